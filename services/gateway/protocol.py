"""The OpenAI-compatible request bodies, with every numeric range checked.

The pydantic models are the API's schema (and what schemathesis fuzzes): strict
types (no ``true`` for an int, no ``"1"`` for a float), finite floats only, and
ranges as field constraints. Checks that need the model or the server's config
(vocabulary size, ``max_n``, the context length) live in ``validation.py``.
Unknown fields are ignored, as OpenAI and vLLM do; fields ferry does not support
(``echo``, ``suffix``, ``best_of`` != n) are refused, never silently dropped.
Structured outputs (``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` names) and tools are shaped here and turned into grammars in
``text/structured.py`` / ``text/tools.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
MAX_SEED = (1 << 63) - 1
MAX_TOKENS_CAP = 1 << 24  # beyond any context length; the real bound is max_model_len
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

TokenId = Annotated[int, Field(ge=0)]
StopStrings = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]],
                        Field(max_length=MAX_STOP_STRINGS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these constraints."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=4096)
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str = Field(min_length=1, max_length=512)
    n: int = Field(default=1, ge=1, le=1024, description="choices per prompt (bounded by the server's max_n)")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20, description="-1 or 0 disables top-k")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    stop: str | StopStrings | None = Field(default=None)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int | None = Field(default=None, ge=-(1 << 31), le=(1 << 31) - 1,
                                 description="lower runs first (with the priority policy)")
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_CAP)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    queue_timeout_s: float | None = Field(default=None, gt=0.0, le=86400.0,
                                          description="ferry: give up if not running within this many seconds")
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1 << 16,
                                                 description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    # vLLM's token constraints
    allowed_token_ids: list[TokenId] | None = Field(default=None, max_length=1 << 20)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] | None = Field(
        default=None, max_length=256)
    # structured outputs: vLLM's field, and the older names clients still send
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=4096)
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_CAP)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1024)
    add_special_tokens: bool = True


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(default="{}", max_length=1 << 20)


class ToolCall(_Strict):
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments  # not JSON: templates get the text as sent
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates expect it (tool call arguments as objects, like HF's)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [c.template_dict() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=4096)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
