"""Linear layers with their weights pre-packed for oneDNN, on the CPU.

``F.linear`` on the CPU hands every call's weight to the BLAS in its plain row-major
layout, which the library re-blocks internally each time. oneDNN can take the weight
once, reordered into the blocked layout its kernels read (``mkldnn._reorder_linear_weight``),
and multiply against that on every call (``mkldnn._linear_pointwise``): the same
products, in the same order for bfloat16 (bit-identical outputs, checked at start-up and
in tests/unit/worker/test_packed_linear.py), and 1.05-1.1x faster at prefill sizes, 1.2-1.4x at
a decode batch of 64 and 1.3-2.9x for a single decode on this model's shapes
(docs/benchmarks.md, "Kernels: linear products"). PyTorch's inductor does the same when it
freezes a model for the CPU.

Projections that read the same input are also fused into one product
(``fuse_projections``): q/k/v of every attention and gate/up of every MLP, as vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` do. transformers' model code
still calls ``q_proj``, ``k_proj`` and ``v_proj`` one after the other; here ``q_proj``
computes all three outputs in one oneDNN call and hands ``k_proj`` and ``v_proj`` theirs
(``FusedHead`` / ``FusedPart``). One product of width 960 instead of 576 + 192 + 192
and one of 3,072 instead of 2 x 1,536 ran 1.2-1.3x faster at every batch size measured.

bfloat16 products go to a kernel of ferry's own where the CPU has AVX512-BF16 and no AMX
(``csrc/tiled_linear.cpp``, ``_add_tiled``): the weight laid out once in the operand order of
``vdpbf16ps``, one sequential stream per thread at one or two rows (a decode step at low
concurrency, where a product is a read of its weight: oneDNN read it at 13.5-20 GB/s, this
kernel at ~32), blocks of 8 rows x 48 outputs past that. On the Zen 4 EPYC it ran the model's
products 1.5-1.8x as fast as oneDNN's packed kernels at 1-8 rows, 1.13x at 64 and level from
256 to 2,048 rows (docs/benchmarks.md, "Kernels: linear products"), so there
it takes every product and oneDNN's copy of the weight is dropped. On a CPU with AMX the AMX
tile products over the same tiles (``amx_linear``, csrc/tiled_linear.cpp) take a decode step's
rows from one up to ``amx_linear_rows()`` and, for the projections ``amx_prompt`` names (all
four by default), a prompt step's: on the 2-vCPU AMX Xeon they ran the model's 30 layers
1.3-1.6x as fast as the tiled kernel at 1-6 rows, which it kept until then (docs/benchmarks.md,
"Kernels: linear products"). The tiled kernel keeps 1-6 rows (``SMALL_BATCH_ROWS``) there only
for shapes the AMX products do not take (N or K not a multiple of 32) or with
``FERRY_CPU_AMX_LINEAR=0``. Both sum in another order than oneDNN, so their outputs are within
one bfloat16 step of oneDNN's, not bit for bit; each sums a row the same way at any row count,
so a row's result does not depend on how many rows are computed with it (with every product on
one of them, a request's outputs do not depend on its batch). ``FERRY_CPU_TILED_LINEAR=0``
keeps every product on oneDNN, ``small`` sends up to ``SMALL_BATCH_ROWS`` rows to the tiled
kernel on any CPU (with AMX: the AMX products past them, the split before).

float32 too: there oneDNN's kernels sum in another order than MKL's (differences ~1e-5
relative on these shapes), so logits are no longer bit-identical to transformers', but
greedy outputs stayed token-identical (SmolLM2-135M: 50 of 50 chat prompts x 64 tokens;
the token-exact tests pass) and the common load ran 1.2x faster, on AVX2 too
(docs/benchmarks.md, "dtype on the CPU"). ``FERRY_CPU_FLOAT32_EXACT=1``
keeps float32 on ``F.linear`` (and on transformers' own element-wise ops and SDPA for
prompts: ``float32_exact``); ``FERRY_CPU_PACKED_LINEAR=0`` turns packing off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels import ops
from shared import envs

log = logging.getLogger("ferry.worker.packed_linear")

BATCH_HINT = 64  # the M oneDNN picks its layout for; measured best or near-best from M=1 to 2048
SMALL_BATCH_ROWS = 6  # the tiled kernel's rows beside AMX or oneDNN products ("small"; AMX shapes it cannot take)
# With AMX: the tiled kernel's rows, the AMX tile products past them (0: they take every
# decode step from one row; measured, docs/benchmarks.md "Kernels: linear products")
AMX_TILED_ROWS = 0
ALL_ROWS = 1 << 62  # the tiled kernel takes every product


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight (the plain weight is dropped)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed: torch.Tensor | None
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

        self.tiles: torch.Tensor | None
        self.register_buffer("tiles", None, persistent=False)  # the tiled kernel's copy (add_tiled), when on
        self._tiled: Callable[..., torch.Tensor] | None = None
        self.tiled_rows = 0  # inputs of up to this many rows go to the tiled kernel
        self._amx: Callable[..., torch.Tensor] | None = None
        self.amx_rows = 0  # past tiled_rows, up to this many rows: AMX tile products over the tiles
        self._amx_rope: Callable[..., torch.Tensor] | None = None  # the same with RoPE as the epilogue
        self.amx_rope_rows = 0  # up to this many rows (a decode step's): rope_forward takes them
        self._bias32 = torch.empty(0)
        self.fixed_rows = 0  # --deterministic: oneDNN's products in calls of exactly this many rows (0: any)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tiled is not None:
            if x.numel() <= self.tiled_rows * self.in_features:
                return self._tiled(x if x.is_contiguous() else x.contiguous(), self.tiles, self._bias32)
            if self._amx is not None and x.numel() <= self.amx_rows * self.in_features:
                return self._amx(x if x.is_contiguous() else x.contiguous(), self.tiles, self._bias32)
        if self.packed is None:  # dropped for a bound on the rows (drop_packed) that this call passed
            raise RuntimeError(f"{x.numel() // self.in_features} rows: past the {max(self.tiled_rows, self.amx_rows)} "
                               "this layer kept kernels for when oneDNN's copy was dropped")
        if self.fixed_rows:
            packed, bias = self.packed, self.bias
            return in_fixed_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], ""),
                                 x, self.fixed_rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def make_batch_invariant(self, fixed_rows: int) -> str:
        """One kernel family for every row count, each summing a row alike at any count: the AMX
        products where the layer has them, else the tiled kernel, else oneDNN's in calls of
        exactly ``fixed_rows`` rows (its kernels block K by the call's shape, so a row's sums
        change with the rows beside it: tests/unit/worker/test_batch_invariant.py). Returns
        which."""
        if self._amx is not None:
            self.tiled_rows, self.amx_rows = 0, ALL_ROWS
            return "AMX"
        if self._tiled is not None:
            self.tiled_rows = ALL_ROWS
            return "tiled"
        if self.packed is None:
            raise RuntimeError("no kernel left for a batch-invariant product: oneDNN's copy was dropped")
        self.fixed_rows = fixed_rows
        return f"oneDNN in {fixed_rows}-row calls"

    def rope_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_cols: int,
                     head_dim: int) -> torch.Tensor | None:
        """``forward(x)`` with the rotary embedding applied to its first ``rope_cols`` outputs (a
        fused q/k/v projection's query and key heads, ``head_dim`` wide; cos/sin [rows, head_dim])
        in the AMX product's epilogue: the same bits as ``forward`` then ``rotary``, one pass
        fewer over the query and key. None where another kernel takes x's rows, or past a
        decode step's (amx_rope_rows): there the products' loop keeps the AMX unit busier and
        the epilogue's extra arithmetic is no longer hidden (30 layers of SmolLM2's q/k/v: 0.78-
        0.83x the time of product then rotary at 64-128 rows, 1.12x at 512, 1.01x at 2,048)."""
        rows = x.numel() // self.in_features if self.in_features else 0
        if self._amx_rope is None or rows <= self.tiled_rows or rows > min(self.amx_rows, self.amx_rope_rows):
            return None
        return self._amx_rope(x if x.is_contiguous() else x.contiguous(), self.tiles, self._bias32, cos, sin,
                              rope_cols, head_dim)

    def add_tiled(self, weight: torch.Tensor, kernels: ops.CpuKernels, rows: int, prompt: bool = False) -> None:
        """Keep a copy of ``weight`` laid out for the tiled kernel and send inputs of up to
        ``rows`` rows to it (csrc/tiled_linear.cpp); ``prompt``: with AMX, every input past
        them to the AMX products, a prompt step's too."""
        self.tiles = kernels.tiled_pack(weight.detach())
        self._bias32 = torch.empty(0) if self.bias is None else self.bias.detach().float().contiguous()
        self._tiled = kernels.tiled_linear
        self.tiled_rows = rows
        # with AMX, the rows past the tiled kernel's up to amx_linear's bound (a decode step's)
        # take AMX tile products over the same tiles (csrc/tiled_linear.cpp), oneDNN's the rest
        amx = amx_rows(kernels) if rows < ALL_ROWS and self.out_features % 32 == 0 and self.in_features % 32 == 0 else 0
        self._amx, self.amx_rows = (kernels.amx_linear, ALL_ROWS if prompt else amx) if amx > rows else (None, 0)
        self._amx_rope = getattr(kernels, "amx_rope_linear", None) if self._amx is not None else None
        self.amx_rope_rows = amx if self._amx_rope is not None else 0

    def remove_tiled(self) -> None:
        self.tiles, self._tiled, self.tiled_rows, self._amx, self.amx_rows = None, None, 0, None, 0
        self._amx_rope, self.amx_rope_rows = None, 0

    def covers(self, rows: int) -> bool:
        """Whether the tiled kernel or the AMX products take every input of up to ``rows`` rows."""
        return self._tiled is not None and (self.tiled_rows >= rows or (self._amx is not None and self.amx_rows >= rows))

    def drop_packed(self, rows: int = ALL_ROWS) -> None:
        """Free oneDNN's copy once the tiled kernel (or past its rows the AMX products) takes
        every product of up to ``rows`` rows: all of them by default; a caller that never passes
        more (the LM head: at most ``max_num_seqs``) may name its bound."""
        if not self.covers(rows):
            raise RuntimeError(f"oneDNN's weight is still needed: the tiled kernels do not take {rows} rows")
        self.packed = None

    def split(self) -> str:
        """Which copies it holds and which kernel takes how many rows (for logs and repr)."""
        if self.tiles is None:
            return "packed"
        if self._amx is not None and self.amx_rows >= ALL_ROWS:
            return f"tiled up to {self.tiled_rows} rows, AMX past them"
        amx = f", AMX up to {self.amx_rows}" if self._amx is not None else ""
        if self.packed is not None:
            return f"packed, tiled up to {self.tiled_rows} rows{amx}"
        return f"tiled up to {self.tiled_rows} rows{amx}" if amx else "tiled"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.split()}")


class TiledEmbedding(nn.Module):
    """An embedding tied to the LM head, read from the head's tiles (``tiled_embedding``).

    A tied head packed here has its own copies (oneDNN's and the tiled kernel's) while the
    embedding kept the plain weight: the same 49,152 x 576 matrix up to three times in a
    SmolLM2 worker (57 MB each). The tiles hold every element bit for bit, so token rows are
    read back out of them (a row's words lie 64 bytes apart; measured on the AMX Xeon, 2
    threads: 0.85 ms for 2,048 ids against nn.Embedding's 0.19, 0.007 ms for 64) and the plain
    weight is dropped.
    """

    def __init__(self, embedding: nn.Embedding, tiles: torch.Tensor, kernels: ops.CpuKernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.tiles: torch.Tensor
        self.register_buffer("tiles", tiles, persistent=False)  # the head's, shared, not a copy
        self._rows = kernels.tiled_embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # nn.Embedding takes int32 ids too; the kernel reads int64
        return self._rows(self.tiles, input_ids if input_ids.dtype == torch.long else input_ids.long())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the LM head's tiles"


def share_tied_embedding(body: nn.Module, head: nn.Module) -> int:
    """Swap ``body``'s embedding for a ``TiledEmbedding`` over ``head``'s tiles where the two are
    the same matrix (checked element for element here, not assumed from the config); the bytes
    of the plain weight given up (0: nothing swapped)."""
    embedding = body.get_input_embeddings()  # type: ignore[operator]
    if (type(embedding) is not nn.Embedding or not isinstance(head, PackedLinear) or head.tiles is None
            or embedding.max_norm is not None or embedding.weight.dtype != torch.bfloat16
            or (head.out_features, head.in_features) != tuple(embedding.weight.shape)):
        return 0
    kernels = _tiled_kernels()
    if kernels is None or not hasattr(kernels, "tiled_embedding"):
        return 0
    n = embedding.num_embeddings
    every = torch.arange(n, dtype=torch.long)
    with torch.inference_mode():
        if not torch.equal(kernels.tiled_embedding(head.tiles, every), embedding.weight):
            return 0
    shared = TiledEmbedding(embedding, head.tiles, kernels)
    body.set_input_embeddings(shared)  # type: ignore[operator]
    return int(embedding.weight.nbytes)


class FusedHead(nn.Module):
    """The first projection of a fused group: one product for the whole group, its own slice returned.

    Its followers (``FusedPart``) are called next on the same input and take their slices
    of that product; a follower called on any other tensor is a change in the model's
    code that this shim cannot follow, so it fails loudly instead of returning a stale slice.
    """

    def __init__(self, fused: nn.Module, sizes: list[int]) -> None:
        super().__init__()
        self.fused = fused
        self.sizes = sizes
        self.in_features = getattr(fused, "in_features", None)
        self.out_features = sizes[0]
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._parts = torch.split(self.fused(x), self.sizes, dim=-1)
        self._input = x
        return self._parts[0]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            raise RuntimeError("a fused projection was called on another input than its group's first")
        part = self._parts[index]
        if index == len(self.sizes) - 1:  # the group is complete: drop the references
            self._input, self._parts = None, ()
        return part


class FusedPart(nn.Module):
    def __init__(self, head: FusedHead, index: int) -> None:
        super().__init__()
        self._head = [head]  # a list: not a registered submodule (the head is already one)
        self.index = index
        self.out_features = head.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._head[0].take(self.index, x)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(module: nn.Module, dtype: torch.dtype, device: torch.device,
                     make: Callable[[nn.Linear, nn.Module], nn.Module] | None = None) -> int:
    """Fuse each q/k/v and gate/up group of plain ``nn.Linear`` layers; the groups fused.

    The joined layer is ``make(joined, first_of_group)`` (``--quantization int8``: an
    ``Int8Linear``), by default a ``PackedLinear`` where packing applies. A packed group
    must compute bit for bit what ``F.linear`` computed for each layer; a group from
    ``make`` (which rounds on purpose) within 10 % of the largest output, on a probe. In
    float32 a packed group may differ from the separate products by summation order
    (1e-5 of the largest output at most).
    """
    if make is None and not packing_enabled(dtype, device):
        return 0
    fused = 0
    for parent in list(module.modules()):
        for names in FUSED_GROUPS:
            found = [getattr(parent, n, None) for n in names]
            layers = [m for m in found if type(m) is nn.Linear and m.weight.dtype == dtype]
            if len(layers) != len(names):
                continue
            if len({m.in_features for m in layers}) != 1 or len({m.bias is None for m in layers}) != 1:
                continue
            first = layers[0]
            joined = nn.Linear(first.in_features, sum(m.out_features for m in layers), bias=first.bias is not None,
                               device=first.weight.device, dtype=dtype)
            with torch.no_grad():
                joined.weight.copy_(torch.cat([m.weight for m in layers]))
                if first.bias is not None:
                    joined.bias.copy_(torch.cat([m.bias for m in layers]))
            stored = [getattr(m, "checkpoint_int8", None) for m in layers]
            if all(x is not None for x in stored):  # a W8A8 checkpoint's rows and scales, joined alike
                joined.checkpoint_int8 = (torch.cat([x[0] for x in stored]),  # type: ignore[assignment, index]
                                          torch.cat([x[1] for x in stored]))  # type: ignore[index]
            try:
                inner: nn.Module = PackedLinear(joined) if make is None else make(joined, first)
            except RuntimeError as exc:
                log.warning("linear packing unavailable (%s); projections left unfused", exc)
                return fused
            head = FusedHead(inner, [m.out_features for m in layers])
            probe = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
            outs = head(probe), *(FusedPart(head, i)(probe) for i in range(1, len(layers)))
            alone = [F.linear(probe, m.weight, m.bias) for m in layers]
            same = _near if make is not None else _order_only if dtype == torch.float32 else torch.equal
            if not all(same(o, a) for o, a in zip(outs, alone, strict=True)):
                log.warning("fused %s differ from separate products; left unfused", "/".join(names))
                continue
            setattr(parent, names[0], head)
            for i, n in enumerate(names[1:], start=1):
                setattr(parent, n, FusedPart(head, i))
            fused += 1
            if isinstance(inner, PackedLinear):
                _add_tiled(inner, joined.weight, joined.bias, "/".join(names))
    return fused


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() <= 0.1 * b.float().abs().max())


def _order_only(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 products that differ only as another summation order makes them differ."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


def float32_exact() -> bool:
    """``FERRY_CPU_FLOAT32_EXACT=1``: float32 computed by the ops transformers' forward runs
    (``F.linear``, its RMSNorm, rotary and SiLU code, SDPA for prompts), as ferry computed
    float32 before these paths; for A/B runs against transformers. Off by default: packed
    linears, fused ops and the prompt kernel sum in another order (~1e-5 relative)."""
    return envs.CPU_FLOAT32_EXACT.get()


def fast_cpu_dtype(dtype: torch.dtype) -> bool:
    """The dtypes the CPU fast paths (packing, fused ops, the prompt kernel) compute:
    bfloat16, and float32 unless ``FERRY_CPU_FLOAT32_EXACT=1``."""
    return dtype == torch.bfloat16 or (dtype == torch.float32 and not float32_exact())


def packing_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not envs.CPU_PACKED_LINEAR.get():
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return fast_cpu_dtype(dtype)


def pack_linears(module: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` for a ``PackedLinear``; the count swapped.

    A layer whose packed product is not bit-identical to ``F.linear`` on a probe input
    (bfloat16) stays as it is, so a oneDNN that disagrees costs speed, never correctness.
    """
    if not packing_enabled(dtype, device):
        return 0
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != dtype:
                continue
            try:
                packed = PackedLinear(child)
                if dtype == torch.bfloat16:
                    probe = torch.randn(3, child.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
                    if not torch.equal(packed(probe), F.linear(probe, child.weight, child.bias)):
                        log.warning("packed %s differs from F.linear; left unpacked", name)
                        continue
            except RuntimeError as exc:  # a oneDNN build without this op or dtype
                log.warning("linear packing unavailable (%s); using F.linear", exc)
                return swapped
            setattr(parent, name, packed)
            swapped += 1
            _add_tiled(packed, child.weight, child.bias, name)
    return swapped


def tiled_rows(dtype: torch.dtype) -> int | None:
    """How many rows at most a bfloat16 product sends to the tiled kernel (None: no tiles at all).

    ``FERRY_CPU_TILED_LINEAR``: ``auto`` (default) every product where the CPU has no AMX,
    ``AMX_TILED_ROWS`` (none) where it has: the AMX tile products over the same tiles take a
    decode step's rows from one (on the AMX Xeon 1.3-1.6x the tiled kernel's speed at 1-6
    rows) and a prompt step's; ``small`` up to ``SMALL_BATCH_ROWS`` on any CPU (with AMX,
    AMX products past them: the split before); ``0`` no tiles, oneDNN alone (for A/B runs).
    """
    if dtype != torch.bfloat16:
        return None
    setting = envs.CPU_TILED_LINEAR.get()  # auto, small or off
    if setting == "off":
        return None
    if setting == "small":
        return SMALL_BATCH_ROWS
    return AMX_TILED_ROWS if ops.cpu_flag("amx_bf16") else ALL_ROWS


def in_fixed_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``product(x)`` computed in calls of exactly ``rows`` rows of x's last dimension (the last
    call padded with zero rows), so every row's result is the same bits however many rows x has."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n == 0:
        out = product(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    pad = -n % rows
    if pad:
        flat = F.pad(flat, (0, 0, 0, pad))
    outs = [product(flat[i : i + rows]) for i in range(0, n + pad, rows)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def amx_rows(kernels: ops.CpuKernels) -> int:
    """The most rows ``amx_linear`` takes here (0: no AMX, or ``FERRY_CPU_AMX_LINEAR=0``, which
    turns it off in the decode call too, for A/B runs)."""
    if not hasattr(kernels, "tiled_amx"):
        return 0
    off = not envs.CPU_AMX_LINEAR.get()
    return int(kernels.tiled_amx(0 if off else 1))


PROJECTION_KINDS = {"q_proj/k_proj/v_proj": "qkv", "o_proj": "o", "gate_proj/up_proj": "gate_up", "down_proj": "down"}
# The projections whose prompt rows the AMX products take by default, and whose oneDNN copy
# is therefore dropped: all four (-203 MiB on SmolLM2-135M, no oneDNN copy of a body weight
# left). Since each pair's epilogue runs under the next pair's products and the rows stream past
# the tiles a thread keeps in L1 (tiled_linear.cpp), the offline common load's prompt steps ran
# level with q/k/v and o_proj on oneDNN or on the AMX products, and single 140-264-token prompts
# level or faster on the AMX products (docs/benchmarks.md, "Kernels: linear
# products (AMX, tiled, oneDNN)"); before that q/k/v (0.77-0.93x oneDNN) and o_proj kept oneDNN's copies.
AMX_PROMPT_DEFAULT = frozenset(PROJECTION_KINDS.values())


def amx_prompt(name: str) -> bool:
    """Whether the projection ``name`` (a fused group's names joined by "/") sends a prompt
    step's rows, past the decode bound, to the AMX products too, where the CPU has AMX.

    ``FERRY_CPU_AMX_PROMPT``: ``auto`` (default) or ``all``: every projection; ``0`` (none:
    oneDNN takes every prompt row and keeps its copies), or a comma list of qkv, o, gate_up, down."""
    kinds = envs.CPU_AMX_PROMPT.get()  # None: auto
    return PROJECTION_KINDS.get(name.rsplit(".", 1)[-1]) in (AMX_PROMPT_DEFAULT if kinds is None else kinds)


def _tiled_kernels() -> ops.CpuKernels | None:
    try:
        ext = ops.load()
    except Exception:  # noqa: BLE001 - no compiler, a failed build: oneDNN alone
        return None
    return ext if ext.tiled_linear_available() else None


def _add_tiled(packed: PackedLinear, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> bool:
    """Give a bfloat16 ``PackedLinear`` the tiled kernel, where the CPU has AVX512-BF16
    (see the module doc), and drop oneDNN's copy where the tiled kernel takes every product.

    It sums in another order than oneDNN, so it is held to the float32 product within a
    bfloat16 step on probes of one row (the stream path) and eleven (two row blocks); where
    the AMX products take them, those probe the AMX products instead.
    """
    rows = tiled_rows(weight.dtype)
    if rows is None or packed.out_features % 16 or packed.in_features % 2 or packed.in_features == 0:
        return False
    kernels = _tiled_kernels()
    if kernels is None:
        return False
    if rows < SMALL_BATCH_ROWS and (packed.out_features % 32 or packed.in_features % 32 or not amx_rows(kernels)):
        rows = SMALL_BATCH_ROWS  # no AMX products for this shape (or they are off): the tiled kernel's small rows
    packed.add_tiled(weight, kernels, rows, prompt=amx_prompt(name))
    # one row and eleven (the tiled kernel's stream and its row blocks); with the AMX products
    # on every row, 130 too (their prompt path, past the decode bound)
    for n in (1, 11) + ((130,) if packed.amx_rows >= ALL_ROWS else ()):
        probe = torch.randn(n, packed.in_features, generator=torch.Generator().manual_seed(n)).to(weight.dtype)
        want = F.linear(probe.float(), weight.float(), None if bias is None else bias.float())
        got = packed(probe).float()
        if not bool(torch.all((got - want).abs() <= want.abs() * 2.0**-7 + 1e-3 * want.abs().max())):
            log.warning("tiled %s differs from its float32 product at %d rows; oneDNN alone", name, n)
            packed.remove_tiled()
            return False
    if packed.covers(ALL_ROWS):  # the tiled kernel takes every row, or the AMX products every row past it
        packed.drop_packed()
    return True
