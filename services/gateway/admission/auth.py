"""The gateway's admission: who may call (API keys) and how often (per-key limits).

Modes, from the gateway's config:

- no ``api_key`` and no ``redis_url``, or a Redis in which no key was ever added:
  open, every request is admitted without limits;
- ``api_key``: a single static key (constant-time comparison), no limits;
- ``redis_url`` with keys added by ``ferry keys``: each key has a name, a default
  priority and per-minute request and token limits, enforced atomically in Redis
  (see ratelimit.py), so every gateway sharing the Redis shares one allowance.
  The static key, if also set, keeps working beside them.

Redis outages: each call to Redis is bounded by ``redis_timeout_s`` (the config's, 100 ms);
on failure the gateway marks Redis degraded, stops calling it on the request
path, and admits with per-gateway limits from its cached copy of the key
records (refreshed every ``refresh_interval_s``), while a background task pings
Redis and switches shared limits back on when it answers. A key this gateway
has never seen cannot be verified during an outage and gets a 503.

The per-gateway limits *share* the key's allowance: with every refresh the
gateway also counts the gateways registered in Redis (the engine registry's
``gateways`` set, live entries only), and while Redis is down it enforces
``limit // N`` of the key's rpm and tpm, N being the last count it saw (at least
one; at least one request per window even when N exceeds the limit). So N
gateways cut off from Redis together admit about what the shared limit would
have, not N times it.

Secrets are never logged or stored: only their SHA-256 is looked up.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.gateway.admission import keystore
from services.gateway.admission.keystore import KeyRecord, Layout
from services.gateway.admission.ratelimit import Decision, LocalLimiter, SharedLimiter, token_cost
from shared.config import GatewayConfig

log = logging.getLogger("ferry.gateway.auth")

STATIC_KEY_NAME = "static"


class AdmissionError(Exception):
    """A refusal, ready to become an OpenAI-style error response."""

    def __init__(self, status: int, message: str, code: str,
                 headers: dict[str, str] | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


_ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


@dataclass(frozen=True)
class Grant:
    """An admitted request: who it is, its default priority, the x-ratelimit-* headers."""

    key_name: str | None
    priority: int | None
    headers: dict[str, str] = field(default_factory=dict)
    key_hash: str | None = None
    reserved_tokens: int = 0
    tpm: int = 0
    shared: bool = False
    """True when the limits were checked in Redis (so usage is reconciled there)."""


def _open() -> Grant:
    """A grant for open mode (a fresh one each time: callers may add headers)."""
    return Grant(key_name=None, priority=None)


def parse_bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


class Admission:
    def __init__(self, config: GatewayConfig, gateway_id: str, *,
                 redis_timeout_s: float | None = None, refresh_interval_s: float = 10.0,
                 reconnect_interval_s: float = 0.5, namespace: str = keystore.DEFAULT_NAMESPACE) -> None:
        self.config = config
        self.gateway_id = gateway_id
        self.layout = Layout(namespace)
        if redis_timeout_s is None:
            redis_timeout_s = config.redis_timeout_s
        self.redis_timeout_s = redis_timeout_s
        self.refresh_interval_s = refresh_interval_s
        self.reconnect_interval_s = reconnect_interval_s
        self.local = LocalLimiter()
        self._static = config.api_key.encode() if config.api_key else None
        self._client = keystore.async_client(config.redis_url, redis_timeout_s) if config.redis_url else None
        self._shared = SharedLimiter(self._client, redis_timeout_s) if self._client else None
        self._consecutive_timeouts = 0
        self._last_timeout_at: float | None = None  # monotonic time of the last counted timeout
        self._auth_enabled: bool | None = None  # unknown until Redis answered once
        self._cache: dict[str, KeyRecord] = {}
        self._state = "disabled" if self._client is None else "connecting"
        self._detail = ""
        self._degraded_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.fallback_admissions = 0
        self.num_gateways = 1  # gateways registered at the last refresh: the fallback's share

    # -- public API ---------------------------------------------------------

    async def authorize(self, authorization_header: str | None,
                        num_prompt_tokens: int, max_tokens: int) -> Grant:
        self._ensure_task()
        token = parse_bearer(authorization_header)
        if token is not None and self._static is not None and hmac.compare_digest(token.encode(), self._static):
            return Grant(key_name=STATIC_KEY_NAME, priority=None)
        if self._client is None:
            if self._static is None:
                return _open()
            raise _unauthorized(token)
        for _ in range(2):
            if self._state == "degraded":
                break
            started = time.monotonic()
            try:
                return await self._authorize_shared(token, num_prompt_tokens, max_tokens)
            except (TimeoutError, RedisError, OSError) as exc:
                self._on_failure(exc, started)
            if self._decidable_locally(token):
                break
            # One timeout, Redis not (yet) marked down, and the cache cannot decide this key
            # (a cold gateway, or a key it has not seen): the budget may have run out in our
            # own busy event loop, not in Redis. Ask once more before answering 503. (If the
            # first call did reach Redis, the key is charged twice: stricter, never looser.)
        return self._authorize_local(token, num_prompt_tokens, max_tokens)

    async def is_admin(self, token: str) -> bool:
        """Whether ``token`` is a key added with ``ferry keys add --admin`` (ops_auth.py).

        Read from Redis (bounded) and cached; while Redis is degraded, from the cache."""
        if self._client is None:
            return False
        key_hash = keystore.hash_key(token)
        cached = self._cache.get(key_hash)
        if self._state == "degraded":
            return cached is not None and cached.admin
        started = time.monotonic()
        try:
            fields = await asyncio.wait_for(self._client.hgetall(self.layout.record(key_hash)),
                                            self.redis_timeout_s * 5)
        except (TimeoutError, RedisError, OSError) as exc:
            self._on_failure(exc, started)
            return cached is not None and cached.admin
        if not fields:
            self._cache.pop(key_hash, None)  # revoked
            return False
        record = KeyRecord.from_redis(key_hash, fields)
        self._cache[key_hash] = record
        return record.admin

    async def record_usage(self, grant: Grant, num_tokens: int) -> None:
        """Reconcile the token reservation with what the request really used."""
        if grant.key_hash is None or grant.tpm <= 0:
            return
        delta = grant.reserved_tokens - num_tokens
        if delta == 0:
            return
        if grant.shared and self._state != "degraded" and self._shared is not None:
            started = time.monotonic()
            try:
                await self._shared.refund(self.layout.bucket(grant.key_hash, "tok"), grant.tpm, delta)
                return
            except (TimeoutError, RedisError, OSError) as exc:
                self._on_failure(exc, started)
        self.local.refund(grant.key_hash, grant.tpm, delta)

    def shared_client(self) -> Redis | None:
        """The Redis client while Redis answers (None: no Redis, or degraded): the failure throttle's."""
        return self._client if self._state != "degraded" else None

    def health(self) -> dict[str, Any]:
        """{"redis": "ok" | "degraded" | "disabled", "detail": ..., "auth": mode, ...}."""
        self._ensure_task()
        out: dict[str, Any] = {
            "redis": "ok" if self._state == "connecting" else self._state,
            "detail": "not contacted yet" if self._state == "connecting" else self._detail,
            "auth": self.auth_mode(),
            "keys_cached": len(self._cache),
        }
        if self._degraded_since is not None:
            out["degraded_since"] = self._degraded_since
            out["fallback_admissions"] = self.fallback_admissions
            out["fallback_share"] = f"1/{self.num_gateways} of each key's limits"
        return out

    async def authenticate(self, authorization_header: str | None, checked_later: bool = False) -> None:
        """The key rules without the limits: raises the same 401 (or 503 when keys cannot be
        verified) as ``authorize`` would, and charges no request or token allowance.

        Every API request passes here first, from the header alone (auth_gate.py). With
        ``checked_later`` (generation: ``authorize`` runs after tokenization and checks the
        key again in Redis, atomically) a key this gateway knows passes without a Redis round
        trip; a missing key is refused without one whenever keys are known to be required."""
        self._ensure_task()
        token = parse_bearer(authorization_header)
        if token is not None and self._static is not None and hmac.compare_digest(token.encode(), self._static):
            return
        if self._client is None:
            if self._static is not None:
                raise _unauthorized(token)
            return
        if token is None and (self._auth_enabled or (self._auth_enabled is False and self._static is not None)):
            raise _unauthorized(token)
        key_hash = keystore.hash_key(token or "")
        if checked_later and (self._auth_enabled is False and self._static is None
                              or self._auth_enabled and key_hash in self._cache):
            return  # open, or a key known here: authorize's script decides, in the same round trip
        for _ in range(2):  # asked again once, as in authorize, when only Redis can decide
            if self._state == "degraded":
                break
            started = time.monotonic()
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.exists(self.layout.auth_flag)
                pipe.exists(self.layout.record(key_hash))
                enabled, known = await asyncio.wait_for(pipe.execute(), self.redis_timeout_s)
                self._mark_ok()
            except (TimeoutError, RedisError, OSError) as exc:
                self._on_failure(exc, started)
                if self._decidable_locally(token):
                    break
                continue
            if enabled:
                if known and token is not None:
                    return
                raise _unauthorized(token)
            if not self._auth_enabled:  # no keys in Redis: open, or the static key only
                if self._static is None:
                    return
                raise _unauthorized(token)
            break  # keys were on and Redis has none now (it lost its data): the cache decides
        # Redis is down: the cached records decide, as for generation requests.
        if self._auth_enabled is None:
            raise AdmissionError(503, "API keys cannot be verified: the key store (Redis) is unreachable",
                                 "key_store_unavailable", {"retry-after": "1"})
        if not self._auth_enabled and self._static is None:
            return
        if token is None or key_hash not in self._cache:
            raise _unauthorized(token)

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not) for /ready: not ready while keys are kept in a Redis that has never
        answered this gateway, since every API request would get a 503 then (a static key alone
        still admits its holder, so that gateway is ready). Once Redis has answered, an outage
        does not make the gateway unready: the cached keys decide (module doc)."""
        self._ensure_task()
        if self._client is None or self._auth_enabled is not None or self._static is not None:
            return True, "ready"
        why = f": {self._detail}" if self._detail else ""
        return False, f"API keys cannot be verified yet: the key store (Redis) has not answered{why}"

    async def check_now(self) -> None:
        """Probe Redis now (GET /health): a refused connection shows as degraded at once, not at
        the next request or watcher tick, and ``keys_cached`` is refreshed from Redis."""
        if self._client is not None and not self._closed:
            await self._probe()

    def auth_mode(self) -> str:
        """'none', 'static', 'redis', 'static+redis' or 'unknown' (Redis never reached)."""
        if self._client is None:
            return "static" if self._static is not None else "none"
        if self._auth_enabled is None:
            return "unknown"
        if self._auth_enabled:
            return "static+redis" if self._static is not None else "redis"
        return "static" if self._static is not None else "none"

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            # The flag ends the loop even if a library swallows the cancellation.
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2 * self.reconnect_interval_s + 1.0)
            self._task = None
        if self._client is not None:
            await self._client.aclose()

    # -- shared (Redis) path ----------------------------------------------

    async def _authorize_shared(self, token: str | None, num_prompt_tokens: int, max_tokens: int) -> Grant:
        assert self._shared is not None
        # One script decides everything (auth on?, key known?, limits), atomically.
        key_hash = keystore.hash_key(token or "")
        keys = [self.layout.auth_flag, self.layout.record(key_hash),
                self.layout.bucket(key_hash, "req"), self.layout.bucket(key_hash, "tok")]
        reply = await self._shared.admit(keys, [num_prompt_tokens, max_tokens])
        self._mark_ok()
        status = reply[0]
        if status == "open" and self._auth_enabled:
            # Keys were on and Redis has none now: it lost its data (restarted without
            # persistence). Never fall open: serve from the cache until the watcher restores them.
            self._mark_lost()
            return self._authorize_local(token, num_prompt_tokens, max_tokens)
        if status == "open":
            self._auth_enabled = False
            if self._static is None:
                return _open()
            raise _unauthorized(token)
        self._auth_enabled = True
        if status == "unknown" or token is None:
            self._cache.pop(key_hash, None)
            raise _unauthorized(token)
        old = self._cache.get(key_hash)
        record = KeyRecord(name=reply[1], key_hash=key_hash, priority=int(reply[2] or 0),
                           rpm=int(float(reply[3])), tpm=int(float(reply[4])),
                           created=old.created if old else 0.0, admin=old.admin if old else False)
        self._cache[key_hash] = record
        if status == "too_large":
            raise _too_large(num_prompt_tokens, record.tpm)
        decision = Decision.from_script(reply)
        return self._grant_or_raise(record=record, decision=decision, cost=int(float(reply[10])), shared=True)

    async def _refresh(self) -> None:
        assert self._client is not None
        timeout = self.redis_timeout_s * 10
        enabled, records = await asyncio.wait_for(keystore.load_all(self._client, self.layout), timeout)
        if not enabled and self._auth_enabled:
            log.warning("redis lost its API keys; restoring %d key records from this gateway's cache",
                        len(self._cache))
            await asyncio.wait_for(keystore.restore(self._client, self.layout, list(self._cache.values())),
                                   timeout)
            enabled, records = await asyncio.wait_for(keystore.load_all(self._client, self.layout), timeout)
        self._auth_enabled = enabled
        self._cache = records
        now = time.time()
        gateways = await asyncio.wait_for(self._client.zcount(f"{self.layout.namespace}gateways", now, "+inf"), timeout)
        self.num_gateways = max(1, int(gateways))

    # -- local (fallback) path ----------------------------------------------

    def _authorize_local(self, token: str | None, num_prompt_tokens: int, max_tokens: int) -> Grant:
        self.fallback_admissions += 1
        if self._auth_enabled is None:
            raise AdmissionError(503, "API keys cannot be verified: the key store (Redis) is unreachable",
                                 "key_store_unavailable", {"retry-after": "1"})
        if not self._auth_enabled:
            if self._static is None:
                return _open()
            raise _unauthorized(token)
        if token is None:
            raise _unauthorized(token)
        key_hash = keystore.hash_key(token)
        record = self._cache.get(key_hash)
        if record is None:
            raise AdmissionError(503, "this API key cannot be verified while the key store (Redis) is "
                                 "unreachable", "key_store_unavailable", {"retry-after": "1"})
        if record.tpm and num_prompt_tokens > record.tpm:
            raise _too_large(num_prompt_tokens, record.tpm)
        # this gateway's share of the key's allowance (see the module doc); default_rpm is per gateway already
        share = self.num_gateways
        rpm = max(1, record.rpm // share) if record.rpm else self.config.default_rpm
        tpm = max(1, record.tpm // share) if record.tpm else 0
        cost = min(token_cost(num_prompt_tokens, max_tokens, record.tpm), tpm) if tpm else 0
        decision = self.local.admit(key_hash, rpm, tpm, cost)
        local = KeyRecord(name=record.name, key_hash=key_hash, priority=record.priority, rpm=rpm, tpm=tpm,
                          created=record.created, admin=record.admin)
        return self._grant_or_raise(record=local, decision=decision, cost=cost, shared=False)

    def _grant_or_raise(self, *, record: KeyRecord, decision: Decision, cost: int, shared: bool) -> Grant:
        headers = decision.headers()
        if not decision.allowed:
            raise AdmissionError(
                429, f"Rate limit reached for key {record.name!r}: limits are {_limits_text(record)}; "
                f"retry after {headers['retry-after']} s",
                "rate_limit_exceeded", headers,
            )
        return Grant(key_name=record.name, priority=record.priority, headers=headers,
                     key_hash=record.key_hash, reserved_tokens=cost if record.tpm else 0,
                     tpm=record.tpm, shared=shared)

    # -- Redis health ------------------------------------------------------

    def _decidable_locally(self, token: str | None) -> bool:
        """Whether the per-gateway path can answer ``token`` from what this gateway knows."""
        if self._auth_enabled is None:
            return False
        if not self._auth_enabled or token is None:
            return True
        return keystore.hash_key(token) in self._cache

    def _on_failure(self, exc: BaseException, started: float) -> None:
        """A refused or reset connection means Redis is down; one timeout may be our own busy loop.

        Two timeouts in a row mark Redis degraded, counting only calls that *started* after
        the last counted timeout was seen: a burst's calls in flight together (one batch of
        the shared limiter, or concurrent lookups) time out together when the event loop or
        the host is busy, and that is one observation, not one per request."""
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
            if self._last_timeout_at is not None and started <= self._last_timeout_at:
                return
            self._last_timeout_at = time.monotonic()
            self._consecutive_timeouts += 1
            if self._consecutive_timeouts < 2:
                return
        self._mark_degraded(exc)

    def _mark_lost(self) -> None:
        if self._state != "degraded":
            log.warning("redis has no API keys any more; using cached keys and per-gateway limits")
            self._degraded_since = time.time()
            self.local.clear()
        self._state = "degraded"
        self._detail = "Redis lost its API keys (restarted without persistence?); restoring from cache"

    def _mark_degraded(self, exc: BaseException) -> None:
        if self._state != "degraded":
            # Never log request data here: only the error class and text.
            log.warning("redis unreachable (%s: %s); using per-gateway limits", type(exc).__name__, exc)
            self._degraded_since = time.time()
            self.local.clear()
        self._state = "degraded"
        self._detail = f"{type(exc).__name__}: {exc}"[:200]

    def _mark_ok(self) -> None:
        """Redis answered: the run of timeouts is over."""
        self._consecutive_timeouts = 0
        if self._state == "degraded":
            # Only the watcher ends a degraded period; a stray success changes nothing.
            return
        self._state = "ok"

    def _ensure_task(self) -> None:
        """Start the watcher once an event loop runs (construction may happen outside one)."""
        if self._client is None or self._closed or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._watch(), name="ferry-redis-watch")

    async def _watch(self) -> None:
        """Reconnect when degraded (every reconnect interval); refresh the key cache while healthy."""
        since_probe = float("inf")
        while not self._closed:
            if self._state == "degraded" or since_probe >= self.refresh_interval_s:
                since_probe = 0.0
                await self._probe()
            # Short sleeps so an outage noticed by a request is probed within one interval.
            await asyncio.sleep(self.reconnect_interval_s)
            since_probe += self.reconnect_interval_s

    async def _probe(self) -> None:
        try:
            assert self._client is not None
            await asyncio.wait_for(self._client.ping(), self.redis_timeout_s * 5)
            await self._refresh()
        except (TimeoutError, RedisError, OSError) as exc:
            self._mark_degraded(exc)
            return
        if self._state == "degraded":
            log.warning("redis is back; shared limits resume")
            self._degraded_since = None
            self.local.clear()
        self._state = "ok"
        self._detail = ""


def _limits_text(record: KeyRecord) -> str:
    parts = []
    if record.rpm:
        parts.append(f"{record.rpm} requests/min")
    if record.tpm:
        parts.append(f"{record.tpm} tokens/min")
    return ", ".join(parts) or "none"


def _unauthorized(token: str | None) -> AdmissionError:
    message = ("Missing API key: send 'Authorization: Bearer <key>'" if token is None
               else "Incorrect API key provided")
    return AdmissionError(401, message, "invalid_api_key", {"www-authenticate": "Bearer"})


def _too_large(num_prompt_tokens: int, tpm: int) -> AdmissionError:
    return AdmissionError(
        429, f"Request too large: the prompt has {num_prompt_tokens} tokens but this key may use "
        f"{tpm} tokens per minute; shorten the prompt", "request_too_large",
        {"x-ratelimit-limit-tokens": str(tpm)},
    )
