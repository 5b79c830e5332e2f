"""Package discovery: warmfleet/, server/ and operator/ become warmfleet, warmfleet.server and
warmfleet.operator, and every folder below them is found, so no subpackage can be left out.

Metadata, dependencies and package data live in pyproject.toml. The folders are mapped (not
installed under their own names) because a top-level package named `operator` would shadow the
standard library's.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"warmfleet": "warmfleet", "warmfleet.server": "server", "warmfleet.operator": "operator"}


def packages() -> list[str]:
    """Each root and every folder below it (namespace folders too: kernels/ holds only C sources)."""
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_namespace_packages(where=folder, exclude=["*__pycache__*"])]
    return found


setup(packages=packages(), package_dir=ROOTS)
