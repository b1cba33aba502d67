"""Attention variants (backends/variant.py): soft-capping, sinks and sliding windows, through every
CPU backend's ``forward_variant`` and the batch-invariant path, against float64 eager attention
(transformers' order: scores, soft-cap, mask, softmax over the scores and the sink) computed here
on each request's whole context without paging.

Windows are tested at their edges: a query sees exactly ``window`` keys counting its own, and a
window as wide as the step's longest context is plain attention (one narrower is not).
"""

from __future__ import annotations

import pytest
import torch

from services.worker.backends import available_backends, select_backend
from services.worker.backends.base import as_decodes, write_kv
from services.worker.backends.variant import AttentionVariant, invariant_attention, variant_attention
from services.worker.model.attention import UnsupportedAttention, attention_variant
from tests.unit.worker.test_attention_backends import BLOCK, CASES, _setup

HEADS = (6, 2)
SCALE = 0.7


def _eager(case: list[tuple[int, int]], query: torch.Tensor, contexts: list, variant: AttentionVariant) -> torch.Tensor:
    outs, start = [], 0
    for (q_len, ctx), (k, v) in zip(case, contexts, strict=True):
        q = query[start: start + q_len].double()
        start += q_len
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * SCALE
        if variant.softcap is not None:
            scores = torch.tanh(scores / variant.softcap) * variant.softcap
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        hidden = k_pos > q_pos
        if variant.window is not None:
            hidden |= k_pos <= q_pos - variant.window
        scores = scores.masked_fill(hidden, float("-inf"))
        if variant.sinks is not None:
            sink = variant.sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
    return torch.cat(outs).float()


def _written(s: dict) -> dict:
    """The step's own keys and values in the cache, as a backend's forward writes them first."""
    write_kv(s["key"], s["value"], s["k_cache"], s["v_cache"], s["batch"].slot_mapping)
    return s


def _variants() -> dict[str, AttentionVariant]:
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    return {
        "softcap": AttentionVariant(softcap=1.5),
        "sinks": AttentionVariant(sinks=sinks),
        "window": AttentionVariant(window=5),
        "window-one": AttentionVariant(window=1),
        "all": AttentionVariant(softcap=2.0, sinks=sinks, window=6),
    }


@pytest.mark.parametrize("variant_name", list(_variants()))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend_name", available_backends("cpu"))
def test_forward_variant_matches_eager_attention(backend_name: str, case: str, variant_name: str) -> None:
    spec = CASES[case]
    variant = _variants()[variant_name]
    s = _setup(spec, *HEADS, seed=11)
    backend = select_backend(backend_name, torch.device("cpu"))
    out = backend.forward_variant(0, s["query"], s["key"], s["value"], s["k_cache"], s["v_cache"], s["batch"],
                                  SCALE, variant)
    want = _eager(spec, s["query"], s["contexts"], variant)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    if variant.window is not None:  # the window changes the answer here: it is tested, not idle
        assert not torch.allclose(out, _eager(spec, s["query"], s["contexts"], AttentionVariant(
            softcap=variant.softcap, sinks=variant.sinks)), atol=1e-3)


@pytest.mark.parametrize("variant_name", list(_variants()))
def test_batch_invariant_path_matches_eager_and_each_token_alone(variant_name: str) -> None:
    """Under --deterministic the variant takes invariant_attention: right, and each token's bits
    the same alone as in the mixed batch."""
    spec = CASES["mixed"]
    variant = _variants()[variant_name]
    s = _setup(spec, *HEADS, seed=5)
    backend = select_backend("reference", torch.device("cpu"))
    backend.make_batch_invariant()
    out = backend.forward_variant(0, s["query"], s["key"], s["value"], s["k_cache"], s["v_cache"], s["batch"],
                                  SCALE, variant)
    torch.testing.assert_close(out, _eager(spec, s["query"], s["contexts"], variant), atol=2e-5, rtol=2e-5)
    # token by token: each decode of its own context, one at a time
    decodes = as_decodes(s["batch"])
    for t in range(out.shape[0]):
        alone = invariant_attention(s["query"][t: t + 1], s["k_cache"], s["v_cache"], decodes.block_table[t: t + 1].long(),
                                    decodes.seq_lens[t: t + 1].long(), SCALE, variant)
        assert torch.equal(alone[0], out[t]), t


def test_keys_outside_the_window_are_never_read() -> None:
    """Blocks wholly behind every query's window may hold anything (a NaN included): the answer
    does not change, on the padded decode path, the chunk path and the invariant path."""
    spec = [(1, 17), (1, 30), (4, 24)]
    variant = AttentionVariant(window=6)
    s = _written(_setup(spec, *HEADS, seed=3))
    want = variant_attention(s["query"], s["k_cache"], s["v_cache"], s["batch"], SCALE, variant)
    poisoned_k, poisoned_v = s["k_cache"].clone(), s["v_cache"].clone()
    for (q_len, ctx), ids in zip(spec, s["block_ids"], strict=True):
        first_seen = max(0, ctx - q_len - variant.window + 1)
        for b in range(first_seen // BLOCK):  # blocks that end before the first key any query sees
            poisoned_k[ids[b]] = float("nan")
            poisoned_v[ids[b]] = float("nan")
    got = variant_attention(s["query"], poisoned_k, poisoned_v, s["batch"], SCALE, variant)
    assert torch.equal(got, want)
    decodes = as_decodes(s["batch"])
    inv = invariant_attention(s["query"], poisoned_k, poisoned_v, decodes.block_table.long(),
                              decodes.seq_lens.long(), SCALE, variant)
    assert not inv.isnan().any()


def test_a_window_as_wide_as_the_longest_context_is_plain() -> None:
    assert AttentionVariant(window=30).plain_for(30)
    assert not AttentionVariant(window=29).plain_for(30)
    assert AttentionVariant().plain_for(10**6)
    assert not AttentionVariant(softcap=30.0).plain_for(1)
    assert not AttentionVariant(sinks=torch.zeros(2)).plain_for(1)
    # and the numbers agree: a window of exactly the context changes nothing, one less does
    spec = [(1, 30), (5, 12)]
    s = _written(_setup(spec, *HEADS, seed=2))
    plain = _eager(spec, s["query"], s["contexts"], AttentionVariant())
    wide = variant_attention(s["query"], s["k_cache"], s["v_cache"], s["batch"], SCALE, AttentionVariant(window=30))
    narrow = variant_attention(s["query"], s["k_cache"], s["v_cache"], s["batch"], SCALE, AttentionVariant(window=29))
    torch.testing.assert_close(wide, plain, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(narrow[0], plain[0], atol=1e-4)  # the 30-token decode loses its first key
    torch.testing.assert_close(narrow[1:], plain[1:], atol=2e-5, rtol=2e-5)  # 12 tokens: inside 29


def test_attention_variant_from_transformers_keywords() -> None:
    assert attention_variant({"sliding_window": None, "softcap": None}, 4) is None
    v = attention_variant({"softcap": 50, "sliding_window": 4096}, 4)
    assert v == AttentionVariant(softcap=50.0, window=4096)
    sinks = torch.zeros(4)
    assert attention_variant({"s_aux": sinks}, 4).sinks is sinks  # type: ignore[union-attr]
    with pytest.raises(UnsupportedAttention, match="not one per query head"):
        attention_variant({"s_aux": torch.zeros(8)}, 4)
    with pytest.raises(ValueError, match="at least one token"):
        AttentionVariant(window=0)
    with pytest.raises(ValueError, match="positive"):
        AttentionVariant(softcap=0.0)
