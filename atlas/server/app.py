"""The FastAPI app: OpenAI-compatible routes over one EngineLoop.

Bodies are read and parsed here rather than by FastAPI, so that every bad input (invalid UTF-8, bad JSON,
NaN, wrong types, out-of-range values) becomes a 400 in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from atlas import __version__
from atlas.server.chat import ChatTemplate
from atlas.server.engine_loop import EngineLoop
from atlas.server.errors import APIError, bad_request
from atlas.server.generate import create_chat_completion, create_completion
from atlas.server.metrics import ServerMetrics
from atlas.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from atlas.server.security import (  # noqa: F401 (the size limits are re-exported for tests)
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    OPEN_PATHS,
    PROBE_PATHS,
    GateMiddleware,
    Lifecycle,
    LimitsMiddleware,
    RequestLimits,
)
from atlas.server.serving import ServingContext

log = structlog.get_logger(__name__)
JSON_TYPES = ("application/json",)  # with any parameters (charset=utf-8)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class ClientGone(Exception):
    """The client closed its connection before its body arrived: a normal event, answered to nobody."""


async def read_json(request: Request) -> Any:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in JSON_TYPES:
        shown = repr(media_type[:64]) if media_type else "none"
        raise APIError(415, f"content-type: send 'application/json' (got {shown})", param="content-type",
                       code="unsupported_media_type")
    try:
        body = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    if not body:
        raise bad_request("the request body is empty; send a JSON object", code="invalid_body")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8", code="invalid_body") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise bad_request("the request body is not valid JSON", code="invalid_json") from None


def _special_text(tokenizer: Any, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False) or None
    except Exception:  # a tokenizer that cannot name the id: report nothing rather than a guess
        return None


def tokenizer_card(ctx: ServingContext) -> dict[str, Any]:
    tok = ctx.tokenizer
    eos_ids = list(getattr(tok, "eos_token_ids", ()) or ())
    template = ctx.chat_template
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": template.eos_token or _special_text(tok, eos_ids[0] if eos_ids else None),
        "eos_token_ids": eos_ids,
        "bos_token": template.bos_token or None,
        "pad_token": None,
        "chat_template": template.source,
        "model_max_length": ctx.max_seq_len,
        "vocab_size": ctx.vocab_size,
    }


def create_app(
    engine_loop: EngineLoop,
    *,
    model_name: str | None = None,
    chat_template: ChatTemplate | None = None,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    lifecycle: Lifecycle | None = None,
    enable_fault_injection: bool = False,
    default_seed: int | None = None,
    metrics_auth: bool = False,
) -> FastAPI:
    """Build the app around a started EngineLoop. The caller owns the loop (starts and stops it); `lifecycle`
    is shared with the server that drains on shutdown. `default_seed`: requests without a seed draw theirs from
    this seed's sequence (else a fresh random one); `metrics_auth`: /metrics needs the key too (else open)."""
    engine = engine_loop.engine
    name = model_name or engine.model_name
    capacities = getattr(engine, "capacities", None)
    ctx = ServingContext(
        engine_loop=engine_loop,
        model_name=name,
        tokenizer=engine.tokenizer,
        chat_template=chat_template or ChatTemplate(),
        max_seq_len=int(getattr(capacities, "max_seq_len", 0) or 0),
        vocab_size=getattr(engine.tokenizer, "vocab_size", None),
        fault_injection=enable_fault_injection,
        seeds=None if default_seed is None else random.Random(default_seed),
    )
    lifecycle = lifecycle or Lifecycle()
    metrics = ServerMetrics(engine_loop, name, lifecycle)
    engine_loop.observer = metrics

    app = FastAPI(title="Atlas", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.engine_loop = engine_loop
    app.state.lifecycle = lifecycle
    # added last = outermost: limits first, then the dead/draining/auth gate, then the routes
    app.add_middleware(GateMiddleware, engine_loop=engine_loop, api_key=api_key, lifecycle=lifecycle,
                       open_paths=PROBE_PATHS if metrics_auth else OPEN_PATHS)
    app.add_middleware(LimitsMiddleware, limits=limits or RequestLimits(), counter=lifecycle.in_flight)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _exc: ClientGone) -> Response:
        # no traceback, no body, no headers: one debug line, and the connection goes
        log.debug("client disconnected before its body arrived", path=request.url.path)
        return Response(status_code=499, headers={"connection": "close"})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        return APIError(exc.status_code, detail, code=str(exc.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, _exc: RequestValidationError) -> JSONResponse:
        return bad_request("the request is malformed").response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # the detail (and its stack) goes to the log, never to the client
        log.error("unhandled error in a route", error=type(exc).__name__, exc_info=exc)
        return APIError(500, "internal server error", code="internal_error").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}  # GateMiddleware answers 503 once the engine is dead

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)  # vLLM's and SageMaker's liveness probe: 200, empty

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "atlas",
                "max_model_len": ctx.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request, parse_body(CompletionRequest, await read_json(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_json(request))
        return await create_chat_completion(ctx, request, body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await read_json(request))
        ctx.check_model(body.model)
        if body.messages is not None:
            tokens = ctx.encode_chat(body.messages, body.add_generation_prompt)
        else:
            tokens = ctx.encode(body.prompt or "", param="prompt")
        return {"count": len(tokens), "max_model_len": ctx.max_seq_len, "tokens": tokens}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        # what lm-evaluation-harness's remote tokenizer reads (as vLLM serves it): special tokens as text and
        # the chat template; /tokenize and /detokenize do the rest
        return tokenizer_card(ctx)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await read_json(request))
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, param="tokens")
        return {"prompt": ctx.decode(body.tokens)}

    if enable_fault_injection:

        @app.post("/debug/inject_fault")
        async def inject_fault(request: Request) -> dict[str, str]:
            body = await read_json(request)
            kind = body.get("kind") if isinstance(body, dict) else None
            if kind not in ("step_error", "fatal", "trace_full"):
                raise bad_request("kind: must be 'step_error', 'fatal' or 'trace_full'", param="kind")
            request_id = body.get("request_id")
            if request_id is not None and not isinstance(request_id, str):
                raise bad_request("request_id: must be a string", param="request_id")
            engine_loop.inject_fault(kind, request_id)
            return {"status": "injected", "kind": kind}

    return app
