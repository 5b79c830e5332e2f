"""The EPP in-process against fake replicas (router_fakes.FakeReplica) and a FakeEnvoy: an ext_proc client that
sends a gateway's ProcessingRequests one by one and reads the answers; ProcessingRequest builders."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from router_fakes import BLOCK, FakeReplica, FakeSharedFailures, Served, synced
from waiting import until
from warmfleet.server.hashing import model_fingerprint
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.runtime import RouterRuntime
from warmfleet.server.router.core.tenants import Tenants
from warmfleet.server.router.epp import pick
from warmfleet.server.router.epp.server import EppServer
from warmfleet.server.router.epp.settings import EppSettings
from warmfleet.server.tokenizer import Tokenizer

FULL_DUPLEX = mode_pb.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = mode_pb.ProcessingMode.BUFFERED
RECV_TIMEOUT_S = 10.0


def _headers(pairs: dict) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def request_headers(path: str = "/v1/chat/completions", method: str = "POST", *, eos: bool = False,
                    headers: Optional[dict] = None, subset: Optional[list[str]] = None,
                    mode: int = FULL_DUPLEX) -> pb.ProcessingRequest:
    """The first message of a stream, as Envoy sends it (protocol_config rides on it)."""
    h = _headers({":path": path, ":method": method, ":authority": "gw", "x-forwarded-for": "10.1.2.3",
                  **(headers or {})})
    h.end_of_stream = eos
    req = pb.ProcessingRequest(request_headers=h, protocol_config=pb.ProtocolConfiguration(
        request_body_mode=mode, response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields[pick.SUBSET].list_value.extend(subset)
        req.metadata_context.filter_metadata[pick.SUBSET_NAMESPACE].CopyFrom(hint)
    return req


def request_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def response_headers(status: int = 200, served: Optional[str] = None, served_in: str = "header",
                     content_type: str = "application/json") -> pb.ProcessingRequest:
    pairs = {":status": str(status), "content-type": content_type}
    if served is not None and served_in == "header":
        pairs[pick.SERVED] = served
    req = pb.ProcessingRequest(response_headers=_headers(pairs))
    if served is not None and served_in == "metadata":
        lb = struct_pb2.Struct()
        lb.fields[pick.SERVED].string_value = served
        req.metadata_context.filter_metadata[pick.LB_NAMESPACE].CopyFrom(lb)
    return req


def response_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def set_headers(common: pb.CommonResponse) -> dict:
    return {h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
            for h in common.header_mutation.set_headers}


def lb_value(resp: pb.ProcessingResponse) -> str:
    return resp.dynamic_metadata.fields[pick.LB_NAMESPACE].struct_value.fields[pick.DESTINATION].string_value


class FakeEnvoy:
    """One ext_proc stream, driven message by message like Envoy's filter (one stream per HTTP request)."""

    def __init__(self, channel: grpc.aio.Channel):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.call = pb_grpc.ExternalProcessorStub(channel).Process(self._requests())

    async def _requests(self):
        while True:
            req = await self.queue.get()
            if req is None:
                return
            yield req

    async def send(self, req: pb.ProcessingRequest) -> None:
        await self.queue.put(req)

    async def recv(self) -> pb.ProcessingResponse:
        resp = await asyncio.wait_for(self.call.read(), RECV_TIMEOUT_S)
        assert resp is not grpc.aio.EOF, "the EPP ended the stream"
        return resp

    async def exchange(self, req: pb.ProcessingRequest, n: int = 1) -> list[pb.ProcessingResponse]:
        await self.send(req)
        return [await self.recv() for _ in range(n)]

    async def close(self) -> None:
        await self.queue.put(None)

    def cancel(self) -> None:
        self.call.cancel()


class EppFleet:
    """Two fake replicas (real KV events) behind an in-process EPP on free loopback ports."""

    def __init__(self, model_dir, *, tenants: Optional[Tenants] = None, max_concurrent_per_client: int = 0,
                 engine: str = "warmfleet", replica_urls: Optional[list[str]] = None, events: bool = True,
                 replica_api_key: Optional[str] = None, drain_grace_s: float = 1.0,
                 settings: Optional[dict] = None, spans=None):
        self.tok = Tokenizer(model_dir)
        self.spans = spans  # otel.Spans of the EPP (tests/test_otel.py), None: no tracing
        self.fp = model_fingerprint(model_dir)
        self.model_dir, self.tenants, self.engine = model_dir, tenants or Tenants({}), engine
        self.max_concurrent_per_client = max_concurrent_per_client
        self.replica_api_key = replica_api_key
        self.drain_grace_s = drain_grace_s
        self.settings = {"secure_serving": False, **(settings or {})}  # EppSettings fields (TLS tests: on)
        self.failures = FakeSharedFailures()
        self.replica_urls, self.events = replica_urls, events  # replica_urls: members that never answer
        self.replicas = [] if replica_urls else [FakeReplica(f"r{i}", self.tok, self.fp, self.failures)
                                                 for i in range(2)]

    async def __aenter__(self) -> "EppFleet":
        self.served = [await Served(r.app).start() for r in self.replicas]
        specs = ([ReplicaSpec(u) for u in self.replica_urls] if self.replica_urls else
                 [ReplicaSpec(s.url, r.events if self.events else None) for s, r in zip(self.served, self.replicas)])
        rt = RouterRuntime(
            hash_cfg=HashConfig(BLOCK, self.fp), replicas=specs,
            renderer=PromptRenderer(str(self.model_dir), tokenizer=self.tok), tenants=self.tenants, spans=self.spans,
            settings=EppSettings(health_interval_s=0.1, health_timeout_s=0.5, engine=self.engine,
                                 max_concurrent_per_client=self.max_concurrent_per_client, block_size=BLOCK,
                                 replica_api_key=self.replica_api_key, drain_grace_s=self.drain_grace_s,
                                 **self.settings))
        self.epp = await EppServer(rt, grpc_port=0, http_port=0).__aenter__()
        self.fleet = self.epp.state["fleet"]
        if not self.replica_urls:
            if self.events and self.engine == "warmfleet":
                await until(lambda: synced(self.fleet.index, [s.url for s in self.served]), "initial resync")
            else:
                await until(lambda: len(self.fleet.routable()) == len(self.served), "health checks")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.epp.grpc_port}")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.epp.__aexit__(*exc)
        for s in self.served:
            await s.stop()
        for r in self.replicas:
            r.close()

    def stream(self) -> FakeEnvoy:
        return FakeEnvoy(self.channel)

    def endpoint(self, i: int) -> str:
        return pick.endpoint_of(self.fleet.registry.get(self.served[i].url))

    def replica_at(self, endpoint: str):
        return self.epp.door.replica_at(endpoint)

    def in_flight(self) -> dict:
        return {pick.endpoint_of(r): r.in_flight for r in self.fleet.registry.replicas.values()}

    def queued(self) -> dict:
        return {pick.endpoint_of(r): r.queued_tokens for r in self.fleet.registry.replicas.values()}

    def metric(self, name: str, **labels) -> float:
        v = self.epp.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


def usage_event(cached: int) -> bytes:
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
             "prompt_tokens_details": {"cached_tokens": cached}}
    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
