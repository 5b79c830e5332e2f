"""What one API server holds: config, the engine and tokenizer once loaded, metrics, replica identity."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import anyio

from ..config import EngineConfig, replica_id
from ..engine.protocol import EngineClient
from ..tenant_keys import CLIENT_KEY_ENV, SALT_SECRET_ENV, key_salts, read_keys_file
from .errors import APIError
from .metrics import CacheConfigInfo, Metrics, ProcessorCacheView
from .snapshots import SnapshotGate

if TYPE_CHECKING:
    from ..multimodal.inputs import ImageInputPreparer
    from ..multimodal.processor_cache import ProcessorCacheClient

T = TypeVar("T")


def served_model_name(cfg: EngineConfig) -> str:
    """The name clients pass as `model`: --served-model-name, else the checkpoint directory's name."""
    return cfg.model.served_model_name or Path(cfg.model.model.rstrip("/")).name or "model"


def client_salts(cfg: EngineConfig) -> dict[str, str]:
    """The client keys of --api-keys-file (and WARMFLEET_CLIENT_API_KEY) and their tenant salts (--salt-secret or
    WARMFLEET_SALT_SECRET derives the ones mapped to null), as the router and the picker compute them; empty
    without either."""
    keys = {k: None for k in [os.environ.get(CLIENT_KEY_ENV, "").strip()] if k}
    if cfg.server.api_keys_file:
        keys.update(read_keys_file(cfg.server.api_keys_file))
    secret = cfg.server.salt_secret or os.environ.get(SALT_SECRET_ENV) or None
    return key_salts(keys, secret) if keys else {}


class ServerState:
    """Engine and tokenizer are attached once the model has loaded; until then /v1 answers 503."""

    def __init__(self, cfg: EngineConfig, engine: Optional[EngineClient] = None, tokenizer: Any = None):
        self.cfg = cfg
        self.replica_id = replica_id(cfg.server)
        self.api_key = cfg.server.api_key or os.environ.get("WARMFLEET_API_KEY") or None
        self.admin_key = cfg.server.admin_key or os.environ.get("WARMFLEET_ADMIN_KEY") or None
        self.client_salts = client_salts(cfg)  # --api-keys-file: client key -> the cache salt it runs under
        self.lora_enabled = cfg.lora.enabled
        self.loras: dict[str, str] = cfg.lora.modules() if cfg.lora.enabled else {}  # adapter name -> path
        self.model_name = engine.model_info.served_model_name if engine is not None else served_model_name(cfg)
        self.metrics = Metrics(self.model_name)
        self.engine: Optional[EngineClient] = None
        self.tokenizer: Any = None
        self.vocab_size: Optional[int] = None
        self.image_pad_id: Optional[int] = None  # multimodal models: prompts may hold it only where an image is
        self.draining = False
        self.snapshots = SnapshotGate()  # /v1/kv/snapshot: one engine call at a time, shared by concurrent callers
        self._kv_capacity_tokens: Optional[int] = None
        # Multimodal: built on the first request with an image, so text-only serving never pays for it.
        self.processor_cache: Optional["ProcessorCacheClient"] = None  # set by `warmfleet serve` (one per pod)
        self.processor_cache_process: Any = None  # the pod's ProcessorCacheProcess when this server owns it
        self._image_preparer: Optional["ImageInputPreparer"] = None
        if engine is not None:
            self.attach(engine, tokenizer)

    def attach(self, engine: EngineClient, tokenizer: Any) -> None:
        """Make the server ready: from now on requests reach `engine`."""
        self.tokenizer = tokenizer
        self.vocab_size = _model_vocab_size(engine.model_info.model_dir, tokenizer)
        self.image_pad_id = None
        if getattr(engine.model_info, "is_multimodal", False):
            from ..multimodal.prompt import IMAGE_PAD

            self.image_pad_id = tokenizer.token_to_id(IMAGE_PAD)
        self.metrics.set_cache_config(CacheConfigInfo(
            block_size=engine.model_info.block_size, enable_prefix_caching=self.cfg.cache.enable_prefix_caching))
        self.engine = engine

    @property
    def is_multimodal(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine.model_info, "is_multimodal", False))

    def connect_processor_cache(self, address: str, timeout_s: Optional[float] = None) -> None:
        """Use the pod's processor-cache process at `address` (one socket, reused for every request)."""
        from ..multimodal.processor_cache import DEFAULT_TIMEOUT_S, ProcessorCacheClient

        self.processor_cache = ProcessorCacheClient(address, timeout_s=timeout_s or DEFAULT_TIMEOUT_S)

    def image_preparer(self) -> "ImageInputPreparer":
        """The frontend's image pipeline (loader, processor, cache client), made on first use."""
        if self._image_preparer is None:
            from ..multimodal.inputs import ImageInputPreparer
            from ..multimodal.media import MediaConfig, MediaLoader
            from ..multimodal.processor import ImageProcessor

            engine = self.require_engine()
            self._image_preparer = ImageInputPreparer(
                self.tokenizer, ImageProcessor.from_model_dir(engine.model_info.model_dir),
                MediaLoader(MediaConfig.from_server_config(self.cfg.server)), self.processor_cache,
                hash_algo=self.cfg.cache.prefix_hash_algo, max_image_tokens=engine.model_info.max_model_len,
            )
        return self._image_preparer

    def processor_cache_view(self) -> Optional[ProcessorCacheView]:
        """Blocking (one round trip, bounded by the client's timeout): the cache's figures for /metrics."""
        client = self.processor_cache
        if client is None:
            return None
        stats = client.stats()
        proc = self.processor_cache_process
        return ProcessorCacheView(stats, client.num_timeouts, client.num_unavailable, client.num_errors,
                                  getattr(proc, "num_restarts", 0))

    def close(self) -> None:
        """Release the image pipeline's processor-cache client (each request's downloads close with it)."""
        self._image_preparer = None
        cache, self.processor_cache = self.processor_cache, None
        if cache is not None:
            cache.close()

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def require_engine(self) -> EngineClient:
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry when /ready answers 200", code="model_loading")
        return self.engine

    def check_model(self, name: Optional[str]) -> str:
        """The served name for a request's `model` (the base model's or a LoRA adapter's); 404 for any other name."""
        if name is None or name == self.model_name:
            return self.model_name
        if name in self.loras:
            return name
        served = ", ".join(f"`{n}`" for n in [self.model_name, *self.loras])
        raise APIError(404, f"The model `{name}` does not exist. This server serves {served}.",
                       param="model", code="model_not_found")

    def lora_for(self, model: str) -> Optional[str]:
        """The LoRA adapter a checked model name selects; None for the base model."""
        return model if model in self.loras else None

    async def context_limit(self) -> tuple[int, str]:
        """Most tokens (prompt + output) one request may hold, and what sets that limit.

        That is the model's context length, unless the primary KV pool is smaller: a request
        the pool can never hold would wait forever, so it is refused instead.
        """
        engine = self.require_engine()
        limit = engine.model_info.max_model_len
        if self._kv_capacity_tokens is None:
            try:
                stats = await engine.stats()
            except Exception:  # capacity unknown this time; the context length still applies
                stats = None
            if stats is not None:
                self._kv_capacity_tokens = stats.gpu_blocks_total * engine.model_info.block_size
        if self._kv_capacity_tokens and self._kv_capacity_tokens < limit:
            return self._kv_capacity_tokens, "KV cache capacity"
        return limit, "maximum context length"

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenizing, template rendering) off the event loop."""
        return await anyio.to_thread.run_sync(fn, *args)


def _model_vocab_size(model_dir: str, tokenizer: Any) -> Optional[int]:
    """Embedding rows of the model (config.json), else the tokenizer's vocabulary; None if unknown."""
    try:
        size = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    except (OSError, ValueError):
        pass
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
