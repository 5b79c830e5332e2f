"""Local processes on loopback (the demo fleet, tests, e2e): a free port each, and stopping them all."""

from __future__ import annotations

import socket
import subprocess
from typing import Sequence

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before in this process (the kernel may offer a released one again)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def stop_all(procs: Sequence[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every process still running (the last started first), wait for each; SIGKILL what outlasts `timeout_s`."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
