"""The engine loop: the one thread that owns the Engine.

The Engine is single-threaded, so HTTP handlers never call it. They put commands (arrival, cancel, fault)
on a thread-safe inbox and read their request's RequestOutputs from an asyncio queue that this thread
fills through `loop.call_soon_threadsafe`. Between two engine steps the thread drains the inbox, so every
arrival is admitted at a definite step, which the engine stamps into the trace.

Wall-clock time here feeds metrics only (TTFT, ITL, latency); no decision reads it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal, Protocol

import attrs
import structlog

from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.errors import EngineDead
from atlas.sampling.params import SamplingParams

log = structlog.get_logger(__name__)

FaultKind = Literal["step_error", "fatal"]


class LatencyObserver(Protocol):
    """Where the loop reports per-request timings (the server's Prometheus metrics)."""

    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_finished(self, reason: FinishReason | None, seconds: float) -> None: ...


@attrs.frozen
class _Arrival:
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
class _Cancel:
    request_id: str


@attrs.frozen
class _Fault:
    kind: FaultKind
    request_id: str | None


class _Stop:
    pass


class EngineStopped(RuntimeError):
    """The engine loop was stopped (the server is shutting down); the engine itself is fine."""


@attrs.frozen
class _Died:
    """Put on every live request's queue when the engine dies, or (fatal=False) when the loop stops."""

    detail: str
    fatal: bool = True


class _Mailbox:
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
class _Subscriber:
    mailbox: _Mailbox
    outputs: asyncio.Queue[Any]
    arrived_at: float
    last_output_at: float | None = None


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the handler gave up waiting (its client went away)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class RequestStream:
    """One admitted request's outputs, as its HTTP handler reads them."""

    def __init__(self, request_id: str, outputs: asyncio.Queue[Any], owner: EngineLoop) -> None:
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
            if isinstance(batch[-1], _Died):
                self.finished = True
                raise (EngineDead if batch[-1].fatal else EngineStopped)(batch[-1].detail)
            if batch[-1].finished:
                self.finished = True
            yield batch

    @staticmethod
    def _ends(item: Any) -> bool:
        return isinstance(item, _Died) or item.finished

    def cancel(self) -> None:
        """The client went away: cancel the request in the engine (an input event) unless it ended."""
        if not self.finished:
            self.finished = True
            self._owner.cancel(self.request_id)


class EngineLoop:
    """Runs `engine.step()` in a dedicated thread and routes each RequestOutput to its request."""

    def __init__(self, engine: Any, *, observer: LatencyObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._force_step = False  # a fatal fault acts at the next step, even when idle
        self._lock = threading.Lock()  # orders "dead" or "stopped" against enqueued arrivals
        self._dead: str | None = None
        self._stopped = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        self.latest_stats: Any = None  # engine.stats() after the last step; read by /metrics
        self.steps_run = 0

    # -- lifecycle (any thread) -------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="atlas-engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step and close the engine (flushing its trace). Idempotent."""
        self._inbox.put(_Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def dead(self) -> str | None:
        """None while alive; the fault's description once the engine is dead."""
        return self._dead

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(detail)` from the engine thread when the engine dies (e.g. to stop the server)."""
        self._death_callbacks.append(callback)

    # -- requests (called from the asyncio side) --------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        inject_fault: FaultKind | None = None,
        stream: bool = False,
        prompt_logprobs: int | None = None,
    ) -> RequestStream:
        """Admit a request. Raises AdmissionError, QueueFull, EngineDead or EngineStopped before anything
        is streamed."""
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[None] = loop.create_future()
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        arrival = _Arrival(
            request_id, tuple(prompt_token_ids), params, loop, admitted, outputs, time.perf_counter(), inject_fault,
            stream, prompt_logprobs,
        )
        with self._lock:
            if self._dead is not None:
                raise EngineDead(self._dead)
            if self._stopped:
                raise EngineStopped("the server is shutting down")
            self._inbox.put(arrival)
        try:
            await admitted
        except asyncio.CancelledError:
            self.cancel(request_id)  # admitted or not, it must not run for nobody
            raise
        return RequestStream(request_id, outputs, self)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))

    def inject_fault(self, kind: FaultKind, request_id: str | None = None) -> None:
        self._inbox.put(_Fault(kind, request_id))

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self._force_step or self.engine.has_unfinished()
                if not self._drain_inbox(block=not busy):
                    break
                if self._force_step or self.engine.has_unfinished():
                    self._force_step = False
                    outputs = self.engine.step()
                    self.steps_run += 1
                    # stats first: a client that has its answer reads /metrics that already count it
                    self._refresh_stats()
                    self._dispatch(outputs)
                else:
                    self._refresh_stats()
                time.sleep(0)  # hand the GIL to the HTTP thread between steps, however fast they are
        except EngineDead as exc:
            self._die(str(exc) or "fatal fault")
        except Exception as exc:  # a bug outside the engine's own error handling: its state is unknown
            log.exception("engine loop crashed")
            self._die(f"engine loop crashed: {type(exc).__name__}")
        finally:
            self._release_everyone(_Died("the server is shutting down", fatal=False))
            try:
                self.engine.close()
            except Exception:
                log.exception("engine close failed")

    def _drain_inbox(self, *, block: bool) -> bool:
        """Apply every waiting command; wait for one first when the engine is idle. False on stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Arrival):
            self._admit(command)
        elif isinstance(command, _Cancel):
            if command.request_id in self._subscribers:
                self.engine.cancel(command.request_id)
        elif isinstance(command, _Fault):
            self.engine.inject_fault(command.kind, command.request_id)
            self._force_step = True

    def _admit(self, arrival: _Arrival) -> None:
        try:
            extra = {} if arrival.prompt_logprobs is None else {"prompt_logprobs": arrival.prompt_logprobs}
            self.engine.add_request(arrival.request_id, arrival.prompt_token_ids, arrival.params,
                                    stream=arrival.stream, **extra)
        except EngineDead as exc:
            arrival.loop.call_soon_threadsafe(_settle, arrival.admitted, exc)
            raise
        except Exception as exc:  # AdmissionError, QueueFull: the handler answers 400 / 503
            arrival.loop.call_soon_threadsafe(_settle, arrival.admitted, exc)
            return
        mailbox = self._mailboxes.get(arrival.loop)
        if mailbox is None:
            mailbox = self._mailboxes[arrival.loop] = _Mailbox(arrival.loop)
        self._subscribers[arrival.request_id] = _Subscriber(mailbox, arrival.outputs, arrival.arrived_at)
        if arrival.inject_fault is not None:  # test hook, only reachable when the server enables it
            self.engine.inject_fault(arrival.inject_fault, arrival.request_id)
            self._force_step = True
        arrival.loop.call_soon_threadsafe(_settle, arrival.admitted, None)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            sub = self._subscribers.get(out.request_id)
            if sub is None:
                continue
            if out.new_token_ids and self.observer is not None:
                if sub.last_output_at is None:
                    self.observer.on_first_token(now - sub.arrived_at)
                else:
                    self.observer.on_inter_token(now - sub.last_output_at)
            if out.new_token_ids:
                sub.last_output_at = now
            if out.finished:
                del self._subscribers[out.request_id]
                if self.observer is not None:
                    self.observer.on_finished(out.finish_reason, now - sub.arrived_at)
            sub.mailbox.post(sub.outputs, out)

    def _refresh_stats(self) -> None:
        try:
            self.latest_stats = self.engine.stats()
        except EngineDead:
            raise
        except Exception:
            log.exception("engine stats failed")

    def _release_everyone(self, ending: _Died) -> None:
        """End every live request and refuse every queued arrival, so no handler waits forever."""
        with self._lock:
            self._stopped = True
        for sub in self._subscribers.values():
            sub.mailbox.post(sub.outputs, ending)
        self._subscribers.clear()
        refusal = EngineDead(ending.detail) if ending.fatal else EngineStopped(ending.detail)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Arrival):
                try:
                    command.loop.call_soon_threadsafe(_settle, command.admitted, refusal)
                except RuntimeError:  # that event loop has closed
                    pass

    def _die(self, detail: str) -> None:
        with self._lock:
            self._dead = detail
        log.error("engine dead", detail=detail)
        self._release_everyone(_Died(detail))
        for callback in self._death_callbacks:
            try:
                callback(detail)
            except Exception:
                log.exception("death callback failed")
