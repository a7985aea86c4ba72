"""What crosses the engine loop's threads (atlas.server.engine_loop): the commands HTTP handlers put on its
inbox, the mailboxes that carry outputs back to each event loop, the routing of a step's outputs to their
requests (with the timings it reports), and the stream a handler reads its request from.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol

import attrs

from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.errors import EngineDead
from atlas.sampling.params import SamplingParams

FaultKind = Literal["step_error", "fatal"]


class LatencyObserver(Protocol):
    """Where the loop reports per-request timings (the server's Prometheus metrics)."""

    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_finished(self, reason: FinishReason | None, seconds: float) -> None: ...


class Canceller(Protocol):
    """Where a stream sends its cancel (the EngineLoop)."""

    def cancel(self, request_id: str) -> None: ...


@attrs.frozen
class Arrival:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future[None]
    outputs: asyncio.Queue[Any]
    arrived_at: float
    inject_fault: FaultKind | None = None
    stream: bool = False  # tokens handed out as sampled (SSE); otherwise held back until the request ends
    prompt_logprobs: int | None = None  # Engine.add_request's: prompt-token logprobs in the first output


@attrs.frozen
class Cancel:
    request_id: str


@attrs.frozen
class Fault:
    kind: FaultKind
    request_id: str | None


class Stop:
    pass


@attrs.frozen
class EndAll:
    """Shutdown past the grace: cancel every live request in the engine (recorded), commit, tell each 503."""

    detail: str
    done: threading.Event


@attrs.frozen
class TraceFailed:
    """Posted by the trace writer's thread when a commit failed: wakes an idle engine thread to die."""

    detail: str


@attrs.frozen
class FullDisk:
    """Tests: the trace store fills up at its next commit (EngineLoop.inject_fault('trace_full'))."""


class EngineStopped(RuntimeError):
    """The engine loop was stopped (the server is shutting down); the engine itself is fine."""


@attrs.frozen
class Died:
    """Put on every live request's queue when the engine dies, or (fatal=False) when the loop stops."""

    detail: str
    fatal: bool = True


class Mailbox:
    """Items bound for one event loop, with at most one wakeup in flight.

    A fast engine produces outputs faster than one callback each could be run: a wakeup per output
    starved the event loop (a client disconnect went unnoticed for seconds at 25k steps/s).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._lock = threading.Lock()
        self._wakeup_pending = False

    def post(self, outputs: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            self._items.append((outputs, item))
            if self._wakeup_pending:
                return
            self._wakeup_pending = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # that event loop has closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._wakeup_pending = False
        for outputs, item in items:
            outputs.put_nowait(item)


@attrs.define
class Subscriber:
    mailbox: Mailbox
    outputs: asyncio.Queue[Any]
    arrived_at: float
    last_output_at: float | None = None


def settle_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the handler gave up waiting (its client went away)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def acknowledge(arrival: Arrival, error: BaseException | None) -> None:
    """Settle an arrival's `admitted` future from any thread (its event loop may have closed: nobody waits)."""
    try:
        arrival.loop.call_soon_threadsafe(settle_future, arrival.admitted, error)
    except RuntimeError:
        pass


class RequestStream:
    """One admitted request's outputs, as its HTTP handler reads them."""

    def __init__(self, request_id: str, outputs: asyncio.Queue[Any], owner: Canceller) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._owner = owner
        self.finished = False

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Every output that has arrived, as one list per wait: a slow reader catches up in one chunk."""
        while not self.finished:
            batch = [await self._outputs.get()]
            while not self._outputs.empty() and not self._ends(batch[-1]):
                batch.append(self._outputs.get_nowait())
            if isinstance(batch[-1], Died):
                self.finished = True
                raise (EngineDead if batch[-1].fatal else EngineStopped)(batch[-1].detail)
            if batch[-1].finished:
                self.finished = True
            yield batch

    @staticmethod
    def _ends(item: Any) -> bool:
        return isinstance(item, Died) or item.finished

    def cancel(self) -> None:
        """The client went away: cancel the request in the engine (an input event) unless it ended."""
        if not self.finished:
            self.finished = True
            self._owner.cancel(self.request_id)


def dispatch(outputs: Sequence[RequestOutput], subscribers: dict[str, Subscriber], lock: threading.Lock,
             observer: LatencyObserver | None) -> None:
    """Route each output to its request's stream (a finished one's subscriber goes), reporting its timings."""
    now = time.perf_counter()
    for out in outputs:
        with lock:
            sub = subscribers.get(out.request_id)
            if sub is not None and out.finished:
                del subscribers[out.request_id]
        if sub is None:
            continue
        if out.new_token_ids and observer is not None:
            if sub.last_output_at is None:
                observer.on_first_token(now - sub.arrived_at)
            else:
                observer.on_inter_token(now - sub.last_output_at)
        if out.new_token_ids:
            sub.last_output_at = now
        if out.finished and observer is not None:
            observer.on_finished(out.finish_reason, now - sub.arrived_at)
        sub.mailbox.post(sub.outputs, out)
