"""Redis faults under admission: a real redis-server SIGKILLed, restarted, SIGSTOPped.

Serving continues with per-gateway limits from the cached key records, no
request stalls on the dead or hung Redis, health says "degraded", and shared
limits resume when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from services.gateway.admission.auth import Admission, AdmissionError, Grant
from services.gateway.admission.keystore import KeyStore, sync_client
from shared.config import GatewayConfig
from tests.redis_server import RedisServer

STALL_BOUND_S = 0.5  # the design bound is ~0.1 s; the slack is for a loaded 2-core CI box


async def timed(admission: Admission, secret: str) -> tuple[Grant | AdmissionError, float]:
    start = time.perf_counter()
    try:
        result: Grant | AdmissionError = await admission.authorize(f"Bearer {secret}", 5, 5)
    except AdmissionError as exc:
        result = exc
    return result, time.perf_counter() - start


async def wait_health(admissions: list[Admission], state: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(a.health()["redis"] != state for a in admissions):
        assert time.monotonic() < deadline, [a.health() for a in admissions]
        await asyncio.sleep(0.05)


def gateway(url: str, name: str) -> Admission:
    return Admission(GatewayConfig(redis_url=url), name, reconnect_interval_s=0.2)


def test_redis_killed_falls_back_per_gateway_and_shared_limits_resume(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server = RedisServer(persist=True).start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("ivan", rpm=4)
        out = asyncio.run(_kill_and_restart(server, secret))
    finally:
        server.stop()

    # Before: one shared allowance of 4 across both gateways.
    assert out["before"] == [True] * 4 + [False] * 4
    # Down: each gateway enforces the key's own limit locally (4 each), nothing stalls.
    assert out["down_a"] == [True] * 4 + [False] * 2
    assert out["down_b"] == [True] * 4 + [False] * 2
    assert out["down_max_s"] < STALL_BOUND_S, out["down_max_s"]
    assert out["health_down"]["redis"] == "degraded"
    assert out["health_down"]["detail"]
    assert out["health_down"]["fallback_admissions"] >= 6
    unknown = out["unknown"]
    assert isinstance(unknown, AdmissionError)
    assert (unknown.status, unknown.code) == (503, "key_store_unavailable")
    # Back: the shared bucket (drained before the crash, persisted) refuses again on both.
    assert out["health_back"]["redis"] == "ok" and "degraded_since" not in out["health_back"]
    accepted_back = sum(out["back"])
    assert accepted_back <= 1 + int(out["outage_s"] / 15), out
    refused = out["back_refusal"]
    assert isinstance(refused, AdmissionError) and refused.status == 429
    assert refused.headers["x-ratelimit-limit-requests"] == "4"
    assert "redis unreachable" in caplog.text and secret not in caplog.text


async def _kill_and_restart(server: RedisServer, secret: str) -> dict[str, Any]:
    a, b = gateway(server.url, "ga"), gateway(server.url, "gb")
    out: dict[str, Any] = {}
    before = [await timed(g, secret) for g in (a, b, a, b, a, b, a, b)]
    out["before"] = [isinstance(r, Grant) for r, _ in before]
    killed_at = time.monotonic()
    server.kill()
    down_a = [await timed(a, secret) for _ in range(6)]
    down_b = [await timed(b, secret) for _ in range(6)]
    out["down_a"] = [isinstance(r, Grant) for r, _ in down_a]
    out["down_b"] = [isinstance(r, Grant) for r, _ in down_b]
    out["down_max_s"] = max(t for _, t in down_a + down_b)
    granted = next(r for r, _ in down_a if isinstance(r, Grant))
    await a.record_usage(granted, 3)  # reconciles locally, no error
    out["unknown"] = (await timed(a, "ferry-not-a-key"))[0]
    out["health_down"] = a.health()
    server.start()
    await wait_health([a, b], "ok")
    out["outage_s"] = time.monotonic() - killed_at
    out["health_back"] = a.health()
    back = [await timed(g, secret) for g in (a, b, a, b)]
    out["back"] = [isinstance(r, Grant) for r, _ in back]
    out["back_refusal"] = next(r for r, _ in back if isinstance(r, AdmissionError))
    await a.close()
    await b.close()
    return out


def test_hung_redis_costs_a_bounded_wait_then_recovers() -> None:
    server = RedisServer().start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("judy", rpm=1000, priority=3)
        out = asyncio.run(_pause_and_resume(server, secret))
    finally:
        server.stop()
    assert out["first"].shared is True
    assert all(isinstance(r, Grant) and r.priority == 3 for r, _ in out["hung"])
    assert max(t for _, t in out["hung"]) < STALL_BOUND_S, out["hung"]
    assert out["health_hung"]["redis"] == "degraded"
    assert [r.shared for r, _ in out["hung"][-2:]] == [False, False]
    assert out["after"].shared is True


async def _pause_and_resume(server: RedisServer, secret: str) -> dict[str, Any]:
    a = gateway(server.url, "ga")
    out: dict[str, Any] = {"first": (await timed(a, secret))[0]}
    server.pause()
    try:
        out["hung"] = [await timed(a, secret) for _ in range(5)]
        out["health_hung"] = a.health()
    finally:
        server.resume()
    await wait_health([a], "ok")
    out["after"] = (await timed(a, secret))[0]
    await a.close()
    return out


def test_redis_restarted_empty_never_opens_the_server_and_keys_are_restored() -> None:
    """ferry serve's embedded Redis keeps nothing on disk: a crash must not disable auth."""
    server = RedisServer(persist=False).start()
    try:
        secret, _ = KeyStore(sync_client(server.url)).add("kate", rpm=100, priority=2)
        out = asyncio.run(_restart_empty(server, secret))
        names = [r.name for r in KeyStore(sync_client(server.url)).list()]
    finally:
        server.stop()
    assert isinstance(out["before"], Grant) and out["before"].shared
    # Right after the empty restart: no key anywhere in Redis, yet no open door.
    assert isinstance(out["no_key_lost"], AdmissionError) and out["no_key_lost"].status == 401
    assert isinstance(out["key_lost"], Grant) and out["key_lost"].key_name == "kate"
    # The watcher put the records back: shared limits with the same secret, auth still on.
    assert out["health"]["redis"] == "ok" and out["health"]["auth"] == "redis"
    after = out["after"]
    assert isinstance(after, Grant) and after.shared and after.priority == 2
    assert isinstance(out["no_key_after"], AdmissionError) and out["no_key_after"].status == 401
    assert names == ["kate"]
    assert isinstance(out["no_key_flushed"], AdmissionError) and out["no_key_flushed"].status == 401
    assert out["health_flushed"]["redis"] == "degraded" and "lost" in out["health_flushed"]["detail"]
    assert isinstance(out["after_flush"], Grant) and out["after_flush"].shared


async def _restart_empty(server: RedisServer, secret: str) -> dict[str, Any]:
    a = Admission(GatewayConfig(redis_url=server.url), "ga", reconnect_interval_s=0.2, refresh_interval_s=0.5)
    out: dict[str, Any] = {"before": (await timed(a, secret))[0]}
    await wait_health([a], "ok")
    await asyncio.sleep(0.6)  # one cache refresh after the first request
    server.kill()
    server.start()
    out["no_key_lost"] = (await timed(a, ""))[0]
    out["key_lost"] = (await timed(a, secret))[0]
    await wait_health([a], "ok")
    out["health"] = a.health()
    out["after"] = (await timed(a, secret))[0]
    out["no_key_after"] = (await timed(a, ""))[0]
    # Data lost under a live connection (FLUSHALL): the admission script itself sees no keys.
    sync_client(server.url).flushall()
    out["no_key_flushed"] = (await timed(a, ""))[0]
    out["health_flushed"] = a.health()
    await wait_health([a], "ok")
    out["after_flush"] = (await timed(a, secret))[0]
    await a.close()
    return out
