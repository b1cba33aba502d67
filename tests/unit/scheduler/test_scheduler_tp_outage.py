"""A tensor-parallel group restart is ONE crash for the poison rule (services/scheduler/ranks.py).

When one rank of a tensor-parallel engine dies, the supervisor restarts every rank of
the group, and the scheduler learns of the deaths one by one: the dead rank's silence,
then the new processes' announcements (each a new pid for its rank), and stray
heartbeats of the old processes. Before the fix, the scheduler could dispatch a plan
between two of those deaths (rank 0's old process still looked alive) and the poison
rule counted two crashes of the requests that were running, ending them as poison
with the default ``max_request_crashes`` 2.

Here the real ``SchedulerService`` runs over real (inproc) ZeroMQ sockets; the test
plays the worker ranks (each "process" a pid; rank 0 computes with ``FakeWorker``)
and one gateway, and hands the scheduler each hand-built sequence of rank deaths in
order, one event per poll of the scheduler's sockets.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import zmq

from services.scheduler.service import SchedulerService
from shared.messages import (
    RequestDeltas,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerHeartbeat,
    WorkerReady,
    encode,
    to_gateway_decoder,
    to_worker_decoder,
)
from shared.transport import connect
from tests.scheduler_fakes import FakeClock, FakeWorker, expected_tokens, make_request, small_config

NUM_BLOCKS = 64
PROMPT = 12
MAX_TOKENS = 30
_ids = itertools.count()


class Ranks:
    """The engine's worker ranks, played by the test: ``pids[rank]`` is its live process."""

    def __init__(self, ctx: zmq.Context, plan_endpoint: str, result_endpoint: str, tp: int) -> None:
        self.tp = tp
        self.plans = connect(ctx, zmq.SUB, plan_endpoint, SUBSCRIBE=b"")
        self.results = connect(ctx, zmq.PUSH, result_endpoint)
        self.pids: dict[int, int] = {}
        self.worker = FakeWorker(4, NUM_BLOCKS)  # rank 0's batch state (the rank that samples)
        self.shutdowns: list[Shutdown] = []
        self.plans_seen = 0
        self.crash_on_plan: Callable[[], None] | None = None  # one shot: called instead of answering
        self.on_plan: Callable[[StepPlan], None] = lambda plan: None

    def announce(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid
        if rank == 0:
            self.worker.restart()  # a new process holds nothing
        self.results.send(encode(WorkerReady(rank=rank, num_kv_blocks=NUM_BLOCKS, block_size=4, model="tiny",
                                             pid=pid, tensor_parallel_size=self.tp)))

    def kill(self, rank: int) -> None:
        del self.pids[rank]

    def heartbeat(self, rank: int, pid: int) -> None:
        self.results.send(encode(WorkerHeartbeat(rank=rank, pid=pid, time=0.0)))

    def answer(self) -> None:
        """Every live rank answers every plan published so far (only rank 0's result carries tokens)."""
        while True:
            try:
                msg = to_worker_decoder.decode(self.plans.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, Shutdown):
                self.shutdowns.append(msg)
                continue
            assert isinstance(msg, StepPlan)
            self.plans_seen += 1
            self.on_plan(msg)
            if self.crash_on_plan is not None and msg.total_num_scheduled_tokens:
                crash, self.crash_on_plan = self.crash_on_plan, None
                crash()
                continue
            if 0 in self.pids:
                result = self.worker.step(msg)
                if msg.total_num_scheduled_tokens:
                    self.results.send(encode(result))
            if msg.total_num_scheduled_tokens:
                for rank in self.pids:
                    if rank != 0:
                        self.results.send(encode(StepResult(step_id=msg.step_id, rank=rank)))


class Engine:
    """A ``SchedulerService`` with scripted ranks and one gateway; ``events`` run one per poll."""

    def __init__(self, tp: int, num_workers: int = 2) -> None:
        self.ctx = zmq.Context()
        n = next(_ids)
        config = small_config(
            num_workers=num_workers, max_request_crashes=2,
            gateway_endpoint=f"inproc://gw{n}", plan_endpoint=f"inproc://plan{n}",
            result_endpoint=f"inproc://result{n}",
        )
        self.clock = FakeClock()
        self.service = SchedulerService(config, ctx=self.ctx, clock=self.clock)
        self.ranks = Ranks(self.ctx, config.plan_endpoint, config.result_endpoint, tp)
        self.gateway = connect(self.ctx, zmq.DEALER, config.gateway_endpoint, ROUTING_ID=b"g0")
        self.events: list[Callable[[], None]] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.errors: dict[str, str | None] = {}
        # (requests in the plan, the poison rule's crash counts when it went out), plans with tokens only
        self.plans: list[tuple[set[str], dict[str, int]]] = []
        self.ranks.on_plan = self._record_plan
        poll = self.service._poll

        def scripted_poll(timeout_s: float) -> None:
            if self.events:
                self.events.pop(0)()
            self.ranks.answer()
            poll(min(timeout_s, 0.05))  # a fake clock: never wait long in real time

        self.service._poll = scripted_poll  # type: ignore[method-assign]

    def _record_plan(self, plan: StepPlan) -> None:
        if plan.total_num_scheduled_tokens and self.service.core is not None:
            self.plans.append((set(plan.num_scheduled_tokens), dict(self.service.core.suspects.counts)))

    def first_plan_from(self, index: int) -> tuple[set[str], dict[str, int]]:
        assert len(self.plans) > index, "no plan went out"
        return self.plans[index]

    def close(self) -> None:
        self.service.close()
        for sock in (self.ranks.plans, self.ranks.results, self.gateway):
            sock.close(linger=0)
        self.ctx.term()

    def submit(self, *names: str) -> None:
        for name in names:
            self.gateway.send(encode(make_request(name, PROMPT, max_tokens=MAX_TOKENS, gateway_id="g0")))

    def run(self, times: int) -> None:
        for _ in range(times):
            self.service.run_once()
            self.read_gateway()

    def run_until(self, done: Callable[[], bool], limit: int = 400) -> None:
        for _ in range(limit):
            if done():
                return
            self.run(1)
        raise AssertionError("the engine did not get there")

    def read_gateway(self) -> None:
        while True:
            try:
                msg = to_gateway_decoder.decode(self.gateway.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, RequestDeltas):
                for d in msg.deltas:
                    self.tokens.setdefault(d.req_id, []).extend(d.new_token_ids)
                    if d.finish_reason is not None:
                        self.finish[d.req_id], self.errors[d.req_id] = d.finish_reason, d.error

    def crashes_of(self, name: str) -> int:
        assert self.service.core is not None
        return self.service.core.suspects.counts.get(name, 0)


@pytest.fixture
def engine() -> Engine:
    return Engine(tp=2)


def start(e: Engine) -> None:
    e.ranks.announce(0, 100)
    e.ranks.announce(1, 101)
    e.run_until(e.service.engine_ready)
    e.submit("a", "b")
    e.run_until(lambda: all(len(e.tokens.get(n, [])) >= 3 for n in ("a", "b")))
    assert e.service.core is not None and {r.req_id for r in e.service.core.running} == {"a", "b"}


def rank1_goes_silent(e: Engine) -> None:
    """Rank 1 is SIGKILLed; rank 0's old process still heartbeats when the scheduler notices."""
    e.ranks.kill(1)
    e.clock.advance(e.service.config.worker_heartbeat_timeout_s + 1)
    e.ranks.heartbeat(0, 100)


def finish_and_check(e: Engine) -> None:
    e.run_until(lambda: len(e.finish) == 2)
    for name in ("a", "b"):
        assert e.finish[name] == "length", e.errors[name]
        assert e.tokens[name] == expected_tokens(name, PROMPT, MAX_TOKENS)  # recomputed, not lost
    assert e.service.core is not None and not e.service.core.suspects


def test_the_dead_ranks_silence_then_both_new_processes_is_one_crash(engine: Engine) -> None:
    e = engine
    start(e)
    rank1_goes_silent(e)
    e.run(1)  # the silence is noticed: rank 0 goes down with its group
    assert e.service.ranks.ready_ranks() == []
    assert (e.crashes_of("a"), e.crashes_of("b")) == (1, 1)
    # The supervisor stops rank 0's old process and starts both ranks; rank 1 announces first.
    # The old code dispatched a plan here (rank 0 still looked alive), and rank 0's new pid
    # was then a second crash of the suspect in that plan.
    e.ranks.kill(0)
    e.events += [lambda: e.ranks.announce(1, 201), lambda: e.ranks.announce(0, 200),
                 lambda: e.ranks.heartbeat(0, 100)]  # a last heartbeat of the old rank 0, queued late
    plans_before = e.ranks.plans_seen
    after = len(e.plans)
    e.run(1)
    assert not e.service.engine_ready() and e.ranks.plans_seen == plans_before  # no plan for half a group
    e.run_until(lambda: not e.events)
    assert e.service.engine_ready() and e.service.ranks.ready_ranks() == [0, 1]
    # the first plan after the restart: one outage, one crash; the suspects run one at a time
    assert e.first_plan_from(after) == ({"a"}, {"a": 1, "b": 1})
    assert e.service.worker_restarts_total == 2
    finish_and_check(e)
    # the old process is told to exit by its pid, so the new rank 0 does not take it for itself
    assert Shutdown(reason="rank 0 (pid 100) was declared dead", rank=0, pid=100) in e.ranks.shutdowns
    e.close()


def test_a_new_pid_first_then_the_other_rank_is_one_crash(engine: Engine) -> None:
    """The group restarted before the scheduler noticed anything: rank 0's new process announces
    first (its old pid is dead), then rank 1's; every step of the way is the same outage."""
    e = engine
    start(e)
    e.ranks.kill(1)
    e.ranks.kill(0)
    e.events += [lambda: e.ranks.announce(0, 300), lambda: e.ranks.heartbeat(1, 101),
                 lambda: e.ranks.announce(1, 301)]
    after = len(e.plans)
    e.run_until(lambda: not e.events)
    e.run_until(e.service.engine_ready)
    assert e.first_plan_from(after) == ({"a"}, {"a": 1, "b": 1})
    assert e.service.worker_restarts_total == 2
    finish_and_check(e)
    e.close()


def test_a_second_outage_during_the_suspects_step_is_a_second_crash(engine: Engine) -> None:
    """The rule still counts real repeated crashes: the group restarts, the suspect runs again
    alone and the group dies during that step: two crashes, the suspect is ended
    (max_request_crashes 2) with the error naming the cause."""
    e = engine
    e.ranks.announce(0, 100)
    e.ranks.announce(1, 101)
    e.run_until(e.service.engine_ready)
    e.submit("a")
    e.run_until(lambda: len(e.tokens.get("a", [])) >= 3)

    def crash() -> None:
        e.ranks.kill(0)
        e.ranks.kill(1)
        e.events.extend([lambda: e.ranks.announce(0, 300), lambda: e.ranks.announce(1, 301)])

    e.ranks.kill(0)
    e.ranks.kill(1)
    e.events += [lambda: e.ranks.announce(0, 200), lambda: e.ranks.announce(1, 201)]
    e.ranks.crash_on_plan = crash  # the first plan after this restart never gets an answer
    after = len(e.plans)
    e.run_until(lambda: "a" in e.finish)
    assert e.first_plan_from(after) == ({"a"}, {"a": 1})
    assert e.finish["a"] == "error" and "crashed 2 times in a row" in (e.errors["a"] or "")
    assert len(e.tokens["a"]) < MAX_TOKENS
    e.close()


def test_replica_ranks_do_not_restart_as_a_group() -> None:
    """``--num-workers 2`` without tensor parallelism: a rank's death leaves the other one ready."""
    e = Engine(tp=1)
    start(e)
    rank1_goes_silent(e)
    e.run(1)
    assert e.service.ranks.ready_ranks() == [0]
    after = len(e.plans)
    e.events.append(lambda: e.ranks.announce(1, 201))
    e.run_until(e.service.engine_ready)
    assert e.first_plan_from(after) == ({"a"}, {"a": 1, "b": 1})
    finish_and_check(e)
    e.close()
