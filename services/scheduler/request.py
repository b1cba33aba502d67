"""One request as the scheduler sees it: tokens, progress, limits and timings.

A request has ``num_tokens`` (prompt plus outputs so far) and
``num_computed_tokens`` (tokens whose KV the worker holds). Scheduling assigns
tokens to close that gap; there is no separate prefill or decode phase::

    prompt_token_ids            output_token_ids
    |p0 p1 p2 p3 p4 p5 p6 p7 | o0 o1 o2 |
    |<---- num_computed_tokens ---->|   |      a step computes the gap and the
    |<------------- num_tokens -------->|      worker samples the next token

Stop conditions on token ids live here too (``check_stop``): they need only the
request's own state.
"""

from __future__ import annotations

import enum

from shared.messages import AddRequest, RequestSummary, RequestTimings, SamplingParams, StopParams

from .ledger import BlockKey, extend_block_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutable scheduler-side state of one request."""

    __slots__ = (
        "req_id", "gateway_id", "prompt_token_ids", "all_token_ids", "sampling", "stop",
        "eos_ids", "stop_ids", "priority", "arrival_time", "seq", "deadline", "status", "num_computed_tokens",
        "num_cached_tokens", "first_scheduled_time", "first_token_time", "num_preemptions", "block_hashes",
        "block_keys", "known_to_worker", "sent_first_delta", "finish_reason", "max_total_tokens", "num_tokens",
        "stop_check_ids", "num_token_slots", "num_cached_blocks", "num_ahead_tokens", "num_ahead_samples",
    )

    def __init__(self, add: AddRequest, seq: int, arrival_time: float, deadline: float, max_model_len: int) -> None:
        self.req_id = add.req_id
        self.gateway_id = add.gateway_id
        self.prompt_token_ids: list[int] = list(add.prompt_token_ids)
        # Prompt then outputs, in one list: what the prefix hashes and the recompute path read.
        self.all_token_ids: list[int] = list(add.prompt_token_ids) + list(add.output_token_ids)
        self.sampling: SamplingParams = add.sampling
        self.stop: StopParams = add.stop
        self.eos_ids = frozenset(() if add.stop.ignore_eos else add.stop.eos_token_ids)
        self.stop_ids = frozenset(add.stop.stop_token_ids)
        self.stop_check_ids = self.eos_ids | self.stop_ids  # one set lookup on the hot path
        self.priority = add.priority
        self.arrival_time = arrival_time
        self.seq = seq  # arrival order at this scheduler: FCFS order and tie-breaker
        self.deadline = deadline  # leave the waiting queue by then, or time out
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.block_keys: list[BlockKey] = []
        self.known_to_worker = False  # the worker holds persistent state for it
        # a continuation's first token was streamed by a previous scheduler: no first-token delta
        self.sent_first_delta = bool(add.output_token_ids)
        self.finish_reason: str | None = None
        self.max_total_tokens = min(max_model_len, len(add.prompt_token_ids) + add.stop.max_tokens)
        self.num_tokens = len(self.all_token_ids)  # kept in step with all_token_ids (hot path)
        # Caches of ledger facts for the hot path, reset whenever the blocks are freed:
        self.num_token_slots = 0  # len(block table) * block_size
        self.num_cached_blocks = 0  # full computed blocks already offered to the prefix cache
        # Scheduled in plans whose results have not come back yet (async scheduling keeps
        # one plan ahead): tokens the worker will have computed, and tokens it will have
        # sampled, once those plans ran. Both are 0 between steps without async scheduling.
        self.num_ahead_tokens = 0
        self.num_ahead_samples = 0

    def reset_progress(self) -> None:
        """Its blocks were freed (preemption): it will be recomputed from the start."""
        self.num_computed_tokens = 0
        self.num_token_slots = 0
        self.num_cached_blocks = 0
        self.num_ahead_tokens = 0  # results of plans in flight for it will be ignored
        self.num_ahead_samples = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: the tokens generated so far."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def update_block_hashes(self, block_size: int) -> None:
        extend_block_hashes(self.block_hashes, self.block_keys, self.all_token_ids, block_size)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def check_stop(self, token_id: int) -> tuple[str, int | None] | None:
        """After ``token_id`` was appended: (finish_reason, stop_token_id) or None."""
        if self.num_output_tokens >= self.stop.min_tokens:
            if token_id in self.eos_ids or token_id in self.stop_ids:
                return "stop", token_id
        if self.num_tokens >= self.max_total_tokens:
            return "length", None
        return None

    def timings(self, finished_time: float | None = None) -> RequestTimings:
        return RequestTimings(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=finished_time,
            num_preemptions=self.num_preemptions,
        )

    def summary(self, now: float) -> RequestSummary:
        return RequestSummary(
            self.req_id, self.priority, self.num_prompt_tokens, self.num_output_tokens,
            self.num_computed_tokens, max(0.0, now - self.arrival_time),
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, prio={self.priority}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
