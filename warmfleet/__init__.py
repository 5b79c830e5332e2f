"""warmfleet: multimodal LLM serving where every request lands on a replica that already holds its prefix.

`from warmfleet import LLM, SamplingParams` runs the engine in-process (imports paddle lazily).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from warmfleet.server.offline import LLM

        return LLM
    if name == "SamplingParams":
        from warmfleet.server.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
