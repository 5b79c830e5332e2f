"""The router core knows nothing of HTTP or gRPC serving: importing it loads no front door, no web server, no gRPC."""

import subprocess
import sys

SERVER_BITS = ("fastapi", "starlette", "uvicorn", "grpc", "envoy")  # web servers, gRPC and its protos (the EPP's)


def test_core_imports_no_http_server_and_no_front_door(tmp_path):
    """In a fresh interpreter (this one has imported the HTTP door long ago): every module below router/core, its
    engine dialects included, then no fastapi/starlette/uvicorn module and no router/http module may be loaded."""
    code = ("import importlib, pkgutil, sys; import warmfleet.server.router.core as core; "
            "names = [m.name for m in pkgutil.walk_packages(core.__path__, core.__name__ + '.')]; "
            "[importlib.import_module(n) for n in names]; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_BITS!r} "
            "or m.startswith(('warmfleet.server.router.http', 'warmfleet.server.router.epp', "
            "'warmfleet.server.router.status'))); "
            "print(len(names)); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) >= 15  # the walk found the core (a broken walk would pass vacuously)


def test_no_core_module_imports_a_front_door_or_a_web_server_even_lazily():
    """The same for imports inside functions, which a fresh interpreter's import does not run."""
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parent.parent / "server" / "router" / "core"
    found = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.lstrip(".").split(".")[0] in SERVER_BITS or any(
                        door in name for door in (".http", ".epp", ".status")) or name.startswith(("..http", "..epp")):
                    found.append(f"{path.relative_to(core)}:{node.lineno} {name}")
    assert len(list(core.rglob("*.py"))) >= 15 and not found, found
