"""The batched sampler alone, on hand-made logits: greedy, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch

from services.worker.sampler import Sampler
from shared.messages import SamplingParams

VOCAB = 50


def run(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None = None,
        sampler: Sampler | None = None) -> tuple[list[int], list]:
    outs = outputs or [[] for _ in params]
    counts = [{t: o.count(t) for t in o} for o in outs]
    sampler = sampler or Sampler(torch.device("cpu"), seed=0)
    return sampler(logits, params, [[1, 2, 3] + o for o in outs], counts, [len(o) for o in outs])


def peaked(row_peaks: list[int], scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(row_peaks), VOCAB, generator=gen) * scale
    for i, t in enumerate(row_peaks):
        logits[i, t] += 5.0
    return logits


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = peaked([7, 11, 42])
    tokens, logprobs = run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert tokens == [7, 11, 42]
    assert logprobs == [None, None, None]


def test_top_k_one_and_tiny_top_p_reduce_to_greedy() -> None:
    logits = peaked([3, 9], scale=2.0)
    expected = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        for seed in range(5):
            tokens, _ = run(logits, [params, params], sampler=Sampler(torch.device("cpu"), seed=seed))
            assert tokens == expected


def test_min_p_and_top_k_keep_only_allowed_tokens() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, [4, 5, 6]] = torch.tensor([2.0, 2.0 - math.log(2), 2.0 - math.log(20)])  # probs 1 : 0.5 : 0.05
    seen_min_p: set[int] = set()
    seen_top_k: set[int] = set()
    for seed in range(60):
        s = Sampler(torch.device("cpu"), seed=seed)
        seen_min_p.add(run(logits, [SamplingParams(min_p=0.3)], sampler=s)[0][0])
        seen_top_k.add(run(logits, [SamplingParams(top_k=2)], sampler=s)[0][0])
    assert seen_min_p == {4, 5}
    assert seen_top_k == {4, 5}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0).repeat(2000, 1)
    tokens, _ = run(logits, [SamplingParams(temperature=1.0)] * 2000)
    freq = [tokens.count(t) / 2000 for t in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.04)
    assert set(tokens) <= {0, 1, 2}  # zero-probability tokens are never drawn


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0  # seen in the prompt ([1, 2, 3])
    logits[0, 20] = 0.9
    assert run(logits, [SamplingParams(temperature=0.0)])[0] == [2]
    assert run(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.2)])[0] == [20]


def test_presence_and_frequency_penalties_use_output_counts() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 30] = 2.0
    logits[0, 31] = 1.5
    greedy = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert run(logits, [greedy], outputs=[[30]])[0] == [31]  # 2.0 - 0.6 < 1.5
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert run(logits, [freq], outputs=[[30, 30]])[0] == [30]  # 2.0 - 0.4 > 1.5
    assert run(logits, [freq], outputs=[[30, 30, 30]])[0] == [31]  # 2.0 - 0.6 < 1.5


def test_seeded_rows_do_not_depend_on_the_batch_or_the_sampler() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen)  # flat-ish: many tokens possible
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [run(logits[:1], [seeded], sampler=Sampler(torch.device("cpu"), seed=s))[0][0] for s in range(3)]
    assert len(set(alone)) == 1
    mixed, _ = run(logits[[1, 0, 2]], [SamplingParams(), seeded, SamplingParams(seed=9)])
    assert mixed[1] == alone[0]
    # The stream advances with the output position: 20 positions are not all one token.
    per_position = {run(logits[:1], [seeded], outputs=[[5] * n])[0][0] for n in range(20)}
    assert len(per_position) > 3


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_n() -> None:
    logits = peaked([8, 16])
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, logprobs=0)]
    tokens, logprobs = run(logits, params)
    ref = torch.log_softmax(logits, dim=-1)
    first, second = logprobs
    assert first.sampled.token_id == 8
    assert first.sampled.logprob == pytest.approx(ref[0, 8].item(), abs=1e-6)
    assert [t.token_id for t in first.top] == ref[0].topk(3).indices.tolist()
    assert first.top[0].logprob >= first.top[1].logprob >= first.top[2].logprob
    assert second.top == [] and second.sampled.token_id == tokens[1] == 16


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a row may draw, by a full sort (the definition the candidate path must meet)."""
    scaled = logits / p.temperature
    vals, idx = scaled.sort(descending=True)
    k = p.top_k if 0 < p.top_k < len(vals) else len(vals)
    probs = vals[:k].softmax(-1)
    keep = (probs.cumsum(-1) - probs) < p.top_p
    keep[0] = True
    keep &= probs >= p.min_p * probs[0]
    return set(idx[:k][keep].tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.9),  # the best 1024 of 3000 hold 0.9: candidates suffice
    SamplingParams(temperature=5.0, top_p=0.95),  # nearly flat: needs more than 1024 tokens, falls back
    SamplingParams(temperature=1.2, top_k=200, top_p=0.8, min_p=0.05),
], ids=["top_k", "top_p_candidates", "top_p_fallback", "all_filters"])
def test_filters_keep_exactly_the_sorted_definition_on_a_large_vocabulary(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 3000, generator=gen) * 3.0
    allowed = _allowed(logits[0], params)
    seen: set[int] = set()
    for seed in range(300):
        seen.add(run(logits, [params], sampler=Sampler(torch.device("cpu"), seed=seed))[0][0])
    assert seen <= allowed
    assert len(seen) > min(len(allowed), 20) // 2  # it samples, it does not collapse on the argmax


def test_top_k_with_top_p_draws_from_the_renormalized_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0).repeat(3000, 1)
    # top-k 3 renormalizes to 4/9, 3/9, 2/9; top-p 0.7 then keeps the first two (4/9 < 0.7 <= 7/9).
    tokens, _ = run(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.7)] * 3000)
    assert set(tokens) == {0, 1}
    assert tokens.count(0) / 3000 == pytest.approx(4 / 7, abs=0.04)


def test_seeded_rows_ignore_the_other_rows_filters() -> None:
    # The candidate width of a batch is its widest row's: a seeded row must not see it.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 3000, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=77)
    alone = run(logits[:1], [seeded])[0][0]
    for others in ([SamplingParams(top_k=500)], [SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)],
                   [SamplingParams(temperature=2.0, seed=3)]):
        tokens, _ = run(logits[: 1 + len(others)], [seeded, *others])
        assert tokens[0] == alone


class _CountingArgmax:
    """torch.argmax behind the Sampler's ``argmax_rows`` seam, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits.argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_greedy_batches_take_the_argmax_kernel_and_nothing_else_does(dtype: torch.dtype) -> None:
    argmax = _CountingArgmax()
    sampler = Sampler(torch.device("cpu"), seed=0, argmax_rows=argmax)
    logits = peaked([7, 11, 42]).to(dtype)
    greedy = SamplingParams(temperature=0.0)
    tokens, logprobs = run(logits, [greedy] * 3, sampler=sampler)
    assert (tokens, logprobs, argmax.calls) == ([7, 11, 42], [None] * 3, 1)
    # anything applied before the argmax, or a random row, keeps the float32 path
    for params in ([greedy, greedy, SamplingParams(temperature=0.7)],
                   [greedy, greedy, SamplingParams(temperature=0.0, logprobs=2)],
                   [greedy, greedy, SamplingParams(temperature=0.0, repetition_penalty=1.3)],
                   [greedy, greedy, SamplingParams(temperature=0.0, presence_penalty=0.5)],
                   [greedy, greedy, SamplingParams(temperature=0.0, frequency_penalty=0.5)]):
        run(logits, params, sampler=sampler)
    assert argmax.calls == 1
    from services.worker.logits_processors import RowConstraint

    banned = [None, None, RowConstraint(banned_token_ids=[42])]  # masks in place: the sampler owns its logits
    tokens, _ = sampler(logits.clone(), [greedy] * 3, [[1]] * 3, [{}] * 3, [0] * 3, banned)
    assert argmax.calls == 1 and tokens[:2] == [7, 11] and tokens[2] != 42
    tokens, _ = sampler(logits, [greedy] * 3, [[1]] * 3, [{}] * 3, [0] * 3, [None] * 3)
    assert argmax.calls == 2 and tokens == [7, 11, 42]


def test_the_cpu_kernel_picks_what_the_float32_path_picks() -> None:
    from services.worker.model.fused_ops import kernels

    ops = kernels()
    if ops is None:
        pytest.skip("no C++ compiler: the sampler keeps torch.argmax")
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 49152, generator=gen) * 3).to(torch.bfloat16)  # bfloat16 logits tie often
    logits[5, 100] = logits[5, 200] = logits[5].max() + 1
    greedy = [SamplingParams(temperature=0.0)] * 64
    fast, _ = run(logits, greedy, sampler=Sampler(torch.device("cpu"), argmax_rows=ops.argmax_rows))
    slow, _ = run(logits, greedy)
    assert fast == slow and fast[5] == 100


def _kernel_sampler(seed: int = 0) -> Sampler:
    from services.worker.model.fused_ops import kernels

    ops = kernels()
    if ops is None:
        pytest.skip("no C++ compiler: the sampler keeps its PyTorch paths")
    return Sampler(torch.device("cpu"), seed=seed, argmax_rows=ops.argmax_rows, sample_rows=ops.sample_rows,
                   race_rows=ops.race_rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_batches_skip_the_float32_copy_and_draw_what_it_draws(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(7, VOCAB, generator=gen) * 2).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=20),
              SamplingParams(temperature=0.9, min_p=0.05)]
    # A presence penalty with no outputs yet changes no logit but takes the float32 path.
    copied = [msgspec.structs.replace(p, presence_penalty=0.5) for p in params]
    for rows in (range(7), [1, 2, 3, 5, 6], [0, 4]):  # mixed, all random, all greedy
        fast, slow = _kernel_sampler(seed=21), _kernel_sampler(seed=21)
        seen: list[torch.dtype] = []
        kernel = fast.sample_rows
        assert kernel is not None

        def spy(x: torch.Tensor, *rest: torch.Tensor, kernel: Any = kernel,
                seen: list[torch.dtype] = seen) -> torch.Tensor:
            seen.append(x.dtype)
            return kernel(x, *rest)

        fast.sample_rows = spy
        race = fast.race_rows
        raced: list[torch.dtype] = []

        def race_spy(x: torch.Tensor, *rest: torch.Tensor, race: Any = race,
                     raced: list[torch.dtype] = raced) -> torch.Tensor:
            raced.append(x.dtype)
            return race(x, *rest)

        fast.race_rows = race_spy
        sub = logits[list(rows)].contiguous()
        for _ in range(5):  # the shared generator moves alike on both
            got, _ = run(sub, [params[i] for i in rows], sampler=fast)
            want, _ = run(sub, [copied[i] for i in rows], sampler=slow)
            assert got == want
        assert seen == ([dtype] * 5 if any(params[i].temperature > 0 for i in rows) else [])
        assert raced == ([dtype] * 5 if 1 in rows else [])  # the seeded row


def test_temperature_rows_through_the_kernel_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0).repeat(4000, 1)
    tokens, _ = run(logits, [SamplingParams(temperature=1.0)] * 4000, sampler=_kernel_sampler())
    freq = [tokens.count(t) / 4000 for t in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    assert set(tokens) <= {0, 1, 2}
    # temperature 0.5 squares the odds: 25 : 9 : 4
    tokens, _ = run(logits, [SamplingParams(temperature=0.5)] * 4000, sampler=_kernel_sampler(1))
    assert [tokens.count(t) / 4000 for t in range(3)] == pytest.approx([25 / 38, 9 / 38, 4 / 38], abs=0.03)


def test_random_rows_take_the_kernel_and_seeds_hold() -> None:
    sampler = _kernel_sampler()
    calls: list[int] = []
    kernel = sampler.sample_rows
    assert kernel is not None

    def counted(x: torch.Tensor, inv_t: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        assert torch.allclose(inv_t, torch.tensor([1 / 0.8] * x.shape[0]))
        return kernel(x, inv_t, *rest)

    sampler.sample_rows = counted
    race = sampler.race_rows
    assert race is not None
    raced: list[int] = []

    def race_counted(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        raced.append(x.shape[0])
        return race(x, *rest)

    sampler.race_rows = race_counted
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=0.8, seed=1234)
    params = [SamplingParams(temperature=0.0), seeded, SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, min_p=0.1)]
    for _ in range(20):
        tokens, _ = run(logits, params, sampler=sampler)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[2] in set(logits[2].topk(5).indices.tolist())
        probs = torch.softmax(logits[4] / 0.8, dim=-1)
        assert probs[tokens[4]] >= 0.1 * probs.max()
    # the three unseeded random rows in one call, the seeded one in the keyed race; the greedy row elsewhere
    assert calls == [3] * 20 and raced == [1] * 20
    alone = run(logits[1:2], [seeded], sampler=_kernel_sampler(seed=99))[0][0]
    assert tokens[1] == alone  # a seeded row's draw ignores the batch and the shared generator
    per_position = {run(logits[1:2], [seeded], outputs=[[5] * n], sampler=sampler)[0][0] for n in range(20)}
    assert len(per_position) > 3


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "pytorch"])
def test_a_seeded_draw_survives_last_bit_changes_of_the_logits(kernels: bool) -> None:
    """A seeded request resumed after a crash recomputes its KV: its logits come back a few ulps
    away from the first run's, and it must still draw the same tokens. Each token keeps its own
    noise (in the kernels' race and in the PyTorch race's candidates alike), so a pick moves only
    when the winner itself is within those ulps of a contender."""
    gen = torch.Generator().manual_seed(8)
    sampler = _kernel_sampler() if kernels else Sampler(torch.device("cpu"))
    # Each row's 64 likeliest tokens come in twins 1e-5 apart, and the nudge turns every twin
    # round: sorted candidates swap ranks pair by pair (noise keyed by rank would swap too).
    # top-k 1,000 takes the PyTorch race's candidate path; its cut falls among distinct tokens.
    logits = torch.randn(64, 8192, generator=gen) * 2
    nudged = logits * (1 + torch.randn(64, 8192, generator=gen) * 1e-6)
    top = logits.topk(64, dim=-1).indices
    for row, ids in zip(logits, top, strict=True):
        row[ids[1::2]] = row[ids[0::2]] + 1e-5
    for row, ids in zip(nudged, top, strict=True):
        row[ids[1::2]] = row[ids[0::2]] - 1e-5
    params = [SamplingParams(temperature=0.9, top_k=1000, seed=s, frequency_penalty=0.3) for s in range(64)]
    first = [run(logits, params, outputs=[[9] * n] * 64, sampler=sampler)[0] for n in range(8)]
    again = [run(nudged, params, outputs=[[9] * n] * 64, sampler=sampler)[0] for n in range(8)]
    assert first == again
    assert len({tuple(t) for t in first}) == 8  # and the draws do move with the position
