"""``--deterministic``'s parts, each alone: a token's numbers must not depend on its batch.

- ``as_decodes`` turns every query token into a decode of its own context;
- each attention backend made batch-invariant gives every token of a mixed step (decodes, a
  fresh prompt, a chunk over a cached prefix) the same bits as that token attended alone;
  without it the prompt paths do not (the property is not free, so this test can fail);
- every linear layer gives a row the same bits at any row count (``in_fixed_rows`` at its
  edges: a call is exactly ``rows`` rows, 16 rows one call, 17 two);
- the PyTorch race draws a seeded row alike beside any other rows;
- what ``--deterministic`` cannot promise is refused by name.

The Triton backend runs under the interpreter (tests/device/interpreter.py), as in
test_triton_attention.py.
"""

from __future__ import annotations

import pytest

from tests.device.interpreter import enable_interpreter

HAVE_TRITON = enable_interpreter()  # before anything imports the kernels

import torch  # noqa: E402
from torch import nn  # noqa: E402

from services.worker.backends import PagedBatch, select_backend  # noqa: E402
from services.worker.backends.base import AttentionBackend, as_decodes  # noqa: E402
from services.worker.model.batch_invariant import FixedRowsLinear, make_linears_batch_invariant  # noqa: E402
from services.worker.model.packed_linear import PackedLinear, in_fixed_rows  # noqa: E402
from services.worker.runner import check_deterministic  # noqa: E402
from services.worker.sampler import Sampler  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402
from shared.messages import SamplingParams  # noqa: E402
from tests.device.attention_cases import AttentionCase, make_case  # noqa: E402

CPU = torch.device("cpu")
# (cached, new): two decodes, a fresh prompt of 5, a chunk of 3 over 4 cached, one of 6 over 13
STEP = [(7, 1), (30, 1), (0, 5), (4, 3), (13, 6)]


def test_as_decodes_gives_each_token_its_own_context_and_table_row() -> None:
    case = make_case(STEP, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    out = as_decodes(case.batch)
    assert (out.num_reqs, out.num_decodes, out.num_tokens, out.max_query_len) == (16, 16, 16, 1)
    assert out.seq_lens_cpu == (8, 31, 1, 2, 3, 4, 5, 5, 6, 7, 14, 15, 16, 17, 18, 19)
    assert out.seq_lens.tolist() == list(out.seq_lens_cpu)
    assert out.query_start_loc_cpu == tuple(range(17)) and out.query_start_loc.tolist() == list(range(17))
    rows = [0, 1] + [2] * 5 + [3] * 3 + [4] * 6
    assert torch.equal(out.block_table, case.batch.block_table[rows])
    assert out.slot_mapping is case.batch.slot_mapping
    decodes = make_case([(3, 1), (9, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16).batch
    assert as_decodes(decodes) is decodes  # a step of decodes only is already one token a row


def _backends() -> list[str]:
    names = ["reference"]
    try:
        select_backend("cpu_paged", CPU)
        names.append("cpu_paged")
    except Exception:  # noqa: BLE001 - no C++ compiler here: the kernels' backend is absent
        pass
    if HAVE_TRITON:
        names.append("triton")
    return names


def _backend(name: str) -> AttentionBackend:
    if name == "triton":
        from services.worker.backends.triton_backend import TritonBackend

        return TritonBackend(CPU)
    return select_backend(name, CPU)


def _one_token(case: AttentionCase, token: int, req: int, position: int) -> PagedBatch:
    """Token ``token`` of the step (of request ``req``, at ``position``) as a decode alone."""
    b = case.batch
    return PagedBatch(
        num_reqs=1, num_decodes=1, num_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([position + 1], dtype=torch.int32), block_table=b.block_table[req : req + 1],
        slot_mapping=b.slot_mapping[token : token + 1], max_query_len=1, max_seq_len=position + 1,
        block_size=b.block_size, max_model_len=b.max_model_len, query_start_loc_cpu=(0, 1),
        seq_lens_cpu=(position + 1,),
    )


def _attend(backend: AttentionBackend, case: AttentionCase, batch: PagedBatch, tokens: slice) -> torch.Tensor:
    if hasattr(backend, "set_head_shape"):
        backend.set_head_shape(case.query.shape[1], case.key.shape[1], case.query.shape[2])
    meta = backend.prepare(batch)
    return backend.forward(0, case.query[tokens], case.key[tokens], case.value[tokens], case.k_cache,
                           case.v_cache, meta, case.scale)


def _alone_vs_together(name: str, dtype: torch.dtype, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's output, each token's output attended alone) through backend ``name``."""
    case = make_case(STEP, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=3)
    backend = _backend(name)
    if invariant:
        backend.make_batch_invariant()
    together = _attend(backend, case, case.batch, slice(None))  # writes every new key and value first
    alone = []
    token = 0
    for req, (cached, new) in enumerate(STEP):
        for j in range(new):
            alone.append(_attend(backend, case, _one_token(case, token, req, cached + j), slice(token, token + 1)))
            token += 1
    return together, torch.cat(alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", _backends())
def test_a_batch_invariant_backend_gives_each_token_its_bits_alone(name: str, dtype: torch.dtype) -> None:
    together, alone = _alone_vs_together(name, dtype, invariant=True)
    for t in range(together.shape[0]):
        assert torch.equal(together[t], alone[t]), f"token {t}: other bits in the step than alone"
    # and it is attention: close to the backend's own default answer
    default, _ = _alone_vs_together(name, dtype, invariant=False)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(together.float(), default.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", [n for n in _backends() if n != "triton"])
def test_without_it_prompt_tokens_differ_from_their_decodes(name: str) -> None:
    """The default paths reduce a prompt's keys in another order than a decode (this is what
    --deterministic is for; were it free, the test above could not fail)."""
    together, alone = _alone_vs_together(name, torch.bfloat16, invariant=False)
    assert any(not torch.equal(together[t], alone[t]) for t in range(2, together.shape[0]))


def test_in_fixed_rows_calls_are_exactly_rows_long_at_the_edges() -> None:
    calls: list[int] = []

    def product(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 2

    x = torch.arange(17 * 3, dtype=torch.float32).view(17, 3)
    for n, expected in ((1, [16]), (15, [16]), (16, [16]), (17, [16, 16]), (32, [16, 16]), (33, [16, 16, 16])):
        calls.clear()
        xs = torch.arange(n * 3, dtype=torch.float32).view(1, n, 3)  # leading dims are kept
        out = in_fixed_rows(product, xs, 16)
        assert calls == expected, n
        assert torch.equal(out, xs * 2)
    calls.clear()
    assert in_fixed_rows(product, x[:0], 16).shape == (0, 3)


def _linears(dtype: torch.dtype) -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    plain = nn.Linear(1536, 192, bias=True).to(dtype)  # K past oneDNN's float32 row-count blocking switch
    out: list[tuple[str, nn.Module]] = []
    holder = nn.Sequential(nn.Linear(1536, 192, bias=True).to(dtype))
    holder[0].load_state_dict(plain.state_dict())
    _, replaced = make_linears_batch_invariant(holder, CPU)
    assert isinstance(holder[0], FixedRowsLinear) and replaced
    out.append(("nn.Linear", holder))
    try:
        packed = nn.Sequential(PackedLinear(plain))
    except Exception:  # noqa: BLE001 - oneDNN cannot pack this dtype here
        return out
    ways, _ = make_linears_batch_invariant(packed, CPU)
    out.append((f"PackedLinear: {', '.join(ways)}", packed))
    from services.worker.model.fused_ops import kernels

    ops = kernels()
    if dtype == torch.bfloat16 and ops is not None and hasattr(ops, "tiled_pack"):
        tiled = PackedLinear(plain)
        tiled.add_tiled(plain.weight, ops, 6)  # the tiled kernel's rows, then AMX or oneDNN past them
        ways, _ = make_linears_batch_invariant(nn.Sequential(tiled), CPU)
        out.append((f"tiled: {', '.join(ways)}", tiled))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_linear_gives_a_row_its_bits_at_any_row_count(dtype: torch.dtype) -> None:
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    for label, layer in _linears(dtype):
        with torch.no_grad():
            alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
            for rows in (2, 7, 16, 17, 64, 129, 300):
                got = layer(x[:rows])[:40]
                n = min(rows, 40)
                assert torch.equal(got[:n], alone[:n]), f"{label}: a row's bits change at {rows} rows"


def test_the_pytorch_race_draws_a_seeded_row_alike_beside_any_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 500
    seeded = SamplingParams(temperature=1.0, top_p=0.8, seed=77)
    neighbours = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.99),
                  SamplingParams(temperature=1.0)]
    sampler = Sampler(CPU, batch_invariant=True)
    for step in range(30):
        logits = torch.randn(4, vocab, generator=gen) * 4
        alone = sampler._race(logits[:1], [seeded], [step])
        together = sampler._race(logits, [seeded, *neighbours], [step] * 4)
        assert int(together[0]) == int(alone[0])


def test_what_it_cannot_promise_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="triton"):
        check_deterministic(WorkerConfig(deterministic=True, device="cuda"), "reference")
    check_deterministic(WorkerConfig(deterministic=True, device="cuda"), "triton")
    check_deterministic(WorkerConfig(deterministic=True, tensor_parallel_size=2), "reference")


def test_top_logprobs_list_ties_by_token_id_in_any_batch() -> None:
    from services.worker.sampler import _top_by_id

    row = torch.full((50,), -9.0)
    row[[7, 3, 40, 12]] = -1.0  # four tied best, then a tie for the fifth place
    row[[30, 2]] = -2.0
    vals, ids = _top_by_id(row.unsqueeze(0), 5)
    assert ids == [[3, 7, 12, 40, 2]] and vals == [[-1.0] * 4 + [-2.0]]
    batch = torch.stack([torch.randn(50), row, torch.randn(50)])
    assert _top_by_id(batch, 5)[1][1] == [3, 7, 12, 40, 2]
    assert _top_by_id(row.unsqueeze(0), 4)[1] == [[3, 7, 12, 40]]  # k at the tie's edge
    assert _top_by_id(row.unsqueeze(0), 6)[1] == [[3, 7, 12, 40, 2, 30]]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_gpu_rmsnorm_gives_a_row_its_bits_at_any_row_count(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from services.worker.cuda.invariant_norm import InvariantRMSNorm, make_norms_batch_invariant

    torch.manual_seed(2)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)  # not a power of two: the row's masked tail counts
    with torch.no_grad():
        norm.weight.normal_()
    holder = nn.Sequential(norm, nn.Linear(96, 96))
    assert make_norms_batch_invariant(holder) == 1 and isinstance(holder[0], InvariantRMSNorm)
    x = torch.randn(2, 37, 96).to(dtype) * 3
    got = holder[0](x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-6  # bfloat16: within two of its steps (rsqrt against 1/sqrt)
    torch.testing.assert_close(got, norm(x), atol=tol * 4, rtol=tol)
    flat = x.reshape(-1, 96)
    for rows in (1, 5, 74):
        assert torch.equal(holder[0](flat[:rows]), got.reshape(-1, 96)[:rows])


def test_a_norm_without_an_invariant_gpu_kernel_is_refused_by_name() -> None:
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from services.worker.cuda.invariant_norm import make_norms_batch_invariant

    class GemmaRMSNorm(nn.Module):
        pass

    with pytest.raises(ValueError, match="GemmaRMSNorm"):
        make_norms_batch_invariant(nn.Sequential(GemmaRMSNorm()))


def test_top_logprobs_ties_match_a_row_by_row_sort_on_tie_heavy_rows() -> None:
    from services.worker.sampler import _top_by_id

    gen = torch.Generator().manual_seed(9)
    raw = (torch.randn(40, 300, generator=gen) * 2).round() / 2  # coarse values: ties everywhere
    for k in (1, 3, 8, 20):
        vals, ids = _top_by_id(raw, k)
        for r in range(raw.shape[0]):
            order = sorted(range(raw.shape[1]), key=lambda t: (-float(raw[r, t]), t))[:k]
            assert ids[r] == order and vals[r] == [float(raw[r, t]) for t in order]
