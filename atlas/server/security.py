"""Pure-ASGI guards in front of every route: size limits, the dead-engine gate, the API key.

They answer before any handler runs, in the OpenAI error shape, and never echo what the client sent.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atlas.server.errors import APIError, engine_dead

OPEN_PATHS = frozenset({"/health"})  # answer without the API key (a load balancer's probe has none)


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")


class LimitsMiddleware:
    """Refuses oversized headers (431) and bodies (413), whether or not Content-Length is declared."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if header_bytes > self.max_header_bytes:
            error = APIError(431, f"request headers exceed the limit of {self.max_header_bytes} bytes",
                             code="headers_too_large")
            await error.response()(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length":
                if not value.isdigit() or int(value) > self.max_body_bytes:
                    await BodyTooLarge(self.max_body_bytes).response()(scope, receive, send)
                    return
        received = 0
        limit = self.max_body_bytes

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body that kept going: the handler's read raises
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted_receive, send)


class GateMiddleware:
    """Once the engine is dead every route answers 503; otherwise every route but /health needs the key."""

    def __init__(self, app: ASGIApp, *, engine_loop: Any, api_key: str | None) -> None:
        self.app = app
        self.engine_loop = engine_loop
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.engine_loop.dead is not None:
            await engine_dead().response()(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            # constant time, so the key cannot be guessed a byte at a time from response timings
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key")
                response = error.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
