"""A real Envoy (WARMFLEET_ENVOY: scripts/envoy-env.sh builds it) started on a bootstrap from
`warmfleet envoy-bootstrap`'s builder, for the gateway tests (the `warmfleet epp` process: livefleet.Epp)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from warmfleet.livefleet import free_port, wait_for
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig, bootstrap


def envoy_binary() -> str:
    """The Envoy binary the tests run; a test that needs it fails (never skips) when it is not given."""
    path = os.environ.get("WARMFLEET_ENVOY")
    if not path:
        pytest.fail("WARMFLEET_ENVOY is unset: these tests need a real Envoy. Run `make unit`, or "
                    "WARMFLEET_ENVOY=\"$(scripts/envoy-env.sh | tail -n 1)\" .venv/bin/pytest ...")
    if not os.access(path, os.X_OK):
        pytest.fail(f"WARMFLEET_ENVOY={path} is not an executable Envoy binary")
    return path


class Envoy:
    """One Envoy process on loopback: the gateway listener on `port`, the admin on `admin_port`."""

    def __init__(self, cfg: GatewayConfig, cwd: Path, name: str = "envoy", filters_before: tuple = ()):
        """`filters_before`: HTTP filters put ahead of ext_proc (what a gateway sets up before the EPP runs)."""
        self.port, self.admin_port = free_port(), free_port()
        self.cfg = replace(cfg, listen_host="127.0.0.1", listen_port=self.port, admin_port=self.admin_port)
        self.name, self.cwd = name, cwd
        self.config_path = cwd / f"{name}.json"
        config = bootstrap(self.cfg)
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][:0] = list(filters_before)
        self.config_path.write_text(json.dumps(config, indent=2))
        self.log_path = cwd / f"{name}.log"
        self.popen = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Envoy":
        with open(self.log_path, "ab") as log:
            # --disable-hot-restart: no shared-memory base id to collide with other Envoys on the host
            self.popen = subprocess.Popen([envoy_binary(), "-c", str(self.config_path), "--disable-hot-restart",
                                           "--log-level", "warning"], cwd=self.cwd, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=2).status_code == 200,
                 f"{self.name} ready", [self], 60)
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=20)

    def __enter__(self) -> "Envoy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
