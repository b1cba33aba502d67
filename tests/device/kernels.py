"""Stage 1: the Triton kernels on the GPU against the reference attention.

The interpreter's cases (tests/unit/worker/test_triton_attention.py) in float32 and
bfloat16, then large shapes (long contexts, big batches, Llama-3-8B's heads),
then the decode and prefill kernels' time against the reference at one large
shape. ``--cpu-dry-run`` runs the first few cases under the interpreter.
"""

from __future__ import annotations

import functools
from typing import Any

from tests.device.common import Options, Stage, run_stage, timed


def standard_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for head_dim in (64, 128):
        for group in (1, 4, 8):
            for bs in (16, 32):
                reqs = [(0, 1), (bs - 1, 1), (bs, 1), (2 * bs + 5, 1)]
                cases.append(dict(reqs=reqs, num_heads=group * 2, num_kv_heads=2, head_dim=head_dim,
                                  block_size=bs, extra_blocks=1))
    for cached in (0, 16, 21):
        cases.append(dict(reqs=[(cached, 37), (cached // 2, 5)], num_heads=8, num_kv_heads=2, head_dim=64,
                          block_size=16, extra_blocks=1))
    cases.append(dict(reqs=[(40, 1), (15, 1), (0, 1), (32, 9), (0, 20), (7, 2)], num_heads=9, num_kv_heads=3,
                      head_dim=64, block_size=16))
    return cases


def large_cases() -> list[dict[str, Any]]:
    return [
        # 64 decodes at 4k context, Llama-3-8B heads (32 over 8), blocks of 16.
        dict(reqs=[(4000 + 13 * i, 1) for i in range(64)], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16),
        # One long decode: split-K across the SMs.
        dict(reqs=[(32000, 1)], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16),
        # Chunked prefill with long cached prefixes, mixed with decodes.
        dict(reqs=[(1000, 1)] * 8 + [(2048, 1024), (0, 2048), (513, 700)], num_heads=32, num_kv_heads=8,
             head_dim=128, block_size=32),
        # MQA, head_dim 64.
        dict(reqs=[(3000, 1)] * 16 + [(100, 900)], num_heads=16, num_kv_heads=1, head_dim=64, block_size=16),
    ]


def body(opts: Options, stage: Stage) -> None:
    import torch

    if opts.cpu_dry_run:
        from tests.device.interpreter import enable_interpreter

        enable_interpreter()
    from services.worker.backends.triton_backend import TritonBackend
    from tests.device.attention_cases import make_case, reference_attention

    device = torch.device(opts.device)
    dtypes = [torch.float32] if opts.cpu_dry_run else [torch.float32, torch.bfloat16]
    cases = standard_cases()[:3] if opts.cpu_dry_run else standard_cases() + large_cases()
    failures: list[str] = []
    worst: dict[str, float] = {}
    for dtype in dtypes:
        for i, spec in enumerate(cases):
            case = make_case(**spec, dtype=dtype, device=opts.device, seed=i)
            ref = make_case(**spec, dtype=dtype, device=opts.device, seed=i)
            if dtype != torch.float32:  # reference in float32 on the same bf16-rounded inputs
                for name in ("query", "key", "value", "k_cache", "v_cache"):
                    setattr(ref, name, getattr(ref, name).float())
            ref_out, ref_k, _ = reference_attention(ref)
            backend = TritonBackend(device, prefill_block_m=16 if opts.cpu_dry_run else 64)
            backend.set_head_shape(spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
            meta = backend.prepare(case.batch)
            out = backend.forward(0, case.query, case.key, case.value, case.k_cache, case.v_cache, meta, case.scale)
            err = (out.float() - ref_out.float()).abs().max().item()
            kv_ok = torch.equal(case.k_cache.float(), ref_k.float())
            tol = 2e-4 if dtype == torch.float32 else 3e-2
            key = str(dtype).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
            if err > tol or not kv_ok or not torch.isfinite(out).all():
                failures.append(f"{key} case {i} ({spec['reqs'][:3]}...): max err {err:.2e}, kv ok {kv_ok}")
    stage.record("num_cases", len(cases) * len(dtypes))
    stage.record("max_abs_err", worst)
    stage.record("failures", failures)
    if failures:
        stage.data["status"] = "fail"
        stage.data["error"] = f"{len(failures)} kernel cases differ from the reference"
    if not opts.cpu_dry_run:
        time_large(opts, stage)


def time_large(opts: Options, stage: Stage) -> None:
    """Decode at batch 64, 4k context (8B heads) and one 2k prefill: triton vs reference."""
    import torch

    from services.worker import backends
    from services.worker.backends.triton_backend import TritonBackend
    from tests.device.attention_cases import make_case, reference_attention

    device = torch.device(opts.device)
    for label, spec in (("decode_b64_ctx4k", large_cases()[0]),
                        ("prefill_2k", dict(reqs=[(0, 2048)], num_heads=32, num_kv_heads=8, head_dim=128,
                                             block_size=16))):
        case = make_case(**spec, dtype=torch.bfloat16, device=opts.device)
        backend = TritonBackend(device)
        backend.set_head_shape(spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
        meta = backend.prepare(case.batch)
        out = torch.empty_like(case.query)
        run = functools.partial(backend.forward, 0, case.query, case.key, case.value, case.k_cache, case.v_cache,
                                meta, case.scale, out=out)
        run()
        t_triton = timed(run, opts.device, repeat=20)
        stage.record(f"{label}_triton_us", round(t_triton * 1e6, 1))
        kv_bytes = sum(case.batch.seq_lens_cpu) * spec["num_kv_heads"] * spec["head_dim"] * 2 * 2
        stage.record(f"{label}_kv_read_GBps", round(kv_bytes / t_triton / 1e9, 1))
        if "reference" in backends.available_backends("cuda"):
            ref = functools.partial(reference_attention, case)
            ref()
            t_ref = timed(ref, opts.device, repeat=5)
            stage.record(f"{label}_reference_us", round(t_ref * 1e6, 1))


if __name__ == "__main__":
    run_stage("kernels", body)
