"""Model sources (hf://, s3://, pvc://, absolute paths), the model cache layout and config.json summaries; pure, no I/O.

Shared by the operator (spec validation, rendering, learning sizes) and `warmfleet fetch-model`
(warmfleet/fetch.py); imports nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

SourceKind = Literal["hf", "s3", "pvc", "path"]

# One pattern for the API server (CEL `matches`, RE2) and for Python (`re.fullmatch`): no backslashes,
# no look-arounds. `[!-~]` is printable ASCII without the space. Bounded so CEL's cost estimate stays low.
_HF = r"hf://[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(@[A-Za-z0-9][A-Za-z0-9._/-]{0,255})?"
_S3 = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[!-~]*)?"
_PVC = r"pvc://[a-z0-9]([-a-z0-9]{0,251}[a-z0-9])?(/[!-~]*)?"
_PATH = r"/[!-~]*"
SOURCE_PATTERN = f"^({_HF}|{_S3}|{_PVC}|{_PATH})$"
DOTDOT_PATTERN = "(^|/)[.][.](/|$)"  # no `..` path segment anywhere (a source names a directory under a mount)
SOURCE_FORMS = "hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX], pvc://CLAIM[/PATH] or an absolute path"

DEFAULT_REVISION = "main"
# What `warmfleet fetch-model` downloads by default: weights as safetensors, configs, tokenizer files and chat
# templates. Pickled weights (*.bin, *.pth), GGUF and ONNX exports are left on the hub.
WEIGHT_PATTERNS = ("*.safetensors",)
METADATA_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*")
MODEL_PATTERNS = WEIGHT_PATTERNS + METADATA_PATTERNS
TOKENIZER_PATTERNS = METADATA_PATTERNS  # the router renders prompts and tokenizes: no weights


@dataclass(frozen=True)
class ModelSource:
    """A parsed spec.model.source."""

    kind: SourceKind
    raw: str
    repo: str = ""  # hf: ORG/NAME
    revision: str = ""  # hf: branch, tag or commit (default main)
    bucket: str = ""  # s3
    prefix: str = ""  # s3: key prefix without leading or trailing '/' ('' = the whole bucket)
    claim: str = ""  # pvc
    path: str = ""  # pvc: path inside the claim ('' = its root); path: the absolute directory

    @property
    def downloads(self) -> bool:
        """Whether an init container fetches it into the model cache (hf://, s3://)."""
        return self.kind in ("hf", "s3")

    def cache_subdir(self) -> str:
        """The model's path as the containers see it, relative to /models: hf/ORG/NAME/REVISION or s3/BUCKET/PREFIX.

        A revision with '/' (refs/pr/1) becomes one segment ('refs--pr--1'), so revisions never nest.
        """
        if self.kind == "hf":
            return f"hf/{self.repo}/{self.revision.replace('/', '--')}"
        if self.kind == "s3":
            return "/".join(p for p in ("s3", self.bucket, self.prefix) if p)
        raise ValueError(f"{self.raw}: only hf:// and s3:// sources live in the model cache")

    def node_cache_subdir(self, endpoint: str | None, namespace: str | None) -> str:
        """The model's directory in a node's shared cache, keyed by everything that identifies its bytes:
        [ns/NAMESPACE/]hf|s3/ORIGIN/... where ORIGIN names the endpoint (host and a digest of the whole URL) and the
        rest is `cache_subdir`'s. `namespace` None: shared across namespaces (an admin's choice).

        Two services naming the same source through different endpoints, or in different namespaces, never
        share a directory, so one cannot serve or overwrite bytes the other fetched.
        """
        kind, rest = self.cache_subdir().split("/", 1)
        head = f"ns/{namespace}/" if namespace else ""
        return f"{head}{kind}/{origin_key(self.kind, endpoint)}/{rest}"


DEFAULT_ENDPOINTS = {"hf": "https://huggingface.co", "s3": "https://s3.amazonaws.com"}


def origin_key(kind: str, endpoint: str | None) -> str:
    """One path segment naming where bytes come from: the endpoint's host (readable) and a digest of its normalized
    URL (so two endpoints on one host, or http vs https, differ). None: the kind's default endpoint."""
    url = (endpoint or DEFAULT_ENDPOINTS[kind]).strip().rstrip("/")
    scheme, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    normal = f"{scheme.lower()}://{host.lower()}/{path}"
    readable = re.sub(r"[^a-z0-9.-]", "_", host.lower())[:64] or "endpoint"
    return f"{readable}-{hashlib.sha256(normal.encode()).hexdigest()[:12]}"


def check_source(value: str) -> str | None:
    """Why `value` is not a valid source, or None (the Python twin of the CEL rule)."""
    if not re.fullmatch(SOURCE_PATTERN, value):
        return f"must be {SOURCE_FORMS}, got {value!r}"
    if re.search(DOTDOT_PATTERN, value):
        return f"must not contain a '..' path segment, got {value!r}"
    return None


def parse_source(value: str) -> ModelSource:
    """Parse a source string; raises ValueError with a readable message."""
    problem = check_source(value)
    if problem:
        raise ValueError(f"model source {problem}")
    if value.startswith("hf://"):
        repo, _, rev = value[len("hf://"):].partition("@")
        return ModelSource("hf", value, repo=repo, revision=rev or DEFAULT_REVISION)
    if value.startswith("s3://"):
        bucket, _, prefix = value[len("s3://"):].partition("/")
        return ModelSource("s3", value, bucket=bucket, prefix=_clean(prefix))
    if value.startswith("pvc://"):
        claim, _, path = value[len("pvc://"):].partition("/")
        return ModelSource("pvc", value, claim=claim, path=_clean(path))
    return ModelSource("path", value, path=value.rstrip("/") or "/")


def _clean(path: str) -> str:
    return "/".join(p for p in path.split("/") if p and p != ".")


# ---- config.json ----

DTYPES = ("bfloat16", "float16", "float32")  # the dtypes spec.model.dtype accepts
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
# Keys under which multimodal checkpoints keep their vision tower's config (Qwen2/2.5/3-VL, LLaVA, Gemma 3,
# Llama 4, InternVL, Idefics: vision_config; Qwen-VL v1: visual; Phi-3-vision: img_processor).
_VISION_KEYS = ("vision_config", "visual", "vision_tower", "mm_vision_tower", "img_processor")


@dataclass(frozen=True)
class ConfigSummary:
    """What the operator reads from a checkpoint's config.json."""

    architecture: str  # architectures[0], '' if absent
    model_type: str
    hidden_size: int | None  # width of a token embedding (text config's hidden_size): the encoder cache stores this
    dtype: str | None  # torch_dtype / dtype as written (may be outside DTYPES, e.g. float8_e4m3fn)
    vision: bool  # has a vision tower config: a multimodal model
    vision_hidden_size: int | None  # the vision tower's own width, for reference
    # the language model's shapes that size a LoRA adapter (the text config's where nested)
    num_layers: int | None = None  # num_hidden_layers
    intermediate_size: int | None = None  # MLP width
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """camelCase, as status.modelConfig.configJson and fetch-model's summary file carry it."""
        out = {"architecture": self.architecture, "modelType": self.model_type, "hiddenSize": self.hidden_size,
               "dtype": self.dtype, "vision": self.vision, "visionHiddenSize": self.vision_hidden_size,
               "numLayers": self.num_layers, "intermediateSize": self.intermediate_size,
               "numAttentionHeads": self.num_attention_heads, "numKeyValueHeads": self.num_key_value_heads,
               "headDim": self.head_dim}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ConfigSummary":
        """The inverse of as_dict."""
        return cls(architecture=str(d.get("architecture") or ""), model_type=str(d.get("modelType") or ""),
                   hidden_size=_int(d.get("hiddenSize")), dtype=d.get("dtype"), vision=bool(d.get("vision")),
                   vision_hidden_size=_int(d.get("visionHiddenSize")), num_layers=_int(d.get("numLayers")),
                   intermediate_size=_int(d.get("intermediateSize")), num_attention_heads=_int(d.get("numAttentionHeads")),
                   num_key_value_heads=_int(d.get("numKeyValueHeads")), head_dim=_int(d.get("headDim")))


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def summarize_config(cfg: Mapping[str, Any]) -> ConfigSummary:
    """Summarize a parsed config.json; raises ValueError if it is not an object.

    The hidden size is the language model's: top-level `hidden_size` (or `d_model`, `n_embd`), else that of
    `text_config` / `llm_config` (newer multimodal configs nest it). The dtype is `torch_dtype`, or `dtype`
    (the key's name since transformers 4.56), of the top level or the text config.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"config.json must hold an object, got {type(cfg).__name__}")
    text = next((cfg[k] for k in ("text_config", "llm_config", "language_config") if isinstance(cfg.get(k), Mapping)), {})

    def width(c: Mapping[str, Any]) -> int | None:
        return next((v for v in (_int(c.get(k)) for k in ("hidden_size", "d_model", "n_embd")) if v), None)

    def dtype(c: Mapping[str, Any]) -> str | None:
        raw = c.get("torch_dtype") or c.get("dtype")
        if not isinstance(raw, str) or raw == "auto":
            return None
        raw = raw.removeprefix("torch.")
        return _DTYPE_ALIASES.get(raw, raw)

    vision_cfg = next((cfg[k] for k in _VISION_KEYS if cfg.get(k)), None)

    def shape(key: str) -> int | None:
        return _int(cfg.get(key)) or _int(text.get(key))
    archs = cfg.get("architectures") or []
    return ConfigSummary(
        architecture=str(archs[0]) if isinstance(archs, list) and archs else "",
        model_type=str(cfg.get("model_type") or ""),
        hidden_size=width(cfg) or width(text),
        dtype=dtype(cfg) or dtype(text),
        vision=vision_cfg is not None,
        vision_hidden_size=(_int(vision_cfg.get("embed_dim")) or width(vision_cfg)) if isinstance(vision_cfg, Mapping) else None,
        num_layers=shape("num_hidden_layers"), intermediate_size=shape("intermediate_size"),
        num_attention_heads=shape("num_attention_heads"), num_key_value_heads=shape("num_key_value_heads"),
        head_dim=shape("head_dim"),
    )
