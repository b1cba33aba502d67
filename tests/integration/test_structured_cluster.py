"""Structured outputs and tool calling on a real ``ferry serve`` cluster, through the official openai client.

The tiny random Llama (SmolLM2's tokenizer) with a Hermes-style chat template that
shows tools (tests/data/tool_chat_template.jinja). A random model writes nonsense,
so every structured answer here is the grammar's doing: it must parse and validate.

- JSON schema / json_object / regex / choice / EBNF grammar, response_format and
  vLLM's structured_outputs and guided_* names; n>1 with a grammar;
- an agent loop: a forced call -> the tool's result -> a plain answer;
- streamed and non-streamed tool calls are equal (greedy);
- tool_choice auto parses what the model writes (nothing, on a random model) and
  tool_choice none sends no tools;
- 400s with the engine's message for bad schemas and grammars, before any work;
- a worker killed mid-way through a grammar request: the restarted worker replays
  the output tokens into a new matcher and the answer equals the undisturbed one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import ServeProcess, openai_client, read_metrics, wait_for

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "tool_chat_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer",
                                                                                  "minimum": -12, "maximum": 12}},
                                       "required": ["zone"]}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("toolmodel") / "tiny-tools"
    shutil.copytree(tiny_model_dir, folder)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def cluster(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(tool_model_dir, tmp_path_factory.mktemp("structured"),
                         ["--worker-heartbeat-timeout-s", "3", "--tool-call-parser", "hermes"]).start()
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def client(cluster: ServeProcess) -> openai.OpenAI:
    return openai_client(cluster.base_url)


def _chat(client: openai.OpenAI, cluster: ServeProcess, **kw: Any) -> Any:
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=cluster.model, **kw)


def test_json_schema_response_format_validates(client: openai.OpenAI, cluster: ServeProcess) -> None:
    for seed in range(3):
        out = _chat(client, cluster, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_structured_outputs_kinds(client: openai.OpenAI, cluster: ServeProcess) -> None:
    out = _chat(client, cluster, temperature=0.7, seed=1, max_tokens=200,
                response_format={"type": "json_object"}, logit_bias={"109": 5.0})  # '}' nudged: it ends
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = _chat(client, cluster, temperature=1.0, extra_body={"structured_outputs": {"regex": r"[a-c]{3}-\d\d"}})
    assert out.choices[0].finish_reason == "stop"
    assert __import__("re").fullmatch(r"[a-c]{3}-\d\d", out.choices[0].message.content)
    for extra in ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                  {"guided_choice": ["red", "green", "blue"]}):
        out = _chat(client, cluster, temperature=1.0, extra_body=extra)
        assert out.choices[0].message.content in ("red", "green", "blue")
    ebnf = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    out = _chat(client, cluster, temperature=0.0, max_tokens=200, extra_body={"structured_outputs": {"grammar": ebnf}})
    assert __import__("re").fullmatch(r"\(\d(\+\d)*\)", out.choices[0].message.content), out.choices[0]
    out = client.completions.create(model=cluster.model, prompt="JSON:", max_tokens=80, temperature=1.0,
                                    extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_n_choices_each_follow_the_grammar(client: openai.OpenAI, cluster: ServeProcess) -> None:
    out = _chat(client, cluster, n=4, temperature=1.0, seed=7, extra_body={"guided_json": PERSON})
    assert len(out.choices) == 4
    values = [json.loads(c.message.content) for c in out.choices]
    for v in values:
        jsonschema.validate(v, PERSON)
    assert len({json.dumps(v) for v in values}) > 1  # different seeds: different answers


def test_agent_loop_call_then_tool_result_then_answer(client: openai.OpenAI, cluster: ServeProcess) -> None:
    messages: list[Any] = list(USER)
    first = _chat(client, cluster, messages=messages, tools=[WEATHER, CLOCK], tool_choice="required",
                  temperature=0.0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        schema = WEATHER if c.function.name == "get_weather" else CLOCK
        jsonschema.validate(args, schema["function"]["parameters"])  # type: ignore[index]
        assert c.id.startswith("call_") and c.type == "function"
    messages.append(choice.message.model_dump(exclude_none=True))
    for c in calls:
        messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21})})
    answer = _chat(client, cluster, messages=messages, tools=[WEATHER, CLOCK], temperature=0.0, max_tokens=12)
    assert answer.choices[0].message.tool_calls is None  # auto: the model wrote no <tool_call>
    assert answer.choices[0].message.content  # plain text
    # the call and its result reached the prompt, after the same tools and question
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_named_tool_choice_and_streamed_calls_equal_plain(client: openai.OpenAI, cluster: ServeProcess) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_kw, parallel in ((named, True), ("required", False), ("required", True)):
        kw = dict(tools=[WEATHER, CLOCK], tool_choice=choice_kw, temperature=0.0, parallel_tool_calls=parallel)
        plain = _chat(client, cluster, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        if choice_kw is named:
            assert [n for n, _ in calls] == ["get_weather"]
        if not parallel:
            assert len(calls) == 1
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in _chat(client, cluster, stream=True, **kw):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(delta_call.index, ["", ""])
                entry[0] += delta_call.function.name or ""
                entry[1] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
        assert finish == plain.finish_reason == "tool_calls"


def test_auto_and_none_tool_choice(client: openai.OpenAI, cluster: ServeProcess) -> None:
    auto = _chat(client, cluster, tools=[WEATHER], temperature=0.0, max_tokens=10)
    plain_with_tools = client.chat.completions.create(
        model=cluster.model, messages=USER, max_tokens=10, temperature=0.0,
        extra_body={"chat_template_kwargs": {"tools": [WEATHER]}})
    # auto renders the tools through the template: the same prompt as passing them by hand
    assert auto.usage.prompt_tokens == plain_with_tools.usage.prompt_tokens
    none = _chat(client, cluster, tools=[WEATHER], tool_choice="none", temperature=0.0, max_tokens=10)
    bare = _chat(client, cluster, temperature=0.0, max_tokens=10)
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens
    assert none.choices[0].message.content == bare.choices[0].message.content


def test_logit_bias_and_allowed_token_ids_on_the_wire(client: openai.OpenAI, cluster: ServeProcess) -> None:
    out = client.completions.create(model=cluster.model, prompt="x", max_tokens=5, temperature=0.0,
                                    logit_bias={"59": 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "K" * 5  # token 59 is 'K' in SmolLM2's vocabulary
    out = client.completions.create(model=cluster.model, prompt="x", max_tokens=6, temperature=1.0,
                                    extra_body={"allowed_token_ids": [71, 72], "ignore_eos": True})
    assert set(out.choices[0].text) <= {"W", "X"} and len(out.choices[0].text) == 6


def _idle_prompt_tokens_after(base_url: str, moment: float) -> float:
    """The prompt-token total from a stats snapshot taken after ``moment`` (wall time) on an idle engine.

    Gateway metrics follow the scheduler's periodic EngineStats: a read right after a request can show an
    older snapshot, taken before that request (or an earlier test's) was counted.
    """
    seen: dict[str, float] = {}

    def settled() -> bool:
        seen.update(read_metrics(base_url))
        return (seen.get("ferry:engine_stats_timestamp_seconds", 0.0) > moment
                and seen.get("ferry:num_requests_running", 1.0) == 0.0
                and seen.get("ferry:num_requests_waiting", 1.0) == 0.0)

    wait_for(settled, 60, what="an idle engine's stats snapshot")
    return seen.get("ferry:prompt_tokens_total", 0.0)


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "objectx"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "look-around"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"],
                      "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/a"}},
                                      "required": ["b"]}}}}, "never be completed"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "foo"),
    ({"structured_outputs": {"grammar": 'root ::= "x" root'}}, "never be completed"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "not several"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"allowed_token_ids": [10 ** 6]}, "outside the vocabulary"),
])
def test_bad_constraints_are_400_before_any_work(cluster: ServeProcess, body: dict[str, Any], needle: str) -> None:
    # An earlier test's requests may still be finishing (a client-closed stream), or have finished since the
    # last stats snapshot: count from a snapshot of an idle engine taken now, so the counter can only move
    # because of this request.
    before = _idle_prompt_tokens_after(cluster.base_url, time.time())
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", trust_env=False, timeout=30,
                   json={"model": cluster.model, "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    # A request that wrongly reached the engine is counted at its first token: compare against a snapshot
    # taken a moment after the answer, once the engine is idle again.
    assert _idle_prompt_tokens_after(cluster.base_url, time.time() + 0.5) == before


def test_worker_restart_mid_grammar_request_gives_the_same_answer(client: openai.OpenAI,
                                                                   cluster: ServeProcess) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 150,
              "maxItems": 150}
    kw: dict[str, Any] = dict(prompt="numbers:", max_tokens=1000, temperature=0.0, extra_body={"guided_json": schema})
    solo = client.completions.create(model=cluster.model, **kw).choices[0].text
    jsonschema.validate(json.loads(solo), schema)
    old_pid = cluster.pid("worker")
    result: dict[str, str] = {}
    started = threading.Event()

    def run() -> None:
        text = ""
        for chunk in client.completions.create(model=cluster.model, stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].text
                if len(text) > 20:
                    started.set()
        result["text"] = text

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(120)
    os.kill(old_pid, signal.SIGKILL)
    t.join(240)
    assert not t.is_alive()
    wait_for(lambda: len(cluster.children("worker")) == 1 and cluster.pid("worker") != old_pid, 60,
             what="a restarted worker")
    assert read_metrics(cluster.base_url).get("ferry:worker_restarts_total", 0.0) >= 1
    assert result["text"] == solo
