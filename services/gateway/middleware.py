"""ASGI middleware in front of the API: request body size and content type.

Pure ASGI (no ``BaseHTTPMiddleware``), so streaming responses and disconnect
detection pass through untouched. A body larger than ``max_body_bytes`` gets a
413 before it is buffered: at once when ``Content-Length`` says so, otherwise as
soon as the streamed body crosses the limit. A POST whose body is not declared as
JSON gets a clear 400 (parsing ``text/plain`` as JSON would let any web page post
to a local server without a CORS preflight).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _too_large(limit: int, size: int | None = None) -> APIError:
    told = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"the request body{told} is larger than this server accepts ({limit} bytes)",
                    code="request_too_large")


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, json_paths: tuple[str, ...],
                 on_refused: Callable[[str, APIError], None] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths
        self.on_refused = on_refused  # (path, error): the refusals made here never reach the error handlers

    async def _refuse(self, scope: Scope, send: Send, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused(scope["path"], err)
        await _send_error(send, err)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._refuse(scope, send, _too_large(self.max_body_bytes, int(length)))
            return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["path"] in self.json_paths and ctype != b"application/json":
            shown = ctype.decode("latin-1") or "none"
            await self._refuse(scope, send, APIError(
                400, f"the request body must be JSON sent with 'Content-Type: application/json' (got {shown})",
                code="invalid_content_type"))
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message: dict[str, Any] = dict(await receive())
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, _too_large(limit).message)
            return message

        return limited_receive
