"""Packaging and CLI: what the wheel and sdist hold, the version, the checkout root shadows nothing of the stdlib; bad flags exit 2 with one line."""

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml


def test_stdlib_operator_is_not_shadowed(tmp_path):
    """In a fresh interpreter (this one imported the stdlib module long ago), importing warmfleet.operator
    first must leave `import operator` to the standard library."""
    code = ("import warmfleet.operator, operator, sysconfig; "
            "assert warmfleet.operator.__name__ == 'warmfleet.operator'; "
            "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__; "
            "assert callable(operator.itemgetter)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_checkout_root_shadows_nothing():
    """From the checkout's root (sys.path[0] is the root), even without `site`, `import operator` is the standard
    library's: operator/ is no package there, only the folder of warmfleet.operator's rooms."""
    code = "import operator, sysconfig; print(operator.__file__); print(sysconfig.get_paths()['stdlib'])"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found, stdlib = proc.stdout.split()
    assert found.startswith(stdlib) and not found.startswith(str(REPO)), found


def test_pytest_runs_from_the_checkout_root():
    """`python -m pytest` from the root (no -P): the root on sys.path shadows no module the tests import."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layering.py",
                           "-k", "circle or downward"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


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


REPO = Path(__file__).resolve().parents[1]
# folder in the checkout -> import name in the wheel (setup.py's mapping)
PACKAGE_FOLDERS = {"warmfleet": "warmfleet", "server": "warmfleet/server", "operator": "warmfleet/operator"}


def _tracked_package_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *PACKAGE_FOLDERS], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert any(f.endswith(".c") for f in out) and any(f.endswith(".jinja") for f in out), out
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, set[str]]:
    """The sdist, and the wheel built from it (what `python -m build` and PyPI users get): their file lists."""
    dist = tmp_path_factory.mktemp("dist")
    # the checkout may hold build/ leftovers of other builds: build from a copy of the tracked files that make it
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", "--", ":(top,glob)*", *PACKAGE_FOLDERS], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "would be ignored" not in proc.stdout + proc.stderr, "setuptools skipped a data folder"
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    with tarfile.open(sdist) as tf:
        sdist_names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    with zipfile.ZipFile(wheel) as zf:
        wheel_names = set(zf.namelist())
    return {"sdist": sdist_names, "wheel": wheel_names}


def test_wheel_and_sdist_hold_every_tracked_package_file(built):
    missing_wheel, missing_sdist = [], []
    for rel in _tracked_package_files():
        folder, rest = rel.split("/", 1)
        if f"{PACKAGE_FOLDERS[folder]}/{rest}" not in built["wheel"]:
            missing_wheel.append(rel)
        if rel not in built["sdist"]:
            missing_sdist.append(rel)
    assert not missing_wheel, f"not in the wheel: {missing_wheel}"
    assert not missing_sdist, f"not in the sdist: {missing_sdist}"
    # every console script's module ships, and nothing of the checkout that is not a package leaks in
    assert {"warmfleet/cli.py", "warmfleet/server/router/core/engines/vllm.py"} <= built["wheel"]
    # the operator's rooms land under warmfleet/operator/, beside the package's own __init__.py
    rooms = sorted(p.name for p in (REPO / "operator").iterdir() if (p / "__init__.py").is_file())
    assert rooms == ["passes", "planning", "spec", "wiring"], rooms
    assert {"warmfleet/operator/__init__.py", *(f"warmfleet/operator/{r}/__init__.py" for r in rooms),
            "warmfleet/operator/wiring/command.py", "warmfleet/operator/planning/children.py"} <= built["wheel"]
    assert not [n for n in built["wheel"] if n.startswith(("tests/", "server/", "operator/", "bench/"))]


def test_version_comes_from_the_installed_metadata_and_the_chart_agrees():
    from importlib.metadata import version

    with open(REPO / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    chart = yaml.safe_load((REPO / "charts/warmfleet/Chart.yaml").read_text())
    assert version("warmfleet") == declared, "reinstall: the installed metadata is older than pyproject.toml"
    assert chart["appVersion"] == declared, "charts/warmfleet/Chart.yaml appVersion must equal the package version"
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"warmfleet {declared}", r.stdout + r.stderr


def test_dockerfile_builds_both_images_from_the_wheel_with_the_image_steps(built):
    """The two targets the chart names run scripts/image-steps.sh on a wheel built from what the sdist holds."""
    text = (REPO / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, flags=re.M | re.S))
    assert {"wheel", "engine", "slim"} <= set(stages), sorted(stages)
    copied = {src for line in re.findall(r"^COPY (?!--from)(.+)$", stages["wheel"], flags=re.M)
              for src in line.split()[:-1]}
    # what the sdist holds at its top, less what setuptools generates
    sdist_top = {n.split("/", 1)[0] for n in built["sdist"] if n} - {"PKG-INFO", "setup.cfg", "warmfleet.egg-info"}
    copied = {c.rstrip("/") for c in copied}
    assert sdist_top <= copied, f"the wheel stage does not copy {sorted(sdist_top - copied)}"
    for target in ("engine", "slim"):
        assert re.search(rf"warmfleet-image-steps {target} /dist", stages[target]), target
        assert re.search(r"^USER 10001", stages[target], flags=re.M), f"{target} runs as root"
    slim_steps = [ln for ln in stages["slim"].splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in slim_steps if "paddle" in ln.lower()], "the slim image installs no Paddle"
