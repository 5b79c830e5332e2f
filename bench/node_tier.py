"""Node-tier benchmark: its copy path (bytes/s, cost per block) and TTFT of a prefix found only there vs cold.

    python -P bench/node_tier.py [--quick] [--json] [--model DIR] [--prefix-tokens 2048] [--runs N]
                                 [--images N] [--vl-model DIR] [--out DIR]

One real `warmfleet node-tier` (loopback TCP, as replicas reach it through a node-local Service) and two engines
in this process (offline `LLM`, the `bench` checkpoint, fp32, block size 64) that share it: replica A and
replica B of one node. Per run a fresh random prefix of --prefix-tokens (+ one 64-token question block):

    cold   B prefills it (a salt nobody used: nothing cached anywhere)
    node   A prefills it (its blocks are written through to the node tier), then B serves it: B's primary pool
           has never held it, so every cached token comes from the node tier (checked: B's node-hit counter
           grows by the cached tokens, and the first token equals the cold run's)

Images (`--images`, the bench qwen2_vl checkpoint; --quick: the tiny one): per run a fresh 224 x 224 image
after a fixed text, then a question. `cold` on a third engine of the same shape without the node tier (so B never
encodes the image itself); `node`: A answers it first, then B, whose KV prefix (the
image's tokens included) and encoder output come from the node tier; `encoder only` (measured before `node`):
B with other text before the same image (same tenant salt: image keys are salted too), so only the encoder output
can come from the node tier.

TTFT = the wall time of a 1-token completion. Runs interleave cold and node; medians are reported with their
ratio, and issue 41's target (node <= 0.25x cold) as a boolean under `targets`. The copy path is measured
beside it: puts and gets of the engine's own block bytes through the client (`put` = queued, sent, committed;
`get` = the longest-prefix lookup a local miss makes, bytes checked), and the engine's block read-out/write-in
(the attention backend's read_blocks / write_blocks). Progress goes to stderr; the last stdout line is one JSON
object (--json); writes node_tier.json and node_tier.png to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

BLOCK_SIZE = 64
progress = harness.reporter("node_tier")
TARGET_RATIO = 0.25


def tokens(rng, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, vocab - 10, size=n)]


def ttft(llm, prompt: list[int], salt: str) -> tuple[float, int, int]:
    from warmfleet import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=salt)[0]
    return time.perf_counter() - t0, out.num_cached_tokens, out.outputs[0].token_ids[0]


def image_chat(text: str, seed: int) -> list[dict]:
    from routing_workload import photo_uri

    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": photo_uri(seed)}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def chat_ttft(llm, msgs: list[dict], salt: str) -> tuple[float, int, int]:
    from warmfleet import SamplingParams

    t0 = time.perf_counter()
    out = llm.chat(msgs, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=salt)[0]
    return time.perf_counter() - t0, out.num_cached_tokens, out.outputs[0].token_ids[0]


def measure_images(model_dir: Path, runs: int, cwd: Path) -> dict:
    """TTFT of an image request whose KV and encoder output sit in the node tier, and of one whose encoder output
    only does, against a cold one (module docstring)."""
    from warmfleet import LLM
    from warmfleet.livefleet import NodeTier

    head = "Look at this photograph carefully and describe every object, colour and shape you can see. " * 4
    nt = NodeTier(cwd, "node-img", capacity_bytes=4 << 30).start()
    try:
        nt.wait_ready()
        kw = dict(block_size=BLOCK_SIZE, num_gpu_blocks=256, node_tier=nt.address, node_tier_timeout_ms=30_000)
        a, b = LLM(str(model_dir), **kw), LLM(str(model_dir), **kw)
        c = LLM(str(model_dir), block_size=BLOCK_SIZE, num_gpu_blocks=256)  # the cold runs: B must not see the image
        for llm in (b, c):
            chat_ttft(llm, image_chat(head, 999), "warm-up")
        cold, node, enc, ok = [], [], [], []
        for r in range(runs):
            t_cold, _, tok_cold = chat_ttft(c, image_chat(head, 1000 + r), f"cold-{r}")
            chat_ttft(a, image_chat(head, 1000 + r), f"node-{r}")
            assert a.engine.node.flush(60.0)
            hits = b.stats().node_encoder_hits
            # the same tenant (an image's key is salted too), other text first: only the encoder output is shared
            t_enc, _, tok_enc = chat_ttft(b, image_chat("Other words first. " + head, 1000 + r), f"node-{r}")
            enc_hit = b.stats().node_encoder_hits - hits
            t_node, c_node, tok_node = chat_ttft(b, image_chat(head, 1000 + r), f"node-{r}")
            progress(f"image run {r}: cold {t_cold * 1e3:.1f} ms, node {t_node * 1e3:.1f} ms ({c_node} cached), "
                     f"encoder only {t_enc * 1e3:.1f} ms ({enc_hit} encoder hit)")
            cold.append(t_cold)
            node.append(t_node)
            enc.append(t_enc)
            ok.append(c_node > 0 and enc_hit == 1 and tok_node == tok_cold)
    finally:
        nt.stop()
    med = statistics.median
    return {"model": str(model_dir), "runs": runs, "ttft_cold_s": cold, "ttft_node_s": node, "ttft_encoder_only_s": enc,
            "ttft_ratio": med(node) / med(cold), "encoder_only_ratio": med(enc) / med(cold), "hits_ok": all(ok)}


def copy_path(llm, address: str, num_blocks: int) -> dict:
    """Bytes/s and microseconds per block of the node tier's put and get, and the engine's read-out and write-in."""
    from warmfleet.server.nodetier.client import NodeTierClient

    eng = llm.engine
    backend, caches, bpb = eng.runner.backend, eng.runner.caches, eng.runner.layout.bytes_per_block
    ids = list(range(min(num_blocks, eng.pool.num_gpu_blocks)))
    n = len(ids)
    reads, writes = [], []
    for _ in range(4):  # the first pass pays page faults: medians of the rest
        t0 = time.perf_counter()
        data = backend.read_blocks(caches, ids, BLOCK_SIZE)
        t1 = time.perf_counter()
        backend.write_blocks(caches, ids, data, BLOCK_SIZE)
        reads.append(t1 - t0)
        writes.append(time.perf_counter() - t1)
    read_s, write_s = statistics.median(reads[1:]), statistics.median(writes[1:])
    client = NodeTierClient(address, timeout_s=30.0)
    keys = [b"bench-copy-%08d" % i + bytes(16) for i in range(n)]
    t0 = time.perf_counter()
    client.put_async([{"kind": "kv", "key": k, "layout": "bench", "data": d} for k, d in zip(keys, data)])
    assert client.flush(120.0)
    put_s = time.perf_counter() - t0
    gets = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = client.get("kv", keys, "bench")
        gets.append(time.perf_counter() - t0)
        assert len(got) == n and got[0] == data[0], "the node tier lost bench blocks (capacity too small?)"
    client.close()
    get_s = statistics.median(gets)
    total = n * bpb
    return {"blocks": n, "bytes_per_block": bpb, "tokens_per_block": BLOCK_SIZE,
            "put_bytes_per_s": total / put_s, "put_us_per_block": put_s / n * 1e6,
            "get_bytes_per_s": total / get_s, "get_us_per_block": get_s / n * 1e6,
            "engine_read_us_per_block": read_s / n * 1e6, "engine_write_us_per_block": write_s / n * 1e6,
            "load_us_per_block": (get_s + write_s) / n * 1e6}


def measure(model_dir: Path, prefix_tokens: int, runs: int, cwd: Path) -> dict:
    from warmfleet import LLM
    from warmfleet.livefleet import NodeTier

    blocks = (prefix_tokens + BLOCK_SIZE) // BLOCK_SIZE + 4
    nt = NodeTier(cwd, capacity_bytes=4 << 30).start()
    try:
        nt.wait_ready()
        kw = dict(block_size=BLOCK_SIZE, num_gpu_blocks=max(blocks, 64), node_tier=nt.address,
                  node_tier_timeout_ms=30_000)
        a, b = LLM(str(model_dir), **kw), LLM(str(model_dir), **kw)
        vocab = a.engine.hf_config.vocab_size if hasattr(a.engine.hf_config, "vocab_size") else 1000
        rng = np.random.default_rng(0)
        ttft(b, tokens(rng, vocab, 2 * BLOCK_SIZE), "warm-up")  # first-call costs out of the runs
        cold, node, ok = [], [], []
        for r in range(runs):
            prompt = tokens(rng, vocab, prefix_tokens + BLOCK_SIZE)
            t_cold, c_cold, tok_cold = ttft(b, prompt, f"cold-{r}")
            assert c_cold == 0
            ttft(a, prompt, f"node-{r}")  # A computes it: written through to the node tier
            assert a.engine.node.flush(60.0)
            before = b.stats().prefix_hits_tokens_node
            t_node, c_node, tok_node = ttft(b, prompt, f"node-{r}")
            from_node = b.stats().prefix_hits_tokens_node - before
            progress(f"run {r}: cold {t_cold * 1e3:.1f} ms, node {t_node * 1e3:.1f} ms ({c_node} cached, "
                     f"{from_node} from the node tier)")
            cold.append(t_cold)
            node.append(t_node)
            ok.append(c_node == from_node == prefix_tokens and tok_node == tok_cold)
        copy = copy_path(a, nt.address, 256)
    finally:
        nt.stop()
    ratio = statistics.median(node) / statistics.median(cold)
    return {"prefix_tokens": prefix_tokens, "runs": runs, "ttft_cold_s": cold, "ttft_node_s": node,
            "ttft_cold_median_s": statistics.median(cold), "ttft_node_median_s": statistics.median(node),
            "ttft_ratio": ratio, "all_hits_from_node_and_same_token": all(ok), "copy_path": copy,
            "targets": {"node_ttft_le_0.25x_cold": ratio <= TARGET_RATIO,
                        "hits_from_node_and_output_equal": all(ok)}}


def chart(res: dict, path: Path) -> None:
    fig, (ax1, ax2) = harness.subplots(2, (11, 4))
    names, values, colors = ["text: cold", "text: node tier"], [res["ttft_cold_median_s"], res["ttft_node_median_s"]], \
        ["#999999", "#2a7ab9"]
    title = f"{res['prefix_tokens']}-token prefix: {res['ttft_ratio']:.2f}x"
    img = res.get("images")
    if img:
        med = statistics.median
        names += ["image: cold", "image: node tier", "image: encoder only"]
        values += [med(img["ttft_cold_s"]), med(img["ttft_node_s"]), med(img["ttft_encoder_only_s"])]
        colors += ["#999999", "#2a7ab9", "#7fb3d5"]
        title += f", image {img['ttft_ratio']:.2f}x"
    ax1.bar(names, [v * 1e3 for v in values], color=colors)
    ax1.set_ylabel("TTFT, ms (median)")
    ax1.tick_params(axis="x", labelsize=7, labelrotation=12)
    ax1.set_title(f"{title} (target <= {TARGET_RATIO})", fontsize=9)
    c = res["copy_path"]
    names = ["engine read-out", "put (TCP)", "get (TCP)", "engine write-in"]
    ax2.bar(names, [c["engine_read_us_per_block"], c["put_us_per_block"], c["get_us_per_block"],
                    c["engine_write_us_per_block"]], color="#2a7ab9")
    ax2.set_ylabel(f"us per block ({c['bytes_per_block'] / 1024:.0f} KiB, {c['tokens_per_block']} tokens)")
    ax2.set_title(f"copy path: get {c['get_bytes_per_s'] / 1e9:.2f} GB/s, put {c['put_bytes_per_s'] / 1e9:.2f} GB/s")
    ax2.tick_params(axis="x", labelsize=8)
    harness.save_figure(fig, path, "warmfleet node tier (loopback TCP, CPU engine, bench checkpoint)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the bench checkpoint, made on first run)")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--images", type=int, default=3, help="image runs (0: none)")
    p.add_argument("--vl-model", help="qwen2_vl checkpoint for the image runs (default: the bench one)")
    p.add_argument("--quick", action="store_true", help="512-token prefix, 2 runs, the tiny VL checkpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.prefix_tokens < BLOCK_SIZE or args.prefix_tokens % BLOCK_SIZE or args.runs < 1:
        p.error(f"--prefix-tokens must be a positive multiple of {BLOCK_SIZE}, --runs >= 1")
    prefix, runs = (512, 2) if args.quick else (args.prefix_tokens, args.runs)
    model = harness.model_dir(args.model, "bench", say=progress)
    with tempfile.TemporaryDirectory() as cwd:
        res = measure(model, prefix, runs, Path(cwd))
        if args.images:
            vl = harness.model_dir(args.vl_model, "tiny" if args.quick else "bench", "qwen2_vl", say=progress)
            res["images"] = measure_images(vl, 2 if args.quick else args.images, Path(cwd))
            res["targets"]["image_node_ttft_le_0.25x_cold"] = res["images"]["ttft_ratio"] <= TARGET_RATIO
            res["targets"]["image_hits_from_node_and_output_equal"] = res["images"]["hits_ok"]
    res["model"] = str(model)
    res["command"] = " ".join(["python", "bench/node_tier.py", *(argv if argv is not None else sys.argv[1:])])
    harness.write_results(Path(args.out), "node_tier", res, chart, progress)
    harness.print_results(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
