"""Authentication before any work: the API key is checked from the header alone.

``AuthGate`` is the outermost middleware. For every API path (everything under
``/v1/`` except the operator's pages, plus ``/tokenize`` and ``/detokenize``; a path
added later under ``/v1/`` is covered without a change here) it checks the
``Authorization`` header before the body is read: no JSON parsing, tokenization,
chat templating, grammar compilation, model lookup or backpressure check happens
for a request without a valid key. A stranger gets ``401`` in OpenAI's error shape
and nothing else (no model names, no validation detail), answered at once whatever
the body holds; an address that keeps failing gets ``429`` (auth_failures.py).

For the generation endpoints a key this gateway already knows (the static key, or a
cached key record) passes without a Redis round trip: the admission script that
charges the key's limits after tokenization checks it again, atomically. The other
API endpoints ask Redis now, as they charge nothing later.

Refused bodies are not read: on a keep-alive connection the HTTP server discards the
rest of the body and the client reads the answer once it has sent it; a connection
that will close is drained first (bounded), so the client is not reset mid-send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.admission.auth import AdmissionError, parse_bearer
from services.gateway.admission.auth_failures import AuthFailures, closes_connection, header_of
from services.gateway.admission.ops_auth import is_ops_path
from services.gateway.errors import APIError, drain, send_error

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
KEYED_PATHS = ("/tokenize", "/detokenize")

# (authorization header, whether a later admission step re-checks the key) -> raises AdmissionError
Authenticate = Callable[[str | None, bool], Awaitable[None]]


def needs_key(path: str) -> bool:
    """Whether ``path`` is an API endpoint behind the key rules (the ops pages have their own)."""
    return (path.startswith("/v1/") and not is_ops_path(path)) or path in KEYED_PATHS


class AuthGate:
    """ASGI middleware: the key rules for the API paths, before anything else (module doc)."""

    def __init__(self, app: ASGIApp, authenticate: Authenticate, failures: AuthFailures,
                 on_refused: Callable[[str, APIError], None] | None = None) -> None:
        self.app = app
        self.authenticate = authenticate
        self.failures = failures
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = header_of(scope, b"authorization")
        try:
            await self.authenticate(header, scope["path"] in GENERATION_PATHS)
        except AdmissionError as e:
            err = APIError(e.status, e.message, code=e.code, headers=e.headers, type_=e.type)
            if e.status == 401:
                reason = "missing_key" if parse_bearer(header) is None else "invalid_key"
                err = await self.failures.refuse(scope, send, receive, reason, err)
            else:  # 503: the keys cannot be verified now (says nothing about the request)
                if closes_connection(scope):
                    await drain(receive)
                await send_error(send, err)
            if self.on_refused is not None:
                self.on_refused(scope["path"], err)
            return
        await self.app(scope, receive, send)
