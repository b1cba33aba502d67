"""OpenAI-shaped errors: one exception type, and the handlers that turn everything into it.

Every refusal the gateway makes has the body
``{"error": {"message", "type", "param", "code"}}`` and the right status. FastAPI's
own 422 validation body and Starlette's plain-text errors are converted here, so a
client never sees a second error format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Send

log = logging.getLogger("ferry.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A refusal with an HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self._type = type_
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self._type is not None:
            return self._type
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: float | None = None, code: str = "unavailable") -> APIError:
    headers = {"Retry-After": retry_after_header(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, code=code, headers=headers)


def retry_after_header(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "1"
    return str(max(1, math.ceil(seconds)))


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_union_tag(part: str) -> bool:
    """pydantic names the union member an error came from inside ``loc`` ('str', 'list[int]')."""
    return part in _TYPE_NAMES or "[" in part or "-" in part


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    parts: list[str] = []
    for p in loc:
        if p in ("body", "query", "path"):
            continue
        if isinstance(p, str) and _is_union_tag(p):
            continue
        parts.append(str(p))
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _most_telling(errors: Sequence[Any]) -> Any:
    """Of a union's failed members, the error that is not just "wrong type" says most."""
    for e in errors:
        if not str(e.get("type", "")).endswith("_type"):
            return e
    return errors[0]


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = _most_telling(errors)
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON", code="invalid_json")
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if param is None:
        return bad_request(f"invalid request body: {msg}")
    return bad_request(f"{param}: {msg}", param=param)


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, APIError], None] | None = None) -> None:
    """Convert every error to OpenAI's shape; ``on_error`` sees each refusal (for metrics and logs)."""

    def refuse(request: Request, err: APIError) -> JSONResponse:
        if on_error is not None:
            try:
                on_error(request, err)
            except Exception:
                log.exception("the on_error hook failed")
        return err.response()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return refuse(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return refuse(request, validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return refuse(request, APIError(exc.status_code, detail, code=code, headers=exc.headers))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler")
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


# -- answering a refusal at the ASGI level (the middlewares, before any route) --

DRAIN_MAX_BYTES = 64 << 20  # read at most this much of a refused body before closing anyway
DRAIN_MAX_S = 10.0


async def send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def drain(receive: Receive) -> None:
    """Read and discard the rest of a refused body (bounded), so the answer reaches the client."""
    drained = 0
    deadline = time.monotonic() + DRAIN_MAX_S
    while drained < DRAIN_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body"):
            return
