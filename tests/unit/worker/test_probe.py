"""Exact or refused, the parts: the attention's keyword policy and the LM head's post-processing.

The whole check (a model through ferry's step and transformers' own forward at load) runs
over real architectures in tests/integration/test_model_families.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.model.attention import UnsupportedAttention, check_keywords
from services.worker.model.output_head import OutputHead, with_output_transform


def test_keywords_that_change_attention_are_refused_by_name() -> None:
    # the variants are honoured (backends/variant.py): soft-caps, sinks, windows pass
    check_keywords({"ferry_meta": object(), "sliding_window": 4096, "position_ids": torch.zeros(1),
                    "softcap": 50.0, "s_aux": torch.zeros(4), "sinks": torch.zeros(4), "output_attentions": False})
    with pytest.raises(UnsupportedAttention, match=r"ALiBi position biases \(alibi=Tensor\)"):
        check_keywords({"alibi": torch.zeros(4)})
    with pytest.raises(UnsupportedAttention, match=r"a head mask \(head_mask=Tensor\)"):
        check_keywords({"head_mask": torch.ones(4)})
    with pytest.raises(UnsupportedAttention, match="takes the keyword rope_bias=Tensor, which ferry does not know"):
        check_keywords({"rope_bias": torch.zeros(2)})


class _Config:
    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)


def test_the_heads_post_processing_is_the_models_own() -> None:
    head = nn.Linear(8, 20, bias=False)
    x = torch.randn(3, 8) * 4
    raw = head(x)
    assert with_output_transform(head, nn.Module(), _Config()) is head
    gemma = with_output_transform(head, nn.Module(), _Config(final_logit_softcapping=3.0))
    assert isinstance(gemma, OutputHead)
    assert torch.equal(gemma(x), torch.tanh(raw / 3.0) * 3.0)
    cohere_model = nn.Module()
    cohere_model.logit_scale = 0.25  # type: ignore[assignment]
    assert torch.equal(with_output_transform(head, cohere_model, _Config())(x), raw * 0.25)
    assert torch.equal(with_output_transform(head, nn.Module(), _Config(logits_scaling=8.0))(x), raw / 8.0)
    # a scale of exactly 1 changes nothing and adds nothing
    assert with_output_transform(head, nn.Module(), _Config(logits_scaling=1.0)) is head
