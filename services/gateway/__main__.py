"""``python -m services.gateway``: the OpenAI-compatible HTTP gateway process.

Flags are ``GatewayConfig``'s fields with dashes (``--scheduler-endpoint``), with
``FERRY_*`` environment defaults, plus the logging flags. The process logs its
effective configuration (secrets redacted), refuses to listen on a non-loopback
address without authentication unless ``--allow-unauthenticated-public``, and
serves one FastAPI app with uvicorn. It never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from services.gateway.admission.keystore import Layout, sync_client
from services.gateway.admission.ops_auth import is_loopback
from services.gateway.engines.routing import policy_from_config
from shared.config import GatewayConfig, add_config_args, config_from_args
from shared.config_checks import config_errors, exit_on_errors
from shared.heap import release_and_log
from shared.logs import add_logging_args, setup_logging_from_args

log = logging.getLogger("ferry.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gateway",
                                     description="ferry's OpenAI-compatible HTTP gateway")
    add_config_args(parser, GatewayConfig)
    add_logging_args(parser)
    return parser


def redis_has_keys(url: str) -> tuple[bool, str]:
    """Whether Redis holds API keys (so every request must carry one)."""
    try:
        client = sync_client(url, timeout_s=2.0)
        try:
            return bool(client.exists(Layout().auth_flag)), "no API key was ever added (ferry keys add)"
        finally:
            client.close()
    except Exception as e:  # any failure means we cannot promise authentication
        return False, f"Redis at the given URL did not answer ({type(e).__name__})"


def check_public_bind(config: GatewayConfig) -> str | None:
    """An error message when binding would expose an unauthenticated API, else None."""
    if is_loopback(config.host) or config.allow_unauthenticated_public or config.api_key:
        return None
    why = "neither --api-key nor --redis-url is set"
    if config.redis_url:
        ok, why = redis_has_keys(config.redis_url)
        if ok:
            return None
    return (f"refusing to listen on {config.host!r} without authentication: {why}. Set --api-key, add keys "
            "with 'ferry keys add', bind 127.0.0.1, or pass --allow-unauthenticated-public")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(GatewayConfig, args)
    exit_on_errors("ferry gateway", config_errors(config))
    error = check_public_bind(config)
    try:
        policy_from_config(config)
    except ValueError as exc:
        error = str(exc)
    if error is not None:
        print(f"ferry gateway: {error}", file=sys.stderr)
        return 2
    setup_logging_from_args("gateway", args)

    import uvicorn

    from services.gateway.api.app import build_app

    app = build_app(config)
    release_and_log("tokenizer loaded", log)  # what parsing tokenizer.json freed (~29 MiB, shared/heap.py)
    st = app.state.gateway
    log.info("gateway starting", extra={"config": st.effective_config()["gateway"], "gateway_id": st.gateway_id,
                                        "tokenizer": str(st.tokenizer.folder)})
    # proxy_headers off: the gateway itself decides whose X-Forwarded-For to believe
    # (--forwarded-allow-ips, auth_failures.py); uvicorn's default trusts 127.0.0.1.
    uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False, proxy_headers=False,
                timeout_graceful_shutdown=max(1, math.ceil(config.shutdown_grace_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
