"""A deterministic fake worker for driving the scheduler without a model.

``FakeWorker`` follows step plans with the same semantics as the real worker
(persistent per-request state, new/resumed requests in full, cached requests as
differences, drop finished and preempted ids first) and "samples" a token that
depends only on the request id and the position, so a request produces the same
tokens however often it is preempted and recomputed.

With ``check=True`` it also simulates the physical KV cache: every computed
position writes its token id into its slot, and before each computation it
verifies that every earlier position of the request is in its block table with
the right token. That catches wrong block ids, a prefix-cache hit on the wrong
content, a shared block being overwritten, or a plan that disagrees with what
the worker holds. ``check=False`` keeps only what sampling needs (benchmarks).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.messages import (
    AddRequest,
    NewRequestData,
    RequestDelta,
    SamplingParams,
    StepPlan,
    StepResult,
    StopParams,
)

TokenFn = Callable[[str, int], int]
VOCAB = 1000


def default_token(req_id: str, position: int) -> int:
    """A token id in [10, VOCAB) from (request id, position): never a small "special" id."""
    return 10 + (zlib.crc32(req_id.encode()) * 31 + position * 7919) % (VOCAB - 10)


@dataclass
class FakeRequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeWorker:
    block_size: int
    num_blocks: int
    token_fn: TokenFn = default_token
    check: bool = True
    requests: dict[str, FakeRequestState] = field(default_factory=dict)
    # physical KV: block id -> token id per slot (None: never written)
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    holders: dict[int, set[str]] = field(default_factory=dict)
    num_steps: int = 0
    forgotten: set[str] = field(default_factory=set)  # held before a restart: the next plan may name them

    def _add(self, data: NewRequestData) -> None:
        assert data.req_id not in self.requests, f"{data.req_id} added twice without being dropped"
        state = FakeRequestState(
            data.req_id, list(data.prompt_token_ids) + list(data.output_token_ids),
            list(data.block_ids), data.num_computed_tokens,
        )
        assert state.num_computed_tokens < len(state.token_ids), f"{data.req_id}: nothing left to compute"
        self.requests[data.req_id] = state
        if self.check:
            for b in data.block_ids:
                self.holders.setdefault(b, set()).add(data.req_id)

    def _drop(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None and self.check:
            for b in state.block_ids:
                self.holders[b].discard(req_id)

    def _compute(self, state: FakeRequestState, n: int) -> None:
        """Check the request's KV so far, then write ``n`` more positions."""
        bs = self.block_size
        start = state.num_computed_tokens
        assert (start + n) <= len(state.block_ids) * bs, (
            f"{state.req_id}: {start + n} tokens need more than its {len(state.block_ids)} blocks"
        )
        assert start + n <= len(state.token_ids), f"{state.req_id}: scheduled past its last token"
        for b in state.block_ids:
            assert 0 <= b < self.num_blocks, f"{state.req_id}: block id {b} out of range"
        if not self.check:
            return
        for pos in range(start):
            block = self.kv.get(state.block_ids[pos // bs])
            got = block[pos % bs] if block is not None else None
            assert got == state.token_ids[pos], (
                f"{state.req_id}: KV at position {pos} (block {state.block_ids[pos // bs]}) holds {got}, "
                f"expected {state.token_ids[pos]}"
            )
        for pos in range(start, start + n):
            block_id = state.block_ids[pos // bs]
            others = self.holders.get(block_id, set()) - {state.req_id}
            assert not others, f"{state.req_id} writes block {block_id} that {others} also hold"
            self.kv.setdefault(block_id, [None] * bs)[pos % bs] = state.token_ids[pos]

    def step(self, plan: StepPlan) -> StepResult:
        """Run one plan: the same order of updates as the real worker's batch state."""
        self.num_steps += 1
        for req_id in plan.finished_req_ids:
            self._drop(req_id)
        for req_id in plan.preempted_req_ids:
            assert req_id in self.requests or req_id in self.forgotten, f"preempted {req_id} is unknown to the worker"
            self._drop(req_id)
        self.forgotten.clear()
        for data in plan.new_requests:
            assert data.num_computed_tokens % self.block_size == 0, "a prefix hit must be whole blocks"
            self._add(data)
        for data in plan.resumed_requests:
            self._add(data)
        for cached in plan.cached_requests:
            state = self.requests.get(cached.req_id)
            assert state is not None, f"step {plan.step_id}: cached {cached.req_id} is unknown to the worker"
            assert cached.num_computed_tokens == state.num_computed_tokens, (
                f"{cached.req_id}: plan says {cached.num_computed_tokens} computed, worker has "
                f"{state.num_computed_tokens}"
            )
            state.block_ids.extend(cached.new_block_ids)
            if self.check:
                for b in cached.new_block_ids:
                    self.holders.setdefault(b, set()).add(cached.req_id)
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
        req_ids: list[str] = []
        sampled: list[int] = []
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            assert state is not None, f"step {plan.step_id}: scheduled {req_id} is unknown to the worker"
            assert n > 0, f"{req_id}: scheduled {n} tokens"
            self._compute(state, n)
            state.num_computed_tokens += n
            if state.num_computed_tokens == len(state.token_ids):
                token = self.token_fn(req_id, len(state.token_ids))
                state.token_ids.append(token)
                req_ids.append(req_id)
                sampled.append(token)
        return StepResult(step_id=plan.step_id, rank=0, req_ids=req_ids, sampled_token_ids=sampled)

    def restart(self) -> None:
        """A fresh process: nothing held, KV contents gone."""
        self.forgotten = set(self.requests)
        self.requests.clear()
        self.kv.clear()
        self.holders.clear()


def expected_tokens(
    req_id: str, num_prompt: int, max_tokens: int, token_fn: TokenFn = default_token,
    stop_ids: frozenset[int] = frozenset(), min_tokens: int = 0,
) -> list[int]:
    """The tokens a request produces with ``token_fn`` and no interference (the reference)."""
    out: list[int] = []
    while len(out) < max_tokens:
        token = token_fn(req_id, num_prompt + len(out))
        out.append(token)
        if token in stop_ids and len(out) >= min_tokens:
            break
    return out


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 8,
    *,
    gateway_id: str = "g0",
    priority: int = 0,
    eos: list[int] | None = None,
    stop_ids: list[int] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    queue_timeout_s: float | None = None,
    arrival_time: float = 0.0,
) -> AddRequest:
    """An ``AddRequest``; an int prompt means that many distinct tokens derived from the id."""
    if isinstance(prompt, int):
        base = zlib.crc32(req_id.encode()) % 50_000
        prompt = [100_000 + base * 1000 + i for i in range(prompt)]
    return AddRequest(
        req_id=req_id, gateway_id=gateway_id, prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        stop=StopParams(
            max_tokens=max_tokens, min_tokens=min_tokens, eos_token_ids=eos or [],
            stop_token_ids=stop_ids or [], ignore_eos=ignore_eos,
        ),
        priority=priority, arrival_time=arrival_time, queue_timeout_s=queue_timeout_s,
    )


def small_config(**overrides: object) -> SchedulerConfig:
    """A scheduler config small enough for hand-checked tests."""
    values: dict[str, object] = dict(
        max_num_batched_tokens=64, max_num_seqs=8, block_size=4, max_waiting_requests=100,
        queue_timeout_s=0.0,
    )
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


class FakeClock:
    """A clock tests advance by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Outcome:
    """What a gateway saw of one request."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    deltas: list[RequestDelta] = field(default_factory=list)


class Driver:
    """Runs the step loop of a ``Scheduler`` against a ``FakeWorker`` and records outcomes."""

    def __init__(self, sched: Scheduler, worker: FakeWorker, check_invariants: bool = True) -> None:
        self.sched = sched
        self.worker = worker
        self.check_invariants = check_invariants
        self.outcomes: dict[str, Outcome] = {}
        self.plans: list[StepPlan] = []
        self.first_token_step: dict[str, int] = {}  # req id -> index of the step that sampled its first token

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        budget = self.sched.config.max_num_batched_tokens
        assert plan.total_num_scheduled_tokens <= budget, f"step {plan.step_id} exceeds the budget"
        assert len(plan.num_scheduled_tokens) <= self.sched.config.max_num_seqs
        result = self.worker.step(plan)
        self.sched.update_from_result(plan, result)
        self.collect()
        if self.check_invariants:
            self.sched.check_invariants()
        self.plans.append(plan)
        return plan

    def collect(self) -> None:
        for deltas in self.sched.take_deltas().values():
            for delta in deltas:
                out = self.outcomes.setdefault(delta.req_id, Outcome())
                assert out.finish_reason is None, f"{delta.req_id} got a delta after finishing"
                if delta.new_token_ids and not out.token_ids:
                    self.first_token_step[delta.req_id] = len(self.plans)
                out.token_ids.extend(delta.new_token_ids)
                out.finish_reason = delta.finish_reason
                out.deltas.append(delta)

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; returns the number of steps."""
        for i in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return i
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
