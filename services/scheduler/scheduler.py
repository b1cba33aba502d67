"""The scheduling core: queues, the token budget, preemption, and the step plan.

``Scheduler`` is a plain object with no sockets and no threads: the scheduler
service (``service.py``) feeds it requests and worker results, and tests drive it
with a fake worker at thousands of steps a second. One step is::

    plan = scheduler.schedule()             # what every worker rank runs
    result = <worker runs plan>             # StepResult: sampled token ids
    scheduler.update_from_result(plan, result)
    deltas = scheduler.take_deltas()        # per gateway: tokens, finishes, aborts

The core imports neither torch nor anything of the network.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import msgspec

from shared.config import SchedulerConfig
from shared.messages import (
    AddRequest,
    EngineStats,
    RequestDelta,
    RequestRejected,
    SampleLogprobs,
    StepPlan,
    StepResult,
)

from .admission import check_queue, check_request
from .ledger import BlockLedger, HybridLedger
from .poison import CrashSuspects
from .queues import DeadlineHeap, make_waiting_queue
from .request import Request, RequestStatus
from .stats import SchedulerCounters, build_stats
from .step import StepBuilder, StepDecision, build_plan

logger = logging.getLogger("ferry.scheduler")


class Scheduler:
    """Continuous batching over a paged KV block ledger (see docs/architecture.md)."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
        window: int = 0,
        num_window_blocks: int = 0,
    ) -> None:
        """``window`` and ``num_window_blocks``: a hybrid KV cache (shared.capacity.HybridKV),
        whose windowed layers keep only what their window reaches (ledger.py's HybridLedger)."""
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.config = config
        self.max_model_len = max_model_len
        self.clock = clock
        self.block_size = config.block_size
        self.ledger: BlockLedger
        if window and num_window_blocks:
            if config.enable_prefix_caching:
                logger.info("prefix caching off: the model's windowed layers keep only their window (hybrid KV cache)")
            self.ledger = HybridLedger(num_kv_blocks, config.block_size, window, num_window_blocks)
        else:
            self.ledger = BlockLedger(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []  # admission order
        self.deadlines = DeadlineHeap()
        self.num_waiting_tokens = 0
        self.counters = SchedulerCounters(clock())
        self._seq = 0
        self._step_id = 0
        self._plan_time: dict[int, float] = {}  # step id -> when its plan was made
        self._finished_for_worker: list[str] = []  # worker-held ids finished since the last plan
        self._preempted_for_worker: list[str] = []  # worker-held ids preempted since the last plan
        self._deltas: defaultdict[str, list[RequestDelta]] = defaultdict(list)
        self.suspects = CrashSuspects(config.max_request_crashes)  # poison requests (poison.py)
        self._config_strs = {k: str(v) for k, v in _config_items(config)}
        self._config_strs.update(num_kv_blocks=str(num_kv_blocks), max_model_len=str(max_model_len))
        if isinstance(self.ledger, HybridLedger):
            self._config_strs.update(window=str(window), num_window_blocks=str(num_window_blocks))

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ inputs

    def add_request(self, req: AddRequest) -> RequestRejected | None:
        """Queue a request, or say why not (the caller sends the refusal)."""
        now = self.clock()
        capacity = self.ledger.num_total_blocks * self.block_size
        rejected = check_request(req, self.config, self.max_model_len, capacity, req.req_id in self.requests)
        if rejected is None:
            rejected = check_queue(
                req, self.config, len(self.waiting), self.num_waiting_tokens, self.counters.drain_rate(now)
            )
        if rejected is not None:
            self.counters.rejected[rejected.reason] += 1
            logger.info(
                "request rejected", extra={"req_id": req.req_id, "reason": rejected.reason, "detail": rejected.message}
            )
            return rejected
        timeout = req.queue_timeout_s if req.queue_timeout_s is not None else self.config.queue_timeout_s
        if timeout > 0:
            deadline = now + max(timeout, self.config.min_queue_timeout_s)
        else:
            deadline = float("inf")  # queue_timeout_s 0: wait as long as it takes
        self._seq += 1
        request = Request(req, self._seq, req.arrival_time or now, deadline, self.max_model_len)
        self.requests[req.req_id] = request
        self._push_waiting(request)
        if deadline != float("inf"):
            self.deadlines.push(request)
        return None

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort waiting or running requests now; unknown (or finished) ids are ignored."""
        now = self.clock()
        aborted_running = False
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            aborted_running |= req.status is RequestStatus.RUNNING
            self._finish(req, "abort", now)
        if aborted_running:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def abort_gateway(self, gateway_id: str) -> int:
        """Abort every request a (dead) gateway owns; returns how many."""
        ids = [r.req_id for r in self.requests.values() if r.gateway_id == gateway_id]
        # The abort deltas stay queued: if the gateway was only slow, it learns what happened.
        self.abort_requests(ids)
        return len(ids)

    def preempt_all(self) -> None:
        """A worker restarted: recompute every running request from scratch.

        Every running request goes back to the waiting queue and will be re-sent in
        full. Its id is still listed in the next plan's ``preempted_req_ids`` (and
        pending finishes stay in ``finished_req_ids``) so that ranks which did *not*
        restart drop their copies; a restarted rank ignores ids it does not know.
        """
        present = [r.req_id for r in self.running]
        # Back to the head of the queue in arrival order, ahead of everything never started.
        for req in sorted(self.running, key=lambda r: r.seq, reverse=True):
            self.ledger.free(req.req_id)
            req.status = RequestStatus.WAITING
            req.reset_progress()
            if req.known_to_worker:
                self._preempted_for_worker.append(req.req_id)
                req.known_to_worker = False
            self._push_waiting(req, preempted=True)
        self.running = []
        # The restarted worker's KV tensors hold nothing: cached hashes would point at garbage.
        self.ledger.reset_prefix_cache()
        self._plan_time.clear()
        now = self.clock()
        for req_id in self.suspects.on_crash(present):  # poison.py: likely the cause of the crashes
            logger.warning("request ended as a likely cause of worker crashes", extra={"req_id": req_id})
            self._finish(self.requests[req_id], "error", now,
                         error=self.suspects.message(self.suspects.max_request_crashes))

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepPlan:
        """Expire, decide the step (``StepBuilder.decide`` states the algorithm), apply it, plan it."""
        now = self.clock()
        for req in self.deadlines.pop_expired(now):
            waited = now - req.arrival_time
            self._finish(req, "timeout", now, error=f"the request waited {waited:.1f}s in the queue without starting")
        decision = StepBuilder(self.config, self.ledger, self.running, self.waiting, self.suspects, now).decide()
        self._apply(decision)
        self._step_id += 1
        plan = build_plan(
            decision, self._step_id, self.ledger, self.requests,
            self._finished_for_worker, self._preempted_for_worker,
        )
        self._finished_for_worker = []
        self._preempted_for_worker = []
        if plan.total_num_scheduled_tokens:
            self.counters.record_step(plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens))
            self._plan_time[plan.step_id] = now
            self._mark_ahead(plan)
        return plan

    def _apply(self, decision: StepDecision) -> None:
        """Move the step's admitted and preempted requests and set their progress (the
        ledger already holds their blocks: the builder allocated and freed them)."""
        now = decision.now
        block_size = self.block_size
        counters = self.counters
        caching = self.ledger.enable_prefix_caching
        for admission in decision.admitted:
            req = self._pop_waiting()
            assert req is admission.req, f"admitted {admission.req} but the queue head was {req}"
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = admission.num_computed_tokens
            req.num_token_slots = admission.num_blocks * block_size
            req.num_cached_blocks = admission.num_cached_blocks
            counters.record_drain(now)
            if caching:
                counters.prefix_cache_queries += req.num_tokens
                counters.prefix_cache_hits += admission.num_computed_tokens
            if not admission.resumed:
                req.first_scheduled_time = now
                req.num_cached_tokens = min(admission.num_computed_tokens, req.num_prompt_tokens)
        for req, num_new_blocks in decision.grown:
            req.num_token_slots += num_new_blocks * block_size
        for victim in decision.preempted:  # its blocks are free: it waits for a full recompute
            victim.status = RequestStatus.WAITING
            victim.reset_progress()
            victim.num_preemptions += 1
            counters.num_preemptions += 1
            if victim.known_to_worker:
                self._preempted_for_worker.append(victim.req_id)
                victim.known_to_worker = False
            self._push_waiting(victim, preempted=True)
        if decision.preempted:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        for admission in decision.admitted:
            req = admission.req
            if req.status is RequestStatus.RUNNING:  # not preempted later in the same step
                self.running.append(req)
                req.known_to_worker = True  # the plan sends it in full

    def _mark_ahead(self, plan: StepPlan) -> None:
        """Count the plan's tokens as in flight until its result is applied, so that a plan
        made before then (async scheduling) continues where this one will leave off."""
        requests = self.requests
        for req_id, n in plan.num_scheduled_tokens.items():
            req = requests[req_id]
            computed = req.num_computed_tokens + req.num_ahead_tokens + n
            req.num_ahead_tokens += n
            if computed == req.num_tokens + req.num_ahead_samples:
                req.num_ahead_samples += 1  # this plan samples its next token

    def update_from_result(self, plan: StepPlan, result: StepResult) -> None:
        """Advance computed counts, append sampled tokens, apply stop conditions.

        Tolerant by design: requests aborted or preempted while the step ran, and
        plans from before a ``preempt_all``, are skipped. This is the hot path (once
        per running request per step), hence the inlined common case.
        """
        started = self._plan_time.pop(plan.step_id, None)
        if started is None:
            return  # an empty step, or one abandoned by preempt_all
        now = self.clock()
        self.counters.record_step_duration(now - started)
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=False))
        logprobs: dict[str, SampleLogprobs | None] = (
            dict(zip(result.req_ids, result.logprobs, strict=False)) if result.logprobs else {}
        )
        requests = self.requests
        block_size = self.block_size
        caching = self.ledger.enable_prefix_caching
        deltas = self._deltas
        running_status = RequestStatus.RUNNING
        num_generated = 0
        any_finished = False
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is None or req.status is not running_status:
                continue
            computed = req.num_computed_tokens + num_scheduled
            req.num_computed_tokens = computed
            req.num_ahead_tokens -= num_scheduled
            if caching and computed // block_size > req.num_cached_blocks:
                self._cache_computed_blocks(req)
            if computed < req.num_tokens:
                continue  # a partial prefill chunk: nothing sampled
            req.num_ahead_samples -= 1
            token_id = sampled.get(req_id)
            if token_id is None:
                self._finish(req, "error", now, error=f"the worker returned no token in step {plan.step_id}")
                any_finished = True
                continue
            num_generated += 1
            lp = logprobs.get(req_id) if logprobs else None
            req.all_token_ids.append(token_id)
            req.num_tokens += 1
            if req.sent_first_delta and token_id not in req.stop_check_ids and req.num_tokens < req.max_total_tokens:
                # The common case: a decode that goes on.
                deltas[req.gateway_id].append(RequestDelta(req_id, [token_id], [lp] if lp is not None else None))
                continue
            any_finished |= self._on_token(req, token_id, lp, now)
        self.counters.generation_tokens += num_generated
        if self.suspects:
            self.suspects.on_step_done(plan.num_scheduled_tokens)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def _cache_computed_blocks(self, req: Request) -> None:
        req.update_block_hashes(self.block_size)
        self.ledger.cache_blocks(req.req_id, req.block_hashes, req.block_keys, req.num_computed_tokens)
        req.num_cached_blocks = req.num_computed_tokens // self.block_size

    def _on_token(self, req: Request, token_id: int, logprob: SampleLogprobs | None, now: float) -> bool:
        """Emit the delta of a token just appended (first token or stop); True if the request finished."""
        stop = req.check_stop(token_id)
        first = not req.sent_first_delta
        if first:
            req.sent_first_delta = True
            req.first_token_time = now
            self.counters.prompt_tokens += req.num_prompt_tokens
        lps = [logprob] if logprob is not None else None
        if stop is None:
            if first:
                delta = RequestDelta(
                    req.req_id, [token_id], lps, num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens, timings=req.timings(),
                )
            else:
                delta = RequestDelta(req.req_id, [token_id], lps)
            self._deltas[req.gateway_id].append(delta)
            return False
        reason, stop_token_id = stop
        self._finish(req, reason, now, new_token_ids=[token_id], logprobs=lps, stop_token_id=stop_token_id, first=first)
        return True

    def _finish(
        self,
        req: Request,
        reason: str,
        now: float,
        *,
        new_token_ids: list[int] | None = None,
        logprobs: list[SampleLogprobs] | None = None,
        stop_token_id: int | None = None,
        error: str | None = None,
        first: bool = False,
    ) -> None:
        """End a request for any reason: free its blocks, tell its gateway and the workers."""
        if req.status is RequestStatus.WAITING:
            req.status = RequestStatus.FINISHED
            self.waiting.discard(req)
            self.num_waiting_tokens -= req.num_tokens
        else:
            req.status = RequestStatus.FINISHED
            self.ledger.free(req.req_id)
        req.finish_reason = reason
        del self.requests[req.req_id]
        if self.suspects:
            self.suspects.forget(req.req_id)
        if req.known_to_worker:
            self._finished_for_worker.append(req.req_id)
            req.known_to_worker = False
        self.counters.finished[reason] += 1
        # Normal ends are DEBUG (one line per request at high rates); the others say why.
        level = logging.DEBUG if reason in ("stop", "length") else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "request finished", extra={
                "req_id": req.req_id, "finish_reason": reason, "num_prompt_tokens": req.num_prompt_tokens,
                "num_output_tokens": req.num_tokens - req.num_prompt_tokens,
                "num_preemptions": req.num_preemptions, "detail": error,
            })
        delta = RequestDelta(
            req.req_id, new_token_ids or [], logprobs, finish_reason=reason, stop_token_id=stop_token_id,
            num_prompt_tokens=req.num_prompt_tokens if first else 0,
            num_cached_tokens=req.num_cached_tokens if first else 0,
            timings=req.timings(finished_time=now), error=error,
        )
        self._deltas[req.gateway_id].append(delta)

    # ------------------------------------------------------------------ the waiting queue and its token count

    def _push_waiting(self, req: Request, preempted: bool = False) -> None:
        if preempted:
            self.waiting.push_preempted(req)
        else:
            self.waiting.push(req)
        self.num_waiting_tokens += req.num_tokens

    def _pop_waiting(self) -> Request:
        req = self.waiting.pop()
        self.num_waiting_tokens -= req.num_tokens
        return req

    # ------------------------------------------------------------------ outputs

    def take_deltas(self) -> dict[str, list[RequestDelta]]:
        """Everything produced since the last call, by gateway id."""
        deltas = dict(self._deltas)
        self._deltas = defaultdict(list)
        return deltas

    def stats(self) -> EngineStats:
        """A snapshot for gateways; clears the per-step samples since the previous call."""
        return build_stats(
            self.counters, self.clock(), self.running, self.waiting, len(self.waiting),
            *self.ledger.pressure(), self._config_strs,
        )

    def check_invariants(self) -> None:
        """Assert the ledger and the queues agree. O(everything): for tests and debug runs."""
        self.ledger.check_invariants()
        running_ids = {r.req_id for r in self.running}
        assert len(running_ids) == len(self.running), "a request is twice in the running list"
        assert len(self.running) <= self.config.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        assert set(self.ledger.block_tables) == running_ids, (
            f"block tables {sorted(self.ledger.block_tables)} != running {sorted(running_ids)}"
        )
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, f"{req} in the running list"
            assert req.num_ahead_tokens >= 0 and req.num_ahead_samples >= 0, f"{req}: negative tokens in flight"
            if not self._plan_time:
                assert req.num_ahead_tokens == req.num_ahead_samples == 0, f"{req}: in flight with no plan out"
            table = self.ledger.block_tables[req.req_id]
            assert len(table) * self.block_size >= req.num_computed_tokens, f"{req} outgrew its blocks {table}"
            assert req.num_token_slots == len(table) * self.block_size, f"{req}: stale slot count"
            assert req.num_computed_tokens <= req.num_tokens, f"{req} computed more than it has"
        waiting = list(self.waiting)
        assert len(waiting) == len(self.waiting), f"waiting queue counts {len(self.waiting)}, holds {len(waiting)}"
        for req in waiting:
            assert req.num_computed_tokens == 0, f"{req} waits with computed tokens"
        assert self.num_waiting_tokens == sum(r.num_tokens for r in waiting), "waiting token count drifted"
        all_ids = running_ids | {r.req_id for r in waiting}
        assert all_ids == set(self.requests), (
            f"requests neither running nor waiting: {set(self.requests) - all_ids}"
        )


def _config_items(config: SchedulerConfig) -> list[tuple[str, object]]:
    return [(f.name, getattr(config, f.name)) for f in msgspec.structs.fields(config)]
