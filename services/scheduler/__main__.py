"""``python -m services.scheduler``: the scheduler process's command line.

Every ``SchedulerConfig`` field is a ``--dashed-flag`` whose default comes from
``FERRY_<FIELD>``. The effective configuration is logged at start-up. SIGTERM or
SIGINT drains (new requests are refused, in-flight ones get ``--shutdown-grace-s``);
a second signal exits at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType

from shared.config import SchedulerConfig, add_config_args, config_as_dict, config_from_args
from shared.config_checks import config_errors, exit_on_errors
from shared.logs import add_logging_args, setup_logging_from_args

log = logging.getLogger("ferry.scheduler")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="ferry scheduler: continuous batching over a paged KV block ledger",
    )
    add_config_args(parser, SchedulerConfig, environ)
    add_logging_args(parser, environ)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging_from_args("scheduler", args)
    config = config_from_args(SchedulerConfig, args)
    exit_on_errors("ferry scheduler", config_errors(config))
    log.info("effective configuration: %s", json.dumps(config_as_dict(config), sort_keys=True),
             extra={"config": config_as_dict(config)})

    from services.scheduler.service import SchedulerService  # after logging is set up

    service = SchedulerService(config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if service.stop_requested:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("signal %d: draining for up to %.1fs", signum, config.shutdown_grace_s)
        service.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # the engine's registration in Redis and its HTTP probes (each off unless configured)
    from services.scheduler.registration import EngineAnnouncer, snapshot_of

    announcer = EngineAnnouncer(config, lambda: snapshot_of(service), service.clock)
    announcer.start()
    try:
        return service.run()
    finally:
        announcer.stop()


if __name__ == "__main__":
    sys.exit(main())
