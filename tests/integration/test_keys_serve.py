"""API keys and per-key limits end to end: ``ferry serve`` with an external Redis.

Real processes and sockets: a redis-server (persistent, so it can be SIGKILLed and
restarted with its keys), ``ferry keys`` to add keys, ``ferry serve`` on the tiny
model. Checks the 401 and 429 bodies and headers over HTTP, then kills Redis:
serving continues, /health says degraded, and it says ok again once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from services.gateway.admission import keys_cli
from services.gateway.engines.registry import EngineRegistry
from shared.config import GatewayConfig
from tests.integration.conftest import ServeProcess, wait_for
from tests.redis_server import BUSY_HOST_REDIS_TIMEOUT_S, RedisServer

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
    # a busy host's Redis budget (tests/redis_server.py); a killed Redis is a refused connect, seen at once
    serve = ServeProcess(tiny_model_dir, tmp_path, ["--redis-url", redis.url, "--redis-timeout-s", str(BUSY_HOST_REDIS_TIMEOUT_S)])
    try:
        tight = _add(redis.url, capsys, "tight", "--rpm", "2", "--tpm", "100000", "--priority", "1")
        roomy = _add(redis.url, capsys, "roomy")
        serve.start().wait_ready()
        base = serve.base_url
        with httpx.Client(timeout=60.0, trust_env=False) as client:
            # with keys on, /v1/models wants one too (as OpenAI's does)
            assert client.get(f"{base}/v1/models").status_code == 401
            model = client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {roomy}"}).json()["data"][0]["id"]

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
        # The key's priority is the default priority of its requests.
        finished = [json.loads(line) for line in log.splitlines()
                    if line.startswith("{") and '"request finished"' in line]
        assert {(r["key"], r["priority"]) for r in finished if r["outcome"] == "ok"} == {("tight", 1), ("roomy", 0)}
    finally:
        serve.kill()
        redis.stop()


def _redis_child(serve: ServeProcess) -> psutil.Process | None:
    """The live embedded redis-server (None between its death and its restart)."""
    found = []
    for proc in serve.descendants():
        with contextlib.suppress(psutil.Error):  # zombies and exits while we look
            if proc.status() != psutil.STATUS_ZOMBIE and "redis-server" in " ".join(proc.cmdline()):
                found.append(proc)
    assert len(found) <= 1, found
    return found[0] if found else None


def test_embedded_redis_crash_keeps_keys_and_auth(tiny_model_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """ferry serve restarts its (non-persistent) Redis empty: auth must stay on, keys keep working."""
    serve = ServeProcess(tiny_model_dir, tmp_path, ["--redis-timeout-s", str(BUSY_HOST_REDIS_TIMEOUT_S)]).start()
    try:
        serve.wait_ready()
        assert keys_cli.main(["--runtime-dir", serve.runtime_dir, "add", "kim", "--rpm", "100"]) == 0
        secret = capsys.readouterr().out.strip()
        base = serve.base_url
        with httpx.Client(timeout=60.0, trust_env=False) as client:
            model = client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {secret}"}).json()["data"][0]["id"]
            assert _complete(client, base, model, None).status_code == 401  # the first key turned auth on
            assert _complete(client, base, model, secret).status_code == 200
            old = _redis_child(serve)
            assert old is not None
            os.kill(old.pid, signal.SIGKILL)
            statuses = []
            deadline = time.monotonic() + 20.0
            while time.monotonic() < deadline:
                statuses.append(_complete(client, base, model, None).status_code)
                assert _complete(client, base, model, secret).status_code == 200
                new = _redis_child(serve)
                if new is not None and new.pid != old.pid and _redis_state(client, base) == "ok":
                    break
                time.sleep(0.3)
            assert _redis_state(client, base) == "ok", "ferry serve did not bring Redis back"
            # A new process, not the old one reported healthy: the kill must have taken effect.
            new = _redis_child(serve)
            assert new is not None and new.pid != old.pid, (old.pid, new)
            assert set(statuses) <= {401, 503}, statuses  # never served without a key
            assert _complete(client, base, model, None).status_code == 401
            assert _complete(client, base, model, secret).status_code == 200
        assert keys_cli.main(["--runtime-dir", serve.runtime_dir, "list"]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["kim", "0", "100"]
    finally:
        serve.kill()
