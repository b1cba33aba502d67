"""API keys and per-key limits end to end: ``ferry serve`` with an external Redis.

Real processes and sockets: a redis-server (persistent, so it can be SIGKILLed and
restarted with its keys), ``ferry keys`` to add keys, ``ferry serve`` on the tiny
model. Checks the 401 and 429 bodies and headers over HTTP, then kills Redis:
serving continues, /health says degraded, and it says ok again once Redis is back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway import keys_cli
from services.gateway.registry import EngineRegistry
from shared.config import GatewayConfig
from tests.integration.conftest import ServeProcess, wait_for
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

BODY = {"model": "", "prompt": "hello", "max_tokens": 3, "temperature": 0.0}


def _add(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert keys_cli.main(["--redis-url", url, "add", *args]) == 0
    return capsys.readouterr().out.strip()


def _complete(client: httpx.Client, base: str, model: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(f"{base}/v1/completions", json={**BODY, "model": model}, headers=headers)


def _engines(url: str) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        registry = EngineRegistry(GatewayConfig(redis_url=url), "probe")
        try:
            return await registry.list_engines()
        finally:
            await registry.close()

    return asyncio.run(go())


def _redis_state(client: httpx.Client, base: str) -> str:
    return str(client.get(f"{base}/health").json()["redis"]["redis"])


def test_keys_limits_and_redis_outage_over_http(tiny_model_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    redis = RedisServer(persist=True).start()
    serve = ServeProcess(tiny_model_dir, tmp_path, ["--redis-url", redis.url])
    try:
        tight = _add(redis.url, capsys, "tight", "--rpm", "2", "--tpm", "100000", "--priority", "1")
        roomy = _add(redis.url, capsys, "roomy")
        serve.start().wait_ready()
        base = serve.base_url
        with httpx.Client(timeout=60.0, trust_env=False) as client:
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]

            missing = _complete(client, base, model, None)
            assert missing.status_code == 401
            assert missing.json() == {"error": {
                "message": "Missing API key: send 'Authorization: Bearer <key>'",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            wrong = _complete(client, base, model, tight + "x")
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert tight not in wrong.text

            ok = [_complete(client, base, model, tight) for _ in range(2)]
            assert [r.status_code for r in ok] == [200, 200]
            assert ok[0].headers["x-ratelimit-limit-requests"] == "2"
            assert ok[1].headers["x-ratelimit-remaining-requests"] == "0"
            assert ok[0].headers["x-ratelimit-limit-tokens"] == "100000"
            limited = _complete(client, base, model, tight)
            assert limited.status_code == 429
            error = limited.json()["error"]
            assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
            assert 25 <= int(limited.headers["retry-after"]) <= 30
            assert limited.headers["x-ratelimit-remaining-requests"] == "0"
            assert _redis_state(client, base) == "ok"
            # The gateway publishes its replica to the engine registry.
            wait_for(lambda: [e["ready"] for e in _engines(redis.url)] == [True], 15.0,
                     what="the ready replica in the engine registry")
            (engine,) = _engines(redis.url)
            assert engine["model"] == model and engine["ready"] is True
            assert engine["endpoint"] == serve.gateway_endpoint and engine["num_kv_blocks_total"] > 0

            redis.kill()
            start = time.monotonic()
            during = [_complete(client, base, model, roomy) for _ in range(3)]
            assert [r.status_code for r in during] == [200, 200, 200], during[-1].text
            assert _redis_state(client, base) == "degraded"
            health = client.get(f"{base}/health").json()["redis"]
            assert health["detail"] and health["auth"] == "redis"
            rows = {row["name"]: row for row in client.get(f"{base}/dashboard/data").json()["health"]}
            assert rows["redis"]["status"] == "degraded" and rows["redis"]["up"] is False
            # The key's own limit, now per gateway: the local bucket starts full (2).
            local = [_complete(client, base, model, tight).status_code for _ in range(3)]
            assert local == [200, 200, 429]
            assert time.monotonic() - start < 60

            redis.start()
            wait_for(lambda: _redis_state(client, base) == "ok", 15.0, what="redis ok again")
            rows = {row["name"]: row for row in client.get(f"{base}/dashboard/data").json()["health"]}
            assert rows["redis"]["status"] == "ok" and rows["redis"]["up"] is True
            # Shared limits resume: the bucket drained before the crash still refuses.
            assert _complete(client, base, model, tight).status_code == 429
            assert _complete(client, base, model, roomy).status_code == 200
        log = serve.log_path.read_text(errors="replace")
        assert "redis" in log.lower()
        assert tight not in log and roomy not in log and tight[6:20] not in log
    finally:
        serve.kill()
        redis.stop()
