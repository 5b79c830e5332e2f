"""--engine-cpus: the engine-core process (every thread) runs on the listed CPUs, the API process stays unpinned."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from warmfleet.localprocs import free_port
from warmfleet.livefleet import EXE, STARTUP_S, tree_pids, wait_for
from warmfleet.server.config import EngineConfig, ModelConfig, parse_cpu_list


@pytest.mark.parametrize("spec, cpus", [("0", {0}), ("0-3", {0, 1, 2, 3}), ("1,3-4", {1, 3, 4}), (" 2 , 0", {0, 2})])
def test_cpu_lists_parse_like_taskset(spec, cpus):
    assert parse_cpu_list(spec) == cpus


@pytest.mark.parametrize("spec", ["", "a", "3-1", "0-", "-1", "0,,1", "1.5"])
def test_a_bad_cpu_list_is_a_config_error_that_names_the_flag(spec):
    with pytest.raises(ValueError, match="--engine-cpus"):
        EngineConfig(ModelConfig(model="/m", engine_cpus=spec)).validate()


def _affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of a process."""
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _start(model_dir: Path, cwd: Path, port: int, cpus: str) -> subprocess.Popen:
    cmd = EXE + ["serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                 "--block-size", "16", "--num-gpu-blocks", "64", "--engine-cpus", cpus, "--log-level", "info"]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_engine_core_runs_on_the_listed_cpu_and_the_api_process_does_not(tiny_model_dir, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.fail(f"this test needs two usable CPUs to tell pinned from unpinned, has {allowed}")
    cpu = allowed[-1]
    port = free_port()
    proc = _start(tiny_model_dir, tmp_path, port, str(cpu))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            wait_for(lambda: http.get("/ready").status_code == 200, "the server ready", [proc], STARTUP_S, poll_s=0.5)
            r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                                   "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        core = [p for p in tree_pids(proc.pid) if p != proc.pid]
        assert len(core) == 1, core
        assert _affinities(core[0]) == {frozenset({cpu})}
        assert frozenset(allowed) in _affinities(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_cpus_this_machine_lacks_stop_the_server_with_a_reason(tiny_model_dir, tmp_path):
    proc = _start(tiny_model_dir, tmp_path, free_port(), "4000")
    try:
        _, err = proc.communicate(timeout=STARTUP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "--engine-cpus 4000: cannot run on those CPUs" in err, err[-2000:]


def test_tuned_malloc_serves_large_blocks_from_the_heap():
    """A 64 MiB block (a prefill's MLP activations are 40 MB on Qwen2.5-0.5B) comes from the heap, not a fresh mmap."""
    import sys

    probe = """
import ctypes, sys
from warmfleet.server.cpu_math import process_setup as cpu
if sys.argv[1] == "tuned":
    assert cpu.tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(64 << 20)
heap = [l.split()[0] for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-"))
print(lo <= p < hi)
"""
    out = {mode: subprocess.run([sys.executable, "-P", "-c", probe, mode], capture_output=True, text=True,
                                check=True).stdout.strip() for mode in ("tuned", "default")}
    assert out == {"tuned": "True", "default": "False"}
