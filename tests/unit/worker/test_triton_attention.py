"""The Triton paged-attention kernels, run by Triton's interpreter on CPU tensors,
against the reference attention on random inputs (tests/device/attention_cases.py).

Shapes are small because the interpreter executes every program in numpy; the
same cases plus large ones run compiled on a GPU in tests/device/kernels.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.device.interpreter import enable_interpreter

if not enable_interpreter():  # before the kernels are imported: jit decides at decoration
    pytest.skip("triton is not installed (pip install -e '.[dev]')", allow_module_level=True)

import torch  # noqa: E402

from services.worker import backends  # noqa: E402
from services.worker.backends import triton_kernels as tk  # noqa: E402
from services.worker.backends.triton_backend import TritonBackend  # noqa: E402
from tests.device.attention_cases import AttentionCase, make_case, reference_attention  # noqa: E402

CPU = torch.device("cpu")


def run_triton(case: AttentionCase, num_splits: int | None = None, block_m: int = 16) -> torch.Tensor:
    backend = TritonBackend(CPU, num_splits=num_splits, prefill_block_m=block_m)
    backend.set_head_shape(case.query.shape[1], case.key.shape[1], case.query.shape[2])
    meta = backend.prepare(case.batch)
    return backend.forward(0, case.query, case.key, case.value, case.k_cache, case.v_cache, meta, case.scale)


def check(case: AttentionCase, num_splits: int | None = None, atol: float = 2e-5) -> None:
    ref_out, ref_k, ref_v = reference_attention(case)
    out = run_triton(case, num_splits)
    assert torch.equal(case.k_cache, ref_k), "KV write: keys differ from the reference"
    assert torch.equal(case.v_cache, ref_v), "KV write: values differ from the reference"
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=atol)


def bs_contexts(bs: int) -> list[tuple[int, int]]:
    """Decodes whose context (cached + 1): is 1, ends a block exactly, crosses into a new
    block by one token, and spans several blocks."""
    return [(0, 1), (bs - 1, 1), (bs, 1), (2 * bs + 5, 1)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(head_dim: int, group: int, block_size: int) -> None:
    case = make_case(bs_contexts(block_size), num_heads=group, num_kv_heads=1, head_dim=head_dim,
                     block_size=block_size, seed=head_dim + group + block_size, extra_blocks=1)
    check(case, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_k_decode_matches_reference(num_splits: int) -> None:
    # Few requests, long-ish contexts: some splits get no blocks (context 3 with 5 splits).
    case = make_case([(150, 1), (70, 1), (2, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     seed=num_splits)
    check(case, num_splits=num_splits)


def test_split_chosen_by_the_backend_matches_reference() -> None:
    case = make_case([(300, 1)], num_heads=8, num_kv_heads=1, head_dim=64, block_size=16, seed=7)
    backend = TritonBackend(CPU)
    backend.set_head_shape(8, 1, 64)
    assert backend.prepare(case.batch).num_splits > 1  # one request, one KV head: the context is split
    check(case)


@pytest.mark.parametrize("cached", [0, 16, 21])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_with_and_without_cached_prefix(cached: int, group: int) -> None:
    # A 37-token chunk spans three 16-row query tiles and crosses block boundaries;
    # cached=16 starts the chunk on a fresh block, cached=21 in the middle of one.
    case = make_case([(cached, 37), (cached // 2, 5)], num_heads=2 * group, num_kv_heads=2, head_dim=64,
                     block_size=16, seed=cached + group, extra_blocks=1)
    check(case)


@pytest.mark.parametrize("head_dim,block_size,group", [(128, 32, 8), (64, 16, 4), (64, 32, 1)])
def test_mixed_batch(head_dim: int, block_size: int, group: int) -> None:
    reqs = [(40, 1), (block_size - 1, 1), (0, 1), (block_size * 2, 9), (0, 20), (7, 2)]
    case = make_case(reqs, num_heads=group, num_kv_heads=1, head_dim=head_dim, block_size=block_size,
                     seed=head_dim + block_size)
    check(case, num_splits=2)


def test_non_power_of_two_heads_and_group() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads (group 3), head_dim 64.
    case = make_case([(33, 1), (5, 1), (12, 6)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=3)
    check(case, num_splits=2)


def test_bfloat16_close_to_float32_reference() -> None:
    case = make_case([(50, 1), (20, 1), (10, 12)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, seed=11)
    ref32 = make_case([(50, 1), (20, 1), (10, 12)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                      dtype=torch.bfloat16, seed=11)
    for c in (ref32,):  # the float32 reference on the same bf16-rounded inputs
        c.query, c.key, c.value = c.query.float(), c.key.float(), c.value.float()
        c.k_cache, c.v_cache = c.k_cache.float(), c.v_cache.float()
    ref_out, _, _ = reference_attention(ref32)
    out = run_triton(case, num_splits=2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


def test_kv_write_skips_padding_slots() -> None:
    k_cache = torch.zeros(4, 16, 2, 64)
    v_cache = torch.zeros(4, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    value = torch.randn(3, 2, 64)
    tk.write_kv(key, value, k_cache, v_cache, torch.tensor([17, -1, 63]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 15], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # the -1 row wrote nothing


def test_output_goes_into_the_preallocated_tensor() -> None:
    case = make_case([(20, 1), (3, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, seed=5)
    ref_out, _, _ = reference_attention(case)
    out = torch.full_like(case.query, float("nan"))
    backend = TritonBackend(CPU, num_splits=1, prefill_block_m=16)
    meta = backend.prepare(case.batch)
    got = backend.forward(0, case.query, case.key, case.value, case.k_cache, case.v_cache, meta, case.scale, out=out)
    assert got is out
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


def test_choose_num_splits() -> None:
    # Many requests fill the SMs: no split.
    assert tk.choose_num_splits(256, 8, 4096, 16, num_sms=132) == 1
    # One request, one KV head, 8k context: split, capped.
    assert tk.choose_num_splits(1, 1, 8192, 16, num_sms=132) == 16
    # Short context: each split must keep >= 256 keys.
    assert tk.choose_num_splits(1, 1, 600, 16, num_sms=132) == 3
    assert tk.choose_num_splits(1, 8, 100, 16, num_sms=132) == 1


def test_registered_for_cuda_and_picked_by_auto() -> None:
    assert "triton" in backends.available_backends("cuda")
    assert "triton" not in backends.available_backends("cpu")
    # Building the backend touches no CUDA API, so this runs on a CPU-only torch.
    assert isinstance(backends.select_backend("auto", torch.device("cuda")), TritonBackend)
    batch = dataclasses.replace(make_case([(3, 1)], 1, 1, 64, 16).batch, block_size=8)
    with pytest.raises(ValueError, match="block_size >= 16"):
        TritonBackend(CPU).prepare(batch)


def test_attention_variants_take_the_triton_kv_write_then_the_variant_path() -> None:
    """A layer with a variant (soft-cap, sinks, a window that bites): the Triton KV-write kernel,
    then backends/variant.py, equal to the reference backend's variant path on the same case."""
    from services.worker.backends.variant import AttentionVariant

    variant = AttentionVariant(softcap=3.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), window=10)
    reqs = [(40, 1), (3, 1), (16, 9), (0, 20)]
    ours = make_case(reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
    theirs = make_case(reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
    got = TritonBackend(CPU).forward_variant(0, ours.query, ours.key, ours.value, ours.k_cache, ours.v_cache,
                                             ours.batch, ours.scale, variant)
    want = backends.select_backend("reference", CPU).forward_variant(
        0, theirs.query, theirs.key, theirs.value, theirs.k_cache, theirs.v_cache, theirs.batch, theirs.scale, variant)
    assert torch.equal(ours.k_cache, theirs.k_cache) and torch.equal(ours.v_cache, theirs.v_cache)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    plain, _, _ = reference_attention(make_case(reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=9))
    assert not torch.allclose(got, plain, atol=1e-3)  # the variant changed the answer
