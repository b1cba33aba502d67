"""One scheduling step: fill the token budget, preempt when blocks run out, build the plan.

The algorithm, in one place:

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
3. The plan lists differences only: new and resumed requests in full, running
   ones as (new block ids, computed count), and the ids workers must drop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shared.messages import CachedRequestData, NewRequestData, StepPlan

from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .scheduler import Scheduler

logger = logging.getLogger("ferry.scheduler")


class StepBuilder:
    """The mutable state of one ``Scheduler.schedule()`` call."""

    def __init__(self, sched: Scheduler, now: float) -> None:
        self.sched = sched
        self.now = now
        self.budget = sched.config.max_num_batched_tokens
        self.threshold = sched.config.long_prefill_token_threshold
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}  # running requests continuing
        self.admitted: list[tuple[Request, bool]] = []  # (request, resumed) admitted this step
        self.preempted: set[str] = set()

    def _chunk(self, num_remaining: int) -> int:
        n = num_remaining
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.budget)

    # ------------------------------------------------------------------ running

    def schedule_running(self) -> None:
        running = self.sched.running
        num_scheduled = self.num_scheduled
        new_block_ids = self.new_block_ids
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
        running = self.sched.running
        allocate = self.sched.ledger.allocate
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
        req.num_token_slots += len(blocks) * self.sched.block_size
        return blocks, num_removed_before

    def _victim_key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.sched.priority_policy else 0, req.seq)

    def _pick_victim(self) -> Request:
        return max(self.sched.running, key=self._victim_key)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and send it back to wait for a full recompute."""
        sched = self.sched
        sched.running.remove(victim)
        sched.ledger.free(victim.req_id)
        victim.status = RequestStatus.WAITING
        victim.reset_progress()
        victim.num_preemptions += 1
        sched.counters.num_preemptions += 1
        logger.info("request preempted", extra={
            "req_id": victim.req_id, "num_preemptions": victim.num_preemptions,
            "num_free_blocks": sched.ledger.num_free_blocks,
        })
        if victim.known_to_worker:
            sched._preempted_for_worker.append(victim.req_id)
            victim.known_to_worker = False
        sched._push_waiting(victim, preempted=True)
        self.preempted.add(victim.req_id)
        n = self.num_scheduled.pop(victim.req_id, None)
        if n is not None:
            self.budget += n  # give back what it was given earlier in this step
            self.new_block_ids.pop(victim.req_id, None)

    # ------------------------------------------------------------------ waiting

    def schedule_waiting(self) -> None:
        sched = self.sched
        if self.preempted:
            return
        max_num_seqs = sched.config.max_num_seqs
        while self.budget > 0:
            req = sched.waiting.peek()
            if req is None or req.req_id in self.preempted:
                return
            if sched.suspects and not sched.suspects.may_admit(req.req_id, (r.req_id for r in sched.running)):
                return  # poison.py: suspects of a worker crash run one at a time
            if len(sched.running) >= max_num_seqs and not self._preempt_for(req):
                return
            outcome = self._admit(req)
            if outcome == "blocks" and self._preempt_for(req):
                continue  # retry with the victim's blocks freed
            if outcome != "ok":
                return

    def _preempt_for(self, req: Request) -> bool:
        """Priority policy: preempt the least important running request if it is less
        important than ``req``. True if one was preempted."""
        sched = self.sched
        if not sched.priority_policy or not sched.running:
            return False
        victim = self._pick_victim()
        if victim.priority <= req.priority:
            return False
        self._preempt(victim)
        return True

    def _admit(self, req: Request) -> str:
        """Give ``req`` its first chunk and move it to running.

        Returns "ok", "budget" (without chunked prefill the step has no room for the
        whole prompt) or "blocks" (not enough free KV blocks)."""
        sched = self.sched
        ledger = sched.ledger
        block_size = sched.block_size
        hits: list[int] = []
        if ledger.enable_prefix_caching:
            req.update_block_hashes(block_size)
            # At least one token must be computed: the worker samples from its logits.
            hits = ledger.lookup(req.block_hashes, req.block_keys, (req.num_tokens - 1) // block_size)
        num_computed = len(hits) * block_size
        remaining = req.num_tokens - num_computed
        if not sched.config.enable_chunked_prefill and self.budget < remaining <= sched.config.max_num_batched_tokens:
            # Without chunking, wait for a step with room for all of it. (A resumed request
            # longer than a whole step can never get one, so it is chunked anyway.)
            return "budget"
        n = self._chunk(remaining)
        blocks = ledger.allocate(req.req_id, num_computed + n, hits)
        if blocks is None:
            return "blocks"
        popped = sched._pop_waiting()
        assert popped is req, f"admitted {req} but the queue head was {popped}"
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        req.num_token_slots = len(blocks) * block_size
        req.num_cached_blocks = len(hits)
        sched.running.append(req)
        counters = sched.counters
        counters.record_drain(self.now)
        if ledger.enable_prefix_caching:
            counters.prefix_cache_queries += req.num_tokens
            counters.prefix_cache_hits += num_computed
        resumed = req.first_scheduled_time is not None
        if not resumed:
            req.first_scheduled_time = self.now
            req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
        self.admitted.append((req, resumed))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request admitted", extra={
                "req_id": req.req_id, "resumed": resumed, "num_cached_tokens": num_computed,
                "queue_s": round(self.now - req.arrival_time, 4),
            })
        self.num_scheduled[req.req_id] = n
        self.budget -= n
        return "ok"

    # ------------------------------------------------------------------ the plan

    def build_plan(self, step_id: int, finished_ids: list[str], preempted_ids: list[str]) -> StepPlan:
        sched = self.sched
        tables = sched.ledger.block_tables
        new_requests: list[NewRequestData] = []
        resumed_requests: list[NewRequestData] = []
        for req, resumed in self.admitted:
            if req.status is not RequestStatus.RUNNING:
                continue  # admitted, then preempted for a more important request
            data = NewRequestData(
                req.req_id, req.prompt_token_ids, req.sampling, list(tables[req.req_id]),
                req.num_computed_tokens, req.output_token_ids,
            )
            (resumed_requests if resumed else new_requests).append(data)
            req.known_to_worker = True
        requests = sched.requests
        # The computed count the worker will hold when it runs this plan (after any plan
        # still in flight): it checks the count against its own state.
        cached_requests = [
            CachedRequestData(req_id, blocks, (r := requests[req_id]).num_computed_tokens + r.num_ahead_tokens)
            for req_id, blocks in self.new_block_ids.items()
        ]
        return StepPlan(
            step_id=step_id,
            new_requests=new_requests,
            cached_requests=cached_requests,
            resumed_requests=resumed_requests,
            preempted_req_ids=preempted_ids,
            finished_req_ids=finished_ids,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
        )
