"""Random-weight model folders for the benchmarks that need a shape ferry has no checkpoint of.

    python -m benchmarks.engine.build_models DIR [NAME ...]

Each is written once (SmolLM2's tokenizer, weights of spread 0.15 so greedy decoding is
decisive; tests/device/common.py's ``build_model_folder``) to DIR/NAME, for ``bench_offline
--model DIR/NAME``. Names: ``mistral-w128`` and ``mistral-w4096`` (SmolLM2-135M's dimensions,
sliding windows of 128 and 4,096 keys), ``qwen3-moe`` (a Qwen3-MoE: 8 layers 1,024 wide, 64
experts of 384 with 8 chosen per token, 8 query and 4 KV heads of 128).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _models() -> dict[str, dict[str, Any]]:
    from tests.device.common import SMOLLM2_135M

    return {
        "mistral-w128": dict(SMOLLM2_135M, model_type="mistral", sliding_window=128),
        "mistral-w4096": dict(SMOLLM2_135M, model_type="mistral", sliding_window=4096),
        "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                          num_experts=64, num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128, vocab_size=49152, max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, rms_norm_eps=1e-6),
    }


def main(argv: list[str] | None = None) -> int:
    from tests.device.common import build_model_folder

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__)
        return 2
    models = _models()
    names = args[1:] or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        print(f"unknown models {unknown}; known: {list(models)}", file=sys.stderr)
        return 2
    for name in names:
        print(build_model_folder(Path(args[0]) / name, models[name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
