"""What TLS between Envoy and `warmfleet epp` costs: the picker's and Envoy's CPU per request, TLS vs h2c.

    python -P bench/epp_tls.py [--requests 200] [--rounds 3] [--model DIR] [--envoy PATH]

One tiny `warmfleet serve` replica; per round, two pickers on it (TLS with the self-signed certificate, the
default; `--no-secure-serving`), each behind its own Envoy from `warmfleet envoy-bootstrap`'s builder
(`epp_tls` on or off), measured in turn (interleaved, so they share the machine's load): `--requests`
streamed chat requests one after another (`max_tokens` 4, usage included), CPU seconds (utime + stime of
/proc/PID/stat) of the picker and of Envoy from before the first request to after the last answer. Prints one
JSON line: per mode the median over rounds of CPU ms per request (picker, Envoy, both) and the TLS overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from warmfleet.livefleet import Envoy, Epp, Replica
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

MODES = {"tls": ((), True), "h2c": (("--no-secure-serving",), False)}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(url: str, n: int) -> None:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            msgs = [{"role": "user", "content": f"Request {i % 20}: what does a gateway do?"}]
            with c.stream("POST", url + "/v1/chat/completions", json={**body, "messages": msgs}) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
                for _ in r.iter_lines():
                    pass


def measure(front: tuple, n: int) -> dict:
    epp, envoy = front
    run(envoy.url, 5)  # warm: connections, the first pick's render
    before = (cpu_s(epp.popen.pid), cpu_s(envoy.popen.pid))
    run(envoy.url, n)
    after = (cpu_s(epp.popen.pid), cpu_s(envoy.popen.pid))
    picker, gw = ((a - b) * 1000 / n for a, b in zip(after, before))
    return {"picker_ms": picker, "envoy_ms": gw, "tier_ms": picker + gw}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="Checkpoint dir (default: a tiny one made here).")
    ap.add_argument("--envoy", default=os.environ.get("WARMFLEET_ENVOY"), help="Envoy binary ($WARMFLEET_ENVOY).")
    args = ap.parse_args()
    if not args.envoy:
        ap.error("give --envoy or WARMFLEET_ENVOY (scripts/envoy-env.sh prints it)")
    cwd = Path(tempfile.mkdtemp(prefix="epp-tls-"))
    model = Path(args.model) if args.model else None
    if model is None:
        from warmfleet.server.tiny_checkpoints.text import make_tiny_model
        model = make_tiny_model(cwd / "tiny", arch="qwen2", size="tiny", seed=0)
    replica = Replica("r0", model, cwd)
    procs: list = [replica]
    fronts = {}
    try:
        replica.start()
        replica.wait_ready()
        for mode, (flags, tls) in MODES.items():
            epp = Epp(model, [replica], cwd, flags)
            epp.name = f"epp-{mode}"
            procs.append(epp.start())
            epp.wait_synced()
            envoy = Envoy(args.envoy, GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{replica.port}"],
                                                    epp_tls=tls), cwd, name=f"envoy-{mode}")
            procs.append(envoy.start())
            envoy.wait_ready(others=(epp,))
            fronts[mode] = (epp, envoy)
        rounds = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, front in fronts.items():
                rounds[mode].append(measure(front, args.requests))
        out = {mode: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for mode, rs in rounds.items()}
        out["tls_overhead_tier_pct"] = round(100 * (out["tls"]["tier_ms"] / out["h2c"]["tier_ms"] - 1), 1)
        out["tls_overhead_picker_pct"] = round(100 * (out["tls"]["picker_ms"] / out["h2c"]["picker_ms"] - 1), 1)
        out.update(requests=args.requests, rounds=args.rounds, load_avg=os.getloadavg()[0])
        print(json.dumps(out))
    finally:
        for p in reversed(procs):
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
