"""The key rules for the API endpoints that generate nothing, and /health's own Redis probe (real Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

from services.gateway.admission.auth import Admission, AdmissionError
from services.gateway.admission.keystore import KeyStore, sync_client
from shared.config import GatewayConfig
from tests.redis_server import BUSY_HOST_REDIS_TIMEOUT_S, RedisServer


async def outcome(admission: Admission, header: str | None) -> int:
    try:
        await admission.authenticate(header)
    except AdmissionError as exc:
        return exc.status
    return 200


def test_authenticate_follows_the_key_rules_and_charges_nothing() -> None:
    server = RedisServer().start()
    try:
        store = KeyStore(sync_client(server.url))

        async def go() -> list[Any]:
            admission = Admission(GatewayConfig(redis_url=server.url, redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S), "g1")
            before = await outcome(admission, None)  # no key in Redis yet: open
            secret, _ = store.add("alice", rpm=1)
            results = [before, await outcome(admission, None), await outcome(admission, "Bearer nope")]
            # rpm 1: three lookups must not use up the one generation request of the minute
            results += [await outcome(admission, f"Bearer {secret}") for _ in range(3)]
            grant = await admission.authorize(f"Bearer {secret}", 1, 1)
            results.append(grant.key_name)
            await admission.close()
            return results

        assert asyncio.run(go()) == [200, 401, 401, 200, 200, 200, "alice"]
        store.client.close()
    finally:
        server.stop()


def test_static_key_without_redis() -> None:
    async def go() -> list[int]:
        admission = Admission(GatewayConfig(api_key="k"), "g1")
        out = [await outcome(admission, h) for h in ("Bearer k", "Bearer x", None)]
        await admission.close()
        return out

    assert asyncio.run(go()) == [200, 401, 401]


def test_health_probe_sees_a_stopped_redis_at_once_and_counts_the_keys_redis_holds() -> None:
    server = RedisServer().start()
    try:
        store = KeyStore(sync_client(server.url))

        async def go() -> tuple[dict[str, Any], dict[str, Any]]:
            admission = Admission(GatewayConfig(redis_url=server.url, redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S), "g1")
            await admission.check_now()
            store.add("a")
            store.add("b")
            await admission.check_now()
            up = admission.health()
            server.kill()
            await admission.check_now()  # no request in between
            down = admission.health()
            await admission.close()
            return up, down

        up, down = asyncio.run(go())
        store.client.close()
    finally:
        server.stop()
    assert up["redis"] == "ok" and up["keys_cached"] == 2 and up["auth"] == "redis"
    assert down["redis"] == "degraded" and "degraded_since" in down
