"""A model's HF-style config for ``ferry plan``, read without torch or transformers.

Converting a GGUF's config through transformers imports torch; the planner must start instantly and never load
weights, so it reads a GGUF's metadata with ``gguf.GGUFReader`` and maps the
``<arch>.*`` keys to the config fields transformers would produce. A Hugging Face
folder is read from its config.json. Names resolve through ``shared.models``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.models import resolve_model


@dataclass(frozen=True)
class PlannedModel:
    name: str
    config: dict[str, Any]
    file_bytes: int  # size of the GGUF file (quantized), 0 for a folder
    gguf_param_count: int  # exact element count from the GGUF tensors, 0 for a folder


def _scalar(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def config_from_gguf(path: Path) -> tuple[dict[str, Any], int]:
    """(HF config dict, parameter count) from a GGUF file's metadata and tensor table."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(_scalar(reader, "general.architecture") or "llama")

    def get(suffix: str) -> Any:
        return _scalar(reader, f"{arch}.{suffix}")

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = get("attention.head_count_kv")
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    tensor_names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "model_type": arch,
        "num_hidden_layers": int(get("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or 4 * hidden),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads if num_kv_heads is not None else num_heads),
        "head_dim": int(get("attention.key_length") or hidden // num_heads),
        "max_position_embeddings": int(get("context_length") or 2048),
        "vocab_size": int(vocab),
        # No separate output matrix in the file means the lm_head reuses the embeddings.
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    experts = get("expert_count")
    if experts:
        config["num_local_experts"] = int(experts)
        config["moe_intermediate_size"] = int(get("expert_feed_forward_length") or config["intermediate_size"])
    params = sum(int(t.n_elements) for t in reader.tensors)
    return config, params


def load_planned_model(name: str) -> PlannedModel:
    """Resolve ``name`` like the worker does and read only its config."""
    source = resolve_model(name)
    if source.kind == "hf_dir":
        with open(source.path / "config.json") as f:
            return PlannedModel(name, dict(json.load(f)), 0, 0)
    config, params = config_from_gguf(source.path)
    return PlannedModel(name, config, source.path.stat().st_size, params)
