"""The engine loop: the one thread that owns the Engine.

The Engine is single-threaded, so HTTP handlers never call it. They put commands (arrival, cancel, fault)
on a thread-safe inbox and read their request's RequestOutputs from an asyncio queue that this thread
fills through `loop.call_soon_threadsafe`. Between two engine steps the thread drains the inbox, so every
arrival is admitted at a definite step, which the engine stamps into the trace.

Write-ahead: a step's events are committed to the trace before any of that step's outputs reach a client,
so every byte a client received is backed by events on disk; and an arrival is acknowledged (`submit`
returns, so the handler may send a status line) only once the commit that holds its RequestArrived is done:
a request that got any byte of a response is in the trace, even after a kill -9. By default the commit runs on the trace
writer's thread while this thread computes the next step, and the outputs are released from there once
their commit is done (`commit="thread"`); `commit="inline"` commits on this thread before releasing. A
failed commit (a full disk) ends the engine: its outputs are never released, every request ends with 503.

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
CommitMode = Literal["thread", "inline"]


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


@attrs.frozen
class _EndAll:
    """Shutdown past the grace: cancel every live request in the engine (recorded), commit, tell each 503."""

    detail: str
    done: threading.Event


@attrs.frozen
class _TraceFailed:
    """Posted by the trace writer's thread when a commit failed: wakes an idle engine thread to die."""

    detail: str


@attrs.frozen
class _FullDisk:
    """Tests: the trace store fills up at its next commit (EngineLoop.inject_fault('trace_full'))."""


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


def _acknowledge(arrival: _Arrival, error: BaseException | None) -> None:
    """Settle an arrival's `admitted` future from any thread (its event loop may have closed: nobody waits)."""
    try:
        arrival.loop.call_soon_threadsafe(_settle, arrival.admitted, error)
    except RuntimeError:
        pass


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

    def __init__(self, engine: Any, *, observer: LatencyObserver | None = None, commit: CommitMode = "thread"
                 ) -> None:
        self.engine = engine
        self.observer = observer
        self.commit_mode = commit
        self._sink = getattr(engine, "trace_sink", None)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._sub_lock = threading.Lock()  # the engine thread admits, the writer thread releases outputs
        # one commit outstanding at most: step N commits while step N+1 computes, never more behind (a kill -9
        # loses at most those two steps, neither of which any client has seen; memory stays bounded)
        self._commit_slot = threading.Semaphore(1)
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._force_step = False  # a fatal fault acts at the next step, even when idle
        self._lock = threading.Lock()  # orders "dead" or "stopped" against enqueued arrivals
        self._dead: str | None = None
        self._stopped = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        # admitted arrivals whose RequestArrived is not committed yet (the engine thread's): acknowledged by the
        # release of the next commit, which holds their events
        self._unacked: list[_Arrival] = []
        self.latest_stats: Any = None  # engine.stats() after the last committed step; read by /metrics
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

    def begin_shutdown(self) -> None:
        """Admit nothing more (EngineStopped: a 503 `shutting_down`); live requests go on."""
        with self._lock:
            self._stopped = True

    @property
    def live_requests(self) -> int:
        """Admitted requests whose final output has not been released yet."""
        with self._sub_lock:
            return len(self._subscribers)

    def end_all(self, detail: str, timeout: float = 10.0) -> bool:
        """Cancel every live request in the engine (RequestCancelled in the trace), commit, and end each one's
        stream with EngineStopped(detail). Blocks until done; False if the engine thread did not answer."""
        done = threading.Event()
        self._inbox.put(_EndAll(detail, done))
        if self._thread is None or not self._thread.is_alive():
            return False
        return done.wait(timeout)

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
        """Admit a request; returns once its arrival is committed to the trace (when there is one), so that
        nothing is sent for a request the trace could lose. Raises AdmissionError, QueueFull, EngineDead or
        EngineStopped before anything is streamed."""
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

    def inject_fault(self, kind: FaultKind | Literal["trace_full"], request_id: str | None = None) -> None:
        self._inbox.put(_FullDisk() if kind == "trace_full" else _Fault(kind, request_id))

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
                    self._commit_then_release(outputs)
                else:  # idle: arrivals refused, a cancel of something finished: commit what they recorded
                    self._commit_then_release([])
                time.sleep(0)  # hand the GIL to the HTTP thread between steps, however fast they are
        except EngineDead as exc:
            self._die(str(exc) or "fatal fault")
        except Exception as exc:  # a bug outside the engine's own error handling: its state is unknown
            log.exception("engine loop crashed")
            self._die(f"engine loop crashed: {type(exc).__name__}")
        finally:
            self._settle_commits()
            self._release_everyone(_Died("the server is shutting down", fatal=False))
            try:
                self.engine.close()  # the last commit and the run-end marker
            except Exception as exc:  # a failed store says so once, without a stack
                log.error("engine close failed: the trace may end before the run did",
                          error=f"{type(exc).__name__}: {exc}")

    # -- write-ahead: commit, then release ----------------------------------------------------------

    def _commit_then_release(self, outputs: list[RequestOutput]) -> None:
        stats = self._stats()
        sink = self._sink
        acks, self._unacked = self._unacked, []
        if sink is None:
            self._release(outputs, stats, None, acks)
            return
        if self.commit_mode == "thread" and callable(getattr(sink, "commit_async", None)):
            self._commit_slot.acquire()

            def committed(error: BaseException | None) -> None:
                self._commit_slot.release()
                self._release(outputs, stats, error, acks)

            sink.commit_async(committed)
            return
        try:
            sink.flush()
        except Exception as exc:
            self._release(outputs, stats, exc, acks)
            raise EngineDead(self._trace_failure(exc)) from None
        self._release(outputs, stats, None, acks)

    def _release(self, outputs: list[RequestOutput], stats: Any, error: BaseException | None,
                 acks: list[_Arrival]) -> None:
        """After the commit of the step that produced `outputs` and of the arrivals `acks` (on the committing
        thread): acknowledge the arrivals, then hand out the outputs."""
        if error is not None:  # never released: nothing on disk backs them
            refusal = EngineDead(self._trace_failure(error))
            for arrival in acks:  # their handlers answer 503 without having sent a byte
                _acknowledge(arrival, refusal)
            if self._dead is None:
                self._inbox.put(_TraceFailed(self._trace_failure(error)))
            return
        for arrival in acks:
            _acknowledge(arrival, None)
        if stats is not None:
            persisted = getattr(self._sink, "events_written", None)
            if persisted is not None and hasattr(stats, "trace_events_written"):
                stats = attrs.evolve(stats, trace_events_written=persisted)
            self.latest_stats = stats  # first: a client that has its answer reads /metrics that count it
        self._dispatch(outputs)

    @staticmethod
    def _trace_failure(error: BaseException) -> str:
        return f"the trace store failed, so nothing more can be served: {error}"

    def _settle_commits(self) -> None:
        """Wait for the writer thread's queued commits (and their releases) before ending anyone."""
        if self._sink is not None and callable(getattr(self._sink, "commit_async", None)):
            try:
                self._sink.flush()
            except Exception:  # a failed store: reported by close, its outputs stay unreleased
                pass

    def _stats(self) -> Any:
        try:
            return self.engine.stats()
        except EngineDead:
            raise
        except Exception:
            log.exception("engine stats failed")
            return None

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
            with self._sub_lock:
                live = command.request_id in self._subscribers
            if live:
                self.engine.cancel(command.request_id)
        elif isinstance(command, _EndAll):
            self._end_all(command)
        elif isinstance(command, _TraceFailed):
            raise EngineDead(command.detail)
        elif isinstance(command, _FullDisk):
            inject = getattr(self._sink, "inject_full_disk", None)
            if inject is None:
                log.warning("trace_full injected without a SQLite trace: ignored")
            else:
                inject(spare_pages=16)  # ~64 KB more: the disk fills mid-load, not at the next commit
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
        with self._sub_lock:
            self._subscribers[arrival.request_id] = _Subscriber(mailbox, arrival.outputs, arrival.arrived_at)
        if arrival.inject_fault is not None:  # test hook, only reachable when the server enables it
            self.engine.inject_fault(arrival.inject_fault, arrival.request_id)
            self._force_step = True
        if self._sink is None:  # nothing to commit: acknowledged now
            _acknowledge(arrival, None)
        else:
            self._unacked.append(arrival)  # acknowledged once its RequestArrived is committed

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            with self._sub_lock:
                sub = self._subscribers.get(out.request_id)
                if sub is not None and out.finished:
                    del self._subscribers[out.request_id]
            if sub is None:
                continue
            if out.new_token_ids and self.observer is not None:
                if sub.last_output_at is None:
                    self.observer.on_first_token(now - sub.arrived_at)
                else:
                    self.observer.on_inter_token(now - sub.last_output_at)
            if out.new_token_ids:
                sub.last_output_at = now
            if out.finished and self.observer is not None:
                self.observer.on_finished(out.finish_reason, now - sub.arrived_at)
            sub.mailbox.post(sub.outputs, out)

    def _end_all(self, command: _EndAll) -> None:
        """The shutdown grace is over: what still runs is cancelled (an input event, so the trace records
        each outcome), committed, and each stream ends with EngineStopped."""
        try:
            self._settle_commits()  # outputs already computed go out first
            with self._sub_lock:
                live = list(self._subscribers)
            for request_id in live:
                self.engine.cancel(request_id)
            if live:
                log.warning("shutdown grace over: requests cancelled", requests=len(live))
            if self._sink is not None:
                self._sink.flush()
            acks, self._unacked = self._unacked, []
            for arrival in acks:  # committed now; their streams end like every other's
                _acknowledge(arrival, None)
            ending = _Died(command.detail, fatal=False)
            with self._sub_lock:
                subs = [self._subscribers.pop(rid) for rid in live if rid in self._subscribers]
            for sub in subs:
                sub.mailbox.post(sub.outputs, ending)
        finally:
            command.done.set()

    def _refresh_stats(self) -> None:
        stats = self._stats()
        if stats is not None:
            self.latest_stats = stats

    def _release_everyone(self, ending: _Died) -> None:
        """End every live request and refuse every queued arrival, so no handler waits forever."""
        with self._lock:
            self._stopped = True
        with self._sub_lock:
            subs = list(self._subscribers.values())
            self._subscribers.clear()
        for sub in subs:
            sub.mailbox.post(sub.outputs, ending)
        refusal = EngineDead(ending.detail) if ending.fatal else EngineStopped(ending.detail)
        acks, self._unacked = self._unacked, []
        for arrival in acks:  # never acknowledged: their handlers answer 503 without having sent a byte
            _acknowledge(arrival, refusal)
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
