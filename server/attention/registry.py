"""Attention backends by name (`--attention-backend`); no paddle: a backend's module is imported when it is created."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..config import DEFAULT_ATTENTION_BACKEND

if TYPE_CHECKING:
    from .interface import AttentionBackend

DEFAULT = DEFAULT_ATTENTION_BACKEND  # the flag's default lives with the flag (contract 3)


def _cpu(native: bool = True) -> "AttentionBackend":
    from .cpu import CpuPagedAttention

    return CpuPagedAttention(native)


# name -> zero-argument factory. A new backend adds one entry here (and its own module); the scheduler,
# the KV cache manager and the models stay as they are.
# `cpu` decodes through a compiled kernel when the machine can build it (else as `cpu-paddle`, logged);
# `cpu-paddle` is Paddle ops only (the reference the kernel is tested against).
BACKENDS: dict[str, Callable[[], "AttentionBackend"]] = {"cpu": _cpu, "cpu-paddle": lambda: _cpu(native=False)}


def check(name: str) -> None:
    """Raise ValueError (one line naming the choices) for a name no backend is registered under."""
    if name not in BACKENDS:
        raise ValueError(f"unknown --attention-backend {name!r}; registered backends: {', '.join(sorted(BACKENDS))}")


def create(name: str) -> "AttentionBackend":
    """A new backend instance of the given name."""
    check(name)
    return BACKENDS[name]()
