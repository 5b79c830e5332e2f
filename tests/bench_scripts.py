"""bench/ scripts as modules, for the tests that drive them: the one way tests reach into bench/.

bench/ is no package, so its folder goes last on sys.path and the scripts load through bench/harness.py's
`sibling`: one module per script per process, the same one the benches themselves share (a test's
`trace_replay` is scaleout's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

import harness  # noqa: E402


def load_bench(script: str) -> ModuleType:
    """bench/`script` (e.g. "simfleet.py") as a module, registered in sys.modules (its dataclasses look it up)."""
    return harness.sibling(script.removesuffix(".py"))
