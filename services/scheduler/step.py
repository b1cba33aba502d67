"""One scheduling step as data: who runs, with how many tokens, and who makes room.

``StepBuilder`` receives the collaborators it decides over and returns its
decisions as a frozen ``StepDecision``; ``Scheduler`` alone applies that value to
its queues, its requests and its counters (``Scheduler._apply``), and
``build_plan`` turns it into the ``StepPlan`` the workers run. The algorithm is
stated at the top of ``StepBuilder.decide``.

What the builder touches:

- mutates the ``BlockLedger`` passed to it: it allocates to learn whether the next
  request fits, and frees a victim's blocks so that the next one can (so the ledger
  already agrees with the decision it returns). Beyond the ledger it only extends a
  request's memo of its own block hashes (``Request.update_block_hashes``) before a
  prefix-cache lookup;
- reads the config, the running list (it works on a copy of its own), the waiting
  queue in policy order (``WaitingQueue.in_order``: nothing is popped or pushed), the
  crash suspects, and the requests' progress;
- returns the tokens per scheduled request, the new block ids of continuing
  requests, the admissions (with their prefix hits and block counts) and the
  preemptions, in the order they were decided.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.config import SchedulerConfig
from shared.messages import CachedRequestData, NewRequestData, StepPlan

from .ledger import BlockLedger, HybridLedger
from .poison import CrashSuspects
from .queues import WaitingQueue
from .request import Request

logger = logging.getLogger("ferry.scheduler")


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request that leaves the queue to run, as decided."""

    req: Request
    resumed: bool  # it ran before (and was preempted): the plan re-sends it in full as resumed
    num_computed_tokens: int  # its prefix-cache hit, in tokens
    num_cached_blocks: int  # the blocks of that hit
    num_blocks: int  # its block table's length after this step's allocation


@dataclass(frozen=True, slots=True)
class StepDecision:
    """Everything one step decided; ``Scheduler._apply`` applies it, ``build_plan`` sends it."""

    now: float
    num_scheduled_tokens: dict[str, int]  # every scheduled request, running ones first (the plan's own)
    new_block_ids: Mapping[str, list[int]]  # running requests that continue ([]: no new block)
    grown: tuple[tuple[Request, int], ...]  # (running request, blocks added to its table)
    admitted: tuple[Admission, ...]  # in admission order (a later preemption may undo one)
    preempted: tuple[Request, ...]  # in preemption order; back to the head of the waiting queue


class StepBuilder:
    """The working state of one step: the budget, the running set as it will be, the decisions."""

    def __init__(
        self,
        config: SchedulerConfig,
        ledger: BlockLedger,
        running: Sequence[Request],
        waiting: WaitingQueue,
        suspects: CrashSuspects,
        now: float,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.waiting = waiting
        self.suspects = suspects
        self.now = now
        self.block_size = config.block_size
        self.priority_policy = config.scheduling_policy == "priority"
        self.running = list(running)  # this step's view: victims leave it, admitted requests join it
        self.budget = config.max_num_batched_tokens
        self.threshold = config.long_prefill_token_threshold
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}  # running requests continuing
        self.grown: list[tuple[Request, int]] = []
        self.admitted: list[Admission] = []
        self.preempted: list[Request] = []

    def decide(self) -> StepDecision:
        """Fill the token budget, preempting when blocks run out. The algorithm, in one place:

        1. Running requests first, in admission order. Each gets
           ``min(num_tokens - num_computed_tokens, long_prefill_token_threshold, budget left)``
           tokens: 1 for a decode, a chunk for a partial prefill. If its blocks cannot
           grow, preempt the victim (lowest priority, then latest arrival; the request
           itself if it is that victim) and retry: the victim's blocks are freed, its
           progress reset, and it goes back to the head of the waiting queue.
        2. Waiting requests in policy order (FCFS, or (priority, arrival)), unless step 1
           preempted (memory is tight: let the running set drain first). A request's
           prefix-cache hit counts as computed (always leaving one token to compute so
           the worker has something to sample from); it then gets a chunk like above.
           Admission stops at the first request that cannot be admitted (no skipping:
           strict policy order), except that under the priority policy a waiting request
           may preempt strictly less important running ones for a seat or for blocks.
        3. The plan (``build_plan``) lists differences only: new and resumed requests in
           full, running ones as (new block ids, computed count), and the ids workers
           must drop.
        """
        self._schedule_running()
        self._schedule_waiting()
        return StepDecision(
            now=self.now,
            num_scheduled_tokens=self.num_scheduled,
            new_block_ids=self.new_block_ids,
            grown=tuple(self.grown),
            admitted=tuple(self.admitted),
            preempted=tuple(self.preempted),
        )

    def _chunk(self, num_remaining: int) -> int:
        n = num_remaining
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.budget)

    # ------------------------------------------------------------------ running

    def _schedule_running(self) -> None:
        running = self.running
        num_scheduled = self.num_scheduled
        new_block_ids = self.new_block_ids
        ledger = self.ledger
        threshold = self.threshold
        budget = self.budget
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            # With a plan in flight (async scheduling) count what it will have computed and
            # sampled; a request whose pending sample reaches its length limit is done.
            computed = req.num_computed_tokens + req.num_ahead_tokens
            num_tokens = req.num_tokens + req.num_ahead_samples
            n = num_tokens - computed
            if req.num_ahead_samples and num_tokens >= req.max_total_tokens:
                n = 0
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            end = computed + n
            ledger.release_behind(req.req_id, computed)  # a hybrid cache: what no window reaches now
            if end <= req.num_token_slots:
                blocks = []  # the common decode: room in its last block
            else:
                self.budget = budget
                grown, num_removed_before = self._grow_or_preempt(req, end, i)
                budget = self.budget
                i -= num_removed_before
                if grown is None:
                    continue  # req preempted itself; running[i] is now the next request
                blocks = grown
            num_scheduled[req.req_id] = n
            new_block_ids[req.req_id] = blocks
            budget -= n
            i += 1
        self.budget = budget

    def _grow_or_preempt(self, req: Request, end: int, index: int) -> tuple[list[int] | None, int]:
        """Grow ``req`` (at ``running[index]``) to ``end`` tokens, preempting victims until
        it fits. Returns (new block ids or None if ``req`` itself was preempted, how many
        preempted requests stood before ``index``)."""
        running = self.running
        allocate = self.ledger.allocate
        num_removed_before = 0
        blocks = allocate(req.req_id, end)
        while blocks is None:
            victim = self._pick_victim()
            if running.index(victim) < index:
                num_removed_before += 1
                index -= 1
            self._preempt(victim)
            if victim is req:
                return None, num_removed_before
            blocks = allocate(req.req_id, end)
        self.grown.append((req, len(blocks)))
        return blocks, num_removed_before

    def _victim_key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.priority_policy else 0, req.seq)

    def _pick_victim(self) -> Request:
        return max(self.running, key=self._victim_key)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and take back what this step gave it; it will wait for a
        full recompute (``Scheduler._apply`` moves it)."""
        self.running.remove(victim)
        self.ledger.free(victim.req_id)
        logger.info("request preempted", extra={
            "req_id": victim.req_id, "num_preemptions": victim.num_preemptions + 1,
            "num_free_blocks": self.ledger.num_free_blocks,
        })
        self.preempted.append(victim)
        n = self.num_scheduled.pop(victim.req_id, None)
        if n is not None:
            self.budget += n  # give back what it was given earlier in this step
            self.new_block_ids.pop(victim.req_id, None)

    # ------------------------------------------------------------------ waiting

    def _schedule_waiting(self) -> None:
        if self.preempted:
            return
        max_num_seqs = self.config.max_num_seqs
        suspects = self.suspects
        candidates = self.waiting.in_order()
        req = next(candidates, None)
        while self.budget > 0:
            if req is None or self._victim_ahead_of(req):
                return
            if suspects and not suspects.may_admit(req.req_id, (r.req_id for r in self.running)):
                return  # poison.py: suspects of a worker crash run one at a time
            if len(self.running) >= max_num_seqs and not self._preempt_for(req):
                return
            outcome = self._admit(req)
            if outcome == "blocks" and self._preempt_for(req):
                continue  # retry with the victim's blocks freed
            if outcome != "ok":
                return
            req = next(candidates, None)

    def _victim_ahead_of(self, req: Request) -> bool:
        """Whether a request preempted in this step would now be the queue's head (a
        victim is not re-admitted in the step that preempted it: admission stops)."""
        waiting = self.waiting
        return any(waiting.pushed_back_before(victim, req) for victim in self.preempted)

    def _preempt_for(self, req: Request) -> bool:
        """Priority policy: preempt the least important running request if it is less
        important than ``req``. True if one was preempted."""
        if not self.priority_policy or not self.running:
            return False
        victim = self._pick_victim()
        if victim.priority <= req.priority:
            return False
        self._preempt(victim)
        return True

    def _admit(self, req: Request) -> str:
        """Give ``req`` its first chunk and count it as running.

        Returns "ok", "budget" (without chunked prefill the step has no room for the
        whole prompt) or "blocks" (not enough free KV blocks)."""
        ledger = self.ledger
        block_size = self.block_size
        config = self.config
        hits: list[int] = []
        if ledger.enable_prefix_caching:
            req.update_block_hashes(block_size)
            # At least one token must be computed: the worker samples from its logits.
            hits = ledger.lookup(req.block_hashes, req.block_keys, (req.num_tokens - 1) // block_size)
        num_computed = len(hits) * block_size
        remaining = req.num_tokens - num_computed
        if not config.enable_chunked_prefill and self.budget < remaining <= config.max_num_batched_tokens:
            # Without chunking, wait for a step with room for all of it. (A resumed request
            # longer than a whole step can never get one, so it is chunked anyway.)
            return "budget"
        n = self._chunk(remaining)
        blocks = ledger.allocate(req.req_id, num_computed + n, hits)
        if blocks is None:
            return "blocks"
        resumed = req.first_scheduled_time is not None
        self.admitted.append(Admission(req, resumed, num_computed, len(hits), len(blocks)))
        self.running.append(req)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request admitted", extra={
                "req_id": req.req_id, "resumed": resumed, "num_cached_tokens": num_computed,
                "queue_s": round(self.now - req.arrival_time, 4),
            })
        self.num_scheduled[req.req_id] = n
        self.budget -= n
        return "ok"


def build_plan(
    decision: StepDecision,
    step_id: int,
    ledger: BlockLedger,
    requests: Mapping[str, Request],
    finished_ids: list[str],
    preempted_ids: list[str],
) -> StepPlan:
    """The plan of an applied decision: differences only (reads the ledger's tables; takes the
    windowed layers' new blocks a hybrid ledger kept for it)."""
    block_tables = ledger.block_tables
    hybrid = ledger if isinstance(ledger, HybridLedger) else None
    dropped = {r.req_id for r in decision.preempted}
    new_requests: list[NewRequestData] = []
    resumed_requests: list[NewRequestData] = []
    for admission in decision.admitted:
        req = admission.req
        if req.req_id in dropped:
            continue  # admitted, then preempted for a more important request
        data = NewRequestData(
            req.req_id, req.prompt_token_ids, req.sampling, list(block_tables[req.req_id]),
            admission.num_computed_tokens, req.output_token_ids,
            window_block_ids=list(hybrid.window_table(req.req_id)) if hybrid is not None else [],
        )
        if hybrid is not None:
            hybrid.take_new_window_ids(req.req_id)  # in the table just sent
        (resumed_requests if admission.resumed else new_requests).append(data)
    # The computed count the worker will hold when it runs this plan (after any plan
    # still in flight): it checks the count against its own state.
    cached_requests = [
        CachedRequestData(req_id, blocks, (r := requests[req_id]).num_computed_tokens + r.num_ahead_tokens,
                          hybrid.take_new_window_ids(req_id) if hybrid is not None else [])
        for req_id, blocks in decision.new_block_ids.items()
    ]
    num_scheduled = decision.num_scheduled_tokens
    return StepPlan(
        step_id=step_id,
        new_requests=new_requests,
        cached_requests=cached_requests,
        resumed_requests=resumed_requests,
        preempted_req_ids=preempted_ids,
        finished_req_ids=finished_ids,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
    )
