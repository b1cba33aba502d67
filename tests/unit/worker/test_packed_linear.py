"""oneDNN-packed and fused linear layers (services/worker/model/packed_linear.py).

Packing and fusing must not change a single bit of a bfloat16 forward on oneDNN: the packed
product against ``F.linear``, each fused projection against its separate layer, and
the whole tiny model's logits (Llama: GQA, no biases; Qwen2: MQA with q/k/v biases)
against the untouched model. The tiled kernel (csrc/tiled_linear.cpp) sums in another
order: held to the float32 product within a bfloat16 step, and to its own bits across
batch sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.packed_linear import (
    ALL_ROWS,
    FusedHead,
    FusedPart,
    PackedLinear,
    amx_prompt,
    fuse_projections,
    pack_linears,
    packing_enabled,
)
from tests.busy import two_threads_beside_a_busy_process
from tests.conftest import cached_tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def _bf16_packing_exact_here() -> bool:
    """oneDNN's packed bfloat16 product equals ``F.linear``'s where both run oneDNN's native
    bf16 kernels (AVX512-BF16, AMX); on AVX2 (e.g. ``ONEDNN_MAX_CPU_ISA=AVX2``) they need not,
    and pack_linears' probe then keeps the layers as they are."""
    lin = nn.Linear(48, 40).to(torch.bfloat16)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        try:
            return torch.equal(PackedLinear(lin)(x), F.linear(x, lin.weight, lin.bias))
        except RuntimeError:  # oneDNN refuses to pack bfloat16 without AVX-512 (or AVX-NE-CONVERT)
            return False


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (1, 7, 48), (2, 64, 48)])
def test_packed_linear_is_bit_identical_in_bfloat16(bias: bool, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[-2])
    lin = nn.Linear(48, 40, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 48, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    if not _bf16_packing_exact_here():  # AVX2: oneDNN refuses or differs, and nothing is swapped in
        model = nn.Sequential(lin)
        assert pack_linears(model, torch.bfloat16, CPU) == 0 and type(model[0]) is nn.Linear
        return
    packed = PackedLinear(lin)
    out = packed(x)
    assert out.shape == (*shape[:-1], 40) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x, lin.weight, lin.bias))


def test_packing_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert packing_enabled(torch.bfloat16, CPU) and packing_enabled(torch.float32, CPU)
    assert not packing_enabled(torch.bfloat16, torch.device("cuda"))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert pack_linears(model, torch.float32, CPU) == 2
    monkeypatch.setenv("FERRY_CPU_FLOAT32_EXACT", "1")  # float32 linears as F.linear computes them
    assert packing_enabled(torch.bfloat16, CPU) and not packing_enabled(torch.float32, CPU)
    assert pack_linears(nn.Sequential(nn.Linear(8, 8)), torch.float32, CPU) == 0
    monkeypatch.delenv("FERRY_CPU_FLOAT32_EXACT")
    monkeypatch.setenv("FERRY_CPU_PACKED_LINEAR", "0")
    assert not packing_enabled(torch.bfloat16, CPU) and not packing_enabled(torch.float32, CPU)
    assert pack_linears(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16), torch.bfloat16, CPU) == 0


def test_float32_packing_and_fusion_stay_within_summation_order() -> None:
    gen = torch.Generator().manual_seed(3)
    attn = nn.Module()
    for name, out in (("q_proj", 576), ("k_proj", 192), ("v_proj", 192)):
        setattr(attn, name, nn.Linear(576, out, bias=False))
    with torch.no_grad():
        for m in attn.children():
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.05)
    x = torch.randn(7, 576, generator=gen)
    with torch.no_grad():
        want = [F.linear(x, m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert fuse_projections(attn, torch.float32, CPU) == 1
    assert isinstance(attn.q_proj, FusedHead) and isinstance(attn.q_proj.fused, PackedLinear)
    with torch.no_grad():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())


def test_fused_part_refuses_another_input() -> None:
    head = FusedHead(nn.Linear(8, 12), [6, 4, 2])
    x = torch.randn(3, 8)
    q = head(x)
    k = FusedPart(head, 1)(x)
    assert q.shape == (3, 6) and k.shape == (3, 4)
    with pytest.raises(RuntimeError, match="another input"):
        FusedPart(head, 2)(torch.randn(3, 8))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_packed_model_gives_the_same_logits_bit_for_bit(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("FERRY_CPU_TILED_LINEAR", "0")  # oneDNN's products (the tiled kernel sums in another order)
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: oneDNN's packed products differ from F.linear's, nothing is packed")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model(kind), dtype=torch.bfloat16).eval()
    fast = copy.deepcopy(model)
    body = fast.get_decoder()
    layers = len(body.layers)
    assert fuse_projections(body, torch.bfloat16, CPU) == 2 * layers  # q/k/v and gate/up in every layer
    # 2 fused products + o_proj + down_proj per layer are packed (the fused ones already were)
    assert pack_linears(body, torch.bfloat16, CPU) == 2 * layers
    attn = body.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedHead) and isinstance(attn.v_proj, FusedPart)
    assert isinstance(attn.o_proj, PackedLinear)
    ids = torch.randint(0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(ids).logits
        got = fast(ids).logits
    assert torch.equal(got, want)


def _tiled_kernels():  # noqa: ANN202
    from services.worker.model.packed_linear import _tiled_kernels

    k = _tiled_kernels()
    if k is None:
        pytest.skip("no AVX512-BF16 tiled kernel in this build (or no compiler)")
    return k


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 27, 64, 130])
@pytest.mark.parametrize("outputs", [96, 80, 64])  # 2, 1 and 0 tiles past the last group of three
def test_tiled_kernel_matches_the_float32_product(bias: bool, rows: int, outputs: int) -> None:
    """The tiled kernel sums in float32 and rounds once: within one bfloat16 step of the exact
    product (plus a float32 step of the sum of the terms' magnitudes: an output that cancels to
    near zero keeps the float32 sum's rounding, which differs between CPUs' vdpbf16ps, e.g. Zen
    4 and Sapphire Rapids) everywhere, and almost always F.linear's own bits; every path (one or
    two rows streamed, blocks of 8 rows with a remainder, groups of 1-3 tiles) is taken here."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(rows + 10 * bias + outputs)
    w = torch.randn(outputs, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(outputs, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(1, rows, 576, generator=gen).to(torch.bfloat16)
    got = k.tiled_linear(x, k.tiled_pack(w), b.float() if bias else torch.empty(0))
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, rows, outputs) and got.dtype == torch.bfloat16
    magnitude = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    # round-to-nearest of a float32 sum
    assert torch.all((got.float() - want).abs() <= want.abs() * 2.0**-8 + magnitude * 2.0**-24)
    assert (got == F.linear(x, w, b)).float().mean() > 0.98


def _amx_kernels():  # noqa: ANN202
    k = _tiled_kernels()
    if not k.tiled_amx(-1):
        pytest.skip("no AMX tile products here (CPU or build)")
    return k


@pytest.mark.parametrize("rows", [1, 7, 16, 31, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 96)])
def test_amx_products_match_the_float32_product(rows: int, shape: tuple[int, int]) -> None:
    """AMX tile products over the tiled kernel's tiles (a CPU with AMX): within the tiled
    kernel's bound of the exact product, rows padded to 32 and 64 alike; a row's result does
    not depend on the other rows; the gated product equals the product followed by
    silu_and_mul, bit for bit (the same sums, rounded the same way)."""
    k = _amx_kernels()
    in_f, out_f = shape
    gen = torch.Generator().manual_seed(rows + in_f)
    w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_f, generator=gen).to(torch.bfloat16).float()
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    tiles = k.tiled_pack(w)
    got = k.amx_linear(x, tiles, b)
    want = F.linear(x.float(), w.float(), b)
    magnitude = F.linear(x.float().abs(), w.float().abs(), b.abs())
    assert got.shape == (rows, out_f) and got.dtype == torch.bfloat16
    assert torch.all((got.float() - want).abs() <= want.abs() * 2.0**-8 + magnitude * 2.0**-24)
    assert torch.equal(k.amx_linear(x[rows // 2:].contiguous(), tiles, b), got[rows // 2:])
    plain, exact = k.amx_linear(x, tiles, torch.empty(0)).float(), F.linear(x.float(), w.float())  # no bias
    assert torch.all((plain - exact).abs() <= exact.abs() * 2.0**-8 + magnitude * 2.0**-24)
    gated = k.amx_silu_linear(x, tiles, b)
    assert gated.shape == (rows, out_f // 2)
    assert torch.equal(gated, k.silu_and_mul(got))


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 96)])
def test_amx_prompt_rows_give_the_bits_of_decode_rows(shape: tuple[int, int]) -> None:
    """Past the decode bound (a prompt step's rows) the AMX products run another loop nest
    (run_rows: row blocks split between the threads, which take each other's items, beside a
    busy process here): every row gives the bits it gives in a product of 100 rows (the decode
    path), plain and gated, at 129-2,051 rows (a last block of fewer than 32 padded), within a
    bfloat16 step of the float32 product; the gated product is the product then silu_and_mul."""
    k = _amx_kernels()
    in_f, out_f = shape
    gen = torch.Generator().manual_seed(in_f + out_f)
    w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_f, generator=gen).to(torch.bfloat16).float()
    tiles = k.tiled_pack(w)
    with two_threads_beside_a_busy_process():
        for rows in (129, 300, 2051):
            x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
            assert rows > k.amx_linear_rows() >= 100
            got, gated = k.amx_linear(x, tiles, b), k.amx_silu_linear(x, tiles, b)
            pieces = [x[i:i + 100].contiguous() for i in range(0, rows, 100)]
            assert torch.equal(got, torch.cat([k.amx_linear(p, tiles, b) for p in pieces])), rows
            assert torch.equal(gated, torch.cat([k.amx_silu_linear(p, tiles, b) for p in pieces])), rows
            assert torch.equal(gated, k.silu_and_mul(got))
            want = F.linear(x.float(), w.float(), b)
            magnitude = F.linear(x.float().abs(), w.float().abs(), b.abs())
            assert torch.all((got.float() - want).abs() <= want.abs() * 2.0**-8 + magnitude * 2.0**-24)


@pytest.mark.parametrize("rows", [7, 32, 64, 100, 129, 300, 2051])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "bias"),
                         [(9, 3, 64, False), (4, 1, 128, True), (2, 2, 32, True)])
def test_amx_rope_product_gives_the_bits_of_product_then_rotary(rows: int, heads: int, kv_heads: int, head_dim: int,
                                                                 bias: bool) -> None:
    """The rotary embedding as the AMX q/k/v product's epilogue (amx_rope_linear; decode rows
    and a prompt step's alike): the query and key columns equal ``amx_linear`` then ``rotary``
    bit for bit, the value columns ``amx_linear``'s; through PackedLinear.rope_forward too, and
    ``amx_rope(0)`` turns the fused path off (decode_layers and the prompt steps ask it)."""
    k = _amx_kernels()
    qw, kw = heads * head_dim, kv_heads * head_dim
    in_f, out_f = 96, qw + 2 * kw
    gen = torch.Generator().manual_seed(rows + head_dim)
    w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_f, generator=gen).to(torch.bfloat16).float() if bias else torch.empty(0)
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 40  # any positions: cos/sin as rotary_emb lays them out
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(torch.bfloat16)
    tiles = k.tiled_pack(w)
    plain = k.amx_linear(x, tiles, b)
    q, kk = k.rotary(plain[:, :qw].view(rows, heads, head_dim), plain[:, qw:qw + kw].view(rows, kv_heads, head_dim),
                     cos, sin)
    got = k.amx_rope_linear(x, tiles, b, cos, sin, qw + kw, head_dim)
    assert got.shape == (rows, out_f) and got.dtype == torch.bfloat16
    assert torch.equal(got[:, :qw], q.reshape(rows, qw))
    assert torch.equal(got[:, qw:qw + kw], kk.reshape(rows, kw))
    assert torch.equal(got[:, qw + kw:], plain[:, qw + kw:])
    assert not torch.equal(got[:, :qw], plain[:, :qw])  # the embedding did rotate them
    assert torch.equal(k.amx_rope_linear(x, tiles, b, cos, sin, 0, head_dim), plain)  # no rope columns: the product
    lin = nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(b)
    packed = PackedLinear(lin)
    packed.add_tiled(w, k, 6, prompt=True)
    # PackedLinear takes it for a decode step's rows (past the tiled kernel's), not a prompt's
    fused = packed.rope_forward(x, cos, sin, qw + kw, head_dim)
    if 6 < rows <= k.amx_linear_rows():
        assert fused is not None and torch.equal(fused, got)
    else:
        assert fused is None
    try:
        assert not k.amx_rope(0)
    finally:
        assert k.amx_rope(1)
    with pytest.raises(RuntimeError, match="whole heads"):
        k.amx_rope_linear(x, tiles, b, cos, sin, head_dim // 2, head_dim)


def test_amx_prompt_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRY_CPU_AMX_PROMPT: by default every projection of a layer sends prompt rows to the AMX
    products (anything else, the LM head, not); ``0`` none, a list those named; anything else is
    refused by name."""
    names = ("model.layers.0.mlp.gate_proj/up_proj", "down_proj", "q_proj/k_proj/v_proj", "o_proj", "lm_head")
    assert [amx_prompt(n) for n in names] == [True, True, True, True, False]
    for setting, want in (("all", [True, True, True, True, False]), ("0", [False] * 5),
                          ("qkv, down", [False, True, True, False, False]), ("auto", [True, True, True, True, False]),
                          ("gate_up,down", [True, True, False, False, False])):
        monkeypatch.setenv("FERRY_CPU_AMX_PROMPT", setting)
        assert [amx_prompt(n) for n in names] == want, setting
    monkeypatch.setenv("FERRY_CPU_AMX_PROMPT", "gate_up,mlp")
    with pytest.raises(ValueError, match="FERRY_CPU_AMX_PROMPT"):
        amx_prompt("down_proj")


@pytest.mark.parametrize("setting", ["auto", "0", "gate_up,down"])
def test_prompt_rows_on_the_amx_products_drop_onednn_copy(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """With AMX, the projections FERRY_CPU_AMX_PROMPT names (by default all four) send every row
    past the tiled kernel's to the AMX products, a prompt's 300 too, and drop oneDNN's copy; the
    others keep it for prompt rows, as ``0`` keeps it everywhere. The
    model's logits stay within a bfloat16 step of transformers' whichever kernels take them."""
    k = _amx_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("FERRY_CPU_AMX_PROMPT", setting)
    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model("llama"), dtype=torch.bfloat16).eval()
    fast = copy.deepcopy(model)
    body = fast.get_decoder()
    fuse_projections(body, torch.bfloat16, CPU)
    pack_linears(body, torch.bfloat16, CPU)
    layer = body.layers[0]
    projections = {"qkv": layer.self_attn.q_proj.fused, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_proj.fused,
                   "down": layer.mlp.down_proj}
    on = {"auto": set(projections), "0": set(), "gate_up,down": {"gate_up", "down"}}[setting]
    for kind, m in projections.items():
        assert isinstance(m, PackedLinear) and m.tiles is not None, kind
        assert (m.packed is None) == (kind in on) and (m.amx_rows == ALL_ROWS) == (kind in on), kind
        assert m.amx_rows >= k.amx_linear_rows()
        assert ("AMX past them" in m.extra_repr()) == (kind in on)
        x = torch.randn(300, m.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.no_grad():
            got = m(x)
            if kind in on:
                assert torch.equal(got, k.amx_linear(x, m.tiles, m._bias32))
            else:
                assert m.packed is not None
                assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], ""))
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, got = model(ids).logits.float(), fast(ids).logits.float()
    assert torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_amx_products_off_and_on() -> None:
    """``tiled_amx(0)`` turns the AMX products off (they refuse to run), ``1`` back on; the
    bound they report is what PackedLinear and the decode call use."""
    k = _amx_kernels()
    x, tiles = torch.ones(3, 64, dtype=torch.bfloat16), k.tiled_pack(torch.ones(32, 64, dtype=torch.bfloat16))
    try:
        assert k.tiled_amx(0) == 0 and k.amx_linear_rows() == 0
        with pytest.raises(RuntimeError, match="no AMX"):
            k.amx_linear(x, tiles, torch.empty(0))
    finally:
        assert k.tiled_amx(1) >= 64
    assert torch.equal(k.amx_linear(x, tiles, torch.empty(0)), torch.full((3, 32), 64.0, dtype=torch.bfloat16))


def test_tiled_kernel_rows_do_not_depend_on_the_batch() -> None:
    """Every output is the same instructions in the same order whatever the row count, so a
    row computed alone, in a block of 8 or beside 200 others gives the same bits."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3072, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(3072, generator=gen)
    tiles = k.tiled_pack(w)
    x = torch.randn(203, 576, generator=gen).to(torch.bfloat16)
    full = k.tiled_linear(x, tiles, bias)
    for lo, hi in ((0, 1), (5, 7), (3, 6), (10, 18), (100, 161), (202, 203)):
        assert torch.equal(k.tiled_linear(x[lo:hi].contiguous(), tiles, bias), full[lo:hi]), (lo, hi)


def test_tiled_kernel_threads_take_each_others_groups_and_miss_none() -> None:
    """With two threads and a process busy beside them, a thread done with its own range of
    groups takes the other's last ones (work_split.h): every output is still written, and
    with the same bits, run after run."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1536 * 2, 576, generator=gen).to(torch.bfloat16)
    tiles = k.tiled_pack(w)
    x = torch.randn(37, 576, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), w.float())
    with two_threads_beside_a_busy_process():
        first = k.tiled_linear(x, tiles, torch.empty(0))
        gated_first = k.tiled_silu_linear(x, tiles, torch.empty(0))
        # every output written: none is far from the float32 product (sums of ~24 in size; one
        # near zero can round differently in float32, so an absolute margin too)
        assert torch.all((first.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-3)
        for _ in range(30):
            assert torch.equal(k.tiled_linear(x, tiles, torch.empty(0)), first)
            assert torch.equal(k.tiled_silu_linear(x, tiles, torch.empty(0)), gated_first)


def test_tiled_kernel_prefetch_changes_no_bit() -> None:
    """The next group's weights are prefetched by the current group's row blocks: a hint to
    the cache, never a value. On and off give the same bits, plain and gated, at row counts
    with one, several and many row blocks."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(12)
    tiles = k.tiled_pack(torch.randn(3072 + 96, 576, generator=gen).to(torch.bfloat16))
    bias = torch.randn(3072 + 96, generator=gen)
    try:
        for rows in (3, 16, 64, 130):
            x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
            k.tiled_prefetch(True)
            on = (k.tiled_linear(x, tiles, bias), k.tiled_silu_linear(x, tiles, bias))
            k.tiled_prefetch(False)
            off = (k.tiled_linear(x, tiles, bias), k.tiled_silu_linear(x, tiles, bias))
            assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]), rows
    finally:
        k.tiled_prefetch(True)


def test_tiled_kernel_refuses_what_it_cannot_compute() -> None:
    k = _tiled_kernels()
    tiles = k.tiled_pack(torch.randn(32, 64).to(torch.bfloat16))
    assert tiles.shape == (2, 32, 16) and tiles.dtype == torch.int32
    assert k.tiled_linear(torch.empty(0, 64, dtype=torch.bfloat16), tiles, torch.empty(0)).shape == (0, 32)
    with pytest.raises(RuntimeError, match="input width"):
        k.tiled_linear(torch.randn(2, 48).to(torch.bfloat16), tiles, torch.empty(0))
    with pytest.raises(RuntimeError, match="contiguous"):
        k.tiled_linear(torch.randn(64, 4).to(torch.bfloat16).t(), tiles, torch.empty(0))
    with pytest.raises(RuntimeError, match="bias"):
        k.tiled_linear(torch.randn(2, 64).to(torch.bfloat16), tiles, torch.zeros(31))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        k.tiled_pack(torch.randn(40, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="K even"):
        k.tiled_pack(torch.randn(32, 63).to(torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 130])
@pytest.mark.parametrize("intermediate", [16, 48, 80])
def test_tiled_silu_product_is_the_product_then_silu_and_mul_bit_for_bit(bias: bool, rows: int,
                                                                         intermediate: int) -> None:
    """The gated MLP's first product with the activation on the accumulators rounds as the
    product followed by silu_and_mul does: the same bits, for the stream and the block rows."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(rows + intermediate + bias)
    w = torch.randn(2 * intermediate, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(2 * intermediate, generator=gen) if bias else torch.empty(0)
    x = (torch.randn(1, rows, 576, generator=gen) * 3).to(torch.bfloat16)  # gate values on both sides of 0
    tiles = k.tiled_pack(w)
    got = k.tiled_silu_linear(x, tiles, b)
    want = k.silu_and_mul(k.tiled_linear(x, tiles, b))
    assert got.shape == (1, rows, intermediate) and torch.equal(got, want)
    gate, up = F.linear(x.float(), w.float(), b if bias else None).split(intermediate, dim=-1)
    exact = F.silu(gate) * up
    assert torch.allclose(got.float(), exact, rtol=2.0**-6, atol=1e-2 * float(exact.abs().max()))


def test_tiled_silu_product_refuses_what_it_cannot_compute() -> None:
    k = _tiled_kernels()
    odd = k.tiled_pack(torch.randn(48, 64).to(torch.bfloat16))  # three tiles: no gate and up halves
    with pytest.raises(RuntimeError, match="gate and an up half"):
        k.tiled_silu_linear(torch.randn(2, 64).to(torch.bfloat16), odd, torch.empty(0))
    tiles = k.tiled_pack(torch.randn(64, 64).to(torch.bfloat16))
    assert k.tiled_silu_linear(torch.empty(0, 64, dtype=torch.bfloat16), tiles, torch.empty(0)).shape == (0, 32)
    with pytest.raises(RuntimeError, match="input width"):
        k.tiled_silu_linear(torch.randn(2, 48).to(torch.bfloat16), tiles, torch.empty(0))


def test_fused_mlp_applies_the_activation_in_the_tiled_product() -> None:
    """A model's MLPs on the tiled kernel take the gated product, with the same outputs as
    the gate/up product followed by silu_and_mul."""
    _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from transformers import AutoModelForCausalLM

    from services.worker.model.fused_ops import FusedSiluMLP, fuse_elementwise

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model("llama"), dtype=torch.bfloat16).eval()
    body = model.get_decoder()
    fuse_projections(body, torch.bfloat16, CPU)
    pack_linears(body, torch.bfloat16, CPU)
    assert fuse_elementwise(body, torch.bfloat16, CPU)["silu_mlp"] == len(body.layers)
    mlp = body.layers[0].mlp
    assert isinstance(mlp, FusedSiluMLP) and mlp._gated is not None
    h = (torch.randn(1, 37, mlp.gate_up.in_features, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        gated = mlp(h)
        mlp._gated = None
        plain = mlp(h)
    assert torch.equal(gated, plain)


def _two_layers(gen: torch.Generator) -> nn.Module:
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40)).to(torch.bfloat16)  # 40: no tiles
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_tiled_kernel_takes_every_product_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (no AMX) a layer with N a multiple of 16 sends every product to the tiled
    kernel, non-contiguous and empty inputs included, and oneDNN's copy is dropped; a layer
    the kernel cannot take keeps oneDNN (bit for bit F.linear)."""
    k = _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from services.kernels import ops

    monkeypatch.setattr(ops, "cpu_flag", lambda name: False)
    gen = torch.Generator().manual_seed(4)
    model = _two_layers(gen)
    plain = copy.deepcopy(model)
    assert pack_linears(model, torch.bfloat16, CPU) == 2
    first, second = model[0], model[1]
    assert first.tiles is not None and first.tiles.shape == (3, 32, 16) and first.packed is None
    assert second.tiles is None and second.packed is not None
    calls = []
    real = k.tiled_linear
    monkeypatch.setattr(first, "_tiled", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    x = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = first(x)
        wide = first(torch.randn(64, 300, generator=gen).to(torch.bfloat16).t())  # a view: made contiguous
        empty = first(torch.empty(0, 64, dtype=torch.bfloat16))
        tail = second(out)
    assert calls == [(300, 64), (300, 64), (0, 64)] and wide.shape == (300, 48) and empty.shape == (0, 48)
    want = F.linear(x.float(), plain[0].weight.float(), plain[0].bias.float())
    assert torch.all((out.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-6)
    assert torch.equal(tail, F.linear(out, plain[1].weight, plain[1].bias))
    with pytest.raises(RuntimeError, match="still needed"):
        second.drop_packed()


@pytest.mark.parametrize("setting", ["small", "amx"])
def test_tiled_kernel_takes_six_rows_at_most_beside_onednn(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """With FERRY_CPU_TILED_LINEAR=small, or with AMX for a shape the AMX products do not take
    (48 outputs here, not a multiple of 32), up to 6 rows go to the tiled kernel and more (7
    here) to oneDNN, which keeps its copy; with 0, nothing goes to it."""
    k = _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from services.kernels import ops

    if setting == "small":
        monkeypatch.setenv("FERRY_CPU_TILED_LINEAR", "small")
    monkeypatch.setattr(ops, "cpu_flag", lambda name: setting == "amx" and name == "amx_bf16")
    gen = torch.Generator().manual_seed(5)
    model = _two_layers(gen)
    plain = copy.deepcopy(model)
    assert pack_linears(model, torch.bfloat16, CPU) == 2
    first = model[0]
    assert first.tiles is not None and first.packed is not None and first.tiled_rows == 6
    calls = []
    real = k.tiled_linear
    monkeypatch.setattr(first, "_tiled", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        small = first(torch.randn(1, 6, 64, generator=gen).to(torch.bfloat16))
        big = first(x)
    assert calls == [(1, 6, 64)] and small.shape == (1, 6, 48)
    assert torch.equal(big, F.linear(x, plain[0].weight, plain[0].bias))
    monkeypatch.setenv("FERRY_CPU_TILED_LINEAR", "0")
    off = copy.deepcopy(plain)
    assert pack_linears(off, torch.bfloat16, CPU) == 2 and off[0].tiles is None and off[0].packed is not None
    monkeypatch.setenv("FERRY_CPU_TILED_LINEAR", "everything")
    with pytest.raises(ValueError, match="FERRY_CPU_TILED_LINEAR"):
        pack_linears(copy.deepcopy(plain), torch.bfloat16, CPU)


@pytest.mark.parametrize("amx_linear", ["1", "0"])
def test_amx_products_take_every_row_from_one(monkeypatch: pytest.MonkeyPatch, amx_linear: str) -> None:
    """With AMX (the default split), a shape the AMX tile products take goes to them from one
    row and the tiled kernel takes none; with them off
    (FERRY_CPU_AMX_LINEAR=0) the tiled kernel keeps its 6 rows beside oneDNN."""
    k = _tiled_kernels()
    if k is None or not k.tiled_amx(-1):
        pytest.skip("no AMX tile products here")
    monkeypatch.setenv("FERRY_CPU_AMX_LINEAR", amx_linear)
    gen = torch.Generator().manual_seed(6)
    model = nn.Sequential(nn.Linear(64, 96)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    plain = copy.deepcopy(model)
    try:
        assert pack_linears(model, torch.bfloat16, CPU) == 1
        layer = model[0]
        assert layer.tiles is not None
        calls: list[str] = []
        for name in ("_tiled", "_amx"):
            real = getattr(layer, name)
            if real is not None:
                monkeypatch.setattr(layer, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
        x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            got = layer(x)
        want = F.linear(x.float(), plain[0].weight.float(), plain[0].bias.float())
        assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-2 * want.abs().max().item())
        if amx_linear == "1":
            # (oneDNN keeps rows past a decode step's: only the model's projections send it prompt rows)
            assert layer.tiled_rows == 0 and layer.amx_rows == k.amx_linear_rows() and calls == ["_amx"]
            assert layer.split() == f"packed, tiled up to 0 rows, AMX up to {k.amx_linear_rows()}"
        else:
            assert layer.tiled_rows == 6 and layer.packed is not None and calls == ["_tiled"]
            assert layer.split() == "packed, tiled up to 6 rows"
    finally:
        k.tiled_amx(1)  # FERRY_CPU_AMX_LINEAR=0 turned them off in the process


def test_fused_groups_and_the_model_on_the_tiled_kernel() -> None:
    _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model("llama"), dtype=torch.bfloat16).eval()
    fast = copy.deepcopy(model)
    body = fast.get_decoder()
    fuse_projections(body, torch.bfloat16, CPU)
    pack_linears(body, torch.bfloat16, CPU)
    head = body.layers[0].self_attn.q_proj
    assert isinstance(head, FusedHead) and head.fused.tiles is not None
    for n in (5, 23):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            want, got = model(ids).logits.float(), fast(ids).logits.float()
        assert torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))  # not bit for bit: another order


def test_tiled_embedding_reads_rows_back_bit_for_bit() -> None:
    """``tiled_embedding`` gives each id's row of the weight that ``tiled_pack`` laid out, any
    id shape, first and last rows of a tile included; an id outside the rows is refused."""
    k = _tiled_kernels()
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(80, 40, generator=gen).to(torch.bfloat16)
    tiles = k.tiled_pack(w)
    ids = torch.tensor([[0, 15, 16], [79, 64, 33]])
    got = k.tiled_embedding(tiles, ids)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, w[ids])
    every = torch.randperm(80, generator=gen)
    assert torch.equal(k.tiled_embedding(tiles, every), w[every])
    assert k.tiled_embedding(tiles, torch.empty(0, dtype=torch.long)).shape == (0, 40)
    for bad in (80, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            k.tiled_embedding(tiles, torch.tensor([3, bad]))


def test_tied_embedding_shares_the_head_tiles_and_the_model_gives_the_same_logits() -> None:
    """A tied embedding is swapped for one that reads the packed head's tiles (the same storage,
    no copy; the plain weight's bytes reported) and the model's logits do not change by a bit;
    an untied pair, or a head without tiles, is left alone."""
    from services.worker.model.packed_linear import TiledEmbedding, share_tied_embedding

    _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model("llama"), dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    fast = copy.deepcopy(model)
    fast.tie_weights()
    assert fast.get_output_embeddings().weight is fast.get_input_embeddings().weight  # the tiny llama is tied
    with torch.no_grad():
        fast.get_input_embeddings().weight.copy_(torch.randn(fast.get_input_embeddings().weight.shape, generator=gen))
    plain = copy.deepcopy(fast)
    assert pack_linears(fast, torch.bfloat16, CPU) >= 1
    head, body = fast.get_output_embeddings(), fast.get_decoder()
    if head.tiles is None:
        pytest.skip("the head's outputs are not whole tiles")
    weight_bytes = body.get_input_embeddings().weight.nbytes
    assert share_tied_embedding(body, head) == weight_bytes
    shared = body.get_input_embeddings()
    assert isinstance(shared, TiledEmbedding) and shared.tiles.data_ptr() == head.tiles.data_ptr()
    with torch.inference_mode():
        assert torch.equal(shared(ids), plain.get_input_embeddings()(ids))
        assert torch.equal(shared(ids.int()), plain.get_input_embeddings()(ids))  # int32 ids, as nn.Embedding takes
        before = copy.deepcopy(plain)
        assert pack_linears(before, torch.bfloat16, CPU) >= 1
        assert torch.equal(fast(ids).logits, before(ids).logits)
    assert share_tied_embedding(body, head) == 0  # already swapped: not an nn.Embedding any more
    untied = copy.deepcopy(plain)
    pack_linears(untied, torch.bfloat16, CPU)
    with torch.no_grad():
        untied.get_decoder().get_input_embeddings().weight.add_(1.0)  # no longer the head's matrix
    assert share_tied_embedding(untied.get_decoder(), untied.get_output_embeddings()) == 0
    assert type(untied.get_decoder().get_input_embeddings()) is nn.Embedding


def test_amx_head_drops_onednn_copy_for_a_bound_on_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX a layer keeps oneDNN's copy for rows past the AMX products' bound; a caller that
    never passes more (the LM head, at most max_num_seqs rows) may drop it: its products stay
    the AMX ones, and a call past the bound is refused with a clear error instead of a crash."""
    _amx_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    gen = torch.Generator().manual_seed(13)
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)  # N and K multiples of 32: AMX
    assert pack_linears(model, torch.bfloat16, CPU) == 1
    first = model[0]
    bound = first.amx_rows
    assert first.packed is not None and bound >= 64 and first.covers(bound) and not first.covers(bound + 1)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = first(x)
        with pytest.raises(RuntimeError, match="still needed"):
            first.drop_packed(bound + 1)
        first.drop_packed(bound)
        assert first.packed is None
        assert torch.equal(first(x), want)
        with pytest.raises(RuntimeError, match="past the"):
            first(torch.randn(bound + 1, 64, generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("max_num_seqs", [8, 1000])
def test_runner_holds_a_tied_head_once_in_bfloat16(max_num_seqs: int) -> None:
    """A bfloat16 worker whose head is tied (the tiny llama, as SmolLM2): the embedding reads the
    head's tiles, and with AMX oneDNN's copy of the head is dropped where the AMX products take
    max_num_seqs rows (8) and kept where they do not (1,000; without AMX the tiled kernel takes
    every row and the copy is gone either way); the first greedy token is the one transformers
    gives in bfloat16 for a prompt of a few tokens."""
    from services.worker.model.packed_linear import TiledEmbedding
    from services.worker.runner import ModelRunner
    from shared.config import WorkerConfig
    from shared.messages import NewRequestData, SamplingParams, StepPlan

    k = _tiled_kernels()
    if not _bf16_packing_exact_here():
        pytest.skip("bfloat16 on AVX2: nothing is packed")
    folder = cached_tiny_model("llama")
    runner = ModelRunner(WorkerConfig(model=str(folder), dtype="bfloat16", kv_cache_memory=1 << 20, block_size=4,
                                      num_threads=1, max_num_seqs=max_num_seqs))
    head, embedding = runner.lm_head, runner.body.get_input_embeddings()
    assert isinstance(head, PackedLinear) and head.tiles is not None
    assert isinstance(embedding, TiledEmbedding) and embedding.tiles.data_ptr() == head.tiles.data_ptr()
    # without AMX (the Zen 4) the tiled kernel takes every product and oneDNN's copy was never made
    # to stay; with AMX it goes where the AMX products take max_num_seqs rows
    assert (head.packed is None) == (head.tiled_rows >= max_num_seqs or k.tiled_amx(-1) >= max_num_seqs)
    prompt = [5, 17, 300, 4000]
    step = StepPlan(step_id=1, num_scheduled_tokens={"r": 4}, new_requests=[NewRequestData(
        req_id="r", prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0), block_ids=[0],
        num_computed_tokens=0)])
    got = runner.execute(step).sampled_token_ids
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    # another summation order than transformers': the token is the argmax, or within a
    # bfloat16 step of it
    assert logits[got[0]] >= logits.max() - 2.0**-7 * logits.abs().max()
