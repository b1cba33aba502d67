"""Two gateways, Redis killed: the per-gateway fallback shares each key's limit.

Both gateways register in Redis (the engine registry) and count each other at
their key-cache refresh; with Redis SIGKILLed, each enforces ``limit // 2``, so
together they admit about the shared limit instead of twice it. With more
gateways than the limit allows, each still admits one request per window.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.gateway.admission.auth import Admission, AdmissionError, Grant
from services.gateway.admission.keystore import KeyStore, sync_client
from services.gateway.engines.registry import EngineRegistry
from shared.config import GatewayConfig
from shared.messages import EngineHealth, EngineStats
from tests.redis_server import RedisServer


class IdleEngine:
    """The registry's view of an engine client, as a gateway would show it."""

    endpoint = "ipc:///tmp/ferry-share-test.sock"
    stats: EngineStats | None = None
    health: EngineHealth | None = None

    def ready(self) -> bool:
        return True


async def admitted(admission: Admission, secret: str, attempts: int, cost: int = 10) -> int:
    n = 0
    for _ in range(attempts):
        try:
            result = await admission.authorize(f"Bearer {secret}", cost // 2, cost - cost // 2)
        except AdmissionError as exc:
            assert exc.status == 429, exc.message
            continue
        assert isinstance(result, Grant)
        n += 1
    return n


async def scenario(url: str, secret: str, num_gateways: int, server: RedisServer, cost: int = 10) -> dict[str, Any]:
    config = GatewayConfig(redis_url=url)
    admissions = [Admission(config, f"g{i}", reconnect_interval_s=0.2, refresh_interval_s=0.3)
                  for i in range(num_gateways)]
    registries = [EngineRegistry(config, f"g{i}") for i in range(num_gateways)]
    for reg in registries:
        assert await reg.publish(IdleEngine())
    for a in admissions:
        await admitted(a, secret, 1)  # starts the watcher; the shared bucket takes these
    deadline = time.monotonic() + 10
    while any(a.num_gateways != num_gateways for a in admissions):
        assert time.monotonic() < deadline, [a.num_gateways for a in admissions]
        await asyncio.sleep(0.05)
    server.kill()
    for a in admissions:
        while a.health()["redis"] != "degraded":  # a refused connection marks it at once
            try:
                await a.authorize(f"Bearer {secret}", 0, 0)
            except AdmissionError:
                pass
            assert time.monotonic() < deadline + 10, a.health()
            await asyncio.sleep(0.05)
    for a in admissions:
        a.local.clear()  # count from a full bucket: what the probe above took does not matter
    out = {"down": [await admitted(a, secret, 10, cost) for a in admissions],
           "health": admissions[0].health()}
    for a in admissions:
        await a.close()
    for reg in registries:
        await reg.close()
    return out


def test_two_gateways_share_the_limit_while_redis_is_down() -> None:
    server = RedisServer().start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("ivan", rpm=8)
        out = asyncio.run(scenario(server.url, secret, 2, server))
    finally:
        server.stop()
    assert out["down"] == [4, 4]  # 8 // 2 each: 8 together, as with Redis up (not 16)
    assert out["health"]["redis"] == "degraded" and out["health"]["fallback_share"] == "1/2 of each key's limits"


def test_more_gateways_than_the_limit_still_admit_one_request_each() -> None:
    server = RedisServer().start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("ivan", rpm=2)
        out = asyncio.run(scenario(server.url, secret, 3, server))
    finally:
        server.stop()
    assert out["down"] == [1, 1, 1]


def test_token_limits_are_shared_too() -> None:
    server = RedisServer().start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("ivan", tpm=100)
        out = asyncio.run(scenario(server.url, secret, 2, server, cost=10))
    finally:
        server.stop()
    assert out["down"] == [5, 5]  # 100 // 2 = 50 tokens each, 10 per request


def test_a_request_larger_than_the_share_still_passes_once() -> None:
    server = RedisServer().start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("ivan", tpm=100)
        out = asyncio.run(scenario(server.url, secret, 2, server, cost=80))  # fits 100, not 50
    finally:
        server.stop()
    assert out["down"] == [1, 1]
