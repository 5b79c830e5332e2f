"""Seconds from a client leaving a non-streaming request to the replica's abort, through `warmfleet route`.

    python bench/disconnect_abort.py [--trials N] [--stream] [--forwarded] [--json] [--model DIR]

Starts one real `warmfleet serve` of the tiny Qwen2 checkpoint (made on first run under ~/.cache/warmfleet/models)
behind one `warmfleet route`, on loopback. Each trial sends a 4000-token generation (`ignore_eos`) through the
router on a raw socket, waits until the replica runs it (`vllm:num_requests_running`), closes the socket and
polls the replica's `vllm:request_success_total{finished_reason="abort"}` every 5 ms until it moves. `--forwarded`
adds `X-Forwarded-For` (the router's ASGI path, as behind an ingress) instead of its hot path. Reports the
seconds per trial and their median and max (JSON, the last stdout line with --json); target: under 1 s.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from warmfleet.livefleet import MODEL_NAME, LiveFleet, metric

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

progress = harness.reporter("disconnect")


def aborted(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=5).text
    return metric(text, "vllm:request_success_total", model_name=MODEL_NAME, finished_reason="abort") or 0.0


def running(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=5).text
    return metric(text, "vllm:num_requests_running", model_name=MODEL_NAME) or 0.0


def trial(router_url: str, replica_url: str, stream: bool, forwarded: bool) -> float:
    """One request left by its client: seconds from the close to the replica's abort."""
    before = aborted(replica_url)
    body = json.dumps({"model": MODEL_NAME, "prompt": "count", "max_tokens": 4000, "ignore_eos": True,
                       "stream": stream})
    port = int(router_url.rsplit(":", 1)[1])
    extra = "x-forwarded-for: 10.1.2.3\r\n" if forwarded else ""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}"
                   f"content-length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 30
        while running(replica_url) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the request never ran on the replica")
            time.sleep(0.005)
        t0 = time.monotonic()
    while aborted(replica_url) < before + 1:
        if time.monotonic() - t0 > 30:
            raise RuntimeError("no abort within 30 s of the client leaving")
        time.sleep(0.005)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--forwarded", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = harness.model_dir(args.model, "tiny", "qwen2")
    fleet = LiveFleet(model, Path(tempfile.mkdtemp(prefix="wf-disconnect-")), n=1).start()
    try:
        secs = []
        for i in range(args.trials):
            secs.append(round(trial(fleet.router.url, fleet.replicas[0].url, args.stream, args.forwarded), 4))
            progress(f"trial {i}: abort {secs[-1]} s after the client left")
    finally:
        fleet.close()
    out = {"command": "python bench/disconnect_abort.py " + " ".join(sys.argv[1:]), "stream": args.stream,
           "forwarded": args.forwarded, "seconds": secs, "median_s": statistics.median(secs), "max_s": max(secs),
           "target_s": 1.0, "met": max(secs) < 1.0}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
