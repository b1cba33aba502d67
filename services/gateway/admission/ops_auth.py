"""The operator's pages behind a key when the gateway listens on a public address.

``/metrics``, ``/dashboard`` (the page, its static files, ``/dashboard/data`` and the
``/dashboard/events`` stream) and ``/v1/config`` show request ids, configuration and
internal endpoints. On a loopback bind they stay open (whoever can reach them can
already reach the machine). On any other bind they need an *admin* credential:

- the gateway's ``admin_key`` (``--admin-key``), or
- an API key created with ``ferry keys add NAME --admin`` (looked up in Redis, and in
  the gateway's cached key records while Redis is down).

It is accepted as ``Authorization: Bearer <key>`` (Prometheus: ``authorization:``
in its scrape config) or as the password of HTTP Basic auth (any user name), so a
browser prompts once and then sends it with the page, its scripts and its event
stream. No credential: 401 with ``WWW-Authenticate``; a credential that is not an
admin one (an ordinary API key included): 403. ``--allow-unauthenticated-public``,
the explicit opt-out of authentication on a public bind, leaves these pages open too.
Each refusal counts as a failed authentication of the client's address, as the API's
do (auth_failures.py: ``ferry:auth_failures_total``, and 429 once an address keeps failing).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.admission.auth_failures import AuthFailures
from services.gateway.errors import APIError

OPS_PATHS = ("/metrics", "/v1/config")
OPS_PREFIXES = ("/dashboard",)
REALM = "ferry operator pages"


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name we will not resolve here: treat it as public


def is_ops_path(path: str) -> bool:
    return path in OPS_PATHS or any(path == p or path.startswith(p + "/") for p in OPS_PREFIXES)


def presented_key(authorization: str | None) -> str | None:
    """The key in ``Bearer <key>`` or in Basic auth's password; None if absent or malformed."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password or None if sep else None
    return None


def static_admin_check(admin_key: str) -> Callable[[str], bool]:
    expected = admin_key.encode()
    return lambda key: bool(expected) and hmac.compare_digest(key.encode(), expected)


class OpsAuth:
    """ASGI middleware: an admin credential for the operator's pages (see the module doc)."""

    def __init__(self, app: ASGIApp, protect: bool, is_admin: Callable[[str], Awaitable[bool]],
                 failures: AuthFailures) -> None:
        self.app = app
        self.protect = protect
        self.is_admin = is_admin
        self.failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.protect or scope["type"] != "http" or not is_ops_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        key = presented_key(headers.get(b"authorization", b"").decode("latin-1"))
        if key is None:
            await self.failures.refuse(scope, send, receive, "missing_admin_key", APIError(
                401, "the operator's pages need an admin key on a public address: send "
                "'Authorization: Bearer <key>' (--admin-key, or a key added with 'ferry keys add NAME --admin')",
                code="missing_admin_key", type_="invalid_request_error",
                headers={"www-authenticate": f'Basic realm="{REALM}", Bearer'}))
        elif not await self.is_admin(key):
            await self.failures.refuse(scope, send, receive, "not_admin", APIError(
                403, "this key may not read the operator's pages (it is not an admin key)",
                code="not_admin", type_="invalid_request_error"))
        else:
            await self.app(scope, receive, send)
