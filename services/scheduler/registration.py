"""An engine announces itself: a registration in Redis with a TTL, and HTTP probes.

A daemon thread of the scheduler process (the engine's front door: its address
is the one gateways connect to) writes, every ``registry_ttl_s / 4`` seconds::

    ferry:replica:<engine_name>   JSON, PX registry_ttl_s      ferry:replicas  ZSET name -> expiry

with the engine's name, advertised endpoint, model, KV capacity (blocks, block
size), max_model_len, readiness and current load. Gateways list the ZSET and
connect to every live engine (services/gateway/engines/engine_pool.py), so a new engine
takes traffic without a gateway restart and one that stops heartbeating (crashed,
partitioned) drops out of every gateway's routing within the TTL. A clean stop
deletes the record at once. Redis failures are logged once and retried; serving
never depends on them.

With ``health_port`` set, the same thread's sibling serves ``GET /health`` (the
step loop is alive: its last turn is recent) and ``GET /ready`` (the engine has
its workers and accepts requests) for Kubernetes probes, on plain HTTP with
the standard library (the scheduler imports no web framework).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shared.config import SchedulerConfig

log = logging.getLogger("ferry.scheduler.registration")

NAMESPACE = "ferry:"
LOOP_STALL_S = 30.0  # /health fails when the step loop has not turned in this long


def engine_name(config: SchedulerConfig) -> str:
    return config.engine_name or f"{socket.gethostname()}-{os.getpid()}"


def advertised_endpoint(config: SchedulerConfig) -> str:
    return config.advertise_endpoint or config.gateway_endpoint


@dataclass
class EngineSnapshot:
    """What the scheduler's step loop last said about itself (read from another thread)."""

    ready: bool = False
    model: str = ""
    max_model_len: int = 0
    num_kv_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    stopping: bool = False
    loop_time: float = 0.0  # the scheduler clock's time of the loop's latest turn (0: not yet)


def replica_record(config: SchedulerConfig, snap: EngineSnapshot, now: float) -> dict[str, Any]:
    return {
        "name": engine_name(config), "endpoint": advertised_endpoint(config), "model": snap.model,
        "ready": snap.ready and not snap.stopping, "num_kv_blocks": snap.num_kv_blocks,
        "block_size": config.block_size, "max_model_len": snap.max_model_len,
        "num_workers": config.num_workers, "num_running": snap.num_running, "num_waiting": snap.num_waiting,
        "host": socket.gethostname(), "pid": os.getpid(), "updated": now,
    }


def snapshot_of(service: Any) -> EngineSnapshot:
    """Read a ``SchedulerService``'s state without touching its loop (GIL-atomic attribute reads).

    The loop advances ``next_stats`` by ``stats_interval_s`` each time it passes that
    time, whether or not a gateway listens, so ``next_stats`` tells when it last turned.
    """
    core = service.core
    interval = service.config.stats_interval_s
    return EngineSnapshot(
        ready=bool(service.engine_ready()), model=str(service.model), max_model_len=int(service.max_model_len),
        num_kv_blocks=int(service.core_num_kv_blocks),
        num_running=int(core.num_running) if core is not None else 0,
        num_waiting=int(core.num_waiting) if core is not None else 0,
        stopping=bool(service.stop_requested),
        loop_time=max(0.0, float(service.next_stats) - interval) if service.next_stats else 0.0,
    )


class EngineAnnouncer:
    """Registration heartbeats and the probe server, beside a running scheduler."""

    def __init__(self, config: SchedulerConfig, snapshot: Callable[[], EngineSnapshot],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.snapshot = snapshot
        self.clock = clock  # the scheduler's own clock: ``loop_time`` is on it
        self.name = engine_name(config)
        self.interval_s = max(0.05, config.registry_ttl_s / 4)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client: Any = None
        self._http: ThreadingHTTPServer | None = None
        self.last_error = ""

    def start(self) -> None:
        if self.config.redis_url:
            import redis

            self._client = redis.Redis.from_url(self.config.redis_url, socket_timeout=1.0,
                                                socket_connect_timeout=1.0)
            self._spawn(self._register_loop, "ferry-registration")
        if self.config.health_port:
            self._http = ThreadingHTTPServer(("0.0.0.0", self.config.health_port), _probe_handler(self))
            self._spawn(self._http.serve_forever, "ferry-probes")
            log.info("probes on :%d (/health, /ready)", self.config.health_port)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self._client is not None:
            try:  # gone at once, not after the TTL: gateways stop routing here now
                self._client.zrem(f"{NAMESPACE}replicas", self.name)
                self._client.delete(f"{NAMESPACE}replica:{self.name}")
            except Exception as exc:  # noqa: BLE001 - redis or socket errors alike; the TTL cleans up
                log.warning("could not deregister: %s", exc)
            self._client.close()

    def publish(self) -> bool:
        now = time.time()
        record = replica_record(self.config, self.snapshot(), now)
        ttl_ms = int(self.config.registry_ttl_s * 1000)
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(f"{NAMESPACE}replica:{self.name}", json.dumps(record), px=ttl_ms)
            pipe.zadd(f"{NAMESPACE}replicas", {self.name: now + self.config.registry_ttl_s})
            pipe.zremrangebyscore(f"{NAMESPACE}replicas", "-inf", now)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: log once, retry next beat
            if not self.last_error:
                log.warning("engine registration failed: %s: %s", type(exc).__name__, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        if self.last_error:
            log.info("engine registration works again")
        self.last_error = ""
        return True

    def _register_loop(self) -> None:
        while not self._stop.is_set():
            self.publish()
            self._stop.wait(self.interval_s)

    def probe(self, path: str) -> tuple[int, dict[str, Any]]:
        snap = self.snapshot()
        stalled = max(0.0, self.clock() - snap.loop_time) if snap.loop_time else 0.0
        if path == "/health":
            ok = stalled < LOOP_STALL_S
            return (200 if ok else 503), {"alive": ok, "loop_stalled_s": round(stalled, 3), "engine": self.name}
        if path == "/ready":
            ok = snap.ready and not snap.stopping
            return (200 if ok else 503), {"ready": ok, "engine": self.name, "model": snap.model,
                                          "stopping": snap.stopping, "num_kv_blocks": snap.num_kv_blocks}
        return 404, {"error": "not found"}


def _probe_handler(announcer: EngineAnnouncer) -> type[BaseHTTPRequestHandler]:
    class Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            status, body = announcer.probe(self.path.split("?", 1)[0])
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
            return

    return Probe
