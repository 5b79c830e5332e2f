"""Packaging and CLI: the operator/ folder never shadows the stdlib; bad flags exit 2 with one line."""

import subprocess
import sys

import pytest


def test_stdlib_operator_is_not_shadowed(tmp_path):
    """In a fresh interpreter (this one imported the stdlib module long ago), importing warmfleet.operator
    first must leave `import operator` to the standard library."""
    code = ("import warmfleet.operator, operator, sysconfig; "
            "assert warmfleet.operator.__name__ == 'warmfleet.operator'; "
            "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__; "
            "assert callable(operator.itemgetter)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _cli(*args):
    return subprocess.run([sys.executable, "-P", "-m", "warmfleet.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["serve", "--model", "/nonexistent", "--block-size", "48"], "--block-size must be a power of two"),
    (["serve", "--model", "/nonexistent", "--swap-space", "-1"], "--swap-space"),
    (["serve", "--model", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["serve", "--model", "/nonexistent", "--attention-backend", "flash-nope"],
     "unknown --attention-backend 'flash-nope'; registered backends: cpu"),
])
def test_bad_serve_flags_exit_2_with_one_line(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_unknown_flag_is_an_argparse_error():
    r = _cli("serve", "--model", "x", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_config_round_trips_through_rendered_args():
    import argparse

    from warmfleet.server.config import CacheConfig, EngineConfig, ModelConfig, add_arguments, from_namespace, to_args

    cfg = EngineConfig(ModelConfig(model="/m", served_model_name="m"),
                       CacheConfig(swap_space=12.5, max_encoder_cache=8192, enable_prefix_caching=False))
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert from_namespace(p.parse_args(to_args(cfg))) == cfg


def test_version_and_doctor(capsys):
    from warmfleet.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("warmfleet ")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warmfleet ") and all(line.split()[0] in ("ok", "warn", "fail") for line in out[1:])
    assert any(line.startswith("ok   python:") for line in out)
    # caches that cannot fit this machine's memory: one failing line naming what to change, exit 1
    assert main(["doctor", "--kv-cache-memory", "1000000"]) == 1
    captured = capsys.readouterr()
    assert any(line.startswith("fail memory:") and "lower the caches" in line for line in captured.out.splitlines())
    assert "1 check(s) failed: memory" in captured.err
