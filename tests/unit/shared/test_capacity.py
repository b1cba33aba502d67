"""shared.capacity against numbers computed by hand from public configs.

The configs are written out here (no hub): Llama-2-7B (multi-head attention),
Llama-3-8B (grouped-query, 8 KV heads), Falcon-7B (multi-query, 1 KV head).
Their published parameter counts are 6,738,415,616, 8,030,261,248 and
6,921,720,704; the sums are spelled out so a wrong term shows which one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import capacity as cap

LLAMA2_7B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float16",
}
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
FALCON_7B = {
    "model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
    "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "bias": False,
    "vocab_size": 65024,
}
SMOLLM2_135M = {  # what transformers makes of the built-in GGUF
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("config", "shape", "bf16_bytes"),
    [
        (LLAMA2_7B, (32, 32, 128), 2 * 32 * 32 * 128 * 2),  # 512 KiB: MHA keeps every head
        (LLAMA3_8B, (32, 8, 128), 2 * 32 * 8 * 128 * 2),  # 128 KiB: 4 query heads share a KV head
        (FALCON_7B, (32, 1, 64), 2 * 32 * 1 * 64 * 2),  # 8 KiB: one KV head for all 71
        (SMOLLM2_135M, (30, 3, 64), 2 * 30 * 3 * 64 * 2),
    ],
)
def test_kv_bytes_per_token_mha_gqa_mqa(config: dict, shape: tuple[int, int, int], bf16_bytes: int) -> None:
    assert cap.kv_shape_from_config(config) == shape
    assert cap.kv_bytes_per_token(config, "bfloat16") == bf16_bytes
    assert cap.kv_bytes_per_token(config, "fp8") == bf16_bytes // 2
    assert cap.kv_bytes_per_token(config, "float32") == bf16_bytes * 2


def test_published_sizes() -> None:
    assert cap.kv_bytes_per_token(LLAMA2_7B, "bfloat16") == 524_288
    assert cap.kv_bytes_per_token(LLAMA3_8B, "bfloat16") == 131_072
    assert cap.kv_bytes_per_token(SMOLLM2_135M, "bfloat16") == 23_040


def test_llama2_7b_parameters() -> None:
    counts = cap.count_parameters(LLAMA2_7B)
    assert counts.embeddings == 32000 * 4096
    assert counts.lm_head == 32000 * 4096  # untied
    assert counts.attention == 32 * 4 * 4096 * 4096
    assert counts.mlp == 32 * 3 * 4096 * 11008
    assert counts.norms == (32 * 2 + 1) * 4096
    assert counts.total == 6_738_415_616
    assert cap.weight_bytes(LLAMA2_7B, "bfloat16") == 2 * 6_738_415_616


def test_llama3_8b_parameters_with_gqa() -> None:
    counts = cap.count_parameters(LLAMA3_8B)
    assert counts.attention == 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024)  # k and v are 8 heads x 128
    assert counts.mlp == 32 * 3 * 4096 * 14336
    assert counts.total == 8_030_261_248
    assert cap.weight_bytes(LLAMA3_8B, "float32") == 4 * 8_030_261_248


def test_falcon_7b_parameters_with_mqa_and_parallel_attention() -> None:
    counts = cap.count_parameters(FALCON_7B)
    assert counts.attention == 32 * (4544 * (71 * 64 + 2 * 64) + 4544 * 4544)
    assert counts.mlp == 32 * 2 * 4544 * 18176  # ungated, 4x hidden
    assert counts.norms == (32 * 1 + 1) * 2 * 4544  # one LayerNorm per block (parallel attention), with bias
    assert counts.lm_head == 0  # tied
    assert counts.total == 6_921_720_704


def test_smollm2_parameters_match_the_gguf_tensor_count() -> None:
    # 134,515,008 is the sum of every tensor's element count in the built-in GGUF.
    assert cap.count_parameters(SMOLLM2_135M).total == 134_515_008


def test_qwen2_counts_qkv_biases() -> None:
    qwen = {**LLAMA3_8B, "model_type": "qwen2"}
    assert cap.count_parameters(qwen).attention - cap.count_parameters(LLAMA3_8B).attention == 32 * (4096 + 2 * 1024)


def test_num_kv_blocks_floors_to_whole_blocks() -> None:
    block = 131_072 * 16  # Llama-3-8B, bf16, 16 tokens: 2 MiB
    assert cap.kv_block_bytes(LLAMA3_8B, "bfloat16", 16) == block
    assert cap.num_kv_blocks(1 << 30, LLAMA3_8B, "bfloat16", 16) == 512
    assert cap.num_kv_blocks((1 << 30) - 1, LLAMA3_8B, "bfloat16", 16) == 511
    assert cap.num_kv_blocks(1 << 30, LLAMA3_8B, "fp8", 16) == 1024
    assert cap.num_kv_blocks(block - 1, LLAMA3_8B, "bfloat16", 16) == 0
    assert cap.num_kv_blocks(-5, LLAMA3_8B, "bfloat16", 16) == 0
    with pytest.raises(ValueError, match="block_size"):
        cap.num_kv_blocks(1 << 30, LLAMA3_8B, "bfloat16", 0)


def test_concurrency_counts_partial_last_blocks() -> None:
    assert cap.blocks_for_tokens(8192, 16) == 512
    assert cap.blocks_for_tokens(8193, 16) == 513
    assert cap.max_concurrency(1024, 8192, 16) == 2
    assert cap.max_concurrency(1025, 8193, 16) == 1  # 513 blocks each: two need 1026
    assert cap.max_concurrency(511, 8192, 16) == 0


def test_gpu_budget_subtracts_everything_and_never_goes_negative() -> None:
    assert cap.gpu_kv_budget_bytes(1000, 0.9, 500, 100, 50, 20) == 900 - 670
    assert cap.gpu_kv_budget_bytes(1000, 0.5, 500, 100) == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cap.gpu_kv_budget_bytes(1000, 1.5, 0, 0)


def test_activation_peak_scales_with_tokens_and_counts_fp32_logits() -> None:
    small = cap.activation_peak_bytes(SMOLLM2_135M, "bfloat16", 1, 1)
    per_token = (3 * 576 + (9 + 2 * 3) * 64 + 3 * 1536) * 2
    assert small == per_token + 2 * 49152 * 4
    assert cap.activation_peak_bytes(SMOLLM2_135M, "bfloat16", 2048, 1) == 2048 * per_token + 2 * 49152 * 4


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    # resolve_dtype("auto", "cpu") follows this detection; the machine running the tests
    # says nothing about it, so feed it cpuinfo files with and without the flags.
    def cpuinfo(flags: str) -> str:
        path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
        path.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        return str(path)

    assert cap.cpu_has_native_bf16(cpuinfo("fpu sse avx2 avx512f avx512_bf16 avx512_vnni")) is True
    assert cap.cpu_has_native_bf16(cpuinfo("fpu avx2 amx_tile amx_bf16 amx_int8")) is True
    assert cap.cpu_has_native_bf16(cpuinfo("fpu sse avx2 avx512f avx512_fp16")) is False
    assert cap.cpu_has_native_bf16(str(tmp_path / "missing")) is False
    no_flags = tmp_path / "no-flags"
    no_flags.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an ARM cpuinfo has no "flags"
    assert cap.cpu_has_native_bf16(str(no_flags)) is False


def test_dtype_names() -> None:
    assert cap.normalize_dtype("bf16") == "bfloat16"
    assert cap.normalize_dtype("fp8_e4m3") == "fp8"
    assert cap.resolve_dtype("auto", "cpu", cpu_bf16=False) == "float32"  # as the worker's loader decides
    assert cap.resolve_dtype("auto", "cpu", cpu_bf16=True) == "bfloat16"
    assert cap.resolve_dtype("auto", "cpu") == ("bfloat16" if cap.cpu_has_native_bf16() else "float32")
    assert cap.resolve_dtype("auto", "gpu") == "bfloat16"
    assert cap.resolve_kv_dtype("auto", "float32") == "float32"
    assert cap.resolve_kv_dtype("fp8", "bfloat16") == "fp8"
    with pytest.raises(ValueError, match="unknown dtype"):
        cap.normalize_dtype("int3")
