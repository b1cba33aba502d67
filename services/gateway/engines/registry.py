"""The engine registry in Redis: which engine replicas exist and how loaded they are.

Each gateway publishes, every ``interval_s``, the replica it serves (model,
scheduler endpoint, live load from the latest EngineStats: running, waiting,
KV usage) and itself (its id and replica), each as a JSON string with a TTL, so
a replica or gateway that stops publishing disappears on its own. Several
gateways in front of one replica write the same engine record (the same
stats), which is harmless.

Layout::

    ferry:engine:<engine_id>    JSON, PX ttl     ferry:engines   ZSET engine_id -> expiry
    ferry:gateway:<gateway_id>  JSON, PX ttl     ferry:gateways  ZSET gateway_id -> expiry

``list_engines()`` reads Redis; ``engines()`` returns the listing from the last
publish cycle without I/O, for synchronous callers such as ``/health``. Redis
failures are never raised: publishing is skipped and the listing falls back to
this gateway's own replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

from services.gateway.admission import keystore
from shared.config import GatewayConfig
from shared.messages import EngineHealth, EngineStats

log = logging.getLogger("ferry.gateway.registry")


class EngineView(Protocol):
    """What the registry reads from the gateway's engine client."""

    endpoint: str
    stats: EngineStats | None
    health: EngineHealth | None

    def ready(self) -> bool: ...


def engine_id(endpoint: str, host: str | None = None) -> str:
    """A stable id per replica: an ipc:// path is only unique on its own host."""
    where = endpoint if not endpoint.startswith("ipc://") else f"{host or socket.gethostname()}|{endpoint}"
    return hashlib.sha1(where.encode()).hexdigest()[:12]


def engine_record(config: GatewayConfig, engine: EngineView, now: float) -> dict[str, Any]:
    stats, health = engine.stats, engine.health
    return {
        "engine_id": engine_id(engine.endpoint),
        "model": config.served_model_name or config.model,
        "endpoint": engine.endpoint,
        "host": socket.gethostname(),
        "ready": engine.ready(),
        "num_workers": health.num_workers if health else 0,
        "workers_ready": list(health.workers_ready) if health else [],
        "max_model_len": health.max_model_len if health else 0,
        "num_running": stats.num_running if stats else 0,
        "num_waiting": stats.num_waiting if stats else 0,
        "kv_usage": round(stats.kv_usage, 4) if stats else 0.0,
        "num_kv_blocks_total": stats.num_kv_blocks_total if stats else 0,
        "num_kv_blocks_free": stats.num_kv_blocks_free if stats else 0,
        "drain_rate_rps": round(stats.drain_rate_rps, 3) if stats else 0.0,
        "stats_time": stats.time if stats else None,
        "updated": now,
    }


class EngineRegistry:
    def __init__(self, config: GatewayConfig, gateway_id: str, *, ttl_s: float = 10.0,
                 interval_s: float = 2.0, timeout_s: float = 0.25,
                 namespace: str = keystore.DEFAULT_NAMESPACE) -> None:
        self.config = config
        self.gateway_id = gateway_id
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.ns = namespace
        self._client = keystore.async_client(config.redis_url, timeout_s) if config.redis_url else None
        self._engine: EngineView | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last: list[dict[str, Any]] = []
        self.last_error = ""

    def start(self, engine: EngineView) -> None:
        """Publish ``engine`` every interval from now on (call inside the event loop)."""
        self._engine = engine
        if self._client is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="ferry-registry")

    async def publish(self, engine: EngineView) -> bool:
        """Write this gateway's replica and itself; False (and logged once) if Redis failed."""
        if self._client is None:
            return False
        now = time.time()
        record = engine_record(self.config, engine, now)
        gateway = {"gateway_id": self.gateway_id, "host": socket.gethostname(), "port": self.config.port,
                   "engine_id": record["engine_id"], "model": record["model"], "updated": now}
        ttl_ms = int(self.ttl_s * 1000)
        expiry = now + self.ttl_s
        pipe = self._client.pipeline(transaction=True)
        pipe.set(f"{self.ns}engine:{record['engine_id']}", json.dumps(record), px=ttl_ms)
        pipe.zadd(f"{self.ns}engines", {record["engine_id"]: expiry})
        pipe.set(f"{self.ns}gateway:{self.gateway_id}", json.dumps(gateway), px=ttl_ms)
        pipe.zadd(f"{self.ns}gateways", {self.gateway_id: expiry})
        pipe.zremrangebyscore(f"{self.ns}engines", "-inf", now)
        pipe.zremrangebyscore(f"{self.ns}gateways", "-inf", now)
        try:
            await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return False
        self.last_error = ""
        return True

    async def list_engines(self) -> list[dict[str, Any]]:
        """Every live replica (Redis's view), or this gateway's own one if Redis is unreachable."""
        return await self._list("engine")

    async def list_gateways(self) -> list[dict[str, Any]]:
        return await self._list("gateway")

    def engines(self) -> list[dict[str, Any]]:
        """The listing from the last publish cycle (no I/O)."""
        if self._last:
            return list(self._last)
        if self._engine is not None:
            return [engine_record(self.config, self._engine, time.time())]
        return []

    def health(self) -> dict[str, Any]:
        if self._client is None:
            return {"registry": "disabled"}
        return {"registry": "degraded" if self.last_error else "ok", "detail": self.last_error,
                "num_engines": len(self._last)}

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.interval_s + 1.0)
            self._task = None
        if self._client is not None:
            await self._client.aclose()

    async def _list(self, kind: str) -> list[dict[str, Any]]:
        if self._client is None:
            return self._fallback(kind)
        try:
            ids = await asyncio.wait_for(
                self._client.zrangebyscore(f"{self.ns}{kind}s", time.time(), "+inf"), self.timeout_s)
            if not ids:
                return []
            raw = await asyncio.wait_for(
                self._client.mget([f"{self.ns}{kind}:{i!s}" for i in sorted(ids)]), self.timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return self._fallback(kind)
        return [json.loads(item) for item in raw if item]

    def _fallback(self, kind: str) -> list[dict[str, Any]]:
        if kind != "engine" or self._engine is None:
            return []
        return [engine_record(self.config, self._engine, time.time())]

    def _failed(self, exc: BaseException) -> None:
        if not self.last_error:
            log.warning("engine registry: redis unreachable (%s: %s)", type(exc).__name__, exc)
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]

    async def _loop(self) -> None:
        while not self._closed:
            if self._engine is not None:
                await self.publish(self._engine)
                self._last = await self.list_engines()
            await asyncio.sleep(self.interval_s)
