"""Tensor parallelism follows transformers' own plan (``base_model_tp_plan``) where the model has one.

The plan's colwise/rowwise entries, applied with ferry's slicing, must give every rank
exactly the weights ferry's own Llama split gives it; plans ferry cannot honour (other
styles, or fewer layers split than its paged attention assumes) are refused by name.
No process group is needed: sharding only slices weights.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from services.worker.model.tensor_parallel import model_tp_plan, shard, shard_by_plan, shard_llama
from tests.conftest import cached_tiny_model


def _load(kind: str) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    folder = cached_tiny_model(kind)
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
            json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_plan_gives_each_rank_the_llama_split(rank: int) -> None:
    model, config = _load("llama")  # GQA 4:2 (the tiny Qwen2 has one KV head: no split by 2)
    plan = model_tp_plan(model)
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
    by_plan, by_ferry = copy.deepcopy(model), copy.deepcopy(model)
    assert shard(by_plan, config, rank, 2) == "transformers' tp_plan"
    shard_llama(by_ferry, config, rank, 2)
    got, want = dict(by_plan.named_parameters()), dict(by_ferry.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    q = by_plan.get_decoder().layers[0].self_attn.q_proj
    assert q.out_features == model.get_decoder().layers[0].self_attn.q_proj.out_features // 2


def test_qwen2_has_the_same_plan() -> None:
    assert model_tp_plan(_load("qwen2")[0]) == model_tp_plan(_load("llama")[0])


def test_plans_ferry_cannot_apply_are_refused() -> None:
    model, config = _load("llama")
    plan = model_tp_plan(model)
    with pytest.raises(ValueError, match="local_colwise"):
        shard_by_plan(copy.deepcopy(model), {**plan, "layers.*.mlp.experts": "local_colwise"}, config, 0, 2)
    partial = {k: v for k, v in plan.items() if not k.endswith("down_proj")}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj rowwise"):
        shard_by_plan(copy.deepcopy(model), partial, config, 0, 2)


def test_without_a_plan_ferrys_split_applies() -> None:
    model, config = _load("llama")
    model.config.base_model_tp_plan = None
    assert model_tp_plan(model) == {}
    assert shard(model, config, 1, 2) == "ferry's Llama split"
