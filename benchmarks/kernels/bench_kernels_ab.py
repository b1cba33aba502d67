"""Two builds of the CPU attention kernels, side by side in one process (docs/benchmarks.md,
"Kernels: decode attention" and "Kernels: prompt attention").

On a shared 2-core machine a kernel's time moves by 10-30 % from one minute to the next,
more than most kernel changes gain, so two runs of ``bench_cpu_paths`` (one per tree) say
little. This loads the kernels of this tree and of ``--base`` (another checkout, e.g. a
``git worktree`` at the commit before a change) into one process, checks that both give
bit-identical outputs on the same inputs (or says they differ), and times them on the
same data in alternating rounds, reporting each one's median over the rounds:

- ``decode``: the common load's decode shape (64 requests, contexts 201-264, 9/3 heads
  of 64, block size 16), one call per layer over ``--layers`` layers' own caches (read
  from memory) on a fresh server's block layout, and on one layer's 17 blocks (resident:
  the compute alone), per cache dtype (bfloat16, float8 with bfloat16 queries), each
  through the path the engine takes on this CPU (``--dot``: on a CPU with AMX a bfloat16
  cache is read through float32 FMAs, elsewhere through bfloat16 dot products);
- ``mixed``: decode steps whose contexts differ widely (one long conversation among short
  ones), where the split of work between threads matters;
- ``prefill``: fresh prompts through the causal prompt kernel (8 x 200 tokens, 10 x 200 + 48,
  one 1,000-token prompt, four uneven ones, one of 1,000 tokens beside ten of 100), in each
  of ``--prefill-dtypes`` (bfloat16 and float32: ``--dtype auto`` on a CPU without native
  bfloat16 serves float32);
- ``linear`` (not by default; a CPU with AMX): the AMX tile products of SmolLM2-135M's four
  projections (q/k/v, o_proj, gate/up with its SiLU, down) over ``--layers`` layers' own
  weights at each of ``--linear-rows`` row counts (decode steps' 8-128, prompt steps' past 128).

    git worktree add /tmp/wt_base HEAD~1
    python -m benchmarks.kernels.bench_kernels_ab --base /tmp/wt_base --out /tmp/b/kernels-ab.json

Both builds go through torch's extension cache (the first run of a tree compiles it, about
a minute). Only kernels both trees have are compared: a tree whose kernel refuses an input
(e.g. an older build without float8 prompts) is reported as such.
"""

# ruff: noqa: B023 - every closure is timed and dropped within its own loop iteration
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels.bench_tiled_linear import KINDS, SHAPES

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
ROOT = Path(__file__).resolve().parents[2]


def load_kernels(tree: Path) -> Any:
    """The CPU kernels as ``tree``'s sources build them (its own cache key, so both coexist)."""
    saved = {k: v for k, v in sys.modules.items() if k == "services" or k.startswith("services.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        try:  # the kernels package; a revision from before it kept the loader in cpu_paged
            from services.kernels import build as loader

            depth = 2
        except ImportError:
            from services.worker.backends import cpu_paged as loader  # type: ignore[no-redef]

            depth = 3
        if Path(loader.__file__).resolve().parents[depth] != tree.resolve():
            raise SystemExit(f"{tree} did not provide services.kernels.build")
        return loader.load_extension()
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "services" or k.startswith("services.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def alternate(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of each function's best of three, in alternating order."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(min(fns[name]() for _ in range(3)))
    return {k: statistics.median(v) for k, v in times.items()}


def tables_for(lens: list[int], blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables over a random permutation of the cache's blocks."""
    need = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(blocks, generator=gen)[: sum(need)].to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[used : used + k]
        used += k
    return table


def decode_cases(args: argparse.Namespace) -> list[tuple[str, torch.dtype, list[int], str]]:
    rng = random.Random(0)
    common = [rng.randint(201, 264) for _ in range(64)]
    cases = []
    if "decode" in args.parts:
        for dt in (torch.bfloat16, torch.float8_e4m3fn):
            cases += [("decode", dt, common, "fresh"), ("decode", dt, common, "resident")]
    if "mixed" in args.parts:
        for lens in ([4000] + [100] * 15, [100] * 15 + [4000], [2000, 1500] + [300] * 4, [3000, 200, 200]):
            cases.append(("mixed", torch.bfloat16, lens, "scattered"))
    return cases


def decode_dot(args: argparse.Namespace, name: str, cache_dtype: torch.dtype) -> bool:
    """The decode kernel's ``bf16_dot``: the backend's rule for both trees (``--dot rule``, the
    default: two builds of the path the engine runs on this CPU, float32 FMAs for a bfloat16
    cache on a CPU with AMX, cpu_paged.bf16_decode_through_fma); True for both (``--dot on``:
    the dot-product path, whichever CPU); or the rule for this tree, dot products for the base
    (``--dot auto``)."""
    if args.dot == "on" or (name == "base" and args.dot == "auto"):
        return True
    from services.worker.backends.cpu_paged import bf16_decode_through_fma

    return not (bf16_decode_through_fma() and cache_dtype == torch.bfloat16)


def run_decode(kernels: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.kernels.bench_cpu_paths import fresh_table

    rows = []
    gen = torch.Generator().manual_seed(0)
    blocks = 2912
    def cache(dt: torch.dtype) -> torch.Tensor:
        return torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dt)

    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    layers_dtype = None
    for part, dt, lens, layout in decode_cases(args):
        if dt != layers_dtype:  # one dtype's caches at a time (30 layers of bfloat16: 1 GiB)
            layers.clear()
            layers += [(cache(dt), cache(dt)) for _ in range(args.layers)]
            layers_dtype = dt
        n = len(lens)
        if layout == "fresh":
            table = fresh_table(n)
        elif layout == "resident":
            table = torch.arange(17, dtype=torch.int32).repeat(n, 1).contiguous()
        else:
            table = tables_for(lens, blocks, gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        scale = HEAD_DIM**-0.5
        outs: dict[str, torch.Tensor] = {}
        fns: dict[str, Callable[[], float]] = {}
        for name, k in kernels.items():
            dot = decode_dot(args, name, dt)
            try:
                outs[name] = k.paged_decode(q, *layers[0], table, seq_lens, scale, dot)
            except RuntimeError as exc:
                print(f"{part} {dt} {layout}: {name} refused ({str(exc).splitlines()[0]})", flush=True)
                continue

            def step(k: Any = k, dot: bool = dot) -> float:
                t = time.perf_counter()
                for li in range(args.layers):
                    k.paged_decode(q, *layers[0 if layout == "resident" else li], table, seq_lens, scale, dot)
                return (time.perf_counter() - t) * 1e3

            fns[name] = step
        if len(fns) < 2:
            continue
        ms = alternate(fns, args.rounds)
        identical = same_bits(outs["base"], outs["this"])
        label = f"{n} requests, contexts {min(lens)}-{max(lens)}" if part == "decode" else "contexts " + ",".join(
            f"{x}" for x in lens[:4]) + ("..." if n > 4 else "") + f" ({n} requests)"
        print(f"{part} {str(dt).removeprefix('torch.')} {layout}, {label}, {args.layers} layers: base {ms['base']:.2f} ms, "
              f"this {ms['this']:.2f} ms per step ({ms['this'] / ms['base'] - 1:+.1%}); bit-identical: {identical}",
              flush=True)
        rows.append({"part": part, "dtype": str(dt), "layout": layout, "lens": lens, "layers": args.layers,
                     "base_ms": ms["base"], "this_ms": ms["this"], "bit_identical": identical})
    return rows


def run_prefill(kernels: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    cases = ([200] * 8, [200] * 10 + [48], [1000], [37, 300, 5, 129], [1000] + [100] * 10, [100] * 10 + [1000])
    for dtype, lens in itertools.product(args.prefill_dtypes, cases):
        total = sum(lens)
        qkv = torch.randn(total, width, generator=gen).to(dtype)  # strided views, as the runner has them
        q = qkv[:, : HEADS * HEAD_DIM].view(total, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(total, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(total, KV_HEADS, HEAD_DIM)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        spans = torch.tensor([(s, s + n) for s, n in zip(starts, lens, strict=True)], dtype=torch.int64)
        outs = {name: torch.empty(total, HEADS, HEAD_DIM, dtype=dtype) for name in kernels}
        fns: dict[str, Callable[[], float]] = {}
        for name, kern in kernels.items():
            kern.prefill_attention(q, k, v, outs[name], spans, HEAD_DIM**-0.5, True)

            def call(kern: Any = kern, out: torch.Tensor = outs[name]) -> float:
                t = time.perf_counter()
                kern.prefill_attention(q, k, v, out, spans, HEAD_DIM**-0.5, True)
                return (time.perf_counter() - t) * 1e3

            fns[name] = call
        ms = alternate(fns, args.rounds * 2)
        identical = same_bits(outs["base"], outs["this"])
        label = (f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens)) if len(lens) < 6
                 else "+".join(f"{len(list(g))} x {x}" for x, g in itertools.groupby(lens)))
        print(f"prefill {str(dtype).removeprefix('torch.')} {label} tokens: base {ms['base']:.3f} ms, this {ms['this']:.3f} ms "
              f"({ms['this'] / ms['base'] - 1:+.1%}); bit-identical: {identical}", flush=True)
        rows.append({"part": "prefill", "dtype": str(dtype), "lens": lens, "base_ms": ms["base"], "this_ms": ms["this"],
                     "bit_identical": identical})
    return rows


# SmolLM2-135M's projections as bench_tiled_linear has them: (name, in, out)
LINEAR_SHAPES = tuple((kind, k, n) for kind, (k, n) in zip(KINDS, SHAPES, strict=True))


def run_linear(kernels: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The AMX tile products (``amx_linear``, ``amx_silu_linear`` for gate/up) of both builds
    on the same tiles, ``--layers`` layers of each projection (each its own weight) per call."""
    from shared.heap import keep_freed_memory

    if not all(k.tiled_amx(-1) for k in kernels.values()):
        print("linear: no AMX tile products here (CPU or build); skipped", flush=True)
        return []
    keep_freed_memory()  # as the worker: a step's freed buffers are reused, not faulted in again
    rows = []
    gen = torch.Generator().manual_seed(2)
    pack = kernels["base"].tiled_pack
    tiles = {name: [pack(torch.randn(n, k, generator=gen).to(torch.bfloat16)) for _ in range(args.layers)]
             for name, k, n in LINEAR_SHAPES}
    empty = torch.empty(0)
    for m in [int(x) for x in args.linear_rows.split(",")]:
        for name, k_in, _ in LINEAR_SHAPES:
            x = torch.randn(m, k_in, generator=gen).to(torch.bfloat16)
            outs: dict[str, list[torch.Tensor]] = {}
            fns: dict[str, Callable[[], float]] = {}
            for tree, kern in kernels.items():
                product = kern.amx_silu_linear if name == "gate_up" else kern.amx_linear
                outs[tree] = [product(x, t, empty) for t in tiles[name]]

                def call(product: Any = product) -> float:
                    t0 = time.perf_counter()
                    for t in tiles[name]:
                        product(x, t, empty)
                    return (time.perf_counter() - t0) * 1e3

                fns[tree] = call
            ms = alternate(fns, args.rounds)
            identical = all(same_bits(a, b) for a, b in zip(outs["base"], outs["this"], strict=True))
            width = outs["this"][0].shape[1] * (2 if name == "gate_up" else 1)
            flop = 2.0 * m * k_in * width * args.layers
            print(f"linear {name} {m} rows x {args.layers} layers: base {ms['base']:.3f} ms "
                  f"({flop / ms['base'] / 1e6:.0f} GFLOP/s), this {ms['this']:.3f} ms ({flop / ms['this'] / 1e6:.0f}), "
                  f"x{ms['base'] / ms['this']:.2f}; bit-identical: {identical}", flush=True)
            rows.append({"part": "linear", "projection": name, "rows": m, "layers": args.layers,
                         "base_ms": ms["base"], "this_ms": ms["this"], "bit_identical": identical})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, type=Path, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--parts", default="decode,mixed,prefill", help="decode, mixed, prefill, linear (AMX products)")
    p.add_argument("--linear-rows", default="8,32,64,128,200,512,2048", help="rows per product (linear)")
    p.add_argument("--layers", type=int, default=30, help="layers' caches per decode step")
    p.add_argument("--dot", choices=("on", "auto", "rule"), default="rule",
                   help="decode bf16_dot: rule (default): both trees as the backend chooses on this CPU; on: dot "
                        "products for both; auto: this tree as the backend chooses, the base tree dot products")
    p.add_argument("--prefill-dtypes", default="bfloat16,float32",
                   type=lambda v: [getattr(torch, d.strip()) for d in v.split(",")],
                   help="query/key/value dtypes of the prefill part")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds per case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.base.resolve() == ROOT:
        raise SystemExit("--base is this tree")
    torch.set_num_threads(args.threads)
    kernels = {"base": load_kernels(args.base), "this": load_kernels(ROOT)}
    if kernels["base"] is kernels["this"]:
        raise SystemExit("both trees build the same kernels (identical sources)")
    rows: list[dict[str, Any]] = []
    if "decode" in args.parts or "mixed" in args.parts:
        rows += run_decode(kernels, args)
    if "prefill" in args.parts:
        rows += run_prefill(kernels, args)
    if "linear" in args.parts:
        rows += run_linear(kernels, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"base": str(args.base), "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
