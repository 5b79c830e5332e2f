"""Package discovery: warmfleet/ and server/ become warmfleet and warmfleet.server, and each room of operator/
(spec/, planning/, passes/, wiring/) becomes warmfleet.operator.<room>; every folder below them is found, so no
subpackage can be left out.

Metadata, dependencies and package data live in pyproject.toml. The folders are mapped (not installed under their
own names) so that nothing at the checkout's root shadows the standard library: operator/ holds no __init__.py
(from the root, `import operator` passes over it to the standard library's module) and the package
warmfleet.operator itself is warmfleet/operator/__init__.py. Its rooms are mapped one by one, not operator/ as a
whole: setuptools' editable finder resolves a mapped package only through that folder's __init__.py.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

OPERATOR = Path(__file__).resolve().parent / "operator"
ROOTS = {"warmfleet": "warmfleet", "warmfleet.server": "server",
         **{f"warmfleet.operator.{room.name}": f"operator/{room.name}"
            for room in sorted(OPERATOR.iterdir()) if (room / "__init__.py").is_file()}}


def packages() -> list[str]:
    """Each root and every folder below it (namespace folders too: kernels/ holds only C sources)."""
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_namespace_packages(where=folder, exclude=["*__pycache__*"])]
    return found


setup(packages=packages(), package_dir=ROOTS)
