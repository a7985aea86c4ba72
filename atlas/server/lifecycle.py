"""The uvicorn server around the app: its bounds, and an honest shutdown.

On SIGTERM/SIGINT (or `should_exit`): new requests get 503 `shutting_down` at once; requests in flight get
`shutdown_grace` seconds to finish; what still runs then is cancelled in the engine (RequestCancelled: the
trace records each outcome) and ends with an SSE error event + `[DONE]` or a JSON 503; the trace is
committed and closed with its run-end marker; the process exits 0. uvicorn's own behaviour was to cancel
the handlers 2 s in (streams cut mid-body, no outcome in the trace) and to re-raise the signal (exit -15/130).
A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from types import FrameType
from typing import Any

import attrs
import structlog
import uvicorn

from atlas.server.connections import ConnectionLimits, bounded_protocol, default_max_connections
from atlas.server.engine_loop import EngineLoop
from atlas.server.logconfig import install_stdlib_redaction
from atlas.server.security import Lifecycle, RequestLimits

log = structlog.get_logger(__name__)

HANDLER_WRAP_UP_S = 5.0  # after the engine ended the rest: time for their handlers to write the ending
# asyncio accepts up to `backlog` connections in one callback: with 4096, a flood's accept burst held the event
# loop for ~1 s per iteration and a /health that needs several iterations took 8.7 s (20,000 idle connections,
# loaded 2-core machine). So the accept batch is small and the kernel's queue is set large afterwards.
ACCEPT_BATCH = 128
LISTEN_QUEUE = 4096


@attrs.frozen
class ServerSettings:
    """Every bound of the HTTP side (the `atlas serve` flags of the same names)."""

    max_connections: int | None = None  # None: the fd limit (raised to its hard limit) less a reserve
    header_timeout: float = 10.0
    # An idle kept-alive connection is closed after this; it must come after the client pools' own expiry
    # (httpx and the OpenAI SDK 5 s, aiohttp 15 s, undici 4 s), else a client sends its next request on a
    # connection the server is closing and gets a reset. At 5 s (uvicorn's default) the load test failed with
    # httpx.ReadError: the server closed a connection idle 5.02 s by its clock that the client took from its
    # pool at 4.893 s by its own (the client's clock starts when it has read the response; on a loaded 2-core
    # box that lagged 0.13 s). 75 s as nginx's; idle connections cost an fd each and the cap evicts them.
    keep_alive_timeout: float = 75.0
    shutdown_grace: float = 30.0
    requests: RequestLimits = RequestLimits()

    def resolved_max_connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()


def uvicorn_config(app: Any, host: str, port: int, log_level: str, settings: ServerSettings) -> uvicorn.Config:
    limits = ConnectionLimits(settings.resolved_max_connections(), settings.header_timeout)
    protocol = bounded_protocol(limits)
    lifecycle = getattr(getattr(app, "state", None), "lifecycle", None)
    if lifecycle is not None:  # /metrics reads the connection counts
        lifecycle.connections = protocol.registry
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # h11 bounds what it buffers while parsing headers: a backstop above the app's own 431 limit
        http=protocol,
        h11_max_incomplete_event_size=4 * settings.requests.max_header_bytes,
        lifespan="off",
        log_level=log_level,
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout)),
        timeout_graceful_shutdown=int(HANDLER_WRAP_UP_S),
        access_log=False,
        backlog=ACCEPT_BATCH,
    )
    install_stdlib_redaction()  # uvicorn.Config configured the stdlib loggers just now
    return config


class AtlasServer(uvicorn.Server):
    """uvicorn.Server with the drain above; the signal is handled, never re-raised."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, lifecycle: Lifecycle,
                 shutdown_grace: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.lifecycle = lifecycle
        self.shutdown_grace = shutdown_grace
        self.exit_signal: int | None = None
        self.drain_report: dict[str, Any] = {}

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded for re-raising (uvicorn's capture_signals would kill the process by it after shutdown)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.exit_signal = sig
            self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            for listening in server.sockets or ():
                dup = socket.fromfd(listening.fileno(), listening.family, listening.type)
                try:
                    dup.listen(LISTEN_QUEUE)  # the kernel's queue (the socket's, not the fd's), beyond the batch
                finally:
                    dup.close()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.drain()
        await super().shutdown(sockets)
        await asyncio.to_thread(self.engine_loop.stop)  # the trace's last commit and its run-end marker

    async def drain(self) -> None:
        lifecycle, engine_loop = self.lifecycle, self.engine_loop
        lifecycle.draining = True  # the listener stays open: newcomers learn why (503) instead of a refusal
        engine_loop.begin_shutdown()
        started = time.monotonic()
        live = engine_loop.live_requests
        log.info("shutting down: admitting nothing more", signal=_signal_name(self.exit_signal),
                 in_flight=live, grace_s=self.shutdown_grace)
        deadline = started + self.shutdown_grace
        while engine_loop.live_requests and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        cut = engine_loop.live_requests
        if cut and engine_loop.dead is None:
            detail = f"the server is shutting down: the request did not finish within the {self.shutdown_grace:g} s grace"
            await asyncio.to_thread(engine_loop.end_all, detail)
        wrap_up = time.monotonic() + HANDLER_WRAP_UP_S
        while lifecycle.in_flight.busy and time.monotonic() < wrap_up and not self.force_exit:
            await asyncio.sleep(0.02)  # the handlers write their endings ([DONE], the JSON 503)
        self.drain_report = {"in_flight": live, "finished_in_grace": live - cut, "ended_by_shutdown": cut,
                             "seconds": round(time.monotonic() - started, 3)}
        log.info("drained", **self.drain_report)


def _signal_name(sig: int | None) -> str:
    if sig is None:
        return "none"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
