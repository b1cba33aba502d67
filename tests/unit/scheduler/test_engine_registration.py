"""An engine's registration in a real Redis (TTL, clean removal) and its HTTP probes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from services.scheduler.registration import EngineAnnouncer, EngineSnapshot, replica_record
from shared.config import SchedulerConfig
from tests.redis_server import RedisServer, free_port


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.stop()


def test_the_record_says_where_and_what_the_engine_is() -> None:
    config = SchedulerConfig(engine_name="e7", gateway_endpoint="tcp://0.0.0.0:5555",
                             advertise_endpoint="tcp://engine-7.svc:5555", block_size=32, num_workers=2)
    snap = EngineSnapshot(ready=True, model="m", max_model_len=512, num_kv_blocks=900, num_running=3, num_waiting=1)
    rec = replica_record(config, snap, 100.0)
    assert {k: rec[k] for k in ("name", "endpoint", "model", "ready", "num_kv_blocks", "block_size",
                                "max_model_len", "num_workers", "num_running", "num_waiting")} == {
        "name": "e7", "endpoint": "tcp://engine-7.svc:5555", "model": "m", "ready": True, "num_kv_blocks": 900,
        "block_size": 32, "max_model_len": 512, "num_workers": 2, "num_running": 3, "num_waiting": 1}
    # without an advertised address, the bound one; a draining engine is not ready
    plain = replica_record(SchedulerConfig(engine_name="e", gateway_endpoint="ipc:///tmp/x.sock"),
                           EngineSnapshot(ready=True, stopping=True), 0.0)
    assert plain["endpoint"] == "ipc:///tmp/x.sock" and plain["ready"] is False


def test_registration_heartbeats_expire_and_a_clean_stop_removes_it(server: RedisServer) -> None:
    config = SchedulerConfig(engine_name="reg-test", redis_url=server.url, registry_ttl_s=0.8)
    snap = EngineSnapshot(ready=True, model="m", num_kv_blocks=64)
    client = redis.Redis.from_url(server.url)
    announcer = EngineAnnouncer(config, lambda: snap)
    announcer.start()
    try:
        deadline = time.monotonic() + 5
        while not client.get("ferry:replica:reg-test") and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = json.loads(client.get("ferry:replica:reg-test") or b"{}")
        assert rec["num_kv_blocks"] == 64 and rec["ready"] is True
        ttl_ms = client.pttl("ferry:replica:reg-test")
        assert 0 < ttl_ms <= 800
        assert client.zscore("ferry:replicas", "reg-test") is not None
        time.sleep(1.2)  # longer than the TTL: heartbeats (every TTL/4) keep it alive
        assert client.get("ferry:replica:reg-test") is not None
    finally:
        announcer.stop()
    assert client.get("ferry:replica:reg-test") is None
    assert client.zscore("ferry:replicas", "reg-test") is None


def test_a_silent_engine_expires_within_its_ttl(server: RedisServer) -> None:
    config = SchedulerConfig(engine_name="silent", redis_url=server.url, registry_ttl_s=0.5)
    announcer = EngineAnnouncer(config, lambda: EngineSnapshot(ready=True))
    announcer._client = redis.Redis.from_url(server.url)
    assert announcer.publish()  # one heartbeat, then silence (a crashed engine)
    client = redis.Redis.from_url(server.url)
    assert client.get("ferry:replica:silent") is not None
    time.sleep(0.7)
    assert client.get("ferry:replica:silent") is None
    assert b"silent" not in client.zrangebyscore("ferry:replicas", time.time(), "+inf")


def test_redis_down_is_logged_not_raised() -> None:
    config = SchedulerConfig(engine_name="x", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    announcer = EngineAnnouncer(config, lambda: EngineSnapshot())
    announcer._client = redis.Redis.from_url(config.redis_url, socket_connect_timeout=0.2)
    assert announcer.publish() is False
    assert "Error" in announcer.last_error


def test_probes_answer_health_and_readiness_over_http() -> None:
    port = free_port()
    clock = [100.0]
    snap = EngineSnapshot(ready=False, model="m", loop_time=99.5)
    announcer = EngineAnnouncer(SchedulerConfig(engine_name="p", health_port=port), lambda: snap,
                                clock=lambda: clock[0])
    announcer.start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200
        r = httpx.get(f"{base}/ready", trust_env=False)
        assert r.status_code == 503 and r.json()["ready"] is False
        snap.ready = True
        assert httpx.get(f"{base}/ready", trust_env=False).status_code == 200
        snap.stopping = True  # draining: no new traffic
        assert httpx.get(f"{base}/ready", trust_env=False).status_code == 503
        clock[0] = 99.5 + 31.0  # the step loop has not turned for 31 s
        r = httpx.get(f"{base}/health", trust_env=False)
        assert r.status_code == 503 and r.json()["loop_stalled_s"] == 31.0
        assert httpx.get(f"{base}/nope", trust_env=False).status_code == 404
    finally:
        announcer.stop()
