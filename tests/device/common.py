"""What every stage of the device check shares: options, result files, models built from
a config (no hub, no carried weights), the machine's measured ceilings, and a driver
that feeds the model runner hand-built step plans.

The default model's weights (a 98 MB GGUF) cannot travel to the GPU machine (64 MiB
for the whole tree), so the check builds models with its exact architecture and
random weights; the tokenizer files travel (``.whl/smollm2-tokenizer``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_CARRIED = ROOT / ".whl" / "smollm2-tokenizer"

# SmolLM2-135M-Instruct's architecture (its config.json, minus the weights).
SMOLLM2_135M: dict[str, Any] = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, vocab_size=49152,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
# Llama-3-8B's architecture.
LLAMA3_8B: dict[str, Any] = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256,
    bos_token_id=128000, eos_token_id=128001,
)
# The dry run's stand-ins: the same code paths at shapes a loaded 2-core CPU runs in seconds.
TINY: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


@dataclass(frozen=True)
class Options:
    out: Path
    cpu_dry_run: bool
    device: str
    model_dir: Path  # the random-weight default-architecture model folder (built by `prepare`)


def parse_options(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu-dry-run", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu_dry_run else "cuda"
    return Options(args.out, args.cpu_dry_run, device, args.out / "work" / "model")


class Stage:
    """One stage's result file ``<out>/<name>.json``: status pass/fail/skip, the numbers it
    recorded, the error on failure. Rewritten as numbers arrive, so a stage killed by its
    time box still leaves what it measured (with status "running")."""

    def __init__(self, name: str, opts: Options) -> None:
        self.path = opts.out / f"{name}.json"
        self.data: dict[str, Any] = {"stage": name, "status": "running", "started": time.time(), "numbers": {}}

    def record(self, key: str, value: Any) -> None:
        self.data["numbers"][key] = value
        print(f"  {key} = {value}", file=sys.stderr, flush=True)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def run_stage(name: str, body: Callable[[Options, Stage], None], argv: list[str] | None = None) -> None:
    """Run ``body`` and write its result file; a failure is a result, not a crash."""
    opts = parse_options(argv)
    stage = Stage(name, opts)
    stage.save()
    try:
        body(opts, stage)
        if stage.data["status"] == "running":
            stage.data["status"] = "pass"
    except SkipStage as e:
        stage.data["status"] = "skip"
        stage.data["reason"] = str(e)
    except Exception as e:
        stage.data["status"] = "fail"
        stage.data["error"] = f"{type(e).__name__}: {e}"
        stage.data["traceback"] = traceback.format_exc()[-4000:]
    stage.data["seconds"] = round(time.time() - stage.data["started"], 1)
    stage.save()
    print(f"[{name}] {stage.data['status']} in {stage.data['seconds']}s", file=sys.stderr, flush=True)
    if stage.data["status"] == "fail":  # a judged failure has no traceback, only its error
        print(stage.data.get("traceback") or stage.data.get("error", ""), file=sys.stderr)


class SkipStage(Exception):
    pass


# --------------------------------------------------------------------------- models
def build_model_folder(folder: Path, arch: dict[str, Any], seed: int = 0, std: float = 0.15) -> Path:
    """A random-weight model folder with the SmolLM2 tokenizer, loadable as ``--model folder``.

    A spread of 0.15 (not the usual 0.02) makes greedy decoding decisive, so
    token-for-token comparisons are meaningful (tests/tiny_models.py does the same)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    values = dict(arch)
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for path in tokenizer_source().iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, tmp / path.name)
    os.replace(tmp, folder)
    return folder


def tokenizer_source() -> Path:
    if TOKENIZER_CARRIED.is_dir():
        return TOKENIZER_CARRIED
    from shared.models import resolve_model, tokenizer_dir

    return tokenizer_dir(resolve_model("smollm2-135m-instruct"))


def random_model_in_memory(arch: dict[str, Any], dtype: Any, device: str, seed: int = 0) -> Any:
    """A transformers causal LM with ``arch`` and random weights, built on the device
    directly (an 8B model in bf16 is 16 GB: never through the host or the disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(arch)
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------- ceilings
def measure_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = timed(lambda: dst.copy_(src), device, repeat=10)
    return 2 * nbytes / t


def measure_matmul(device: str, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on random data."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    t = timed(lambda: a @ b, device, repeat=10)
    return 2 * n**3 / t


def timed(fn: Callable[[], Any], device: str, repeat: int = 10) -> float:
    """Mean seconds per call (CUDA events on a GPU)."""
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
