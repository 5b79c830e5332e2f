"""Shared pytest fixtures: tiny random checkpoints written once per session (deterministic, see make_tiny_model)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Real-vLLM integration tests run from `make test-vllm`, which builds the vLLM environment and names
# its python here; the plain suite leaves them out rather than skipping them.
collect_ignore = [] if os.environ.get("WARMFLEET_VLLM_PYTHON") else ["vllm"]

BOS = "<|endoftext|>"  # stands in for a BOS token: bos_model_dir's tokenizer prepends it to plain text


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint (2 layers, hidden 64, vocab 1024, ChatML template); treat as read-only."""
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-VL checkpoint (vision tower, M-RoPE decoder, preprocessor config); treat as read-only."""
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), arch="qwen2_vl", size="tiny", seed=0)


@pytest.fixture(scope="session")
def bos_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with a tokenizer that adds BOS to plain text, as Llama's does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    out = tmp_path_factory.mktemp("bos") / "tiny-bos"
    shutil.copytree(tiny_model_dir, out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                              processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (no q/k/v bias, llama3 RoPE scaling), same tokenizer; treat as read-only."""
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny", seed=0)


@pytest.fixture()
async def cluster():
    """kmock (taught server-side apply) with the discovery kopf needs and every resource the operator touches
    (tests/operator_fixtures/cluster.py); a module may define its own `cluster` instead."""
    import kmock

    from operator_fixtures.cluster import declare
    from operator_fixtures.kmock_apply import FakeApplyEmulator

    async with FakeApplyEmulator() as emulator, kmock.Server(emulator):
        yield declare(emulator)
