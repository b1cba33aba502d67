"""OpenAI response bodies and stream chunks for completions and chat completions.

A renderer accumulates each choice's text and logprobs from ``ChoiceEvent``s and
produces either stream chunks (one per event) or the final response. Logprobs
of ``-inf`` (a token outside top-k/top-p) are sent as -9999.0, as OpenAI does,
because JSON has no infinity.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.api.generation import ChoiceEvent
from services.gateway.text.tokenizer import GatewayTokenizer
from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser
from services.gateway.text.tools import ToolStream, calls_json
from shared.messages import SampleLogprobs, TokenLogprob


def _lp(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


_encode = msgspec.json.Encoder().encode  # compact UTF-8 JSON, ~10x cheaper than json.dumps per chunk


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else _encode(data)
    return b"data: " + payload + b"\n\n"


@dataclass
class _Acc:
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0


class Renderer:
    """Common bookkeeping; subclasses know the completions or chat shapes."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, tokenizer: GatewayTokenizer, request_id: str, model: str, num_choices: int,
                 logprobs: bool) -> None:
        self.tok = tokenizer
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.acc = [_Acc() for _ in range(num_choices)]

    def _token(self, t: TokenLogprob) -> dict[str, Any]:
        text = self.tok.token_text(t.token_id)
        raw = self.tok.token_bytes(t.token_id) if self.tok.is_byte_level else text.encode("utf-8")
        return {"token": text, "logprob": _lp(t.logprob), "bytes": list(raw)}

    def add(self, ev: ChoiceEvent) -> None:
        acc = self.acc[ev.index]
        acc.text.append(ev.text)
        acc.finish_reason = ev.finish_reason or acc.finish_reason
        if self.logprobs:
            self._add_logprobs(acc, ev.logprobs)

    def _add_logprobs(self, acc: _Acc, lps: list[SampleLogprobs]) -> None:
        raise NotImplementedError

    def chunk(self, ev: ChoiceEvent, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk for ``ev`` (also accumulated)."""
        raise NotImplementedError

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming response."""
        raise NotImplementedError

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_of(self, choice: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
        out = {**self._envelope(self.chunk_object_name), "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": usage}


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _add_logprobs(self, acc: _Acc, lps: list[SampleLogprobs]) -> None:
        for lp in lps:
            tok = self._token(lp.sampled)
            acc.tokens.append(tok["token"])
            acc.token_logprobs.append(tok["logprob"])
            acc.top_logprobs.append({self.tok.token_text(t.token_id): _lp(t.logprob) for t in lp.top})
            acc.text_offset.append(acc.offset)
            acc.offset += len(tok["token"])

    def _logprobs_since(self, acc: _Acc, start: int) -> dict[str, Any]:
        return {"tokens": acc.tokens[start:], "token_logprobs": acc.token_logprobs[start:],
                "top_logprobs": acc.top_logprobs[start:], "text_offset": acc.text_offset[start:]}

    def chunk(self, ev: ChoiceEvent, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        acc = self.acc[ev.index]
        start = len(acc.tokens)
        self.add(ev)
        choice = {"index": ev.index, "text": ev.text,
                  "logprobs": self._logprobs_since(acc, start) if self.logprobs else None,
                  "finish_reason": ev.finish_reason}
        return self._chunk_of(choice, usage)

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [{"index": i, "text": "".join(a.text),
                    "logprobs": self._logprobs_since(a, 0) if self.logprobs else None,
                    "finish_reason": a.finish_reason} for i, a in enumerate(self.acc)]
        return {**self._envelope(self.object_name), "choices": choices, "usage": usage}


class ChatRenderer(Renderer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _add_logprobs(self, acc: _Acc, lps: list[SampleLogprobs]) -> None:
        for lp in lps:
            entry = self._token(lp.sampled)
            entry["top_logprobs"] = [self._token(t) for t in lp.top]
            acc.chat_logprobs.append(entry)

    tool_parser: ToolParser | None = None
    tool_streams: list[ToolStream] | None = None

    def use_tools(self, parser: ToolParser) -> None:
        """Read each choice's output into ``tool_calls`` with ``parser`` (text/tool_parsers/)."""
        self.tool_parser = parser
        self.tool_streams = [ToolStream(parser) for _ in self.acc]

    @staticmethod
    def _finish(reason: str | None, calls: list[ParsedCall]) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def role_chunk(self, index: int) -> dict[str, Any]:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._envelope(self.chunk_object_name), "choices": [choice]}

    def chunk(self, ev: ChoiceEvent, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        acc = self.acc[ev.index]
        start = len(acc.chat_logprobs)
        self.add(ev)
        finish = ev.finish_reason
        if self.tool_streams is not None:
            stream = self.tool_streams[ev.index]
            content, calls = stream.feed(ev.text, final=ev.finish_reason is not None)
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls_json(calls, stream.ids, with_index=True)
            finish = self._finish(finish, calls)
        else:
            delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
        choice = {"index": ev.index, "delta": delta,
                  "logprobs": {"content": acc.chat_logprobs[start:]} if self.logprobs else None,
                  "finish_reason": finish}
        return self._chunk_of(choice, usage)

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, a in enumerate(self.acc):
            text = "".join(a.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: list[ParsedCall] = []
            if self.tool_parser is not None:
                content, calls = self.tool_parser.parse(text)
                if calls:
                    message = {"role": "assistant", "content": content if content.strip() else None,
                               "tool_calls": calls_json(calls, [], with_index=False)}
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": a.chat_logprobs} if self.logprobs else None,
                            "finish_reason": self._finish(a.finish_reason, calls)})
        return {**self._envelope(self.object_name), "choices": choices, "usage": usage}
