"""Stage 2: ferry's engine against transformers ``generate`` on the same device.

- float32: greedy tokens must match token for token (prompts of mixed lengths, so
  steps mix prefill chunks and decodes, and decode-only steps replay CUDA graphs);
- bfloat16: ferry's logprobs of its own greedy tokens against transformers' float32
  logprobs of the same sequence (teacher-forced), and the fraction of positions
  where bf16 greedy picks the float32 argmax.

The model has the default model's architecture with random weights (common.py says why).
"""

from __future__ import annotations

from typing import Any

from tests.device.common import SMOLLM2_135M, TINY, Options, SkipStage, Stage, build_model_folder, run_stage

PROMPT_LENS = (5, 17, 33, 64, 100, 129)
MAX_TOKENS = 32
# Pass thresholds for bf16 against the float32 model (documented in docs/benchmarks.md).
BF16_MEAN_LOGPROB_DIFF = 0.15
BF16_TOP1_AGREEMENT = 0.9


def prompts(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_greedy(model_dir: str, ids: list[list[int]], device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).eval()
    # No EOS: exactly MAX_TOKENS greedy tokens, like ferry's ignore_eos (min_new_tokens would
    # instead mask EOS and pick the runner-up where EOS is the argmax).
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in ids:  # one at a time: no padding, so nothing but the kernels differs
            x = torch.tensor([p], device=device)
            g = model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    del model
    return out


def hf_logprobs(model_dir: str, seqs: list[tuple[list[int], list[int]]], device: str) -> list[list[float]]:
    """float32 logprob of each generated token given everything before it, and the argmax."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).eval()
    result = []
    with torch.inference_mode():
        for prompt, gen in seqs:
            x = torch.tensor([prompt + gen], device=device)
            logp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
            rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
            picked = rows.gather(1, torch.tensor(gen, device=device)[:, None])[:, 0]
            result.append(list(zip(picked.tolist(), rows.argmax(-1).tolist(), strict=True)))
    del model
    return result


def ferry_generate(model_dir: str, ids: list[list[int]], dtype: str, device: str,
                   logprobs: bool) -> tuple[list[Any], int]:
    from services.engine.offline import LLM, GenerationParams

    llm = LLM(model=model_dir, dtype=dtype, device=device, kv_cache_memory=256 << 20, max_num_batched_tokens=128,
              max_num_seqs=8)
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                              logprobs=0 if logprobs else None)
    outs = llm.generate(ids, params, decode=False)
    graphs = getattr(llm.runner, "graphs", None)
    replays = graphs.num_replays if graphs is not None else 0
    del llm
    return outs, replays


def body(opts: Options, stage: Stage) -> None:
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SkipStage("no CUDA device")
    arch = TINY if opts.cpu_dry_run else SMOLLM2_135M
    model_dir = str(build_model_folder(opts.model_dir, arch))
    ids = prompts(arch["vocab_size"])
    expected = hf_greedy(model_dir, ids, opts.device)
    outs, replays = ferry_generate(model_dir, ids, "float32", opts.device, logprobs=False)
    got = [o.token_ids for o in outs]
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    first_diff = {str(i): next((j for j, (x, y) in enumerate(zip(got[i], expected[i], strict=False)) if x != y),
                               min(len(got[i]), len(expected[i]))) for i in mismatches}
    stage.record("fp32_prompts", len(ids))
    stage.record("fp32_token_exact", len(mismatches) == 0)
    stage.record("fp32_first_mismatch_by_prompt", first_diff)
    stage.record("fp32_graph_replays", replays)
    if mismatches:
        stage.data["status"] = "fail"
        stage.data["error"] = f"{len(mismatches)}/{len(ids)} prompts differ from transformers generate in float32"
    outs16, _ = ferry_generate(model_dir, ids, "bfloat16", opts.device, logprobs=True)
    ref = hf_logprobs(model_dir, [(p, o.token_ids) for p, o in zip(ids, outs16, strict=True)], opts.device)
    diffs: list[float] = []
    agree = total = 0
    for o, r in zip(outs16, ref, strict=True):
        for lp, (ref_lp, _) in zip(o.logprobs or [], r, strict=False):
            diffs.append(abs(lp.sampled.logprob - ref_lp))
        agree += sum(1 for t, (_, top) in zip(o.token_ids, r, strict=False) if t == top)
        total += len(r)
    mean = sum(diffs) / max(1, len(diffs))
    stage.record("bf16_mean_abs_logprob_diff", round(mean, 4))
    stage.record("bf16_max_abs_logprob_diff", round(max(diffs, default=0.0), 4))
    stage.record("bf16_top1_agreement", round(agree / max(1, total), 4))
    # On the CPU dry run bf16 says nothing about the GPU's bf16 kernels: recorded, not judged.
    if not opts.cpu_dry_run and (mean > BF16_MEAN_LOGPROB_DIFF or agree / max(1, total) < BF16_TOP1_AGREEMENT):
        stage.data["status"] = "fail"
        stage.data["error"] = (stage.data.get("error", "") + " bf16 logprobs far from float32").strip()


if __name__ == "__main__":
    run_stage("exactness", body)
