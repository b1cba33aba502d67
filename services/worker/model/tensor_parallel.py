"""Tensor parallelism: one model split across N worker ranks of one engine (Megatron-style).

Each rank holds 1/N of every attention layer's heads and of every MLP's
intermediate width, and 1/N of the KV cache (its own KV heads, all blocks):

    q_proj, k_proj, v_proj   column-parallel: rank r keeps heads [r*H/N, (r+1)*H/N) of
                             queries and [r*K/N, (r+1)*K/N) of keys/values, which are
                             exactly the KV heads its query heads use (GQA groups
                             stay whole because H/N is a multiple of H/K)
    o_proj                   row-parallel: rank r multiplies its heads' slice of the
                             input; an all-reduce sums the N partial outputs
    gate_proj, up_proj       column-parallel over the intermediate width
    down_proj                row-parallel, all-reduced

Embeddings, norms and the LM head stay whole on every rank (they are a small
part of the weights of the models this targets; splitting the vocabulary would
add a gather for nothing on a CPU). Two all-reduces per layer, nothing else.

Which layer gets which split comes from transformers' own tensor-parallel plan
when the model's config class has one (``base_model_tp_plan``, e.g. Llama's
``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``):
``colwise`` and ``rowwise`` entries are applied by ferry's own slicing below; a plan
with any other style (MoE experts' ``local_colwise``, ``gather``...) is refused by
name. Without a plan, ferry's own split for the Llama family (Llama, Mistral, Qwen2,
SmolLM...: ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``) applies.
Either way the result must shard every layer's seven projections, so ferry's paged
attention runs unchanged on fewer heads (transformers' attention views with ``-1``
heads). transformers' own execution of the plan (``from_pretrained(tp_plan="auto")``)
needs ``torchrun`` and DTensor and assumes its own KV cache; ferry's ranks are plain
processes under ``ferry serve``'s supervision, so only the plan is taken from it.

Collectives go through ``torch.distributed`` (gloo on CPU, NCCL on CUDA). The
ranks rendezvous at ``tp_init_method``, which ``ferry serve`` hands out per
engine: a file in the engine's private runtime folder (``file://``, no port at
all) on one host, or ``tcp://host:port`` of rank 0 across hosts.

Sampling happens on rank 0 only; it broadcasts the sampled token ids so every
rank's batch state stays identical (the scheduler reads rank 0's result).
Only rank 0 applies the LM head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shared import capacity
from shared.config import WorkerConfig

from .packed_linear import in_fixed_rows

log = logging.getLogger("ferry.worker.tp")

COLLECTIVE_TIMEOUT_S = 300.0  # a peer that vanished is usually seen at once (closed socket); this bounds a hang


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: this rank's slice of the input features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.fixed_rows = 0  # --deterministic: products in calls of this many rows, partial sums added in rank order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_rows:
            weight = self.weight
            y = in_fixed_rows(lambda rows: F.linear(rows, weight), x, self.fixed_rows)
            # all_reduce's ring sums each element in an order set by where it falls in the
            # buffer, whose size is the step's rows: every rank's partial, added in rank order
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, y.contiguous())
            y = parts[0]
            for part in parts[1:]:
                y = y + part
        else:
            y = F.linear(x, self.weight)
            dist.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def make_batch_invariant(self, fixed_rows: int) -> str:
        self.fixed_rows = fixed_rows
        return f"row-parallel, BLAS in {fixed_rows}-row calls, partials summed in rank order"


def _column(linear: nn.Linear, rank: int, size: int) -> nn.Linear:
    """Rows [rank*out/size, (rank+1)*out/size) of the weight (and bias)."""
    out = linear.out_features // size
    rows = slice(rank * out, (rank + 1) * out)
    new = nn.Linear(linear.in_features, out, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[rows])
    new.requires_grad_(False)
    return new


def _row(linear: nn.Linear, rank: int, size: int) -> RowParallelLinear:
    width = linear.in_features // size
    cols = slice(rank * width, (rank + 1) * width)
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return RowParallelLinear(linear.weight.detach()[:, cols].contiguous(), bias)


def check_divisible(config: Mapping[str, Any], size: int) -> None:
    """A ValueError saying which dimension does not split ``size`` ways (shared.capacity's rule)."""
    capacity.tensor_parallel_config(config, size)


def rank_config(config: Mapping[str, Any], size: int) -> dict[str, Any]:
    """The config one rank's KV cache is sized from: 1/N of the heads, the same head size."""
    return capacity.tensor_parallel_config(config, size)


PLAN_STYLES = ("colwise", "rowwise")
LLAMA_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def model_tp_plan(model: Any) -> dict[str, str]:
    """transformers' tensor-parallel plan of the model's decoder (empty when its class has none)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def shard(model: Any, config: Mapping[str, Any], rank: int, size: int) -> str:
    """Shard ``model`` for this rank by transformers' plan, else ferry's Llama split; which one was used."""
    plan = model_tp_plan(model)
    if not plan:
        shard_llama(model, config, rank, size)
        return "ferry's Llama split"
    shard_by_plan(model, plan, config, rank, size)
    return "transformers' tp_plan"


def shard_by_plan(model: Any, plan: Mapping[str, str], config: Mapping[str, Any], rank: int, size: int) -> None:
    """Apply a transformers ``tp_plan`` (decoder-relative patterns) with ferry's column/row slicing."""
    import fnmatch

    unsupported = sorted({style for style in plan.values() if style not in PLAN_STYLES})
    if unsupported:
        raise ValueError(f"the model's tensor-parallel plan uses {', '.join(unsupported)}; ferry applies only "
                         f"{' and '.join(PLAN_STYLES)} (dense Llama-family layers; MoE is not supported)")
    check_divisible(config, size)
    decoder = model.get_decoder()
    done: dict[str, str] = {}
    for name, module in list(decoder.named_modules()):
        style = next((st for pattern, st in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or not name:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(f"the tensor-parallel plan splits {name}, a {type(module).__name__}, not a Linear")
        parent_name, _, attr = name.rpartition(".")
        parent = decoder.get_submodule(parent_name)
        setattr(parent, attr, _column(module, rank, size) if style == "colwise" else _row(module, rank, size))
        done[name] = style
    # ferry's paged attention and KV sizing assume every projection of every layer is split,
    # queries/keys/values by heads and o/down by rows: a plan that does less is refused.
    for i in range(len(decoder.layers)):
        for proj in LLAMA_PROJECTIONS:
            want = "rowwise" if proj.endswith(("o_proj", "down_proj")) else "colwise"
            if done.get(f"layers.{i}.{proj}") != want:
                raise ValueError(f"the tensor-parallel plan does not split layers.{i}.{proj} {want}; "
                                 "ferry needs the Llama-family split")


def shard_llama(model: Any, config: Mapping[str, Any], rank: int, size: int) -> None:
    """Replace every decoder layer's projections by this rank's slices, in place."""
    check_divisible(config, size)
    layers = model.get_decoder().layers
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [(attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))]
        for module, names in needed:
            if module is None or not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
                raise ValueError(f"tensor parallelism supports the Llama family (q/k/v/o and gate/up/down "
                                 f"projections); {type(layer).__name__} is not one")
        assert attn is not None and mlp is not None  # checked just above
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _column(getattr(attn, name), rank, size))
        attn.o_proj = _row(attn.o_proj, rank, size)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, _column(getattr(mlp, name), rank, size))
        mlp.down_proj = _row(mlp.down_proj, rank, size)


class _NoHead(nn.Module):
    """The LM head of a rank that does not sample: no logits, only their row count."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty((hidden.shape[0], 0))


class RankZeroSampler:
    """Rank 0 samples and broadcasts the token ids; the other ranks receive them."""

    def __init__(self, sampler: Callable[..., tuple[list[int], list[Any]]], rank: int) -> None:
        self.sampler = sampler
        self.rank = rank

    def __call__(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[list[int], list[Any]]:
        n = logits.shape[0]
        if self.rank == 0:
            tokens, logprobs = self.sampler(logits, *args, **kwargs)
            ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        else:
            ids, logprobs = torch.empty(n, dtype=torch.long, device=logits.device), [None] * n
        dist.broadcast(ids, src=0)
        return [int(t) for t in ids.tolist()], logprobs


@dataclass
class TensorParallel:
    """One rank's place in its engine's tensor-parallel group."""

    rank: int
    size: int

    def kv_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return rank_config(config, self.size)

    def wrap(self, lm_head: nn.Module, sampler: Any) -> tuple[nn.Module, Any]:
        return (lm_head if self.rank == 0 else _NoHead()), RankZeroSampler(sampler, self.rank)


def setup(config: WorkerConfig, model: Any, model_config: Mapping[str, Any]) -> TensorParallel | None:
    """Shard ``model`` for this rank and join the group; None without tensor parallelism."""
    size = config.tensor_parallel_size
    if size <= 1:
        return None
    if not 0 <= config.rank < size:
        raise ValueError(f"rank {config.rank} is outside a tensor-parallel group of {size}")
    if not config.tp_init_method:
        raise ValueError("tensor parallelism needs --tp-init-method (ferry serve sets it per engine)")
    how = shard(model, model_config, config.rank, size)
    log.info("rank %d of %d: sharded by %s", config.rank, size, how)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    log.info("rank %d of %d: joining the %s group at %s", config.rank, size, backend, config.tp_init_method)
    dist.init_process_group(backend, init_method=config.tp_init_method, rank=config.rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # one collective now: a rank that cannot reach the others fails at start-up, not in a step
    probe = torch.ones(1, device=config.device)
    dist.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor-parallel group check: all-reduce gave {probe.item()}, expected {size}")
    return TensorParallel(config.rank, size)
