"""Writes coalesced per event-loop tick under the router's HTTP protocol (hotpath.py): one send() per response.

Starlette sends `http.response.start` and `http.response.body` as two ASGI messages and uvicorn
writes each to the socket at once, so a small answer costs two send() syscalls. On loopback each
send runs the receiver's TCP path and wakes it; on a busy host that is the router's largest
fixed cost. Here writes made within one loop tick are joined and handed to the real transport
at the end of that tick (`loop.call_soon`): nothing is held longer than the code that produced
it runs, so streams are not buffered (every SSE event still leaves in the tick it was relayed).
"""

from __future__ import annotations

import asyncio
from typing import Any



class CoalescingTransport:
    """Wraps an asyncio transport: write() appends; the joined bytes go out at the end of the tick."""

    def __init__(self, transport: asyncio.Transport):
        self._t = transport
        self._buf: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._buf:
            self._loop.call_soon(self.flush)
        self._buf.append(bytes(data))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._buf:
            return
        data = b"".join(self._buf) if len(self._buf) > 1 else self._buf[0]
        self._buf.clear()
        if not self._t.is_closing():
            self._t.write(data)

    def close(self) -> None:
        self.flush()
        self._t.close()

    def write_eof(self) -> None:
        self.flush()
        self._t.write_eof()

    def abort(self) -> None:
        self._buf.clear()
        self._t.abort()

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size() + sum(len(b) for b in self._buf)

    def __getattr__(self, name: str) -> Any:  # get_extra_info, is_closing, pause_reading, set_protocol, ...
        return getattr(self._t, name)
