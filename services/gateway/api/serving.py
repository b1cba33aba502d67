"""POST /v1/completions and /v1/chat/completions: validate, admit, submit, answer.

Order of checks: the key, from the header alone, before the body is read
(admission/auth_gate.py: 401, or 429 for an address that keeps failing), the body's size and
structure (middleware.py), the body's schema (400), the gateway's own backpressure
(429 ``gateway_overloaded`` past ``max_inflight_requests``, 429 ``queue_full`` when
fresh EngineStats show the scheduler's queue full: both before any tokenizing or
Redis), the model name (404), the request's meaning against the model (400:
vocabulary, context length), the key's limits (429; the key is checked again in the
same Redis script), the engine (503 when the scheduler is down; 429 / 503 / 400
when the scheduler refuses). docs/operations.md, "Who is checked when".

Every response carries ``timings`` (a vLLM-style extension; on a stream, in the
usage chunk when ``include_usage`` is set, else in the last chunk): see
``Generation.timings``.

Streams: the response headers wait up to ``STREAM_HEADER_WAIT_S`` for the first
event, so a request the scheduler refuses at once (queue full) still gets a real
429 status; a failure after the stream started is a final ``data: {"error": ...}``
event followed by ``data: [DONE]``.

Client disconnects abort the request in the scheduler, for streams (the response
listens for ``http.disconnect`` while it writes) and for plain responses (the
handler races the generation against the disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from services.gateway.admission.auth import AdmissionError, Grant
from services.gateway.api.generation import ChoiceEvent, Generation
from services.gateway.api.render import ChatRenderer, CompletionRenderer, Renderer, sse
from services.gateway.api.state import GatewayState, InflightSlot, state_of
from services.gateway.api.validation import GenerationSpec, validate_chat, validate_completion
from services.gateway.errors import APIError
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.text.structured import wants_grammar

log = logging.getLogger("ferry.gateway.requests")
router = APIRouter()

STREAM_HEADER_WAIT_S = 1.0
STREAM_STALL_TIMEOUT_S = 30.0
STREAM_STALL_CHECK_S = 5.0
# tokenizing a long prompt off the event loop keeps other streams flowing
TOKENIZE_IN_THREAD_CHARS = 16_384
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, logs do
T = TypeVar("T")


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    st = state_of(request)

    def size() -> int:
        chars = len(body.prompt) if isinstance(body.prompt, str) else sum(len(str(p)) for p in body.prompt)
        return chars + _grammar_weight(body)

    return await _handle(st, request, size, lambda: validate_completion(body, st.tokenizer, st.limits()),
                         CompletionRenderer, "cmpl", "completions")


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    st = state_of(request)
    return await _handle(st, request, lambda: sum(len(m.text()) for m in body.messages) + _grammar_weight(body),
                         lambda: validate_chat(body, st.tokenizer, st.limits()), ChatRenderer, "chatcmpl", "chat")


def _grammar_weight(body: CompletionRequest | ChatCompletionRequest) -> int:
    """Compiling a grammar can take long (large schemas): such a request validates off the event loop."""
    return TOKENIZE_IN_THREAD_CHARS + 1 if wants_grammar(body) else 0


async def _handle(st: GatewayState, request: Request, size: Callable[[], int],
                  validate: Callable[[], GenerationSpec],
                  renderer_cls: type[Renderer], id_prefix: str, endpoint: str) -> Response:
    """Both endpoints: backpressure first, then validate (in a thread when large) and serve.

    ``size`` (characters to tokenize) and ``validate`` are callables so that nothing
    runs before the receive time is taken and the cheap refusals are checked; the
    in-flight slot is released here on any failure, in one place for both endpoints.
    """
    received = time.time()
    slot = _backpressure(st)
    try:
        spec = await _maybe_in_thread(size(), validate)
        renderer = renderer_cls(st.tokenizer, f"{id_prefix}-{uuid.uuid4().hex}", st.model_name,
                                spec.num_choices, spec.logprobs is not None)
        if isinstance(renderer, ChatRenderer) and spec.tool_plan is not None and spec.tool_plan.parser is not None:
            renderer.use_tools(spec.tool_plan.parser)
        return await _serve(st, request, spec, renderer, endpoint, slot, received)
    except BaseException:
        slot.release()  # idempotent: a generation that started released it already
        raise


def _backpressure(st: GatewayState) -> InflightSlot:
    """The cheap refusals, before tokenizing or Redis: a full gateway, a full scheduler queue."""
    refusal = st.early_refusal()
    if refusal is not None:
        raise refusal
    return st.inflight.acquire()


async def _maybe_in_thread(size: int, fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn) if size > TOKENIZE_IN_THREAD_CHARS else fn()


async def _admit(st: GatewayState, request: Request, spec: GenerationSpec) -> Grant:
    try:
        return await st.admission.authorize(request.headers.get("authorization"), spec.num_prompt_tokens,
                                            spec.max_total_tokens)
    except AdmissionError as e:
        raise APIError(e.status, e.message, code=e.code, headers=e.headers, type_=e.type) from e


async def _serve(st: GatewayState, request: Request, spec: GenerationSpec, renderer: Renderer,
                 endpoint: str, slot: InflightSlot, received: float) -> Response:
    grant = await _admit(st, request, spec)
    priority = spec.priority if spec.priority is not None else (grant.priority or 0)
    gen = Generation(st.engine, st.tokenizer, st.metrics, spec, renderer.id, priority, grant.key_name)
    gen.received_time = received
    gen.on_settled = slot.release
    gen.client_request_id = request.headers.get("x-request-id", "")[:128] or None
    started = time.monotonic()
    try:
        gen.submit()
    except APIError:
        _settle(st, grant, gen, endpoint, started, "refused")
        raise
    if spec.stream:
        return await _start_stream(st, request, gen, renderer, grant, endpoint, started)
    outcome = "error"
    try:
        finished = await _unless_disconnected(request, _collect(gen, renderer))
        if finished is None:
            outcome = "client_closed"
            return Response(status_code=CLIENT_CLOSED)
        outcome = "ok"
        return JSONResponse(finished, headers=_headers(grant, gen))
    finally:
        _settle(st, grant, gen, endpoint, started, outcome)


async def _collect(gen: Generation, renderer: Renderer) -> dict[str, Any]:
    async for ev in gen.events():
        renderer.add(ev)
    return {**renderer.response(gen.usage()), "timings": gen.timings()}


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work``; None (and ``work`` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _settle(st: GatewayState, grant: Grant, gen: Generation, endpoint: str, started: float,
            outcome: str) -> None:
    """Abort leftovers, report metrics, reconcile token usage, log one line. Never awaits."""
    if gen.settled:
        return
    gen.settled = True
    gen.close()
    if gen.on_settled is not None:
        gen.on_settled()
    usage = gen.usage()
    produced = int(usage["completion_tokens"])  # type: ignore[call-overload]
    used = int(usage["total_tokens"]) if produced else 0  # type: ignore[call-overload]
    task = asyncio.get_running_loop().create_task(st.admission.record_usage(grant, used))
    st.background.add(task)
    task.add_done_callback(st.background.discard)
    err = gen.error
    log.info("request finished", extra={
        "req_id": gen.base_id, "client_request_id": gen.client_request_id, "endpoint": endpoint,
        "outcome": outcome if err is None else "error", "status": err.status if err else None,
        "error_code": err.code if err else None, "key": grant.key_name, "priority": gen.priority,
        "num_choices": len(gen.choices), "stream": gen.spec.stream,
        "finish_reasons": sorted({c.finish_reason or "abort" for c in gen.choices.values()}),
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": produced,
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],  # type: ignore[index]
        "duration_s": round(time.monotonic() - started, 4)})


class _DisconnectAwareStream(StreamingResponse):
    """A stream that always watches for the client leaving, and always closes its iterator.

    Starlette skips the disconnect listener on newer ASGI servers and relies on a
    failing write; a request still queued writes nothing, so the watch is kept. A
    write blocked for ``STREAM_STALL_TIMEOUT_S`` (an abandoned reader) ends it too.
    ``on_close`` runs however the stream ends (finished, client gone, error).
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        writing_since: list[float | None] = [None]

        async def send_and_mark(message: Message) -> None:
            writing_since[0] = loop.time()
            await send(message)  # returns at once unless the transport's buffer is full
            writing_since[0] = None

        async def watch_stalls() -> None:
            # a client that keeps the connection open but stops reading blocks the write
            # once buffers fill; treat it like a client that left. One timer per stream,
            # not one per chunk: a timeout around every write cost ~15 % of the gateway's CPU.
            while True:
                await asyncio.sleep(STREAM_STALL_CHECK_S)
                since = writing_since[0]
                if since is not None and loop.time() - since > STREAM_STALL_TIMEOUT_S:
                    raise OSError("the client stopped reading the stream")

        try:
            async with asyncio.TaskGroup() as tg:
                stream = tg.create_task(self.stream_response(send_and_mark))
                listen = tg.create_task(self.listen_for_disconnect(receive))
                watch = tg.create_task(watch_stalls())
                stream.add_done_callback(lambda _: (listen.cancel(), watch.cancel()))
                listen.add_done_callback(lambda _: stream.cancel())
        except* OSError:
            pass  # the client went away mid-write
        finally:
            self._on_close()
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()


async def _start_stream(st: GatewayState, request: Request, gen: Generation, renderer: Renderer,
                        grant: Grant, endpoint: str, started: float) -> Response:
    events = gen.events().__aiter__()
    first: asyncio.Future[ChoiceEvent] = asyncio.ensure_future(events.__anext__())  # type: ignore[arg-type]
    outcome = {"value": "error"}
    try:
        early = await _unless_disconnected(request, asyncio.wait({first}, timeout=STREAM_HEADER_WAIT_S))
        if early is None:
            first.cancel()
            _settle(st, grant, gen, endpoint, started, "client_closed")
            return Response(status_code=CLIENT_CLOSED)
        if first.done() and first.exception() is not None:
            exc = first.exception()
            _settle(st, grant, gen, endpoint, started, "refused")
            assert exc is not None
            raise exc  # a refusal before any output: a real HTTP status
    except asyncio.CancelledError:
        first.cancel()
        _settle(st, grant, gen, endpoint, started, "client_closed")
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            if isinstance(renderer, ChatRenderer):
                for i in range(gen.spec.num_choices):
                    yield sse(renderer.role_chunk(i))
            yield sse(_chunk(renderer, gen, await first))
            async for ev in events:
                yield sse(_chunk(renderer, gen, ev))
            if gen.spec.include_usage:
                yield sse({**renderer.usage_chunk(gen.usage()), "timings": gen.timings()})
            outcome["value"] = "ok"
        except APIError as e:
            # the headers went out with 200: the client got an error event, not e.status
            st.metrics.on_rejected(e.code or str(e.status), 200)
            yield sse(e.body())
        # The generation is over: free its in-flight slot before the last byte, so a client
        # that sends its next request as soon as it reads [DONE] never meets its own slot.
        if gen.on_settled is not None:
            gen.on_settled()
        yield b"data: [DONE]\n\n"

    def on_close() -> None:
        if not first.done():
            first.cancel()
        if outcome["value"] != "ok" and gen.error is None and gen.unfinished:
            outcome["value"] = "client_closed"
        _settle(st, grant, gen, endpoint, started, outcome["value"])

    return _DisconnectAwareStream(body(), on_close, headers=_headers(grant, gen))


def _headers(grant: Grant, gen: Generation) -> dict[str, str]:
    """Rate-limit headers, and the id the logs (and every process's logs) know this request by."""
    return {**grant.headers, "X-Request-Id": gen.base_id}


def _chunk(renderer: Renderer, gen: Generation, ev: ChoiceEvent) -> dict[str, Any]:
    usage = gen.usage() if gen.spec.include_usage and gen.spec.continuous_usage else None
    chunk = renderer.chunk(ev, usage)
    if not gen.unfinished and not gen.spec.include_usage:
        chunk["timings"] = gen.timings()  # the last chunk (with usage, the usage chunk carries them)
    return chunk
