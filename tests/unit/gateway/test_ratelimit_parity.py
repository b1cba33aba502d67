"""The Lua script (shared limits, in a real Redis) and LocalLimiter (the fallback) agree.

Both implement the same token buckets; a divergence would make limits change
character when Redis goes down or comes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from services.gateway.admission.auth import Admission, AdmissionError, Grant
from services.gateway.admission.keystore import KeyStore, sync_client
from services.gateway.admission.ratelimit import LocalLimiter, token_cost
from shared.config import GatewayConfig
from tests.redis_server import BUSY_HOST_REDIS_TIMEOUT_S, RedisServer

RPM, TPM = 4, 300
# (prompt tokens, max_tokens) per request: refusals by tokens, then by requests, and one
# capped reservation (400 > 300 reserves 300)
REQUESTS = [(10, 50), (100, 100), (200, 0), (0, 30), (5, 5), (1, 1), (150, 250)]


def local_run() -> list[tuple[bool, int, int]]:
    clock = iter(float(i) * 1e-6 for i in range(1000))  # time stands (almost) still
    limiter = LocalLimiter(clock=lambda: next(clock))
    out = []
    for prompt, max_tokens in REQUESTS:
        d = limiter.admit("k", RPM, TPM, token_cost(prompt, max_tokens, TPM))
        out.append((d.allowed, int(d.remaining_requests), int(d.remaining_tokens)))
    return out


async def shared_run(url: str, secret: str) -> list[tuple[bool, int, int]]:
    admission = Admission(GatewayConfig(redis_url=url, redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S), "g1")
    out = []
    for prompt, max_tokens in REQUESTS:
        try:
            grant: Grant | AdmissionError = await admission.authorize(f"Bearer {secret}", prompt, max_tokens)
        except AdmissionError as exc:
            grant = exc
        h = grant.headers
        out.append((isinstance(grant, Grant), int(h["x-ratelimit-remaining-requests"]),
                    int(h["x-ratelimit-remaining-tokens"])))
    assert admission.health()["redis"] == "ok"  # the shared limits answered every call
    await admission.close()
    return out


@pytest.fixture()
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    yield server.url
    server.stop()


def test_lua_and_local_buckets_agree(redis_url: str) -> None:
    secret, _ = KeyStore(sync_client(redis_url)).add("k", rpm=RPM, tpm=TPM)
    shared = asyncio.run(shared_run(redis_url, secret))
    local = local_run()
    assert [a for a, _, _ in shared] == [a for a, _, _ in local]
    assert [a for a, _, _ in local] == [True, True, False, True, True, False, False]
    assert local[4][1:] == (0, 0)  # both buckets exactly empty
    for (_, s_req, s_tok), (_, l_req, l_tok) in zip(shared, local, strict=True):
        # The Redis run takes real milliseconds, so its buckets may have refilled a token or two.
        assert l_req <= s_req <= l_req + 1
        assert l_tok <= s_tok <= l_tok + 2
