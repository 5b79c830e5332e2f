"""A real Envoy (WARMFLEET_ENVOY: scripts/envoy-env.sh builds it) started on a bootstrap from
`warmfleet envoy-bootstrap`'s builder, for the gateway tests (the `warmfleet epp` process: livefleet.Epp)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmfleet import livefleet
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig


def envoy_binary() -> str:
    """The Envoy binary the tests run; a test that needs it fails (never skips) when it is not given."""
    path = os.environ.get("WARMFLEET_ENVOY")
    if not path:
        pytest.fail("WARMFLEET_ENVOY is unset: these tests need a real Envoy. Run `make unit`, or "
                    "WARMFLEET_ENVOY=\"$(scripts/envoy-env.sh | tail -n 1)\" .venv/bin/pytest ...")
    if not os.access(path, os.X_OK):
        pytest.fail(f"WARMFLEET_ENVOY={path} is not an executable Envoy binary")
    return path


class Envoy(livefleet.Envoy):
    """livefleet.Envoy on the tests' binary: `start()` returns once it is ready; also a context manager."""

    def __init__(self, cfg: GatewayConfig, cwd: Path, name: str = "envoy", filters_before: tuple = ()):
        """`filters_before`: HTTP filters put ahead of ext_proc (what a gateway sets up before the EPP runs)."""
        def edit(boot: dict) -> None:
            hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["http_filters"][:0] = list(filters_before)
        super().__init__(envoy_binary(), cfg, cwd, name, edit)

    def start(self) -> "Envoy":
        super().start()
        self.wait_ready()
        return self

    def __enter__(self) -> "Envoy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(timeout_s=20)
