"""One formula: a started worker's KV block count equals ``ferry plan``'s for the same budget.

The worker side is the real ``ModelRunner`` (weights loaded, KV tensors
allocated from ``--kv-cache-memory``); the planner side is a separate
``python -m ferry_cli plan --devices cpu:<bytes> --json`` process that reads only
the config. Budgets are deliberately not multiples of a block, so a rounding
difference on either side shows. The weight bytes the planner derives from the
config must equal the bytes of the parameters the worker actually loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared import capacity

ROOT = Path(__file__).resolve().parents[2]


def planner_row(model: str, budget: int, dtype: str, block_size: int, kv_dtype: str = "auto") -> dict:
    cmd = [sys.executable, "-m", "ferry_cli", "plan", "--model", model, "--devices", f"cpu:{budget}",
           "--dtype", dtype, "--kv-cache-dtype", kv_dtype, "--block-size", str(block_size), "--max-model-len", "512",
           "--prompt-len", "64", "--output-len", "64", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1
    return rows[0]


def worker_numbers(model: str, budget: int, dtype: str, block_size: int,
                   kv_dtype: str = "auto") -> tuple[int, int, int, dict]:
    import torch

    from services.worker.runner import ModelRunner
    from shared.config import WorkerConfig

    torch.set_num_threads(1)
    runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, device="cpu", kv_cache_memory=budget,
                                      block_size=block_size, max_model_len=512, num_threads=1,
                                      kv_cache_dtype=kv_dtype))
    config = runner.hf_config.to_dict()
    return runner.num_kv_blocks, runner.kv_cache_bytes, runner.weight_bytes, config


def check_same(model: str, budget: int, dtype: str, block_size: int, kv_dtype: str = "auto") -> None:
    row = planner_row(model, budget, dtype, block_size, kv_dtype)
    blocks, kv_bytes, weights, config = worker_numbers(model, budget, dtype, block_size, kv_dtype)
    assert row["kv_blocks"] == blocks > 0
    assert row["kv_blocks"] * row["block_bytes"] == kv_bytes  # the tensors the worker allocated
    assert row["kv_bytes_per_token"] == capacity.kv_bytes_per_token(config, row["kv_cache_dtype"])
    assert row["weight_bytes"] == weights


@pytest.mark.parametrize(
    ("kind", "dtype", "block_size", "kv_dtype"),
    # GQA fp32; MQA with q/k/v biases, bf16; a float8 KV cache (--kv-cache-dtype fp8: one byte)
    [("llama", "auto", 16, "auto"), ("qwen2", "bfloat16", 32, "auto"), ("llama", "bfloat16", 16, "fp8")],
)
def test_tiny_model_blocks_match(tmp_path: Path, kind: str, dtype: str, block_size: int, kv_dtype: str) -> None:
    from tests.tiny_models import build_tiny_model

    if kv_dtype == "fp8":
        from services.worker.backends import available_backends

        if "cpu_paged" not in available_backends("cpu"):
            pytest.skip("a float8 KV cache needs the cpu_paged kernels")
    folder = build_tiny_model(tmp_path / kind, kind)
    check_same(str(folder), 1_000_003, dtype, block_size, kv_dtype)


@pytest.mark.slow
def test_default_model_blocks_match() -> None:
    check_same("smollm2-135m-instruct", 64 * (1 << 20) + 12_345, "auto", 16)
