"""shared.logs: JSON lines with req_id, content redaction, the logging flags."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from shared.logs import add_logging_args, current_req_id, request_context, setup_logging


@pytest.fixture
def buf() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    yield stream
    root.handlers[:] = before[0]
    root.setLevel(before[1])


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_with_explicit_req_id_and_extra_fields(buf: io.StringIO) -> None:
    setup_logging("gateway", stream=buf)
    logging.getLogger("ferry.test").info("request %s", "finished", extra={"req_id": "r-1", "num_output_tokens": 7})
    (rec,) = lines(buf)
    assert rec["msg"] == "request finished" and rec["level"] == "INFO"
    assert rec["service"] == "gateway" and rec["logger"] == "ferry.test"
    assert rec["req_id"] == "r-1" and rec["num_output_tokens"] == 7
    assert str(rec["ts"]).endswith("Z")


def test_request_context_binds_req_id_across_tasks(buf: io.StringIO) -> None:
    setup_logging("scheduler", stream=buf)
    log = logging.getLogger("ferry.test")

    async def serve(req_id: str) -> None:
        with request_context(req_id):
            await asyncio.sleep(0)
            await asyncio.create_task(asyncio.sleep(0))
            log.info("step")

    async def main() -> None:
        await asyncio.gather(serve("a"), serve("b"))

    asyncio.run(main())
    log.info("outside")
    got = lines(buf)
    assert sorted(str(r.get("req_id")) for r in got[:2]) == ["a", "b"]
    assert "req_id" not in got[2] and current_req_id() is None


def test_prompts_are_redacted_unless_asked(buf: io.StringIO) -> None:
    setup_logging("gateway", stream=buf)
    log = logging.getLogger("ferry.test")
    log.info("received", extra={"req_id": "r", "prompt": "my secret text", "prompt_token_ids": [1, 2, 3]})
    rec = lines(buf)[0]
    assert "secret" not in buf.getvalue()
    assert rec["prompt"] == {"redacted": True, "len": 14}
    assert rec["prompt_token_ids"] == {"redacted": True, "len": 3}
    buf.truncate(0), buf.seek(0)
    setup_logging("gateway", stream=buf, log_prompts=True)
    log.info("received", extra={"prompt": "my secret text"})
    assert lines(buf)[0]["prompt"] == "my secret text"


def test_exceptions_text_format_and_idempotent_setup(buf: io.StringIO) -> None:
    setup_logging("worker", stream=buf)
    setup_logging("worker", stream=buf)  # replaces, does not duplicate
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("w").exception("failed", extra={"req_id": "z"})
    (rec,) = lines(buf)
    assert "ValueError: boom" in str(rec["exc"])
    buf.truncate(0), buf.seek(0)
    setup_logging("worker", json=False, stream=buf)
    logging.getLogger("w").warning("slow step", extra={"req_id": "q", "step_ms": 12, "messages": ["hi"]})
    text = buf.getvalue()
    assert "[q]" in text and "step_ms=12" in text and "WARNING" in text and "'hi'" not in text


def test_logging_flags_from_environment() -> None:
    parser = argparse.ArgumentParser()
    add_logging_args(parser, environ={"FERRY_LOG_LEVEL": "DEBUG", "FERRY_LOG_PROMPTS": "1"})
    args = parser.parse_args([])
    assert args.log_level == "DEBUG" and args.log_prompts is True and args.log_format == "json"
    args = parser.parse_args(["--log-format", "text"])
    assert args.log_format == "text"
