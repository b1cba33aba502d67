"""What ``ferry serve`` keeps beside its stack: its own log lines, the embedded Redis's, the runtime folder.

``ferry serve``'s supervision events and the lines redis-server prints are written
in the children's log format (``shared/logs.py``) on stderr, so stderr is JSON
lines only and stdout carries nothing but the ready banner. A ``--runtime-dir``
the operator named outlives the command; the sockets made in it do not.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable

from shared.logs import JsonFormatter, TextFormatter

log = logging.getLogger("ferry.serve")


def setup_serve_logs(log_format: str) -> None:
    """ferry serve's own lines (supervision events) and the embedded Redis's, in the children's
    log format on stderr; stdout carries only the ready banner."""
    for name, service in (("ferry.serve", "serve"), ("ferry.redis", "redis")):
        logger = logging.getLogger(name)
        logger.propagate = False
        logger.setLevel(logging.INFO)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter(service))
        logger.addHandler(handler)


REDIS_LEVELS = {".": logging.DEBUG, "-": logging.DEBUG, "*": logging.INFO, "#": logging.WARNING}


def redis_log_sink(log_format: str) -> Callable[[str], None]:
    """Re-log each line of redis-server's own log (``pid:role date # message``) in ferry's format,
    on stderr with the other services' logs, so stdout carries only the ready banner."""
    redis_log = logging.getLogger("ferry.redis")
    if not redis_log.handlers:
        setup_serve_logs(log_format)

    def sink(line: str) -> None:
        head, sep, message = line.partition(" ")
        parts = message.split(" ", 5) if sep else []
        # "3721:M 30 Nov 2026 19:42:04.745 # Server initialized": the level mark is the 5th word
        if ":" in head and len(parts) == 6 and parts[4] in REDIS_LEVELS:
            redis_log.log(REDIS_LEVELS[parts[4]], parts[5], extra={"redis_pid": head.split(":")[0]})
        else:
            redis_log.warning(line)

    return sink


RUNTIME_SOCKETS = ("gateway.sock", "plan.sock", "result.sock", "redis.sock")


def remove_sockets(runtime_dir: str) -> None:
    """Remove the sockets this command made in an operator's --runtime-dir (the folder stays)."""
    for name in RUNTIME_SOCKETS:
        path = os.path.join(runtime_dir, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass
