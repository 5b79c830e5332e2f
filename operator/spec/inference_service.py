"""InferenceService spec and status types: the single source of the CRD schema (see crd.py); no kopf."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal, Optional

from warmfleet.operator.spec.pod_overlay import RouterPodOverlay, ServerPodOverlay
from warmfleet.operator.spec.node_tier import NodeTierSpec, NodeTierStatus
from warmfleet.operator.spec.schema import Rule, from_dict, prop
from warmfleet.operator.spec.tracing import TracingSpec
from warmfleet.server import engine_kinds
from warmfleet.source import DOTDOT_PATTERN, ModelSource, SOURCE_FORMS, SOURCE_PATTERN, check_source, parse_source

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
Mode = Literal["Auto", "Fixed"]
EngineKind = Literal[engine_kinds.KINDS]  # type: ignore[valid-type]  # the registered kinds; one description each in planning/engine_descriptions.py
EngineChoice = Literal[("auto", *engine_kinds.KINDS)]  # type: ignore[valid-type]  # spec.engine.kind: auto, or a kind
MemorySource = Literal["label", "product", "instance-type", "spec"]  # where a pool's GPU memory figure came from


# Shared by every Auto/Fixed size: CEL for the API server, the same check in Python for `render`.
SIZE_RULES: list[Rule] = [
    ("self.mode != 'Fixed' || has(self.size)", "size is required when mode is Fixed",
     lambda s: s.mode != "Fixed" or s.size is not None),
    ("!has(self.min) || !has(self.max) || self.min <= self.max", "min must be <= max",
     lambda s: s.min is None or s.max is None or s.min <= s.max),
]


@dataclass(kw_only=True)
class GiBSize:
    """A cache size in GiB: Auto derives it per node pool, Fixed takes `size`; min/max clamp Auto."""

    mode: Mode = prop("Auto", doc="Auto sizes from the node pool's host memory; Fixed uses `size` everywhere.")
    size: Optional[float] = prop(None, doc="Size in GiB when mode is Fixed (0 disables the cache).", minimum=0)
    min: Optional[float] = prop(None, doc="Lower bound in GiB for the Auto size.", minimum=0)
    max: Optional[float] = prop(None, doc="Upper bound in GiB for the Auto size.", minimum=0)

    RULES: ClassVar[list[Rule]] = SIZE_RULES


@dataclass(kw_only=True)
class TokenSize:
    """A cache size in tokens: Auto derives it from GPU memory, Fixed takes `size`; min/max clamp Auto."""

    mode: Mode = prop("Auto", doc="Auto sizes from the pool's GPU memory and the model's hidden size; Fixed uses `size`.")
    size: Optional[int] = prop(None, doc="Size in tokens when mode is Fixed (0 disables the cache).", minimum=0)
    min: Optional[int] = prop(None, doc="Lower bound in tokens for the Auto size.", minimum=0)
    max: Optional[int] = prop(None, doc="Upper bound in tokens for the Auto size.", minimum=0)

    RULES: ClassVar[list[Rule]] = SIZE_RULES


DEFAULT_HIDDEN_SIZE = 4096  # when neither the spec nor config.json says (sources the operator cannot read)
DEFAULT_DTYPE = "bfloat16"
DEFAULT_MODEL_CACHE = "/var/cache/warmfleet/models"  # hostPath of the node-local model cache
DOWNLOADING = "has(self.source) && (self.source.startsWith('hf://') || self.source.startsWith('s3://'))"


def _downloads(m: "ModelSpec") -> bool:
    return m.source is not None and m.source.startswith(("hf://", "s3://"))


@dataclass(kw_only=True)
class HubSpec:
    """Where hf:// sources are downloaded from."""

    endpoint: Optional[str] = prop(
        None, doc="Hub URL, e.g. a mirror (default: https://huggingface.co); the init container gets it as HF_ENDPOINT.",
        pattern="^https?://[!-~]+$", maxLength=2048,
    )


@dataclass(kw_only=True)
class S3Spec:
    """The S3-compatible store of s3:// sources."""

    endpoint: Optional[str] = prop(
        None, doc="Endpoint URL of an S3-compatible store (MinIO, Ceph RGW, R2, ...; path-style requests); default: AWS S3.",
        pattern="^https?://[!-~]+$", maxLength=2048,
    )
    region: Optional[str] = prop(None, doc="Region (default: us-east-1).", pattern=r"^[a-z0-9-]+$", maxLength=64)


@dataclass(kw_only=True)
class ModelCacheSpec:
    """The node-local cache hf:// and s3:// models are downloaded into, shared by the replicas on a node."""

    host_path: Optional[str] = prop(
        None, doc=f"Directory on each node (default {DEFAULT_MODEL_CACHE}); must be writable by uid/gid 10001 (docs/models.md).",
        pattern="^/[!-~]*$", maxLength=1024,
    )
    pvc: Optional[str] = prop(
        None, doc="PersistentVolumeClaim used as the cache instead of a hostPath (ReadWriteMany to share it across nodes).",
        pattern=DNS_LABEL, maxLength=253,
    )

    RULES: ClassVar[list[Rule]] = [
        ("!(has(self.hostPath) && has(self.pvc))", "hostPath and pvc are mutually exclusive",
         lambda c: c.host_path is None or c.pvc is None),
    ]


@dataclass(kw_only=True)
class ModelSpec:
    """The checkpoint every replica serves: `source` (preferred), or the older `path` + `pvc`."""

    source: Optional[str] = prop(
        None, doc=("Where the checkpoint comes from (preferred over path + pvc): hf://ORG/NAME[@REVISION] (Hugging Face Hub) "
                   "or s3://BUCKET[/PREFIX] (S3-compatible), downloaded by an init container into the node-local model "
                   "cache; pvc://CLAIM[/PATH], a PersistentVolumeClaim mounted read-only; or an absolute path baked into "
                   "the image. Exactly one of source and path."),
        minLength=1, maxLength=1024,
    )
    credentials_secret: Optional[str] = prop(
        None, doc=("Secret (same namespace) with the download credentials: key HF_TOKEN for hf://, keys AWS_ACCESS_KEY_ID "
                   "and AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN) for s3://. The operator reads it to learn config.json."),
        pattern=DNS_LABEL, maxLength=253,
    )
    hub: Optional[HubSpec] = prop(None, doc="Hub settings for hf:// sources.")
    s3: Optional[S3Spec] = prop(None, doc="Store settings for s3:// sources.")
    cache: Optional[ModelCacheSpec] = prop(
        None, doc=f"Node-local model cache for hf:// and s3:// sources (default: hostPath {DEFAULT_MODEL_CACHE}).",
    )
    path: Optional[str] = prop(
        None, doc="Older form of source: checkpoint directory inside the server container (baked into the image, or under /models when `pvc` is set).",
        minLength=1,
    )
    pvc: Optional[str] = prop(None, doc="With path: PersistentVolumeClaim mounted read-only at /models (source pvc://CLAIM/PATH says the same).",
                              pattern=DNS_LABEL, maxLength=253)
    served_name: Optional[str] = prop(
        None, doc="Name clients send as `model` (default: the InferenceService name). Immutable once set.",
        minLength=1, maxLength=253,
    )
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = prop(
        None, doc=f"Weight and activation dtype; also sizes encoder-cache entries (default: config.json's torch_dtype for hf:// and s3:// sources, else {DEFAULT_DTYPE}).",
    )
    hidden_size: Optional[int] = prop(
        None, doc=("Width of one encoder-output token (the language model's hidden size), which sizes the encoder cache. "
                   f"Default: config.json's for hf:// and s3:// sources (status.modelConfig says where it came from), else {DEFAULT_HIDDEN_SIZE}."),
        minimum=1, maximum=65536,
    )
    max_model_len: Optional[int] = prop(None, doc="Context length in tokens (default: the checkpoint's).", minimum=1)

    RULES: ClassVar[list[Rule]] = [
        ("has(self.source) != has(self.path)", "exactly one of source and path is required (source is preferred)",
         lambda m: (m.source is None) != (m.path is None)),
        (f"!has(self.source) || (self.source.matches('{SOURCE_PATTERN}') && !self.source.matches('{DOTDOT_PATTERN}'))",
         f"source must be {SOURCE_FORMS}, without '..' segments",
         lambda m: m.source is None or check_source(m.source) is None),
        ("!has(self.pvc) || has(self.path)", "pvc goes with path; with source, write pvc://CLAIM/PATH",
         lambda m: m.pvc is None or m.path is not None),
        (f"(!has(self.cache) && !has(self.credentialsSecret)) || ({DOWNLOADING})",
         "cache and credentialsSecret apply to hf:// and s3:// sources only",
         lambda m: (m.cache is None and m.credentials_secret is None) or _downloads(m)),
        ("!has(self.hub) || (has(self.source) && self.source.startsWith('hf://'))", "hub applies to hf:// sources only",
         lambda m: m.hub is None or (m.source or "").startswith("hf://")),
        ("!has(self.s3) || (has(self.source) && self.source.startsWith('s3://'))", "s3 applies to s3:// sources only",
         lambda m: m.s3 is None or (m.source or "").startswith("s3://")),
    ]

    @cached_property
    def parsed_source(self) -> ModelSource | None:
        """`source` parsed once (every builder of the children reads it); None for the older path (+ pvc) form."""
        return parse_source(self.source) if self.source else None


@dataclass(kw_only=True)
class EngineSpec:
    """The inference engine each replica runs."""

    kind: EngineChoice = prop(
        "auto", doc=("auto (vllm where the service's pools have GPUs, warmfleet where they are all CPU-only; status.engine "
                     "says which and why), warmfleet (`warmfleet serve`: no GPU attention backend, see docs/performance.md), "
                     "vllm (vLLM's OpenAI server) or fastdeploy (FastDeploy's api_server)."),
    )
    image: Optional[str] = prop(
        None, doc=("Engine image. Default: vllm/vllm-openai:v0.32.0 for vllm, FastDeploy's 2.3.0 CUDA 12.6 image for "
                   "fastdeploy (pinned by version: docs/gpu-cluster.md), and for warmfleet spec.server.image, else the "
                   "operator's --default-image (the engine image)."),
        minLength=1,
    )
    extra_args: list[str] = prop([], doc="Engine arguments appended after every rendered one (a repeated flag overrides the rendered value).", maxItems=64)


@dataclass(kw_only=True)
class ServerSpec:
    """The server (engine) pods."""

    image: Optional[str] = prop(
        None, doc="One image with the `warmfleet` command for the router, the fetch-model step and (engine.kind warmfleet, engine.image unset) the engine. Default: the operator's --router-image (slim, no Paddle) for the router and fetch-model, its --default-image for the engine.",
        minLength=1,
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = prop("IfNotPresent", doc="Kubernetes image pull policy.")
    gpus_per_replica: int = prop(
        1, doc=("GPUs (nvidia.com/gpu, or gpuResource) per replica; replicas per node = GPUs per node ÷ this. Above 1 the engine "
                "runs tensor parallel (vllm, fastdeploy; warmfleet runs one device per replica). 0: replicas request no GPU and "
                "are packed by allocatable CPU (cpus) and host memory, engine warmfleet only (CPU attention); warmfleet's "
                "replicas on a pool without GPUs are sized so whatever this says (docs/sizing.md)."),
        minimum=0, maximum=16,
    )
    cpus: int = prop(4, doc="CPU cores requested per replica (also the limit).", minimum=1, maximum=512)
    engine_memory_gib: float = prop(
        16.0, doc="Host memory the engine needs besides its caches (runtime, weight staging), in GiB.", minimum=1, maximum=4096,
    )
    max_num_batched_tokens: int = prop(2048, doc="Token budget of one engine step; the encoder cache never drops below it.", minimum=1)
    gpu_resource: Optional[str] = prop(
        None, doc=("Extended resource a replica requests gpusPerReplica of, and that counts a node's GPUs (allocatable). "
                   "Default: nvidia.com/gpu, or amd.com/gpu on nodes that have it; e.g. gpu.intel.com/i915."),
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z]{2,}/[-._a-zA-Z0-9]+$", maxLength=253,
    )
    gpu_memory_gib: Optional[float] = prop(
        None, doc=("Memory per GPU, GiB, for nodes whose GPU memory nothing else tells: no nvidia.com/gpu.memory label "
                   "(GPU feature discovery), a product and an instance type the operator's tables do not know "
                   "(status.pools[].inputs.sources.gpuMemory says which source each pool's figure came from)."),
        minimum=1, maximum=4096,
    )
    network_policy: bool = prop(
        True, doc=("Render a NetworkPolicy over the server pods: their KV-event ports admit only this service's routers "
                   "(endpoint pickers), their HTTP port also the operator's namespace (and, in gateway mode, any pod: the "
                   "gateway's proxies). false: no policy (your own, or none; docs/security.md)."),
    )
    extra_args: list[str] = prop([], doc="Extra engine arguments appended after the rendered ones, before engine.extraArgs (kept for compatibility; prefer engine.extraArgs).", maxItems=64)
    pod: Optional[ServerPodOverlay] = prop(
        None, doc=("Kubernetes pod fields added to the server pods of every pool (tolerations, affinity, nodeSelector, env, "
                   "imagePullSecrets, priorityClassName, volumes, ...); what the operator sets itself is refused (docs/pod-overlays.md)."),
    )


@dataclass(kw_only=True)
class PoolBounds:
    """Replica bounds of one node pool under autoscaling."""

    name: str = prop(doc="A spec.pools name (bounds each of its node shapes) or a pool name from status.pools.",
                     pattern=DNS_LABEL, maxLength=63)
    min_replicas: int = prop(0, doc="Fewest replicas in the pool.", minimum=0)
    max_replicas: Optional[int] = prop(None, doc="Most replicas in the pool (default: what its nodes can host).", minimum=0)

    RULES: ClassVar[list[Rule]] = [
        ("!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas",
         lambda s: s.max_replicas is None or s.min_replicas <= s.max_replicas),
    ]


@dataclass(kw_only=True)
class Autoscaling:
    """Replica bounds for spec.replicas (kubectl scale, the scale subresource); with a target, the operator scales itself."""

    min_replicas: int = prop(1, doc="Fewest replicas; spec.replicas below it is raised to it.", minimum=0)
    max_replicas: int = prop(doc="Most replicas; spec.replicas above it is lowered to it.", minimum=1)
    target_queued_prefill_tokens: Optional[int] = prop(
        None, doc=("Target uncached prompt tokens waiting for their first token per replica, as the routers count them; "
                   "the operator sets spec.replicas to keep the fleet's average near it (docs/autoscaling.md)."),
        minimum=1,
    )
    target_ttft_p90_seconds: Optional[float] = prop(
        None, doc="Target 90th-percentile time to first token of streamed requests, seconds, from the routers' histogram.",
        minimum=0.001, maximum=600,
    )
    protect_hit_ratio: bool = prop(
        True, doc="No scale-in while the fleet's cached-token ratio is falling (removing a replica would drop more cache).",
    )
    hit_ratio_drop: float = prop(
        0.02, doc="A fall of the cached-token ratio by more than this (absolute, over the metrics window) counts as falling.",
        minimum=0, maximum=1,
    )
    metrics_window_seconds: int = prop(60, doc="Window over which queued tokens are averaged and TTFT p90 and the hit ratio are computed.",
                                       minimum=10, maximum=3600)
    scale_up_stabilization_seconds: int = prop(
        0, doc="Scale out to the lowest recommendation of this window (0: at once).", minimum=0, maximum=3600,
    )
    scale_down_stabilization_seconds: int = prop(
        300, doc="Scale in only to the highest recommendation of this window, so a dip does not remove warm caches.",
        minimum=0, maximum=3600,
    )
    pools: list[PoolBounds] = prop([], doc="Per-pool bounds where pools differ; the total is split over pools within them.",
                                   maxItems=16)

    RULES: ClassVar[list[Rule]] = [
        ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas",
         lambda s: s.min_replicas <= s.max_replicas),
        ("!has(self.pools) || self.pools.all(p, self.pools.exists_one(q, q.name == p.name))",
         "autoscaling pool names must be unique", lambda s: len({p.name for p in s.pools}) == len(s.pools)),
    ]

    @property
    def enabled(self) -> bool:
        """Whether the operator scales by itself (a target is set), not only clamps spec.replicas."""
        return self.target_queued_prefill_tokens is not None or self.target_ttft_p90_seconds is not None

    def clamp(self, replicas: int) -> int:
        """`replicas` within [minReplicas, maxReplicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(kw_only=True)
class NamedPool:
    """A named subset of the selected nodes; each still splits by node shape."""

    name: str = prop(doc="Pool name, used in Deployment names.", pattern=DNS_LABEL, maxLength=20)
    node_selector: dict[str, str] = prop({}, doc="Labels a node must carry to belong to this pool (on top of spec.nodeSelector).")


@dataclass(kw_only=True)
class CacheSpec:
    """KV, encoder and processor caches."""

    block_size: int = prop(64, doc="Tokens per KV block.", enum=[16, 32, 64, 128, 256])
    prefix_caching: bool = prop(True, doc="Reuse cached KV blocks across requests.")
    swap_space: GiBSize = prop(GiBSize(), doc="CPU swap tier for evicted KV blocks per replica, in GiB (--swap-space).")
    encoder_cache: TokenSize = prop(TokenSize(), doc="Vision-encoder output cache per replica, in tokens (--max-encoder-cache).")
    processor_cache: GiBSize = prop(GiBSize(), doc="Preprocessed-image cache per replica, in GiB (--max-processor-cache).")
    host_reserve_fraction: float = prop(0.1, doc="Share of a node's allocatable memory kept free for kubelet, daemons and page cache.", minimum=0, maximum=0.9)
    swap_fraction: float = prop(0.9, doc="Share of the host memory left per replica (after engine and processor cache) given to the swap tier.", minimum=0, maximum=1)
    encoder_fraction: float = prop(0.05, doc="Share of each replica's GPU memory set aside for the encoder cache.", minimum=0, maximum=0.5)
    node_tier: NodeTierSpec = prop(NodeTierSpec(), doc=(
        "One cache per node (`warmfleet node-tier`, a DaemonSet per pool) shared by the service's replicas there, in "
        "place of their own swap tier (--swap-space 0); warmfleet's engine only (docs/node-tier-operator.md)."))


@dataclass(kw_only=True)
class SecretKeyRef:
    """A key in a Secret of the same namespace."""

    name: str = prop(doc="Secret name.", pattern=DNS_LABEL, maxLength=253)
    key: str = prop("api-key", doc="Key within the Secret.", minLength=1)


@dataclass(kw_only=True)
class KeysSecretRef:
    """A Secret of the same namespace holding a JSON object of client API keys to cache salts."""

    name: str = prop(doc="Secret name.", pattern=DNS_LABEL, maxLength=253)
    key: str = prop("keys.json", doc="Key within the Secret: JSON {\"API key\": \"salt\" or null} (null: a salt derived from the key).",
                    minLength=1, maxLength=253, pattern=r"^[-._a-zA-Z0-9]+$")


RouterMode = Literal["proxy", "gateway"]
FailureMode = Literal["FailOpen", "FailClose"]
DEFAULT_FAILURE_MODE: FailureMode = "FailClose"  # the InferencePool CRD's default for endpointPickerRef.failureMode (GIE v1)


@dataclass(kw_only=True)
class GatewayRef:
    """A Gateway API Gateway the operator attaches an HTTPRoute to (gateway mode)."""

    name: str = prop(doc="Gateway name.", pattern=DNS_LABEL, maxLength=253)
    namespace: Optional[str] = prop(None, doc="Gateway namespace (default: the InferenceService's); another namespace's "
                                              "Gateway must allow routes from this one (listeners[].allowedRoutes).",
                                    pattern=DNS_LABEL, maxLength=63)
    section_name: Optional[str] = prop(None, doc="The Gateway listener to attach to (default: every listener that allows the route).",
                                       pattern=DNS_LABEL, maxLength=253)


@dataclass(kw_only=True)
class PickerCertificate:
    """The endpoint picker's gRPC certificate from a Secret (gateway mode), instead of the self-signed one."""

    secret_name: str = prop(doc="A Secret of the same namespace with `tls.crt` and `tls.key` (type kubernetes.io/tls, as "
                                "cert-manager writes it), mounted into the picker pods.", pattern=DNS_LABEL, maxLength=253)
    verify_clients_with: Optional[str] = prop(
        None, doc="A key of that Secret holding a PEM CA (e.g. `ca.crt`): the picker then accepts only gateways with a "
                  "client certificate that CA signed (mutual TLS).", minLength=1, maxLength=253, pattern=r"^[-._a-zA-Z0-9]+$")


@dataclass(kw_only=True)
class RouterSpec:
    """The cache-affinity router: the OpenAI endpoint (proxy mode) or a gateway's endpoint picker (gateway mode)."""

    mode: RouterMode = prop(
        "proxy", doc=("proxy: `warmfleet route` pods behind a Service are the OpenAI endpoint. gateway: an InferencePool "
                      "(Gateway API Inference Extension) over the server pods, whose endpoint picker is `warmfleet epp`; a "
                      "Gateway (Istio, kgateway, Envoy Gateway, ...) carries the traffic (docs/gateway.md)."),
    )
    gateway: Optional[GatewayRef] = prop(
        None, doc="gateway mode: the Gateway to attach an HTTPRoute to (backendRef: the InferencePool). Unset: no HTTPRoute is rendered; route to the pool yourself.",
    )
    failure_mode: FailureMode = prop(
        DEFAULT_FAILURE_MODE, doc=("gateway mode: what the gateway does while the endpoint picker does not answer: FailClose "
                                   "rejects requests (the GIE default), FailOpen sends them to a server pod it picks itself "
                                   "(InferencePool endpointPickerRef.failureMode). Ignored in proxy mode."),
    )
    picker_certificate: Optional[PickerCertificate] = prop(
        None, doc=("gateway mode: the endpoint picker's gRPC certificate from a Secret (TLS either way: without it the "
                   "picker makes a self-signed one at startup, as GIE's reference picker does). Ignored in proxy mode."),
    )
    replicas: int = prop(2, doc="Router pods (endpoint-picker pods in gateway mode).", minimum=1, maximum=64)
    load_bound: float = prop(1.25, doc="A replica loaded beyond this multiple of the mean loses its prefix affinity.", minimum=1, maximum=10)
    api_key_secret: Optional[SecretKeyRef] = prop(None, doc="Secret holding the API key clients must send (router and servers read WARMFLEET_API_KEY).")
    keys_secret: Optional[KeysSecretRef] = prop(
        None, doc=("Per-client isolation: a Secret with the client keys and one cache salt per client or team, mounted into the "
                   "routers (endpoint pickers) and, for engine warmfleet, the server pods as `--api-keys-file`; clients "
                   "with different salts never share cached prefixes, through the router or straight at a replica. "
                   "Without it every client of apiKeySecret shares one salt (docs/security.md)."),
    )
    kv_events_curve: bool = prop(
        False, doc=("Authenticate and encrypt the replicas' KV-event sockets with ZMQ CURVE (engine warmfleet only): the "
                    "operator generates the replicas' and the routers' (pickers') key pairs once into the Secret "
                    "NAME-kv-curve (never rotated by a reconcile: delete it to rotate) and passes them as "
                    "--kv-events-curve-*; the node tiers (cache.nodeTier) publish with the replicas' pair; a pod "
                    "without the routers' key gets no event, whatever the network allows."),
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = prop("ClusterIP", doc="Type of the router Service.")
    port: int = prop(8000, doc="Port of the router Service (the endpoint URL's port; proxy mode).", minimum=1, maximum=65535)
    pod: Optional[RouterPodOverlay] = prop(
        None, doc=("Kubernetes pod fields added to the router pods (proxy mode) or endpoint-picker pods (gateway mode): "
                   "tolerations, affinity, nodeSelector, env, resources, ...; what the operator sets itself is refused (docs/pod-overlays.md)."),
    )

    RULES: ClassVar[list[Rule]] = [
        ("!has(self.gateway) || self.mode == 'gateway'", "gateway applies to mode gateway only",
         lambda r: r.gateway is None or r.mode == "gateway"),
    ]


@dataclass(kw_only=True)
class DisruptionSpec:
    """Rollouts, drains and startup."""

    max_unavailable: int = prop(1, doc="Server replicas per pool that may be down during a rollout or a voluntary eviction (PDB).", minimum=0)
    drain_seconds: int = prop(30, doc="Seconds a stopping replica keeps serving in-flight requests (preStop) before SIGTERM.", minimum=0, maximum=3600)
    startup_timeout_seconds: int = prop(1800, doc="Seconds a replica may take to load weights before it is restarted.", minimum=60, maximum=86400)


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class AdapterSpec:
    """A LoRA adapter served next to the model; added and removed at run time, without restarting replicas."""

    name: str = prop(doc="Name clients send as `model` to select the adapter; unique, not the served model name.",
                     pattern=DNS_LABEL, maxLength=63)
    source: str = prop(
        doc=("Where the PEFT adapter directory comes from: hf://ORG/NAME[@REVISION] or s3://BUCKET[/PREFIX] (fetched into "
             "the node-local model cache under the service's adapters directory at pod start and, on running pods, by the "
             "adapter-fetch sidecar), pvc://CLAIM/PATH on the model's own claim, or an absolute path in the image."),
        minLength=1, maxLength=1024,
    )
    rank: Optional[int] = prop(
        None, doc="The adapter's rank r, if known before its files are read: checked against spec.lora.maxLoraRank and shown in status.",
        minimum=1, maximum=1024,
    )
    target_modules: list[Literal[LORA_PROJECTIONS]] = prop(  # type: ignore[valid-type]
        [], doc="The projections it adapts, if known (default: all seven), for the size shown in status.", maxItems=7)

    RULES: ClassVar[list[Rule]] = [
        (f"self.source.matches('{SOURCE_PATTERN}') && !self.source.matches('{DOTDOT_PATTERN}')",
         f"source must be {SOURCE_FORMS}, without '..' segments", lambda a: check_source(a.source) is None),
    ]


@dataclass(kw_only=True)
class ModelShape:
    """The language model's shapes that size a LoRA adapter (default: config.json's, for hf:// and s3:// models)."""

    num_layers: Optional[int] = prop(None, doc="Decoder layers (config.json num_hidden_layers).", minimum=1, maximum=1024)
    intermediate_size: Optional[int] = prop(None, doc="MLP width (config.json intermediate_size).", minimum=1, maximum=1048576)
    num_attention_heads: Optional[int] = prop(None, doc="Query heads (default: q/k/v/o taken as hiddenSize x hiddenSize).",
                                              minimum=1, maximum=1024)
    num_key_value_heads: Optional[int] = prop(None, doc="KV heads (default: numAttentionHeads, the largest).", minimum=1, maximum=1024)
    head_dim: Optional[int] = prop(None, doc="Width of one head (default: hiddenSize / numAttentionHeads).", minimum=1, maximum=4096)


@dataclass(kw_only=True)
class LoraSpec:
    """Per-replica LoRA limits. Setting this section enables adapters (it is part of the pod template: changing it rolls
    the replicas); spec.adapters is not, and changes at run time."""

    max_loras: int = prop(1, doc="Adapters resident on the accelerator at once (--max-loras); sized out of GPU memory.",
                          minimum=1, maximum=256)
    max_lora_rank: int = prop(16, doc="Largest adapter rank accepted (--max-lora-rank); sizing assumes it for every adapter.",
                              minimum=1, maximum=1024)
    max_cpu_loras: Optional[int] = prop(
        None, doc="Adapters kept in host memory (--max-cpu-loras; default maxLoras, at least maxLoras); sized into the pod's memory request.",
        minimum=1, maximum=4096,
    )
    credentials_secret: Optional[str] = prop(
        None, doc="Secret with the adapters' download credentials (HF_TOKEN; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), for every hf:// and s3:// adapter.",
        pattern=DNS_LABEL, maxLength=253,
    )
    hub: Optional[HubSpec] = prop(None, doc="Hub settings for hf:// adapters.")
    s3: Optional[S3Spec] = prop(None, doc="Store settings for s3:// adapters.")
    model_shape: Optional[ModelShape] = prop(
        None, doc="The language model's shapes for sizing adapters; needed (numLayers, intermediateSize) when config.json cannot be read.",
    )
    fetch_interval_seconds: int = prop(30, doc="How often the adapter-fetch sidecar of a running pod looks for new hf:// and s3:// adapters.",
                                       minimum=5, maximum=3600)
    admin_key_secret: Optional[SecretKeyRef] = prop(
        None, doc=("engine warmfleet: the key of the servers' and routers' admin routes (load/unload adapters, drain), "
                   "which the operator reads and sends. Default: a random key the operator generates once per service "
                   "into the Secret NAME-admin (key admin-key), never the client API key. vLLM has no separate admin "
                   "key: its runtime LoRA routes take the API key."),
    )

    RULES: ClassVar[list[Rule]] = [
        ("!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras", "maxCpuLoras must be >= maxLoras",
         lambda s: s.max_cpu_loras is None or s.max_cpu_loras >= s.max_loras),
    ]

    @property
    def num_cpu_loras(self) -> int:
        """Adapters in host memory: maxCpuLoras, else maxLoras (the engines' default)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(kw_only=True)
class InferenceServiceSpec:
    """Desired state of an InferenceService."""

    model: ModelSpec = prop(doc="The checkpoint to serve.")
    engine: EngineSpec = prop(EngineSpec(), doc="The inference engine of the replicas.")
    server: ServerSpec = prop(ServerSpec(), doc="Server pods.")
    replicas: Optional[int] = prop(
        None, doc="Server replicas across all pools (default 1, or autoscaling.minReplicas); with autoscaling, clamped to its bounds (the scale subresource writes it).",
        minimum=0, maximum=4096)
    autoscaling: Optional[Autoscaling] = prop(None, doc="Replica bounds, and the operator's cache-aware autoscaler when a target is set.")
    node_selector: dict[str, str] = prop({}, doc="Labels a node must carry to host servers.")
    pools: list[NamedPool] = prop([], doc="Optional named pools; without them every selected node shape is a pool.", maxItems=16)
    cache: CacheSpec = prop(CacheSpec(), doc="Cache sizes.")
    router: RouterSpec = prop(RouterSpec(), doc="Router.")
    disruption: DisruptionSpec = prop(DisruptionSpec(), doc="Disruption and startup.")
    lora: Optional[LoraSpec] = prop(None, doc="LoRA limits per replica; set it to serve spec.adapters (docs/lora.md).")
    tracing: Optional[TracingSpec] = prop(None, doc="OpenTelemetry spans of the service's pods (docs/observability.md); "
                                                    "unset: none (trace headers still pass through).")
    adapters: list[AdapterSpec] = prop(
        [], doc="LoRA adapters, loaded into and unloaded from running replicas by the operator (no restart); needs spec.lora.",
        maxItems=256,
    )

    RULES: ClassVar[list[Rule]] = [
        ("!has(self.pools) || self.pools.all(p, self.pools.exists_one(q, q.name == p.name))", "pool names must be unique",
         lambda s: len({p.name for p in s.pools}) == len(s.pools)),
        ("!has(self.adapters) || size(self.adapters) == 0 || has(self.lora)",
         "adapters need spec.lora (the limits every replica starts with)", lambda s: not s.adapters or s.lora is not None),
        ("!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
         "adapter names must be unique", lambda s: len({a.name for a in s.adapters}) == len(s.adapters)),
    ]

    def desired_replicas(self) -> int:
        """Replicas to run: spec.replicas (within the autoscaling bounds), else autoscaling.minReplicas, else 1."""
        if self.autoscaling is not None:
            return self.autoscaling.clamp(self.replicas if self.replicas is not None else self.autoscaling.min_replicas)
        if self.replicas is not None:
            return self.replicas
        return 1


# The served name is immutable: a transition rule on the model object (oldSelf exists only on update).
SERVED_NAME_RULE = {
    "rule": "has(self.servedName) == has(oldSelf.servedName) && (!has(self.servedName) || self.servedName == oldSelf.servedName)",
    "message": "model.servedName is immutable",
}


# ---- status ----

@dataclass(kw_only=True)
class Condition:
    """A standard Kubernetes condition."""

    type: Literal["Ready", "Progressing", "Degraded", "InvalidSpec", "ModelConfigUnavailable", "EngineFit", "GPUMemoryKnown",
                  "TaintsTolerated", "NodeTierReady", "InferencePoolReady", "EndpointPickerReady",
                  "HTTPRouteReady"] = prop(doc="Condition type.")
    status: Literal["True", "False", "Unknown"] = prop(doc="Condition status.")
    reason: str = prop(doc="CamelCase reason.")
    message: str = prop("", doc="Human-readable detail.")
    last_transition_time: Optional[str] = prop(None, doc="When status last changed (RFC 3339).", format="date-time")
    observed_generation: Optional[int] = prop(None, doc="Generation the condition was computed from.", format="int64")


@dataclass(kw_only=True)
class PoolShape:
    """What nodes of one pool share."""

    gpu_product: str = prop(doc="nvidia.com/gpu.product label ('unknown' if absent).")
    gpu_memory_mib: int = prop(doc="Per-GPU memory, MiB, from inputs.sources.gpuMemory's source (0: no source knows it; GPUMemoryKnown says so).",
                               format="int64")
    gpus_per_node: int = prop(doc="Allocatable GPUs (gpuResource) per node.")
    gpu_resource: str = prop("nvidia.com/gpu", doc="The extended resource counted as GPUs and requested by replicas.")
    host_memory_bytes: int = prop(doc="Smallest allocatable host memory among the pool's nodes, bytes.", format="int64")
    cpu_millis: int = prop(0, doc="Smallest allocatable CPU among the pool's nodes, millicores (packs CPU-only replicas: docs/sizing.md).",
                           format="int64")


@dataclass(kw_only=True)
class PoolSizes:
    """Per-replica sizes derived for one pool, as rendered into pod args and resources (flags per engine: docs/sizing.md)."""

    replicas_per_node: int = prop(doc=("floor(GPUs per node / GPUs per replica); CPU-only replicas: floor(CPUs per node / "
                                       "server.cpus), fewer while memory does not fit (inputs.sources.replicasPerNode)."))
    swap_space_gib: float = prop(doc="CPU KV tier, GiB (warmfleet and FastDeploy --swap-space, vLLM --kv-offloading-size; 0 disables).")
    encoder_cache_tokens: Optional[int] = prop(
        None, doc="Encoder cache, tokens (--max-encoder-cache); absent when the engine sizes its own (vLLM).", format="int64",
    )
    processor_cache_gib: float = prop(doc="Processor cache, GiB (--max-processor-cache, vLLM --mm-processor-cache-gb).")
    gpu_memory_utilization: Optional[float] = prop(
        None, doc="--gpu-memory-utilization rendered for a peer engine (absent for warmfleet).",
    )
    memory_bytes: int = prop(doc="Pod memory request = limit, bytes.", format="int64")
    shm_bytes: int = prop(doc="/dev/shm size limit, bytes.", format="int64")
    lora_device_bytes: Optional[int] = prop(
        None, doc="Accelerator memory for resident LoRA adapters: maxLoras x the budgeted adapter (spec.lora).", format="int64")
    lora_host_bytes: Optional[int] = prop(
        None, doc="Host memory for LoRA adapters: maxCpuLoras x the budgeted adapter, inside memoryBytes (spec.lora).", format="int64")
    hash: str = prop(doc="Digest of the sizes; a change rolls the pool.")


@dataclass(kw_only=True)
class PoolInputs:
    """The numbers the sizes came from."""

    host_bytes_per_replica: int = prop(doc="Host memory per replica after the reserve, bytes.", format="int64")
    engine_bytes: int = prop(doc="Engine host memory, bytes.", format="int64")
    gpu_bytes_per_replica: int = prop(doc="GPU memory per replica, bytes.", format="int64")
    bytes_per_encoder_token: int = prop(doc="hiddenSize x dtype bytes.")
    bytes_per_adapter: Optional[int] = prop(
        None, doc="The adapter every LoRA slot is budgeted for: layers x maxLoraRank x sum over projections of (in + out) x dtype bytes.",
        format="int64")
    sources: dict[str, str] = prop({}, doc=("Per size: auto, fixed, min or max (which bound clamped it); lora: the adapter's inputs; "
                                             "gpuMemory: label (nvidia.com/gpu.memory), product (the table of nvidia.com/gpu.product "
                                             "values), instance-type (node.kubernetes.io/instance-type), spec (server.gpuMemoryGib) "
                                             "or unknown (none (CPU-only) for replicas without GPUs); replicasPerNode "
                                             "(CPU-only replicas): cpu or memory, the limit that held."))


@dataclass(kw_only=True)
class PoolStatus:
    """One node pool."""

    name: str = prop(doc="Pool name (suffix of its Deployment).")
    engine: EngineKind = prop("warmfleet", doc="Engine the pool's replicas run (spec.engine.kind).")
    nodes: list[str] = prop([], doc="Nodes in the pool.")
    shape: Optional[PoolShape] = prop(None, doc="Node shape.")
    fits: bool = prop(True, doc="Whether a replica fits on the pool's nodes.")
    message: str = prop("", doc="Why the pool cannot host replicas, if it cannot.")
    replicas: int = prop(0, doc="Replicas assigned to the pool.")
    ready_replicas: int = prop(0, doc="Ready replicas of the pool's Deployment.")
    sizes: Optional[PoolSizes] = prop(None, doc="Derived sizes.")
    inputs: Optional[PoolInputs] = prop(None, doc="Inputs of the sizes.")
    node_tier: Optional[NodeTierStatus] = prop(None, doc="The pool's node tier and its inputs (spec.cache.nodeTier on).")


@dataclass(kw_only=True)
class EngineStatus:
    """The engine the replicas run, and why that one."""

    kind: EngineKind = prop(doc="The engine every pool runs.")
    chosen_by: Literal["spec", "auto"] = prop(doc="spec (engine.kind names it) or auto (picked from the pools' GPUs).")
    reason: str = prop("", doc="Why this engine, in a sentence (the pools that decided it).")


LearnedFrom = Literal["config.json", "spec", "default"]


@dataclass(kw_only=True)
class LearnedInt:
    """A value sizing and rendering use, and where it came from."""

    value: int = prop(doc="The value in use.", format="int64")
    from_: LearnedFrom = prop(doc="spec (explicit, always wins), config.json (read by the operator) or default.")


@dataclass(kw_only=True)
class LearnedStr:
    """A value sizing and rendering use, and where it came from."""

    value: str = prop(doc="The value in use.")
    from_: LearnedFrom = prop(doc="spec (explicit, always wins), config.json (read by the operator) or default.")


@dataclass(kw_only=True)
class LearnedValues:
    """The model facts the sizes were computed from."""

    hidden_size: LearnedInt = prop(doc="Encoder-output token width (encoder-cache bytes per token = hiddenSize x dtype bytes).")
    dtype: LearnedStr = prop(doc="Weight and activation dtype, rendered into the engine's --dtype.")


@dataclass(kw_only=True)
class ConfigJson:
    """What the model's config.json says (hf:// and s3:// sources)."""

    architecture: str = prop("", doc="architectures[0], e.g. Qwen2VLForConditionalGeneration.")
    model_type: str = prop("", doc="model_type.")
    hidden_size: Optional[int] = prop(None, doc="The language model's hidden_size (top level, or text_config's).", format="int64")
    dtype: Optional[str] = prop(None, doc="torch_dtype as written (used only if it is bfloat16, float16 or float32).")
    vision: bool = prop(False, doc="Whether it has a vision tower config (vision_config): a multimodal model.")
    vision_hidden_size: Optional[int] = prop(None, doc="The vision tower's own width, for reference.", format="int64")
    num_layers: Optional[int] = prop(None, doc="num_hidden_layers (sizes LoRA adapters).", format="int64")
    intermediate_size: Optional[int] = prop(None, doc="intermediate_size, the MLP width (sizes LoRA adapters).", format="int64")
    num_attention_heads: Optional[int] = prop(None, doc="num_attention_heads (sizes LoRA adapters).", format="int64")
    num_key_value_heads: Optional[int] = prop(None, doc="num_key_value_heads (sizes LoRA adapters).", format="int64")
    head_dim: Optional[int] = prop(None, doc="head_dim, when config.json says (sizes LoRA adapters).", format="int64")


@dataclass(kw_only=True)
class ModelConfigStatus:
    """What the operator knows about the model and where each value came from."""

    source: str = prop("", doc="spec.model.source (or path) this is about.")
    revision: str = prop("", doc="Hub commit, or S3 ETag, of the config.json read.")
    config_json: Optional[ConfigJson] = prop(None, doc="Summary of config.json, when it was read.")
    learned: LearnedValues = prop(doc="The hidden size and dtype in use, each with where it came from.")
    message: str = prop("", doc="Why config.json could not be read, when it could not.")


@dataclass(kw_only=True)
class WarmupStatus:
    """The routers' warm-up state of the server replicas (their /v1/router/replicas), summed over routers."""

    warming: int = prop(0, doc="Replicas being warmed (hot prefixes replayed into them; no traffic yet).")
    warm: int = prop(0, doc="Replicas routable for traffic.")
    down: int = prop(0, doc="Replicas known to the routers but failing health checks.")
    warmed_replicas: int = prop(0, doc="Replicas that went through a warm-up (their last one is summed below).")
    replayed_prefixes: int = prop(0, doc="Hot prefixes replayed in those warm-ups.", format="int64")
    replayed_tokens: int = prop(0, doc="Prompt tokens replayed in those warm-ups.", format="int64")
    longest_seconds: float = prop(0.0, doc="The longest of those warm-ups, seconds.")


@dataclass(kw_only=True)
class AutoscalingStatus:
    """The operator's last autoscaling decision (written when it changes, not on every scrape)."""

    desired_replicas: int = prop(0, doc="Replicas the autoscaler asked for (spec.replicas).")
    pools: dict[str, int] = prop({}, doc="Their split over pools.")
    reason: str = prop("", doc="CamelCase reason: ScaleOut, ScaleIn, HitRatioFalling, Stabilizing, WithinTarget, NoMetrics, ...")
    message: str = prop("", doc="The figures the decision came from.")
    last_scale_time: Optional[str] = prop(None, doc="When the autoscaler last changed spec.replicas (RFC 3339).",
                                          format="date-time")


@dataclass(kw_only=True)
class AdapterStatus:
    """One spec.adapters item on the running replicas (the operator's adapter pass)."""

    name: str = prop(doc="Adapter name.")
    source: str = prop("", doc="Its source.")
    path: str = prop("", doc="Its directory inside the server pods, as loaded.")
    loaded_replicas: int = prop(0, doc="Ready replicas that have it loaded.")
    ready_replicas: int = prop(0, doc="Ready replicas the operator reached or tried.")
    message: str = prop("", doc="Why it is not loaded everywhere (files not fetched yet, refused by the engine, ...).")


@dataclass(kw_only=True)
class InferenceServiceStatus:
    """Observed state of an InferenceService."""

    observed_generation: Optional[int] = prop(None, doc="metadata.generation last reconciled.", format="int64")
    conditions: list[Condition] = prop([], doc=("Ready, Progressing, Degraded, InvalidSpec, ModelConfigUnavailable, EngineFit, GPUMemoryKnown; "
                                                 "NodeTierReady while a pool has a node tier; in gateway mode also InferencePoolReady, "
                                                 "EndpointPickerReady and (spec.router.gateway) HTTPRouteReady."))
    replicas: int = prop(0, doc="Server replicas that exist (scale subresource).")
    desired_replicas: int = prop(0, doc="Server replicas wanted.")
    ready_replicas: int = prop(0, doc="Server replicas ready.")
    ready: str = prop("False", doc="Ready condition status, for printing.")
    selector: str = prop("", doc="Label selector of the server pods (scale subresource).")
    endpoint: str = prop("", doc=("OpenAI base URL: the router Service's (proxy mode), the Gateway's address once it has one "
                                   "(gateway mode with spec.router.gateway), else empty (gateway mode: the pool is reached "
                                   "through a route of your own)."))
    model: str = prop("", doc="Served model name.")
    engine: Optional[EngineStatus] = prop(None, doc="The engine the replicas run and why (spec.engine.kind, or auto's choice).")
    pools: list[PoolStatus] = prop([], doc="Node pools and their sizes.")
    model_config: Optional[ModelConfigStatus] = prop(None, doc="Model facts (hidden size, dtype, config.json) and their origin.")
    warmup: Optional[WarmupStatus] = prop(None, doc="Warm-up state of the replicas, as the routers report it.")
    autoscaling: Optional[AutoscalingStatus] = prop(None, doc="The autoscaler's last decision (spec.autoscaling with a target).")
    adapters: list[AdapterStatus] = prop([], doc="spec.adapters on the ready replicas: loaded on how many, and why not (spec.lora).")


def parse_spec(data: Any) -> InferenceServiceSpec:
    """Parse and validate `spec` (defaults applied); raises SpecError."""
    return from_dict(InferenceServiceSpec, data if data is not None else {}, "spec")


def served_name(spec: InferenceServiceSpec, name: str) -> str:
    """The model name clients use."""
    return spec.model.served_name or name

