"""The lean CPU forward (services/worker/model/lean_forward.py) against transformers' own.

Random Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) models: in bfloat16 and float32 with
every swap of packed_linear and fused_ops made (the fused mode), and untouched in float32
and bfloat16 (the plain mode). Two steps through ferry's paged attention (two fresh
prompts, then their decodes beside a third prompt's first chunk), each through the
model's forward and through the lean one on its own copy of the cache: the hidden
states must be equal bit for bit, and so must the keys and values written. Where the
architecture differs, the lean forward must decline.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch

from services.kernels.build import cpu_flag
from services.worker.backends import select_backend
from services.worker.backends.build import build_paged_batch
from services.worker.kv_cache import KVCache
from services.worker.model import fused_ops
from services.worker.model.attention import ATTN_IMPLEMENTATION, StepAttention, register_paged_attention
from services.worker.model.lean_forward import DECODE_LAYER_PARTS, LeanDecoder
from services.worker.model.packed_linear import PackedLinear, fuse_projections, pack_linears

CPU = torch.device("cpu")
BF16 = torch.bfloat16
BLOCK = 4


def _model(kind: str, dtype: torch.dtype = BF16, **overrides: object):  # noqa: ANN202
    from transformers import AutoConfig, AutoModelForCausalLM

    register_paged_attention()
    cfg = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, vocab_size=300,
               tie_word_embeddings=True)
    if kind == "mistral":
        cfg["sliding_window"] = None  # Mistral's default window (4096) sends it to transformers' forward
    cfg.update(overrides)
    config = AutoConfig.for_model(kind, **cfg)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION).eval()
    return model, config


def _fuse(body: torch.nn.Module, dtype: torch.dtype = BF16) -> None:
    fuse_projections(body, dtype, CPU)
    pack_linears(body, dtype, CPU)
    fused_ops.fuse_elementwise(body, dtype, CPU)


def _steps() -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(query lens, context lens, block ids) per step: two prompts (7 and 5 tokens), then their
    decodes and the first 6-token chunk of a third prompt, then three decodes alone (a step the
    fused mode runs in one call, decode_layers)."""
    tables = [[0, 1, 6], [2, 3, 7], [4, 5, 8]]
    return [([7, 5], [7, 5], tables[:2]), ([1, 1, 6], [8, 6, 6], tables), ([1, 1, 1], [9, 7, 7], tables)]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("backend_name", ["reference", "cpu_paged"])
def test_fused_lean_forward_equals_the_models_forward(kind: str, dtype: torch.dtype, backend_name: str) -> None:
    if fused_ops.kernels() is None or not torch.backends.mkldnn.is_available():
        pytest.skip("no fused CPU kernels (no compiler) or no oneDNN: there is no fused mode here")
    model, config = _model(kind, dtype)
    body = model.get_decoder()
    _fuse(body, dtype)
    if not all(isinstance(layer.mlp, fused_ops.FusedSiluMLP) for layer in body.layers):
        assert dtype == BF16 and fused_ops.kernels().kernel_isa() != "avx512"  # an AVX2 build
        pytest.skip("bfloat16 here: oneDNN's joined products differ from the separate ones, nothing is joined")
    lean = LeanDecoder.build(body, fused_ops.kernels())
    assert lean is not None and lean.mode == "fused"
    _check_steps(body, lean, config, backend_name, dtype)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("backend_name", ["reference", "cpu_paged"])
def test_plain_lean_forward_equals_the_models_forward(kind: str, dtype: torch.dtype, backend_name: str) -> None:
    model, config = _model(kind, dtype)
    body = model.get_decoder()
    lean = LeanDecoder.build(body, None)
    assert lean is not None and lean.mode == "plain"
    _check_steps(body, lean, config, backend_name, dtype)


def _check_steps(body: torch.nn.Module, lean: LeanDecoder, config, backend_name: str,  # noqa: ANN001
                 dtype: torch.dtype) -> None:
    try:
        backend = select_backend(backend_name, CPU)
    except Exception as exc:  # noqa: BLE001 - cpu_paged without a compiler
        pytest.skip(f"{backend_name} unavailable: {exc}")
    caches = {name: KVCache.allocate(config.to_dict(), 9, BLOCK, dtype, "cpu") for name in ("model", "lean")}
    gen = torch.Generator().manual_seed(7)
    for query_lens, seq_lens, tables in _steps():
        batch, positions = build_paged_batch(query_lens, seq_lens, tables, BLOCK, 256, CPU)
        ids = torch.randint(0, 300, (1, sum(query_lens)), generator=gen)
        pos = torch.from_numpy(positions).unsqueeze(0)
        meta = backend.prepare(batch)
        with torch.inference_mode():
            want = body(input_ids=ids, position_ids=pos, use_cache=False,
                        ferry_meta=StepAttention(backend, meta, caches["model"].caches, 256, batch)).last_hidden_state
            got = lean(ids, pos, StepAttention(backend, meta, caches["lean"].caches, 256, batch))
        assert got.shape == want.shape == (1, sum(query_lens), config.hidden_size)
        assert got.dtype == dtype
        assert torch.equal(got, want)
    for (k1, v1), (k2, v2) in zip(caches["model"].caches, caches["lean"].caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert k1.abs().sum() > 0  # the steps did write keys


class _Counting:
    """The kernels' module with its decode_layers calls counted and their wall time summed."""

    def __init__(self, kernels: object) -> None:
        self._kernels, self.calls, self.wall_s = kernels, 0, 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self._kernels, name)

    def decode_layers(self, *args: object) -> torch.Tensor:
        self.calls += 1
        t0 = time.perf_counter()
        try:
            return self._kernels.decode_layers(*args)
        finally:
            self.wall_s += time.perf_counter() - t0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_dtype", [BF16, torch.float8_e4m3fn])
@pytest.mark.parametrize("split", [False, "onednn", "amx"])
def test_decode_steps_in_one_call_equal_the_layer_loop(monkeypatch: pytest.MonkeyPatch, kind: str,
                                                        kv_dtype: torch.dtype, split: bool | str) -> None:
    """bfloat16 on the tiled kernels: a step of decodes only runs every layer in one C++ call,
    with the same hidden states and the same keys and values written as the Python loop, for a
    bfloat16 and a float8 cache, grouped-query heads, q/k/v biases (Qwen2), contexts across
    block boundaries and 1-5 requests; steps with a prompt chunk keep the loop. ``split``: the
    tiled kernels take up to 2 rows and oneDNN's packed copies the rest (as with AMX), so the
    3-5-request steps take oneDNN's products inside the call, as the loop's layers would (the
    tiles zeroed, so a product taken from the wrong copy shows; AMX products off). ``amx`` (a
    CPU with AMX): those steps take AMX tile products over the tiles, in the call as in the
    loop's layers, with the same bits. Its
    part clocks (on here, for the profilers) change nothing and fill every part, within the
    call's time."""
    ops = fused_ops.kernels()
    if ops is None or not ops.tiled_linear_available() or not torch.backends.mkldnn.is_available():
        pytest.skip("no tiled bfloat16 kernel on this CPU: no decode_layers path")
    model, config = _model(kind, BF16, num_hidden_layers=3)
    body = model.get_decoder()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: give them values that show
        for p in body.parameters():
            if p.dim() == 1 and p.abs().sum() == 0:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    if split == "amx" and not ops.tiled_amx(-1):
        pytest.skip("no AMX tile products here")
    monkeypatch.setenv("FERRY_CPU_TILED_LINEAR", "small" if split else "auto")
    monkeypatch.setenv("FERRY_CPU_AMX_LINEAR", "0" if split == "onednn" else "1")
    _fuse(body, BF16)
    for m in body.modules():
        if split and isinstance(m, PackedLinear) and m.tiles is not None:
            m.tiled_rows = 2
            if split == "onednn":  # the tiles zeroed: a product of 3-5 rows taken there instead of oneDNN's cannot pass
                assert m.amx_rows == 0
                m.tiles.zero_()
            else:
                assert m.amx_rows >= 5
    one_call = LeanDecoder.build(body, _Counting(ops))
    loop = LeanDecoder.build(body, ops)
    assert one_call is not None and loop is not None and one_call.decode_args is not None
    # auto: the tiled kernel takes every row without AMX, none with it (the AMX products from one row)
    want_rows = 2 if split else 0 if cpu_flag("amx_bf16") and ops.tiled_amx(-1) else 1 << 62
    assert one_call.decode_args.rows == want_rows
    if split != "onednn" and ops.tiled_amx(-1):
        # the AMX products take every projection's prompt rows too (FERRY_CPU_AMX_PROMPT's
        # default), which dropped oneDNN's copies: the call takes every step up to their bound
        assert one_call.decode_args.packed == [] and one_call.decode_args.amx_rows == ops.amx_linear_rows() > 5
    else:
        assert len(one_call.decode_args.packed) == (8 * 3 if split else 0) and one_call.decode_args.amx_rows == 0
    # with AMX products from one row, every decode step's q/k/v takes RoPE in its epilogue
    rope_in_products = not split and one_call.decode_args.rows == 0 and bool(ops.amx_rope(-1))
    try:
        _steps_in_one_call_equal_the_loop(one_call, loop, config, kv_dtype, rope_in_products)
    finally:
        ops.tiled_amx(1)  # FERRY_CPU_AMX_LINEAR=0 turned them off in the process


def _steps_in_one_call_equal_the_loop(one_call: LeanDecoder, loop: LeanDecoder, config: Any,
                                      kv_dtype: torch.dtype, rope_in_products: bool = False) -> None:
    assert one_call.decode_args is not None
    loop.decode_args = None
    one_call.part_times = torch.zeros(2, len(DECODE_LAYER_PARTS), dtype=torch.float64)
    backend = select_backend("cpu_paged", CPU)
    caches = {name: KVCache.allocate(config.to_dict(), 40, BLOCK, kv_dtype, "cpu") for name in ("loop", "one")}
    gen = torch.Generator().manual_seed(3)
    tables = [list(range(8 * r, 8 * r + 8)) for r in range(5)]
    prompts = [9, 4, 13, 2, 7]
    steps = [(prompts, prompts)]  # every prompt at once (the loop), then decodes, one request finishing each step
    for i in range(1, 5):
        live = prompts[: 6 - i]
        steps.append(([1] * len(live), [p + i for p in live]))
    steps.append(([1, 1, 3], [prompts[0] + 5, prompts[1] + 5, 3]))  # a decode beside a prompt: the loop
    for query_lens, seq_lens in steps:
        batch, positions = build_paged_batch(query_lens, seq_lens, tables[: len(query_lens)], BLOCK, 256, CPU)
        ids = torch.randint(0, 300, (1, sum(query_lens)), generator=gen)
        pos = torch.from_numpy(positions).unsqueeze(0)
        meta = backend.prepare(batch)
        before = one_call.kernels.calls
        with torch.inference_mode():
            want = loop(ids, pos, StepAttention(backend, meta, caches["loop"].caches, 256, batch))
            got = one_call(ids, pos, StepAttention(backend, meta, caches["one"].caches, 256, batch))
        decodes_only = all(q == 1 for q in query_lens)
        assert one_call.kernels.calls == before + decodes_only
        assert got.shape == want.shape and got.dtype == BF16
        assert torch.equal(got, want)
    assert one_call.kernels.calls == 4
    wall, cpu = one_call.part_times.tolist()
    timed = [t for part, *t in zip(DECODE_LAYER_PARTS, wall, cpu, strict=True) if not (rope_in_products and part == "rope")]
    assert all(w > 0 and c > 0 for w, c in timed)  # norms, products, rotary, attention: each timed
    if rope_in_products:
        assert wall[DECODE_LAYER_PARTS.index("rope")] == 0  # no rotary pass of its own
    assert sum(wall) <= one_call.kernels.wall_s
    for (k1, v1), (k2, v2) in zip(caches["loop"].caches, caches["one"].caches, strict=True):
        assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))
        assert k1.float().abs().sum() > 0


def test_decode_layers_switch_and_what_it_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRY_CPU_DECODE_LAYERS=0 keeps the loop; so does float32 (no tiled kernel there) and a
    layer left on oneDNN."""
    ops = fused_ops.kernels()
    if ops is None or not ops.tiled_linear_available() or not torch.backends.mkldnn.is_available():
        pytest.skip("no tiled bfloat16 kernel on this CPU: no decode_layers path")
    model, _ = _model("llama", BF16)
    body = model.get_decoder()
    _fuse(body, BF16)
    built = LeanDecoder.build(body, ops)
    assert built is not None and built.decode_args is not None and len(built.decode_args.weights) == 10 * 2
    monkeypatch.setenv("FERRY_CPU_DECODE_LAYERS", "0")
    built = LeanDecoder.build(body, ops)
    assert built is not None and built.mode == "fused" and built.decode_args is None
    monkeypatch.delenv("FERRY_CPU_DECODE_LAYERS")
    body.layers[1].self_attn.o_proj.remove_tiled()
    built = LeanDecoder.build(body, ops)
    assert built is not None and built.mode == "fused" and built.decode_args is None
    f32, _ = _model("llama", torch.float32)
    f32_body = f32.get_decoder()
    _fuse(f32_body, torch.float32)
    built = LeanDecoder.build(f32_body, ops)
    assert built is not None and built.mode == "fused" and built.decode_args is None


def test_lean_forward_modes_and_what_it_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _model("llama", torch.float32)  # (float32: joined and packed on every CPU with oneDNN)
    body = model.get_decoder()
    plain = LeanDecoder.build(body, None)
    assert plain is not None and plain.mode == "plain"
    ops = fused_ops.kernels()
    if ops is not None and torch.backends.mkldnn.is_available():
        built = LeanDecoder.build(body, ops)  # kernels, but nothing fused yet: plain
        assert built is not None and built.mode == "plain"
        fused = copy.deepcopy(body)
        _fuse(fused, torch.float32)
        built = LeanDecoder.build(fused, ops)
        assert built is not None and built.mode == "fused"
        partial = copy.deepcopy(body)
        fuse_projections(partial, torch.float32, CPU)  # q/k/v fused, norms and MLP as they were: plain, through the shims
        built = LeanDecoder.build(partial, ops)
        assert built is not None and built.mode == "plain"
    monkeypatch.setenv("FERRY_CPU_LEAN_FORWARD", "0")
    assert LeanDecoder.build(body, None) is None
    monkeypatch.delenv("FERRY_CPU_LEAN_FORWARD")
    olmo2, _ = _model("olmo2")  # norms after attention and MLP: not the plain pre-norm layer
    assert LeanDecoder.build(olmo2.get_decoder(), None) is None
    windowed, _ = _model("mistral", sliding_window=16)
    assert LeanDecoder.build(windowed.get_decoder(), None) is None


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_rope_rows_from_the_table_are_rotary_embs_bits(dtype: torch.dtype) -> None:
    """cos/sin read from LeanDecoder's table (static RoPE types) are rotary_emb's own for any
    positions, batch and order; the table grows past its first bound; a dynamic RoPE type
    (its frequencies change with the context) is computed per call, with no table."""
    model, _ = _model("llama", dtype, max_position_embeddings=16384)
    lean = LeanDecoder.build(model.get_decoder(), None)
    assert lean is not None and lean.rope_static
    gen = torch.Generator().manual_seed(5)
    for n, top in ((1, 10), (3, 100), (64, 4000), (2048, 4096), (17, 9000)):
        pos = torch.randint(0, top, (1, n), generator=gen)
        x = torch.zeros(1, n, 128, dtype=dtype)
        want, got = lean.rotary_emb(x, position_ids=pos), lean.cos_sin(x, pos)
        assert all(torch.equal(w, g) and g.shape == (1, n, 32) for w, g in zip(want, got, strict=True))
    assert lean.rope_table is not None and lean.rope_table[0].shape == (16384, 32)  # 9,000 doubled past 4,096
    dynamic, _ = _model("llama", dtype, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    lean = LeanDecoder.build(dynamic.get_decoder(), None)
    assert lean is not None and not lean.rope_static
    pos = torch.arange(300)[None]
    x = torch.zeros(1, 300, 128, dtype=dtype)
    assert all(torch.equal(w, g) for w, g in zip(lean.rotary_emb(x, position_ids=pos), lean.cos_sin(x, pos), strict=True))
    assert lean.rope_table is None
