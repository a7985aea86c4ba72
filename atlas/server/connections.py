"""Connection bounds below the app: a connection cap, and a deadline for a request's headers.

uvicorn (h11) holds a connection for as long as the client keeps it: one that never sends a byte, or sends
its headers a byte at a time, is held forever (its keep-alive timer is reset by every byte received), and
20,200 of them reached the fd limit and took /health and the accept loop down with them. This protocol:

- caps open connections (`max_connections`, derived from the fd limit by default). At the cap a newcomer gets
  a 503 and a close; the connections already open are never closed to make room (evicting the longest idle one
  closed legitimate just-opened connections before their request arrived, and kept-alive ones under their
  clients' next request: at a cap of 1000 under a flood, /health answered 2 of 8). The header deadline frees
  the slots of connections that never send a request.
- writes the 503 and then closes only once the client has sent something, or closed its side, or after
  REFUSE_LINGER_S: a close with the client's request unread resets the connection, and a reset can cost the
  client the 503 it was about to read.
- gives a request's headers `header_timeout` seconds, however slowly they trickle in: from the moment a new
  connection opens, and on a kept-alive connection from the first byte of its next request; then a 408 and
  a close (enforced by a sweep that closes the oldest first, a bounded number per event-loop turn). A
  kept-alive connection that sends nothing is uvicorn's keep-alive timer's (`keep_alive_timeout`), never the
  header deadline's: a server that closes an idle connection before the client's pool expires it races the
  client's next request on it (the request meets a reset: httpx.ReadError), so the idle close must come last.

The body's own deadline, the in-flight request limit and the 413 are the ASGI middleware's (security.py).
"""

from __future__ import annotations

import asyncio
import resource
from collections import OrderedDict
from typing import Any, ClassVar

import attrs
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)

FD_RESERVE = 256  # fds kept free of connections: the trace store, model files, refused connections' linger

_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"message": "too many open connections, all with a request in flight; retry later", '
              b'"type": "service_unavailable", "param": null, "code": "too_many_connections"}}')
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = (b'{"error": {"message": "the request headers did not arrive within the header timeout", '
                 b'"type": "invalid_request_error", "param": null, "code": "header_timeout"}}')


@attrs.frozen
class ConnectionLimits:
    max_connections: int
    header_timeout: float  # seconds for a request's headers: from the connection's opening, or the next first byte


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft fd limit to its hard limit (allowed without privileges); (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a platform that refuses: keep the soft limit
            pass
    return soft, hard


def default_max_connections() -> int:
    soft, _hard = raise_fd_limit()
    return max(64, soft - FD_RESERVE)


# Deadlines are enforced by one sweep every SWEEP_S closing at most SWEEP_MAX connections, not by a timer per
# connection: 20,000 connections opened in one burst time out in one burst, and their timers all ran in one
# event-loop iteration (a /health caught behind them took 2.7 s). Oldest first, since the deadlines are in the
# order the deadlines started.
SWEEP_S = 0.05
SWEEP_MAX = 200


REFUSE_LINGER_S = 0.5  # a refused connection's 503 is written, then the close waits this long at most


class _Registry:
    """The server's connections whose header deadline runs, each with the time it started (the sweep closes
    from the front), and the counts /metrics reports."""

    def __init__(self) -> None:
        self.deadlines: OrderedDict[BoundedH11Protocol, float] = OrderedDict()
        self.open = 0
        self.refused = 0
        self.header_timeouts = 0
        self._sweeping: asyncio.TimerHandle | None = None

    def watch(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        if self._sweeping is None:
            self._sweeping = loop.call_later(SWEEP_S, self._sweep, loop, timeout)

    def _sweep(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._sweeping = None
        expired = loop.time() - timeout
        for _ in range(SWEEP_MAX):
            oldest = next(iter(self.deadlines.items()), None)
            if oldest is None or oldest[1] > expired:
                break
            oldest[0]._headers_late()
        if self.deadlines:
            self.watch(loop, timeout)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the header deadline. Build one class per server with
    `bounded_protocol(limits)`: uvicorn instantiates the class itself."""

    limits: ClassVar[ConnectionLimits]
    registry: ClassVar[_Registry]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._received_any = False
        self._counted = False
        self._refused: asyncio.TimerHandle | None = None  # a connection refused at the cap: its close timer

    # -- the cap ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        reg = self.registry
        if reg.open >= self.limits.max_connections:  # the open ones keep their slots: this one is refused
            reg.refused += 1
            transport.write(_BUSY_503 % (len(_BUSY_BODY), _BUSY_BODY))
            self._refused = self.loop.call_later(REFUSE_LINGER_S, self._end_refused)
            return
        reg.open += 1
        self._counted = True
        self._wait_for_request()
        self._start_deadline()  # a new connection has header_timeout for its first request's headers

    def _end_refused(self) -> None:
        if self._refused is not None:
            self._refused.cancel()
        if not self.transport.is_closing():
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self._refused is not None:
            self._end_refused()
            return None
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused is not None:
            self._refused.cancel()
        self._forget()
        super().connection_lost(exc)

    def _forget(self) -> None:
        if self._counted:
            self._counted = False
            self.registry.open -= 1
        self.registry.deadlines.pop(self, None)

    def _close(self, why: str) -> None:
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    # -- idle or busy -------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _wait_for_request(self) -> None:
        """No request in flight. Its header deadline starts with the next byte (or at the opening, for a new
        connection); until then an idle kept-alive connection is the keep-alive timer's."""
        if not self._counted:
            return
        self.registry.deadlines.pop(self, None)
        self._received_any = False

    def _start_deadline(self) -> None:
        """The header deadline runs from now (the registry's sweep enforces it)."""
        if not self._counted or self in self.registry.deadlines:
            return
        self.registry.deadlines[self] = self.loop.time()
        self.registry.watch(self.loop, self.limits.header_timeout)

    def _request_started(self) -> None:
        self.registry.deadlines.pop(self, None)

    def _headers_late(self) -> None:
        if self._busy() or self.transport.is_closing():
            self.registry.deadlines.pop(self, None)
            return
        self.registry.header_timeouts += 1
        if self._received_any:  # a partial request: say why; a connection that sent nothing just closes
            self.transport.write(_TIMEOUT_408 % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
        self._close("header timeout")

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:  # the request of a refused connection: read (so the close is clean), dropped
            self._end_refused()
            return
        was_busy = self._busy()
        self._received_any = True
        if not was_busy:  # the first byte of a request: its headers' deadline (a no-op if it already runs)
            self._start_deadline()
        super().data_received(data)
        if not was_busy and self._busy():
            self._request_started()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if self._busy():
            self._request_started()
        elif not self.transport.is_closing():
            self._wait_for_request()


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """A protocol class bound to one server's limits and its own registry of connections."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits, "registry": _Registry()})
