"""What a causal LM does to its LM head's output before it calls it logits.

The runner applies the LM head to the sampling rows itself (not the model's ``forward``, which
computes every position's logits), so whatever the model's ``forward`` does after its head must
be done here too, in the same order and dtype: Gemma 2/3's final soft-cap
(``cap * tanh(logits / cap)``), Cohere's ``logit_scale`` (times) and Granite's
``logits_scaling`` (divided by). A model that does something else there is caught at load by
the probe (probe.py), which compares ferry's logits with the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class OutputHead(nn.Module):
    """``head``, then the model's own logit post-processing."""

    def __init__(self, head: nn.Module, softcap: float | None, scale: float | None, divide: float | None) -> None:
        super().__init__()
        self.head = head
        self.softcap, self.scale, self.divide = softcap, scale, divide

    @property
    def weight(self) -> Any:
        return getattr(self.head, "weight", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.scale is not None:  # Cohere: logits * logit_scale
            logits = logits * self.scale
        if self.divide is not None:  # Granite: logits / logits_scaling
            logits = logits / self.divide
        if self.softcap is not None:  # Gemma 2/3: as their forward does it
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits

    def extra_repr(self) -> str:
        parts = [f"softcap={self.softcap}" if self.softcap is not None else "",
                 f"scale={self.scale}" if self.scale is not None else "",
                 f"divide={self.divide}" if self.divide is not None else ""]
        return ", ".join(p for p in parts if p)


def with_output_transform(head: nn.Module, model: nn.Module, hf_config: Any) -> nn.Module:
    """``head`` wrapped in the post-processing ``model``'s forward applies (itself where none)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(model, "logit_scale", None)  # Cohere keeps it on the model, from its config
    scale = float(scale) if isinstance(scale, int | float) and scale != 1 else None
    divide = getattr(text, "logits_scaling", None)
    divide = float(divide) if isinstance(divide, int | float) and divide != 1 else None
    if softcap is None and scale is None and divide is None:
        return head
    return OutputHead(head, float(softcap) if softcap is not None else None, scale, divide)
