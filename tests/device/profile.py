"""Stage 6 (opt-in: ``STAGES=profile``): where a decode step's time goes on the GPU.

For the default architecture at batch 1 and 64 and the Llama-3-8B shape at batch 64
(random weights, bf16, graphs on and, for the 8B, off): the decode steps run under
``torch.profiler``; recorded per step are the wall time, the summed time of the
device's kernels (the rest is the host: packing, launches, sampling, the sync) and
the kernels that cost most, grouped by name. The first GPU run (2026-12-04) found
the default model's graph-replayed step at 53x its HBM roofline at batch 1 and the
8B's at 2.1x at batch 64: this stage says which part to work on.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

from tests.device.common import (
    LLAMA3_8B,
    SMOLLM2_135M,
    TINY,
    Options,
    SkipStage,
    Stage,
    random_model_in_memory,
    run_stage,
)
from tests.device.drive import run_batch
from tests.device.throughput import make_runner

PROMPT_LEN = 512
STEPS = 12
TOP = 12


def kernel_table(prof: Any, steps: int) -> tuple[float, list[dict[str, Any]]]:
    """(device kernel microseconds per step, the costliest kernels per step)."""
    rows = []
    total = 0.0
    for ev in prof.key_averages():
        us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0) or 0.0)
        # self time on the device: kernels and memcpys, not the CPU ops that launched them
        self_us = float(
            getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0) or 0.0
        )
        if self_us <= 0:
            continue
        total += self_us
        rows.append(
            {
                "name": ev.key[:90],
                "us_per_step": round(self_us / steps, 1),
                "calls_per_step": round(ev.count / steps, 1),
                "us_incl": round(us / steps, 1),
            }
        )
    rows.sort(key=lambda r: -r["us_per_step"])
    return total / steps, rows[:TOP]


def body(opts: Options, stage: Stage) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SkipStage("no CUDA device")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if opts.device == "cuda" else [])
    dtype = torch.float32 if opts.cpu_dry_run else torch.bfloat16
    plans = (
        [("tiny", TINY, [(1, False), (4, False)])]
        if opts.cpu_dry_run
        else [
            ("small", SMOLLM2_135M, [(1, False), (64, False)]),
            ("8b", LLAMA3_8B, [(64, False), (64, True)]),
        ]
    )
    prompt_len, steps = (16, 3) if opts.cpu_dry_run else (PROMPT_LEN, STEPS)
    for name, arch, runs in plans:
        model = random_model_in_memory(arch, dtype, opts.device)
        for eager in sorted({e for _, e in runs}):
            runner = make_runner(opts, model, arch, dtype, eager, 64, 8192, prompt_len + 2 * steps + 64)
            for batch, e in runs:
                if e != eager:
                    continue
                run_batch(runner, batch, prompt_len, 2, 8192, arch["vocab_size"])  # warm-up
                prof = profile(activities=acts)
                timing = run_batch(
                    runner, batch, prompt_len, steps, 8192, arch["vocab_size"], around_decode=prof
                )
                wall_us = statistics.median(timing.decode_step_s) * 1e6
                device_us, top = kernel_table(prof, steps)
                stage.record(
                    f"{name}_b{batch}_{'eager' if eager else 'graphs'}",
                    {
                        "step_wall_us": round(wall_us, 1),
                        "device_us": round(device_us, 1),
                        "host_share": round(max(0.0, 1 - device_us / wall_us), 3),
                        "top": top,
                    },
                )
            del runner
            gc.collect()
        del model
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    run_stage("profile", body)
