"""CUDA-graph decode logic on the CPU: buckets, padding, static buffers, the eager
fallback, and the one-copy staging; the graph itself is an eager stand-in that
re-runs the captured function over the same static buffers, so a step whose
inputs did not all flow through those buffers gives a wrong answer here too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.device.interpreter import enable_interpreter

if not enable_interpreter():
    pytest.skip("triton is not installed (pip install -e '.[dev]')", allow_module_level=True)

import torch  # noqa: E402

from services.worker.backends import PagedBatch  # noqa: E402
from services.worker.backends.triton_backend import TritonBackend  # noqa: E402
from services.worker.cuda.graphs import (  # noqa: E402
    DecodeGraphs,
    StaticDecodeInputs,
    decode_forward,
    eager_capture,
    graph_batch_sizes,
    graph_memory_estimate,
    graphs_wanted,
    is_decode_only,
    pick_bucket,
)
from services.worker.cuda.staging import StepStaging  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402
from shared.messages import NewRequestData, SamplingParams, StepPlan  # noqa: E402
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


def _plans(prompts: list[list[int]], nb: int) -> list[StepPlan]:
    """Prefill every prompt in one step, then three decode steps."""
    greedy = SamplingParams(temperature=0.0, logprobs=0)
    new = [NewRequestData(req_id=f"r{i}", prompt_token_ids=p, sampling=greedy,
                          block_ids=list(range(i * nb, (i + 1) * nb)), num_computed_tokens=0)
           for i, p in enumerate(prompts)]
    plans = [StepPlan(step_id=1, new_requests=new, num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new})]
    for step in range(2, 5):
        plans.append(StepPlan(step_id=step, num_scheduled_tokens={r.req_id: 1 for r in new}))
    return plans


def test_runner_replays_decode_graphs_with_the_same_tokens(tiny_model_dir: Path) -> None:
    """The real runner and model: decode steps through captured (stand-in) graphs with the
    triton kernels give the tokens and logprobs of the eager reference path."""
    config = WorkerConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=4 << 20,
                          max_num_seqs=4, max_model_len=128, num_threads=1)
    prompts = [[5, 9, 200, 7, 31], [44, 3], [1000, 17, 17, 2, 8, 99, 12]]
    eager = ModelRunner(config)
    graphed = ModelRunner(config)
    assert graphed.graphs is None  # CPU: no CUDA graphs unless a test installs them
    backend = TritonBackend(CPU, prefill_block_m=16)
    graphed.graphs = DecodeGraphs(
        decode_forward(graphed.body, graphed.lm_head, backend, graphed.kv.caches, graphed.max_model_len),
        max_num_seqs=4, max_model_len=graphed.max_model_len, block_size=graphed.block_size, device=CPU,
        capture=eager_capture)
    graphed.graphs.capture_all()
    for plan in _plans(prompts, nb=2):
        want = eager.execute(plan)
        got = graphed.execute(plan)
        assert got.sampled_token_ids == want.sampled_token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a is not None and b is not None
            assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-4
    assert graphed.graphs.num_replays == 3  # the prefill step ran eagerly, the three decodes replayed


def test_graphs_off_reasons() -> None:
    backend = TritonBackend(CPU)
    assert "no CUDA graphs" in graphs_wanted(CPU, False, backend)
    cuda = torch.device("cuda")
    assert graphs_wanted(cuda, True, backend) == "--enforce-eager"
    assert "cannot be captured" in graphs_wanted(cuda, False, object())
    assert graphs_wanted(cuda, False, backend) == ""
    assert WorkerConfig().enforce_eager is False
    assert graph_memory_estimate([], 100, 2, 10, 10) == 0
    # Outputs for every bucket (1+2+4 rows of 100 logits of 2 bytes) + activations scaled to 4 of 8 tokens.
    assert graph_memory_estimate([1, 2, 4], 100, 2, 800, 8) == 7 * 100 * 2 + 400


def test_enforce_eager_flag_reaches_the_worker_config() -> None:
    import argparse

    from shared.config import add_config_args, config_from_args, config_to_flags

    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    config = config_from_args(WorkerConfig, parser.parse_args(["--enforce-eager", "--device", "cuda"]))
    assert config.enforce_eager is True
    # The supervisor rebuilds a worker's config from flags: the knob survives the round trip.
    again = config_from_args(WorkerConfig, parser.parse_args(config_to_flags(config)))
    assert again.enforce_eager is True and again.device == "cuda"
    assert config_from_args(WorkerConfig, parser.parse_args([])).enforce_eager is False
