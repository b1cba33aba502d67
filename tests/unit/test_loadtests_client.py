"""The streaming client against scripted HTTP answers (httpx MockTransport): timing, cancel, error kinds."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from loadtests.client import ClientConfig, RequestRecord, request_body, send_request
from loadtests.trace import TraceRequest

CHAT = TraceRequest(id="c1", max_tokens=8, messages=[{"role": "user", "content": "hi"}], group="chat")
PROMPT = TraceRequest(id="p1", max_tokens=8, prompt="hello", cancel_after=2)
CONFIG = ClientConfig("http://server", "m", request_timeout_s=5.0)


def sse(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


def delta(text: str, finish: str | None = None, usage: dict | None = None) -> dict:
    out: dict = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    if usage:
        out["usage"] = usage
    return out


def run(request: TraceRequest, handler: Callable[[httpx.Request], httpx.Response],
        config: ClientConfig = CONFIG) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, request, config, time.perf_counter())

    return asyncio.run(go())


def paced(parts: list[bytes], gap_s: float) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for part in parts:
            await asyncio.sleep(gap_s)
            yield part

    return gen()


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

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["model"] == "m"
        return httpx.Response(200, content=paced(parts, 0.03), headers={"content-type": "text/event-stream"})

    record = run(CHAT, handler)
    assert record.status == "ok" and record.finish_reason == "length"
    assert record.output_tokens == 4 and record.prompt_tokens == 9  # usage wins over chunk counting
    assert record.ttft_s is not None and record.ttft_s >= 0.05  # role chunk is not a token
    assert len(record.itl_s) == 2 and all(g >= 0.02 for g in record.itl_s)
    assert record.latency_s is not None and record.latency_s >= record.ttft_s + sum(record.itl_s)


def test_without_usage_tokens_are_counted_per_chunk() -> None:
    parts = sse({"choices": [{"index": 0, "text": "x"}]}, {"choices": [{"index": 0, "text": "y",
                                                                       "finish_reason": "stop"}]})
    record = run(TraceRequest(id="p", max_tokens=4, prompt="q"), lambda r: httpx.Response(200, content=b"".join(parts)))
    assert record.status == "ok" and record.output_tokens == 2 and record.finish_reason == "stop"


def test_cancel_after_closes_the_stream_and_is_not_a_completion() -> None:
    parts = sse(*[{"choices": [{"index": 0, "text": t}]} for t in "abcdef"], "[DONE]")
    record = run(PROMPT, lambda r: httpx.Response(200, content=b"".join(parts)))
    assert record.status == "cancelled" and record.output_tokens == 2 and record.error_kind is None


@pytest.mark.parametrize(("status", "kind"), [(429, "429"), (503, "503"), (504, "timeout"), (400, "other"),
                                              (500, "other")])
def test_http_errors_are_split_by_kind(status: int, kind: str) -> None:
    body = {"error": {"message": "queue is full", "type": "x", "param": None, "code": status}}
    record = run(CHAT, lambda r: httpx.Response(status, json=body))
    assert record.status == "error" and record.error_kind == kind and record.http_status == status
    assert record.error == "queue is full"


def test_error_event_inside_the_stream() -> None:
    parts = sse(delta("a"), {"error": {"message": "queue timeout", "code": 503}})
    record = run(CHAT, lambda r: httpx.Response(200, content=b"".join(parts)))
    assert record.status == "error" and record.error_kind == "503" and record.ttft_s is not None


@pytest.mark.parametrize(("code", "kind"), [("queue_timeout", "503"), ("queue_full", "429"), ("engine_error", "other")])
def test_error_event_with_ferrys_string_code(code: str, kind: str) -> None:
    # ferry's gateway sends its error code as a string once the stream's 200 is out: a queue timeout
    # after the headers is still a queue timeout (a 503), not "other".
    parts = sse(delta("a"), {"error": {"message": "the request waited too long", "type": "x", "code": code}})
    record = run(CHAT, lambda r: httpx.Response(200, content=b"".join(parts)))
    assert record.status == "error" and record.error_kind == kind


def test_stream_that_ends_early_is_an_error() -> None:
    record = run(CHAT, lambda r: httpx.Response(200, content=b"".join(sse(delta("a")))))
    assert record.status == "error" and record.error_kind == "other" and "ended" in (record.error or "")


def test_total_deadline_is_a_timeout() -> None:
    parts = sse(*[delta("a")] * 50, "[DONE]")
    record = run(CHAT, lambda r: httpx.Response(200, content=paced(parts, 0.05)),
                 ClientConfig("http://server", "m", request_timeout_s=0.3))
    assert record.status == "error" and record.error_kind == "timeout"


def test_connection_failure_is_other() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    record = run(CHAT, handler)
    assert record.status == "error" and record.error_kind == "other" and "ConnectError" in (record.error or "")


def test_server_reported_queue_time_is_read() -> None:
    parts = sse(delta("a", "stop", {"completion_tokens": 1, "queue_wait_time_in_ms": 250}), "[DONE]")
    record = run(CHAT, lambda r: httpx.Response(200, content=b"".join(parts)))
    assert record.queue_time_s == pytest.approx(0.25)
    parts = sse({**delta("a", "stop"), "timings": {"queue_time_s": 0.5}}, "[DONE]")
    assert run(CHAT, lambda r: httpx.Response(200, content=b"".join(parts))).queue_time_s == 0.5
