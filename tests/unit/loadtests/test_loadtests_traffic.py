"""Scenario generators, the trace format and arrival processes: deterministic, exact, validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.arrivals import ArrivalSpec, send_offsets
from loadtests.scenarios import SCENARIO_NAMES, generate, parse_overrides, scenario_options
from loadtests.textgen import TextBuilder, load_tokenizer
from loadtests.trace import Trace, TraceError, TraceRequest, content_hash, read_trace, write_trace

SMALL = {"prompt_tokens": (8, 40), "prefix_tokens": (20, 30), "output_tokens": (2, 16)}


@pytest.fixture(scope="module")
def builder() -> TextBuilder:
    return TextBuilder(load_tokenizer())


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_same_seed_same_hash_other_seed_other_hash(builder: TextBuilder, name: str) -> None:
    first = generate(name, 24, 7, builder, SMALL)
    again = generate(name, 24, 7, builder, SMALL)
    other = generate(name, 24, 8, builder, SMALL)
    assert first.content_hash == again.content_hash
    assert [r.to_dict() for r in first.requests] == [r.to_dict() for r in again.requests]
    assert first.content_hash != other.content_hash
    assert len(first.requests) == 24


@pytest.mark.parametrize("n", [1, 2, 3, 17, 300])
def test_text_has_the_exact_token_count(builder: TextBuilder, n: int) -> None:
    import random

    rng = random.Random(n)
    for _ in range(5):
        assert len(builder.tokenizer.encode(builder.text(n, rng))) == n


def test_prompt_tokens_are_real_token_counts(builder: TextBuilder) -> None:
    trace = generate("agent-rag", 20, 0, builder, SMALL)
    for request in trace.requests:
        assert request.messages is not None
        counted = sum(len(builder.tokenizer.encode(m["content"])) for m in request.messages)
        assert counted == request.prompt_tokens
        assert 2 <= request.max_tokens <= 16


def test_agent_rag_shares_prefixes_and_cancels(builder: TextBuilder) -> None:
    trace = generate("agent-rag", 60, 0, builder, {**SMALL, "cancel_fraction": 0.5})
    by_group: dict[str, set[str]] = {}
    for request in trace.requests:
        assert request.prefix_group is not None and request.messages is not None
        by_group.setdefault(request.prefix_group, set()).add(request.messages[0]["content"])
        if request.cancel_after is not None:
            assert 1 <= request.cancel_after < request.max_tokens
    assert len(by_group) == 4 and all(len(prefixes) == 1 for prefixes in by_group.values())
    assert 15 <= sum(r.cancel_after is not None for r in trace.requests) <= 45


def test_mixed_holds_the_three_groups_in_time_order(builder: TextBuilder) -> None:
    trace = generate("mixed", 40, 0, builder, SMALL)
    assert trace.describe()["groups"] == {"agent-rag": 10, "chat": 24, "long-context": 6}
    offsets = [r.offset_s for r in trace.requests]
    assert offsets == sorted(offsets)


def test_trace_round_trip_keeps_the_hash(tmp_path: Path, builder: TextBuilder) -> None:
    trace = generate("chat", 10, 1, builder, SMALL)
    digest = write_trace(trace, tmp_path / "t.jsonl")
    loaded = read_trace(tmp_path / "t.jsonl")
    assert loaded.content_hash == digest == trace.content_hash
    assert loaded.meta["scenario"] == "chat" and loaded.meta["seed"] == 1
    # The header is metadata: dropping it does not change the traffic's hash.
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    (tmp_path / "bare.jsonl").write_text("\n".join(lines[1:]) + "\n")
    assert read_trace(tmp_path / "bare.jsonl").content_hash == digest


def test_hash_is_sha256_of_the_canonical_lines() -> None:
    import hashlib

    request = TraceRequest(id="a", max_tokens=4, prompt="hi", offset_s=0.5)
    line = '{"cancel_after":null,"group":"default","id":"a","max_tokens":4,"offset_s":0.5,' \
           '"prefix_group":null,"prompt":"hi","prompt_tokens":null}\n'
    assert content_hash([request]) == hashlib.sha256(line.encode()).hexdigest()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"max_tokens": 4}, "exactly one of"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}], "max_tokens": 4}, "exactly one of"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4, "cancel_after": 0}, "cancel_after"),
        ({"messages": [{"content": "y"}], "max_tokens": 4}, "messages"),
        ({"prompt": "x", "max_tokens": 4, "offset_s": -1}, "offset_s"),
    ],
)
def test_bad_trace_lines_are_refused_with_the_line_number(tmp_path: Path, line: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "max_tokens": 2}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:2: .*{message}"):
        read_trace(path)


def test_operator_trace_gets_ids_and_is_sorted(tmp_path: Path) -> None:
    path = tmp_path / "ops.jsonl"
    rows = [{"prompt": "b", "max_tokens": 3, "offset_s": 2.0}, {"prompt": "a", "max_tokens": 3, "offset_s": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = read_trace(path)
    assert [r.prompt for r in trace.requests] == ["a", "b"]
    assert all(r.id for r in trace.requests)
    with pytest.raises(TraceError, match="not supported"):
        (tmp_path / "v9.jsonl").write_text('{"ferry_trace": 9}\n' + json.dumps(rows[0]) + "\n")
        read_trace(tmp_path / "v9.jsonl")


def test_scenario_overrides_parse_and_validate() -> None:
    assert parse_overrides(["prompt_tokens=32:64", "cancel-fraction=0.5", "num_prefix_groups=2"]) == {
        "prompt_tokens": (32, 64), "cancel_fraction": 0.5, "num_prefix_groups": 2,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["nonsense=1"])
    with pytest.raises(ValueError, match="lo <= hi"):
        scenario_options("chat", {"prompt_tokens": (10, 5)})
    with pytest.raises(ValueError, match="unknown scenario"):
        scenario_options("nope")


def test_constant_arrivals_are_evenly_spaced() -> None:
    assert send_offsets(ArrivalSpec("constant"), 4.0, 1.0, [0.0] * 10) == [0.0, 0.25, 0.5, 0.75]


def test_open_loop_offsets_stop_at_the_trace_length_and_duration() -> None:
    assert len(send_offsets(ArrivalSpec("poisson"), 100.0, 10.0, [0.0] * 7)) == 7
    offsets = send_offsets(ArrivalSpec("poisson", seed=3), 5.0, 2.0, [0.0] * 1000)
    assert offsets[0] == 0.0 and max(offsets) < 2.0


@pytest.mark.parametrize(("kind", "burstiness"), [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_random_arrivals_average_the_offered_rate(kind: str, burstiness: float) -> None:
    offsets = send_offsets(ArrivalSpec(kind, burstiness, seed=1), 10.0, 200.0, [0.0] * 100000)
    assert len(offsets) / 200.0 == pytest.approx(10.0, rel=0.08)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(burstiness**-0.5, rel=0.15)  # gamma's CV is 1/sqrt(shape)


def test_rates_share_one_arrival_pattern_scaled() -> None:
    slow = send_offsets(ArrivalSpec("poisson", seed=2), 1.0, 100.0, [0.0] * 20)
    fast = send_offsets(ArrivalSpec("poisson", seed=2), 4.0, 100.0, [0.0] * 20)
    assert fast == pytest.approx([t / 4.0 for t in slow])


def test_trace_arrivals_are_time_scaled_to_the_rate() -> None:
    trace_offsets = [10.0, 11.0, 13.0, 20.0]
    assert send_offsets(ArrivalSpec("trace"), 2.0, 100.0, trace_offsets, natural_rate=1.0) == [0.0, 0.5, 1.5, 5.0]
    assert send_offsets(ArrivalSpec("trace"), 2.0, 2.0, trace_offsets, natural_rate=1.0) == [0.0, 0.5, 1.5]


def test_closed_loop_has_no_schedule_and_bad_specs_fail() -> None:
    with pytest.raises(ValueError, match="closed loop"):
        send_offsets(ArrivalSpec("closed"), 1.0, 1.0, [0.0])
    with pytest.raises(ValueError, match="unknown arrival"):
        ArrivalSpec("weibull")
    with pytest.raises(ValueError, match="burstiness"):
        ArrivalSpec("gamma", 0.0)


def test_natural_rate_of_a_trace() -> None:
    trace = Trace([TraceRequest(id=str(i), max_tokens=1, prompt="x", offset_s=i * 0.5) for i in range(5)])
    assert trace.natural_rate() == pytest.approx(2.0)


def test_fixed_scenario_has_exact_lengths_and_plain_prompts(builder: TextBuilder) -> None:
    from loadtests.scenarios import generate, parse_overrides

    trace = generate("fixed", 6, 3, builder, parse_overrides(["prompt_tokens=50:50", "output_tokens=9:9"]))
    prompts = [r.prompt for r in trace.requests]
    assert all(r.messages is None and r.max_tokens == 9 for r in trace.requests)
    assert [len(builder.tokenizer.encode(p or "")) for p in prompts] == [50] * 6
    assert len(set(prompts)) == 6  # distinct, so no prefix-cache hits between requests
    other = generate("fixed", 6, 4, builder, parse_overrides(["prompt_tokens=50:50", "output_tokens=9:9"]))
    assert not set(prompts) & {r.prompt for r in other.requests}  # fresh prompts per seed
    assert parse_overrides(["completions=false"]) == {"completions": False}
    with pytest.raises(ValueError, match="true or false"):
        parse_overrides(["completions=maybe"])
