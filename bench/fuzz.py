"""Fuzz every HTTP surface of a replica and a router: schemathesis cases from their OpenAPI schemas plus a hand corpus.

    python bench/fuzz.py [--examples N] [--json] [--model DIR] [--out FILE]

Starts one real `warmfleet serve` of the tiny Qwen2-VL checkpoint (images and text; made on first
run under ~/.cache/warmfleet/models) with a 512-token context and one `warmfleet route` in front
of it, on loopback. For each server: `--examples` schemathesis cases per operation and generation
mode (valid and invalid data; request bodies from server/api/protocol.py's models, see
bench/fuzzing.py), then the hand corpus (truncated/corrupt images, a 400-megapixel
decompression bomb, HTML as an image, invalid UTF-8, lone surrogates, 100000-deep JSON, huge
numbers, 5000 content parts, a prompt one token over the context, file:// and gopher:// URLs).

Reports (JSON, the last stdout line with --json): cases and statuses per server, every failure (a
5xx, no answer within 60 s, a 4xx that is not OpenAI-shaped, a hostile request accepted), the
hand corpus's answer per case, the slowest answer, and RSS / peak RSS (VmHWM) of the replica's
processes and the router before and after. `targets`: no_5xx, no_hang, errors_openai_shaped,
memory_bounded (replica API peak RSS under 1.5 GiB; the bomb must not be decoded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from warmfleet.livefleet import LiveFleet

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

fuzzing = harness.sibling("fuzzing")

MAX_MODEL_LEN = 512
MEMORY_BOUND_MIB = 1536


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=150, help="schemathesis cases per operation and mode (valid, invalid)")
    ap.add_argument("--model", help="a Qwen2-VL checkpoint directory (default: the tiny one, made on first run)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line last")
    ap.add_argument("--out", help="also write the JSON report to this file")
    args = ap.parse_args()

    t0 = time.monotonic()
    model = harness.model_dir(args.model, "tiny", "qwen2_vl")
    fleet = LiveFleet(model, Path(tempfile.mkdtemp(prefix="warmfleet-fuzz-")), n=1,
                      replica_args=("--max-model-len", str(MAX_MODEL_LEN)))
    fleet.start()
    report: dict = {"examples_per_operation_and_mode": args.examples, "servers": {}}
    try:
        rep = fleet.replicas[0]
        before = {"replica": fuzzing.memory_mib(rep.popen.pid), "router": fuzzing.memory_mib(fleet.router.popen.pid)}
        for name, url in (("replica", rep.url), ("router", fleet.router.url)):
            v = fuzzing.run_schema_cases(url, args.examples)
            n_schema = v.cases
            v = fuzzing.run_hand_corpus(url, MAX_MODEL_LEN, verdicts=v)
            alive = rep.alive() and fleet.router.alive()
            report["servers"][name] = {
                "schema_cases": n_schema, "hand_cases": v.cases - n_schema, "by_status": v.by_status,
                "failures": v.failures[:50], "num_failures": len(v.failures), "slowest_s": round(v.slowest_s, 3),
                "hand_corpus": {k: {"status": s, "message": m, "seconds": t} for k, (s, m, t) in v.by_case.items()},
                "processes_alive_after": alive}
            print(f"[fuzz] {name}: {v.cases} cases, {v.by_status}, {len(v.failures)} failures", file=sys.stderr)
        after = {"replica": fuzzing.memory_mib(rep.popen.pid), "router": fuzzing.memory_mib(fleet.router.popen.pid)}
        report["memory_mib"] = {"before": before, "after": after}
    finally:
        fleet.close()
    servers = report["servers"].values()
    statuses = [k for s in servers for k in s["by_status"]]
    peak_api = report["memory_mib"]["after"]["replica"].get("api", {}).get("peak", 0)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["targets"] = {
        "no_5xx": not any(k.isdigit() and int(k) >= 500 for k in statuses),
        "no_hang": not any(not k.isdigit() for k in statuses) and all(s["processes_alive_after"] for s in servers),
        "errors_openai_shaped": not any("OpenAI-shaped" in f or "without an error message" in f
                                        for s in servers for f in s["failures"]),
        "hostile_requests_refused": not any("accepted (200)" in f for s in servers for f in s["failures"]),
        "memory_bounded": peak_api < MEMORY_BOUND_MIB,
    }
    text = json.dumps(report, indent=None if args.json else 2)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(text)
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
