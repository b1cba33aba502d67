"""The GEMM limit of a fixed-length trace: how fast its matrix work could run on this machine.

A decoder's forward is mostly dense matrix products: per token and layer the q, k,
v and o projections and the gated MLP, plus one LM-head row per sampled token.
For a trace of ``num_requests`` prompts of ``prompt_tokens`` tokens that each
generate ``output_tokens`` tokens, those products have known shapes:

- prefill: every prompt token through every layer, in chunks of
  ``prefill_chunk`` rows (the step token budget);
- decode bodies: ``output_tokens - 1`` steps of ``num_requests`` rows (the first
  output token comes out of the prefill);
- LM heads: one row per output token, ``num_requests`` rows at a time.

``measure`` times each of those shapes on this machine, with the given threads and
dtype, through both of PyTorch's CPU GEMM libraries: ``torch.matmul`` (MKL in float32,
oneDNN in bfloat16) and oneDNN on a weight packed once into its blocked layout
(``mkldnn._linear_pointwise``, what vLLM's CPU linears call), and in bfloat16 through
ferry's tiled kernel where this CPU has it (services/kernels/csrc/tiled_linear.cpp,
what ferry's bfloat16 linears call: faster than oneDNN at
decode sizes) and, on a CPU with AMX, ferry's AMX tile products over the same tiles (what
its linears call there), and keeps the best of a
few trials of the fastest (a limit is what the hardware can do, not what it did beside other
jobs). The two differ most in float32 on AMD CPUs, where MKL takes a slow
path: on a Zen 5 EPYC oneDNN ran these shapes at 2.1-2.9x MKL's rate. The limit is then the
trace's FLOPs at those rates: no attention, norms, sampling or serving, so no
server can beat it; the board reports each server's throughput as a share of it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, path: Path) -> ModelDims:
        raw = json.loads((path / "config.json").read_text())
        heads = int(raw["num_attention_heads"])
        return cls(
            num_layers=int(raw["num_hidden_layers"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads), vocab_size=int(raw["vocab_size"]),
        )

    def layer_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in features K, out features N) of one decoder layer's linears."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


@dataclass(frozen=True)
class TraceShape:
    num_requests: int = 64
    prompt_tokens: int = 200
    output_tokens: int = 64
    prefill_chunk: int = 2048


def _best_rate(run: Any, flops_per_call: float, min_s: float, trials: int) -> float:
    """Best FLOP/s of ``run()`` over ``trials`` timed loops of at least ``min_s`` each."""
    for _ in range(2):
        run()
    best = 0.0
    for _ in range(trials):
        reps = 0
        start = time.perf_counter()
        while True:
            run()
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        best = max(best, flops_per_call * reps / elapsed)
    return best


def _rates(m: int, k: int, n: int, dtype: Any, min_s: float, trials: int) -> dict[str, float]:
    """Best FLOP/s of ``[m, k] @ [k, n]`` by library: ``matmul``, and ``onednn`` where it runs."""
    import torch

    x = torch.randn(m, k).to(dtype)
    weight = torch.randn(n, k).to(dtype)  # stored [out, in] like nn.Linear, multiplied transposed
    w = weight.t()
    flops = 2.0 * m * k * n
    rates = {"matmul": _best_rate(lambda: torch.matmul(x, w), flops, min_s, trials)}
    if torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, m)
            rates["onednn"] = _best_rate(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                         flops, min_s, trials)
        except (RuntimeError, AttributeError):  # a torch without the packed-linear ops: matmul alone
            pass
    kernels = _tiled_kernels() if dtype == torch.bfloat16 and n % 16 == 0 and k % 2 == 0 else None
    if kernels is not None:
        tiles, no_bias = kernels.tiled_pack(weight), torch.empty(0)
        rates["tiled"] = _best_rate(lambda: kernels.tiled_linear(x, tiles, no_bias), flops, min_s, trials)
        # with AMX, ferry's AMX tile products over the same tiles (what its linears call past 6 rows)
        if n % 32 == 0 and k % 32 == 0 and kernels.tiled_amx(-1):
            rates["amx"] = _best_rate(lambda: kernels.amx_linear(x, tiles, no_bias), flops, min_s, trials)
    return rates


def _tiled_kernels() -> Any | None:
    """ferry's tiled bfloat16 kernel, where this CPU and build have it (else None)."""
    try:
        from services.worker.model.packed_linear import _tiled_kernels as load
    except ImportError:
        return None
    return load()


def measure(dims: ModelDims, trace: TraceShape, dtype_name: str, threads: int,
            min_s: float = 0.25, trials: int = 3) -> dict[str, Any]:
    """The trace's GEMM time and output-token rate at the rates measured here (see the module doc)."""
    import torch

    torch.set_num_threads(threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    num_prompt = trace.num_requests * trace.prompt_tokens
    chunk = min(trace.prefill_chunk, num_prompt)
    num_decode_steps = max(0, trace.output_tokens - 1)
    batch = trace.num_requests
    parts: list[dict[str, Any]] = []

    def add(part: str, name: str, m: int, k: int, n: int, num_rows: int) -> None:
        rates = _rates(m, k, n, dtype, min_s, trials)
        via = max(rates, key=lambda key: rates[key])
        rate = rates[via]
        flops = 2.0 * num_rows * k * n
        parts.append({"part": part, "name": name, "m": m, "k": k, "n": n, "flops": flops,
                      "gflop_s": rate / 1e9, "seconds": flops / rate, "via": via})

    for name, k, n in dims.layer_shapes():
        add("prefill", name, chunk, k, n, num_prompt * dims.num_layers)
        add("decode", name, batch, k, n, batch * num_decode_steps * dims.num_layers)
    add("lm_head", "lm_head", batch, dims.hidden_size, dims.vocab_size, batch * trace.output_tokens)
    return summarize(dims, trace, dtype_name, threads, parts)


def best_of(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two measurements of the same limit (e.g. before and after a long run on a shared
    machine) merged shape by shape: the faster rate is the closer one to the hardware's."""
    parts = []
    for x, y in zip(a["shapes"], b["shapes"], strict=True):
        best = dict(x if x["gflop_s"] >= y["gflop_s"] else y)
        parts.append(best)
    dims = ModelDims(**a["model"])
    return summarize(dims, TraceShape(**a["trace"]), a["dtype"], a["threads"], parts)


def summarize(dims: ModelDims, trace: TraceShape, dtype_name: str, threads: int,
              parts: list[dict[str, Any]]) -> dict[str, Any]:
    by_part: dict[str, dict[str, float]] = {}
    for p in parts:
        agg = by_part.setdefault(p["part"], {"tflop": 0.0, "seconds": 0.0})
        agg["tflop"] += p["flops"] / 1e12
        agg["seconds"] += p["seconds"]
    for agg in by_part.values():
        agg["gflop_s"] = agg["tflop"] * 1e3 / agg["seconds"]
    total_s = sum(p["seconds"] for p in parts)
    return {
        "dtype": dtype_name, "threads": threads, "trace": asdict(trace), "model": asdict(dims),
        "parts": by_part, "shapes": parts, "seconds": total_s,
        "output_tok_s": trace.num_requests * trace.output_tokens / total_s,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.peers.gemm_limit MODEL_DIR DTYPE THREADS N PROMPT OUTPUT``: one measurement as JSON
    (a child process, so the caller chooses the OpenMP environment it starts with)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    model_dir, dtype, threads, n, prompt, output = args
    trace = TraceShape(int(n), int(prompt), int(output))
    print(json.dumps(measure(ModelDims.from_config(Path(model_dir)), trace, dtype, int(threads))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
