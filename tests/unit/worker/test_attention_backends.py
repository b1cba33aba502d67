"""Every registered CPU attention backend against plain dense attention and the reference.

Random inputs on a small paged cache (block size 4, shuffled block ids): GQA, MQA and
MHA head layouts; decodes whose context ends exactly on a block boundary (full last
block), one token into a new block, and a single-token context; a fresh prefill; chunked
prefill over a cached prefix that ends mid-block and one that ends on a boundary; all in
one mixed batch and each kind alone. Expected values come from float64 softmax attention
over each request's whole context, computed here without any paging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from services.worker.backends import PagedBatch, available_backends, select_backend
from services.worker.backends.build import build_paged_batch
from tests.busy import same_bits_with_work_taken

BLOCK = 4
NUM_BLOCKS = 40
HEAD_DIM = 8

# (query_len, context_len after the step) per request; decodes first.
MIXED = [(1, 8), (1, 9), (1, 1), (1, 4), (1, 13), (7, 7), (3, 11), (4, 8), (2, 2)]
CASES = {
    "mixed": MIXED,
    "decodes": [(1, n) for n in (1, 3, 4, 5, 8, 16, 17, 31)],
    "prefills": [(5, 5), (16, 16), (3, 20), (8, 8)],
    "prefix_chunks": [(3, 11), (4, 8), (5, 9), (6, 30)],
}
HEADS = {"gqa": (6, 2), "mqa": (4, 1), "mha": (3, 3)}


def _setup(case: list[tuple[int, int]], heads: int, kv_heads: int, seed: int, head_dim: int = HEAD_DIM) -> dict:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    shape = (NUM_BLOCKS, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)  # garbage everywhere a request has not written
    v_cache = torch.randn(shape, generator=gen)
    block_ids, contexts, queries, keys, values = [], [], [], [], []
    for q_len, ctx in case:
        nb = -(-ctx // BLOCK)
        ids = [perm.pop() for _ in range(nb + 1)]  # one spare block: tables may be longer than needed
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        for p in range(ctx - q_len):  # the cached prefix is already in the cache
            k_cache[ids[p // BLOCK], p % BLOCK] = k[p]
            v_cache[ids[p // BLOCK], p % BLOCK] = v[p]
        block_ids.append(ids)
        contexts.append((k, v))
        queries.append(torch.randn(q_len, heads, head_dim, generator=gen))
        keys.append(k[ctx - q_len :])
        values.append(v[ctx - q_len :])
    batch, positions = build_paged_batch([q for q, _ in case], [c for _, c in case], block_ids, BLOCK, 1024,
                                         torch.device("cpu"))
    return dict(batch=batch, positions=positions, k_cache=k_cache, v_cache=v_cache, contexts=contexts,
                query=torch.cat(queries), key=torch.cat(keys), value=torch.cat(values), block_ids=block_ids)


def _cpu_kernels(prompts: bool = False) -> Any:
    """cpu_paged's extension, or a skip: no compiler here (the backend is absent too), or, with
    ``prompts``, a build without the prompt kernels (neither AVX-512 nor AVX2)."""
    from services.kernels.build import load_extension

    try:
        kernel = load_extension()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cpu_paged kernels unavailable: {exc}")
    if prompts and not kernel.prefill_attention_available():
        pytest.skip("built without AVX-512 or AVX2")
    return kernel


@contextlib.contextmanager
def _prefill_amx(kernel: Any, on: bool) -> Iterator[None]:
    """The bfloat16 prompt kernel with its AMX tile products on or off for the block (a skip when
    asked for where this build or CPU has none); on again after, as the backend runs it."""
    used = kernel.prefill_amx(1 if on else 0)
    try:
        if on and not used:
            pytest.skip("no AMX here (amx_bf16 in /proc/cpuinfo and a build for it)")
        assert not used or on
        yield
    finally:
        kernel.prefill_amx(1)


def _dense(case: list[tuple[int, int]], query: torch.Tensor, contexts: list, scale: float) -> torch.Tensor:
    outs, start = [], 0
    for (q_len, ctx), (k, v) in zip(case, contexts, strict=True):
        q = query[start : start + q_len].double()  # [q, heads, d]
        start += q_len
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs).float()


def test_build_paged_batch_positions_slots_and_order() -> None:
    batch, positions = build_paged_batch([1, 1, 3], [5, 1, 6], [[7, 2], [3], [9, 4]], BLOCK, 64, torch.device("cpu"))
    assert (batch.num_reqs, batch.num_decodes, batch.num_tokens) == (3, 2, 5)
    assert batch.query_start_loc_cpu == (0, 1, 2, 5) and batch.seq_lens_cpu == (5, 1, 6)
    assert positions.tolist() == [4, 0, 3, 4, 5]
    # position 4 of [7, 2] -> block 2 slot 0; 0 of [3] -> 12; 3,4,5 of [9, 4] -> 39, 16, 17
    assert batch.slot_mapping.tolist() == [8, 12, 39, 16, 17]
    assert batch.block_table.tolist() == [[7, 2], [3, 0], [9, 4]]
    assert (batch.max_query_len, batch.max_seq_len) == (3, 6)
    with pytest.raises(ValueError, match="decodes"):
        build_paged_batch([3, 1], [3, 4], [[1], [2]], BLOCK, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_paged_batch([1], [5], [[1]], BLOCK, 64, torch.device("cpu"))


def test_selecting_backends() -> None:
    cpu = torch.device("cpu")
    assert "reference" in available_backends("cpu") and "reference" in available_backends("cuda")
    assert select_backend("reference", cpu).name == "reference"
    assert select_backend("auto", cpu).name in available_backends("cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("no-such-backend", cpu)


@pytest.mark.parametrize("backend_name", available_backends("cpu"))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_matches_dense_attention_and_reference(backend_name: str, heads: str, case: str) -> None:
    seed = sorted(HEADS).index(heads) * 10 + sorted(CASES).index(case)
    _check_backend(backend_name, HEADS[heads], CASES[case], seed, HEAD_DIM)


@pytest.mark.parametrize("backend_name", available_backends("cpu"))
@pytest.mark.parametrize("head_dim", [64, 128])  # the sizes kernels specialize for (SmolLM2: 64)
def test_backend_at_real_head_sizes(backend_name: str, head_dim: int) -> None:
    _check_backend(backend_name, (9, 3), MIXED, head_dim, head_dim)


def _check_backend(backend_name: str, heads: tuple[int, int], spec: list[tuple[int, int]], seed: int,
                   head_dim: int) -> None:
    num_heads, num_kv_heads = heads
    data = _setup(spec, num_heads, num_kv_heads, seed, head_dim)
    batch: PagedBatch = data["batch"]
    scale = head_dim**-0.5
    expected = _dense(spec, data["query"], data["contexts"], scale)
    results = {}
    for name in ("reference", backend_name):
        backend = select_backend(name, torch.device("cpu"))
        k_cache, v_cache = data["k_cache"].clone(), data["v_cache"].clone()
        meta = backend.prepare(batch)
        # Two layers share one step's metadata: the second call must not depend on the first.
        for layer in range(2):
            out = backend.forward(layer, data["query"], data["key"], data["value"], k_cache, v_cache, meta, scale)
        assert out.shape == data["query"].shape
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        results[name] = out
        # The new tokens' keys and values landed in their slots.
        slots = batch.slot_mapping
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat_k[slots], data["key"])
        torch.testing.assert_close(v_cache.view(-1, num_kv_heads, head_dim)[slots], data["value"])
    torch.testing.assert_close(results[backend_name], results["reference"], rtol=1e-5, atol=1e-5)
    assert np.array_equal(data["positions"][: batch.num_decodes], np.array([c - 1 for _, c in spec[: batch.num_decodes]]))


@pytest.mark.parametrize("backend_name", available_backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (128, (8, 1)), (256, (4, 2))])
def test_backend_in_half_precision(backend_name: str, dtype: torch.dtype, head_dim: int,
                                   heads: tuple[int, int]) -> None:
    """bfloat16/float16 caches (the AVX-512 path widens them to float32): still the dense result."""
    spec = [(1, 8), (1, 13), (1, 37), (1, 1), (7, 7), (3, 11)]
    out, expected = _run_in_dtype(backend_name, spec, heads, head_dim + heads[0], head_dim, dtype)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def _run_in_dtype(backend_name: str, spec: list[tuple[int, int]], heads: tuple[int, int], seed: int, head_dim: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``spec`` with the cache and inputs in ``dtype``: the backend's output and the dense result."""
    data = _setup(spec, heads[0], heads[1], seed, head_dim)
    scale = head_dim**-0.5
    query, key, value = (data[n].to(dtype) for n in ("query", "key", "value"))
    # The dense reference sees exactly the rounded values the backend reads.
    contexts = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in data["contexts"]]
    expected = _dense(spec, query.float(), contexts, scale)
    backend = select_backend(backend_name, torch.device("cpu"))
    k_cache, v_cache = data["k_cache"].to(dtype), data["v_cache"].to(dtype)
    out = backend.forward(0, query, key, value, k_cache, v_cache, backend.prepare(data["batch"]), scale)
    return out, expected


@pytest.mark.parametrize("backend_name", available_backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4), (8, 1)])
def test_many_decodes_at_real_head_sizes(backend_name: str, dtype: torch.dtype, head_dim: int,
                                         heads: tuple[int, int]) -> None:
    """Enough decodes for cpu_paged's one-item-per-request kernel (>= 4 per thread), GQA, MQA, MHA."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = [(1, n) for n in (1, 3, 4, 5, 8, 9, 12, 13, 2, 7, 6, 10)]  # 37 of the 40 blocks
        out, expected = _run_in_dtype(backend_name, spec, heads, head_dim + 7, head_dim, dtype)
        assert out.dtype == dtype
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_rounds_to_float8_as_torch_does(src: torch.dtype) -> None:
    """A float8 cache takes the model's keys/values as they are and write_kv rounds them
    itself: byte for byte what ``.to(torch.float8_e4m3fn)`` gives, over every bfloat16 and
    float16 bit pattern (NaNs, infinities, subnormals, the saturation edge at 448-480) and
    float32 values around each e4m3 rounding boundary, strided as the step's projections are."""
    kernel = _cpu_kernels()
    kv_heads, head_dim = 2, 64
    if src == torch.float32:
        fp8_values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        finite = fp8_values[torch.isfinite(fp8_values)].unique()
        mids = (finite[1:] + finite[:-1]) / 2  # exact ties: nearest even decides
        base = torch.cat([finite, mids, torch.tensor([448.0, 464.0, 479.9, 480.0, 1e6, float("inf"), float("nan"),
                                                      1e-9, 2.0**-10, 2.0**-9 * 1.5, 1e-40])])
        bits = base.view(torch.int32)
        values = torch.cat([bits + d for d in (-1, 0, 1)]).view(torch.float32)  # either side of each
        values = torch.cat([values, -values])
    else:
        values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src)
    width = kv_heads * head_dim
    pad = -values.numel() % width
    values = torch.cat([values, torch.zeros(pad, dtype=src)])
    tokens = values.numel() // width
    # keys a strided view (heads 3 rows apart in a wider projection), values contiguous
    wide = torch.zeros(tokens, 3 * width, dtype=src)
    wide[:, width : 2 * width] = values.view(tokens, width)
    key = wide[:, width : 2 * width].view(tokens, kv_heads, head_dim)
    value = values.view(tokens, kv_heads, head_dim).flip(0).contiguous()
    blocks = -(-tokens // 16)
    k_cache, v_cache = (torch.zeros(blocks, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn) for _ in range(2))
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(5))[:tokens]
    kernel.write_kv(key, value, k_cache, v_cache, slots)
    for cache, x in ((k_cache, key), (v_cache, value)):
        got = cache.view(torch.uint8).view(-1, kv_heads, head_dim)[slots]
        want = x.to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(got, want), (got != want).sum()
    with pytest.raises(RuntimeError, match="cache's dtype"):  # a float8 cache does not take float64
        kernel.write_kv(key.double(), value.double(), k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype,bf16_dot,amx", [(torch.bfloat16, True, False), (torch.bfloat16, True, True),
                                                (torch.bfloat16, False, False), (torch.float16, True, False),
                                                (torch.float32, True, False)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 1), (4, 4), (14, 2)])
def test_prefill_kernel_matches_causal_attention(dtype: torch.dtype, bf16_dot: bool, amx: bool, head_dim: int,
                                                 heads: tuple[int, int]) -> None:
    """cpu_paged's fresh-chunk kernel: several prompts (tile and key-block edges: 1, 15-17, 32-33, 200
    tokens; 530 and 1030 past the bfloat16 kernel's 512-key softmax passes, a query tile across
    their edge) packed behind two decode rows, q/k/v as strided views of one product, 2 threads;
    bfloat16 through AVX512-BF16 dot products (where the CPU has them), through AMX tile products
    (where it has those; 16-row blocks over 9-56 rows an item) and through float32 FMAs."""
    kernel = _cpu_kernels(prompts=True)
    num_heads, kv_heads = heads
    lens = [17, 1, 200, 33, 16, 15, 32, 530, 1030]
    total = 2 + sum(lens)
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    qkv = torch.randn(total, (num_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
    v = qkv[:, (num_heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)
    starts = np.cumsum([2] + lens)
    spans = torch.tensor([[int(a), int(b)] for a, b in zip(starts[:-1], starts[1:], strict=True)], dtype=torch.int64)
    out = torch.full((total, num_heads, head_dim), 7.0, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _prefill_amx(kernel, amx):
            kernel.prefill_attention(q, k, v, out, spans, head_dim**-0.5, bf16_dot)
    finally:
        torch.set_num_threads(threads)
    assert torch.all(out[:2] == 7.0)  # rows outside the spans are left alone
    expected = _dense([(n, n) for n in lens], q[2:].float(), [(k[a:b].float(), v[a:b].float()) for a, b in
                                                            spans.tolist()], head_dim**-0.5)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out[2:].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_prefill_kernel_takes_scores_far_past_a_rows_first_keys(amx: bool, head_dim: int, paged: bool) -> None:
    """The bfloat16 prompt kernel's softmax keeps a reference per row (the max of its first 32
    keys) rather than each span's max, and does a row again against its true max when a span's
    row sum passes 2^64 (as any score more than 2^64 past the reference makes it). Keys whose scores pass the first
    keys' by ~144 in log2 units (2^144 overflows float32 unless the row is done again), one in
    the first 512-key span and one past that in the second, and one far below: every query row
    after them attends to them alone, the rows before are as they were; against float64
    attention, fresh and over a cached prefix."""
    kernel = _cpu_kernels(prompts=True)
    num_heads, kv_heads, n = 9, 3, 700
    gen = torch.Generator().manual_seed(head_dim)
    u = torch.ones(head_dim)
    q = (u + 0.1 * torch.randn(n, num_heads, head_dim, generator=gen)).to(torch.bfloat16)
    k = torch.randn(n, kv_heads, head_dim, generator=gen)
    # a key's score is ~s (in the softmax's natural units) where it is s u / sqrt(head_dim)
    k[100] = 100 * u * head_dim**-0.5  # ~144 log2 units past the first keys': 2^144 overflows unless done again
    k[600] = 200 * u * head_dim**-0.5  # ~144 past that, in the second span
    k[300] = -100 * u * head_dim**-0.5  # far below: a probability of zero
    k = k.to(torch.bfloat16)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.full((n, num_heads, head_dim), 7.0, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _prefill_amx(kernel, amx):
            if not paged:
                kernel.prefill_attention(q, k, v, out, torch.tensor([[0, n]], dtype=torch.int64), scale, True)
            else:  # a 40-token cached prefix, the rest a chunk over it
                block_size, prefix = 16, 40
                blocks = -(-n // block_size)
                perm = torch.randperm(blocks + 2, generator=gen)[:blocks].to(torch.int32)
                k_cache = torch.zeros(blocks + 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
                v_cache = torch.zeros_like(k_cache)
                slots = (perm.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
                k_cache.view(-1, kv_heads, head_dim)[slots] = k
                v_cache.view(-1, kv_heads, head_dim)[slots] = v
                kernel.prefill_attention_paged(q, out, k_cache, v_cache, torch.tensor([[prefix, n, prefix]]),
                                               perm[None].contiguous(), scale, True)
    finally:
        torch.set_num_threads(threads)
    first = 40 if paged else 0
    expected = _dense([(n - first, n)], q[first:].float(), [(k.float(), v.float())], scale)
    torch.testing.assert_close(out[first:].float(), expected, rtol=2e-2, atol=2e-2)
    # the rows past each far key return its value (the softmax's weight on it ~1)
    torch.testing.assert_close(out[650].float(), v[600].float().repeat_interleave(3, dim=0), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[200].float(), v[100].float().repeat_interleave(3, dim=0), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_write_kv_kernel_stores_rows_like_index_copy(dtype: torch.dtype) -> None:
    """cpu_paged's write_kv: keys/values as strided views of one projection (and values with
    heads apart), shuffled slots; a negative slot (a padded row) is skipped, a slot past the
    cache refused; the bytes equal the reference's index_copy_."""
    from services.worker.backends.reference import write_kv

    kernel = _cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_dim = 37, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen) * 4
    key = qkv[:, 9 * head_dim : 12 * head_dim].view(tokens, kv_heads, head_dim)
    value = torch.randn(tokens, kv_heads, 2 * head_dim, generator=gen)[:, :, :head_dim]  # heads apart
    slots = torch.randperm(10 * 16, generator=gen)[:tokens]
    slots[5] = -1
    caches = [torch.zeros(10, 16, kv_heads, head_dim).to(dtype) for _ in range(4)]
    kernel.write_kv(key.to(dtype), value.to(dtype), caches[0], caches[1], slots)
    keep = slots >= 0
    write_kv(key[keep], value[keep], caches[2], caches[3], slots[keep])
    for mine, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))
        assert mine.view(torch.uint8).view(-1, kv_heads * head_dim * mine.element_size()).any(1).sum() == tokens - 1
    slots[0] = 10 * 16
    with pytest.raises(RuntimeError, match="past the cache"):
        kernel.write_kv(key.to(dtype), value.to(dtype), caches[0], caches[1], slots)


@pytest.mark.parametrize("dtype,bf16_dot,fp8,amx", [
    (torch.bfloat16, True, False, False), (torch.bfloat16, True, False, True), (torch.bfloat16, False, False, False),
    (torch.float16, True, False, False), (torch.float32, True, False, False), (torch.bfloat16, True, True, False),
    (torch.bfloat16, True, True, True), (torch.bfloat16, False, True, False), (torch.float16, True, True, False),
    (torch.float32, True, True, False)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_prefill_kernel_matches_attention_over_a_cached_prefix(dtype: torch.dtype, bf16_dot: bool, fp8: bool,
                                                                      amx: bool, head_dim: int,
                                                                      heads: tuple[int, int], block_size: int) -> None:
    """cpu_paged's kernels for chunks with a cached prefix: queries at positions prefix.. attend
    to every key before them, all read from the paged cache through shuffled block tables.
    Prefixes and chunk lengths on and off the kernels' 16-query and 32/16-key tiles and the
    cache's blocks, and contexts across the bfloat16 kernel's 512-key softmax passes; bfloat16 through AVX512-BF16 dot products (where the CPU has them) and
    float32 FMAs; a float8 cache (--kv-cache-dtype fp8) read with queries in the model's dtype,
    against attention over the float8 values; rows outside the spans are left alone."""
    kernel = _cpu_kernels(prompts=True)
    num_heads, kv_heads = heads
    chunks = [(1, 5), (200, 17), (16, 32), (31, 33), (64, 1), (3, 100), (500, 40), (1030, 5)]  # (prefix, length)
    gen = torch.Generator().manual_seed(head_dim * 10 + num_heads + block_size)
    width = max(-(-(p + n) // block_size) for p, n in chunks)
    num_blocks = len(chunks) * width + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(chunks) * width].view(len(chunks), width).to(torch.int32).contiguous()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)  # garbage where no request wrote
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    total = 2 + sum(n for _, n in chunks)
    q = torch.randn(total, num_heads * 2, head_dim, generator=gen).to(dtype)[:, ::2]  # strided heads
    spans, contexts, start = [], [], 2
    for s, (prefix, n) in enumerate(chunks):
        ctx = prefix + n
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(cache_dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(cache_dtype)
        for p in range(ctx):  # the prefix and the chunk's own keys, as write_kv left them
            k_cache[tables[s, p // block_size], p % block_size] = k[p]
            v_cache[tables[s, p // block_size], p % block_size] = v[p]
        spans.append((start, start + n, prefix))
        contexts.append((k.float(), v.float()))
        start += n
    out = torch.full((total, num_heads, head_dim), 7.0, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _prefill_amx(kernel, amx):
            kernel.prefill_attention_paged(q, out, k_cache, v_cache, torch.tensor(spans, dtype=torch.int64), tables,
                                           head_dim**-0.5, bf16_dot)
    finally:
        torch.set_num_threads(threads)
    assert torch.all(out[:2] == 7.0)
    expected = _dense([(n, p + n) for p, n in chunks], q[2:].float(), contexts, head_dim**-0.5)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out[2:].float(), expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="out of range"):  # a table too short for its span
        kernel.prefill_attention_paged(q, out, k_cache, v_cache, torch.tensor([(2, 7, 10 * width * block_size)]),
                                       tables[:1], head_dim**-0.5, bf16_dot)


@pytest.mark.parametrize("dtype,bf16_dot,fp8", [(torch.bfloat16, True, False), (torch.bfloat16, False, False),
                                                (torch.float16, True, False), (torch.float32, True, False),
                                                (torch.bfloat16, True, True), (torch.bfloat16, False, True),
                                                (torch.float32, True, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 1), (4, 4), (16, 2), (14, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_decodes", [3, 12, 13])
def test_decode_kernel_matches_attention(dtype: torch.dtype, bf16_dot: bool, fp8: bool, head_dim: int,
                                         heads: tuple[int, int], block_size: int, num_decodes: int) -> None:
    """cpu_paged's decode kernel on a shuffled cache: group sizes 1-4 and 8 (compiled per group)
    and 7 (the generic path), contexts of 1 token, odd lengths and 15-17, 31-33 and 200 tokens
    (the sixteen-token passes and the two-token value steps), one work item per request (12
    decodes on 2 threads) and per KV head (3, and 13 where one context is longer than a
    thread's share of the step); bfloat16 through AVX512-BF16 dot products (where
    the CPU has them) and through float32 FMAs; a float8 (e4m3) cache read with a bfloat16 or
    float32 query, against attention over the float8 values."""
    kernel = _cpu_kernels()
    num_heads, kv_heads = heads
    lens = [1, 200, 33, 16, 17, 15, 32, 31, 2, 5, 64, 100, 700][:num_decodes]
    gen = torch.Generator().manual_seed(head_dim + num_heads + block_size)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    # float8: values up to ~600 (some saturate at 448), and some subnormals (below 2^-6)
    spread = torch.tensor([1.0, 150.0, 0.004]) if fp8 else torch.ones(3)
    pick = torch.randint(0, 3, (num_blocks, block_size, kv_heads, head_dim), generator=gen)
    k_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * spread[pick]).to(cache_dtype)
    v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * spread[pick]).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5 / (30.0 if fp8 else 1.0)  # float8's large values: keep the softmax from saturating
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernel.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), scale, bf16_dot)
    finally:
        torch.set_num_threads(threads)
    assert out.dtype == dtype and out.shape == q.shape
    contexts = []
    for i, n in enumerate(lens):
        slots = (table[i, : -(-n // block_size)].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        flat_k, flat_v = (c.view(torch.uint8).view(-1, kv_heads, head_dim)[slots].view(cache_dtype)
                          if fp8 else c.view(-1, kv_heads, head_dim)[slots] for c in (k_cache, v_cache))
        contexts.append((flat_k.float(), flat_v.float()))
    expected = _dense([(1, n) for n in lens], q.float(), contexts, scale)
    # float8: the query and P go through bfloat16 dot products (noise far below float8's own)
    tol = 2e-2 if fp8 else {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    rel = expected.abs().max().item() if fp8 else 1.0  # values up to ~448: a tolerance relative to them
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * rel)


@pytest.mark.parametrize("setting,amx,bf16_cache,fp8_cache", [
    (None, True, False, True), ("auto", True, False, True), (None, False, True, True),
    ("1", True, True, True), ("0", False, False, False), ("0", True, False, False)])
def test_decode_dot_products_by_cpu_and_cache(monkeypatch: pytest.MonkeyPatch, setting: str | None, amx: bool,
                                              bf16_cache: bool, fp8_cache: bool) -> None:
    """Decodes over a bfloat16 cache take float32 FMAs on a CPU with AMX (where vdpbf16ps runs
    at half the FMA's rate) and dot products elsewhere; a float8 cache keeps its dot products;
    FERRY_CPU_BF16_DOT=1 forces them, 0 turns them off everywhere (prompts too)."""
    from services.kernels import ops
    from services.worker.backends import cpu_paged

    if setting is None:
        monkeypatch.delenv("FERRY_CPU_BF16_DOT", raising=False)
    else:
        monkeypatch.setenv("FERRY_CPU_BF16_DOT", setting)
    monkeypatch.setattr(ops, "cpu_flag", lambda name: amx and name == "amx_bf16")
    backend = object.__new__(cpu_paged.CpuPagedBackend)  # the rule only, no kernels built
    backend.bf16_dot = cpu_paged.bf16_dot_enabled()
    backend.bf16_decode_fma = cpu_paged.bf16_decode_through_fma()
    assert backend.bf16_dot == (setting != "0")
    assert backend.decode_dot(torch.bfloat16) is bf16_cache
    assert backend.decode_dot(torch.float8_e4m3fn) is fp8_cache


@pytest.mark.parametrize("backend_name", [b for b in available_backends("cpu") if b == "cpu_paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_float8_cache_through_the_backend(backend_name: str, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """``--kv-cache-dtype fp8``: the step's new keys/values are written to a float8 cache, and
    decodes and chunks after a cached prefix (ending mid-block and on a boundary) read every
    key from it: the result equals attention over the float8-rounded context."""
    spec = [(1, 8), (1, 9), (1, 1), (1, 13), (3, 11), (4, 8), (2, 2 + 4)]
    head_dim = 64
    data = _setup(spec, heads[0], heads[1], 11, head_dim)
    scale = head_dim**-0.5
    query, key, value = (data[n].to(dtype) for n in ("query", "key", "value"))
    fp8 = torch.float8_e4m3fn
    contexts = [(k.to(dtype).to(fp8).float(), v.to(dtype).to(fp8).float()) for k, v in data["contexts"]]
    expected = _dense(spec, query.float(), contexts, scale)
    backend = select_backend(backend_name, torch.device("cpu"))
    k_cache, v_cache = data["k_cache"].to(dtype).to(fp8), data["v_cache"].to(dtype).to(fp8)
    out = backend.forward(0, query, key, value, k_cache, v_cache, backend.prepare(data["batch"]), scale)
    assert out.dtype == dtype
    # decodes: bfloat16 dot products over the float8 keys/values (where the CPU has them), whatever
    # the query's dtype; chunks after a prefix: SDPA in the query's dtype
    tol = 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    # the new tokens landed in their slots, as float8
    slots = data["batch"].slot_mapping
    got = k_cache.view(torch.uint8).view(-1, heads[1], head_dim)[slots].view(fp8)
    assert torch.equal(got.view(torch.uint8), key.to(fp8).view(torch.uint8))


def test_kernels_are_built_for_this_cpus_instruction_set() -> None:
    """The build chosen for this CPU (or ``-march=native``) takes the widest path it runs: AVX-512
    where /proc/cpuinfo lists avx512f, else AVX2 with FMA and F16C, else the plain loops."""
    import os

    if os.environ.get("FERRY_CPU_MARCH", "").strip() not in ("", "native"):
        pytest.skip("FERRY_CPU_MARCH names another instruction set")
    kernel = _cpu_kernels()
    try:
        flags = next(line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if "avx512f" in flags:
        want = "avx512"
    elif {"avx2", "fma", "f16c"} <= set(flags):
        want = "avx2"
    else:
        want = "portable"
    assert kernel.kernel_isa() == want
    assert bool(kernel.prefill_attention_available()) == (want != "portable")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_threads_take_each_others_items_and_change_no_bit(dtype: torch.dtype) -> None:
    """The attention kernels split their work items by cost and a thread done with its own
    range takes the other's from the back (work_split.h, parallel_by_cost): with a process busy
    beside the two threads many items change thread, and every output is the bits of the split
    done once (``work_stealing(False)``), run after run: decode with one item per request
    and per KV head, fresh prompts and chunks over a cached prefix."""
    kernel = _cpu_kernels(prompts=True)
    num_heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(21)
    lens = [int(n) for n in torch.randint(1, 300, (40,), generator=gen)]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen).view(len(lens), max_blocks).to(torch.int32).contiguous()
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    total = sum(lens)
    qp = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    kp = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    vp = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    starts = np.cumsum([0] + lens)
    spans = torch.tensor([[int(a), int(b)] for a, b in zip(starts[:-1], starts[1:], strict=True)], dtype=torch.int64)
    # chunks of the last 1-40 tokens of each context, its earlier tokens a cached prefix
    tails = [min(n, 1 + i % 40) for i, n in enumerate(lens)]
    cstarts = np.cumsum([0] + tails)
    paged_spans = torch.tensor([[int(cstarts[i]), int(cstarts[i + 1]), n - t] for i, (n, t) in
                                enumerate(zip(lens, tails, strict=True))], dtype=torch.int64)
    qc = torch.randn(int(cstarts[-1]), num_heads, head_dim, generator=gen).to(dtype)

    def run() -> tuple[torch.Tensor, ...]:
        few = kernel.paged_decode(q[:3], k_cache, v_cache, table[:3], seq_lens[:3], 0.125, True)  # per KV head
        many = kernel.paged_decode(q, k_cache, v_cache, table, seq_lens, 0.125, True)  # per request
        fresh = torch.empty_like(qp)
        kernel.prefill_attention(qp, kp, vp, fresh, spans, 0.125, True)
        cached = torch.empty_like(qc)
        kernel.prefill_attention_paged(qc, cached, k_cache, v_cache, paged_spans, table, 0.125, True)
        return few, many, fresh, cached

    once = same_bits_with_work_taken(kernel, run)
    assert all(torch.isfinite(t.float()).all() for t in once)
    assert once[1].abs().sum() > 0 and once[2].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (12, 2, 64), (4, 4, 128), (2, 1, 96)])
def test_decode_reads_a_query_with_its_own_token_stride(dtype: torch.dtype, heads: int, kv_heads: int,
                                                        head_dim: int) -> None:
    """A query that is a view of a wider q/k/v product (each token's heads contiguous, tokens
    that product's row apart: decode_layers' query when RoPE was the product's epilogue) gives
    the bits of the same query made contiguous, on the grouped kernels (read in place) and the
    others (copied first); a query whose heads are not contiguous is copied whole first, the
    same bits again."""
    kernel = _cpu_kernels()
    gen = torch.Generator().manual_seed(heads * head_dim)
    lens, block_size = [5, 40, 17, 33, 64, 1, 29, 50, 8], 16
    max_blocks = -(-max(lens) // block_size)
    k_cache = torch.randn(len(lens) * max_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    table = torch.randperm(len(lens) * max_blocks, generator=gen).view(len(lens), max_blocks).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    width = (heads + 2 * kv_heads) * head_dim
    product = torch.randn(len(lens), width, generator=gen).to(dtype)
    view = product[:, : heads * head_dim].view(len(lens), heads, head_dim)
    assert not view.is_contiguous()
    scale = head_dim**-0.5
    got = kernel.paged_decode(view, k_cache, v_cache, table, seq_lens, scale, True)
    want = kernel.paged_decode(view.contiguous(), k_cache, v_cache, table, seq_lens, scale, True)
    assert got.is_contiguous() and torch.equal(got, want)
    assert float(want.float().abs().sum()) > 0
    heads_apart = view.transpose(0, 1).contiguous().transpose(0, 1)  # tokens adjacent, heads far apart
    assert heads_apart.stride(1) != head_dim
    assert torch.equal(kernel.paged_decode(heads_apart, k_cache, v_cache, table, seq_lens, scale, True), want)
    with pytest.raises(RuntimeError, match="query"):
        kernel.paged_decode(view[0], k_cache, v_cache, table, seq_lens, scale, True)


def test_decode_takes_a_one_head_query_whatever_its_head_stride() -> None:
    """A [tokens, 1, head_dim] query is contiguous for torch whatever stride its head
    dimension carries (a view can give it any); paged_decode takes it as it is, with the bits of
    a freshly made copy."""
    kernel = _cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(4, 16, 1, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 31], dtype=torch.int32)
    dense = torch.randn(2, 1, 64, generator=gen).to(torch.bfloat16)
    odd = torch.empty_strided((2, 1, 64), (64, 7, 1), dtype=torch.bfloat16)
    odd.copy_(dense)
    assert odd.is_contiguous() and odd.stride(1) == 7
    got = kernel.paged_decode(odd, k_cache, v_cache, table, lens, 0.125, True)
    assert torch.equal(got, kernel.paged_decode(dense, k_cache, v_cache, table, lens, 0.125, True))
