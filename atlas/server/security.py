"""Pure-ASGI guards in front of every route: size and time limits, the in-flight bound, the dead, draining and
auth gate.

They answer before any handler runs, in the OpenAI error shape, and never echo what the client sent. A 413,
408 or 431 closes the connection (`connection: close`): what the client still sends is never read.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import attrs
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atlas.server.errors import APIError, engine_dead, shutting_down

# answer without the API key, as vLLM's do: probes (a load balancer's has no key), the version, and /metrics (a
# Prometheus scrape configured for vLLM sends none; `atlas serve --metrics-auth` keeps it behind the key)
PROBE_PATHS = frozenset({"/health", "/ping", "/version"})
OPEN_PATHS = PROBE_PATHS | {"/metrics"}
UNBOUNDED_PATHS = OPEN_PATHS  # probes and scrapes: never refused for being busy
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt max_seq_len allows, far below harm
DEFAULT_MAX_HEADER_BYTES = 16 << 10


@attrs.frozen
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    # seconds from a request's headers to its body's last byte: a slow body is cut (408), however it trickles
    body_timeout: float = 30.0
    # requests in the app at once (probes excepted), above which a 503; a connection carries one at a time,
    # so this bounds the work, not the sockets (connections.py caps those)
    max_concurrency: int = 4096


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large",
                         close=True)


class BodyTimeout(APIError):
    def __init__(self, limit: float) -> None:
        super().__init__(408, f"the request body did not arrive within the body timeout of {limit:g} s",
                         code="body_timeout", close=True)


class LimitsMiddleware:
    """Refuses oversized headers (431) and bodies (413, declared or not), cuts slow bodies (408), bounds the
    requests in flight (503), and counts them (`in_flight`: shutdown waits for it to reach zero)."""

    def __init__(self, app: ASGIApp, *, limits: RequestLimits, counter: InFlight) -> None:
        self.app = app
        self.limits = limits
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.counter.value += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.counter.value -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.limits
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if header_bytes > limits.max_header_bytes:
            error = APIError(431, f"request headers exceed the limit of {limits.max_header_bytes} bytes",
                             code="headers_too_large", close=True)
            await error.response()(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length":
                if not value.isdigit() or int(value) > limits.max_body_bytes:
                    await BodyTooLarge(limits.max_body_bytes).response()(scope, receive, send)
                    return
        if scope["path"] in UNBOUNDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.counter.busy >= limits.max_concurrency:
            error = APIError(503, f"too many requests in flight (max_concurrency {limits.max_concurrency}); "
                             "retry later", code="server_busy")
            await error.response()(scope, receive, send)
            return
        self.counter.busy += 1
        try:
            await self.app(scope, _BodyReader(receive, limits), send)
        finally:
            self.counter.busy -= 1


class _BodyReader:
    """`receive` with the body's size limit and deadline; past the body's end it is the plain receive."""

    def __init__(self, receive: Receive, limits: RequestLimits) -> None:
        self._receive = receive
        self._limits = limits
        self._deadline = time.monotonic() + limits.body_timeout
        self._received = 0
        self._complete = False

    async def __call__(self) -> Message:
        if self._complete:
            return await self._receive()
        remaining = self._deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            raise BodyTimeout(self._limits.body_timeout) from None
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limits.max_body_bytes:  # a chunked body that kept going
                raise BodyTooLarge(self._limits.max_body_bytes)
            if not message.get("more_body", False):
                self._complete = True
        else:
            self._complete = True
        return message


@attrs.define
class InFlight:
    """Requests inside the app: all of them (`value`), and those the concurrency limit counts (`busy`)."""

    value: int = 0
    busy: int = 0


class GateMiddleware:
    """Once the engine is dead every route answers 503; while the server shuts down every new request does
    (`shutting_down`); otherwise every route but `open_paths` needs the key."""

    def __init__(self, app: ASGIApp, *, engine_loop: Any, api_key: str | None, lifecycle: Lifecycle,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.engine_loop = engine_loop
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.lifecycle = lifecycle
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.engine_loop.dead is not None:
            await engine_dead().response()(scope, receive, send)
            return
        if self.lifecycle.draining:
            response = shutting_down().response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in self.open_paths:
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


@attrs.define
class Lifecycle:
    """What the app knows of the server's shutdown: `draining` once a signal came (new requests get 503)."""

    draining: bool = False
    in_flight: InFlight = attrs.Factory(InFlight)
    connections: Any = None  # the connection registry (connections.py), once a server runs the app
