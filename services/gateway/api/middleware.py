"""ASGI middleware in front of the API: request body size, time, content type and shape.

Pure ASGI (no ``BaseHTTPMiddleware``), so streaming responses and disconnect
detection pass through untouched. For the JSON endpoints the whole body is read
here first, then checked (``body_check.py``: UTF-8, JSON, no lone surrogates, no
duplicate keys, bounded depth and list lengths, per-field limits) and handed to
the app; so every refusal below is an OpenAI-shaped 4xx, never a dropped
connection:

- a body larger than ``max_body_bytes`` gets a 413, at once when ``Content-Length``
  says so, otherwise as soon as the streamed body crosses the limit. Either way the
  rest of the body is read and discarded first (up to ``DRAIN_MAX_BYTES`` and
  ``DRAIN_MAX_S``): answering and closing while the client is still sending makes the
  kernel reset the connection, and the client never sees the 413;
- a body that takes longer than ``body_timeout_s`` to arrive gets a 408;
- a POST whose body is not declared as JSON gets a clear 400 (parsing ``text/plain``
  as JSON would let any web page post to a local server without a CORS preflight).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.api.body_check import RequestLimits, check_body
from services.gateway.errors import APIError, drain, send_error


def _too_large(limit: int, size: int | None = None) -> APIError:
    told = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"the request body{told} is larger than this server accepts ({limit} bytes)",
                    code="request_too_large")


class _BodyError(Exception):
    def __init__(self, err: APIError, drain: bool) -> None:
        super().__init__(err.message)
        self.err = err
        self.drain = drain  # the client may still be sending


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, json_paths: tuple[str, ...],
                 limits: Callable[[], RequestLimits] = RequestLimits, body_timeout_s: float = 30.0,
                 on_refused: Callable[[str, APIError], None] | None = None) -> None:
        self.app = app
        self.on_refused = on_refused  # (path, error): the refusals made here never reach the error handlers
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths
        self.limits = limits
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await drain(receive)
            await self._refuse(scope, send, _too_large(self.max_body_bytes, int(length)))
            return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["path"] not in self.json_paths:
            await self.app(scope, receive, send)
            return
        if ctype != b"application/json":
            await drain(receive)
            shown = ctype.decode("latin-1") or "none"
            await self._refuse(scope, send, APIError(
                400, f"the request body must be JSON sent with 'Content-Type: application/json' (got {shown})",
                code="invalid_content_type"))
            return
        try:
            raw = await self._read_body(receive)
            check_body(raw, self.limits())
        except _BodyError as e:
            if e.drain:
                await drain(receive)
            await self._refuse(scope, send, e.err)
            return
        except APIError as e:
            await self._refuse(scope, send, e)
            return
        if raw is None:
            return  # the client left while sending
        await self.app(scope, _replay(raw, receive), send)

    async def _refuse(self, scope: Scope, send: Send, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused(scope["path"], err)
        await send_error(send, err)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, left))
            except TimeoutError:
                raise _BodyError(APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                          code="request_timeout"), drain=False) from None
            if message["type"] == "http.disconnect":
                raise _BodyError(APIError(400, "the client disconnected while sending the body"), drain=False)
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                raise _BodyError(_too_large(self.max_body_bytes), drain=bool(message.get("more_body")))
            chunks.append(body)
            if not message.get("more_body"):
                return b"".join(chunks)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """The body once, then the real receive (the app still sees a client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay
