"""The gateway process's app against a fake scheduler over real zmq and HTTP sockets.

One uvicorn server for the module; each test gets a fresh ``FakeScheduler`` bound
to the same ipc endpoint, so every test also exercises the gateway reconnecting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.unit.gateway.test_gateway_support import FakeScheduler, running_env, wait_until
from tests.unit.gateway.test_gateway_support import GatewayEnv as Env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from running_env(tmp_path_factory.mktemp("gw"))


@pytest.fixture
def fake(env: Env) -> Iterator[FakeScheduler]:
    yield env.start_fake()
    env.stop_fake()


def sse_events(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 12}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def test_ready_waits_for_the_scheduler(env: Env) -> None:
    env.stop_fake()
    wait_until(lambda: env.http.get("/ready").status_code == 503, 5, "not ready without a scheduler")
    health = env.http.get("/health")
    assert health.status_code == 200 and health.json()["scheduler"]["connected"] is False
    env.start_fake()
    body = env.http.get("/ready").json()
    assert body["ready"] is True and body["scheduler"]["workers_ready"] == [0]
    env.stop_fake()


def test_completion(env: Env, fake: FakeScheduler) -> None:
    fake.cached_tokens = 1
    resp = env.http.post("/v1/completions", json={**COMPLETION, "priority": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert resp.headers["x-request-id"] == body["id"] and fake.adds[-1].req_id == body["id"] + "-0"
    add = fake.adds[-1]
    assert add.stop.max_tokens == 12 and add.priority == 3 and add.stop.eos_token_ids == [2]
    assert add.prompt_token_ids == env.tok.encode("Hello")
    choice = body["choices"][0]
    assert choice["text"] == env.text_of(fake.tokens_for(add)) and choice["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"] == {"prompt_tokens": len(add.prompt_token_ids), "completion_tokens": 12,
                             "total_tokens": len(add.prompt_token_ids) + 12,
                             "prompt_tokens_details": {"cached_tokens": 1}}


def test_completion_stream_with_usage(env: Env, fake: FakeScheduler) -> None:
    req = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with env.http.stream("POST", "/v1/completions", json=req) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == env.text_of(fake.tokens_for(fake.adds[-1]))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


def test_chat_stream_with_logprobs(env: Env, fake: FakeScheduler) -> None:
    req = {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2}
    with env.http.stream("POST", "/v1/chat/completions", json=req) as resp:
        events = sse_events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    add = fake.adds[-1]
    assert add.sampling.logprobs == 2
    assert add.prompt_token_ids == env.tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    content = [c for e in events[1:-1] for c in e["choices"][0]["logprobs"]["content"]]
    assert len(content) == 6 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert [c["token"] for c in content] == [env.tok.token_text(t) for t in fake.tokens_for(add)]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == \
        env.text_of(fake.tokens_for(add))


def test_n_choices_are_seeded_requests_sharing_the_prompt(env: Env, fake: FakeScheduler) -> None:
    resp = env.http.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 7})
    body = resp.json()
    adds = fake.adds[-3:]
    assert [a.sampling.seed for a in adds] == [7, 8, 9]
    assert len({tuple(a.prompt_token_ids) for a in adds}) == 1
    texts = [c["message"]["content"] for c in body["choices"]]
    assert texts == [env.text_of(fake.tokens_for(a)) for a in adds] and len(set(texts)) == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18
    assert body["usage"]["prompt_tokens"] == len(adds[0].prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_aborts_in_the_scheduler(env: Env, fake: FakeScheduler, stream: bool) -> None:
    req = {**COMPLETION, "stop": ["d, t"], "max_tokens": 30, "stream": stream}
    if stream:
        with env.http.stream("POST", "/v1/completions", json=req) as resp:
            events = sse_events(resp)
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        choice = env.http.post("/v1/completions", json=req).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert (text, finish) == ("Hello worl", "stop")
    rid = fake.adds[-1].req_id
    wait_until(lambda: rid in fake.aborted(), 2, "abort after a stop string")


def test_eos_finishes_with_stop_and_is_not_shown(env: Env, fake: FakeScheduler) -> None:
    fake.eos_after = 3
    body = env.http.post("/v1/completions", json=COMPLETION).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == env.text_of(fake.tokens_for(fake.adds[-1])[:2])
    assert body["usage"]["completion_tokens"] == 3


def test_queue_full_is_429_with_retry_after(env: Env, fake: FakeScheduler) -> None:
    fake.reject = ("queue_full", 2.2)
    for stream in (False, True):
        resp = env.http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["code"] == "queue_full"
        assert resp.json()["error"]["type"] == "rate_limit_error"


def test_queue_timeout_is_503(env: Env, fake: FakeScheduler) -> None:
    fake.finish_now = "timeout"
    resp = env.http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_timeout"
    fake.finish_now = "error"
    resp = env.http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error"


def test_stream_disconnect_aborts(env: Env, fake: FakeScheduler) -> None:
    fake.tick_s = 0.05
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    rid = fake.adds[-1].req_id
    wait_until(lambda: rid in fake.aborted(), 3, "abort after the client closed the stream")


def test_non_stream_disconnect_aborts(env: Env, fake: FakeScheduler) -> None:
    fake.hold = True  # queued forever: only the disconnect can end it
    with pytest.raises(httpx.ReadTimeout):
        env.http.post("/v1/completions", json=COMPLETION, timeout=0.5)
    wait_until(lambda: len(fake.adds) == 1, 5, "the request reached the scheduler")
    rid = fake.adds[-1].req_id
    wait_until(lambda: rid in fake.aborted(), 5, "abort after the client went away")
    # a client leaving while its stream waits in the queue is noticed too
    with pytest.raises(httpx.ReadTimeout):
        env.http.post("/v1/completions", json={**COMPLETION, "stream": True}, timeout=0.5)
    wait_until(lambda: len(fake.adds) == 2, 5, "the stream reached the scheduler")
    rid = fake.adds[-1].req_id
    wait_until(lambda: rid in fake.aborted(), 5, "abort of a queued stream")


def test_scheduler_death_holds_in_flight_and_resubmits_it(env: Env) -> None:
    fake = env.start_fake()
    fake.hold = True
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        assert resp.status_code == 200  # headers went out after the wait for a first token
        orphan = fake.adds[-1].req_id
        env.stop_fake()
        wait_until(lambda: env.http.get("/ready").status_code == 503, 30, "not ready without a scheduler")
        refused = env.http.post("/v1/completions", json=COMPLETION)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "scheduler_unavailable"
        assert env.http.get("/health").json()["scheduler"]["held"] == 1
        fake = env.start_fake()  # same endpoint, no gateway restart: the held request is re-sent
        events = sse_events(resp)
    resent = [a for a in fake.adds if a.req_id == orphan + "~r1"]
    assert len(resent) == 1 and resent[0].output_token_ids == [] and resent[0].prompt_token_ids == env.tok.encode("Hello")
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == env.text_of(fake.tokens_for(resent[0]))
    wait_until(lambda: orphan in fake.aborted(), 30, "the orphaned id is aborted in the new scheduler")
    assert resumed(env, "connection_lost") >= 1
    env.stop_fake()


def test_scheduler_death_mid_stream_resumes_with_the_tokens_already_streamed(env: Env) -> None:
    fake = env.start_fake()
    fake.tick_s = 0.05
    req = {**COMPLETION, "max_tokens": 40, "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
    with env.http.stream("POST", "/v1/completions", json=req) as resp:
        lines = resp.iter_lines()
        got: list[Any] = []
        for line in lines:  # read a few tokens, then kill the scheduler under the stream
            if line.startswith("data: "):
                got.append(json.loads(line[len("data: "):]))
                if len(got) == 5:
                    break
        first = fake.adds[-1]
        env.stop_fake()
        fake = env.start_fake()
        rest = sse_events_from(lines)
    events = got + rest
    cont = next(a for a in fake.adds if a.req_id.startswith(first.req_id + "~r"))
    assert 5 <= len(cont.output_token_ids) < 40
    assert cont.output_token_ids == fake.tokens_for(first)[:len(cont.output_token_ids)]
    assert cont.stop == first.stop and cont.sampling == first.sampling and cont.arrival_time == first.arrival_time
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == env.text_of(fake.tokens_for(first))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 40
    snapshot = env.http.get("/dashboard/data").json()
    assert any("resumed" in ev["text"] for ev in snapshot["events"])
    env.stop_fake()


def resumed(env: Env, cause: str) -> float:
    """ferry:requests_resumed_total{cause=...} as scraped."""
    for line in env.http.get("/metrics").text.splitlines():
        if line.startswith("ferry:requests_resumed_total{") and f'cause="{cause}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no ferry:requests_resumed_total series for {cause}")


def sse_events_from(lines: Iterator[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_silent_scheduler_is_down_until_it_speaks_again(env: Env, fake: FakeScheduler) -> None:
    fake.hold = True
    fake.mute = True
    resp = env.http.post("/v1/completions", json=COMPLETION)  # fails after scheduler_timeout_s=2
    assert resp.status_code == 503 and "silent" in resp.json()["error"]["message"]
    assert env.http.get("/ready").status_code == 503
    fake.mute = False
    wait_until(lambda: env.http.get("/ready").status_code == 200, 3, "ready once it speaks again")


def test_metrics_config_and_heartbeats(env: Env, fake: FakeScheduler) -> None:
    env.http.post("/v1/completions", json=COMPLETION)
    metrics = env.http.get("/metrics")
    assert metrics.status_code == 200 and "ferry:" in metrics.text
    cfg = env.http.get("/v1/config").json()
    # typed, also from a scheduler that reports its knobs only as strings (this fake does)
    assert cfg["scheduler"] == {"max_num_seqs": 4, "max_waiting_requests": 1024} and cfg["gateway"]["served_model_name"] == "tiny"
    assert cfg["workers"] == []
    wait_until(lambda: len(fake.heartbeats) >= 2, 3, "heartbeats every heartbeat_interval_s")
    gid = env.app.state.gateway.gateway_id
    assert {h.gateway_id for h in fake.heartbeats} == {gid}
    assert all(a.gateway_id == gid for a in fake.adds)


def test_streamed_queue_timeout_is_counted_once_with_the_status_the_client_got(env: Env, fake: FakeScheduler) -> None:
    def rejected(reason: str, status: str) -> float:
        for line in env.http.get("/metrics").text.splitlines():
            if line.startswith("ferry:request_rejected_total{") and f'reason="{reason}"' in line \
                    and f'status="{status}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = rejected("queue_timeout", "200"), rejected("queue_timeout", "503")
    fake.hold = True
    with env.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200  # the headers went out before the queue timeout
        fake.finish_running = "timeout"
        events = sse_events(resp)
    assert events[-2]["error"]["code"] == "queue_timeout" and events[-1] == "[DONE]"
    after = rejected("queue_timeout", "200"), rejected("queue_timeout", "503")
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 0.0)


def test_a_new_scheduler_incarnation_without_a_drop_resumes_in_flight_requests(env: Env) -> None:
    """A scheduler restarted so fast that no disconnect was seen announces a new incarnation:
    the requests the old one held are gone, so they are re-sent as continuations."""
    fake = env.start_fake()
    fake.tick_s = 0.05
    req = {**COMPLETION, "max_tokens": 30, "stream": True}
    with env.http.stream("POST", "/v1/completions", json=req) as resp:
        lines = resp.iter_lines()
        got = []
        for line in lines:
            if line.startswith("data: "):
                got.append(json.loads(line[len("data: "):]))
                if len(got) == 3:
                    break
        first = fake.adds[-1]
        fake.incarnation = "reborn"  # the same socket, a "new process"
        rest = sse_events_from(lines)
    events = got + rest
    cont = next(a for a in fake.adds if a.req_id == first.req_id + "~r1")
    assert len(cont.output_token_ids) >= 3
    wait_until(lambda: first.req_id in fake.aborted(), 30, "the old incarnation's id is aborted")
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == env.text_of(fake.tokens_for(first))
    assert resumed(env, "new_incarnation") >= 1
    env.stop_fake()


def start_held(env: Env) -> FakeScheduler:
    """A fake scheduler that holds every request from the first instant (no token ever)."""
    env.fake = FakeScheduler(env.endpoint, env.script)
    env.fake.hold = True
    wait_until(lambda: env.http.get("/ready").status_code == 200, 30, "gateway ready")
    return env.fake


def test_a_request_is_resumed_at_most_max_resumes_times(env: Env) -> None:
    max_resumes = env.app.state.gateway.config.max_resumes
    fake = start_held(env)
    with env.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        wait_until(lambda: bool(fake.adds), 30, "the request reached the scheduler")
        rid = fake.adds[-1].req_id
        for k in range(1, max_resumes + 1):
            env.stop_fake()
            fake = start_held(env)
            wait_until(lambda k=k, f=fake: any(a.req_id == f"{rid}~r{k}" for a in f.adds), 30, f"resume {k}")
        env.stop_fake()  # one loss more than it may survive
        fake = start_held(env)
        events = sse_events(resp)
    error = events[-2]["error"]
    assert error["code"] == "scheduler_unavailable" and f"max_resumes={max_resumes}" in error["message"]
    assert not any(a.req_id == f"{rid}~r{max_resumes + 1}" for a in fake.adds)
    env.stop_fake()
