"""A seeded request resumed on a fresh worker continues exactly (the scheduler-crash resume).

The gateway re-submits a request as prompt + ``output_token_ids``; the worker's
per-request generator is keyed by ``(seed, number of outputs so far)``. So a fresh
``Sampler`` (other base seed, other batch neighbours) that picks the request up at
output position k must draw exactly the tokens the original would have drawn; and
position must matter, or a continuation sent as a longer prompt (position 0) would
silently restart the random stream.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.worker.sampler import Sampler
from shared.messages import SamplingParams

VOCAB = 50
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=4242, frequency_penalty=0.5)
OTHER = SamplingParams(temperature=0.7)


def logits_after(history: list[int]) -> torch.Tensor:
    """A deterministic stand-in for the model: logits that depend on the whole history."""
    gen = torch.Generator().manual_seed(hash(tuple(history)) & 0xFFFFFFFF)
    return torch.randn(VOCAB, generator=gen) * 3


def counts(outputs: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in outputs:
        out[t] = out.get(t, 0) + 1
    return out


def generate(sampler: Sampler, prompt: list[int], outputs: list[int], num_tokens: int,
             neighbour: bool) -> list[int]:
    """Continue ``prompt + outputs`` for ``num_tokens`` steps (optionally beside another row)."""
    outputs = list(outputs)
    for _ in range(num_tokens):
        history = prompt + outputs
        rows = [logits_after(history)]
        params = [SEEDED]
        if neighbour:
            rows.append(logits_after([7, *history]))
            params.append(OTHER)
        tokens, _ = sampler(torch.stack(rows), params, [history] * len(rows), [counts(outputs)] * len(rows),
                            [len(outputs)] * len(rows))
        outputs.append(tokens[0])
    return outputs


def _pytorch(seed: int) -> Sampler:
    return Sampler(torch.device("cpu"), seed=seed)


def _kernels(seed: int) -> Sampler:
    """The CPU worker's sampler: seeded rows through ``race_rows``, the neighbour through ``sample_rows``."""
    from services.worker.model.fused_ops import kernels

    ops = kernels()
    if ops is None:
        pytest.skip("no C++ compiler: the sampler keeps its PyTorch paths")
    return Sampler(torch.device("cpu"), seed=seed, argmax_rows=ops.argmax_rows, sample_rows=ops.sample_rows,
                   race_rows=ops.race_rows)


SAMPLERS = pytest.mark.parametrize("make", [_pytorch, _kernels], ids=["pytorch", "kernels"])


@SAMPLERS
def test_a_seeded_request_resumed_at_any_position_continues_exactly(make: Callable[[int], Sampler]) -> None:
    prompt = [1, 2, 3]
    original = generate(make(0), prompt, [], 24, neighbour=False)
    assert len(set(original)) > 3  # really random, not a fixed point
    for k in (1, 8, 23):
        resumed = generate(make(99), prompt, original[:k], 24 - k, neighbour=True)
        assert resumed == original, f"resumed at output {k}"


@SAMPLERS
def test_the_position_is_part_of_the_key(make: Callable[[int], Sampler]) -> None:
    """Sent as a longer prompt (no outputs), the continuation would draw different noise."""
    prompt = [1, 2, 3]
    original = generate(make(0), prompt, [], 16, neighbour=False)
    as_prompt = generate(make(0), prompt + original[:8], [], 8, neighbour=False)
    assert as_prompt != original[8:]
