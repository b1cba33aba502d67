"""Stage: ``--deterministic`` on the device (docs/api.md, "Deterministic outputs").

The default model's architecture (random weights, bf16). Seeded requests (temperature 1,
top-p, logprobs) are served each alone, then all together with repeats (prefix-cache hits),
a small step budget (chunked prompts), a warm cache and unseeded neighbours: with
``deterministic=True`` every seeded request must come back with the same tokens and
logprobs, bit for bit (the stage fails otherwise); without it the same mix is recorded as a
control. Then the cost: a common-load-shaped burst (64 prompts of 200 tokens, 64 greedy
tokens each) with and without the flag, alternating, three pairs, out tok/s and the median
ratio.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tests.device.common import SMOLLM2_135M, TINY, Options, SkipStage, Stage, build_model_folder, run_stage

PROMPT_LENS = (5, 17, 40, 64, 100, 129, 250, 300)
MAX_TOKENS = 32


def _engine(model_dir: str, device: str, deterministic: bool, **knobs: Any) -> Any:
    from services.engine.offline import LLM

    return LLM(model=model_dir, dtype="bfloat16", device=device, kv_cache_memory=512 << 20, max_num_seqs=64,
               deterministic=deterministic, **knobs)


def _bits(out: Any) -> tuple[Any, ...]:
    return tuple(out.token_ids), repr(out.logprobs)


def mix_check(model_dir: str, device: str, vocab: int, deterministic: bool) -> tuple[int, int]:
    """(seeded requests equal to alone, seeded requests checked)."""
    import torch

    from services.engine.offline import GenerationParams

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[3] = prompts[6][:40] + prompts[3][40:]  # a shared prefix
    params = [GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=100 + i, logprobs=2,
                               ignore_eos=True) for i in range(len(prompts))]
    solo = _engine(model_dir, device, deterministic, enable_prefix_caching=False)
    alone = [_bits(solo.generate([p], g, decode=False)[0]) for p, g in zip(prompts, params, strict=True)]
    del solo
    mixed = _engine(model_dir, device, deterministic, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    mixed.generate([prompts[6]], params[6], decode=False)  # warm the prefix cache
    order = [2, 0, 5, 6, 1, 7, 3, 4, 2, 6]
    neighbours = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 33, 70, 150) * 6]
    noise = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True)
    outs = mixed.generate([prompts[i] for i in order] + neighbours,
                          [params[i] for i in order] + [noise] * len(neighbours), decode=False)
    equal = sum(_bits(out) == alone[i] for i, out in zip(order, outs, strict=False))
    return equal, len(order)


def throughput(model_dir: str, device: str, vocab: int, deterministic: bool, num: int, prompt_len: int) -> float:
    import torch

    from services.engine.offline import GenerationParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num)]
    llm = _engine(model_dir, device, deterministic, max_num_batched_tokens=2048)
    llm.generate([[1, 2, 3]], GenerationParams(max_tokens=2), decode=False)  # warm-up
    params = GenerationParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, decode=False)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del llm
    return sum(len(o.token_ids) for o in outs) / wall


def body(opts: Options, stage: Stage) -> None:
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SkipStage("no CUDA device")
    arch = TINY if opts.cpu_dry_run else SMOLLM2_135M
    model_dir = str(build_model_folder(opts.model_dir, arch))
    vocab = arch["vocab_size"]
    equal, checked = mix_check(model_dir, opts.device, vocab, deterministic=True)
    stage.record("deterministic_equal_to_alone", f"{equal}/{checked}")
    control, _ = mix_check(model_dir, opts.device, vocab, deterministic=False)
    stage.record("default_equal_to_alone", f"{control}/{checked}")
    if equal != checked:
        stage.data["status"] = "fail"
        stage.data["error"] = f"--deterministic: {checked - equal}/{checked} seeded requests differ from alone"
    num, prompt_len = (8, 40) if opts.cpu_dry_run else (64, 200)
    pairs = []
    for _ in range(1 if opts.cpu_dry_run else 3):
        base = throughput(model_dir, opts.device, vocab, False, num, prompt_len)
        det = throughput(model_dir, opts.device, vocab, True, num, prompt_len)
        pairs.append({"default_out_tok_s": round(base, 1), "deterministic_out_tok_s": round(det, 1)})
        stage.record("pairs", pairs)
    ratio = statistics.median(p["deterministic_out_tok_s"] / p["default_out_tok_s"] for p in pairs)
    stage.record("deterministic_over_default_median", round(ratio, 3))


if __name__ == "__main__":
    run_stage("determinism", body)
