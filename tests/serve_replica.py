"""A `warmfleet serve` subprocess on the tiny checkpoint whose JSON log lines a thread reads into a queue:
the end-to-end server tests (text and multimodal) wait on what it logs."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

from warmfleet.localprocs import free_port, stop_all

START_TIMEOUT_S = 180.0


class Replica:
    """A `warmfleet serve` subprocess whose JSON log lines are read by a thread into a queue."""

    def __init__(self, model_dir, cwd, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import sys; from warmfleet.cli import main; sys.exit(main())",
               "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "tiny", "--replica-id", "e2e-replica",
               "--block-size", "16", "--num-gpu-blocks", "256", "--max-model-len", "2048", "--drain-timeout-s", "60", *extra_args]
        # cwd outside the repo: its operator/ folder would shadow the standard library
        self.proc = subprocess.Popen(cmd, cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_log(self, msg: str, timeout_s: float, prefix: bool = False) -> dict:
        """Block until a JSON log record with this message (or, with `prefix`, starting with it) appears.

        The server says so itself, no polling; records read past are consumed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError("server exited:\n" + "".join(self.log[-40:]))
            try:
                record = json.loads(line)
            except ValueError:
                continue
            got = record.get("msg", "")
            if got == msg or (prefix and isinstance(got, str) and got.startswith(msg)):
                return record

    def stop(self) -> None:
        stop_all([self.proc])

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
