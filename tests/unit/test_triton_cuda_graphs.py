"""CUDA-graph decode logic on the CPU: buckets, padding, static buffers, the eager
fallback, and the one-copy staging; the graph itself is an eager stand-in that
re-runs the captured function over the same static buffers, so a step whose
inputs did not all flow through those buffers gives a wrong answer here too."""

from __future__ import annotations

import numpy as np
import pytest

from tests.device.interpreter import enable_interpreter

if not enable_interpreter():
    pytest.skip("triton is not installed (pip install -e '.[dev]')", allow_module_level=True)

import torch  # noqa: E402

from services.worker.backends import PagedBatch  # noqa: E402
from services.worker.backends.triton_backend import TritonBackend  # noqa: E402
from services.worker.cuda_graphs import (  # noqa: E402
    DecodeGraphs,
    StaticDecodeInputs,
    eager_capture,
    graph_batch_sizes,
    is_decode_only,
    pick_bucket,
)
from services.worker.cuda_staging import StepStaging  # noqa: E402
from tests.device.attention_cases import make_case  # noqa: E402

CPU = torch.device("cpu")


def test_bucket_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert graph_batch_sizes(128)[-3:] == [96, 112, 128]
    assert graph_batch_sizes(0) == []


def test_pick_bucket_pads_up_and_refuses_too_many() -> None:
    sizes = graph_batch_sizes(64)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 16, 32, 48, 64]
    assert pick_bucket(65, sizes) is None
    assert pick_bucket(0, sizes) is None


def test_decode_only_decision() -> None:
    assert is_decode_only(make_case([(5, 1), (9, 1)], 1, 1, 64, 16).batch)
    assert not is_decode_only(make_case([(5, 1), (0, 4)], 1, 1, 64, 16).batch)  # a prefill chunk: eager


def test_static_inputs_fill_and_pad() -> None:
    case = make_case([(20, 1), (3, 1), (40, 1)], 1, 1, 64, 16)
    static = StaticDecodeInputs.allocate(8, 4, CPU)
    static.block_table.fill_(7)  # stale ids from an earlier step
    ids = torch.tensor([[11, 12, 13]])
    pos = torch.tensor([[20, 3, 40]])
    static.fill(4, ids, pos, case.batch)
    assert static.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert static.positions[:4].tolist() == [20, 3, 40, 0]
    assert static.slot_mapping[:4].tolist() == case.batch.slot_mapping.tolist() + [-1]
    assert static.seq_lens[:4].tolist() == [21, 4, 41, 1]
    cols = case.batch.block_table.shape[1]
    assert torch.equal(static.block_table[:3, :cols], case.batch.block_table)
    assert static.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    too_wide = make_case([(100, 1)], 1, 1, 64, 16).batch
    with pytest.raises(ValueError, match="exceeds"):
        static.fill(1, ids[:, :1], pos[:, :1], too_wide)


class TinyAttentionModel:
    """embedding -> q/k/v -> the triton backend over a real paged cache -> 'logits'."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, vocab: int = 50) -> None:
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, dim = 4, k_cache.shape[2], k_cache.shape[3]
        self.shape = (heads, kv_heads, dim)
        self.emb = torch.randn(vocab, (heads + 2 * kv_heads) * dim, generator=gen)
        self.pos_emb = torch.randn(256, heads * dim, generator=gen)
        self.out_proj = torch.randn(heads * dim, vocab, generator=gen)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.backend = TritonBackend(CPU, prefill_block_m=16)
        self.backend.set_head_shape(*self.shape)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        x = self.emb[ids[0]]
        q = (x[:, : heads * dim] + self.pos_emb[pos[0]]).view(-1, heads, dim)
        k = x[:, heads * dim : (heads + kv_heads) * dim].reshape(-1, kv_heads, dim)
        v = x[:, (heads + kv_heads) * dim :].reshape(-1, kv_heads, dim)
        meta = self.backend.prepare(batch)
        out = self.backend.forward(0, q, k, v, self.k_cache, self.v_cache, meta, dim**-0.5)
        return out.reshape(out.shape[0], -1) @ self.out_proj


def test_replayed_decode_equals_eager_step() -> None:
    reqs = [(20, 1), (3, 1), (40, 1)]  # 3 requests replay in the bucket of 4
    case = make_case(reqs, 4, 2, 64, 16, seed=3)
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.tensor([[20, 3, 40]])
    eager_model = TinyAttentionModel(case.k_cache.clone(), case.v_cache.clone())
    expected = eager_model(ids, pos, case.batch)

    graph_model = TinyAttentionModel(case.k_cache.clone(), case.v_cache.clone())
    graphs = DecodeGraphs(graph_model, max_num_seqs=4, max_model_len=64, block_size=16, device=CPU,
                          capture=eager_capture)
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4]
    # Capture ran padded rows only: nothing may have been written to the cache.
    assert torch.equal(graph_model.k_cache, case.k_cache) and torch.equal(graph_model.v_cache, case.v_cache)
    bucket = graphs.bucket_for(case.batch)
    assert bucket == 4
    got = graphs.run(bucket, ids, pos, case.batch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The real rows' K/V landed in the same slots as the eager step's; padding wrote nothing.
    assert torch.equal(graph_model.k_cache, eager_model.k_cache)
    assert torch.equal(graph_model.v_cache, eager_model.v_cache)
    # Mixed and oversized steps fall back to eager.
    assert graphs.bucket_for(make_case([(3, 1), (0, 5)], 4, 2, 64, 16).batch) is None
    assert graphs.bucket_for(make_case([(3, 1)] * 5, 4, 2, 64, 16).batch) is None


def test_staging_one_copy_round_trip() -> None:
    staging = StepStaging(CPU, capacity_bytes=16)  # too small: grows
    arrays = [np.arange(5, dtype=np.int64), np.array([[1, 2], [3, 4]], dtype=np.int32), np.array([7], np.int32)]
    out = staging.stage(arrays)
    for a, t in zip(arrays, out, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and t.tolist() == a.tolist()
    case = make_case([(20, 1), (0, 9)], 1, 1, 64, 16)
    staged, extra = staging.stage_batch(case.batch, [np.array([3, 1, 4], dtype=np.int64)])
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        a, b = getattr(case.batch, name), getattr(staged, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert staged.num_decodes == 1 and extra[0].tolist() == [3, 1, 4]
