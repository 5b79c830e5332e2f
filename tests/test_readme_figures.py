"""scripts/readme_figures.py: README's figures table is what the committed bench JSON gives, and rewriting is stable."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["readme_figures"] = mod
    spec.loader.exec_module(mod)
    return mod


rf = _load()


def stored(name: str, result: dict) -> dict:
    return {"bench": name, "command": f".venv/bin/python bench/{name}.py --quick --json", "date": "2026-01-02",
            "started_utc": "2026-01-02T03:04:05Z", "duration_s": 125, "commit": "abc1234",
            "machine": {"cpu": "Test CPU", "cpus_usable": 2, "memory_gib": 8.0, "system": "Linux", "python": "3.11"},
            "result": result}


PREFIX = {"ttft_miss_s": 0.69, "hit_over_miss": 0.058, "swap_hit_over_miss": 0.31, "prefix_tokens": 2048,
          "cached_tokens_swap_hit_cpu": 2048, "decode_tok_s_batch1": 141.2, "decode_tok_s_batch16": 805.0,
          "decode_tok_s_batch64": 1234.5, "transformers_decode_tok_s_batch1": None,
          "transformers_decode_tok_s_batch16": None,
          "targets": {"hit_over_miss_le_0.10": True, "swap_hit_over_miss_le_0.25": False, "swap_hits_from_cpu": True}}
ROUTING = {
    "targets": {"churn_no_client_errors": True, "churn_unrouted_le_1s": True, "added_latency_p50_le_2ms": False,
                "brand_new_check": True},
    "warmfleet_churn": {"client_errors": 0, "s_until_dead_replica_unrouted": 0.16},
    "warmfleet_latency": {"added_p50_ms": 2.5},
    "text": {"oracle_cached_ratio": 0.877,
             "routers": {"rr": {"cached_ratio": 0.3, "ttft_p90_s": 2.0, "spread": 1.0},
                         "sglang": {"cached_ratio": 0.679, "ttft_p90_s": 1.0, "spread": 1.6},
                         "warmfleet": {"cached_ratio": 0.785, "ttft_p90_s": 0.51, "spread": 1.12}},
             "targets": {"ratio_vs_oracle": 0.895, "ratio_ok_oracle": False, "spread_ok": True,
                         "ratio_minus_best_peer": 0.106, "ratio_ok_peer": False, "ttft_p90_vs_best_peer": 0.51,
                         "ttft_ok": True}},
    "images": None,
}
README = "# x\n\n## Benchmarks\n\nintro\n\n" + rf.FIGURES_BEGIN + "\nold | table\n" + rf.FIGURES_END + "\n\n## Next\n"


def rows_of(text: str) -> dict:
    """figure -> (value, target, met) of the generated table in `text`."""
    block = text[text.index(rf.FIGURES_BEGIN):text.index(rf.FIGURES_END)]
    cells = [line.strip("|").split(" | ") for line in block.splitlines() if line.startswith("| ")]
    return {c[0].strip(): tuple(x.strip() for x in c[1:]) for c in cells[1:]}


def test_rewrite_replaces_only_the_block_and_is_idempotent():
    data = {"prefix_cache": stored("prefix_cache", PREFIX), "routing": stored("routing", ROUTING)}
    once = rf.rewrite(README, data)
    assert once.startswith("# x\n\n## Benchmarks\n\nintro\n\n") and once.endswith("\n\n## Next\n")
    assert "old | table" not in once
    assert rf.rewrite(once, data) == once
    assert rf.rewrite(rf.rewrite(once, {}), data) == once  # back from an empty table too


def test_rows_are_the_json_figures_with_their_targets():
    rows = rows_of(rf.rewrite(README, {"prefix_cache": stored("prefix_cache", PREFIX),
                                       "routing": stored("routing", ROUTING)}))
    assert rows["TTFT 2,048-token prefix hit ÷ miss (0.69 s cold)"] == ("0.058", "≤ 0.10", "yes")
    assert rows["TTFT swap-tier (CPU) hit ÷ miss"] == ("0.31", "≤ 0.25", "**no**")
    assert rows["decode tok/s, batch 1 / 16 / 64"] == ("141 / 805 / 1,234", "", "")
    assert not any("transformers" in k for k in rows)  # null in the JSON: no row
    assert rows["routing, text: cached-token ratio, warmfleet (oracle 0.877)"] == \
        ("0.785 (0.895 × oracle)", "≥ 0.9 × oracle", "**no**")
    assert rows["routing, text: cached-token ratio, warmfleet − best peer (SGLang 0.679)"] == \
        ("+0.106", "≥ +0.15", "**no**")
    assert rows["routing, text: TTFT p90 warmfleet ÷ best peer (0.51 s)"] == ("0.51", "≤ 0.6", "yes")
    assert rows["routing: churn (replica killed mid-run): client errors, s until unrouted"] == \
        ("0, 0.16", "0, ≤ 1", "yes")
    assert rows["router-added latency p50 (ms)"] == ("2.5", "≤ 2", "**no**")
    assert rows["routing: `brand_new_check`"] == ("", "", "yes")  # a target no row knows is still shown
    assert not any(k.startswith("routing, images") for k in rows)  # no image workload in this JSON
    assert not any("mm_hash" in k for k in rows)  # no multimodal file


def test_missing_figures_and_targets_give_no_row_or_a_dash():
    partial = copy.deepcopy(PREFIX)
    del partial["swap_hit_over_miss"], partial["targets"]["hit_over_miss_le_0.10"]
    rows = rows_of(rf.rewrite(README, {"prefix_cache": stored("prefix_cache", partial)}))
    assert not any(k.startswith("TTFT swap-tier") for k in rows)
    assert rows["TTFT 2,048-token prefix hit ÷ miss (0.69 s cold)"][2] == "—"


def test_footer_names_the_command_the_date_and_the_machine():
    text = rf.rewrite(README, {"routing": stored("routing", ROUTING)})
    assert "Measured on 2026-01-02 by `.venv/bin/python scripts/readme_figures.py --run`" in text
    assert "`bench/routing.py --quick --json` (2 min)" in text and "at commit abc1234" in text
    assert "2 usable cores (Test CPU, 8.0 GiB" in text
    two = rf.rewrite(README, {"routing": stored("routing", ROUTING),
                              "multimodal": {**stored("multimodal", {}), "date": "2026-01-03", "duration_s": 40}})
    assert "Measured from 2026-01-02 to 2026-01-03" in two and "`bench/multimodal.py --quick --json` (40 s, 2026-01-03)" in two


def test_no_markers_is_an_error():
    with pytest.raises(ValueError):
        rf.rewrite("# no table here\n", {})


def test_committed_json_is_complete_and_says_when_and_where():
    data = rf.load_results()
    assert set(data) == set(rf.BENCHES), f"missing {set(rf.BENCHES) - set(data)} in bench/results/readme/"
    for name, s in data.items():
        assert s["bench"] == name and s["command"].endswith(" ".join(rf.BENCHES[name]))
        assert s["date"] and s["machine"]["cpu"] and s["machine"]["cpus_usable"] >= 1
        assert isinstance(s["result"].get("targets"), dict) and s["result"]["targets"], name
        assert all(isinstance(v, bool) for v in rf.target_booleans(s["result"]).values())


def test_readme_table_is_what_the_committed_json_gives():
    readme = (ROOT / "README.md").read_text()
    assert rf.rewrite(readme, rf.load_results()) == readme, \
        "README.md's figures table is stale: run .venv/bin/python scripts/readme_figures.py"
    assert rf.main(["--check"]) == 0


def test_check_reports_a_stale_table(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    results = tmp_path / "results"
    results.mkdir()
    (results / "routing.json").write_text(json.dumps(stored("routing", ROUTING)))
    monkeypatch.setattr(rf, "README", readme)
    monkeypatch.setattr(rf, "RESULTS", results)
    assert rf.main(["--check"]) == 1 and readme.read_text() == README
    assert rf.main([]) == 0 and rf.main(["--check"]) == 0
    assert "router-added latency p50 (ms)" in readme.read_text()
