"""Which package may import which (server rooms, operator rooms): read from the source (ast), so a wrong edge fails here, not at run time."""

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


# ---- the operator: rooms in data-flow order, pure rooms free of I/O clients, no circle ----

OPERATOR = Path(__file__).resolve().parents[1] / "operator"
# the operator's rooms as a newcomer reads them; a room imports only the rooms before it (and itself)
OPERATOR_ROOMS = ("spec", "planning", "passes", "wiring")
PURE_ROOMS = ("spec", "planning")
# what a pure module may not import: kopf, an HTTP client, a Kubernetes client (ours is warmfleet.kube)
IO_CLIENTS = ("kopf", "httpx", "aiohttp", "kubernetes", "kubernetes_asyncio", "warmfleet.kube")


def operator_modules():
    """`warmfleet.operator.<room>.<module>` → path, for every module of the operator/ folder."""
    out = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        parts = path.relative_to(OPERATOR).with_suffix("").parts
        out[".".join(("warmfleet", "operator", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


def operator_edges(path, known):
    """The operator modules a file imports, function-level (lazy) imports included: `from pkg import mod` names mod."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            out.update(subs or ([node.module] if node.module in known else []))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    return out


def test_operator_modules_import_no_circle_lazy_imports_counted():
    known = operator_modules()
    graph = {name: operator_edges(path, known) - {name} for name, path in known.items()}
    circles, done = [], set()

    def visit(name, trail):
        if name in trail:
            circles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for nxt in sorted(graph[name]):
            visit(nxt, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def _room(name):
    parts = name.split(".")
    return parts[2] if len(parts) > 2 else None


def test_operator_rooms_import_only_downward_in_data_flow_order():
    known = operator_modules()
    for name, path in known.items():
        if path.parent == OPERATOR:
            raise AssertionError(f"{path}: every operator module lives in a room {OPERATOR_ROOMS}")
        assert _room(name) in OPERATOR_ROOMS, path
        rank = OPERATOR_ROOMS.index(_room(name))
        up = [m for m in operator_edges(path, known) if OPERATOR_ROOMS.index(_room(m)) > rank]
        assert not up, (path, up)


def test_pure_operator_rooms_import_no_kopf_http_or_kubernetes_client(tmp_path):
    """spec/ and planning/ import no I/O client, read from the source and in a fresh interpreter (transitively)."""
    known = operator_modules()
    pure = [n for n in known if _room(n) in PURE_ROOMS]
    assert pure
    for name in pure:
        bad = [m for m in imported_modules_abs(known[name]) if m == "asyncio" or m.startswith(IO_CLIENTS)]
        assert not bad, (known[name], bad)
    code = (f"import importlib, sys; [importlib.import_module(n) for n in {pure!r}]; "
            f"bad = sorted(m for m in sys.modules if m in {IO_CLIENTS!r} or m.split('.')[0] in {IO_CLIENTS!r}); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def imported_modules_abs(path):
    """Absolute module names a file imports (the operator uses no relative imports)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


MAX_FUNCTION_LINES = 70  # issue 38: a function that grows past this is split into named steps


def test_no_product_function_is_over_70_lines():
    root = Path(__file__).resolve().parents[1]
    long = []
    for top in ("server", "operator", "warmfleet"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
