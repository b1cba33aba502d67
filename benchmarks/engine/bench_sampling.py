"""The sampler's share of a sampled workload, with the CPU sampling kernels on and off.

The common load's shape (64 distinct prompts of 200 random tokens, 64 output tokens each,
all submitted at once) through the offline engine at one temperature (by default with
no top-k/top-p: OpenAI's default for a sampled request; ``--top-p``/``--top-k`` add them), in rounds; each round runs it once with the
worker's ``argmax_rows``/``sample_rows`` kernels and once with the sampler's PyTorch paths,
in one process, so both see the same machine. Per run: wall time, the steps' summed
``forward_s`` and ``sample_s`` (the worker's own timers), output tok/s. Prints a line per
run and writes JSON.

    python -m benchmarks.engine.bench_sampling --temperature 1.0 --rounds 3 --out results/bench-sampling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from services.engine.offline import GATEWAY_ID, LLM, GenerationParams
from shared.messages import AddRequest


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    sampler = llm.runner.sampler
    kernels = (sampler.argmax_rows, sampler.sample_rows, sampler.race_rows)
    if kernels[1] is None:
        raise SystemExit("no CPU sampling kernels in this worker (not a CPU, or no C++ compiler): nothing to compare")
    rng = random.Random(args.seed)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, ignore_eos=True)
    sched = llm.scheduler
    runs: list[dict[str, Any]] = []
    next_id = 0
    for rnd in range(args.rounds):
        for mode in ("kernels", "torch"):
            sampler.argmax_rows, sampler.sample_rows, sampler.race_rows = kernels if mode == "kernels" else (None,) * 3
            for _ in range(args.num_prompts):
                tokens = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                sched.add_request(AddRequest(
                    req_id=f"s{next_id}", gateway_id=GATEWAY_ID, prompt_token_ids=tokens, sampling=params.sampling(),
                    stop=params.stop_params([]), arrival_time=time.time()))
                next_id += 1
            forward = sample = 0.0
            start = time.perf_counter()
            while sched.has_unfinished_requests():
                plan = sched.schedule()
                result = llm.runner.execute(plan)
                sched.update_from_result(plan, result)
                sched.take_deltas()
                forward += result.forward_s
                sample += result.sample_s
            wall = time.perf_counter() - start
            row = {"round": rnd, "sampler": mode, "wall_s": round(wall, 3), "forward_s": round(forward, 3),
                   "sample_s": round(sample, 3), "out_tok_s": round(args.num_prompts * args.max_tokens / wall, 1)}
            runs.append(row)
            print(f"round {rnd} {mode:8s} wall {wall:6.2f} s  forward {forward:6.2f} s  sample {sample:5.2f} s  "
                  f"{row['out_tok_s']:6.1f} out tok/s", flush=True)
    sampler.argmax_rows, sampler.sample_rows, sampler.race_rows = kernels
    return {"command": "python -m benchmarks.engine.bench_sampling " + " ".join(args.argv), "model": args.model,
            "dtype": args.dtype, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "threads": args.threads,
            "cpu": cpu_model(), "loadavg": os.getloadavg(), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.bench_sampling", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core this process may use)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench-sampling.json")
    args = p.parse_args(argv)
    if args.temperature <= 0:
        p.error("--temperature must be positive (greedy rows take argmax_rows, timed by bench_parts)")
    args.argv = argv if argv is not None else sys.argv[1:]
    report = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
