"""Structured logging for every ferry process: one JSON object per line, with a request id.

Each service calls ``setup_logging("gateway")`` (or ``setup_logging_from_args``)
once at start-up. A record carries ``req_id`` either explicitly::

    logger.info("request finished", extra={"req_id": req_id, "num_output_tokens": 12})

or implicitly, from ``request_context(req_id)`` around the code that serves it (a
context variable, so it follows asyncio tasks). The gateway creates the id and sends
it in ``AddRequest.req_id``; the scheduler and workers log with the same id, so one
``grep req_id`` follows a request through every process.

Prompts and generated text are never written unless the operator asks
(``--log-prompts`` / ``FERRY_LOG_PROMPTS=1``): extra fields with a content name
(``prompt``, ``messages``, ``prompt_token_ids``, ``completion``...) are replaced by
their size. Pass content only through such fields, never inside the message text.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import datetime as _dt
import json as _json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import IO, Any

from shared import envs

_REQ_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("ferry_req_id", default=None)

# Extra fields that may hold user content: redacted unless prompts are enabled.
CONTENT_FIELDS = frozenset({
    "prompt", "prompts", "prompt_text", "prompt_token_ids", "messages", "input", "content",
    "completion", "output_text", "output_token_ids", "text", "stop_strings",
})

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {
    "message", "asctime", "taskName",
}
_HANDLER_MARK = "_ferry_handler"


def current_req_id() -> str | None:
    """The request id bound by the innermost ``request_context``, if any."""
    return _REQ_ID.get()


@contextlib.contextmanager
def request_context(req_id: str | None) -> Iterator[None]:
    """Bind ``req_id`` to every log record made inside the block (and tasks it starts)."""
    token = _REQ_ID.set(req_id)
    try:
        yield
    finally:
        _REQ_ID.reset(token)


def _redact(value: Any) -> dict[str, Any]:
    size = len(value) if hasattr(value, "__len__") else None
    return {"redacted": True, "len": size}


def _extras(record: logging.LogRecord, log_prompts: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.__dict__.items():
        if key in _STANDARD_ATTRS or key.startswith("_") or key == "req_id":
            continue
        out[key] = value if log_prompts or key not in CONTENT_FIELDS else _redact(value)
    return out


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "service", "logger", "msg", "req_id"?, ...extra fields, "exc"?}`` per line."""

    def __init__(self, service: str, log_prompts: bool = False) -> None:
        super().__init__()
        self.service = service
        self.log_prompts = log_prompts

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        req_id = getattr(record, "req_id", None) or _REQ_ID.get()
        if req_id:
            out["req_id"] = req_id
        out.update(_extras(record, self.log_prompts))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return _json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A human-readable line with the same fields, for terminals."""

    def __init__(self, service: str, log_prompts: bool = False) -> None:
        super().__init__()
        self.service = service
        self.log_prompts = log_prompts

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        req_id = getattr(record, "req_id", None) or _REQ_ID.get()
        parts = [ts, f"{record.levelname:<7}", f"{self.service}", record.name]
        if req_id:
            parts.append(f"[{req_id}]")
        parts.append(record.getMessage())
        parts += [f"{k}={v}" for k, v in _extras(record, self.log_prompts).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "INFO", json: bool = True, log_prompts: bool = False,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Route the root logger (and uvicorn's) to one structured handler on stderr.

    Idempotent: a second call replaces the handler the first one installed.
    Returns the handler (tests point ``stream`` at a buffer).
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter = JsonFormatter if json else TextFormatter
    handler.setFormatter(formatter(service, log_prompts=log_prompts))
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn installs its own plain-text handlers; send its records through ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
    target = stream if stream is not None else sys.stderr
    if json or not target.isatty():
        disable_progress_bars()
    return handler


def disable_progress_bars() -> None:
    """No tqdm bars (model loading, GGUF conversion) in a log meant for machines.

    Progress bars are for terminals: on a pipe or a file they interleave carriage
    returns with the JSON lines. Set before transformers and huggingface_hub are
    imported (they read these at import), and applied to them if already imported.
    """
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def add_logging_args(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--log-level``, ``--log-format`` and ``--log-prompts`` with FERRY_* environment defaults."""
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", default=envs.LOG_LEVEL.get(environ),
                       help="DEBUG, INFO, WARNING or ERROR [env FERRY_LOG_LEVEL]")
    group.add_argument("--log-format", choices=("json", "text"), default=envs.LOG_FORMAT.get(environ),
                       help="one JSON object per line, or text for terminals [env FERRY_LOG_FORMAT]")
    group.add_argument("--log-prompts", action="store_true",
                       default=envs.LOG_PROMPTS.get(environ),
                       help="write prompt and output content into logs (off: only sizes) [env FERRY_LOG_PROMPTS]")


def setup_logging_from_args(service: str, args: argparse.Namespace) -> logging.Handler:
    return setup_logging(service, level=args.log_level, json=args.log_format == "json",
                         log_prompts=bool(args.log_prompts))
