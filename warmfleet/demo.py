"""`warmfleet demo`: a local fleet (replicas + router) on a tiny checkpoint made on first run; no cluster."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from warmfleet.livefleet import NodeTier, Proc, wait_http
from warmfleet.localprocs import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Checkpoint directory (default: a tiny Qwen2 made on first run).")
    p.add_argument("--replicas", type=int, default=2, help="Number of local replicas.")
    p.add_argument("--port", type=int, default=8000, help="Router port: the OpenAI endpoint.")
    p.add_argument("--once", action="store_true", help="Send the sample conversation, print the figures, and exit.")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="Seconds to wait for every process.")
    p.add_argument("--verbose", action="store_true",
                   help="Show the replicas' and the router's logs on this console (default: files under --log-dir).")
    p.add_argument("--node-tier-gib", type=float, default=0.0,
                   help="Run one node tier of this many GiB shared by the replicas (`warmfleet node-tier`, as on one "
                   "node); it replaces their swap tiers and the router follows its events. 0 (default): none.")
    p.add_argument("--log-dir", default=None,
                   help="Where replica and router logs go (default: ~/.cache/warmfleet/demo-logs).")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _wait_ready(proc: Proc, url: str, what: str, deadline: float) -> None:
    try:
        wait_http(url, f"{what} ready at {url}", [proc], max(0.0, deadline - time.monotonic()), poll_s=0.2)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n(see {proc.log_path}, or raise --startup-timeout-s)") from None


def _chat(base: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": "tiny-qwen2", "messages": messages, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()) | {"replica": r.headers.get("x-warmfleet-replica")}


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def default_model() -> Path:
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / "tiny-qwen2"
    if not (out / "config.json").exists():
        _say(f"writing a tiny random Qwen2 checkpoint to {out}")
        make_tiny_model(out, arch="qwen2", size="tiny", seed=0)
    return out


def start_node_tier(gib: float, log_dir: Path, env: dict, console: bool, deadline: float) -> NodeTier:
    """`warmfleet node-tier` of `gib` GiB on loopback (node name "local"), listening."""
    nt = NodeTier(log_dir, "local", int(gib * (1 << 30)))
    nt.env, nt.console = env, console
    nt.log_path.unlink(missing_ok=True)
    nt.start()
    try:
        nt.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        nt.stop()
        raise
    _say(f"node tier up: {gib:g} GiB at {nt.address}, events at {nt.events}")
    return nt


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.node_tier_gib < 0:
        raise ValueError("--node-tier-gib must be >= 0")
    model = (Path(args.model) if args.model else default_model()).resolve()
    log_dir = Path(args.log_dir or Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet"))
                   / "demo-logs").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WARMFLEET_LOG_FORMAT=os.environ.get("WARMFLEET_LOG_FORMAT", "text"))
    procs: list[Proc] = []

    def start(name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, log_dir, env=env, console=args.verbose)
        proc.log_path.unlink(missing_ok=True)  # this run's log only
        procs.append(proc.start())
        return proc

    deadline = time.monotonic() + args.startup_timeout_s
    try:
        node = None
        if args.node_tier_gib > 0:
            node = start_node_tier(args.node_tier_gib, log_dir, env, args.verbose, deadline)
            procs.append(node)
        host_tier = list(node.replica_args()) if node else ["--swap-space", "0.05"]
        replicas = []
        _say(f"starting {args.replicas} replicas and the router on {model} "
             f"({'logs on this console' if args.verbose else f'logs in {log_dir}'})")
        for i in range(args.replicas):
            port, events = free_port(), free_port()
            start(f"replica-{i}", [
                "serve", "--model", str(model), "--served-model-name", "tiny-qwen2", "--port", str(port),
                "--kv-events-port", str(events), "--replica-id", f"replica-{i}", "--block-size", "16",
                "--kv-cache-memory", "0.05", *host_tier])
            replicas.append((f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}"))
        for (url, _), p in zip(replicas, [p for p in procs if p is not node]):
            _wait_ready(p, f"{url}/ready", p.name, deadline)
        router_args = ["route", "--model", str(model), "--port", str(args.port), "--block-size", "16"]
        for url, events in replicas:
            router_args += ["--replica", f"{url},events={events}"]
        if node is not None:
            router_args += ["--node-tier-events", node.events]
        router = start("router", router_args)
        base = f"http://127.0.0.1:{args.port}"
        _wait_ready(router, f"{base}/ready", "the router", deadline)
        names = {url: f"replica-{i}" for i, (url, _) in enumerate(replicas)}
        _say(f"fleet up: OpenAI endpoint {base}/v1 (model 'tiny-qwen2', {args.replicas} replicas)")

        system = {"role": "system", "content": "You are a helpful assistant. " * 12}
        for q in ("What is a prefix cache?", "And why route by it?"):
            r = _chat(base, [system, {"role": "user", "content": q}])
            u = r["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            _say(f"{q!r} -> {names.get(r['replica'], r['replica'])}: {u['prompt_tokens']} prompt tokens, "
                 f"{cached} from cache")
        if args.once:
            return 0
        _say(f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
             "-d '{\"model\":\"tiny-qwen2\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
        _say(f"which replica holds what: curl {base}/v1/router/replicas")
        _say("Ctrl-C stops the fleet.")
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(3600)
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=10)
