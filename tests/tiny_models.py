"""Tiny random-weight Hugging Face model folders for tests (no hub, a few MB, seeded).

``build_tiny_model(tmp_path, "llama")`` writes a Llama with grouped-query
attention; ``"qwen2"`` a Qwen2 (biases on q/k/v). Each folder has config.json,
safetensors weights and the SmolLM2 tokenizer files (so the vocabulary, chat
template and EOS ids are real), and loads with ``--model <folder>``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # head size 64: the CPU prompt kernels' (csrc/prefill_attention.cpp) shapes, as real models have
    "llama-hd64": dict(
        model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
    ),
}


def tokenizer_files() -> Path:
    from shared.models import resolve_model, tokenizer_dir

    return tokenizer_dir(resolve_model("smollm2-135m-instruct"))


def build_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model of ``kind`` into ``folder`` and return the folder."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer_files()
    with open(tok / "config.json") as f:
        tok_config = json.load(f)
    values = dict(TINY_CONFIGS[kind])
    values.update(
        vocab_size=tok_config["vocab_size"], bos_token_id=tok_config.get("bos_token_id"),
        eos_token_id=tok_config.get("eos_token_id"), pad_token_id=tok_config.get("pad_token_id"),
    )
    values.update(overrides)
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform logits and many argmax ties; a larger
    # spread makes greedy decoding decisive, so token-for-token comparisons are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for path in tok.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, folder / path.name)
    return folder
