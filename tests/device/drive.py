"""Feed a ``ModelRunner`` hand-built step plans: prefill a batch, then time decode steps.

No scheduler: the batch is fixed, blocks are assigned up front, and every decode
step schedules one token per request, so a step's time is the worker's alone
(the runner returns after reading the sampled tokens, i.e. after the GPU is done).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from shared.messages import NewRequestData, SamplingParams, StepPlan


@dataclass
class BatchTiming:
    batch: int
    prompt_len: int
    prefill_s: float
    decode_step_s: list[float]
    kv_tokens_read: int  # context tokens the median decode step attends over (sum over requests)

    @property
    def decode_median_s(self) -> float:
        return statistics.median(self.decode_step_s)


def run_batch(runner: Any, batch: int, prompt_len: int, decode_steps: int, budget: int, vocab: int,
              first_block: int = 0, seed: int = 0, around_decode: Any = None) -> BatchTiming:
    """Prefill ``batch`` random prompts (whole prompts per step, up to ``budget`` tokens),
    then run ``decode_steps`` decode steps; the requests are finished at the end.
    ``around_decode``: a context manager entered around the decode steps alone (a profiler)."""
    import contextlib
    import random

    rng = random.Random(seed)
    bs = runner.block_size
    nb = -(-(prompt_len + decode_steps + 1) // bs)
    if first_block + batch * nb > runner.num_kv_blocks:
        raise ValueError(f"batch {batch} x {nb} blocks does not fit {runner.num_kv_blocks} KV blocks")
    greedy = SamplingParams(temperature=0.0)
    reqs = [
        NewRequestData(req_id=f"b{batch}-{i}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)],
                       sampling=greedy, block_ids=list(range(first_block + i * nb, first_block + (i + 1) * nb)),
                       num_computed_tokens=0)
        for i in range(batch)
    ]
    step_id = 0
    per_step = max(1, budget // prompt_len)
    t0 = time.perf_counter()
    for start in range(0, batch, per_step):
        chunk = reqs[start : start + per_step]
        step_id += 1
        runner.execute(StepPlan(step_id=step_id, new_requests=chunk,
                                num_scheduled_tokens={r.req_id: prompt_len for r in chunk},
                                total_num_scheduled_tokens=prompt_len * len(chunk)))
    prefill_s = time.perf_counter() - t0
    with around_decode if around_decode is not None else contextlib.nullcontext():
        times = _decode(runner, reqs, step_id, decode_steps, batch)
    step_id += decode_steps
    runner.execute(StepPlan(step_id=step_id + 1, finished_req_ids=[r.req_id for r in reqs]))
    mid_ctx = prompt_len + decode_steps // 2 + 1
    return BatchTiming(batch, prompt_len, prefill_s, times, kv_tokens_read=batch * mid_ctx)


def _decode(runner: Any, reqs: list[NewRequestData], step_id: int, decode_steps: int, batch: int) -> list[float]:
    times: list[float] = []
    for _ in range(decode_steps):
        step_id += 1
        t = time.perf_counter()
        runner.execute(StepPlan(step_id=step_id, num_scheduled_tokens={r.req_id: 1 for r in reqs},
                                total_num_scheduled_tokens=batch))
        times.append(time.perf_counter() - t)
    return times
