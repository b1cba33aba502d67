"""The worker's persistent per-request state, updated from each step plan's differences.

A ``StepPlan`` names only what changed: new and resumed requests in full,
continuing requests as (new block ids, computed-token count), and ids to drop.
``BatchState.apply`` folds those into the requests the worker already holds;
the rest (prompt, outputs so far, block table, sampling parameters) stays here
between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import NewRequestData, SamplingParams, StepPlan


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_counts: dict[int, int] = field(default_factory=dict)  # for frequency/presence penalties
    window_block_ids: list[int] = field(default_factory=list)  # a hybrid KV cache's windowed layers (-1: released)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        counts: dict[int, int] = {}
        for t in data.output_token_ids:
            counts[t] = counts.get(t, 0) + 1
        return cls(
            req_id=data.req_id,
            token_ids=list(data.prompt_token_ids) + list(data.output_token_ids),
            num_prompt_tokens=len(data.prompt_token_ids),
            sampling=data.sampling,
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            output_counts=counts,
            window_block_ids=list(data.window_block_ids),
        )


class BatchState:
    """Requests the worker holds, by id."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def apply(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            self.requests.pop(req_id, None)
        for data in plan.new_requests:
            self.requests[data.req_id] = RequestState.from_new(data)
        for data in plan.resumed_requests:
            # A resumed request is rebuilt from scratch: its old blocks were freed.
            self.requests[data.req_id] = RequestState.from_new(data)
        for cached in plan.cached_requests:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise KeyError(f"step {plan.step_id}: cached request {cached.req_id!r} is unknown to this worker")
            state.block_ids.extend(cached.new_block_ids)
            state.window_block_ids.extend(cached.new_window_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, num in plan.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None:
                raise KeyError(f"step {plan.step_id}: scheduled request {req_id!r} is unknown to this worker")
            end = state.num_computed_tokens + num
            if num <= 0 or end > state.num_tokens:
                raise ValueError(
                    f"step {plan.step_id}: {req_id!r} scheduled {num} tokens from {state.num_computed_tokens} "
                    f"but holds {state.num_tokens}"
                )
            if end > len(state.block_ids) * self.block_size:
                raise ValueError(
                    f"step {plan.step_id}: {req_id!r} needs {end} KV slots but holds "
                    f"{len(state.block_ids)} blocks of {self.block_size}"
                )
