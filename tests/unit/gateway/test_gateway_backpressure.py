"""The gateway's own backpressure and per-request timings, against a fake scheduler over real sockets.

- the in-flight bound answers 429 ``gateway_overloaded`` before any tokenizing,
  and frees its slot however a request ends;
- fresh EngineStats showing a full waiting queue answer 429 ``queue_full``
  without tokenizing or reaching the scheduler; stale stats never refuse;
- every response carries ``timings`` (non-streaming body, the last stream chunk,
  or the usage chunk), and the official openai client still parses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

from services.gateway.api import serving
from services.gateway.api.state import GatewayState, InflightLimiter, drain_retry_after_s
from services.gateway.engines.engine_client import EngineClient
from shared.config import GatewayConfig
from shared.messages import EngineStats
from tests.unit.gateway.test_gateway_app import COMPLETION, sse_events
from tests.unit.gateway.test_gateway_support import FakeScheduler, running_env, wait_until
from tests.unit.gateway.test_gateway_support import GatewayEnv as Env

TIMING_KEYS = {"queue_time_s", "prefill_time_s", "decode_time_s", "ttft_s", "e2e_s", "num_preemptions"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from running_env(tmp_path_factory.mktemp("gwbp"))


@pytest.fixture
def fake(env: Env) -> Iterator[FakeScheduler]:
    yield env.start_fake()
    env.stop_fake()


@pytest.fixture
def state(env: Env) -> Iterator[GatewayState]:
    st: GatewayState = env.app.state.gateway
    yield st
    st.inflight.limit = 0


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call of the request validation (where tokenizing and templating happen)."""
    calls: list[str] = []
    real = serving.validate_completion

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("completion")
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "validate_completion", counting)
    return calls


def rejected(env: Env, reason: str) -> float:
    for line in env.http.get("/metrics").text.splitlines():
        if line.startswith("ferry:request_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_inflight_bound_refuses_before_tokenizing_and_frees_its_slots(
        env: Env, fake: FakeScheduler, state: GatewayState, validations: list[str]) -> None:
    state.inflight.limit = 1
    fake.hold = True  # the first request stays open
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as held:
        assert held.status_code == 200 and state.inflight.in_flight == 1
        before = rejected(env, "gateway_overloaded")
        refused = env.http.post("/v1/completions", json=COMPLETION)
        assert refused.status_code == 429, refused.text
        err = refused.json()["error"]
        assert err["code"] == "gateway_overloaded" and err["type"] == "rate_limit_error"
        assert "limit of 1 open" in err["message"] and int(refused.headers["retry-after"]) >= 1
        chat = env.http.post("/v1/chat/completions",
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 429 and chat.json()["error"]["code"] == "gateway_overloaded"
        assert validations == ["completion"] and len(fake.adds) == 1  # neither refusal did any work
        assert rejected(env, "gateway_overloaded") == before + 2
    wait_until(lambda: state.inflight.in_flight == 0, 5, "the closed stream frees its slot")
    fake.hold = False
    # refusals further down (404, 400, scheduler 429) and successes all give their slot back
    assert env.http.post("/v1/completions", json={**COMPLETION, "model": "nope"}).status_code == 404
    assert env.http.post("/v1/completions", json={**COMPLETION, "prompt": [10**6]}).status_code == 400
    fake.reject = ("queue_full", 1.0)
    assert env.http.post("/v1/completions", json=COMPLETION).status_code == 429
    fake.reject = None
    assert env.http.post("/v1/completions", json=COMPLETION).status_code == 200
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as ok:
        assert sse_events(ok)[-1] == "[DONE]"
    wait_until(lambda: state.inflight.in_flight == 0, 5, "every slot released")
    assert env.http.get("/health").json()["in_flight"] == {"requests": 0, "limit": 1}


def test_full_queue_in_fresh_stats_refuses_without_tokenizing(
        env: Env, fake: FakeScheduler, validations: list[str]) -> None:
    fake.stats_config = {**fake.stats_config, "max_waiting_requests": "3"}
    fake.num_waiting = 4  # over the bound by one: still full after 0.5 s of draining at 2 per second
    st: GatewayState = env.app.state.gateway
    wait_until(lambda: st.engine.stats is not None and st.engine.stats.num_waiting == 4, 3, "stats with a full queue")
    before = rejected(env, "queue_full")
    for stream in (False, True):
        resp = env.http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "queue_full" and "4 of 3" in resp.json()["error"]["message"]
        assert resp.headers["retry-after"] == "2"  # 4 waiting / 2.0 per second drained
    assert validations == [] and fake.adds == []
    assert rejected(env, "queue_full") == before + 2
    fake.num_waiting = 2  # room again: the next request goes through
    wait_until(lambda: st.engine.stats is not None and st.engine.stats.num_waiting == 2, 3, "stats with room")
    assert env.http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert validations == ["completion"]


def _state_with(stats: EngineStats | None, age_s: float, connected: bool = True, sent: int = 0) -> GatewayState:
    engine = EngineClient("ipc:///nonexistent", "gw-test")
    engine.stats, engine.connected, engine.sent_since_stats = stats, connected, sent
    engine.stats_received = time.monotonic() - age_s
    return GatewayState(config=GatewayConfig(), gateway_id="gw-test", tokenizer=None,  # type: ignore[arg-type]
                        engine=engine, metrics=None, admission=None,  # type: ignore[arg-type]
                        served_names=frozenset({"m"}))


def test_early_refusal_needs_fresh_stats_and_a_reported_bound() -> None:
    full = EngineStats(time=0.0, num_running=4, num_waiting=8, num_kv_blocks_total=1, num_kv_blocks_free=0,
                       kv_usage=1.0, drain_rate_rps=0.0, config={"max_waiting_requests": "8"})
    err = _state_with(full, age_s=0.1).early_refusal()
    assert err is not None and err.status == 429 and err.headers["Retry-After"] == "5"  # no drain rate yet
    assert _state_with(full, age_s=2.5).early_refusal() is None  # stale: the scheduler decides
    assert _state_with(full, age_s=0.1, connected=False).early_refusal() is None
    assert _state_with(None, age_s=0.1).early_refusal() is None
    # what drained since the snapshot, and what this gateway sent since, move the estimate
    draining = msgspec.structs.replace(full, drain_rate_rps=10.0)
    assert _state_with(draining, age_s=0.5).early_refusal() is None  # ~3 waiting by now
    assert _state_with(draining, age_s=0.5, sent=6).early_refusal() is not None  # ~9 again
    filling = msgspec.structs.replace(full, num_waiting=6)
    assert _state_with(filling, age_s=0.1).early_refusal() is None
    assert _state_with(filling, age_s=0.1, sent=2).early_refusal() is not None
    unbounded = EngineStats(time=0.0, num_running=4, num_waiting=8, num_kv_blocks_total=1, num_kv_blocks_free=0,
                            kv_usage=1.0, config={})
    assert _state_with(unbounded, age_s=0.1).early_refusal() is None


def test_inflight_limiter_retry_after_follows_the_completion_rate() -> None:
    limiter = InflightLimiter(2)
    a, b = limiter.acquire(), limiter.acquire()
    with pytest.raises(Exception) as refused:
        limiter.acquire()
    assert getattr(refused.value, "headers", {})["Retry-After"] == "5"  # nothing finished yet
    a.release()
    a.release()  # idempotent
    assert limiter.in_flight == 1
    for _ in range(19):
        limiter.acquire().release()
    c = limiter.acquire()
    assert limiter.completion_rate() == pytest.approx(2.0)  # 20 releases in the 10 s window
    with pytest.raises(Exception) as refused:
        limiter.acquire()
    assert getattr(refused.value, "headers", {})["Retry-After"] == "1"  # 2 open / 2 per second
    b.release()
    c.release()
    assert limiter.in_flight == 0 and InflightLimiter(0).acquire() is not None
    assert drain_retry_after_s(600, 2.0) == 60.0 and drain_retry_after_s(3, 2.0) == 1.5


def _check_timings(t: dict[str, Any]) -> None:
    assert set(t) == TIMING_KEYS
    assert t["queue_time_s"] == 0.0  # the fake schedules at arrival
    assert t["prefill_time_s"] is not None and t["prefill_time_s"] >= 0.0
    assert t["decode_time_s"] is not None and t["decode_time_s"] > 0.0  # 12 ticks of 10 ms
    assert 0.0 < t["ttft_s"] <= t["e2e_s"] and t["num_preemptions"] == 0


def test_timings_in_responses_and_final_chunks(env: Env, fake: FakeScheduler) -> None:
    body = env.http.post("/v1/completions", json=COMPLETION).json()
    _check_timings(body["timings"])
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        events = sse_events(resp)
    chunks = events[:-1]
    assert all("timings" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _check_timings(chunks[-1]["timings"])
    req = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with env.http.stream("POST", "/v1/completions", json=req) as resp:
        events = sse_events(resp)
    assert all("timings" not in c for c in events[:-2])
    assert events[-2]["usage"]["completion_tokens"] == 12
    _check_timings(events[-2]["timings"])
    # n > 1: one object for the request (slowest phases, preemptions summed)
    chat = env.http.post("/v1/chat/completions", json={"model": "tiny", "n": 2, "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert set(chat.json()["timings"]) == TIMING_KEYS


def test_official_client_parses_responses_with_timings(env: Env, fake: FakeScheduler) -> None:
    client = openai.OpenAI(base_url=f"{env.server.url}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(timeout=10))
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert (done.model_extra or {})["timings"]["num_preemptions"] == 0
    chunks = list(client.chat.completions.create(model="tiny", max_tokens=4, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert set((chunks[-1].model_extra or {})["timings"]) == TIMING_KEYS
    client.close()


def test_the_bound_is_a_flag_of_the_gateway_and_of_ferry_serve() -> None:
    from ferry_cli.serve import build_parser as serve_parser
    from services.gateway.__main__ import build_parser as gateway_parser

    assert GatewayConfig().max_inflight_requests == 2048
    assert gateway_parser().parse_args(["--max-inflight-requests", "7"]).max_inflight_requests == 7
    assert serve_parser().parse_args(["--max-inflight-requests", "0"]).max_inflight_requests == 0


def test_queue_full_message_says_the_estimate_not_a_stale_snapshot() -> None:
    # the snapshot says 0 waiting, but this gateway sent 2 since: the queue of 2 is full
    empty = EngineStats(time=0.0, num_running=2, num_waiting=0, num_kv_blocks_total=1, num_kv_blocks_free=0,
                        kv_usage=1.0, drain_rate_rps=0.0, config={"max_waiting_requests": "2"})
    err = _state_with(empty, age_s=0.1, sent=2).early_refusal()
    assert err is not None and err.message.startswith("the waiting queue is full (about 2 of 2 requests, ")
    assert "(0 of 2" not in err.message


def test_a_request_leaves_the_sent_count_when_it_runs_or_is_refused() -> None:
    """The early refusal counts what this gateway sent since the last EngineStats as waiting;
    one that has its first delta runs, one that is refused never waits: neither counts, so a
    client with a few requests in flight is not refused by its own running requests."""
    from services.gateway.engines.resume import Stream
    from shared.messages import RequestDelta, RequestDeltas, RequestRejected

    engine = EngineClient("ipc:///nonexistent", "gw-test")
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(4):
        engine._streams.add(Stream(f"r{i}", queue, None, stats_gen=engine.stats_gen))
    engine.sent_since_stats = 4
    engine._dispatch(RequestDeltas(step_id=1, deltas=[RequestDelta(req_id="r0", new_token_ids=[5]),
                                                               RequestDelta(req_id="r1", new_token_ids=[6])]))
    assert engine.sent_since_stats == 2
    engine._dispatch(RequestDeltas(step_id=1, deltas=[RequestDelta(req_id="r0", new_token_ids=[7])]))
    assert engine.sent_since_stats == 2  # its first delta took it out; later ones change nothing
    engine._dispatch(RequestRejected(req_id="r2", reason="queue_full", message="full"))
    assert engine.sent_since_stats == 1
    stats = EngineStats(time=0.0, num_running=2, num_waiting=1, num_kv_blocks_total=1, num_kv_blocks_free=0,
                        kv_usage=1.0, config={"max_waiting_requests": "8"})
    engine._dispatch(stats)  # the snapshot counts r3 itself now
    assert engine.sent_since_stats == 0
    engine._dispatch(RequestDeltas(step_id=1, deltas=[RequestDelta(req_id="r3", new_token_ids=[1])]))
    assert engine.sent_since_stats == 0  # sent before that snapshot: not counted twice
