"""Per-step decode latency of ferry's offline engine in float32 vs bfloat16.

What decides ``--dtype auto`` on a CPU (docs/worker.md): for each dtype, greedy
decodes of 64 tokens at batch 1 and batch 8, timed end to end. Prints one line per
run and, last, one JSON object; ``--out`` also writes it.

    python -m benchmarks.engine.bench_dtype --threads 2 --out results/bench-dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from services.engine.offline import LLM, GenerationParams


def measure(dtype: str, model: str, threads: int, batches: list[int], max_tokens: int) -> list[dict[str, Any]]:
    llm = LLM(model=model, dtype=dtype, num_threads=threads, kv_cache_memory=1 << 29)
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm up"], params)
    rows = []
    for batch in batches:
        prompts = [f"Tell me a story about the number {i}." for i in range(batch)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        num_out = sum(len(o.token_ids) for o in outputs)
        row = {"dtype": dtype, "batch": batch, "wall_s": round(wall, 3),
               "output_tok_s": round(num_out / wall, 1), "ms_per_step": round(1000 * wall / max_tokens, 1)}
        print(f"{dtype:9} batch {batch:3}: {row['ms_per_step']:7.1f} ms/step {row['output_tok_s']:8.1f} out tok/s")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.bench_dtype", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        rows += measure(dtype, args.model, args.threads, [int(b) for b in args.batches.split(",")], args.max_tokens)
    report = {"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
              "runs": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
