"""Multimodal micro-benchmarks (image hashing, processor cache); prints one JSON object as its last line.

    python bench/multimodal.py [--quick] --json

hash_gbps: warmfleet's mm_hash (blake3 over raw bytes + params) on a 4-megapixel JPEG and PNG;
baseline_gbps: FastDeploy's recipe (decode, preprocess, SHA-256 over the pixel array), both in
raw-input GB/s. processor_hit_over_miss: processor-cache GET of a 1-megapixel JPEG's pixels over
decoding + preprocessing it (processor_hit_read_over_miss: the GET plus one pass over the pixels). ttft_image_hit_over_miss: TTFT of a repeated request (same text
prefix, same image, new question) over a cold one on the bench VL checkpoint (engine in-process,
processor cache included); ttft_encoder_hit_over_miss: the same with the prefix cache off, so only
the encoder (and processor) caches are warm. `targets`: one boolean per figure (target met),
`target_values`: the thresholds.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image

from warmfleet.server.hashing import mm_hash
from warmfleet.server.multimodal.media import decode_image
from warmfleet.server.multimodal.processor import ImageProcessor
from warmfleet.server.multimodal.processor_cache import ProcessorCacheClient, ProcessorCacheProcess

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, after the stdlib
import harness  # noqa: E402


# figure -> target: hash_speedup at least this, the hit/miss ratios at most these
TARGETS = {"hash_speedup": 5.0, "processor_hit_over_miss": 0.05, "ttft_image_hit_over_miss": 0.15,
           "ttft_encoder_hit_over_miss": 0.5}


def photo_bytes(w: int, h: int, fmt: str, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([xx / w * 255, yy / h * 255, (np.sin(xx / 40) + 1) * 127], -1) + rng.normal(0, 6, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hash(proc: ImageProcessor, repeats: int) -> dict:
    out = {}
    params = proc.hash_params()
    for fmt in ("JPEG", "PNG"):
        data = photo_bytes(2304, 1728, fmt)  # ~4 megapixels
        ours = median_time(lambda: mm_hash(data, params=params), repeats)

        def baseline():
            pv = proc(decode_image(data, "bench", 1 << 30)).pixel_values
            hashlib.sha256(pv.tobytes()).hexdigest()

        base = median_time(baseline, max(1, repeats // 5))
        out[fmt.lower()] = {"bytes": len(data), "hash_gbps": len(data) / ours / 1e9,
                            "baseline_gbps": len(data) / base / 1e9, "ratio": base / ours}
    return out


def bench_processor_cache(proc: ImageProcessor, repeats: int) -> dict:
    data = photo_bytes(1152, 864, "JPEG", seed=1)  # ~1 megapixel
    key = mm_hash(data, params=proc.hash_params())
    address = f"ipc://{tempfile.mkdtemp()}/bench-pc.sock"
    server = ProcessorCacheProcess(address, 1 << 30).start()
    client = ProcessorCacheClient(address, timeout_s=5.0)
    try:
        for _ in range(60):
            if client.ping(1.0):
                break
        miss = median_time(lambda: proc(decode_image(data, "bench", 1 << 30)), repeats)
        client.put(key, proc(decode_image(data, "bench", 1 << 30)))
        assert client.get(key) is not None, "processor cache did not store the item"
        hit = median_time(lambda: client.get(key), repeats * 4)
        # the same hit, then one pass over every pixel (what handing them to the engine costs at least)
        hit_read = median_time(lambda: float(client.get(key).pixel_values.sum()), repeats * 4)
        nbytes = client.get(key).pixel_values.nbytes
    finally:
        client.close()
        server.stop()
    return {"miss_s": miss, "hit_s": hit, "hit_read_s": hit_read, "pixel_bytes": nbytes,
            "processor_hit_over_miss": hit / miss, "processor_hit_read_over_miss": hit_read / miss}


_progress = harness.reporter("bench")


def bench_ttft(quick: bool) -> dict:
    """TTFT of image requests, cold vs warm caches, on the bench VL checkpoint (made on first run)."""
    import base64
    from pathlib import Path

    from warmfleet import LLM, SamplingParams
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    model = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / "bench-qwen2-vl"
    if not (model / "config.json").exists():
        _progress(f"writing the bench VL checkpoint to {model}")
        make_tiny_vl_model(model, arch="qwen2_vl", size="bench", seed=0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    system = "You are a careful visual assistant; answer briefly and precisely. " * 24

    def conv(uri: str, question: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": question}]}]

    def ttft(llm, msgs, salt):
        t0 = time.perf_counter()
        out = llm.chat(msgs, sp, cache_salt=salt)[0]
        return time.perf_counter() - t0, out.num_cached_tokens

    runs = 2 if quick else 4
    figures = {}
    for label, caching in (("prefix", True), ("encoder_only", False)):
        _progress(f"TTFT with images, prefix caching {'on' if caching else 'off'} ({runs} runs)")
        llm = LLM(str(model), block_size=64, kv_cache_memory=1.0, enable_prefix_caching=caching,
                  max_num_batched_tokens=8192, max_encoder_cache=16384)
        warm = "data:image/jpeg;base64," + base64.b64encode(photo_bytes(1000, 1000, "JPEG", seed=99)).decode()
        ttft(llm, conv(warm, "warm-up"), "warm-up")
        miss, hit, cached = [], [], []
        for r in range(runs):
            uri = "data:image/jpeg;base64," + base64.b64encode(photo_bytes(1000, 1000, "JPEG", seed=r)).decode()
            t, _ = ttft(llm, conv(uri, "What is in this picture?"), f"run-{r}")
            miss.append(t)
            t, c = ttft(llm, conv(uri, "Which colours dominate?"), f"run-{r}")
            hit.append(t)
            cached.append(c)
            _progress(f"  run {r + 1}/{runs}: miss {miss[-1]:.3f}s hit {hit[-1]:.3f}s cached {c} tokens")
        figures[label] = {"ttft_miss_s": statistics.median(miss), "ttft_hit_s": statistics.median(hit),
                          "ratio": statistics.median(hit) / statistics.median(miss),
                          "cached_tokens": int(statistics.median(cached)),
                          "encoder_cache_hits": llm.stats().encoder_cache_hits}
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    repeats = 5 if args.quick else 20
    proc = ImageProcessor()
    h = bench_hash(proc, repeats)
    pc = bench_processor_cache(proc, repeats)
    ttft = bench_ttft(args.quick)
    result = {
        "hash_gbps": statistics.median(v["hash_gbps"] for v in h.values()),
        "baseline_gbps": statistics.median(v["baseline_gbps"] for v in h.values()),
        "hash_speedup": statistics.median(v["ratio"] for v in h.values()),
        "hash_by_format": h,
        "processor_hit_over_miss": pc["processor_hit_over_miss"],
        "processor_cache": pc,
        "ttft_image_hit_over_miss": round(ttft["prefix"]["ratio"], 4),
        "ttft_encoder_hit_over_miss": round(ttft["encoder_only"]["ratio"], 4),
        "ttft": ttft,
        "target_values": TARGETS,
        "cpu_count": os.cpu_count(),
    }
    # booleans, as the other benches report them: hash_speedup is a floor, the ratios are ceilings
    result["targets"] = {f"{k}_{'ge' if k == 'hash_speedup' else 'le'}_{v:g}":
                         bool(result[k] >= v if k == "hash_speedup" else result[k] <= v) for k, v in TARGETS.items()}
    if not args.json:
        print(json.dumps(result, indent=2), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
