"""Every ISA build of the CPU kernels this CPU can execute (services/kernels/build.py), not
only the one ``load_extension`` would pick: each build's dispatch (``kernel_isa``, the tiled
and AMX paths) and its ops against PyTorch on small inputs.

The other kernel tests run on the build this CPU picks; ``FERRY_CPU_MARCH=<build>`` runs them
on another (with ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` for torch's own kernels).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.kernels.build import BUILDS, ISA_BUILDS, cflags, cpu_march, load_extension, runnable_builds

RUNNABLE = runnable_builds()


def _kernels(name: str) -> Any:
    try:
        return load_extension(name)
    except Exception as exc:  # noqa: BLE001 - no compiler here
        pytest.skip(f"the {name} build is unavailable: {exc}")


def test_builds_are_chosen_from_the_cpu_flags() -> None:
    avx2 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe".split())
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    zen4 = avx512 | {"avx512_bf16", "avx512vbmi", "avx512_vnni"}
    spr = zen4 | {"amx_tile", "amx_bf16", "amx_int8"}
    assert runnable_builds(frozenset({"sse4_2", "avx"})) == []
    assert runnable_builds(avx2) == ["avx2"]
    assert runnable_builds(avx512) == ["avx2", "avx512"]
    assert runnable_builds(zen4 - {"avx512vbmi"}) == ["avx2", "avx512"]
    assert runnable_builds(zen4) == ["avx2", "avx512", "avx512_bf16"]
    assert runnable_builds(spr) == [b.name for b in ISA_BUILDS]
    assert "-march=native" not in " ".join(f for b in ISA_BUILDS for f in cflags(b.name))
    assert cflags("native")[1] == "-march=native"


def test_the_default_is_the_widest_build_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_CPU_MARCH", raising=False)
    assert cpu_march() == (RUNNABLE[-1] if RUNNABLE else "native")
    monkeypatch.setenv("FERRY_CPU_MARCH", "avx2")
    assert cpu_march() == "avx2"
    monkeypatch.setenv("FERRY_CPU_MARCH", "x86-64-v3;rm")
    with pytest.raises(ValueError, match="FERRY_CPU_MARCH"):
        cpu_march()


@pytest.mark.parametrize("name", RUNNABLE or [pytest.param("none", marks=pytest.mark.skip("no ISA build runs here"))])
def test_each_build_dispatches_to_its_level(name: str) -> None:
    k = _kernels(name)
    assert k.kernel_isa() == ("avx2" if name == "avx2" else "avx512")
    assert bool(k.tiled_linear_available()) == (name in ("avx512_bf16", "amx"))
    assert bool(k.prefill_attention_available())
    if name != "amx":
        assert k.tiled_amx(-1) == 0 and not k.prefill_amx(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", RUNNABLE or [pytest.param("none", marks=pytest.mark.skip("no ISA build runs here"))])
def test_each_build_computes_the_fused_ops(name: str, dtype: torch.dtype) -> None:
    k = _kernels(name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    x32 = x.float()
    norm = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5).float(), norm, rtol=tol, atol=tol)
    gu = torch.randn(5, 128, generator=gen).to(dtype)
    want = F.silu(gu[:, :64].float()) * gu[:, 64:].float()
    torch.testing.assert_close(k.silu_and_mul(gu).float(), want, rtol=tol, atol=tol)
    logits = torch.randn(4, 1000, generator=gen).to(dtype)
    assert torch.equal(k.argmax_rows(logits), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("name", RUNNABLE or [pytest.param("none", marks=pytest.mark.skip("no ISA build runs here"))])
def test_each_build_decodes_over_the_paged_cache(name: str) -> None:
    k = _kernels(name)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size, lens = 6, 2, 64, 16, [1, 17, 40]
    blocks = sum(-(-n // block_size) for n in lens)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.zeros(len(lens), 3, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = torch.arange(used, used + nb, dtype=torch.int32)
        used += nb
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = k.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), scale, False)
    for i, n in enumerate(lens):
        slots = (table[i].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i], keys) * scale, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("ht,thd->hd", p, values), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [n for n in RUNNABLE if n in ("avx512_bf16", "amx")]
                         or [pytest.param("none", marks=pytest.mark.skip("no bfloat16 build runs here"))])
def test_each_bfloat16_build_multiplies_on_its_tiles(name: str) -> None:
    k = _kernels(name)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    tiles = k.tiled_pack(weight)
    bias = torch.empty(0)
    for rows in (1, 11, 40):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        want = F.linear(x.float(), weight.float())
        products = [k.tiled_linear] + ([k.amx_linear] if name == "amx" and k.tiled_amx(-1) else [])
        for product in products:
            got = product(x, tiles, bias).float()
            assert bool(torch.all((got - want).abs() <= want.abs() * 2.0**-7 + 1e-3 * want.abs().max())), product


def test_every_build_has_its_flags() -> None:
    assert sorted(BUILDS) == sorted(b.name for b in ISA_BUILDS) == ["amx", "avx2", "avx512", "avx512_bf16"]
