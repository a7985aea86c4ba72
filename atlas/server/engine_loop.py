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
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import structlog

from atlas.engine.outputs import RequestOutput
from atlas.errors import EngineDead
from atlas.sampling.params import SamplingParams
from atlas.server.loop_messages import (
    Arrival,
    Cancel,
    Died,
    EndAll,
    EngineStopped,
    Fault,
    FaultKind,
    FullDisk,
    LatencyObserver,
    Mailbox,
    RequestStream,
    Stop,
    Subscriber,
    TraceFailed,
    acknowledge,
    dispatch,
    settle_future,
)

log = structlog.get_logger(__name__)

CommitMode = Literal["thread", "inline"]


class EngineLoop:
    """Runs `engine.step()` in a dedicated thread and routes each RequestOutput to its request."""

    def __init__(self, engine: Any, *, observer: LatencyObserver | None = None, commit: CommitMode = "thread"
                 ) -> None:
        self.engine = engine
        self.observer = observer
        self.commit_mode = commit
        self._sink = getattr(engine, "trace_sink", None)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._subscribers: dict[str, Subscriber] = {}
        self._sub_lock = threading.Lock()  # the engine thread admits, the writer thread releases outputs
        # one commit outstanding at most: step N commits while step N+1 computes, never more behind (a kill -9
        # loses at most those two steps, neither of which any client has seen; memory stays bounded)
        self._commit_slot = threading.Semaphore(1)
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}
        self._force_step = False  # a fatal fault acts at the next step, even when idle
        self._lock = threading.Lock()  # orders "dead" or "stopped" against enqueued arrivals
        self._dead: str | None = None
        self._stopped = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        # admitted arrivals whose RequestArrived is not committed yet (the engine thread's): acknowledged by the
        # release of the next commit, which holds their events
        self._unacked: list[Arrival] = []
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
        self._inbox.put(Stop())
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
        self._inbox.put(EndAll(detail, done))
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
        arrival = Arrival(
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
        self._inbox.put(Cancel(request_id))

    def inject_fault(self, kind: FaultKind | Literal["trace_full"], request_id: str | None = None) -> None:
        self._inbox.put(FullDisk() if kind == "trace_full" else Fault(kind, request_id))

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
            self._release_everyone(Died("the server is shutting down", fatal=False))
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
                 acks: list[Arrival]) -> None:
        """After the commit of the step that produced `outputs` and of the arrivals `acks` (on the committing
        thread): acknowledge the arrivals, then hand out the outputs."""
        if error is not None:  # never released: nothing on disk backs them
            refusal = EngineDead(self._trace_failure(error))
            for arrival in acks:  # their handlers answer 503 without having sent a byte
                acknowledge(arrival, refusal)
            if self._dead is None:
                self._inbox.put(TraceFailed(self._trace_failure(error)))
            return
        for arrival in acks:
            acknowledge(arrival, None)
        if stats is not None:
            persisted = getattr(self._sink, "events_written", None)
            if persisted is not None and hasattr(stats, "trace_events_written"):
                stats = attrs.evolve(stats, trace_events_written=persisted)
            self.latest_stats = stats  # first: a client that has its answer reads /metrics that count it
        dispatch(outputs, self._subscribers, self._sub_lock, self.observer)

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
            if isinstance(command, Stop):
                return False
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> None:
        if isinstance(command, Arrival):
            self._admit(command)
        elif isinstance(command, Cancel):
            with self._sub_lock:
                live = command.request_id in self._subscribers
            if live:
                self.engine.cancel(command.request_id)
        elif isinstance(command, EndAll):
            self._end_all(command)
        elif isinstance(command, TraceFailed):
            raise EngineDead(command.detail)
        elif isinstance(command, FullDisk):
            inject = getattr(self._sink, "inject_full_disk", None)
            if inject is None:
                log.warning("trace_full injected without a SQLite trace: ignored")
            else:
                inject(spare_pages=16)  # ~64 KB more: the disk fills mid-load, not at the next commit
        elif isinstance(command, Fault):
            self.engine.inject_fault(command.kind, command.request_id)
            self._force_step = True

    def _admit(self, arrival: Arrival) -> None:
        try:
            extra = {} if arrival.prompt_logprobs is None else {"prompt_logprobs": arrival.prompt_logprobs}
            self.engine.add_request(arrival.request_id, arrival.prompt_token_ids, arrival.params,
                                    stream=arrival.stream, **extra)
        except EngineDead as exc:
            arrival.loop.call_soon_threadsafe(settle_future, arrival.admitted, exc)
            raise
        except Exception as exc:  # AdmissionError, QueueFull: the handler answers 400 / 503
            arrival.loop.call_soon_threadsafe(settle_future, arrival.admitted, exc)
            return
        mailbox = self._mailboxes.get(arrival.loop)
        if mailbox is None:
            mailbox = self._mailboxes[arrival.loop] = Mailbox(arrival.loop)
        with self._sub_lock:
            self._subscribers[arrival.request_id] = Subscriber(mailbox, arrival.outputs, arrival.arrived_at)
        if arrival.inject_fault is not None:  # test hook, only reachable when the server enables it
            self.engine.inject_fault(arrival.inject_fault, arrival.request_id)
            self._force_step = True
        if self._sink is None:  # nothing to commit: acknowledged now
            acknowledge(arrival, None)
        else:
            self._unacked.append(arrival)  # acknowledged once its RequestArrived is committed

    def _end_all(self, command: EndAll) -> None:
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
                acknowledge(arrival, None)
            ending = Died(command.detail, fatal=False)
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

    def _release_everyone(self, ending: Died) -> None:
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
            acknowledge(arrival, refusal)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Arrival):
                try:
                    command.loop.call_soon_threadsafe(settle_future, command.admitted, refusal)
                except RuntimeError:  # that event loop has closed
                    pass

    def _die(self, detail: str) -> None:
        with self._lock:
            self._dead = detail
        log.error("engine dead", detail=detail)
        self._release_everyone(Died(detail))
        for callback in self._death_callbacks:
            try:
                callback(detail)
            except Exception:
                log.exception("death callback failed")
