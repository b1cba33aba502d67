"""Scheduler benchmark: microseconds per step with 256 and 1,024 running decodes.

Run with ``make bench-scheduler`` (``python -m benchmarks.serving.bench_scheduler``). A
minimal fake worker answers every plan instantly, so the figure is the
scheduler's own cost per step: ``schedule()`` + ``update_from_result()`` +
``take_deltas()``, timed around those calls only. ``us_per_step_N`` is the
median *thread CPU time* of a step (``time.thread_time``), so that other
processes on a shared machine do not inflate it; the median wall time is
reported beside it (``wall_us_per_step_N``). Encoding the plan with msgspec
(what the service does before publishing it) is reported separately.

Every request decodes with ``ignore_eos`` and a large ``max_tokens``, so the
running set stays full; blocks are appended every ``block_size`` tokens and
full blocks are registered in the prefix cache, as in real serving. The last
printed line is one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.messages import AddRequest, SamplingParams, StepPlan, StepResult, StopParams, encode

PROMPT_LEN = 128


class InstantWorker:
    """Follows plans just enough to sample at the right moments; no checks, no KV."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, plan: StepPlan) -> StepResult:
        num_tokens = self.num_tokens
        num_computed = self.num_computed
        for req_id in plan.finished_req_ids:
            num_tokens.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            num_tokens.pop(req_id, None)
        for data in plan.new_requests + plan.resumed_requests:
            num_tokens[data.req_id] = len(data.prompt_token_ids) + len(data.output_token_ids)
            num_computed[data.req_id] = data.num_computed_tokens
        req_ids: list[str] = []
        sampled: list[int] = []
        for req_id, n in plan.num_scheduled_tokens.items():
            done = num_computed[req_id] + n
            num_computed[req_id] = done
            if done == num_tokens[req_id]:
                num_tokens[req_id] = done + 1
                req_ids.append(req_id)
                sampled.append(10 + done % 1000)
        return StepResult(step_id=plan.step_id, rank=0, req_ids=req_ids, sampled_token_ids=sampled)


def _request(i: int, max_tokens: int) -> AddRequest:
    # Distinct prompts: no prefix hits, so every request holds its own blocks.
    prompt = [1000 + (i * 7919 + j) % 30000 for j in range(PROMPT_LEN)]
    return AddRequest(
        req_id=f"req-{i}", gateway_id=f"gw-{i % 4}", prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0), stop=StopParams(max_tokens=max_tokens, ignore_eos=True),
    )


def bench_decodes(num_running: int, num_steps: int) -> dict[str, float]:
    """Fill the running set with ``num_running`` decodes, then time ``num_steps`` steps."""
    block_size = 16
    budget = max(2048, num_running)
    # Outlive the prefill phase (early requests decode while later ones prefill) and the timed steps.
    max_tokens = num_steps + num_running * PROMPT_LEN // budget + 64
    blocks_per_req = -(-(PROMPT_LEN + max_tokens) // block_size)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=num_running, block_size=block_size,
        max_waiting_requests=num_running,
    )
    sched = Scheduler(config, num_running * blocks_per_req + 16, PROMPT_LEN + max_tokens + 1)
    worker = InstantWorker()
    for i in range(num_running):
        assert sched.add_request(_request(i, max_tokens)) is None
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        plan = sched.schedule()
        sched.update_from_result(plan, worker.step(plan))
        sched.take_deltas()
    sched.stats()
    cpu_s: list[float] = []  # thread CPU time: what the scheduler itself costs
    wall_s: list[float] = []  # wall time: includes time the OS gave to other processes
    encode_s = 0.0
    perf = time.perf_counter
    cpu = time.thread_time
    for _ in range(num_steps):
        c0, t0 = cpu(), perf()
        plan = sched.schedule()
        c1, t1 = cpu(), perf()
        data = encode(plan)
        c2 = cpu()
        result = worker.step(plan)
        c3, t3 = cpu(), perf()
        sched.update_from_result(plan, result)
        sched.take_deltas()
        c4, t4 = cpu(), perf()
        assert plan.total_num_scheduled_tokens == num_running, "the running set drained during the benchmark"
        cpu_s.append((c1 - c0) + (c4 - c3))
        wall_s.append((t1 - t0) + (t4 - t3))
        encode_s += c2 - c1
        del data
    cpu_sorted = sorted(cpu_s)
    median_cpu = statistics.median(cpu_s)
    return {
        # Headline: median thread CPU time. On a shared machine wall time mostly measures
        # how often the OS hands the core to someone else during a step.
        "us_per_step": 1e6 * median_cpu,
        "us_per_step_mean": 1e6 * sum(cpu_s) / num_steps,
        "us_per_step_p99": 1e6 * cpu_sorted[int(0.99 * (num_steps - 1))],
        "steps_per_s": 1 / median_cpu,
        "wall_us_per_step": 1e6 * statistics.median(wall_s),
        "wall_us_per_step_min": 1e6 * min(wall_s),
        "encode_us_per_step": 1e6 * encode_s / num_steps,
        "num_kv_blocks": sched.ledger.num_total_blocks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per running-set size")
    parser.add_argument("--sizes", type=str, default="256,1024", help="running-set sizes, comma-separated")
    parser.add_argument("--out", default="results/bench-scheduler.json", help="where to write the JSON summary")
    args = parser.parse_args(argv)
    summary: dict[str, object] = {
        "steps": args.steps,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    for size in (int(s) for s in args.sizes.split(",")):
        res = bench_decodes(size, args.steps)
        print(
            f"{size:5d} running decodes: {res['us_per_step']:7.1f} us/step CPU median "
            f"(mean {res['us_per_step_mean']:.1f}, p99 {res['us_per_step_p99']:.1f}), {res['steps_per_s']:6.0f} steps/s; "
            f"wall median {res['wall_us_per_step']:.1f} (min {res['wall_us_per_step_min']:.1f}); "
            f"plan encode {res['encode_us_per_step']:.1f} us/step"
        )
        for key, value in res.items():
            summary[f"{key}_{size}"] = round(value, 2)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
