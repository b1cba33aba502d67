"""Failed authentications: who the client is, and a per-address throttle on repeated failures.

A client address whose requests fail authentication more than ``limit`` times in a
``window_s`` (60 s) window gets ``429 auth_failures`` with ``Retry-After`` for
``block_s`` instead of ``401``, so a stranger hammering the gateway with bad keys
costs it even less and learns it is noticed. The count is only ever consulted on a
failure: a request with a valid key is never throttled, whatever its address did.

With Redis (``redis_url``) every gateway sharing it counts together (one small
script per failure, keys that expire with their window); without Redis, or while it
is unreachable, each gateway counts alone in memory, bounded to ``max_addresses``
addresses (the least recently failing is forgotten first).

The client address is the TCP peer, or, when the peer is one of the configured
proxies (``forwarded_allow_ips``, uvicorn's ``--forwarded-allow-ips`` semantics: IPs
or CIDRs, ``*`` for any), the right-most address of ``X-Forwarded-For`` that is not
itself a trusted proxy.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from services.gateway.errors import APIError, drain, send_error

log = logging.getLogger("ferry.gateway.auth")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The peers whose ``X-Forwarded-For`` header is believed (``forwarded_allow_ips``)."""

    def __init__(self, spec: str) -> None:
        items = [part.strip() for part in spec.split(",") if part.strip()]
        self.always = "*" in items
        self.networks: list[IPNetwork] = []
        for item in items:
            if item != "*":
                self.networks.append(ipaddress.ip_network(item, strict=False))  # ValueError: bad spec

    def __contains__(self, host: str) -> bool:
        if self.always:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def client(self, peer: str, forwarded_for: str | None) -> str:
        """The client's address for a request from ``peer`` carrying ``forwarded_for``."""
        if not forwarded_for or peer not in self:
            return peer
        hops = [_host_of(h) for h in forwarded_for.split(",") if h.strip()]
        if not hops:
            return peer
        if self.always:
            return hops[0]
        for hop in reversed(hops):  # each proxy appends the address it saw
            if hop not in self:
                return hop
        return hops[0]  # every hop is a proxy of ours


def _host_of(hop: str) -> str:
    """'1.2.3.4:5678' -> '1.2.3.4', '[::1]:80' -> '::1'; anything else stripped as is."""
    hop = hop.strip()
    if hop.startswith("[") and "]" in hop:
        return hop[1:hop.index("]")]
    if hop.count(":") == 1:
        return hop.split(":", 1)[0]
    return hop


def peer_and_forwarded(scope: Scope) -> tuple[str, str | None]:
    """The TCP peer's host and the request's X-Forwarded-For header (all of its lines)."""
    client = scope.get("client")
    peer = str(client[0]) if client else "unknown"
    values = [bytes(v).decode("latin-1") for k, v in scope.get("headers") or [] if k == b"x-forwarded-for"]
    return peer, ", ".join(values) if values else None


@dataclass(frozen=True)
class Throttled:
    """The throttle's answer to one failure: seconds the address stays blocked (0: it is not)."""

    retry_after_s: float
    started: bool = False
    """This failure started the block (the moment worth an event on the dashboard)."""

    @property
    def blocked(self) -> bool:
        return self.retry_after_s > 0


NOT_THROTTLED = Throttled(0.0)


@dataclass
class _Count:
    window_start: float
    failures: int
    blocked_until: float = 0.0


# KEYS: the address's failure count, its block flag. ARGV: window s, limit, block s.
# Returns {failures in this window, seconds the block still runs (0: none), 1 if it started now}.
_FAILURE_SCRIPT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
local left = redis.call('TTL', KEYS[2])
local started = 0
if n > tonumber(ARGV[2]) and left < 0 then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  left = tonumber(ARGV[3])
  started = 1
end
if left < 0 then left = 0 end
return {n, left, started}
"""


class FailureThrottle:
    """Counts failed authentications per client address; answers how long one is blocked."""

    def __init__(self, limit: int, block_s: float, *, window_s: float = 60.0, max_addresses: int = 10_000,
                 redis: Callable[[], Redis | None] = lambda: None, namespace: str = "ferry:",
                 redis_timeout_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.block_s = block_s
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._redis = redis
        self._namespace = namespace
        self._redis_timeout_s = redis_timeout_s
        self._clock = clock
        self._counts: collections.OrderedDict[str, _Count] = collections.OrderedDict()
        self._script: object | None = None
        self._script_client: Redis | None = None

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    async def on_failure(self, address: str) -> Throttled:
        """Count one failure from ``address``; whether (and how much longer) it is blocked."""
        if not self.enabled:
            return NOT_THROTTLED
        client = self._redis()
        if client is not None:
            try:
                return await self._shared(client, address)
            except (TimeoutError, RedisError, OSError) as exc:
                log.debug("auth failure count in Redis failed (%s); counting locally", type(exc).__name__)
        return self._local(address)

    def tracked(self) -> int:
        """Addresses held in memory (bounded by ``max_addresses``)."""
        return len(self._counts)

    def _local(self, address: str) -> Throttled:
        now = self._clock()
        entry = self._counts.get(address)
        if entry is None or now - entry.window_start >= self.window_s:
            blocked_until = entry.blocked_until if entry is not None else 0.0
            entry = _Count(window_start=now, failures=0, blocked_until=blocked_until)
        entry.failures += 1
        started = entry.failures > self.limit and entry.blocked_until <= now
        if started:
            entry.blocked_until = now + self.block_s
        self._counts[address] = entry
        self._counts.move_to_end(address)
        while len(self._counts) > self.max_addresses:
            self._counts.popitem(last=False)
        return Throttled(retry_after_s=max(0.0, entry.blocked_until - now), started=started)

    async def _shared(self, client: Redis, address: str) -> Throttled:
        if self._script is None or self._script_client is not client:
            self._script = client.register_script(_FAILURE_SCRIPT)
            self._script_client = client
        keys = [f"{self._namespace}authfail:{address}", f"{self._namespace}authblock:{address}"]
        args = [math.ceil(self.window_s), self.limit, math.ceil(self.block_s)]
        reply = await asyncio.wait_for(self._script(keys=keys, args=args),  # type: ignore[operator]
                                       self._redis_timeout_s)
        return Throttled(retry_after_s=float(reply[1]), started=bool(int(reply[2])))


# (reason, client address, the throttle's answer)
FailureHook = Callable[[str, str, Throttled], None]


class AuthFailures:
    """Where every failed authentication goes: the client's address, the throttle, the metrics."""

    def __init__(self, throttle: FailureThrottle, proxies: TrustedProxies, on_failure: FailureHook) -> None:
        self.throttle = throttle
        self.proxies = proxies
        self.on_failure = on_failure

    def address(self, scope: Scope) -> str:
        peer, forwarded = peer_and_forwarded(scope)
        return self.proxies.client(peer, forwarded)

    async def refuse(self, scope: Scope, send: Send, receive: Receive, reason: str, err: APIError) -> APIError:
        """Count the failure, answer ``err`` (or 429 while the address is blocked); the answer sent."""
        address = self.address(scope)
        verdict = await self.throttle.on_failure(address)
        self.on_failure("throttled" if verdict.blocked else reason, address, verdict)
        if verdict.blocked:
            # A blocked address's body is not read at all: the connection closes after the 429
            # (what the rest of a flood's 4 MiB bodies would cost to receive is not spent)
            seconds = max(1, math.ceil(verdict.retry_after_s - 1e-6))  # (now + 45) - now may be 45.000001
            err = APIError(429, f"Too many failed authentications from this address; retry after {seconds} s",
                           code="auth_failures", type_="rate_limit_error",
                           headers={"retry-after": str(seconds), "connection": "close"})
        elif closes_connection(scope):
            await drain(receive)
        await send_error(send, err)
        return err


def header_of(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def closes_connection(scope: Scope) -> bool:
    """Whether the server closes the connection after this answer (HTTP/1.0 or 'Connection: close')."""
    if scope.get("http_version") == "1.0":
        return (header_of(scope, b"connection") or "").lower() != "keep-alive"
    return (header_of(scope, b"connection") or "").lower() == "close"
