"""Exact or refused, never silently wrong: a walk over causal-LM families from transformers.

Each family is a tiny random model built here from its config (2 layers, 4 query heads, 16-wide
heads; grouped KV heads where the family has them), with what makes the family special turned
up so that it matters: soft-caps small enough to bite, logit scales far from 1, experts routed
two of four. Each is served by the offline engine in float32 under chunked prefill and must
either give transformers' own greedy tokens (eager attention, so soft-caps and sinks count)
with the logprobs of its forward within 1e-3, or be refused at load (``ModelRefused``) with a
message that names the architecture and the feature. At least 25 families must be served
exactly; docs/worker.md ("Model families") has the list and the result table.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.model.attention import ModelRefused
from tests.tiny_models import tokenizer_files

pytestmark = pytest.mark.slow

BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (config overrides, expected: "exact" or the feature a refusal must name)
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "llama": ({}, "exact"),
    "mistral": ({}, "exact"),
    "ministral": ({}, "exact"),
    "qwen2": ({}, "exact"),
    "qwen3": ({}, "exact"),
    "gemma": ({}, "exact"),
    "gemma2": (dict(attn_logit_softcapping=None, final_logit_softcapping=3.0), "exact"),
    "gemma3_text": (dict(sliding_window=512, final_logit_softcapping=3.0), "exact"),
    "phi": ({}, "exact"),
    "phi3": ({}, "exact"),
    "starcoder2": ({}, "exact"),
    "olmo": ({}, "exact"),
    "olmo2": ({}, "exact"),
    "cohere": (dict(logit_scale=0.25), "exact"),
    "cohere2": (dict(logit_scale=0.25), "exact"),
    "granite": (dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                     attention_multiplier=0.3), "exact"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "exact"),
    "qwen2_moe": (dict(MOE, shared_expert_intermediate_size=32), "exact"),
    "qwen3_moe": (MOE, "exact"),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2), "exact"),
    "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0), "exact"),
    "helium": ({}, "exact"),
    "smollm3": ({}, "exact"),
    "glm": ({}, "exact"),
    "arcee": ({}, "exact"),
    "seed_oss": ({}, "exact"),
    "ernie4_5": ({}, "exact"),
    "apertus": ({}, "exact"),
    "exaone4": ({}, "exact"),
    "internlm3": ({}, "exact"),
    "hunyuan_v1_dense": ({}, "exact"),
    "gpt_bigcode": ({}, "exact"),
    "gpt_neox": ({}, "exact"),
    "gptj": (dict(rotary_dim=8), "exact"),
    "gpt2": ({}, "exact"),
    "opt": (dict(word_embed_proj_dim=64, ffn_dim=128), "exact"),
    "codegen": (dict(rotary_dim=8), "exact"),
    "persimmon": ({}, "exact"),
    # attention variants (backends/variant.py), each turned up to bite: a soft-cap of 2, sinks of
    # unit size, windows of 8 keys where the prompts run to 38 tokens
    "gemma2-softcap": (dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=8), "exact"),
    "gemma3_text-window": (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                final_logit_softcapping=3.0), "exact"),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8), "exact"),
    "mistral-window": (dict(sliding_window=8), "exact"),
    "qwen2-window": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "exact"),
    "cohere2-window": (dict(logit_scale=0.25, sliding_window=8), "exact"),
    # refused, by name
    "bloom": ({}, "attention interface"),  # ALiBi, in its own attention code
    "falcon": (dict(new_decoder_architecture=True, num_kv_heads=2), "attention interface"),
    "stablelm": ({}, "do not pass their keyword arguments"),
    "nemotron": ({}, "do not pass their keyword arguments"),
}
PROMPTS = [[300 + i for i in range(20)] + [5, 6, 7], list(range(1000, 1030)), [7, 8, 9]]
MAX_TOKENS = 8


def _kind(family: str) -> str:
    return family.split("-")[0]


def build(family: str) -> Path:
    """The family's tiny model folder, built once per source of this file (cached like tiny_models')."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    overrides, _ = FAMILIES[family]
    key = hashlib.sha256(Path(__file__).read_bytes() + family.encode()).hexdigest()[:12]
    base = Path(os.environ.get("FERRY_TEST_CACHE", Path.home() / ".cache" / "ferry" / "test-models"))
    folder = base / f"family-{family}-{key}"
    if (folder / "config.json").is_file():
        return folder
    cls = CONFIG_MAPPING[_kind(family)]
    accepted = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    values = {k: v for k, v in BASE.items() if k in accepted}  # no stray GQA key for a family without it
    values.update(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **overrides)
    config = AutoConfig.for_model(_kind(family), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "sink" in name:
                p.normal_(0.0, 1.0)
    tmp = base / f".family-{family}-{key}-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    for path in tokenizer_files().iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, tmp / path.name)
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def transformers_greedy(folder: Path) -> tuple[Any, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    out = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return model, out


def serve(folder: Path) -> str:
    """'exact', or the refusal's message; an AssertionError where ferry is wrong."""
    model, want = transformers_greedy(folder)
    try:
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=32 << 20, num_threads=1,
                  max_num_batched_tokens=16, long_prefill_token_threshold=8)
    except ModelRefused as exc:
        return str(exc)
    outs = llm.generate(PROMPTS, GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                   logprobs=0))
    assert [o.token_ids for o in outs] == want, f"{folder.name}: greedy tokens differ from transformers'"
    with torch.no_grad():
        for p, o in zip(PROMPTS, outs, strict=True):
            logp = torch.log_softmax(model(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
            assert o.logprobs is not None
            for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                got, expected = lp.sampled.logprob, float(logp[len(p) - 1 + j, tok])
                assert abs(got - expected) <= 1e-3, f"{folder.name}: token {j} logprob {got} vs {expected}"
    return "exact"


RESULTS: dict[str, str] = {}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_served_exactly_or_refused_by_name(family: str) -> None:
    torch.set_num_threads(1)
    _, expected = FAMILIES[family]
    result = serve(build(family))
    RESULTS[family] = result
    if expected == "exact":
        assert result == "exact", f"{family}: refused, expected to be served exactly: {result}"
    else:
        assert result != "exact", f"{family}: served, though it needs {expected}"
        from transformers import CONFIG_MAPPING

        arch = CONFIG_MAPPING[_kind(family)].__name__.removesuffix("Config")
        assert arch.lower() in result.lower().replace("_", "") and expected in result, result


def test_at_least_25_of_30_or_more_families_are_exact() -> None:
    exact = [f for f, (_, e) in FAMILIES.items() if e == "exact"]
    assert len(FAMILIES) >= 30 and len(exact) >= 25
    print(json.dumps(RESULTS, indent=1))
