"""A stream whose client stops reading is ended after the stall timeout, and only then.

Unit test of ``_DisconnectAwareStream`` alone: ASGI ``send`` and ``receive`` are
plain coroutines here (the real server is covered by tests/unit/gateway/test_gateway_app.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gateway.api import serving


def run_stream(monkeypatch: pytest.MonkeyPatch, block_at: int | None, slow_s: float = 0.0) -> dict[str, Any]:
    monkeypatch.setattr(serving, "STREAM_STALL_TIMEOUT_S", 0.3)
    monkeypatch.setattr(serving, "STREAM_STALL_CHECK_S", 0.05)
    seen: dict[str, Any] = {"sent": [], "closed": 0, "acloses": 0}

    async def content() -> AsyncIterator[bytes]:
        try:
            for i in range(6):
                yield f"data: {i}\n\n".encode()
        finally:
            seen["acloses"] += 1

    async def send(message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.body" and message.get("body"):
            if block_at is not None and len(seen["sent"]) == block_at:
                await asyncio.Event().wait()  # the reader stopped: this write never returns
            await asyncio.sleep(slow_s)  # a slow reader that still reads
            seen["sent"].append(message["body"])

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never disconnects
        return {}

    async def main() -> float:
        response = serving._DisconnectAwareStream(content(), on_close=lambda: seen.__setitem__(
            "closed", seen["closed"] + 1))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
        return loop.time() - t0

    seen["elapsed_s"] = asyncio.run(main())
    return seen


def test_a_reader_that_stops_is_cut_off_after_the_stall_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = run_stream(monkeypatch, block_at=2)
    assert seen["sent"] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert 0.3 <= seen["elapsed_s"] < 5.0
    assert seen["closed"] == 1 and seen["acloses"] == 1


def test_slow_writes_under_the_timeout_are_not_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    # every write takes 0.1 s, the whole stream 0.6 s: longer than the timeout in total,
    # but no single write is, so every chunk arrives
    seen = run_stream(monkeypatch, block_at=None, slow_s=0.1)
    assert seen["sent"] == [f"data: {i}\n\n".encode() for i in range(6)]
    assert seen["closed"] == 1 and seen["acloses"] == 1
