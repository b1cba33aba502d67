"""Poison requests against the real scheduler process, then end to end through ``ferry serve``.

The test speaks the wire protocol as the worker (see test_faults_scheduler_service.py):
its fault-injection hook, which exists only here, crashes the "worker" (a fatal
``WorkerError``, then a new process announcing itself) whenever a step computes a
prompt holding the poison token id. The scheduler must end that request after
``max_request_crashes`` (2) consecutive crashes with an error naming the cause, and
finish every other request normally.

End to end, a test-only hook (tests/fault_injection/sitecustomize.py, active only
when that folder is on PYTHONPATH and FERRYTEST_POISON_TOKEN_ID is set) makes the
real worker raise whenever a step computes a prompt with the poison token: the
client of that request gets a 500 naming the cause, the others their normal text.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.messages import (
    EngineHealth,
    EngineStats,
    RequestDeltas,
    StepPlan,
    WorkerError,
    encode,
    to_gateway_decoder,
)
from tests.integration.conftest import ROOT, ServeProcess, child_env, read_metrics, tail
from tests.integration.test_faults_scheduler_service import Harness

POISON = 999


class PoisonHarness(Harness):
    def __init__(self, tmp: Path, *flags: str) -> None:
        super().__init__(tmp, *flags)
        self.errors: dict[str, str] = {}

    def pump_gateway(self, timeout_s: float = 0.05) -> None:
        while self.gateway.poll(int(timeout_s * 1000)):
            msg = to_gateway_decoder.decode(self.gateway.recv())
            if isinstance(msg, EngineHealth):
                self.health = msg
            elif isinstance(msg, EngineStats):
                self.stats = msg
            elif isinstance(msg, RequestDeltas):
                for d in msg.deltas:
                    self.tokens.setdefault(d.req_id, []).extend(d.new_token_ids)
                    if d.finish_reason:
                        self.finished[d.req_id] = d.finish_reason
                        self.errors[d.req_id] = d.error or ""
            timeout_s = 0.0


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[PoisonHarness]:
    h = PoisonHarness(tmp_path, "--worker-heartbeat-timeout-s", "5", "--max-request-crashes", "2")
    try:
        yield h
    finally:
        h.close()


def test_a_request_that_crashes_the_worker_twice_is_ended_and_the_others_finish(harness: PoisonHarness) -> None:
    h = harness
    pid = 6000
    h.announce(pid)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")
    prompts = {"a": [1, 2, 3], "b": [4, POISON, 5], "c": [6, 7], "d": [8, 9, 10, 11]}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=3)
    crashes = 0
    deadline = time.monotonic() + 60
    while len(h.finished) < len(prompts):
        assert time.monotonic() < deadline, f"unfinished: {h.finished}\n{tail(h.log)}"
        if not h.plans.poll(50):
            h.heartbeat()
            h.pump_gateway(0.0)
            continue
        plan = h.next_plan()
        if not isinstance(plan, StepPlan) or not plan.num_scheduled_tokens:
            continue
        computed = plan.new_requests + plan.resumed_requests
        if any(POISON in r.prompt_token_ids for r in computed):  # the fault-injection hook
            crashes += 1
            h.results.send(encode(WorkerError(rank=0, message=f"injected crash on token {POISON}",
                                              step_id=plan.step_id, fatal=True)))
            pid += 1
            h.announce(pid)
            continue
        h.answer(plan, pid)
    assert crashes == 2
    assert h.finished["b"] == "error" and "crashed 2 times in a row" in h.errors["b"]
    assert {rid: h.finished[rid] for rid in "acd"} == {"a": "length", "c": "length", "d": "length"}
    assert all(h.tokens[rid] == [7, 7, 7] for rid in "acd")
    h.wait(lambda: h.stats is not None and h.stats.num_running == 0 and h.stats.kv_usage == 0.0
           and h.stats.worker_restarts_total == 2, 5, "an idle engine after two restarts")


# -- end to end: ferry serve, a real worker with the test-only hook, HTTP -----------------

FAULT_DIR = Path(__file__).resolve().parents[1] / "fault_injection"
SERVE_POISON = 4242  # a token id of the SmolLM2 vocabulary, in no prompt below but the poison one


class PoisonServe(ServeProcess):
    def start(self) -> PoisonServe:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        env = child_env(FERRYTEST_POISON_TOKEN_ID=str(SERVE_POISON),
                        PYTHONPATH=os.pathsep.join([str(FAULT_DIR), str(ROOT)]))
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, process_group=0)
        return self


def test_ferry_serve_ends_the_poison_request_with_a_500_and_serves_the_others(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    serve = PoisonServe(tiny_model_dir, tmp_path, ["--worker-heartbeat-timeout-s", "3", "--max-restarts", "10"])
    serve.start()
    try:
        serve.wait_ready()
        base = {"model": serve.model, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        prompts: list[Any] = ["A calm story:", "Another one:", [1, 2, SERVE_POISON, 3], "A third:"]
        calm = {i: _post(serve, {**base, "prompt": p}) for i, p in enumerate(prompts) if i != 2}
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            # A request that reaches the gateway while the crashed worker restarts is refused with
            # 503 + Retry-After (the engine is not ready); a client retries it, as these do.
            futures = [pool.submit(_post_retrying, serve, {**base, "prompt": p}) for p in prompts]
            results = [f.result(timeout=300) for f in futures]
        status, body = results[2]
        assert status == 500, body
        assert body["error"]["code"] == "engine_error" and "crashed 2 times in a row" in body["error"]["message"]
        for i, (status, body) in enumerate(results):
            if i != 2:
                assert status == 200, body
                assert body["choices"][0]["text"] == calm[i][1]["choices"][0]["text"]
        assert read_metrics(serve.base_url)["ferry:worker_restarts_total"] == 2
        assert "injected fault" in serve.log_path.read_text(errors="replace")  # the whole log, not its tail
    finally:
        serve.kill()


def _post_retrying(serve: ServeProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    for _ in range(60):
        status, answer = _post(serve, body)
        if status != 503 or answer["error"]["code"] != "scheduler_unavailable":
            return status, answer
        time.sleep(1.0)
    return status, answer


def _post(serve: ServeProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = httpx.post(f"{serve.base_url}/v1/completions", json=body, timeout=300, trust_env=False)
    return resp.status_code, resp.json()
