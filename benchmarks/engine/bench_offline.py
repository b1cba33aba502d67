"""Offline throughput: ferry's engine vs transformers ``generate`` (static batches) and
transformers' continuous batching, on one mixed workload, in one process run.

    python -m benchmarks.engine.bench_offline --out results/bench-offline.json   (make bench-offline)

Workload (seeded): short chats sharing a system prompt, plus long documents, with
varied output lengths. Every request generates exactly its ``max_tokens`` (EOS
ignored) so all systems produce the same useful tokens:

- ferry: ``LLM.generate`` (scheduler + paged-KV runner, chunked prefill, prefix caching);
- hf-static: ``model.generate`` in fixed batches of ``--static-batch-size`` prompts in
  arrival order, left-padded, each batch running to its longest ``max_tokens`` (only
  each request's own tokens are counted);
- hf-cb: transformers' continuous batching manager, the engine behind ``generate_batch``,
  fed with ``add_request(..., max_new_tokens=<per request>)`` exactly as ``generate_batch``
  feeds it (``generate_batch`` itself takes one ``max_new_tokens`` for all requests).

Reports output tokens/s and total (prompt + output) tokens/s by wall clock, plus the
process CPU seconds (a check on how much the shared machine interfered), and the
ratios of ferry to each baseline per dtype. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_io import openmp_policy
from services.engine.offline import LLM, GenerationParams
from services.worker.model.lean_forward import DECODE_LAYER_PARTS
from services.worker.runner import set_num_threads


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    kinds: list[str]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Run:
    system: str
    dtype: str
    threads: int
    wall_s: float
    cpu_s: float
    output_tokens: int
    total_tokens: int
    output_tok_s: float
    total_tok_s: float
    settings: dict[str, Any]
    profile: dict[str, Any] | None = None


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    if args.workload == "common":
        # The common load: distinct fixed-length prompts, fixed output length.
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        return Workload(prompts, [args.max_tokens] * args.num_prompts, ["common"] * args.num_prompts)
    system = [rng.randrange(1000, 40000) for _ in range(32)]  # shared by every chat
    items: list[tuple[list[int], int, str]] = []
    for _ in range(args.num_chats):
        user = [rng.randrange(1000, 40000) for _ in range(rng.randint(*args.chat_prompt))]
        items.append((system + user, rng.randint(*args.chat_output), "chat"))
    for _ in range(args.num_docs):
        doc = [rng.randrange(1000, 40000) for _ in range(rng.randint(*args.doc_prompt))]
        items.append((doc, rng.randint(*args.doc_output), "doc"))
    rng.shuffle(items)
    return Workload([p for p, _, _ in items], [m for _, m, _ in items], [k for _, _, k in items])


def timed(system: str, dtype: str, threads: int, work: Workload, settings: dict[str, Any], fn: Any) -> Run:
    t0, c0 = time.perf_counter(), time.process_time()
    produced = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if produced != work.num_output_tokens:
        raise RuntimeError(f"{system}: produced {produced} output tokens, expected {work.num_output_tokens}")
    total = work.num_prompt_tokens + produced
    run = Run(system, dtype, threads, wall, cpu, produced, total, produced / wall, total / wall, settings)
    print(f"{system:10s} {dtype:9s} threads={threads} wall {wall:7.1f}s cpu {cpu:7.1f}s  "
          f"output {run.output_tok_s:7.1f} tok/s  total {run.total_tok_s:7.1f} tok/s", flush=True)
    return run


def run_ferry(work: Workload, dtype: str, args: argparse.Namespace) -> Run:
    settings = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=True, enable_chunked_prefill=True,
                    attention_backend=args.attention_backend, quantization=args.quantization,
                    kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=dtype, num_threads=args.threads, **settings)  # type: ignore[arg-type]
    llm.generate([[1, 2, 3]], GenerationParams(max_tokens=2))  # warm-up: first-call allocations
    settings["attention_backend"] = llm.runner.attn_backend.name
    settings["startup_s"] = round(time.perf_counter() - t0, 2)

    def go() -> int:
        params = [GenerationParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
        outs = llm.generate(work.prompts, params, decode=False)
        return sum(len(o.token_ids) for o in outs)

    if args.attention_share:
        return _with_attention_share(llm, lambda: timed("ferry", dtype, args.threads, work, settings, go))
    if not args.profile:
        return timed("ferry", dtype, args.threads, work, settings, go)
    from .bench_profile import profile_shares

    # One pass, under the profiler (a busy shared machine cannot spare two): its tok/s
    # include cProfile's overhead, so compare them only with other profiled runs.
    settings["under_cprofile"] = True
    holder: dict[str, Run] = {}
    shares = profile_shares(
        lambda: holder.setdefault("run", timed("ferry", dtype, args.threads, work, settings, go)),
        llm.runner.model, llm.runner.sampler, llm.runner.lean, llm.runner.attn_backend,
    )
    run = holder["run"]
    run.profile = shares
    return run


def _with_attention_share(llm: LLM, fn: Any) -> Run:
    """Run ``fn`` with the attention backend's ``forward`` and each step's forward timed by
    wall clock: the share of the forward (pack, decoder body, LM head; ``forward_s`` of the
    worker's step result, as /metrics reports it) spent inside the attention backend, whose
    calls are each layer's cache write, decode kernel, prompt kernels and SDPA fallbacks, and
    the same work inside a decode step's one-call layers (its own part clocks). No profiler:
    two clock reads per call, so the throughput stays comparable with plain runs."""
    runner, backend = llm.runner, llm.runner.attn_backend
    lean = runner.lean if getattr(runner.lean, "decode_args", None) is not None else None
    inner_forward, inner_execute = backend.forward, runner.execute
    acc = {"attention_s": 0.0, "forward_s": 0.0, "calls": 0}

    def forward(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner_forward(*a, **kw)
        finally:
            acc["attention_s"] += time.perf_counter() - t0
            acc["calls"] += 1

    def execute(plan: Any) -> Any:
        result = inner_execute(plan)
        acc["forward_s"] += result.forward_s
        return result

    before = [(obj, name, vars(obj).get(name)) for obj, name in ((backend, "forward"), (runner, "execute"))]
    backend.forward, runner.execute = forward, execute  # type: ignore[method-assign]
    part_times = torch.zeros(2, len(DECODE_LAYER_PARTS), dtype=torch.float64)
    if lean is not None:
        lean.part_times = part_times
    try:
        run = fn()
    finally:  # as they were: the class's methods, or whatever wrapper was there before
        for obj, name, old in before:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        if lean is not None:  # wall seconds, as the calls timed above
            acc["attention_s"] += float(part_times[0, DECODE_LAYER_PARTS.index("attention")])
            lean.part_times = None
    share = acc["attention_s"] / acc["forward_s"] if acc["forward_s"] else 0.0
    run.profile = {"attention_s": round(acc["attention_s"], 4), "forward_s": round(acc["forward_s"], 4),
                   "attention_calls": acc["calls"], "attention_share_of_forward": round(share, 4),
                   "backend": backend.name}
    print(f"attention ({backend.name}): {acc['attention_s']:.3f} s of the forward's {acc['forward_s']:.3f} s "
          f"= {100 * share:.1f} % ({acc['calls']} calls)", flush=True)
    return run


def _hf_model(args: argparse.Namespace, dtype: str, attn: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    from services.worker.loader import DTYPES, model_dir
    from shared.models import resolve_model

    folder = model_dir(resolve_model(args.model))
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn:
        kwargs["attn_implementation"] = attn
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def run_hf_static(work: Workload, dtype: str, args: argparse.Namespace) -> Run:
    model = _hf_model(args, dtype)
    pad = 0
    bsz = args.static_batch_size

    def go() -> int:
        produced = 0
        for start in range(0, len(work.prompts), bsz):
            batch = work.prompts[start : start + bsz]
            wants = work.max_tokens[start : start + bsz]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max(wants), min_new_tokens=max(wants),
                                     do_sample=False, eos_token_id=None, pad_token_id=pad)
            produced += sum(min(w, out.shape[1] - width) for w in wants)
        return produced

    return timed("hf-static", dtype, args.threads, work, {"batch_size": bsz, "attn": "sdpa"}, go)


def run_hf_cb(work: Workload, dtype: str, args: argparse.Namespace) -> Run:
    from transformers import GenerationConfig

    model = _hf_model(args, dtype, attn="paged|sdpa")
    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_tokens), eos_token_id=-1, pad_token_id=0)

    def go() -> int:
        produced = 0
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            for i, (prompt, want) in enumerate(zip(work.prompts, work.max_tokens, strict=True)):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=want, eos_token_id=-1)
            done = 0
            while done < len(work.prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    produced += len(result.generated_tokens)
                    done += 1
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
        return produced

    return timed("hf-cb", dtype, args.threads, work, {"attn": "paged|sdpa"}, go)


def batch_invariance(args: argparse.Namespace) -> dict[str, Any]:
    """How often a greedy output differs between running alone and inside the whole batch."""
    work = make_workload(args)
    report: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        llm = LLM(model=args.model, dtype=dtype, num_threads=args.threads, kv_cache_memory=args.kv_cache_memory,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
        params = [GenerationParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
        together = llm.generate(work.prompts, params, decode=False)
        differ, first_diffs = 0, []
        for prompt, p, out in zip(work.prompts, params, together, strict=True):
            alone = llm.generate([prompt], p, decode=False)[0].token_ids
            if alone != out.token_ids:
                differ += 1
                first_diffs.append(next(i for i, (a, b) in enumerate(zip(alone, out.token_ids, strict=True)) if a != b))
        report[dtype] = {"requests": len(work.prompts), "differ": differ, "first_diff_positions": first_diffs}
        print(f"batch invariance {dtype}: {differ}/{len(work.prompts)} greedy outputs differ alone vs batched "
              f"(first differing positions {first_diffs})", flush=True)
    return report


def _isolated(system: str, dtype: str, argv: list[str]) -> Run:
    """One system in a fresh process: no thread pools, allocator state or leaked threads carry over."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "benchmarks.engine.bench_offline", *argv, "--one", f"{system}@{dtype}",
               "--out", str(out)]
        subprocess.run(cmd, check=True)
        return Run(**json.loads(out.read_text()))


SYSTEMS = {"ferry": run_ferry, "hf-static": run_hf_static, "hf-cb": run_hf_cb}


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.bench_offline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--systems", default="ferry,hf-static,hf-cb")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core this process may use)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-chats", type=int, default=32)
    p.add_argument("--num-docs", type=int, default=6)
    p.add_argument("--chat-prompt", type=_pair, default=(20, 120), help="user-turn tokens, min,max")
    p.add_argument("--chat-output", type=_pair, default=(32, 160))
    p.add_argument("--doc-prompt", type=_pair, default=(400, 900))
    p.add_argument("--doc-output", type=_pair, default=(16, 64))
    p.add_argument("--workload", choices=["mixed", "common"], default="mixed",
                   help="mixed: chats + documents; common: --num-prompts distinct prompts of --prompt-len tokens, "
                        "--max-tokens each (the issue-11 load: 64 x 200 -> 64)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (a float8 e4m3 KV cache)")
    p.add_argument("--deterministic", action="store_true", help="ferry: batch-invariant numerics (docs/api.md)")
    p.add_argument("--profile", action="store_true", help="ferry only: time the workload under cProfile, with shares")
    p.add_argument("--attention-share", action="store_true",
                   help="ferry only: wall-clock share of the forward spent in the attention backend (no profiler)")
    p.add_argument("--gemm-limit", action="store_true",
                   help="measure matmul rates at the model's shapes and the trace's GEMM limit, per dtype")
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--out", default="results/bench-offline.json")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # SYSTEM@DTYPE, run in a child process
    p.add_argument("--invariance", action="store_true",
                   help="instead: count greedy outputs that differ alone vs batched, per dtype")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.threads = set_num_threads(args.threads)
    if args.invariance:
        report = batch_invariance(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        return 0
    work = make_workload(args)
    if not args.one:
        kinds = f"{args.num_chats} chats, {args.num_docs} docs" if args.workload == "mixed" else "common"
        print(f"workload: {len(work.prompts)} requests ({kinds}), "
              f"{work.num_prompt_tokens} prompt + {work.num_output_tokens} output tokens; threads {args.threads}")
    if args.one:
        system, dtype = args.one.split("@")
        run = SYSTEMS[system](work, dtype, args)
        Path(args.out).write_text(json.dumps(asdict(run)))
        return 0
    limit = None
    if args.gemm_limit:
        from services.worker.loader import model_dir
        from shared.models import resolve_model

        from .bench_profile import gemm_limit

        config = json.loads((model_dir(resolve_model(args.model)) / "config.json").read_text())
        limit = gemm_limit(config, work.num_prompt_tokens, work.num_output_tokens, len(work.prompts), ["float32", "bfloat16"],
                           prefill_m=args.max_num_batched_tokens, decode_m=min(args.max_num_seqs, len(work.prompts)))
    runs = [_isolated(system, dtype, argv)
            for dtype in args.dtypes.split(",") for system in args.systems.split(",")]
    ratios: dict[str, dict[str, float]] = {}
    for run in runs:
        if run.system == "ferry":
            continue
        ferry = next((r for r in runs if r.system == "ferry" and r.dtype == run.dtype), None)
        if ferry is not None:
            key = f"ferry/{run.system}@{run.dtype}"
            ratios[key] = {"output": ferry.output_tok_s / run.output_tok_s, "total": ferry.total_tok_s / run.total_tok_s}
            print(f"{key:28s} output x{ratios[key]['output']:.2f}  total x{ratios[key]['total']:.2f}")
    best = {r.system: max((x for x in runs if x.system == r.system), key=lambda x: x.output_tok_s) for r in runs}
    if "ferry" in best:
        for system, run in best.items():
            if system != "ferry":
                key = f"ferry@{best['ferry'].dtype}/{system}@{run.dtype} (best dtype each)"
                ratios[key] = {"output": best["ferry"].output_tok_s / run.output_tok_s,
                               "total": best["ferry"].total_tok_s / run.total_tok_s}
                print(f"{key:28s} output x{ratios[key]['output']:.2f}  total x{ratios[key]['total']:.2f}")
    report = {
        "command": "python -m benchmarks.engine.bench_offline " + " ".join(argv),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "torch": torch.__version__, "loadavg": os.getloadavg(), "openmp": openmp_policy()},
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        "num_prompt_tokens": work.num_prompt_tokens, "num_output_tokens": work.num_output_tokens,
        "runs": [asdict(r) for r in runs], "ratios": ratios, "gemm_limit": limit,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
