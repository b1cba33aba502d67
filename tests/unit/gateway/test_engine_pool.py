"""The gateway's engine pool against two stand-in schedulers over real zmq sockets.

Affinity (one prefix, one engine), spreading (distinct prefixes reach both),
re-routing of requests that never started when their engine dies, the retryable
failure of those that had started, and per-engine metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.serving.fake_scheduler import FakeScheduler
from services.gateway.engines.engine_client import EngineFailure, RequestQueue
from services.gateway.engines.engine_pool import EnginePool
from services.gateway.observability.metrics import GatewayMetrics
from shared.config import GatewayConfig
from shared.messages import AddRequest, RequestDelta, SamplingParams, StopParams

SCRIPT = [5, 6, 7, 8, 9, 10, 11, 12]


def add(req_id: str, prompt: list[int], max_tokens: int = 4) -> AddRequest:
    return AddRequest(req_id=req_id, gateway_id="gw-test", prompt_token_ids=prompt, sampling=SamplingParams(),
                      stop=StopParams(max_tokens=max_tokens), arrival_time=time.time())


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def drain(queue: RequestQueue, req_ids: set[str], timeout_s: float = 10.0) -> dict[str, list[object]]:
    """Items per request until each finished or failed."""
    got: dict[str, list[object]] = {r: [] for r in req_ids}
    open_ids = set(req_ids)
    while open_ids:
        rid, item = await asyncio.wait_for(queue.get(), timeout_s)
        got[rid].append(item)
        if isinstance(item, EngineFailure) or (isinstance(item, RequestDelta) and item.finish_reason):
            open_ids.discard(rid)
    return got


@pytest.fixture
def fakes(tmp_path: Path):  # type: ignore[no-untyped-def]
    made = [FakeScheduler(f"ipc://{tmp_path}/e{i}.sock", SCRIPT, tick_s=0.02) for i in range(2)]
    yield made
    for f in made:
        try:
            f.close()
        except Exception:  # noqa: BLE001 - already closed by the test
            pass


def make_pool(fakes: list[FakeScheduler], **knobs: object) -> EnginePool:
    config = GatewayConfig(scheduler_endpoint=",".join(f.endpoint for f in fakes), heartbeat_interval_s=0.1,
                           **knobs)  # type: ignore[arg-type]
    return EnginePool(config, "gw-test", GatewayMetrics("m"))


def owner_of(fakes: list[FakeScheduler], req_id: str) -> int:
    return next(i for i, f in enumerate(fakes) if any(a.req_id == req_id for a in f.adds))


def test_one_prefix_goes_to_one_engine_and_distinct_ones_spread(fakes: list[FakeScheduler]) -> None:
    async def run() -> None:
        pool = make_pool(fakes, routing_prefix_blocks=2)
        await pool.start()
        try:
            await until(pool.ready)
            await until(lambda: all(r["ready"] for r in pool.engine_rows()))
            queue = RequestQueue()
            shared = list(range(100, 140))  # 2.5 blocks of 16: the first two are the key
            for i in range(12):
                pool.submit([add(f"s{i}", shared + [i])], queue)
            await drain(queue, {f"s{i}" for i in range(12)})
            assert len({owner_of(fakes, f"s{i}") for i in range(12)}) == 1
            for i in range(40):
                pool.submit([add(f"d{i}", [1000 + i] * 40)], queue)
            await drain(queue, {f"d{i}" for i in range(40)})
            spread = [sum(owner_of(fakes, f"d{i}") == e for i in range(40)) for e in (0, 1)]
            assert min(spread) >= 8, spread
            rows = {r["name"]: r for r in pool.engine_rows()}
            assert rows["0"]["routed_total"] + rows["1"]["routed_total"] == 52
            text = pool.metrics.render()[0].decode()
            assert 'ferry:requests_routed_total{engine="0",model_name="m",outcome="routed"}' in text
            # each engine's stats feed series with its own engine label
            assert 'ferry:num_requests_running{engine="1",model_name="m"}' in text
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_dead_engine_s_unstarted_requests_reroute_and_started_ones_fail_retryably(
        fakes: list[FakeScheduler]) -> None:
    victim, survivor = fakes
    survivor.workers_ready = []  # not ready: everything goes to the victim at first

    async def run() -> None:
        pool = make_pool(fakes)
        await pool.start()
        try:
            await until(lambda: [r["ready"] for r in pool.engine_rows()] == [True, False])
            queue = RequestQueue()
            pool.submit([add("started", [1] * 20, max_tokens=500)], queue)
            while True:  # its first token reached the gateway: it has started
                rid, item = await asyncio.wait_for(queue.get(), 5)
                if isinstance(item, RequestDelta) and item.new_token_ids:
                    break
            victim.hold = True  # accepted from now on, never generated: queued, not started
            for i in range(3):
                pool.submit([add(f"queued{i}", [2 + i] * 20, max_tokens=3)], queue)
            await until(lambda: len(victim.adds) == 4)
            survivor.workers_ready = [0]
            await until(lambda: all(r["ready"] for r in pool.engine_rows()))
            victim.close()  # the engine dies
            items = await drain(queue, {"started", "queued0", "queued1", "queued2"})
            assert isinstance(items["started"][-1], EngineFailure)  # the client gets 503 + Retry-After
            for i in range(3):
                last = items[f"queued{i}"][-1]
                assert isinstance(last, RequestDelta) and last.finish_reason == "length", items[f"queued{i}"]
                assert not any(isinstance(x, EngineFailure) for x in items[f"queued{i}"])
            assert sorted(a.req_id for a in survivor.adds) == ["queued0", "queued1", "queued2"]
            text = pool.metrics.render()[0].decode()
            assert 'ferry:requests_routed_total{engine="1",model_name="m",outcome="rerouted"} 3.0' in text
            assert 'ferry:requests_routed_total{engine="0",model_name="m",outcome="routed"} 4.0' in text
        finally:
            await pool.close()

    asyncio.run(run())


def test_engines_join_from_the_registry_and_leave_when_their_ttl_runs_out(fakes: list[FakeScheduler]) -> None:
    import redis

    from services.scheduler.registration import EngineAnnouncer, EngineSnapshot
    from shared.config import SchedulerConfig
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        # engine "b" registers once (then goes silent, as a crashed engine does)
        sched = SchedulerConfig(engine_name="b", gateway_endpoint=fakes[1].endpoint, redis_url=server.url,
                                registry_ttl_s=1.0)
        announcer = EngineAnnouncer(sched, lambda: EngineSnapshot(ready=True, model="smollm2-135m-instruct"))
        announcer._client = redis.Redis.from_url(server.url)
        other_model = EngineAnnouncer(SchedulerConfig(engine_name="c", gateway_endpoint="tcp://10.0.0.9:5555",
                                                      redis_url=server.url), lambda: EngineSnapshot(model="other"))
        other_model._client = redis.Redis.from_url(server.url)
        assert announcer.publish() and other_model.publish()
        # an ipc:// socket registered by another host cannot be reached from here
        client = redis.Redis.from_url(server.url)
        client.set("ferry:replica:far", json.dumps({"name": "far", "endpoint": "ipc:///tmp/far.sock",
                                                    "model": "smollm2-135m-instruct", "host": "elsewhere"}))
        client.zadd("ferry:replicas", {"far": time.time() + 60})

        async def run() -> None:
            pool = make_pool(fakes[:1], redis_url=server.url)
            await pool.start()
            try:
                await until(lambda: "b" in pool.members, 5)  # joined, no restart
                assert pool.members["b"].discovered and "c" not in pool.members  # another model's engine
                assert "far" not in pool.members
                await until(lambda: all(r["ready"] for r in pool.engine_rows()))
                await until(lambda: "b" not in pool.members, 5)  # its registration expired: gone
                assert list(pool.members) == ["0"]  # the static engine stays
            finally:
                await pool.close()

        asyncio.run(run())
    finally:
        server.stop()



def test_a_full_queue_sends_the_request_to_an_engine_with_room(fakes: list[FakeScheduler]) -> None:
    from shared.messages import RequestRejected

    full, roomy = fakes
    full.reject = ("queue_full", 2.0)

    async def run() -> None:
        pool = make_pool(fakes, routing_policy="round_robin")
        await pool.start()
        try:
            await until(lambda: all(r["ready"] for r in pool.engine_rows()))
            queue = RequestQueue()
            for i in range(4):
                pool.submit([add(f"r{i}", [i] * 8)], queue)
            items = await drain(queue, {f"r{i}" for i in range(4)})
            for i in range(4):  # every request ends normally, on the engine with room
                assert isinstance(items[f"r{i}"][-1], RequestDelta) and items[f"r{i}"][-1].finish_reason == "length"
            assert sorted(a.req_id for a in roomy.adds) == ["r0", "r1", "r2", "r3"]
            assert len(full.adds) == 2  # round robin sent it half, it refused them
            roomy.reject = ("queue_full", 3.0)  # nowhere left: the refusal reaches the client
            pool.submit([add("last", [9] * 8)], queue)
            rid, item = await asyncio.wait_for(queue.get(), 5)
            assert rid == "last" and isinstance(item, RequestRejected) and item.reason == "queue_full"
        finally:
            await pool.close()

    asyncio.run(run())


def test_each_engine_s_counters_advance_by_its_own_totals() -> None:
    from services.gateway.engines.engine_pool import engine_metrics
    from tests.unit.gateway.test_metrics import stats, value

    base = GatewayMetrics("m")
    one = engine_metrics(base, "1")
    assert engine_metrics(base, "0") is base  # the single engine's label: the same object
    base.on_engine_stats(stats(prefix_cache_hits_total=4, num_running=2))
    one.on_engine_stats(stats(prefix_cache_hits_total=10, num_running=5))
    base.on_engine_stats(stats(prefix_cache_hits_total=6, num_running=1))  # +2 on engine 0, not -4
    one.on_engine_stats(stats(prefix_cache_hits_total=13, num_running=0))  # +3 on engine 1
    assert value(base, "ferry:prefix_cache_hits_total", engine="0") == 6
    assert value(base, "ferry:prefix_cache_hits_total", engine="1") == 13
    assert value(base, "ferry:num_requests_running", engine="0") == 1
    assert value(base, "ferry:num_requests_running", engine="1") == 0
    assert base.last_stats is not None and base.last_stats.num_running == 1  # the view kept its own


def test_close_returns_even_when_discovery_swallows_its_cancellation(fakes: list[FakeScheduler]) -> None:
    # asyncio.wait_for (Python 3.11) can drop a cancellation that lands as its inner call
    # completes; a discovery round that swallows it must not keep close() waiting forever.
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        async def run() -> float:
            pool = make_pool(fakes[:1], redis_url=server.url)
            rounds = 0

            async def stubborn_discover() -> None:
                nonlocal rounds
                rounds += 1
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    pass  # swallowed, as the 3.11 wait_for race does

            pool.discover = stubborn_discover  # type: ignore[method-assign]
            await pool.start()
            await until(lambda: rounds >= 1)
            start = time.monotonic()
            await asyncio.wait_for(pool.close(), 10.0)
            return time.monotonic() - start

        assert asyncio.run(run()) < 5.0
    finally:
        server.stop()
