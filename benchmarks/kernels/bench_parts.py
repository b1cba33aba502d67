"""Micro-benchmarks of the worker's parts, in process CPU time (what survives a busy machine).

    python -m benchmarks.kernels.bench_parts --threads 1,2 --out results/bench-parts.json

- ``decode-layer``: one decode step's layer at the common load's shape (64 requests,
  contexts 201-264, SmolLM2's 9 query / 3 KV heads of 64, block size 16, shuffled
  blocks): attention per backend, the seven linear layers at M=64, and the eager
  norm/RoPE/SiLU/residual work; and attention's share of the layer per backend.
- ``sampler``: 8 rows x 49,152 float32 logits through ``Sampler`` for greedy, seeded
  and unseeded temperature, top-k+top-p and top-p rows, and a decode step's 64 rows of
  bfloat16 logits (greedy and temperature), each through the PyTorch paths and through
  the CPU kernels' ``argmax_rows``/``sample_rows``.

Each figure is the minimum over 5 rounds of 10 calls. Prints lines, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.backends import available_backends, select_backend
from services.worker.backends.build import build_paged_batch
from services.worker.sampler import Sampler
from shared.messages import SamplingParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_REQS, HIDDEN, INTER = 9, 3, 64, 16, 64, 576, 1536


def _best_ms(fns: dict[str, Callable[[], Any]], rounds: int = 5, calls: int = 10) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.process_time() - t0) / calls * 1000)
    return {k: round(v, 3) for k, v in best.items()}


def decode_layer() -> dict[str, float]:
    rng = random.Random(0)
    ctxs = [rng.randint(201, 264) for _ in range(NUM_REQS)]
    blocks = list(range(1200))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-c // BLOCK))] for c in ctxs]
    batch, _ = build_paged_batch([1] * NUM_REQS, ctxs, tables, BLOCK, 8192, torch.device("cpu"))
    kc, vc = torch.randn(1200, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(1200, BLOCK, KV_HEADS, HEAD_DIM)
    q = torch.randn(NUM_REQS, HEADS, HEAD_DIM)
    k, v = torch.randn(NUM_REQS, KV_HEADS, HEAD_DIM), torch.randn(NUM_REQS, KV_HEADS, HEAD_DIM)
    fns: dict[str, Callable[[], Any]] = {}
    def attend(name: str) -> Callable[[], Any]:
        backend = select_backend(name, torch.device("cpu"))
        meta = backend.prepare(batch)
        return lambda: backend.forward(0, q, k, v, kc, vc, meta, HEAD_DIM**-0.5)

    for name in available_backends("cpu"):
        fns[f"attention {name}"] = attend(name)
    shapes = [(HIDDEN, HIDDEN), (HIDDEN, 192), (HIDDEN, 192), (HIDDEN, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER),
              (INTER, HIDDEN)]
    weights = [torch.randn(o, i) for i, o in shapes]
    xs = {HIDDEN: torch.randn(NUM_REQS, HIDDEN), INTER: torch.randn(NUM_REQS, INTER)}
    fns["7 linear layers, M=64"] = lambda: [F.linear(xs[i], w) for (i, _), w in zip(shapes, weights, strict=True)]
    x, norm_w = torch.randn(1, NUM_REQS, HIDDEN), torch.randn(HIDDEN)
    qq, kk = torch.randn(1, HEADS, NUM_REQS, HEAD_DIM), torch.randn(1, KV_HEADS, NUM_REQS, HEAD_DIM)
    cos = torch.randn(1, 1, NUM_REQS, HEAD_DIM)
    gate, up = torch.randn(1, NUM_REQS, INTER), torch.randn(1, NUM_REQS, INTER)

    def rest() -> None:  # as transformers' Llama runs them, eagerly
        for _ in range(2):
            _ = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        for t in (qq, kk):
            half = HEAD_DIM // 2
            _ = t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * cos
        _ = F.silu(gate) * up
        _ = x + x
        _ = x + x

    fns["norms, RoPE, SiLU*mul, residuals"] = rest
    best = _best_ms(fns)
    others = best["7 linear layers, M=64"] + best["norms, RoPE, SiLU*mul, residuals"]
    for name in available_backends("cpu"):
        a = best[f"attention {name}"]
        best[f"attention share, {name} (%)"] = round(100 * a / (a + others), 1)
    return best


def sampler() -> dict[str, float]:
    """Each case through the PyTorch paths and, when the CPU kernels load, through
    ``argmax_rows``/``sample_rows``/``race_rows`` (greedy and temperature-only rows; the filtered rows
    take the same path either way): 8 rows of float32 logits, and a decode step's 64 rows
    of bfloat16 logits."""
    from services.worker.model.fused_ops import kernels

    ops = kernels()
    samplers = {"torch": Sampler(torch.device("cpu"))}
    if ops is not None:
        samplers["kernels"] = Sampler(torch.device("cpu"), argmax_rows=ops.argmax_rows, sample_rows=ops.sample_rows,
                                      race_rows=ops.race_rows)
    cases = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature 0.8, seeded": SamplingParams(temperature=0.8, seed=1),
        "temperature 1.0": SamplingParams(temperature=1.0),
        "top-k 50 + top-p 0.9, seeded": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1),
        "top-p 0.9, unseeded": SamplingParams(temperature=0.8, top_p=0.9),
    }
    batches = {8: torch.randn(8, 49152, generator=torch.Generator().manual_seed(0)) * 4,
               64: (torch.randn(64, 49152, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)}

    def draw(smp: Sampler, logits: torch.Tensor, p: SamplingParams) -> Callable[[], Any]:
        n = logits.shape[0]
        return lambda: smp(logits, [p] * n, [[1, 2, 3]] * n, [{}] * n, [5] * n)

    fns = {}
    for rows, logits in batches.items():
        for name, p in cases.items():
            if rows == 64 and "top" in name:
                continue
            for path, smp in samplers.items():
                fns[f"{name}, {rows} {'bf16' if rows == 64 else 'f32'} rows, {path}"] = draw(smp, logits, p)
    return _best_ms(fns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_parts", description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--out", default="results/bench-parts.json")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for part, fn in (("decode-layer", decode_layer), ("sampler", sampler)):
            res = fn()
            report[f"{part}@{threads}"] = res
            for name, value in res.items():
                print(f"threads {threads} {part:12s} {name:36s} {value:8.2f}", flush=True)
    report["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
