"""Fused CPU ops, bfloat16 and float32 (services/worker/model/fused_ops.py, services/kernels/csrc/fused_ops.cpp).

Each kernel against the transformers code it replaces, on random inputs: the rotary
embedding bit for bit in both dtypes (also on the strided q/k views the fused q/k/v
product yields), RMSNorm and SiLU-and-mul within one bfloat16 step and almost always
equal in bfloat16, within a few float32 ulps in float32; then a whole random Llama and
Qwen2 with every swap made, against the untouched model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from services.worker.model import fused_ops
from services.worker.model.fused_ops import FusedRMSNorm, FusedSiluMLP, fuse_elementwise, fused_ops_enabled
from services.worker.model.packed_linear import FusedHead, fuse_projections, pack_linears
from tests.busy import same_bits_with_work_taken

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _kernels():  # noqa: ANN202
    k = fused_ops.kernels()
    if k is None:
        pytest.skip("no C++ compiler: the fused ops are absent and the model stays as it is")
    return k


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_step_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: one bfloat16 step at most, almost always equal; float32: within 2^-18 relative."""
    assert got.dtype == want.dtype
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert torch.all(diff <= want.abs() * 2.0**-18 + 1e-30), float(diff.max())  # ~30 ulps; seen <= 9
        return
    assert torch.all(diff <= want.float().abs() * 2.0**-7 + 1e-6), float(diff.max())
    assert (got == want).float().mean() > 0.995


DTYPES = pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "f32"])


@DTYPES
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("width", [64, 576])
def test_rms_norm_matches_llama_rms_norm(rows: int, width: int, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    k = _kernels()
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=_gen(1)) + 0.5)
    x = (torch.randn(rows, width, generator=_gen(rows)) * 4).to(dtype)
    with torch.inference_mode():
        got, want = k.rms_norm(x, norm.weight, 1e-5), norm(x)
    assert got.shape == want.shape and got.dtype == dtype
    _one_step_apart(got, want)


@DTYPES
def test_rms_norm_rows_in_fours_are_the_rows_alone(dtype: torch.dtype) -> None:
    """The kernels norm four rows at a time (four sums of squares in flight), each row's sum in
    the order a row alone has: a row's bits do not depend on its neighbours."""
    k = _kernels()
    x = (torch.randn(13, 576, generator=_gen(13)) * 3).to(dtype)
    delta = torch.randn(13, 576, generator=_gen(14)).to(dtype)
    weight = (torch.rand(576, generator=_gen(2)) + 0.5).to(dtype)
    together = k.rms_norm(x, weight, 1e-5)
    summed, normed = k.add_rms_norm(x, delta, weight, 1e-5)
    for r in range(13):
        assert torch.equal(together[r], k.rms_norm(x[r : r + 1].contiguous(), weight, 1e-5)[0]), r
        one_sum, one_norm = k.add_rms_norm(x[r : r + 1].contiguous(), delta[r : r + 1].contiguous(), weight, 1e-5)
        assert torch.equal(summed[r], one_sum[0]) and torch.equal(normed[r], one_norm[0]), r


@DTYPES
@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("inter", [32, 1536])
def test_silu_and_mul_matches_act_times_up(rows: int, inter: int, dtype: torch.dtype) -> None:
    k = _kernels()
    x = (torch.randn(rows, 2 * inter, generator=_gen(inter)) * 5).to(dtype)
    x[0, :4] = torch.tensor([-200.0, -90.0, 0.0, 120.0])  # saturated and zero gates
    got = k.silu_and_mul(x)
    want = F.silu(x[:, :inter]) * x[:, inter:]
    assert got.shape == (rows, inter)
    _one_step_apart(got[:, 4:], want[:, 4:])
    # saturated: ~0 (e^-90 and e^-200 underflow differently, both far below one step of 1e-6), 0, the gate itself
    assert torch.all(got[0, :3].float().abs() <= 1e-6 * x[0, inter : inter + 3].float().abs())
    assert got[0, 3] == want[0, 3]


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_equals_apply_rotary_pos_emb_on_strided_views(head_dim: int, tokens: int, dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    k = _kernels()
    original = getattr(modeling_llama.apply_rotary_pos_emb, "ferry_original", modeling_llama.apply_rotary_pos_emb)
    heads, kv_heads = 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen(tokens)).to(dtype)
    q = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    kk = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    angles = torch.rand(1, tokens, head_dim // 2, generator=_gen(5)) * 500
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = original(q, kk, cos, sin)
    got_q, got_k = k.rotary(q[0].transpose(0, 1), kk[0].transpose(0, 1), cos[0], sin[0])
    assert got_q.is_contiguous() and got_q.shape == (tokens, heads, head_dim)
    assert torch.equal(got_q.transpose(0, 1).unsqueeze(0), want_q)
    assert torch.equal(got_k.transpose(0, 1).unsqueeze(0), want_k)
    # the patched function: same result through ferry's fast path, and the original for anything else
    patched = fused_ops._rotary(original, k)
    fast_q, fast_k = patched(q, kk, cos, sin)
    assert torch.equal(fast_q, want_q) and torch.equal(fast_k, want_k)
    qf, kf, cf, sf = q.half(), kk.half(), cos.half(), sin.half()  # float16: not a fused dtype
    slow = patched(qf, kf, cf, sf)
    assert slow[0].dtype == torch.float16 and torch.equal(slow[0], original(qf, kf, cf, sf)[0])
    if dtype == torch.float32:  # FERRY_CPU_FLOAT32_EXACT=1: float32 through the original at every call
        spy = _Spy(k)
        exact = fused_ops._rotary(original, spy)
        monkeypatch.setenv("FERRY_CPU_FLOAT32_EXACT", "1")
        assert torch.equal(exact(q, kk, cos, sin)[0], want_q) and spy.calls == 0
        monkeypatch.delenv("FERRY_CPU_FLOAT32_EXACT")
        assert torch.equal(exact(q, kk, cos, sin)[0], want_q) and spy.calls == 1


class _Spy:
    """The kernels, counting rotary calls."""

    def __init__(self, kernels) -> None:  # noqa: ANN001
        self.kernels, self.calls = kernels, 0

    def rotary(self, *args):  # noqa: ANN002, ANN202
        self.calls += 1
        return self.kernels.rotary(*args)


def test_fused_ops_on_the_cpu_in_bfloat16_and_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused_ops_enabled(BF16, CPU) and fused_ops_enabled(torch.float32, CPU)
    assert not fused_ops_enabled(torch.float16, CPU)
    assert not fused_ops_enabled(BF16, torch.device("cuda"))
    from services.worker.backends.cpu_paged import CpuPagedBackend

    _kernels()
    assert CpuPagedBackend(CPU).float32_prefill  # float32 prompts through the prompt kernel
    monkeypatch.setenv("FERRY_CPU_FLOAT32_EXACT", "1")  # float32 computed as transformers computes it
    assert fused_ops_enabled(BF16, CPU) and not fused_ops_enabled(torch.float32, CPU)
    assert not CpuPagedBackend(CPU).float32_prefill  # and its prompts through SDPA
    monkeypatch.delenv("FERRY_CPU_FLOAT32_EXACT")
    monkeypatch.setenv("FERRY_CPU_FUSED_OPS", "0")
    assert not fused_ops_enabled(BF16, CPU)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert fuse_elementwise(model, BF16, CPU) == {"rms_norm": 0, "silu_mlp": 0, "rotary": 0}


def _random_model(kind: str, dtype: torch.dtype = BF16):  # noqa: ANN202
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2 if kind == "llama" else 1, max_position_embeddings=256, vocab_size=512,
               tie_word_embeddings=True)
    config = AutoConfig.for_model(kind, **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@DTYPES
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_model_matches_the_untouched_one(kind: str, dtype: torch.dtype) -> None:
    _kernels()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: gate/up are not fused, so the MLP is not either")
    model = _random_model(kind, dtype)
    fast = copy.deepcopy(model)
    body = fast.get_decoder()
    layers = len(body.layers)
    fuse_projections(body, dtype, CPU)
    pack_linears(body, dtype, CPU)
    # gate/up are joined only where oneDNN's product equals the separate ones (bfloat16 on
    # AVX2 may not): the MLP's activation is fused only over a joined gate/up
    joined = sum(isinstance(layer.mlp.gate_proj, FusedHead) for layer in body.layers)
    if dtype == torch.float32 or fused_ops.kernels().kernel_isa() == "avx512":
        assert joined == layers
    counts = fuse_elementwise(body, dtype, CPU)
    assert counts == {"rms_norm": 2 * layers + 1, "silu_mlp": joined, "rotary": 1}
    assert isinstance(body.norm, FusedRMSNorm)
    assert all(isinstance(layer.mlp, FusedSiluMLP) == (joined == layers) for layer in body.layers)
    module = __import__(type(body.layers[0].self_attn).__module__, fromlist=["apply_rotary_pos_emb"])
    assert getattr(module.apply_rotary_pos_emb, "ferry_fused", False)
    ids = torch.randint(0, 512, (1, 23), generator=_gen(3))
    with torch.inference_mode():
        want = model(ids).logits.float()
        got = fast(ids).logits.float()
    if dtype == torch.float32:  # summation orders and exponentials only: float32 noise
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        return
    # bfloat16 through two layers: the rare one-step differences stay small and keep the argmax
    assert torch.allclose(got, want, atol=0.05, rtol=0.05), float((got - want).abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_is_the_add_then_the_norm(rows: int, dtype: torch.dtype) -> None:
    k = _kernels()
    x = (torch.randn(1, rows, 576, generator=_gen(rows)) * 3).to(dtype)
    delta = torch.randn(1, rows, 576, generator=_gen(rows + 1)).to(dtype)
    weight = (torch.rand(576, generator=_gen(2)) + 0.5).to(dtype)
    total, normed = k.add_rms_norm(x, delta, weight, 1e-5)
    assert total.dtype == normed.dtype == dtype
    assert torch.equal(total, x + delta)  # the same sum PyTorch stores
    assert torch.equal(normed, k.rms_norm(x + delta, weight, 1e-5))
    assert torch.equal(x, (torch.randn(1, rows, 576, generator=_gen(rows)) * 3).to(dtype))  # inputs untouched
    with pytest.raises(RuntimeError, match="one dtype"):
        k.add_rms_norm(x, delta.to(torch.float32 if dtype == BF16 else BF16), weight, 1e-5)


def _argmax_cases(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that probe argmax's rules: ties (first wins), NaN (first NaN wins), -inf rows,
    signed zeros, +inf, the maximum in the last (vector tail) element, and many equal values."""
    nan, inf = float("nan"), float("inf")
    x = torch.randn(10, width, generator=_gen(width)) * 4
    last = width - 1
    x[1, last // 3] = x[1, last] = 100.0                      # a tie: the earlier index
    x[2, last // 2] = 100.0
    x[2, last] = nan                                         # a NaN after the maximum
    x[3, last] = nan
    x[3, last // 4] = nan                                    # two NaNs: the first
    x[4] = -inf                                              # nothing but -inf: index 0
    x[5] = -1.0 - torch.rand(width, generator=_gen(5))       # signed zeros as the maximum
    x[5, last // 2], x[5, last] = -0.0, 0.0
    x[6, last] = 1000.0                                      # in the tail past the last full vector
    x[7, last // 5] = inf
    x[8] = torch.randint(-3, 3, (width,), generator=_gen(8)).float()  # many equal maxima
    x[9, 0] = 1000.0
    return x.to(dtype)


@DTYPES
@pytest.mark.parametrize("width", [1, 15, 17, 64, 1000, 49152])
def test_argmax_rows_is_torch_argmax(width: int, dtype: torch.dtype) -> None:
    k = _kernels()
    x = _argmax_cases(width, dtype)
    got = k.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (10,)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    if width >= 17:
        assert got[1] == (width - 1) // 3 and got[2] == width - 1 and got[3] == (width - 1) // 4
        assert got[4] == 0 and got[6] == width - 1 and got[9] == 0
    wide = torch.randn(64, width, generator=_gen(width + 1)).to(dtype)  # a decode step's worth of rows
    assert torch.equal(k.argmax_rows(wide), wide.argmax(dim=-1))
    assert k.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous"):
        k.argmax_rows(x.t() if width > 1 else x[0])


@DTYPES
@pytest.mark.parametrize("width", [1, 16, 37, 1000])
def test_sample_rows_is_the_inverse_cdf_of_the_softmax(width: int, dtype: torch.dtype) -> None:
    k = _kernels()
    n = 4000  # uniforms on a grid: each token's share of them is its probability, to 1/n
    x = (torch.randn(1, width, generator=_gen(width)) * 3).to(dtype)
    if width > 3:
        x[0, 2] = float("-inf")  # masked (a constraint): never drawn
    for temperature in (0.6, 1.0, 1.7):
        u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
        tokens = k.sample_rows(x.repeat(n, 1), torch.full((n,), 1 / temperature), *_no_filters(n), u)
        assert tokens.dtype == torch.int64 and bool((tokens[1:] >= tokens[:-1]).all())  # u's order kept
        freq = torch.bincount(tokens, minlength=width).double() / n
        p = torch.softmax(x[0].double() / temperature, dim=-1)
        assert float((freq - p).abs().max()) <= 1.5 / n, (freq, p)
        if width > 3:
            assert not bool((tokens == 2).any())


def test_sample_rows_edges() -> None:
    k = _kernels()
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[0.0, 5.0, 1.0, -inf],      # u = 0: the first token of nonzero weight
                      [-inf, 5.0, 1.0, -inf],     # u just below 1: the last such token
                      [1.0, nan, 3.0, nan],       # a NaN: the first NaN, as argmax answers
                      [-inf, -inf, -inf, -inf],   # nothing to draw: 0
                      [0.0, 5.0, 1.0, 4.0],       # temperature 1e-4: the argmax
                      [-200.0, 0.0, -200.0, 0.0]])  # e^-200 weighs nothing; a tie splits u
    inv_t = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e4, 1.0])
    u = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5, 0.5, 0.999, 0.75])
    assert k.sample_rows(x, inv_t, *_no_filters(6), u).tolist() == [0, 2, 1, 0, 1, 3]
    with pytest.raises(RuntimeError, match="one per row"):
        k.sample_rows(x, inv_t[:2], *_no_filters(6), u)


def _no_filters(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n)


def _filtered_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """float64 reference: top-k, then top-p over what top-k kept, then min-p, each keeping the
    tokens tied with the last one it needs; then renormalized."""
    e = torch.exp((x.double() - x.double().max()) / temperature)
    keep = torch.ones_like(e, dtype=torch.bool)
    if 0 < top_k < e.numel():
        keep &= e >= e.sort(descending=True).values[top_k - 1]
    if top_p < 1.0:
        kept = (e * keep).sort(descending=True).values
        cum = kept.cumsum(0)
        last = int(torch.searchsorted(cum, top_p * cum[-1]))  # the first prefix reaching top_p
        keep &= e >= kept[min(last, kept.numel() - 1)]
    keep &= e >= min_p
    w = e * keep
    return w / w.sum()


@DTYPES
@pytest.mark.parametrize("width", [37, 1000])
@pytest.mark.parametrize("filters", [(5, 1.0, 0.0), (0, 0.6, 0.0), (50, 0.8, 0.0), (0, 1.0, 0.2), (20, 0.9, 0.05),
                                     (1, 1.0, 0.0), (0, 0.0, 0.0)],
                         ids=["top-k", "top-p", "top-k+top-p", "min-p", "all three", "top-k 1", "top-p 0"])
def test_sample_rows_filters_are_the_thresholds(width: int, filters: tuple[int, float, float],
                                                dtype: torch.dtype) -> None:
    k = _kernels()
    top_k, top_p, min_p = filters
    n = 4000
    x = (torch.randn(1, width, generator=_gen(width + 7)) * 2).to(dtype)
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
    tokens = k.sample_rows(x.repeat(n, 1), torch.full((n,), 1 / 0.8), torch.full((n,), top_k, dtype=torch.long),
                           torch.full((n,), top_p), torch.full((n,), min_p), u)
    freq = torch.bincount(tokens, minlength=width).double() / n
    p = _filtered_probs(x[0], 0.8, top_k, top_p, min_p)
    assert float((freq - p).abs().max()) <= 1.5 / n, (freq, p)
    assert set(tokens.tolist()) <= set(p.nonzero().flatten().tolist())
    if top_k == 1 or top_p == 0.0:
        assert set(tokens.tolist()) == {int(x[0].float().argmax())}


@DTYPES
@pytest.mark.parametrize("width", [37, 1000])
@pytest.mark.parametrize("filters", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.6, 0.0), (20, 0.9, 0.05), (1, 1.0, 0.0),
                                     (0, 0.0, 0.0)],
                         ids=["none", "top-k", "top-p", "all three", "top-k 1", "top-p 0"])
def test_race_rows_draws_the_filtered_softmax(width: int, filters: tuple[int, float, float],
                                              dtype: torch.dtype) -> None:
    k = _kernels()
    top_k, top_p, min_p = filters
    n = 40_000  # one key per draw: each token's share is its probability, within sampling error
    x = (torch.randn(1, width, generator=_gen(width + 7)) * 2).to(dtype)
    x[0, 3] = float("-inf")  # masked (a constraint): never drawn
    tokens = k.race_rows(x.repeat(n, 1), torch.full((n,), 1 / 0.8), torch.full((n,), top_k, dtype=torch.long),
                         torch.full((n,), top_p), torch.full((n,), min_p), torch.arange(n))
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    freq = torch.bincount(tokens, minlength=width).double() / n
    p = _filtered_probs(x[0], 0.8, top_k, top_p, min_p)
    bound = 5 * (p * (1 - p) / n).sqrt() + 1 / n  # five standard deviations
    assert bool(((freq - p).abs() <= bound).all()), (freq - p).abs().max()
    assert set(tokens.tolist()) <= set(p.nonzero().flatten().tolist())
    if top_k == 1 or top_p == 0.0:
        assert set(tokens.tolist()) == {int(x[0].float().argmax())}
    # a key is a draw: the same key, the same token, in any row of any batch
    again = k.race_rows(x.repeat(3, 1), torch.full((3,), 1 / 0.8), torch.full((3,), top_k, dtype=torch.long),
                        torch.full((3,), top_p), torch.full((3,), min_p), torch.tensor([7, 0, 7]))
    assert again.tolist() == [tokens[7].item(), tokens[0].item(), tokens[7].item()]


def test_race_rows_pick_survives_last_bit_changes_of_the_logits() -> None:
    """The point of the keyed race: a seeded request resumed on recomputed KV sees logits a
    few ulps away from the first run's, and must draw the same tokens. (The inverse CDF moves
    its pick whenever an earlier token's mass or the top-p cut moves: ``sample_rows`` on these
    rows with one uniform each changed 6 of 2,000 picks when this test was written.)"""
    k = _kernels()
    n, width = 2000, 8192
    x = torch.randn(n, width, generator=_gen(3)) * 1.2  # a random-weight model's flat logits
    nudged = x * (1 + torch.randn(n, width, generator=_gen(4)) * 1e-5)
    filters = (torch.full((n,), 1 / 0.9), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.95), torch.zeros(n))
    keys = torch.arange(n, dtype=torch.long)
    assert torch.equal(k.race_rows(x, *filters, keys), k.race_rows(nudged, *filters, keys))


def test_race_rows_edges() -> None:
    k = _kernels()
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, nan],       # a NaN: the first NaN, as argmax answers
                      [-inf, -inf, -inf, -inf],   # nothing to draw: 0
                      [0.0, 5.0, 1.0, 4.0],       # temperature 1e-4: the argmax
                      [-inf, 5.0, -inf, -inf]])   # one token left
    got = k.race_rows(x, torch.tensor([1.0, 1.0, 1e4, 1.0]), *_no_filters(4), torch.tensor([1, 2, 3, 4]))
    assert got.tolist() == [1, 0, 1, 1]
    with pytest.raises(RuntimeError, match="one per row"):
        k.race_rows(x, torch.ones(4), *_no_filters(4), torch.tensor([1, 2]))


def test_kernel_bfloat16_rounding_equals_torch_bit_for_bit() -> None:
    """The kernels' float32 -> bfloat16 store (AVX512-BF16's instruction where the CPU has it,
    with NaNs and subnormals sent through the exact path) gives torch's bits: every sign and
    exponent and upper mantissa, each with the low halves that decide rounding (zero, just below,
    at and above the tie, all ones), so every NaN, subnormal, infinity and tie; then random bits."""
    k = _kernels()
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (upper[:, None] | lows[None, :]).reshape(-1)
    bits = torch.cat([bits, torch.randint(0, 1 << 32, (1 << 20,), generator=_gen(7), dtype=torch.int64)])
    x = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps: the same 32 bits
    got, want = k.to_bfloat16(x).view(torch.int16), x.to(BF16).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan], torch.full_like(got[nan], 0x7FC0))  # c10's one NaN, any sign or payload
    assert int(nan.sum()) > 2 * 255 * 6 and int((x.abs() < 1.1754944e-38).sum()) > 255 * 6  # NaNs and subnormals were there


@DTYPES
def test_row_ops_in_pieces_taken_between_threads_change_no_bit(dtype: torch.dtype) -> None:
    """A prompt step's row-wise ops run in pieces that a thread done with its own takes from the
    other (work_split.h, parallel_rows): with a process busy beside the two threads, norms,
    the residual add and rotary give the bits of the split done once (``work_stealing(False)``),
    run after run, at 2,048 rows (pieces) and 64 (one piece per thread)."""
    k = _kernels()
    gen = _gen(31)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    cases = []
    for rows in (2048, 64):
        x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
        delta = torch.randn(rows, 576, generator=gen).to(dtype)
        qkv = torch.randn(rows, 15, 64, generator=gen).to(dtype)  # q, k, v heads of one product: strided views
        angles = torch.rand(rows, 32, generator=gen) * 6.28
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype).contiguous() for f in (torch.cos, torch.sin))
        cases.append((x, delta, qkv[:, :9], qkv[:, 9:12], cos, sin))

    def run() -> list[torch.Tensor]:
        out = []
        for x, delta, q, kk, cos, sin in cases:
            out += [k.rms_norm(x, weight, 1e-5), *k.add_rms_norm(x, delta, weight, 1e-5), *k.rotary(q, kk, cos, sin)]
        return out

    once = same_bits_with_work_taken(k, run)
    # and the values are the ops': a norm row alone, the sum, a rotation that keeps each pair's length
    x, delta, q, _, _, _ = cases[0]
    assert torch.equal(once[0][1000], k.rms_norm(x[1000:1001].contiguous(), weight, 1e-5)[0])
    assert torch.equal(once[1], x + delta)
    q32, r32 = q.float(), once[3].float()
    torch.testing.assert_close(r32.pow(2).view(2048, 9, 2, 32).sum(2), q32.pow(2).view(2048, 9, 2, 32).sum(2),
                               rtol=2e-2, atol=2e-2)
