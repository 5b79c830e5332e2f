"""Does TTFT reveal another tenant's cache? Tenant B's time to first token on prefixes tenant A warmed vs cold ones.

    python bench/tenant_probe.py [--rounds N] [--prefix-words W] [--json] [--model DIR] [--out FILE]

Starts one real `warmfleet serve` of the bench-size Qwen2 checkpoint (made on first run under
~/.cache/warmfleet/models) behind a `warmfleet route` with two API keys, on loopback. Each round
makes fresh random system prompts (~4 tokens a word), has A send one of them (now cached under A's
salt), then, in random order, measures streamed TTFT of:
  b_on_a_warm  B sending A's warm prefix (what a prober would do),
  b_cold       B sending a prefix nobody sent,
  a_warm       A sending its own warm prefix again (control: a real hit),
  a_cold       A sending a prefix nobody sent (control).
The control shows the probe can see a cache hit; the question is whether b_on_a_warm differs from
b_cold. Test: two-sided Mann-Whitney U with a permutation p-value (20,000 label shuffles, numpy;
no scipy here), and the ratio of medians.

Reports (JSON, the last stdout line with --json; a PNG of the four distributions beside --out):
TTFT median / p10 / p90 per group, cached tokens B saw, U and p for (b_on_a_warm vs b_cold) and for
the control. `targets`: b_sees_no_cached_tokens, b_ttft_indistinguishable (p > 0.01),
control_detects_hits (p < 0.01).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from warmfleet.livefleet import MODEL_NAME, LiveFleet

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

KEY_A, KEY_B = "probe-tenant-a", "probe-tenant-b"
GROUPS = ("b_on_a_warm", "b_cold", "a_warm", "a_cold")


def model_dir(arg: str | None) -> Path:
    return harness.model_dir(arg, "bench", "qwen2")


def ttft(client: httpx.Client, url: str, key: str, system: str, question: str) -> tuple[float, int]:
    """Seconds to the first streamed content chunk, and the cached tokens reported in the final usage."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t0 = time.monotonic()
    first, cached = None, 0
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices"):
                first = time.monotonic() - t0
            if ev.get("usage"):
                cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first if first is not None else time.monotonic() - t0, cached


def mann_whitney(x: list[float], y: list[float], permutations: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """U statistic of x vs y and its two-sided permutation p-value (ties get average ranks)."""
    data = np.asarray(x + y, dtype=float)
    order = data.argsort(kind="mergesort")
    ranks = np.empty(len(data))
    ranks[order] = np.arange(1, len(data) + 1)
    for v in np.unique(data):  # average ranks of ties
        m = data == v
        if m.sum() > 1:
            ranks[m] = ranks[m].mean()
    nx = len(x)

    def u_of(r: np.ndarray) -> np.ndarray:
        return r[..., :nx].sum(axis=-1) - nx * (nx + 1) / 2

    u = float(u_of(ranks))
    centre = nx * len(y) / 2
    rng = np.random.default_rng(seed)
    shuffled = np.stack([rng.permutation(ranks) for _ in range(permutations)])
    extreme = np.abs(u_of(shuffled) - centre) >= abs(u - centre) - 1e-9
    return u, float((extreme.sum() + 1) / (permutations + 1))


def summary(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {"n": len(xs), "median_ms": round(float(np.median(a)) * 1000, 1),
            "p10_ms": round(float(np.quantile(a, 0.1)) * 1000, 1), "p90_ms": round(float(np.quantile(a, 0.9)) * 1000, 1)}


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3000)}" for _ in range(n))


def probe(url: str, rounds: int, prefix_words: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    times: dict[str, list[float]] = {g: [] for g in GROUPS}
    cached: dict[str, list[int]] = {g: [] for g in GROUPS}
    with httpx.Client(timeout=120) as c:
        ttft(c, url, KEY_A, words(rng, prefix_words), "warm up")  # first request pays start-up costs
        for i in range(rounds):
            warm = f"Round {i} tenant A context: " + words(rng, prefix_words)
            ttft(c, url, KEY_A, warm, "first")
            jobs = [("b_on_a_warm", KEY_B, warm), ("a_warm", KEY_A, warm),
                    ("b_cold", KEY_B, f"Round {i} cold B: " + words(rng, prefix_words)),
                    ("a_cold", KEY_A, f"Round {i} cold A: " + words(rng, prefix_words))]
            rng.shuffle(jobs)
            for group, key, system in jobs:
                t, n = ttft(c, url, key, system, f"question {i}")
                times[group].append(t)
                cached[group].append(n)
            print(f"[probe] round {i + 1}/{rounds}: " + ", ".join(f"{g} {times[g][-1] * 1000:.0f} ms" for g in GROUPS),
                  file=sys.stderr, flush=True)
    u, p = mann_whitney(times["b_on_a_warm"], times["b_cold"])
    u_c, p_c = mann_whitney(times["a_warm"], times["a_cold"])
    med = {g: float(np.median(times[g])) for g in GROUPS}
    return {
        "ttft": {g: summary(times[g]) for g in GROUPS},
        "cached_tokens_max": {g: max(cached[g]) for g in GROUPS},
        "b_warm_vs_cold": {"U": u, "p": round(p, 4), "median_ratio": round(med["b_on_a_warm"] / med["b_cold"], 3)},
        "control_a_warm_vs_cold": {"U": u_c, "p": round(p_c, 5), "median_ratio": round(med["a_warm"] / med["a_cold"], 3)},
        "samples_s": times,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([np.asarray(result["samples_s"][g]) * 1000 for g in GROUPS])
    ax.set_xticks(range(1, len(GROUPS) + 1), GROUPS)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"B on A-warm vs B cold: p={result['b_warm_vs_cold']['p']}; "
                 f"control A warm vs cold: p={result['control_a_warm_vs_cold']['p']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds; each gives one sample per group")
    ap.add_argument("--prefix-words", type=int, default=250, help="words per system prompt (~4 tokens a word)")
    ap.add_argument("--model", help="a Qwen2 checkpoint (default: the bench-size one, made on first run)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line last")
    ap.add_argument("--out", help="also write the JSON report here, and the PNG beside it")
    args = ap.parse_args()

    fleet = LiveFleet(model_dir(args.model), Path(tempfile.mkdtemp(prefix="warmfleet-tenant-probe-")), n=1,
                      router_args=("--api-key", KEY_A, "--api-key", KEY_B))
    fleet.start()
    try:
        result = probe(fleet.router.url, args.rounds, args.prefix_words)
    finally:
        fleet.close()
    result["targets"] = {
        "b_sees_no_cached_tokens": result["cached_tokens_max"]["b_on_a_warm"] == 0,
        "b_ttft_indistinguishable": result["b_warm_vs_cold"]["p"] > 0.01,
        "control_detects_hits": result["control_a_warm_vs_cold"]["p"] < 0.01,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        try:
            plot(result, Path(args.out).with_suffix(".png"))
        except ImportError:
            print("[probe] matplotlib not installed: no PNG (pip install 'warmfleet[bench]')", file=sys.stderr)
    shown = {k: v for k, v in result.items() if k != "samples_s"}
    print(json.dumps(shown, indent=None if args.json else 2))
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
