"""The gateway's FastAPI application: its lifespan, middleware, and the small endpoints.

``build_app`` wires one ``GatewayState`` (config, tokenizer, engine client, metrics,
admission) into the routes of ``serving.py`` (completions, chat) and the ones
here: models, tokenize/detokenize, health, readiness, version, config, metrics
and the dashboard. The engine client's sockets open in the lifespan, inside the
server's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.admission.auth import AdmissionError
from services.gateway.admission.auth_failures import AuthFailures, FailureThrottle, Throttled, TrustedProxies
from services.gateway.admission.auth_gate import GENERATION_PATHS, AuthGate
from services.gateway.admission.ops_auth import OpsAuth, is_loopback, static_admin_check
from services.gateway.api.middleware import RequestGuard
from services.gateway.api.serving import router as serving_router
from services.gateway.api.state import build_state, ferry_version, state_of
from services.gateway.api.validation import check_model, render_chat
from services.gateway.errors import APIError, bad_request, install_error_handlers
from services.gateway.observability.dashboard import make_dashboard_router
from services.gateway.protocol import DetokenizeRequest, TokenizeRequest
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.config import GatewayConfig

JSON_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


misc = APIRouter()


async def require_key(request: Request) -> None:
    """The API endpoints that generate nothing follow the key rules too (OpenAI's /v1/models
    needs a key), without counting against a key's limits. The ops pages (/health, /ready,
    /metrics, /dashboard, /v1/config) have rules of their own (docs/api.md)."""
    try:
        await state_of(request).admission.authenticate(request.headers.get("authorization"))
    except AdmissionError as e:
        raise APIError(e.status, e.message, code=e.code, headers=e.headers, type_=e.type) from e


@misc.get("/v1/models", dependencies=[Depends(require_key)])
async def list_models(request: Request) -> dict[str, Any]:
    st = state_of(request)
    card = {"id": st.model_name, "object": "model", "created": st.started_at, "owned_by": "ferry",
            "root": st.config.model, "parent": None, "max_model_len": st.max_model_len()}
    return {"object": "list", "data": [card]}


@misc.post("/tokenize", dependencies=[Depends(require_key)])
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    st = state_of(request)
    if body.model is not None:
        check_model(body.model, st.limits())
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = render_chat(st.tokenizer, messages, body.add_generation_prompt)
        ids = st.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = st.tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": st.max_model_len(), "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [st.tokenizer.token_text(t) for t in ids]
    return out


@misc.post("/detokenize", dependencies=[Depends(require_key)])
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    st = state_of(request)
    if body.model is not None:
        check_model(body.model, st.limits())
    bad = next((t for t in body.tokens if t >= st.tokenizer.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{st.tokenizer.vocab_size - 1})", "tokens")
    return {"prompt": st.tokenizer.decode(body.tokens)}


@misc.get("/health")
async def health(request: Request) -> dict[str, Any]:
    st = state_of(request)
    await st.admission.check_now()  # Redis's state as of now, not as of the last request
    return st.health()


@misc.get("/ready")
async def ready(request: Request) -> JSONResponse:
    st = state_of(request)
    ok, reason = st.engine.readiness()
    keys_ok, keys_reason = st.admission.readiness()
    if ok and not keys_ok:
        ok, reason = False, keys_reason
    body = {"ready": ok, "reason": reason, "scheduler": st.engine.status()}
    return JSONResponse(body, status_code=200 if ok else 503)


@misc.get("/version")
async def version() -> dict[str, str]:
    return {"version": ferry_version()}


@misc.get("/v1/config")
async def effective_config(request: Request) -> dict[str, Any]:
    return state_of(request).effective_config()


@misc.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    body, content_type = state_of(request).metrics.render()
    return Response(body, media_type=content_type)


def build_app(config: GatewayConfig, tokenizer: GatewayTokenizer | None = None,
              gateway_id: str | None = None) -> FastAPI:
    st = build_state(config, tokenizer, gateway_id)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await st.engine.start()
        st.admission.readiness()  # starts the key store's watcher: its first probe sets the auth mode
        if st.registry is not None:
            st.registry.start(st.engine)
        try:
            yield
        finally:
            if st.registry is not None:
                await st.registry.close()
            await st.engine.close()
            await st.admission.close()

    app = FastAPI(title="ferry", version=ferry_version(), lifespan=lifespan,
                  description="An OpenAI-compatible gateway in front of a ferry engine.")
    app.state.gateway = st

    def on_refused(path: str, err: APIError) -> None:
        # ferry:request_rejected_total: refusals of generation requests, each counted once,
        # by error code and the HTTP status the client got (docs/observability.md)
        if path in GENERATION_PATHS:
            st.metrics.on_rejected(err.code or str(err.status), err.status)

    def on_error(request: Request, err: APIError) -> None:
        on_refused(request.url.path, err)

    install_error_handlers(app, on_error)
    app.include_router(serving_router)
    app.include_router(misc)
    app.include_router(make_dashboard_router(
        st.metrics, lambda: {"health": st.health(), "config": st.effective_config()},
        engines=st.engine.engine_views))
    admin_key = static_admin_check(config.admin_key)

    async def is_admin(key: str) -> bool:
        return admin_key(key) or await st.admission.is_admin(key)

    def on_auth_failure(reason: str, address: str, verdict: Throttled) -> None:
        st.metrics.on_auth_failure(reason, address, verdict.retry_after_s, verdict.started,
                                   config.auth_failure_limit)

    throttle = FailureThrottle(config.auth_failure_limit, config.auth_failure_block_s,
                               redis=st.admission.shared_client, namespace=st.admission.layout.namespace,
                               redis_timeout_s=config.redis_timeout_s)
    failures = AuthFailures(throttle, TrustedProxies(config.forwarded_allow_ips), on_auth_failure)
    protect = not is_loopback(config.host) and not config.allow_unauthenticated_public
    # Starlette runs the last added outermost: AuthGate sees a request first, before the body guard
    # reads or parses its body and before any route (docs/operations.md, "Who is checked when").
    app.add_middleware(OpsAuth, protect=protect, is_admin=is_admin, failures=failures)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes, json_paths=JSON_PATHS,
                       limits=st.request_limits, body_timeout_s=config.body_timeout_s,
                       on_refused=on_refused)
    app.add_middleware(AuthGate, authenticate=st.admission.authenticate, failures=failures,
                       on_refused=on_refused)
    return app
