"""Poison requests against the real scheduler process (``python -m services.scheduler``).

The test speaks the wire protocol as the worker (see test_faults_scheduler_service.py):
its fault-injection hook, which exists only here, crashes the "worker" (a fatal
``WorkerError``, then a new process announcing itself) whenever a step computes a
prompt holding the poison token id. The scheduler must end that request after
``max_request_crashes`` (2) consecutive crashes with an error naming the cause, and
finish every other request normally.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

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
from tests.integration.conftest import tail
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
