"""ferry's tiled bfloat16 linear kernel against oneDNN, in one process (docs/benchmarks.md,
"Kernels: linear products").

Two measurements, each alternating both paths round by round on the same data (a shared
2-core machine moves by 10-30 % from one minute to the next):

- ``linears``: one decode step's linear layers of SmolLM2-135M at M rows (30 layers x the
  fused q/k/v, o, fused gate/up and down products, every layer its own weights, so they are
  read from memory as in a forward), oneDNN's packed product against the tiled kernel; ms
  per step and the weight bytes read per second; and the LM head (576 -> 49,152) at M rows;
- ``steps``: the offline engine at a batch of B requests (200-token prompts, 64 output tokens
  each), every bfloat16 layer on oneDNN, then on the tiled kernel with the MLP's SiLU as a
  pass of its own, then with the SiLU applied in the gate/up product (the same loaded model,
  both copies kept: the row limit and the gated product are per-module attributes); ms per
  decode step with all B requests decoding, and per prompt step (a step with prompt tokens);
- ``prefetch`` (not in the default): the tiled kernel's next-group weight prefetch on and
  off, the 30 layers' products and the LM head at M rows.
- ``prompt`` (not in the default; AMX only): a prompt step's products at M rows (past the
  decode path's 128), per projection over the 30 layers, oneDNN's packed product (gate/up
  followed by ``silu_and_mul``) against the AMX products (gate/up with the SiLU on the
  accumulators), with the worker's heap settings (shared/heap.py); what
  ``FERRY_CPU_AMX_PROMPT`` chooses from.

    python -m benchmarks.kernels.bench_tiled_linear --out /tmp/b/tiled-linear.json

bfloat16 on a CPU with AVX512-BF16 only (the kernel's instruction); elsewhere it says so.
"""

# ruff: noqa: B023 - every closure is timed and dropped within its own loop iteration
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_io import header, write_json

# SmolLM2-135M's products per layer as ferry runs them: (in, out) of q/k/v fused, o, gate/up fused, down
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
KINDS = ("qkv", "o", "gate_up", "down")  # SHAPES' names, in order
LAYERS = 30


def run_linears(kernels: Any, rows: list[int], rounds: int) -> list[dict[str, Any]]:
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).to(dt) for k, n in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
    tiles = [[kernels.tiled_pack(w) for w in layer] for layer in weights]
    head = torch.randn(49152, 576, generator=gen).to(dt)
    head_packed, head_tiles = torch.ops.mkldnn._reorder_linear_weight(head, 64), kernels.tiled_pack(head)
    nbytes = sum(2 * k * n for k, n in SHAPES) * LAYERS
    empty = torch.empty(0)
    use_amx = bool(getattr(kernels, "tiled_amx", lambda _: 0)(-1))
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(dt) for k in {k for k, _ in SHAPES}}

        def onednn() -> None:
            for layer in packed:
                for (k, _), p in zip(SHAPES, layer, strict=True):
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

        def tiled() -> None:
            for layer in tiles:
                for (k, _), t in zip(SHAPES, layer, strict=True):
                    kernels.tiled_linear(xs[k], t, empty)

        def amx() -> None:
            for layer in tiles:
                for (k, _), t in zip(SHAPES, layer, strict=True):
                    kernels.amx_linear(xs[k], t, empty)

        x_head = xs[576]
        times: dict[str, list[float]] = {"onednn": [], "tiled": [], "head_onednn": [], "head_tiled": []}
        # with AMX: the AMX tile products over the same tiles (what decode steps of 7-128 rows take)
        arms: list[tuple[str, Any]] = [("onednn", onednn), ("tiled", tiled)] + ([("amx", amx)] if use_amx else [])
        if use_amx:
            times["amx"] = []
        for _ in range(rounds):
            for name, fn in (*arms,
                             ("head_onednn", lambda: torch.ops.mkldnn._linear_pointwise(x_head, head_packed, None, "none", [], "")),
                             ("head_tiled", lambda: kernels.tiled_linear(x_head, head_tiles, empty))):
                fn()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        row = {"rows": m, **{f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in times.items()}}
        flops = 2 * m * nbytes / 2
        row.update({f"{k}_gflop_s": round(flops / statistics.median(times[k]) / 1e9) for k, _ in arms})
        row.update({f"{k}_gb_s": round(nbytes / statistics.median(times[k]) / 1e9, 1) for k, _ in arms})
        print(f"linears, {m} rows, {LAYERS} layers: oneDNN {row['onednn_ms']} ms ({row['onednn_gflop_s']} GFLOP/s, "
              f"{row['onednn_gb_s']} GB/s of weights), tiled {row['tiled_ms']} ms ({row['tiled_gflop_s']} GFLOP/s, "
              f"{row['tiled_gb_s']} GB/s), x{row['onednn_ms'] / row['tiled_ms']:.2f}; LM head oneDNN "
              f"{row['head_onednn_ms']} ms, tiled {row['head_tiled_ms']} ms"
              + (f"; AMX {row['amx_ms']} ms ({row['amx_gb_s']} GB/s), x{row['onednn_ms'] / row['amx_ms']:.2f} of oneDNN"
                 if use_amx else ""), flush=True)
        out.append(row)
    return out


def run_prompt(kernels: Any, rows: list[int], rounds: int) -> list[dict[str, Any]]:
    from shared.heap import keep_freed_memory

    keep_freed_memory()  # as the worker: a step's freed buffers are reused, not faulted in again
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    kinds = KINDS
    weights = [[torch.randn(n, k, generator=gen).to(dt) for k, n in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
    tiles = [[kernels.tiled_pack(w) for w in layer] for layer in weights]
    empty = torch.empty(0)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(dt) for k in {k for k, _ in SHAPES}}

        def onednn(i: int) -> None:
            x = xs[SHAPES[i][0]]
            for layer in packed:
                y = torch.ops.mkldnn._linear_pointwise(x, layer[i], None, "none", [], "")
                if kinds[i] == "gate_up":
                    kernels.silu_and_mul(y)

        def amx(i: int) -> None:
            x = xs[SHAPES[i][0]]
            product = kernels.amx_silu_linear if kinds[i] == "gate_up" else kernels.amx_linear
            for layer in tiles:
                product(x, layer[i], empty)

        times: dict[str, list[float]] = {f"{kind}_{arm}": [] for kind in kinds for arm in ("onednn", "amx")}
        for _ in range(rounds):
            for i, kind in enumerate(kinds):
                for arm, fn in (("onednn", onednn), ("amx", amx)):
                    fn(i)
                    t0 = time.perf_counter()
                    fn(i)
                    times[f"{kind}_{arm}"].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"rows": m, **{f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in times.items()}}
        for arm in ("onednn", "amx"):
            row[f"total_{arm}_ms"] = round(sum(row[f"{kind}_{arm}_ms"] for kind in kinds), 2)
        ratios = {kind: row[f"{kind}_onednn_ms"] / row[f"{kind}_amx_ms"] for kind in (*kinds, "total")}
        row.update({f"{kind}_speedup": round(r, 3) for kind, r in ratios.items()})
        print(f"prompt products, {m} rows, {LAYERS} layers (oneDNN ms / AMX ms = speed-up): "
              + ", ".join(f"{kind} {row[f'{kind}_onednn_ms']}/{row[f'{kind}_amx_ms']} = x{ratios[kind]:.2f}"
                          for kind in (*kinds, "total")), flush=True)
        out.append(row)
    return out


def run_steps(batches: list[int], rounds: int, threads: int) -> list[dict[str, Any]]:
    import os

    os.environ["FERRY_CPU_TILED_LINEAR"] = "small"  # both copies kept; the row limit is switched below
    from services.engine.offline import LLM, GenerationParams
    from services.worker.model.fused_ops import FusedSiluMLP
    from services.worker.model.packed_linear import ALL_ROWS, PackedLinear

    llm = LLM(dtype="bfloat16", num_threads=threads)
    layers = [m for m in llm.runner.model.modules() if isinstance(m, PackedLinear) and m.tiles is not None]
    mlps = [m for m in llm.runner.model.modules() if isinstance(m, FusedSiluMLP) and m._gated is not None]
    gated = [m._gated for m in mlps]
    print(f"{len(layers)} linear layers with the tiled kernel, {len(mlps)} MLPs with its gated product", flush=True)
    arms = ("onednn", "tiled_separate", "tiled")
    execute = llm.runner.execute
    times: list[tuple[int, float]] = []

    def timed(plan: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(plan)
        times.append((plan.total_num_scheduled_tokens, time.perf_counter() - t0))
        return result

    llm.runner.execute = timed  # type: ignore[method-assign]
    params = GenerationParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    out = []
    for b in batches:
        decode: dict[str, list[float]] = {a: [] for a in arms}
        prompt: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(rounds):
            for name in arms:
                for m in layers:
                    m.tiled_rows = 0 if name == "onednn" else ALL_ROWS
                for mlp, fn in zip(mlps, gated, strict=True):
                    mlp._gated = fn if name == "tiled" else None
                prompts = [[rng.randrange(1000, 40000) for _ in range(200)] for _ in range(b)]
                times.clear()
                llm._run(prompts, [params] * b)
                decode[name].append(statistics.median([t for n, t in times if n == b][8:]))  # all decoding
                prompt[name].append(statistics.median([t for n, t in times if n > b]))
        row = {"batch": b, **{f"decode_{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in decode.items()},
               **{f"prompt_{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in prompt.items()}}
        for part in ("decode", "prompt"):
            base = row[f"{part}_onednn_ms"]
            print(f"batch {b}, {part} step: oneDNN {base} ms; tiled, SiLU apart {row[f'{part}_tiled_separate_ms']} ms "
                  f"({row[f'{part}_tiled_separate_ms'] / base:.2f}x); tiled, SiLU in the product "
                  f"{row[f'{part}_tiled_ms']} ms ({row[f'{part}_tiled_ms'] / base:.2f}x)", flush=True)
        out.append(row)
    llm.close()
    return out


def run_prefetch(kernels: Any, rows: list[int], rounds: int) -> list[dict[str, Any]]:
    """The tiled kernel with its next-group weight prefetch on and off (``tiled_prefetch``),
    alternating round by round: the 30 layers' products as the model runs them (q/k/v, o,
    gate/up with the SiLU, down; weights from memory) and the LM head (two copies, taken in
    turn, so neither stays in the cache)."""
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    body = [(kernels.tiled_pack(torch.randn(n, k, generator=gen).to(dt)), k, n == 3072)
            for _ in range(LAYERS) for k, n in SHAPES]
    heads = [kernels.tiled_pack(torch.randn(49152, 576, generator=gen).to(dt)) for _ in range(2)]
    empty = torch.empty(0)
    out = []
    try:
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen).to(dt) for k in {k for k, _ in SHAPES}}
            times: dict[str, list[float]] = {"body_on": [], "body_off": [], "head_on": [], "head_off": []}
            for i in range(2 * rounds):
                on = i % 2 == 0
                kernels.tiled_prefetch(on)
                t0 = time.perf_counter()
                for t, k, gated in body:
                    (kernels.tiled_silu_linear if gated else kernels.tiled_linear)(xs[k], t, empty)
                t1 = time.perf_counter()
                kernels.tiled_linear(xs[576], heads[i // 2 % 2], empty)
                t2 = time.perf_counter()
                key = "on" if on else "off"
                times[f"body_{key}"].append(t1 - t0)
                times[f"head_{key}"].append(t2 - t1)
            row = {"rows": m, **{f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in times.items()}}
            print(f"prefetch, {m} rows: body {row['body_on_ms']} ms on, {row['body_off_ms']} off "
                  f"({row['body_on_ms'] / row['body_off_ms']:.3f}); LM head {row['head_on_ms']} on, "
                  f"{row['head_off_ms']} off ({row['head_on_ms'] / row['head_off_ms']:.3f})", flush=True)
            out.append(row)
    finally:
        kernels.tiled_prefetch(True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="linears,steps", help="linears, steps, prefetch, prompt (comma-separated)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048", help="rows per product (linears)")
    p.add_argument("--prompt-rows", default="140,205,264,512,1024,2048", help="rows per product (prompt)")
    p.add_argument("--batches", default="1,4,16,64", help="requests decoding together (steps)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from services.worker.model.packed_linear import _tiled_kernels

    kernels = _tiled_kernels()
    if kernels is None:
        print("no tiled kernel here (it needs AVX512-BF16 and the CPU kernels' build)")
        return 1
    parts = set(args.parts.split(","))
    result = {**header("benchmarks.kernels.bench_tiled_linear", argv), "threads": args.threads, "rounds": args.rounds}
    if "linears" in parts:
        result["linears"] = run_linears(kernels, [int(x) for x in args.rows.split(",")], args.rounds)
    if "prefetch" in parts:
        result["prefetch"] = run_prefetch(kernels, [int(x) for x in args.rows.split(",")], args.rounds)
    if "prompt" in parts:
        if not kernels.tiled_amx(-1):
            print("prompt: no AMX products here")
        else:
            rows = args.prompt_rows.split(",")
            result["prompt"] = run_prompt(kernels, [int(x) for x in rows], args.rounds)
    if "steps" in parts:
        result["steps"] = run_steps([int(x) for x in args.batches.split(",")], args.rounds, args.threads)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
