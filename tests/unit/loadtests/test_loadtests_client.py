"""The streaming client against scripted HTTP answers from a real local server: timing, cancel, error kinds.

Each test's handler is an aiohttp web handler served on 127.0.0.1 for that test alone,
so the client's real HTTP stack (connection, chunked transfer, SSE framing) is exercised.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from loadtests.client import ClientConfig, RequestRecord, request_body, send_request, stream_session
from loadtests.trace import TraceRequest

CHAT = TraceRequest(id="c1", max_tokens=8, messages=[{"role": "user", "content": "hi"}], group="chat")
PROMPT = TraceRequest(id="p1", max_tokens=8, prompt="hello", cancel_after=2)
CONFIG = ClientConfig("http://server", "m", request_timeout_s=5.0)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sse(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


def delta(text: str, finish: str | None = None, usage: dict | None = None) -> dict:
    out: dict = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    if usage:
        out["usage"] = usage
    return out


def run(request: TraceRequest, handler: Handler, config: ClientConfig = CONFIG) -> RequestRecord:
    async def go() -> RequestRecord:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            local = ClientConfig(f"http://127.0.0.1:{port}", config.model, request_timeout_s=config.request_timeout_s)
            async with stream_session(local.request_timeout_s) as session:
                return await send_request(session, request, local, time.perf_counter())
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def stream(parts: list[bytes], gap_s: float = 0.0, split: bool = False) -> Handler:
    """A handler that streams ``parts`` (one write each, ``gap_s`` apart; ``split``: every
    part written in two halves, so events straddle reads)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in parts:
            if gap_s:
                await asyncio.sleep(gap_s)
            halves = [part[: len(part) // 2], part[len(part) // 2:]] if split else [part]
            for half in halves:
                await response.write(half)
                if split:
                    await asyncio.sleep(0.005)
        await response.write_eof()
        return response

    return handler


def whole(parts: list[bytes]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"".join(parts), content_type="text/event-stream")

    return handler


def test_bodies_follow_the_trace_line() -> None:
    path, body = request_body(CHAT, ClientConfig("http://s/", "m", ignore_eos=True, extra_body={"top_p": 0.5}))
    assert path == "/v1/chat/completions"
    assert body["messages"] == CHAT.messages and body["max_tokens"] == 8 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True and body["top_p"] == 0.5
    path, body = request_body(PROMPT, CONFIG)
    assert path == "/v1/completions" and body["prompt"] == "hello" and "ignore_eos" not in body


def test_timing_per_text_chunk_and_usage_tokens() -> None:
    parts = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, delta("a"), delta("b"), delta("c"),
                delta("", "length", {"prompt_tokens": 9, "completion_tokens": 4}), "[DONE]")

    bodies: list[dict] = []
    inner = stream(parts, 0.03)

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        return await inner(request)

    record = run(CHAT, handler)
    assert bodies[0]["model"] == "m" and bodies[0]["messages"] == CHAT.messages
    assert record.status == "ok" and record.finish_reason == "length"
    assert record.output_tokens == 4 and record.prompt_tokens == 9  # usage wins over chunk counting
    assert record.ttft_s is not None and record.ttft_s >= 0.05  # role chunk is not a token
    assert len(record.itl_s) == 2 and all(g >= 0.02 for g in record.itl_s)
    assert record.latency_s is not None and record.latency_s >= record.ttft_s + sum(record.itl_s)


def test_without_usage_tokens_are_counted_per_chunk() -> None:
    parts = sse({"choices": [{"index": 0, "text": "x"}]}, {"choices": [{"index": 0, "text": "y",
                                                                       "finish_reason": "stop"}]})
    record = run(TraceRequest(id="p", max_tokens=4, prompt="q"), whole(parts))
    assert record.status == "ok" and record.output_tokens == 2 and record.finish_reason == "stop"


def test_cancel_after_closes_the_stream_and_is_not_a_completion() -> None:
    parts = sse(*[{"choices": [{"index": 0, "text": t}]} for t in "abcdef"], "[DONE]")
    record = run(PROMPT, stream(parts))
    assert record.status == "cancelled" and record.output_tokens == 2 and record.error_kind is None


@pytest.mark.parametrize(("status", "kind"), [(429, "429"), (503, "503"), (504, "timeout"), (400, "other"),
                                              (500, "other")])
def test_http_errors_are_split_by_kind(status: int, kind: str) -> None:
    body = {"error": {"message": "queue is full", "type": "x", "param": None, "code": status}}
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    record = run(CHAT, handler)
    assert record.status == "error" and record.error_kind == kind and record.http_status == status
    assert record.error == "queue is full"


def test_error_event_inside_the_stream() -> None:
    parts = sse(delta("a"), {"error": {"message": "queue timeout", "code": 503}})
    record = run(CHAT, whole(parts))
    assert record.status == "error" and record.error_kind == "503" and record.ttft_s is not None


@pytest.mark.parametrize(("code", "kind"), [("queue_timeout", "503"), ("queue_full", "429"), ("engine_error", "other")])
def test_error_event_with_ferrys_string_code(code: str, kind: str) -> None:
    # ferry's gateway sends its error code as a string once the stream's 200 is out: a queue timeout
    # after the headers is still a queue timeout (a 503), not "other".
    parts = sse(delta("a"), {"error": {"message": "the request waited too long", "type": "x", "code": code}})
    record = run(CHAT, whole(parts))
    assert record.status == "error" and record.error_kind == kind


def test_stream_that_ends_early_is_an_error() -> None:
    record = run(CHAT, whole(sse(delta("a"))))
    assert record.status == "error" and record.error_kind == "other" and "ended" in (record.error or "")


def test_total_deadline_is_a_timeout() -> None:
    parts = sse(*[delta("a")] * 50, "[DONE]")
    record = run(CHAT, stream(parts, 0.05), ClientConfig("http://server", "m", request_timeout_s=0.3))
    assert record.status == "error" and record.error_kind == "timeout"


def test_connection_failure_is_other() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def go() -> RequestRecord:
        config = ClientConfig(f"http://127.0.0.1:{port}", "m", request_timeout_s=5.0)
        async with stream_session(5.0) as session:
            return await send_request(session, CHAT, config, time.perf_counter())

    record = asyncio.run(go())
    assert record.status == "error" and record.error_kind == "other" and "Connect" in (record.error or "")


def test_events_split_across_reads_are_put_back_together() -> None:
    parts = sse(delta("ab"), delta("c", "stop", {"completion_tokens": 2}), "[DONE]")
    record = run(CHAT, stream(parts, split=True))
    assert record.status == "ok" and record.output_tokens == 2 and record.finish_reason == "stop"
    assert len(record.itl_s) == 1


def test_a_payload_that_is_not_a_json_object_is_an_error() -> None:
    record = run(CHAT, whole([b"data: {not json\n\n", *sse("[DONE]")]))
    assert record.status == "error" and record.error_kind == "other" and "bad SSE payload" in (record.error or "")
    record = run(CHAT, whole([b"data: [1, 2]\n\n", *sse("[DONE]")]))
    assert record.status == "error" and "bad SSE payload: [1, 2]" in (record.error or "")


def test_crlf_lines_and_comments_are_read() -> None:
    body = b": keep-alive\r\n\r\ndata: " + json.dumps(delta("x", "stop")).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    record = run(CHAT, whole([body]))
    assert record.status == "ok" and record.output_tokens == 1 and record.finish_reason == "stop"


def test_server_reported_queue_time_is_read() -> None:
    parts = sse(delta("a", "stop", {"completion_tokens": 1, "queue_wait_time_in_ms": 250}), "[DONE]")
    record = run(CHAT, whole(parts))
    assert record.queue_time_s == pytest.approx(0.25)
    parts = sse({**delta("a", "stop"), "timings": {"queue_time_s": 0.5}}, "[DONE]")
    assert run(CHAT, whole(parts)).queue_time_s == 0.5
