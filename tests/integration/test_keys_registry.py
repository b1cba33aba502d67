"""The engine registry against a real Redis: publish, list, TTL expiry, Redis down."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from services.gateway.engines.registry import EngineRegistry, engine_id
from shared.config import GatewayConfig
from shared.messages import EngineHealth, EngineStats
from tests.redis_server import RedisServer


@dataclass
class FakeEngine:
    endpoint: str
    stats: EngineStats | None = None
    health: EngineHealth | None = None

    def ready(self) -> bool:
        return self.health is not None and self.health.scheduler_ready


def stats(running: int, waiting: int, kv_usage: float) -> EngineStats:
    return EngineStats(time=time.time(), num_running=running, num_waiting=waiting, num_kv_blocks_total=100,
                       num_kv_blocks_free=100 - int(kv_usage * 100), kv_usage=kv_usage)


def test_registry_lists_live_replicas_and_forgets_silent_ones() -> None:
    server = RedisServer().start()
    try:
        out = asyncio.run(_scenario(server))
    finally:
        server.stop()
    engines = {e["endpoint"]: e for e in out["engines"]}
    assert set(engines) == {"tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"}
    first = engines["tcp://10.0.0.1:5555"]
    assert (first["num_running"], first["num_waiting"], first["kv_usage"]) == (3, 7, 0.25)
    assert first["ready"] is True and first["workers_ready"] == [0]
    assert first["model"] == "tiny" and first["engine_id"] == engine_id("tcp://10.0.0.1:5555")
    assert sorted(g["gateway_id"] for g in out["gateways"]) == ["ga", "gb", "gc"]
    # Only gateway "gc" kept publishing: replica 1 expired with its TTL.
    assert [e["endpoint"] for e in out["after_ttl"]] == ["tcp://10.0.0.2:5555"]
    assert out["cached"] and out["cached"][0]["endpoint"] == "tcp://10.0.0.2:5555"
    assert out["health"] == {"registry": "ok", "detail": "", "num_engines": 1}
    # Redis dead: no exception, a quick False, and the listing is this gateway's own replica.
    assert out["publish_down"] is False and out["publish_down_s"] < 0.5
    assert [e["endpoint"] for e in out["engines_down"]] == ["tcp://10.0.0.2:5555"]
    assert out["health_down"]["registry"] == "degraded"


async def _scenario(server: RedisServer) -> dict[str, Any]:
    config = GatewayConfig(redis_url=server.url, model="tiny")
    healthy = EngineHealth(time=time.time(), scheduler_ready=True, num_workers=1, workers_ready=[0])
    one = FakeEngine("tcp://10.0.0.1:5555", stats(3, 7, 0.25), healthy)
    two = FakeEngine("tcp://10.0.0.2:5555", stats(1, 0, 0.5), healthy)
    ga = EngineRegistry(config, "ga", ttl_s=0.6)
    gb = EngineRegistry(config, "gb", ttl_s=0.6)
    gc = EngineRegistry(config, "gc", ttl_s=0.6, interval_s=0.1)
    out: dict[str, Any] = {}
    assert await ga.publish(one) and await gb.publish(one) and await gc.publish(two)
    out["engines"] = await ga.list_engines()
    out["gateways"] = await ga.list_gateways()
    gc.start(two)  # keeps publishing every 0.1 s
    await asyncio.sleep(1.0)
    out["after_ttl"] = await ga.list_engines()
    out["cached"] = gc.engines()
    out["health"] = gc.health()
    await gc.close()
    server.kill()
    gd = EngineRegistry(config, "gd")
    gd.start(two)
    start = time.perf_counter()
    out["publish_down"] = await gd.publish(two)
    out["publish_down_s"] = time.perf_counter() - start
    out["engines_down"] = await gd.list_engines()
    out["health_down"] = gd.health()
    for registry in (ga, gb, gd):
        await registry.close()
    return out
