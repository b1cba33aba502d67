"""The gateway's shared state: config, tokenizer, engine client, metrics and admission.

One ``GatewayState`` per process, built once at start-up and stored on the app;
route handlers reach it with ``state_of(request)``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from fastapi import Request

from services.gateway.auth import Admission
from services.gateway.engine_client import EngineClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.tokenizer import GatewayTokenizer, load_gateway_tokenizer
from services.gateway.validation import ServingLimits
from shared.config import GatewayConfig, config_as_dict

try:  # the Redis engine registry (admission's module); the gateway serves without it
    from services.gateway.registry import EngineRegistry
except ImportError:  # pragma: no cover - only while that module is absent
    EngineRegistry = None  # type: ignore[assignment,misc]


def ferry_version() -> str:
    try:
        return metadata.version("ferry")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def new_gateway_id() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class GatewayState:
    config: GatewayConfig
    gateway_id: str
    tokenizer: GatewayTokenizer
    engine: EngineClient
    metrics: GatewayMetrics
    admission: Admission
    served_names: frozenset[str]
    registry: Any = None  # EngineRegistry when available
    background: set[Any] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    def max_model_len(self) -> int:
        return self.engine.max_model_len or self.tokenizer.max_position_embeddings

    def limits(self) -> ServingLimits:
        return ServingLimits(self.served_names, self.config.max_n, self.max_model_len())

    def health(self) -> dict[str, Any]:
        ready, reason = self.engine.readiness()
        return {"status": "ok", "ready": ready, "reason": reason, "gateway_id": self.gateway_id,
                "version": ferry_version(), "model": self.model_name, "scheduler": self.engine.status(),
                "redis": self.admission.health(),
                "registry": self.registry.health() if self.registry is not None else {"registry": "absent"}}

    def effective_config(self) -> dict[str, Any]:
        gateway = config_as_dict(self.config)
        if gateway.get("api_key"):
            gateway["api_key"] = "<set>"
        if gateway.get("redis_url"):
            gateway["redis_url"] = _redact_url(str(gateway["redis_url"]))
        stats = self.engine.stats
        return {"gateway": gateway, "gateway_id": self.gateway_id, "model": self.model_name,
                "max_model_len": self.max_model_len(),
                "scheduler": dict(stats.config) if stats is not None else {}}


def _redact_url(url: str) -> str:
    """Hide a password in redis://user:password@host."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"


def state_of(request: Request) -> GatewayState:
    st = request.app.state.gateway
    assert isinstance(st, GatewayState)
    return st


def build_state(config: GatewayConfig, tokenizer: GatewayTokenizer | None = None,
                gateway_id: str | None = None) -> GatewayState:
    gid = gateway_id or new_gateway_id()
    tok = tokenizer or load_gateway_tokenizer(config.model, config.cache_dir)
    model_name = config.served_model_name or config.model
    metrics_ = GatewayMetrics(model_name, config.metrics_compat == "vllm",
                              max_model_len=tok.max_position_embeddings or 32768)
    engine = EngineClient(config.scheduler_endpoint, gid, config.heartbeat_interval_s,
                          config.scheduler_timeout_s, on_stats=metrics_.on_engine_stats,
                          on_health=metrics_.on_engine_health)
    registry = EngineRegistry(config, gid) if EngineRegistry is not None else None
    return GatewayState(config=config, gateway_id=gid, tokenizer=tok, engine=engine, metrics=metrics_,
                        admission=Admission(config, gid), served_names=frozenset({model_name}),
                        registry=registry)
