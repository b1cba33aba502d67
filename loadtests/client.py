"""One streamed request against any OpenAI-compatible server, timed per chunk.

The timing rules follow ``vllm bench serve``: the clock starts just before the
request is sent; the first chunk that carries generated text marks the time to
first token; every later text-bearing chunk adds one inter-token gap. Output
tokens come from the server's ``usage`` (``stream_options.include_usage``)
when it reports them, else one per text chunk.

A request whose trace line has ``cancel_after`` is closed by the client after
that many tokens: it is recorded as ``cancelled``, never as a completion or an
error. Failures are split by kind: HTTP 429, HTTP 503, client-side timeouts,
and everything else (including error events inside an open stream).

The streams go through aiohttp (a C HTTP parser on asyncio's own transports) and
msgspec's JSON decoder: on a machine where the load generator shares the cores with
the server it measures, the client's CPU per token is taken from the server, and
httpx's stack (httpcore, anyio, h11) cost about twice what aiohttp does per chunk
(docs/benchmarks.md, "Gateway cost per streamed token"). httpx stays for the plain
requests (model discovery, metrics).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec

from loadtests.trace import TraceRequest

ERROR_KINDS = ("429", "503", "timeout", "other")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    api_key: str = ""
    request_timeout_s: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = False
    """Send vLLM's ``ignore_eos`` so every request produces max_tokens (not every server accepts it)."""
    extra_body: dict[str, Any] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    req_id: str
    group: str
    sent_s: float = 0.0
    """Send time, seconds from the run's start."""
    status: str = "error"
    """'ok' (completed), 'cancelled' (closed by the client on purpose) or 'error'."""
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    queue_time_s: float | None = None
    """Queue time the server reported for this request, if it does."""
    task: str | None = None
    """The task type of a checked request (None: synthetic traffic)."""
    text: str | None = None
    """The answer's text, kept for checked requests only."""
    tool_calls: list[list[str]] | None = None
    """The answer's tool calls as [name, arguments JSON text], checked requests only."""
    correct: bool | None = None
    """The checker's verdict (None: not checked, not completed, or nothing to judge against)."""
    check_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["itl_s"] = [round(x, 6) for x in self.itl_s]
        if self.task is None:
            for key in ("task", "text", "tool_calls", "correct", "check_reason"):
                del out[key]
        return out


def request_body(request: TraceRequest, config: ClientConfig) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body for one trace request."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
    }
    if config.ignore_eos and request.check is None:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    if request.check is not None:
        # a task item is judged on its greedy answer, ended where the model ends it
        body["temperature"] = 0.0
        body.pop("top_p", None)
    if request.body:
        body.update(request.body)
    if request.messages is not None:
        body["messages"] = request.messages
        return "/v1/chat/completions", body
    body["prompt"] = request.prompt
    return "/v1/completions", body


def classify_status(status: int) -> str:
    if status == 429:
        return "429"
    if status == 503:
        return "503"
    if status in (408, 504):
        return "timeout"
    return "other"


# Error codes servers put in an error event once a stream has started (HTTP 200 is already
# sent): they mean the same as the status the request would have got before the stream.
_CODE_KINDS = {
    "queue_timeout": "503", "scheduler_unavailable": "503", "engine_unavailable": "503",
    "service_unavailable": "503", "aborted": "503",
    "queue_full": "429", "rate_limit_exceeded": "429", "too_many_requests": "429",
    "timeout": "timeout", "request_timeout": "timeout",
}


def classify_code(code: object) -> str:
    """The kind of an error event's string code (``queue_timeout`` counts with the 503s)."""
    return _CODE_KINDS.get(str(code).lower(), "other") if code is not None else "other"


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def _chunk_tool_calls(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices") or []
    delta = choices[0].get("delta") if choices else None
    calls = delta.get("tool_calls") if isinstance(delta, dict) else None
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def server_queue_time(chunk: dict[str, Any]) -> float | None:
    """Per-request queue time a server returns, in seconds, from the places servers put it."""
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or chunk.get("ferry") or {}
    for source, key, scale in (
        (timings, "queue_time_s", 1.0),
        (usage, "queue_time_s", 1.0),
        (usage, "queue_wait_time_in_ms", 1e-3),
        (timings, "queue_ms", 1e-3),
    ):
        if isinstance(source, dict) and isinstance(source.get(key), int | float):
            return float(source[key]) * scale
    return None


class _StreamState:
    """What one stream has produced so far."""

    def __init__(self, record: RequestRecord, start: float, cancel_after: int | None, keep: bool = False) -> None:
        self.record, self.start, self.cancel_after = record, start, cancel_after
        self.last = start
        self.num_chunks = 0
        self.done = False
        self.keep = keep
        """Keep the answer (text and tool calls) for the checker."""
        self.pieces: list[str] = []
        self.calls: dict[int, list[str]] = {}

    def answer(self) -> tuple[str, list[list[str]]]:
        return "".join(self.pieces), [self.calls[i] for i in sorted(self.calls)]

    def _fold_calls(self, chunk: dict[str, Any]) -> bool:
        """Tool-call deltas (a name once, arguments in pieces); True when the chunk carried any."""
        calls = _chunk_tool_calls(chunk)
        for call in calls:
            index = call.get("index", len(self.calls))
            slot = self.calls.setdefault(index if isinstance(index, int) else len(self.calls), ["", ""])
            function = call.get("function") or {}
            if function.get("name"):
                slot[0] = str(function["name"])
            if function.get("arguments"):
                slot[1] += str(function["arguments"])
        return bool(calls)

    def on_chunk(self, chunk: dict[str, Any], now: float) -> bool:
        """Fold one SSE chunk in; True when the client should stop reading."""
        record = self.record
        if isinstance(chunk.get("error"), dict):
            err = chunk["error"]
            code = err.get("code")
            record.error_kind = classify_status(code) if isinstance(code, int) else classify_code(code)
            record.error = str(err.get("message") or err)[:500]
            return True
        text = _chunk_text(chunk)
        if self.keep:
            if text:
                self.pieces.append(text)
            if self._fold_calls(chunk) and not text:
                text = " "  # a tool call's delta is the answer's output: it is timed like text
        if text:
            if record.ttft_s is None:
                record.ttft_s = now - self.start
            else:
                record.itl_s.append(now - self.last)
            self.last = now
            self.num_chunks += 1
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                record.finish_reason = str(choice["finish_reason"])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                record.output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                record.prompt_tokens = usage["prompt_tokens"]
        queue = server_queue_time(chunk)
        if queue is not None:
            record.queue_time_s = queue
        return self.cancel_after is not None and self.num_chunks >= self.cancel_after


def stream_session(request_timeout_s: float, max_connections: int = 0) -> aiohttp.ClientSession:
    """The session streams go through: no proxies from the environment, no connection cap by
    default (an open loop must not queue behind the client), keep-alive connections reused,
    ``request_timeout_s`` between two reads (``send_request`` also bounds the whole request)."""
    connector = aiohttp.TCPConnector(limit=max_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


_encode_json = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode


async def send_request(
    session: aiohttp.ClientSession, request: TraceRequest, config: ClientConfig, run_start: float
) -> RequestRecord:
    """Send one request, stream it to the end (or to its cancel point), and time it."""
    path, body = request_body(request, config)
    record = RequestRecord(request.id, request.group, prompt_tokens=request.prompt_tokens, task=request.task)
    headers = {"Content-Type": "application/json", **config.headers()}
    data = _encode_json(body)
    start = time.perf_counter()
    record.sent_s = start - run_start
    state = _StreamState(record, start, request.cancel_after, keep=request.check is not None)
    try:
        # A total deadline: the session's own timeouts only bound each read.
        async with asyncio.timeout(config.request_timeout_s):
            async with session.post(config.url(path), data=data, headers=headers) as response:
                record.http_status = response.status
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    record.error_kind = classify_status(response.status)
                    record.error = _error_message(text)
                    return _finish(record, state, time.perf_counter())
                stopped = await _read_stream(response.content, state)
                if stopped and record.error_kind is None:
                    record.status = "cancelled"
    except TimeoutError as exc:  # aiohttp's read timeouts are TimeoutErrors too
        record.error_kind, record.error = "timeout", f"{type(exc).__name__}: no answer within {config.request_timeout_s}s"
    except aiohttp.ClientError as exc:
        record.error_kind, record.error = "other", f"{type(exc).__name__}: {exc}"[:500]
    return _finish(record, state, time.perf_counter())


async def _read_stream(content: aiohttp.StreamReader, state: _StreamState) -> bool:
    """Fold the SSE events in as the bytes arrive; True when the client stopped on purpose.

    Every event of one read gets that read's time: they reached the client together.
    """
    pending = b""
    async for data in content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            verdict = _on_line(line, state, now)
            if verdict is not None:
                return verdict
    if pending:  # a last line without its newline
        verdict = _on_line(pending, state, time.perf_counter())
        if verdict is not None:
            return verdict
    return False


def _on_line(line: bytes, state: _StreamState, now: float) -> bool | None:
    """One SSE line: None to read on, else what ``_read_stream`` returns."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        state.done = True
        return False
    try:
        chunk = _decode_json(payload)
    except msgspec.DecodeError:
        chunk = None
    if not isinstance(chunk, dict):
        text = payload[:200].decode(errors="replace")
        state.record.error_kind, state.record.error = "other", f"bad SSE payload: {text}"
        return False
    return True if state.on_chunk(chunk, now) else None


def _finish(record: RequestRecord, state: _StreamState, now: float) -> RequestRecord:
    record.latency_s = now - state.start
    if record.status == "cancelled":
        record.output_tokens = state.num_chunks
        return record
    if record.error_kind is None:
        if state.done or record.finish_reason is not None:
            record.status = "ok"
            if record.output_tokens == 0:
                record.output_tokens = state.num_chunks
            if state.keep:
                record.text, record.tool_calls = state.answer()
        else:
            record.error_kind, record.error = "other", "the stream ended without a finish reason or [DONE]"
    return record


def _error_message(text: str) -> str:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return str(parsed["error"].get("message", parsed["error"]))[:500]
    if isinstance(parsed, dict) and "detail" in parsed:
        return str(parsed["detail"])[:500]
    return text[:500]


class AuthRefused(RuntimeError):
    """The server refused a request for authentication (401/403): no run can measure anything."""


AUTH_STATUSES = (401, 403)


def auth_refused(status: int, message: str, api_key: str) -> AuthRefused:
    hint = ("the key given was not accepted; check it with 'ferry keys list' on the server" if api_key
            else "pass --api-key KEY or set OPENAI_API_KEY")
    return AuthRefused(f"the server refused the request for authentication (HTTP {status}: {message}); {hint}")


async def discover_model(base_url: str, api_key: str = "", timeout_s: float = 10.0) -> str:
    """The first model id the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        if response.status_code in AUTH_STATUSES:
            raise auth_refused(response.status_code, _error_message(response.text), api_key)
        response.raise_for_status()
        data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def discover_model_sync(base_url: str, api_key: str = "") -> str:
    return asyncio.run(discover_model(base_url, api_key))
