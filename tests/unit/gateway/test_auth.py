"""Admission without a key store: open mode, the static key, and an unreachable Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.admission.auth import Admission, AdmissionError, Grant, parse_bearer
from shared.config import GatewayConfig
from tests.redis_server import RedisServer, free_port


def test_parse_bearer() -> None:
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("bearer   abc  ") == "abc"
    assert parse_bearer("Basic abc") is None
    assert parse_bearer("Bearer ") is None
    assert parse_bearer(None) is None
    assert parse_bearer("") is None


def test_open_mode_admits_everything_without_headers() -> None:
    async def go() -> tuple[Grant, dict[str, object]]:
        admission = Admission(GatewayConfig(), "g1")
        grant = await admission.authorize(None, 10, 10)
        await admission.record_usage(grant, 20)
        health = admission.health()
        await admission.close()
        return grant, health

    grant, health = asyncio.run(go())
    assert grant == Grant(key_name=None, priority=None, headers={})
    assert health["redis"] == "disabled"
    assert health["auth"] == "none"


def test_static_key() -> None:
    async def go() -> list[object]:
        admission = Admission(GatewayConfig(api_key="s3cret-static"), "g1")
        results: list[object] = []
        for header in ("Bearer s3cret-static", "Bearer wrong", None, "s3cret-static", "Bearer s3cret-stati"):
            try:
                results.append(await admission.authorize(header, 1, 1))
            except AdmissionError as exc:
                results.append(exc)
        await admission.close()
        return results

    ok, wrong, missing, no_scheme, prefix = asyncio.run(go())
    assert isinstance(ok, Grant) and ok.key_name == "static" and ok.headers == {}
    for refused in (wrong, missing, no_scheme, prefix):
        assert isinstance(refused, AdmissionError)
        assert refused.status == 401
        assert refused.code == "invalid_api_key"
        assert refused.type == "invalid_request_error"
        assert refused.headers == {"www-authenticate": "Bearer"}
        assert "s3cret" not in refused.message
    assert isinstance(missing, AdmissionError) and "Missing API key" in missing.message


def test_unreachable_redis_at_start_refuses_quickly_with_503_and_reports_degraded() -> None:
    """Nothing listens on the port: keys cannot be verified, and nothing stalls."""

    async def go() -> tuple[AdmissionError, float, dict[str, object], Grant]:
        config = GatewayConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", api_key="static-key")
        admission = Admission(config, "g1")
        start = time.perf_counter()
        with pytest.raises(AdmissionError) as info:
            await admission.authorize("Bearer ferry-unknown", 5, 5)
        elapsed = time.perf_counter() - start
        # The static key needs no Redis.
        static = await admission.authorize("Bearer static-key", 5, 5)
        health = admission.health()
        await admission.close()
        return info.value, elapsed, health, static

    error, elapsed, health, static = asyncio.run(go())
    assert error.status == 503 and error.code == "key_store_unavailable"
    assert error.headers["retry-after"] == "1"
    assert elapsed < 1.0, elapsed
    assert health["redis"] == "degraded"
    assert health["auth"] == "unknown"
    assert static.key_name == "static"


def test_not_ready_until_the_key_store_has_answered_once() -> None:
    """/ready's key part: a gateway whose keys live in a Redis it has never reached would answer
    every API request 503, so it is not ready; it becomes ready at the watcher's first answer
    (an empty Redis: open mode), and a static key alone makes it ready at once."""

    async def go() -> tuple[tuple[bool, str], tuple[bool, str], tuple[bool, str], str]:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        admission = Admission(GatewayConfig(redis_url=url), "g1", reconnect_interval_s=0.05)
        with_static = Admission(GatewayConfig(redis_url=url, api_key="static-key"), "g2")
        before = admission.readiness()
        static = with_static.readiness()
        await asyncio.sleep(0.3)  # the first probe has been refused by now
        server = RedisServer(port).start()
        try:
            deadline = time.monotonic() + 10
            while not admission.readiness()[0] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            after = admission.readiness()
            mode = admission.auth_mode()
        finally:
            await admission.close()
            await with_static.close()
            server.stop()
        return before, static, after, mode

    before, static, after, mode = asyncio.run(go())
    assert before[0] is False and "key store (Redis) has not answered" in before[1]
    assert static == (True, "ready")
    assert after == (True, "ready") and mode == "none"


def test_the_redis_budget_comes_from_the_config_unless_given() -> None:
    async def go() -> tuple[float, float, float]:
        url = f"redis://127.0.0.1:{free_port()}/0"
        budgets = []
        for admission in (Admission(GatewayConfig(redis_url=url), "g1"),
                          Admission(GatewayConfig(redis_url=url, redis_timeout_s=0.7), "g2"),
                          Admission(GatewayConfig(redis_url=url, redis_timeout_s=0.7), "g3", redis_timeout_s=0.3)):
            budgets.append(admission.redis_timeout_s)
            await admission.close()
        return budgets[0], budgets[1], budgets[2]

    assert asyncio.run(go()) == (0.1, 0.7, 0.3)
