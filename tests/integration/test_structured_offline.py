"""Grammar-constrained generation through the real scheduler and model runner (offline engine, tiny model).

- many random JSON schemas (hypothesis, bounded for a loaded 2-core machine):
  every output parses and validates with ``jsonschema`` and ends with ``stop``;
- preemption + recompute and prefix-cache hits: greedy outputs with a KV budget
  that forces preemption equal those with room to spare, token for token;
- bad_words and allowed_token_ids change what is generated as asked.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.offline import LLM, GenerationParams
from shared.grammar import json_schema_grammar
from tests.conftest import cached_tiny_model
from tests.integration.test_offline_tiny import tiny_llm

pytestmark = pytest.mark.slow


@lru_cache(maxsize=1)
def _roomy() -> LLM:
    torch.set_num_threads(1)
    return tiny_llm(cached_tiny_model("llama"), num_blocks=600, max_num_batched_tokens=64)


_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).flatmap(lambda lo: st.integers(lo, lo + 500).map(
        lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.integers(-5, 5), st.text("abc", max_size=3), st.booleans()), min_size=1, max_size=4,
             unique_by=lambda v: json.dumps(v)).map(lambda vs: {"enum": vs}),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}$"}),
)


def _composite(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    obj = st.dictionaries(st.text("xyzw", min_size=1, max_size=3), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))
    arr = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    any_of = st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs})
    return st.one_of(obj, arr, any_of)


SCHEMAS = st.recursive(_leaf, _composite, max_leaves=6)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(SCHEMAS, st.integers(0, 1 << 30))
def test_random_schemas_always_validate(schema: dict[str, Any], seed: int) -> None:
    llm = _roomy()
    grammar = json_schema_grammar(schema)
    params = [GenerationParams(max_tokens=400, temperature=1.0, seed=seed + i, grammar=grammar) for i in range(2)]
    for out in llm.generate([[1, 2, 3], [4, 5]], params):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 12, "maxItems": 12}
WORDS = {"type": "object", "properties": {"w": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                "minItems": 6, "maxItems": 6}},
         "required": ["w"], "additionalProperties": False}
SHARED = list(range(300, 312))
PROMPTS = [SHARED + [5], SHARED + [6], [7, 8, 9], SHARED[:8] + [1, 2], [11, 12]]


def test_preemption_and_prefix_hits_leave_grammar_outputs_unchanged() -> None:
    torch.set_num_threads(1)
    folder = cached_tiny_model("llama")
    grammars = [json_schema_grammar(ARRAY if i % 2 else WORDS) for i in range(len(PROMPTS))]
    params = [GenerationParams(max_tokens=60, temperature=0.0, grammar=g) for g in grammars]
    roomy = _roomy().generate(PROMPTS, params)
    tight = tiny_llm(folder, num_blocks=20)
    outs = tight.generate(PROMPTS, params)
    stats = tight.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the KV budget was meant to force preemption"
    assert stats.prefix_cache_hits_total > 0, "shared prefixes were meant to hit the prefix cache"
    for ref, out, i in zip(roomy, outs, range(len(PROMPTS)), strict=True):
        assert out.finish_reason == ref.finish_reason == "stop"
        assert out.token_ids == ref.token_ids
        jsonschema.validate(json.loads(out.text), ARRAY if i % 2 else WORDS)
    # a seeded random request too: the noise depends on (seed, position), the mask on the outputs
    seeded = [GenerationParams(max_tokens=60, temperature=1.0, seed=5, grammar=grammars[1])] * 5
    assert [o.token_ids for o in tight.generate(PROMPTS, seeded)] == \
        [o.token_ids for o in _roomy().generate(PROMPTS, seeded)]


def test_bad_words_and_allowed_token_ids_shape_greedy_output() -> None:
    llm = _roomy()
    base = llm.generate([[1, 2, 3]], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    first = base[0]
    banned = llm.generate([[1, 2, 3]], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        bad_words_token_ids=((first,),)))[0].token_ids
    assert first not in banned and banned[0] != first
    # a two-token bad word: its second token is banned only right after its first
    pair = llm.generate([[1, 2, 3]], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                      bad_words_token_ids=((base[0], base[1]),)))[0].token_ids
    assert pair[0] == base[0] and pair[1] != base[1]
    allowed = llm.generate([[1, 2, 3]], GenerationParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                                         allowed_token_ids=(100, 200, 300)))[0].token_ids
    assert set(allowed) <= {100, 200, 300} and len(allowed) == 8
    bias = llm.generate([[1, 2, 3]], GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                      logit_bias=((4242, 100.0),)))[0].token_ids
    assert bias == [4242] * 4


def test_min_tokens_past_a_complete_grammar_pads_with_eos_and_stops() -> None:
    from shared.grammar import regex_grammar

    out = _roomy().generate([[1, 2, 3]], GenerationParams(max_tokens=20, temperature=0.0, min_tokens=5,
                                                          grammar=regex_grammar("ab")))[0]
    eos = _roomy().runner.eos_token_ids
    assert out.finish_reason == "stop" and out.text == "ab"
    assert len(out.token_ids) == 5 and all(t in eos for t in out.token_ids[-3:])
