"""Which server package may import which: read from the source (ast), so a wrong edge fails here, not at run time."""

import ast
import subprocess
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "server"


def imported_modules(path):
    """Absolute names (relative to the `warmfleet.server` package) of everything a module imports."""
    package = path.parent.relative_to(SERVER).parts  # e.g. ("models",)
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:  # from ..attention.interface import X
            base = package[:len(package) - (node.level - 1)]
            names.append(".".join([*base, *([node.module] if node.module else [])]))
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def server_imports(path):
    """The `warmfleet.server` modules a file imports, relative names (absolute `warmfleet.server.x` folded in)."""
    names = [m.removeprefix("warmfleet.server.") if m.startswith("warmfleet.server.") else m
             for m in imported_modules(path)]
    return [m for m in names if m.split(".")[0] in {p.stem for p in SERVER.iterdir()}]


def test_backends_sit_below_engine_and_models_and_models_see_only_the_interface():
    for path in (SERVER / "attention").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] in ("engine", "models")], path
    for path in (SERVER / "models").glob("*.py"):
        mods = imported_modules(path)
        assert not [m for m in mods if m.startswith("engine")], path
        assert {m for m in mods if m.startswith("attention")} <= {"attention.interface"}, path


def test_cpu_math_imports_nothing_else_of_the_server():
    for path in (SERVER / "cpu_math").glob("*.py"):
        assert not [m for m in server_imports(path) if not m.startswith("cpu_math")], path


def test_tiny_checkpoints_sit_above_models_and_multimodal():
    for room in ("models", "multimodal", "engine", "attention", "api", "cpu_math"):
        for path in (SERVER / room).rglob("*.py"):
            assert not [m for m in server_imports(path) if m.startswith("tiny_checkpoints")], path


def test_the_flags_contract_loads_nothing_of_attention_or_paddle(tmp_path):
    """In a fresh interpreter, importing warmfleet.server.config (the operator does) loads no attention module
    and no paddle: the backend names are checked by attention/registry.py, which imports config, not back."""
    code = ("import sys, warmfleet.server.config; "
            "bad = sorted(m for m in sys.modules if m.startswith('warmfleet.server.attention') or m.split('.')[0] == 'paddle'); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_router_core_knows_no_front_door_and_the_doors_know_not_each_other():
    """core/ imports neither door nor the shared HTTP routes (status.py); the EPP (epp/) and the proxy (http/) share
    the core and status.py, never each other's modules."""
    router = SERVER / "router"
    for path in (router / "core").rglob("*.py"):
        bad = [m for m in server_imports(path) if m.startswith(("router.http", "router.epp", "router.status"))]
        assert not bad, (path, bad)
    for path in (router / "epp").rglob("*.py"):
        assert not [m for m in server_imports(path) if m.startswith("router.http")], path
    for path in (router / "http").rglob("*.py"):
        assert not [m for m in server_imports(path) if m.startswith("router.epp")], path
    assert not [m for m in server_imports(router / "status.py") if m.startswith(("router.http", "router.epp"))]


def test_the_epp_flags_and_envoy_bootstrap_load_no_grpc_or_protos(tmp_path):
    """The operator renders the EPP's args from epp/settings.py, and `warmfleet envoy-bootstrap` runs anywhere:
    neither may pull in grpc, the protos (a package named `envoy`) or the router's HTTP stack."""
    code = ("import sys, warmfleet.server.router.epp.settings, warmfleet.server.router.epp.envoy_bootstrap; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'envoy', 'fastapi', 'httpx')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
