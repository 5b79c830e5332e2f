"""The model facts sizing uses (hidden size, dtype): config.json of hf:// and s3:// sources, read off the event
loop with the credentials the spec names and cached; resolved against spec.model, where explicit values win;
the status section and the ModelConfigUnavailable condition that say where each value came from. No kopf.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from warmfleet.kube import Kube, KubeError
from warmfleet.operator.passes import bounded_http
from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.planning.service_status import merge_conditions
from warmfleet.operator.spec.inference_service import (
    Condition,
    ConfigJson,
    DEFAULT_DTYPE,
    DEFAULT_HIDDEN_SIZE,
    InferenceServiceSpec,
    LearnedInt,
    LearnedStr,
    LearnedValues,
    ModelConfigStatus,
    ModelShape,
    parse_spec,
)
from warmfleet.operator.spec.schema import SpecError, to_dict
from warmfleet.source import ConfigSummary, DTYPES, parse_source

CONDITION = "ModelConfigUnavailable"
READ_TIMEOUT_S = 15.0  # one attempt to read config.json (the hub's HEAD + GET, or one S3 GET)
FRESH_S = 900.0  # a config.json read is trusted this long (a branch may move), then read again
RETRY_S = 30.0  # a failed read is tried again after this
RETRY_DELAY_S = 60.0  # while config.json cannot be read, a timer reconciles the service this often
STATUS_MESSAGE_CHARS = 300  # of a read's error, as status.modelConfig.message and the condition carry it


@dataclass(frozen=True)
class Learned:
    """One attempt to read a source's config.json, or what status remembers of an earlier one."""

    source: str
    summary: ConfigSummary | None
    revision: str = ""
    error: str = ""  # why it could not be read ('' when it was)
    reason: str = ""  # CamelCase: Unauthorized, NotFound, Unreachable, MissingSecret, BadConfig, ...
    earlier: bool = False  # `summary` is the one read before, kept while the source cannot be read


@dataclass
class ConfigCache:
    """Reads per (namespace, source, endpoints, Secret), fresh for FRESH_S (failures: RETRY_S). Lives in OperatorState."""

    clock: Callable[[], float] = time.monotonic
    entries: dict[tuple[str, ...], tuple[float, Learned]] = field(default_factory=dict)

    def get(self, key: tuple[str, ...]) -> Learned | None:
        hit = self.entries.get(key)
        return hit[1] if hit and hit[0] > self.clock() else None

    def put(self, key: tuple[str, ...], learned: Learned) -> Learned:
        self.entries[key] = (self.clock() + (RETRY_S if learned.error else FRESH_S), learned)
        return learned


def downloads(spec: InferenceServiceSpec) -> bool:
    """Whether the spec's model is fetched by an init container (hf://, s3://): then config.json is readable."""
    return bool(spec.model.source) and spec.model.source.startswith(("hf://", "s3://"))


def _decode(secret: Mapping[str, Any]) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out


def _read(spec: InferenceServiceSpec, secret: Mapping[str, str] | None, anonymous: bool,
          allowed: tuple[str, ...] | None = None) -> Learned:
    """Blocking: read and summarize config.json; every failure is a Learned with its error. `allowed` (the operator's
    reads, not `render`'s): the spec's endpoint is first checked like an image URL (bounded_http.endpoint_problem),
    redirects are not followed and the answer is capped."""
    m = spec.model
    src = parse_source(m.source or "")
    endpoint = (m.hub.endpoint if m.hub else None) if src.kind == "hf" else (m.s3.endpoint if m.s3 else None)
    if allowed is not None and endpoint:
        problem = bounded_http.endpoint_problem(endpoint, allowed)
        if problem:
            return Learned(src.raw, None, error=problem, reason="EndpointRefused")
    try:
        from warmfleet.fetch import FetchError, S3Credentials, read_config
    except ImportError as exc:  # the operator image lacks the fetch extra
        return Learned(m.source or "", None, error=f"cannot read config.json: {exc} (install warmfleet[fetch])", reason="NotInstalled")
    s = secret or {}
    creds = S3Credentials(s.get("AWS_ACCESS_KEY_ID"), s.get("AWS_SECRET_ACCESS_KEY"), s.get("AWS_SESSION_TOKEN")) \
        if s.get("AWS_ACCESS_KEY_ID") else None
    try:
        summary, revision = read_config(
            src, hf_token=s.get("HF_TOKEN"), hub_endpoint=m.hub.endpoint if m.hub else None, s3_creds=creds,
            s3_endpoint=m.s3.endpoint if m.s3 else None, s3_region=m.s3.region if m.s3 else None,
            anonymous=anonymous, timeout_s=READ_TIMEOUT_S, follow_redirects=allowed is None)
    except FetchError as exc:  # status carries it: one line, bounded (a tenant's endpoint chose the rest)
        message = exc.message if allowed is None else exc.message.strip().splitlines()[0][:STATUS_MESSAGE_CHARS]
        return Learned(src.raw, None, error=message, reason=exc.reason)
    return Learned(src.raw, summary, revision)


async def learn(cache: ConfigCache, kube: Kube, namespace: str, body: Mapping[str, Any],
                allowed: tuple[str, ...] = ()) -> Learned | None:
    """config.json of the service's hf:// or s3:// source (None for other sources or a spec that does not parse).

    Only the credentials the spec names are used (its Secret, read here), never the operator's own:
    a service must not learn about a model its own pods could not fetch.
    """
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return None
    if not downloads(spec):
        return None
    m = spec.model
    key = (namespace, m.source or "", m.hub.endpoint or "" if m.hub else "", m.s3.endpoint or "" if m.s3 else "",
           m.s3.region or "" if m.s3 else "", m.credentials_secret or "")
    hit = cache.get(key)
    if hit is not None:
        return with_earlier(hit, body)
    secret: dict[str, str] | None = None
    note = ""
    if m.credentials_secret:
        try:
            obj = await kube.get("Secret", namespace, m.credentials_secret)
        except KubeError as exc:
            if exc.status != 403:
                raise
            obj, note = {}, (f" (the operator may not read Secret {m.credentials_secret}: chart value "
                             "operator.readModelCredentials; it tried without credentials)")
        if obj is None:
            missing = Learned(m.source or "", None, error=f"Secret {namespace}/{m.credentials_secret} not found", reason="MissingSecret")
            return with_earlier(cache.put(key, missing), body)
        secret = _decode(obj)
    try:
        learned = await asyncio.wait_for(asyncio.to_thread(_read, spec, secret, True, allowed), READ_TIMEOUT_S * 2 + 5)
    except asyncio.TimeoutError:
        learned = Learned(m.source or "", None, error=f"reading config.json took longer than {READ_TIMEOUT_S * 2 + 5:g}s",
                          reason="Unreachable")
    if learned.error and note:
        learned = dataclasses.replace(learned, error=learned.error + note)
    return with_earlier(cache.put(key, learned), body)


def learn_now(body: Mapping[str, Any]) -> Learned | None:
    """For `warmfleet operator render`: read config.json now, with this machine's credentials (HF_TOKEN, AWS_*)."""
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return None
    return _read(spec, None, False) if downloads(spec) else None


def from_status(body: Mapping[str, Any]) -> Learned | None:
    """What the service's status remembers of config.json, if it is about the current source."""
    mc = ((body.get("status") or {}).get("modelConfig") or {})
    source = ((body.get("spec") or {}).get("model") or {}).get("source")
    if not source or mc.get("source") != source or not mc.get("configJson"):
        return None
    return Learned(source, ConfigSummary.from_dict(mc["configJson"]), str(mc.get("revision") or ""))


def with_earlier(learned: Learned, body: Mapping[str, Any]) -> Learned:
    """A failed read keeps using the config.json read before for the same source (status), still reporting the error."""
    if not learned.error or learned.summary is not None:
        return learned
    prior = from_status(body)
    if prior is None or prior.source != learned.source:
        return learned
    return dataclasses.replace(learned, summary=prior.summary, revision=prior.revision, earlier=True)


@dataclass(frozen=True)
class Resolved:
    """The hidden size and dtype sizing and rendering use, and where each came from."""

    hidden_size: int
    hidden_from: str
    dtype: str
    dtype_from: str
    summary: ConfigSummary | None = None  # config.json's, for the shapes that size LoRA adapters


def resolve(spec: InferenceServiceSpec, learned: Learned | None) -> Resolved:
    """Explicit spec values win, then config.json, then defaults; raises SpecError when the hidden size is
    needed (the engine takes our encoder-cache size) for a downloaded model whose config.json says nothing."""
    m = spec.model
    s = learned.summary if learned else None
    if m.hidden_size is not None:
        hidden, hidden_from = m.hidden_size, "spec"
    elif s is not None and s.hidden_size:
        hidden, hidden_from = s.hidden_size, "config.json"
    elif downloads(spec) and _takes_our_encoder_cache(spec):
        why = (f"config.json could not be read ({learned.error})" if learned and learned.error and s is None
               else "config.json has no hidden_size" if s is not None else "config.json has not been read")
        raise SpecError("spec.model.hiddenSize", f"is needed to size the encoder cache and {why}; set spec.model.hiddenSize")
    else:
        hidden, hidden_from = DEFAULT_HIDDEN_SIZE, "default"
    if m.dtype is not None:
        dtype, dtype_from = m.dtype, "spec"
    elif s is not None and s.dtype in DTYPES:
        dtype, dtype_from = str(s.dtype), "config.json"
    else:
        dtype, dtype_from = DEFAULT_DTYPE, "default"
    return Resolved(hidden, hidden_from, dtype, dtype_from, s)


def effective(spec: InferenceServiceSpec, r: Resolved) -> InferenceServiceSpec:
    """The spec with the resolved hidden size and dtype filled in (what sizing and rendering read), and with
    spec.lora, the model shapes config.json gives where spec.lora.modelShape leaves them unset."""
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, hidden_size=r.hidden_size, dtype=r.dtype))
    if spec.lora is None or r.summary is None:
        return spec
    s, shape = r.summary, spec.lora.model_shape or ModelShape()
    learned = {f: getattr(shape, f) if getattr(shape, f) is not None else getattr(s, f)
               for f in ("num_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    return dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, model_shape=ModelShape(**learned)))


def _status(spec: InferenceServiceSpec, learned: Learned | None, resolved: Resolved | None) -> dict[str, Any]:
    s = learned.summary if learned else None
    config = ConfigJson(architecture=s.architecture, model_type=s.model_type, hidden_size=s.hidden_size, dtype=s.dtype,
                        vision=s.vision, vision_hidden_size=s.vision_hidden_size, num_layers=s.num_layers,
                        intermediate_size=s.intermediate_size, num_attention_heads=s.num_attention_heads,
                        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim) if s else None
    values = LearnedValues(hidden_size=LearnedInt(value=resolved.hidden_size, from_=resolved.hidden_from),  # type: ignore[arg-type]
                           dtype=LearnedStr(value=resolved.dtype, from_=resolved.dtype_from)) if resolved else None  # type: ignore[arg-type]
    return to_dict(ModelConfigStatus(source=spec.model.source or spec.model.path or "", revision=learned.revision if learned else "",
                                     config_json=config, learned=values, message=_message(learned)))


def _message(learned: Learned | None) -> str:
    if learned is None or not learned.error:
        return ""
    return learned.error + (f"; using the config.json read before (revision {learned.revision[:12]})" if learned.earlier else "")


def _condition(learned: Learned | None) -> Condition | None:
    if learned is None:
        return None
    if learned.error:
        return Condition(type=CONDITION, status="True", reason=learned.reason or "Unreachable", message=_message(learned))  # type: ignore[arg-type]
    return Condition(type=CONDITION, status="False", reason="ConfigRead",  # type: ignore[arg-type]
                     message=f"config.json read at revision {learned.revision[:12]}" if learned.revision else "config.json read")


def _takes_our_encoder_cache(spec: InferenceServiceSpec) -> bool:
    """Whether the engine takes our encoder-cache size; engine.kind auto not yet resolved (no plan) counts as yes."""
    return spec.engine.kind == "auto" or engine_of(spec).sizes_encoder_cache


def with_model_config(status: dict[str, Any], body: Mapping[str, Any], learned: Learned | None, now: str,
                      generation: int | None) -> dict[str, Any]:
    """`status` plus status.modelConfig and the ModelConfigUnavailable condition (only for hf:// and s3:// sources)."""
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return status
    chosen = (status.get("engine") or {}).get("kind")
    if spec.engine.kind == "auto" and chosen:  # the engine the plan resolved auto to (status.engine)
        spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, kind=chosen))
    if learned is None and downloads(spec):
        learned = from_status(body)
    try:
        resolved: Resolved | None = resolve(spec, learned)
    except SpecError:
        resolved = None
    out = dict(status)
    out["modelConfig"] = _status(spec, learned, resolved)
    cond = _condition(learned) if downloads(spec) else None
    conds = [c for c in out.get("conditions", []) if c.get("type") != CONDITION]
    if cond is not None:
        previous = [c for c in out.get("conditions", []) if c.get("type") == CONDITION] + conds
        conds = merge_conditions(previous, [cond], now, generation)
    out["conditions"] = conds
    return out


def model_config_warning(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a Warning Event when ModelConfigUnavailable turns True or changes reason."""
    def cond(st: Mapping[str, Any]) -> Mapping[str, Any]:
        return next((c for c in (st or {}).get("conditions", []) if c.get("type") == CONDITION), {})

    now, was = cond(new), cond(old)
    if now.get("status") == "True" and (was.get("status"), was.get("reason")) != ("True", now.get("reason")):
        return CONDITION, f"{now.get('reason')}: {now.get('message', '')}"
    return None


def unavailable(status: Mapping[str, Any]) -> bool:
    """Whether the status says config.json could not be read (the operator's timer then tries again)."""
    return any(c.get("type") == CONDITION and c.get("status") == "True" for c in (status or {}).get("conditions", []))
