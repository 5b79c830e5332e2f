"""The Endpoint Picker protocol's wire values: endpoints (ip:port), the subset hint, the pick's header, dynamic
metadata and immediate answers as ext_proc messages; no routing and no I/O.

    request:  metadata_context["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"] = [ip:port, ...]
    pick:     header x-gateway-destination-endpoint = "ip:port[,ip:port...]" (primary, then fallbacks)
              dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"] = the same value
    response: metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"] = ip:port
              (or the response header of that name, which the gateway's route adds: envoy_bootstrap.py)
"""

from __future__ import annotations

from typing import Iterable, Optional
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ..core.errors import Refusal
from ..core.registry import Replica

DESTINATION = "x-gateway-destination-endpoint"  # header and envoy.lb metadata key of the pick
SERVED = "x-gateway-destination-endpoint-served"  # what the gateway reports on the response
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
BODY_CHUNK_BYTES = 62_000  # streamed body responses stay under Envoy's 64 KiB gRPC message advice (GIE: the same)
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def endpoint_of(rep: Replica) -> str:
    """The replica as the gateway names it: host:port of its HTTP URL (the scheme's port when the URL gives none)."""
    parts = urlsplit(rep.spec.url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def header_value(headers: pb.HttpHeaders, name: str) -> Optional[str]:
    """A header of an ext_proc headers message (Envoy sends raw_value; value in older versions), None if absent."""
    for h in headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return None


def _lb_struct(req: pb.ProcessingRequest, namespace: str) -> Optional[struct_pb2.Struct]:
    md = req.metadata_context.filter_metadata
    return md[namespace] if namespace in md else None


def subset_of(req: pb.ProcessingRequest) -> Optional[frozenset[str]]:
    """The subset hint's endpoints, None when the gateway sets none (pick from the whole pool).

    An empty list is a hint too: nothing is eligible."""
    hint = _lb_struct(req, SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())


def served_of(req: pb.ProcessingRequest, headers: pb.HttpHeaders) -> Optional[str]:
    """The endpoint that served the response: envoy.lb metadata (the protocol), else the response header."""
    lb = _lb_struct(req, LB_NAMESPACE)
    if lb is not None and SERVED in lb.fields and lb.fields[SERVED].string_value:
        return lb.fields[SERVED].string_value.split(",")[0].strip()
    value = header_value(headers, SERVED)
    return value.split(",")[0].strip() if value and value != "-" else None


def destination(endpoints: Iterable[str]) -> str:
    """The pick's one value: primary first, then the fallbacks a gateway retry walks in order."""
    return ",".join(endpoints)


def pick_metadata(value: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = value
    return md


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=OVERWRITE)


def pick_common(value: str, body_len: Optional[int] = None, body: Optional[bytes] = None,
                extra: Optional[dict] = None) -> pb.CommonResponse:
    """The pick as a common response: the destination header (and the rewritten body's content-length), the
    route cache cleared so the gateway routes by the header; `body` replaces a buffered body; `extra` headers (the
    request id the EPP made) are set on the way to the replica. No secret ever rides on it: the client's own
    `authorization` passes as it came, and the EPP never adds a replica key (docs/security.md)."""
    headers = [_set(DESTINATION, value)]
    if body_len is not None:
        headers.append(_set("content-length", str(body_len)))
    headers += [_set(k, v) for k, v in (extra or {}).items()]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    return common


def set_headers(common: pb.CommonResponse, headers: dict) -> pb.CommonResponse:
    """`common` with `headers` set (overwritten) by its header mutation."""
    common.header_mutation.set_headers.extend(_set(k, v) for k, v in headers.items())
    return common


def request_headers_response(common: Optional[pb.CommonResponse] = None,
                             value: Optional[str] = None) -> pb.ProcessingResponse:
    out = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common or pb.CommonResponse()))
    if value is not None:
        out.dynamic_metadata.CopyFrom(pick_metadata(value))
    return out


def request_body_response(common: Optional[pb.CommonResponse] = None,
                          value: Optional[str] = None) -> pb.ProcessingResponse:
    out = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common or pb.CommonResponse()))
    if value is not None:
        out.dynamic_metadata.CopyFrom(pick_metadata(value))
    return out


def streamed(body: bytes, end_of_stream: bool) -> pb.CommonResponse:
    """One FULL_DUPLEX_STREAMED body chunk handed back to the gateway."""
    return pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)))


def streamed_request_body(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """A whole request body as FULL_DUPLEX_STREAMED chunks (at most BODY_CHUNK_BYTES each; one empty if empty)."""
    cuts = range(0, len(body), BODY_CHUNK_BYTES) if body else [0]
    last = cuts[-1]
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(
        response=streamed(body[i:i + BODY_CHUNK_BYTES], end_of_stream and i == last))) for i in cuts]


def immediate(refusal: Refusal, extra: Optional[dict] = None) -> pb.ProcessingResponse:
    """The gateway answers the client itself with the router's OpenAI-shaped error (and `extra` headers)."""
    headers = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=OVERWRITE),
        *(_set(k, v) for k, v in (extra or {}).items())])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status), headers=headers, body=refusal.body(),
        details=f"warmfleet_epp_{refusal.status}"))
