"""``python -m benchmarks.kernels.bench_prompt_attention``: the prompt attention kernel
(services/kernels/csrc/prefill_attention.cpp) against another version of it, side by
side in one process.

``--against`` names the other version: a git revision (its ``prefill_attention.cpp`` and the
headers beside it, read with ``git show``) or a directory holding them. Both are built as
extensions of their own (only the prompt kernels), then:

- ``kernel``: for each ``--shapes`` entry (prompt lengths, e.g. ``200x10,48`` = ten 200-token
  prompts and a 48-token chunk, as one step), ``--layers`` calls on distinct random ``--dtype``
  q/k/v (strided views of one q/k/v product, SmolLM2's 9 query and 3 KV heads of 64 by
  default), the two versions alternating round by round; medians, useful GFLOP/s (causal),
  the largest difference between the versions' outputs and each one's against float32 SDPA.
  ``--amx off`` runs both builds' bfloat16 kernels without AMX tiles (AVX512-BF16 dot products,
  the path of a CPU without AMX).
- ``model``: the default model in ``--dtype`` (bfloat16 unless told; ``auto`` as ``ferry
  serve`` chooses: float32 on a CPU without native bfloat16) on the common load (64 x 200-token prompts, 64
  output tokens, greedy; ``--num-prompts``, ``--prompt-len`` and ``--max-tokens`` change it, e.g. 32 x
  2,000 for the long-prompt load) through the offline engine, the CPU backend's prompt kernels switched
  between the two versions run by run (ABBA order); output tok/s and the seconds of prompt
  and decode steps per run.

Prints one line per measurement and writes JSON with ``--out``. Speed is measured here, never
asserted in a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_io import header, write_json

KERNEL = "prefill_attention.cpp"
HEADERS = ("vec512.h", "vec256.h", "work_split.h", "pool.h", "amx.h")
NEWER_HEADERS = frozenset({"pool.h"})  # absent from older revisions (work_split.h includes it since)


def _csrc() -> Path:
    from services.kernels.build import CSRC

    return CSRC


def _sources(against: str) -> tuple[str, dict[str, str]]:
    """The kernel's and its headers' text at ``against`` (a directory, else a git revision)."""
    folder = Path(against)
    if folder.is_dir():
        return str(folder), {n: (folder / n).read_text() for n in (KERNEL, *HEADERS)
                             if n not in NEWER_HEADERS or (folder / n).exists()}
    root = Path(__file__).resolve().parents[2]
    rel = _csrc().relative_to(root)
    texts = {}
    for name in (KERNEL, *HEADERS):
        shown = subprocess.run(["git", "show", f"{against}:{rel / name}"], cwd=root, capture_output=True, text=True)
        if shown.returncode != 0 and name in NEWER_HEADERS:
            continue
        if shown.returncode != 0:
            raise SystemExit(f"--against {against}: {shown.stderr.strip()}")
        texts[name] = shown.stdout
    rev = subprocess.run(["git", "rev-parse", "--short", against], cwd=root, capture_output=True, text=True)
    return rev.stdout.strip() or against, texts


def build(texts: dict[str, str]) -> Any:
    """The prompt kernels of these sources, built (cached by their hash) as an extension of their own."""
    from torch.utils.cpp_extension import load_inline

    from services.kernels.build import cflags as build_cflags
    from services.kernels.build import cpu_march

    cflags = build_cflags(cpu_march())
    key = hashlib.sha256(("".join(texts.get(n, "") for n in (KERNEL, *HEADERS)) + " ".join(cflags)).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"ferry_prompt_attention_{key}"
    folder.mkdir(exist_ok=True)
    for name in HEADERS:
        if name in texts:
            (folder / name).write_text(texts[name])
    return load_inline(name=f"ferry_prompt_attention_{key}", cpp_sources=[texts[KERNEL]],
                       functions=["prefill_attention", "prefill_attention_paged", "prefill_amx"], extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"], extra_include_paths=[str(folder)], verbose=False)


def _lengths(shape: str) -> list[int]:
    """``200x10,48`` -> ten 200s and a 48."""
    out: list[int] = []
    for part in shape.split(","):
        n, _, times = part.strip().partition("x")
        out += [int(n)] * int(times or 1)
    return out


def kernel(mods: dict[str, Any], shapes: list[str], layers: int, rounds: int, heads: int, kv_heads: int,
           head_dim: int, dtype: str = "bfloat16") -> list[dict[str, Any]]:
    return [_one_shape(mods, shape, layers, rounds, heads, kv_heads, head_dim, dtype) for shape in shapes]


def _one_shape(mods: dict[str, Any], shape: str, layers: int, rounds: int, heads: int, kv_heads: int,
               head_dim: int, dtype_name: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    lens = _lengths(shape)
    total = sum(lens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    spans = torch.tensor([[starts[i], starts[i + 1]] for i in range(len(lens))], dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    width = (heads + 2 * kv_heads) * head_dim
    dtype = getattr(torch, dtype_name)
    qkvs = [torch.randn(total, width, generator=gen).to(dtype) for _ in range(layers)]
    outs = {v: [torch.empty(total, heads, head_dim, dtype=dtype) for _ in qkvs] for v in mods}

    def views(x: Any) -> tuple[Any, Any, Any]:
        q = x[:, : heads * head_dim].view(total, heads, head_dim)
        k = x[:, heads * head_dim : (heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
        return q, k, x[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)

    def run(v: str) -> float:
        t0 = time.perf_counter()
        for x, o in zip(qkvs, outs[v], strict=True):
            mods[v].prefill_attention(*views(x), o, spans, head_dim**-0.5, True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in mods}
    for r in range(rounds + 1):  # the first round warms up
        for name in mods:
            seconds = run(name)
            if r:
                times[name].append(seconds)
    query, key, value = views(qkvs[0])
    ref = torch.empty(total, heads, head_dim)
    for a, b in spans.tolist():
        qq = query[a:b].float().transpose(0, 1)
        kk, vv = (x[a:b].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0) for x in (key, value))
        ref[a:b] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=head_dim**-0.5).transpose(0, 1)
    flop = layers * sum(4 * heads * head_dim * n * (n + 1) / 2 for n in lens)
    row: dict[str, Any] = {"shape": shape, "dtype": dtype_name, "layers": layers, "rounds": rounds}
    for name in mods:
        med = statistics.median(times[name])
        row[f"{name}_ms"] = round(med * 1e3, 3)
        row[f"{name}_gflops"] = round(flop / med / 1e9, 1)
        row[f"{name}_max_err_vs_sdpa"] = round(float((outs[name][0].float() - ref).abs().max()), 5)
    row["new_over_against"] = round(row["new_ms"] / row["against_ms"], 3)
    row["max_diff_between"] = round(max(float((a.float() - b.float()).abs().max())
                                        for a, b in zip(outs["new"], outs["against"], strict=True)), 5)
    print(f"kernel {shape}: against {row['against_ms']:.2f} ms, new {row['new_ms']:.2f} ms ({layers} calls) "
          f"new/against {row['new_over_against']:.3f}; GFLOP/s {row['against_gflops']:.0f} -> {row['new_gflops']:.0f}; "
          f"max |new - against| {row['max_diff_between']:.4f}", flush=True)
    return row


class _PromptKernels:
    """The CPU backend's kernel module with its prompt kernels taken from another build."""

    def __init__(self, base: Any, prompt: Any) -> None:
        self._base, self._prompt = base, prompt

    def __getattr__(self, name: str) -> Any:
        if name in ("prefill_attention", "prefill_attention_paged"):
            return getattr(self._prompt, name)
        return getattr(self._base, name)


def model(against: Any, runs: int, num_prompts: int = 64, prompt_len: int = 200, max_tokens: int = 64,
          dtype: str = "bfloat16") -> dict[str, Any]:
    from services.engine.offline import LLM, GenerationParams
    from services.worker.backends.cpu_paged import CpuPagedBackend

    llm = LLM(model="smollm2-135m-instruct", dtype=dtype, num_threads=2, max_num_batched_tokens=2048,
              max_num_seqs=128, enable_prefix_caching=False, enable_chunked_prefill=True)
    llm.generate([[1, 2, 3]], GenerationParams(max_tokens=2))
    runner, backend = llm.runner, llm.runner.attn_backend
    if not isinstance(backend, CpuPagedBackend) or backend.kernel is None:
        raise SystemExit(f"the {backend.name} backend has no prompt kernel here")
    kernels = {"against": _PromptKernels(backend.kernel, against), "new": backend.kernel}
    seconds = {"prompt": 0.0, "decode": 0.0}
    inner = runner.execute

    def execute(plan: Any) -> Any:
        result = inner(plan)
        prompt = plan.total_num_scheduled_tokens > len(plan.num_scheduled_tokens)  # a request with a chunk
        seconds["prompt" if prompt else "decode"] += result.forward_s
        return result

    runner.execute = execute  # type: ignore[method-assign]
    per: dict[str, list[dict[str, float]]] = {v: [] for v in kernels}
    try:
        for i in range(runs):
            for name in ("against", "new") if i % 2 == 0 else ("new", "against"):
                backend.kernel = kernels[name]
                rng = random.Random(100 + i)
                prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(num_prompts)]
                params = [GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * num_prompts
                seconds["prompt"] = seconds["decode"] = 0.0
                t0 = time.perf_counter()
                produced = sum(len(o.token_ids) for o in llm.generate(prompts, params, decode=False))
                wall = time.perf_counter() - t0
                run = {"out_tok_s": round(produced / wall, 1), "prompt_steps_s": round(seconds["prompt"], 3),
                       "decode_steps_s": round(seconds["decode"], 3)}
                per[name].append(run)
                print(f"model, run {i + 1} {name}: {run['out_tok_s']} out tok/s, prompt steps {run['prompt_steps_s']} s, "
                      f"decode steps {run['decode_steps_s']} s", flush=True)
    finally:
        backend.kernel = kernels["new"]
        del runner.execute
    out: dict[str, Any] = {"runs": per}
    for name, rows in per.items():
        out[f"{name}_median"] = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    print(f"model, medians: against {out['against_median']}, new {out['new_median']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--against", required=True, help="a git revision or a directory with the other prefill_attention.cpp")
    p.add_argument("--parts", default="kernel,model", help="kernel, model or both")
    p.add_argument("--shapes", default="200x10,48;2000,48;500x4;64x32;16x128",
                   help="';'-separated steps of prompt lengths (kernel)")
    p.add_argument("--layers", type=int, default=30, help="calls per round, each on its own q/k/v (kernel)")
    p.add_argument("--rounds", type=int, default=11, help="rounds of both versions (kernel)")
    p.add_argument("--heads", default="9,3", help="query heads, KV heads (kernel)")
    p.add_argument("--head-dim", type=int, default=64, help="64 or 128 (kernel)")
    p.add_argument("--runs", type=int, default=6, help="runs of the common load, alternating (model)")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts a run (model)")
    p.add_argument("--prompt-len", type=int, default=200, help="tokens a prompt (model; 2000: the long-prompt load)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated a prompt (model)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"),
                   help="q/k/v (kernel; auto: bfloat16) and the model's dtype (model)")
    p.add_argument("--amx", choices=("on", "off"), default="on",
                   help="off: both builds' bfloat16 kernels without AMX tiles, as on an AVX512-BF16 CPU without AMX (kernel)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as ferry serve gives its worker (read when OpenMP starts)
    import torch

    torch.set_num_threads(args.threads)
    label, texts = _sources(args.against)
    mods = {"against": build(texts), "new": build({n: (_csrc() / n).read_text() for n in (KERNEL, *HEADERS)})}
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    heads, kv_heads = (int(x) for x in args.heads.split(","))
    result = {**header("benchmarks.kernels.bench_prompt_attention", argv), "against": label}
    if args.amx == "off":
        for mod in mods.values():
            mod.prefill_amx(0)
    if "kernel" in parts:
        shapes = [s for s in args.shapes.split(";") if s.strip()]
        kernel_dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        result["kernel"] = kernel(mods, shapes, args.layers, args.rounds, heads, kv_heads, args.head_dim, kernel_dtype)
    if "model" in parts:
        result["model"] = model(mods["against"], args.runs, args.num_prompts, args.prompt_len, args.max_tokens,
                                dtype=args.dtype)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
