"""The scheduler process's fault paths, fast: the real ``python -m services.scheduler``
over real ipc sockets, with the test speaking the wire protocol as worker and gateway
(no model, no torch), so each path is driven exactly:

- requests that arrive before the workers are queued and run once they announce;
- a fatal ``WorkerError`` and a missed step deadline each declare the rank dead; the
  running requests are re-sent in full (prompt plus generated tokens) to the rank's
  next process, and the restart counter moves; a rank declared dead that still
  heartbeats is told to exit (``Shutdown(rank=0)``), and so is a worker that
  announced itself to a previous scheduler process;
- a re-announcement with a new pid replaces the old process at once;
- a silent gateway has its requests aborted and their blocks freed;
- SIGTERM sends ``Shutdown`` to the workers and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared.messages import (
    AddRequest,
    EngineHealth,
    EngineStats,
    GatewayHeartbeat,
    RequestDeltas,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepResult,
    StopParams,
    WorkerError,
    WorkerHeartbeat,
    WorkerReady,
    encode,
    to_gateway_decoder,
    to_worker_decoder,
)
from tests.integration.conftest import ROOT, child_env, tail

GATEWAY = "gw-test"


class Harness:
    """A scheduler process plus the test's own worker (SUB + PUSH) and gateway (DEALER) sockets."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="ferry-s-")
        eps = {k: f"ipc://{self.dir}/{k}.sock" for k in ("gateway", "plan", "result")}
        self.log = tmp / "scheduler.log"
        cmd = [sys.executable, "-m", "services.scheduler", "--gateway-endpoint", eps["gateway"],
               "--plan-endpoint", eps["plan"], "--result-endpoint", eps["result"], "--stats-interval-s", "0.05",
               "--log-format", "text", *flags]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=log, process_group=0)
        self.ctx = zmq.Context()
        self.plans = self.ctx.socket(zmq.SUB)
        self.plans.setsockopt(zmq.SUBSCRIBE, b"")
        self.plans_monitor = self.plans.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.plans.connect(eps["plan"])
        self.subscribed = False
        self.results = self.ctx.socket(zmq.PUSH)
        self.results.connect(eps["result"])
        self.gateway = self.ctx.socket(zmq.DEALER)
        self.gateway.setsockopt(zmq.IDENTITY, GATEWAY.encode())
        self.gateway.connect(eps["gateway"])
        self.health: EngineHealth | None = None
        self.stats: EngineStats | None = None
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    # -- gateway side
    def heartbeat(self) -> None:
        self.gateway.send(encode(GatewayHeartbeat(GATEWAY, time.time())))

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.gateway.send(encode(AddRequest(req_id, GATEWAY, prompt, SamplingParams(temperature=0.0),
                                            StopParams(max_tokens=max_tokens))))

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
            timeout_s = 0.0

    # -- worker side
    def wait_subscribed(self) -> None:
        # Like a real worker (which loads its model meanwhile): be subscribed to plans
        # before saying ready, or the first plan is published to nobody.
        if not self.subscribed:
            assert self.plans_monitor.poll(20_000), f"plan socket never connected:\n{tail(self.log)}"
            time.sleep(0.2)
            self.subscribed = True

    def announce(self, pid: int, num_kv_blocks: int = 64) -> None:
        self.wait_subscribed()
        self.results.send(encode(WorkerReady(rank=0, num_kv_blocks=num_kv_blocks, block_size=16, model="fake",
                                             max_model_len=256, pid=pid)))

    def next_plan(self, timeout_s: float = 10.0) -> StepPlan | Shutdown:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pump_gateway(0.0)
            if self.plans.poll(50):
                msg = to_worker_decoder.decode(self.plans.recv())
                return msg
            self.heartbeat()
        raise AssertionError(f"no plan in {timeout_s}s:\n{tail(self.log)}")

    def answer(self, plan: StepPlan, pid: int, token: int = 7) -> None:
        """Sample ``token`` for every request whose scheduled tokens reach its end (greedy fake)."""
        ids = list(plan.num_scheduled_tokens)
        self.results.send(encode(StepResult(step_id=plan.step_id, rank=0, req_ids=ids,
                                            sampled_token_ids=[token] * len(ids))))
        self.results.send(encode(WorkerHeartbeat(rank=0, pid=pid, time=time.time())))

    def wait(self, predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.heartbeat()
            self.pump_gateway(0.05)
            if predicate():
                return
        raise AssertionError(f"timed out waiting for {what}:\n{tail(self.log)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.plans.disable_monitor()
        self.ctx.destroy(linger=0)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    # Poison counting off: these tests kill the rank under one request again and again on
    # purpose (test_faults_poison.py covers ending a request present at every crash).
    h = Harness(tmp_path, "--worker-heartbeat-timeout-s", "2", "--step-timeout-s", "1.5",
                "--gateway-timeout-s", "1.5", "--max-request-crashes", "0")
    try:
        yield h
    finally:
        h.close()


def test_queued_before_ready_then_worker_error_recomputes_on_the_new_process(harness: Harness) -> None:
    h = harness
    h.wait(lambda: h.health is not None, 10, "a first EngineHealth")
    assert h.health is not None and not h.health.scheduler_ready
    h.add("a", [1, 2, 3], max_tokens=4)
    h.announce(pid=1001)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and [r.req_id for r in plan.new_requests] == ["a"]
    h.answer(plan, pid=1001)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and plan.num_scheduled_tokens == {"a": 1}
    h.answer(plan, pid=1001)
    h.wait(lambda: len(h.tokens.get("a", [])) == 2, 5, "two tokens")
    # The next step fails fatally: the rank is dead until a process announces itself.
    plan = h.next_plan()
    assert isinstance(plan, StepPlan)
    h.results.send(encode(WorkerError(rank=0, message="boom", step_id=plan.step_id, fatal=True)))
    h.wait(lambda: h.health is not None and not h.health.scheduler_ready, 5, "not ready after the error")
    h.announce(pid=1002)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan)
    resent = plan.new_requests + plan.resumed_requests
    assert [(r.req_id, r.prompt_token_ids, r.output_token_ids, r.num_computed_tokens) for r in resent] == \
        [("a", [1, 2, 3], [7, 7], 0)]
    assert plan.num_scheduled_tokens == {"a": 5}  # prompt plus generated tokens, recomputed
    for _ in range(10):
        h.answer(plan, pid=1002)
        h.wait(lambda: "a" in h.finished or bool(h.plans.poll(0)), 5, "a finish or the next plan")
        if "a" in h.finished:
            break
        plan = h.next_plan()  # type: ignore[assignment]
    assert h.finished["a"] == "length" and h.tokens["a"] == [7, 7, 7, 7]
    # Nothing else runs, yet the workers still hear that "a" is done (and drop its state).
    flush = h.next_plan()
    assert isinstance(flush, StepPlan) and flush.finished_req_ids == ["a"] and flush.total_num_scheduled_tokens == 0
    h.wait(lambda: h.stats is not None and h.stats.worker_restarts_total == 1 and h.stats.num_running == 0
           and h.stats.kv_usage == 0.0, 5, "stats after recovery")


def test_step_timeout_and_new_pid_declare_the_rank_dead(harness: Harness) -> None:
    h = harness
    h.announce(pid=2001)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")
    h.add("b", [5, 6], max_tokens=3)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan)
    # No answer, but heartbeats keep coming: only the step deadline can catch a hung forward.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (h.health and not h.health.scheduler_ready):
        h.results.send(encode(WorkerHeartbeat(rank=0, pid=2001, time=time.time())))
        h.heartbeat()
        h.pump_gateway(0.1)
    assert h.health is not None and not h.health.scheduler_ready, tail(h.log)
    # It still heartbeats, so the scheduler asks exactly that rank to exit (to be restarted).
    h.results.send(encode(WorkerHeartbeat(rank=0, pid=2001, time=time.time())))
    retire = h.next_plan()
    assert isinstance(retire, Shutdown) and retire.rank == 0, retire
    h.announce(pid=2002)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and plan.num_scheduled_tokens == {"b": 2}
    # A third process announces while the second is in use: the second is dead at once.
    h.announce(pid=2003)
    h.wait(lambda: h.stats is not None and h.stats.worker_restarts_total == 2, 5, "two restarts")
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and plan.num_scheduled_tokens == {"b": 2}
    assert "rank 0 (pid 2002) is dead: re-announced with a new pid 2003" in tail(h.log, 20000)


def test_silent_gateway_is_aborted_and_sigterm_stops_workers(harness: Harness) -> None:
    h = harness
    h.announce(pid=3001)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")
    h.add("c", [1] * 40, max_tokens=200)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan)
    h.answer(plan, pid=3001)
    h.wait(lambda: h.stats is not None and h.stats.num_running == 1 and h.stats.kv_usage > 0, 5, "a running request")
    # The gateway goes quiet (the worker keeps heartbeating and answering).
    deadline = time.monotonic() + 8
    aborted = False
    while time.monotonic() < deadline and not aborted:
        h.results.send(encode(WorkerHeartbeat(rank=0, pid=3001, time=time.time())))
        if h.plans.poll(100):
            msg = to_worker_decoder.decode(h.plans.recv())
            if isinstance(msg, StepPlan):
                aborted = "c" in msg.finished_req_ids
                if msg.num_scheduled_tokens:
                    time.sleep(0.2)  # a slow decode: the request outlives the gateway's silence
                    h.answer(msg, pid=3001)
    assert aborted, tail(h.log)
    assert "gateway gw-test silent" in tail(h.log, 20000)
    h.wait(lambda: h.stats is not None and h.stats.num_running == 0 and h.stats.kv_usage == 0.0, 5, "freed blocks")
    h.proc.send_signal(signal.SIGTERM)
    # A plan still on its way (the abort's flush) is answered as a worker would; then Shutdown.
    # (The drain may take its whole grace, 10 s, when that plan is unanswered: wait past it.)
    msg = h.next_plan(timeout_s=20.0)
    while isinstance(msg, StepPlan):
        h.answer(msg, pid=3001)
        msg = h.next_plan(timeout_s=20.0)
    assert isinstance(msg, Shutdown)
    assert h.proc.wait(timeout=10) == 0


def test_worker_of_a_previous_scheduler_is_asked_to_restart(harness: Harness) -> None:
    """A new scheduler process hears heartbeats from a worker that announced itself to the
    old one: that worker holds stale state and must restart, so it gets Shutdown(rank)."""
    h = harness
    h.wait_subscribed()
    deadline = time.monotonic() + 10
    retire: Shutdown | None = None
    while time.monotonic() < deadline and retire is None:
        h.results.send(encode(WorkerHeartbeat(rank=0, pid=4001, time=time.time())))
        if h.plans.poll(200):
            msg = to_worker_decoder.decode(h.plans.recv())
            if isinstance(msg, Shutdown):
                retire = msg
    assert retire is not None and retire.rank == 0, tail(h.log)
    # Its restarted process announces itself and is used.
    h.announce(pid=4002)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")


def test_request_arriving_during_a_long_step_is_counted_waiting(harness: Harness) -> None:
    """A new request joins the waiting queue while a step runs, so the waiting gauge
    (and a queue-full refusal) see it before the step ends."""
    h = harness
    h.announce(pid=3001)
    h.wait(lambda: h.health is not None and h.health.scheduler_ready, 10, "readiness")
    h.add("a", [1, 2, 3], max_tokens=4)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and list(plan.num_scheduled_tokens) == ["a"]
    # The worker holds the step (keeps heartbeating); "b" arrives meanwhile.
    h.add("b", [4, 5, 6], max_tokens=4)
    h.stats = None
    deadline = time.monotonic() + 1.0  # well inside the 1.5 s step timeout
    while time.monotonic() < deadline and not (h.stats is not None and h.stats.num_waiting == 1):
        h.results.send(encode(WorkerHeartbeat(rank=0, pid=3001, time=time.time())))
        h.heartbeat()
        h.pump_gateway(0.05)
    assert h.stats is not None and h.stats.num_waiting == 1 and h.stats.num_running == 1, h.stats
    h.answer(plan, pid=3001)
    plan = h.next_plan()
    assert isinstance(plan, StepPlan) and [r.req_id for r in plan.new_requests] == ["b"]
