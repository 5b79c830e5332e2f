"""The OpenAI endpoints: chat/completions and completions, streaming (SSE) or not.

Each handler checks the request (→ 400/404 before any engine work), tokenizes off the event
loop (a chat request with image parts also loads, hashes and preprocesses its images there, or
takes them from the processor cache; a text-only one never touches the multimodal code), fans
out one engine request per choice (`generation.stream_choices`), and shapes deltas into OpenAI
JSON. A client that goes away mid-request cancels the work, which aborts the engine
requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .. import rendering
from ..engine.protocol import GenerateRequest
from ..engine.sampling_params import SamplingParams
from ..hashing import MMPlaceholder
from ..outputs import EngineError, OutputStream, chat_logprobs, completion_logprobs
from ..tenant_keys import tenant_salt
from ..tokenizer import ChatTemplateError, IncrementalDetokenizer
from ..bodies import BodyTooLarge, read_capped
from .errors import APIError, bad_request, error_body, validation_error
from .generation import Choice, stream_choices
from .limits import check_fanout, num_prompts
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .state import ServerState

M = TypeVar("M", bound=BaseModel)

_BIG_BODY_BYTES = 256 << 10  # bodies larger than this are parsed off the event loop
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; logged, never seen by the client


# ---- request parsing ----------------------------------------------------------------------------
async def parse_body(request: Request, model: type[M], state: ServerState) -> M:
    """The JSON body validated as `model`; malformed JSON and invalid fields are 400s, oversize 413."""
    try:
        raw = await read_capped(request, state.cfg.server.max_request_bytes)
    except BodyTooLarge as exc:
        raise APIError(413, str(exc), code="request_too_large") from None
    except ClientDisconnect:  # gone (or cut off by a read deadline, api/deadlines.py) before the body was in
        raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection before sending the whole body",
                       code="client_closed_request") from None
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(raw) if len(raw) < _BIG_BODY_BYTES else await state.run_sync(json.loads, raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    salt = getattr(request.state, "tenant_salt", None)  # a client key of --api-keys-file (app.require_key)
    if salt is not None and "cache_salt" in model.model_fields and (data.get("cache_salt") is None
                                                                    or isinstance(data["cache_salt"], str)):
        data["cache_salt"] = tenant_salt(salt, data.get("cache_salt"))  # never another tenant's entries
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_supported(body: SamplingFields) -> None:
    """400 for OpenAI parameters this engine accepts by name but cannot honour."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(body, name)
        if v is not None and v != 0:
            raise bad_request(f"{name} is not supported (only 0)", param=name, code="unsupported_value")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported_value")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    if state.vocab_size is not None:
        bad = next((t for t in ids if t >= state.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (size {state.vocab_size})", param=param)


async def resolve_max_tokens(
    state: ServerState, requested: Optional[int], explicit: bool, prompt_len: int, param: str, prompt_param: str
) -> int:
    """Output budget of a request, or a 400 that names the limit and the request's numbers."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param=param, code="invalid_value")
    limit, what = await state.context_limit()
    if prompt_len >= limit:
        raise bad_request(
            f"This model's {what} is {limit} tokens, but the prompt has {prompt_len} tokens "
            f"(at least one token must remain for the completion). Please shorten the prompt.",
            param=prompt_param, code="context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return room
    if not explicit:  # a default budget (legacy completions: 16) shrinks to fit
        return min(requested, room)
    if requested > room:
        raise bad_request(
            f"This model's {what} is {limit} tokens. However, you requested {prompt_len + requested} tokens "
            f"({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the length of the prompt or the completion.",
            param=param, code="context_length_exceeded",
        )
    return requested


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: Optional[int], state: ServerState) -> SamplingParams:
    """Engine SamplingParams for one choice of the request (n is fanned out by the API)."""
    stop_ids = list(body.stop_token_ids or [])
    check_token_ids(state, stop_ids, "stop_token_ids")
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=logprobs,
    )
    try:
        sp.validate()
    except ValueError as exc:
        raise bad_request(str(exc), code="invalid_value") from None
    return sp


def check_no_image_tokens(state: ServerState, ids: list[int], param: str) -> None:
    """A multimodal model's image placeholder token may only stand where the API put an image's pads."""
    if state.image_pad_id is not None and state.image_pad_id in ids:
        raise bad_request(
            "the prompt contains the image placeholder token <|image_pad|> but no image for it; "
            "send images as image_url content parts", param=param, code="invalid_value",
        )


def make_choices(state: ServerState, base_id: str, prompts: list[list[int]], sp: SamplingParams,
                 cache_salt: Optional[str], images: Optional["ImageInputs"] = None,
                 lora_name: Optional[str] = None) -> list[Choice]:
    """One engine request per (prompt, sample); sample i of a seeded request uses seed + i."""
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(sp.n):
            seed = None if sp.seed is None else (sp.seed + i) % (1 << 63)
            child = dataclasses.replace(sp, n=1, seed=seed)
            stream = OutputStream(IncrementalDetokenizer(state.tokenizer, ids), sp.stop)
            req = GenerateRequest(f"{base_id}-{p}-{i}", ids, child, cache_salt=cache_salt, lora_name=lora_name)
            if images is not None:
                req.mm_placeholders = list(images.placeholders)
                req.mm_inputs = images.inputs  # shared by the n samples; never mutated
            choices.append(Choice(index=p * sp.n + i, prompt_index=p, request=req, stream=stream))
    return choices


def usage(choices: list[Choice], state: ServerState) -> dict[str, Any]:
    """OpenAI usage; each prompt counts once, its cached tokens are the best any of its samples got."""
    prompt_tokens = cached = image_tokens = 0
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(c.prompt_index, []).append(c)
    for group in by_prompt.values():
        prompt_tokens += len(group[0].request.prompt_token_ids)
        image_tokens += sum(m.length for m in group[0].request.mm_placeholders)
        best = max(group, key=lambda c: c.stream.num_cached_tokens)
        cached += best.stream.num_cached_tokens
        state.metrics.cached_prompt_tokens.labels(state.model_name, "cpu").inc(best.stream.num_cached_tokens_cpu)
        state.metrics.cached_prompt_tokens.labels(state.model_name, "gpu").inc(
            best.stream.num_cached_tokens - best.stream.num_cached_tokens_cpu
        )
    completion = sum(c.stream.num_generated_tokens for c in choices)
    details: dict[str, int] = {"cached_tokens": cached}
    if state.image_pad_id is not None or image_tokens:  # a multimodal model always reports it
        details["image_tokens"] = image_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": details,
    }


# ---- running and responding ---------------------------------------------------------------------
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, so its cleanup (aborts) runs on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


async def until_disconnect(request: Request, work: Any) -> Any:
    """Await `work` unless the client disconnects first; then cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def stream_error(state: ServerState, exc: EngineError) -> str:
    """The SSE event that ends a stream the engine failed (the client sees why, never a silent cut)."""
    err = engine_failure(exc)
    state.metrics.error(err.status)
    return sse(error_body(err.status, err.message, code=err.code))


def engine_failure(exc: EngineError) -> APIError:
    if exc.status == 404:  # its LoRA adapter was unloaded while it waited: as if it had never been served
        return APIError(404, str(exc), code="model_not_found")
    return APIError(500, f"the engine failed this request: {exc}", code="engine_error")


# ---- chat ---------------------------------------------------------------------------------------
async def chat_completions(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, ChatCompletionRequest, state)
    check_fanout(1, body.n, state.cfg.scheduler.choice_limit)
    model = state.check_model(body.model)
    state.require_engine()
    check_supported(body)
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages", code="invalid_value")
    if body.tools and body.tool_choice != "none":
        raise bad_request("tool calling is not supported", param="tools", code="unsupported_value")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("only response_format type 'text' is supported", param="response_format",
                          code="unsupported_value")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
    messages = [message_dict(m, i) for i, m in enumerate(body.messages)]
    images: Optional[ImageInputs] = None
    if rendering.has_images(body.messages):  # a client that leaves while its images download stops them
        images = await until_disconnect(request, prepare_images(state, body.messages, messages,
                                                                body.add_generation_prompt, body.cache_salt))
        if isinstance(images, Response):
            return images
        prompt_ids = images.prompt_token_ids
    else:
        try:
            prompt_ids = await state.run_sync(rendering.chat_ids, state.tokenizer, messages, body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages", code="invalid_messages") from None
        check_no_image_tokens(state, prompt_ids, "messages")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = await resolve_max_tokens(state, body.requested_max_tokens(), True, len(prompt_ids), param, "messages")
    top = (body.top_logprobs or 0) if body.logprobs else None
    sp = sampling_params(body, max_tokens, top, state)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = make_choices(state, rid, [prompt_ids], sp, body.cache_salt, images, state.lora_for(model))
    meta = {"id": rid, "created": int(time.time()), "model": model}
    if images is not None:
        images.count(state)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _with_media_header(SSEResponse(_chat_stream(state, choices, meta, top, include_usage)), images)
    return _with_media_header(await until_disconnect(request, _chat_full(state, choices, meta, top)), images)


def _with_media_header(resp: Response, images: Optional[ImageInputs]) -> Response:
    """Tell the router what the http(s) images of this request hashed to (multimodal/url_hashes.py)."""
    if images is not None and images.media_header and resp.status_code == 200:
        from ..multimodal.url_hashes import HEADER

        resp.headers[HEADER] = images.media_header
    return resp


def message_dict(m: Any, index: int) -> dict[str, Any]:
    msg = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        for part in m.content:
            if part.type != "text" and part.type not in rendering.IMAGE_PART_TYPES:
                raise bad_request(
                    f"messages[{index}]: content part type {part.type!r} is not supported by this server",
                    param=f"messages.{index}.content", code="unsupported_value",
                )
    return msg


# ---- images ---------------------------------------------------------------------------------------


@dataclass
class ImageInputs:
    """A chat request's images, prepared by the frontend for the engine."""

    prompt_token_ids: list[int]  # rendered prompt with every image's pads expanded
    placeholders: list[MMPlaceholder]  # one per image, in prompt order
    inputs: list[dict]  # wire.to_msgpack of each image's pixels, same order as `placeholders`
    num_image_tokens: int
    hash_time_s: float
    prepare_time_s: float
    num_processor_cache_hits: int
    num_processor_cache_misses: int
    media_header: Optional[str] = None  # url_hashes.HEADER's value: what the router learns of fetched image URLs

    def count(self, state: ServerState) -> None:
        """Metrics of an admitted request."""
        m = state.metrics
        m.images.inc(len(self.placeholders))
        m.image_tokens.inc(self.num_image_tokens)
        m.image_prepare_seconds.observe(self.prepare_time_s)
        if self.hash_time_s > 0:
            m.image_hash_seconds.observe(self.hash_time_s)
        if self.num_processor_cache_hits:
            m.processor_cache_lookups.labels(state.model_name, "hit").inc(self.num_processor_cache_hits)
        if self.num_processor_cache_misses:
            m.processor_cache_lookups.labels(state.model_name, "miss").inc(self.num_processor_cache_misses)


def _part_param(where: str) -> str:
    """"messages[0].content[1]" → "messages.0.content.1" (how `param` names fields elsewhere)."""
    return where.replace("[", ".").replace("]", "")


async def prepare_images(state: ServerState, parsed: list[Any], messages: list[dict],
                         add_generation_prompt: bool, cache_salt: Optional[str] = None) -> ImageInputs:
    """Load, hash, preprocess (or fetch from the processor cache) and expand; every bad input is a 400."""
    if not state.is_multimodal:
        i, j = rendering.image_part_positions(parsed)[0]
        raise bad_request(
            f"messages[{i}].content[{j}]: the model `{state.model_name}` does not accept images (text-only model)",
            param=f"messages.{i}.content.{j}", code="unsupported_value",
        )
    from ..multimodal import url_hashes, wire
    from ..multimodal.media import MediaError
    from ..multimodal.prompt import UnknownMediaError

    t0 = time.perf_counter()
    try:
        prepared = await state.image_preparer().prepare_async(messages, cache_salt,
                                                               add_generation_prompt=add_generation_prompt)
    except UnknownMediaError as exc:
        raise bad_request(str(exc), param=_part_param(exc.where), code="unknown_image") from None
    except MediaError as exc:
        raise bad_request(str(exc), param=_part_param(exc.where), code="invalid_image") from None
    except ValueError as exc:  # template failure; placeholders written by hand that do not match the images
        raise bad_request(str(exc), param="messages", code="invalid_messages") from None
    inputs = await state.run_sync(lambda: [wire.to_msgpack(img) for img in prepared.images])
    return ImageInputs(
        prompt_token_ids=prepared.prompt.prompt_token_ids, placeholders=list(prepared.prompt.mm_placeholders),
        inputs=inputs, num_image_tokens=prepared.num_image_tokens, hash_time_s=prepared.hash_time_s,
        prepare_time_s=time.perf_counter() - t0, num_processor_cache_hits=prepared.num_processor_cache_hits,
        num_processor_cache_misses=prepared.num_processor_cache_misses,
        media_header=url_hashes.encode_header((u, i.mm_hash, i.grid_thw) for u, i in prepared.fetched),
    )




async def run_to_completion(state: ServerState, choices: list[Choice]) -> dict[int, list]:
    """Drive every choice to its end (non-streaming); returns each choice's logprob entries."""
    logprobs: dict[int, list] = {c.index: [] for c in choices}
    try:
        async for choice, delta in stream_choices(state.require_engine(), choices, state.metrics):
            logprobs[choice.index].extend(delta.logprobs)
    except EngineError as exc:
        raise engine_failure(exc) from None
    return logprobs


async def _chat_full(state: ServerState, choices: list[Choice], meta: dict, top: Optional[int]) -> Response:
    logprobs = await run_to_completion(state, choices)
    out = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.stream.text},
            "logprobs": chat_logprobs(logprobs[c.index], state.tokenizer, top) if top is not None else None,
            "finish_reason": c.stream.finish_reason,
        }
        for c in choices
    ]
    return JSONResponse({**meta, "object": "chat.completion", "choices": out, "usage": usage(choices, state)})


async def _chat_stream(state: ServerState, choices: list[Choice], meta: dict, top: Optional[int],
                       include_usage: bool) -> AsyncIterator[str]:
    base = {**meta, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs: Any = None, finish_reason: Optional[str] = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice], **extra})

    # Each choice's role chunk goes out with its first engine output, as vLLM does: the first byte
    # of a stream then means prefill is done, so a router can still retry a replica that dies in
    # prefill, and nothing reaches the client before the engine has accepted the request.
    unannounced = {c.index for c in choices}
    try:
        async for choice, delta in stream_choices(state.require_engine(), choices, state.metrics):
            if choice.index in unannounced:
                unannounced.discard(choice.index)
                yield chunk(choice.index, {"role": "assistant", "content": ""})
            if not (delta.text or delta.logprobs or delta.finish_reason):
                continue
            lp = chat_logprobs(delta.logprobs, state.tokenizer, top) if top is not None and delta.logprobs else None
            yield chunk(choice.index, {"content": delta.text} if delta.text else {}, lp, delta.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(choices, state)})
    except EngineError as exc:
        yield stream_error(state, exc)
    yield SSE_DONE


# ---- completions --------------------------------------------------------------------------------
async def completions(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, CompletionRequest, state)
    check_fanout(num_prompts(body.prompt), body.n, state.cfg.scheduler.choice_limit)
    model = state.check_model(body.model)
    state.require_engine()
    check_supported(body)
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_value")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of == n)", param="best_of", code="unsupported_value")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo",
                          code="unsupported_value")
    prompts, texts = await _completion_prompts(body, state)
    explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
    budgets = [await resolve_max_tokens(state, body.max_tokens, explicit, len(p), "max_tokens", "prompt") for p in prompts]
    sp = sampling_params(body, min(budgets), body.logprobs, state)
    rid = f"cmpl-{uuid.uuid4().hex}"
    choices = make_choices(state, rid, prompts, sp, body.cache_salt, lora_name=state.lora_for(model))
    for c in choices:  # a list of prompts may leave each a different budget
        c.request.sampling_params.max_tokens = budgets[c.prompt_index]
    echo = texts if body.echo else None
    meta = {"id": rid, "created": int(time.time()), "model": model}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_completion_stream(state, choices, meta, body.logprobs, echo, include_usage))
    return await until_disconnect(request, _completion_full(state, choices, meta, body.logprobs, echo))


async def _completion_prompts(body: CompletionRequest, state: ServerState) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt: a string, a list of strings, token ids or lists of token ids."""
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise bad_request("prompt must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(x, int) for x in p):
        p = [p]
    prompts: list[list[int]] = []
    texts: list[str] = []
    for i, item in enumerate(p):
        if isinstance(item, str):
            ids = await state.run_sync(rendering.completion_ids, state.tokenizer, item)
            text = item
        else:
            ids = list(item)
            check_token_ids(state, ids, "prompt")
            # the text of token-id prompts only serves `echo`: one thread hop per prompt cost a
            # 16-prompt request ~40 ms before its first step (docs/performance.md)
            text = await state.run_sync(state.tokenizer.decode, ids) if ids and body.echo else ""
        if not ids:
            raise bad_request(f"prompt {i} is empty (no tokens)", param="prompt", code="invalid_value")
        check_no_image_tokens(state, ids, "prompt")
        prompts.append(ids)
        texts.append(text)
    return prompts, texts




async def _completion_full(state: ServerState, choices: list[Choice], meta: dict, num_logprobs: Optional[int],
                           echo: Optional[list[str]]) -> Response:
    logprobs = await run_to_completion(state, choices)
    out = []
    for c in choices:
        prefix = echo[c.prompt_index] if echo else ""
        lp = None
        if num_logprobs is not None:
            lp = completion_logprobs(logprobs[c.index], state.tokenizer, num_logprobs, len(prefix))
        out.append({"index": c.index, "text": prefix + c.stream.text, "logprobs": lp, "finish_reason": c.stream.finish_reason})
    return JSONResponse({**meta, "object": "text_completion", "choices": out, "usage": usage(choices, state)})


async def _completion_stream(state: ServerState, choices: list[Choice], meta: dict, num_logprobs: Optional[int],
                             echo: Optional[list[str]], include_usage: bool) -> AsyncIterator[str]:
    base = {**meta, "object": "text_completion"}
    extra = {"usage": None} if include_usage else {}
    offsets = {c.index: 0 for c in choices}

    def chunk(index: int, text: str, logprobs: Any = None, finish_reason: Optional[str] = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice], **extra})

    try:
        if echo:
            for c in choices:
                offsets[c.index] = len(echo[c.prompt_index])
                yield chunk(c.index, echo[c.prompt_index])
        async for choice, delta in stream_choices(state.require_engine(), choices, state.metrics):
            if not (delta.text or delta.logprobs or delta.finish_reason):
                continue
            lp = None
            if num_logprobs is not None:
                lp = completion_logprobs(delta.logprobs, state.tokenizer, num_logprobs, offsets[choice.index])
            offsets[choice.index] += len(delta.text)
            yield chunk(choice.index, delta.text, lp, delta.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(choices, state)})
    except EngineError as exc:
        yield stream_error(state, exc)
    yield SSE_DONE
