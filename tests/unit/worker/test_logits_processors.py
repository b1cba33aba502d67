"""Token constraints in the worker: values of masked / biased logits, and the grammar matchers' lifecycle.

The matcher tests use the real SmolLM2 tokenizer (llguidance's view of it) and
plain step plans, no model: a request's mask after (re)adding it must equal the
mask of a matcher that never left, whatever happened in between.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from services.worker.batch import BatchState
from services.worker.logits_processors import (
    ConstraintTracker,
    RowConstraint,
    apply_constraints,
    banned_by_bad_words,
)
from services.worker.sampler import Sampler
from shared.grammar import GrammarCache, GrammarError, json_schema_grammar, load_tokenizer, regex_grammar
from shared.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan

VOCAB = 49152
EOS = 2


@lru_cache(maxsize=1)
def _tokenizer():  # type: ignore[no-untyped-def]
    from tests.tiny_models import tokenizer_files

    return load_tokenizer(tokenizer_files(), VOCAB, [EOS])


def _allowed(mask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:VOCAB]
    return {int(i) for i in np.flatnonzero(bits)}


def test_unconstrained_batch_is_untouched() -> None:
    logits = torch.randn(3, 10)
    assert apply_constraints(logits, None) is logits
    before = logits.clone()
    apply_constraints(logits, [None, None, None])
    assert torch.equal(logits, before)


def test_logit_bias_allowed_and_banned_values() -> None:
    logits = torch.arange(20, dtype=torch.float32).reshape(2, 10)
    before = logits.clone()
    out = apply_constraints(logits, [
        RowConstraint(logit_bias={1: 100.0, 9: -2.5}, banned_token_ids=[3]),
        RowConstraint(allowed_token_ids=[4, 6], banned_token_ids=[6]),
    ])
    assert out[0, 1].item() == 101.0 and out[0, 9].item() == 6.5 and out[0, 3].item() == -math.inf
    untouched = [0, 2, 4, 5, 6, 7, 8]
    assert torch.equal(out[0, untouched], before[0, untouched])
    assert out[1, 4].item() == 14.0  # kept with its value
    assert all(out[1, i].item() == -math.inf for i in range(10) if i != 4)


def test_grammar_bitmask_masks_exactly_the_disallowed_ids_of_its_row() -> None:
    vocab = 70  # not a multiple of 32: the tail bits must not matter
    mask = np.zeros(96, dtype=np.uint8)
    mask[[0, 33, 69]] = 1
    packed = np.packbits(mask, bitorder="little").tobytes()
    logits = torch.randn(3, vocab)
    before = logits.clone()
    out = apply_constraints(logits, [None, RowConstraint(grammar_bitmask=packed), None])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [0, 33, 69]
    assert torch.equal(out[1, finite], before[1, finite])


def test_sampler_applies_constraints_after_penalties_on_both_paths() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(2, 8)
    logits[:, 5] = 10.0
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0, seed=3)
    cons = [RowConstraint(logit_bias={2: 50.0}), RowConstraint(allowed_token_ids=[6, 7], logit_bias={7: 30.0})]
    tokens, _ = sampler(logits.clone(), [greedy, hot], [[1], [1]], [{}, {}], [0, 0], constraints=cons)
    assert tokens == [2, 7]
    tokens, _ = sampler(logits.clone(), [greedy, hot], [[1], [1]], [{}, {}], [0, 0])
    assert tokens[0] == 5  # and without constraints, nothing changes


def test_bad_words_ban_the_last_token_after_its_prefix() -> None:
    words = [[7], [1, 2, 3], [4, 5]]
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [9, 1, 2]) == [7, 3]
    assert banned_by_bad_words(words, [1, 2, 4]) == [7, 5]
    assert banned_by_bad_words(words, [2, 1]) == [7]


def _new(req_id: str, grammar: str, outputs: list[int] | None = None) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(grammar=grammar),
                          block_ids=list(range(64)), num_computed_tokens=0, output_token_ids=outputs or [])


def _plan(step: int, **kw) -> StepPlan:  # type: ignore[no-untyped-def]
    return StepPlan(step_id=step, **kw)


def test_matcher_survives_preemption_and_restart_by_replaying_outputs() -> None:
    tracker = ConstraintTracker(_tokenizer)
    batch = BatchState(16)
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 8}}, "required": ["k"]}
    grammar = json_schema_grammar(schema)
    text = '{"k":"abc"}'
    token_ids = _tokenizer().tokenize_str(text)
    plan = _plan(0, new_requests=[_new("r", grammar)])
    batch.apply(plan)
    tracker.sync(plan)
    state = batch.requests["r"]
    masks = []
    for i, tok in enumerate(token_ids):
        cons = tracker.for_step([state])
        assert cons is not None and cons[0] is not None and cons[0].grammar_bitmask is not None
        masks.append(cons[0].grammar_bitmask)
        assert tok in _allowed(cons[0].grammar_bitmask), (i, tok)
        tracker.advance([state], [tok])
        state.append_token(tok)
    end_mask = tracker.for_step([state])[0].grammar_bitmask  # type: ignore[index,union-attr]
    assert _allowed(end_mask) == {EOS}  # the object is closed: only EOS may follow
    # preempted, then resumed with its outputs: the rebuilt matcher is where the old one was
    outputs = token_ids[:3]
    for kind in ("resumed_requests", "new_requests"):  # resume after preemption / a restarted worker's add
        plan = _plan(1, preempted_req_ids=["r"])
        batch.apply(plan)
        tracker.sync(plan)
        assert len(tracker) == 0
        plan = _plan(2, **{kind: [_new("r", grammar, outputs)]})
        batch.apply(plan)
        tracker.sync(plan)
        rebuilt = tracker.for_step([batch.requests["r"]])[0].grammar_bitmask  # type: ignore[index,union-attr]
        assert rebuilt == masks[3]
    # a fresh tracker (a restarted worker) that learns of the request from a plan with outputs
    fresh = ConstraintTracker(_tokenizer)
    plan = _plan(3, new_requests=[_new("r", grammar, token_ids)])
    fresh.sync(plan)
    batch.apply(plan)
    assert _allowed(fresh.for_step([batch.requests["r"]])[0].grammar_bitmask) == {EOS}  # type: ignore[index,union-attr,arg-type]
    fresh.close()
    tracker.close()


def test_continuing_requests_keep_their_matcher_and_finished_ones_drop_it() -> None:
    tracker = ConstraintTracker(_tokenizer)
    g = regex_grammar("(ab)+")
    plan = _plan(0, new_requests=[_new("a", g), _new("b", g)])
    tracker.sync(plan)
    batch = BatchState(16)
    batch.apply(plan)
    states = [batch.requests["a"], batch.requests["b"]]
    tracker.for_step(states)
    cache = tracker.grammar_cache()
    assert cache.num_compiled == 1  # one distinct grammar: compiled once, copied for the second request
    a_tok = _tokenizer().tokenize_str("a")[0]
    tracker.advance(states, [a_tok, a_tok])
    plan = _plan(1, cached_requests=[CachedRequestData("a", [], 3)], finished_req_ids=["b"])
    tracker.sync(plan)
    assert len(tracker) == 1
    tracker.close()


def test_grammar_cache_is_bounded_and_remembers_failures() -> None:
    cache = GrammarCache(_tokenizer(), max_entries=2)
    for i in range(3):
        cache.matcher(regex_grammar(f"x{i}"))
    assert len(cache) == 2 and cache.num_compiled == 3
    bad = regex_grammar("[a-")
    for _ in range(2):
        with pytest.raises(GrammarError, match="unclosed character class"):
            cache.matcher(bad)
    assert cache.num_compiled == 4
    m1 = cache.matcher(regex_grammar("x2"))
    m1.consume_tokens(_tokenizer().tokenize_str("x"))
    m2 = cache.matcher(regex_grammar("x2"))  # a copy in the initial state, not the advanced one
    assert not m2.is_stopped() and m1 is not m2
    assert json.loads(json.dumps(cache.num_hits)) >= 1


def test_a_grammar_that_fails_in_the_worker_ends_its_request_instead_of_the_worker() -> None:
    tracker = ConstraintTracker(_tokenizer)
    plan = _plan(0, new_requests=[_new("r", regex_grammar("[a-"))])
    tracker.sync(plan)
    batch = BatchState(16)
    batch.apply(plan)
    cons = tracker.for_step([batch.requests["r"]])
    assert cons is not None and _allowed(cons[0].grammar_bitmask) == {EOS}  # type: ignore[union-attr,arg-type]
    tracker.close()


def test_masks_of_different_widths_line_up_by_row() -> None:
    # llguidance's masks are wider than the vocabulary; an EOS-only mask may be exactly as wide
    vocab = 64
    wide = np.zeros(160, dtype=np.uint8)
    wide[[3, 100]] = 1
    narrow = np.zeros(64, dtype=np.uint8)
    narrow[[5]] = 1
    logits = torch.zeros(2, vocab)
    apply_constraints(logits, [RowConstraint(grammar_bitmask=np.packbits(wide, bitorder="little").tobytes()),
                               RowConstraint(grammar_bitmask=np.packbits(narrow, bitorder="little").tobytes())])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5]


def test_a_worker_without_a_tokenizer_view_ends_grammar_requests_and_keeps_serving() -> None:
    def broken() -> None:
        raise FileNotFoundError("no tokenizer.json")

    tracker = ConstraintTracker(broken, eos_token_ids=[EOS])  # type: ignore[arg-type]
    plan = _plan(0, new_requests=[_new("r", regex_grammar("ab"))])
    tracker.sync(plan)
    batch = BatchState(16)
    batch.apply(plan)
    cons = tracker.for_step([batch.requests["r"]])
    assert cons is not None and _allowed(cons[0].grammar_bitmask) == {EOS}  # type: ignore[union-attr,arg-type]
    logits = torch.zeros(1, VOCAB)
    apply_constraints(logits, cons)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    tracker.close()
