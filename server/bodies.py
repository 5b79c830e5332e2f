"""HTTP request bodies read under a byte cap (replica API and router): refused past it, never buffered beyond it."""

from __future__ import annotations


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body exceeds {limit} bytes (--max-request-bytes)")
        self.limit = limit


async def read_capped(request, limit: int) -> bytes:
    """The raw body of a Starlette request; raises BodyTooLarge as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
