"""The Engine: arrivals in, one scheduler step at a time, RequestOutputs out; every change an event.

    for e in schedule(state, lanes): journal.apply(e)      # pure decisions, each applied before the next
    plan    = plan_step(state, lanes)                      # pure: the StepPlan of the step in flight
    result  = backend.execute(plan)                        # tensors: the step's only call into the data plane
    journal.apply_all(outcome(state, plan, result))        # pure fold: StepExecuted, ring snapshots
    for e in book.settle(...): journal.apply(e)            # stops, rollbacks, finishes, outputs

Single-threaded: exactly one thread (the engine loop) calls it. Engines are built by atlas.registry.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, Literal, TypeVar

import attrs
import numpy as np
import structlog

from atlas.backends.base import Backend, Capabilities
from atlas.config import Capacities, EngineConfig, derive_capacities, log_capacities
from atlas.engine.drafters import Drafter, make_drafter
from atlas.engine.drafters.lane import SpeculativeLane
from atlas.engine.drafters.policy import VerifyCosts
from atlas.engine.journal import Journal
from atlas.engine.outcome import cursor_violation, outcome
from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.engine.planner import Lanes, plan_step, schedule
from atlas.engine.prefix_lane import PrefixLane
from atlas.engine.records import EngineStats, EventSink, engine_stats
from atlas.engine.requests import RequestBook
from atlas.engine.rollback import next_boundary
from atlas.engine.stopping import Tokenizer
from atlas.errors import (
    AdmissionError,
    DeviceFault,
    EngineDead,
    InvariantViolation,
    QueueFull,
    StateDigestMismatch,
)
from atlas.plan import StepPlan, StepResult
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState
from atlas.state.events import (
    EngineFaulted,
    Event,
    FaultInjected,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
)
from atlas.state.machines import Sequence as SequenceState

log = structlog.get_logger("atlas.engine")
R = TypeVar("R")


def drive(events: Generator[Event, None, R], journal: Journal) -> R:
    """Apply every event a decision generator yields, in order; its return value."""
    while True:
        try:
            e = next(events)
        except StopIteration as done:
            return done.value
        journal.apply(e)


# prompts from this many tokens are converted through one numpy array (below: the per-element way, cheaper there)
LONG_PROMPT = 256


def prompt_ints(token_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, int] | None]:
    """(tuple(map(int, token_ids)), its (least, greatest) or None when empty). A long list or tuple that numpy holds
    as one integer array (ints, numpy ints, bools among ints) takes one array conversion, its min and max and one
    tolist: a 2,048-token prompt's conversion and bounds ~100 -> ~45 us on this box (map(int) 65 us, min and max
    35). Anything else (floats, strings, ints past 64 bits, a short prompt) goes the per-element way, which
    converts or refuses it exactly as before; the array's values are those ints either way."""
    if type(token_ids) in (list, tuple) and len(token_ids) >= LONG_PROMPT:
        values = np.array(token_ids)
        if values.dtype.kind in "iu" and values.ndim == 1:
            return tuple(values.tolist()), (int(values.min()), int(values.max()))
    prompt = tuple(map(int, token_ids))
    return prompt, ((min(prompt), max(prompt)) if prompt else None)


class Engine:
    def __init__(self, backend: Backend, *, tokenizer: Tokenizer, config: EngineConfig,
                 capacities: Capacities | None = None, spec: Any = None, model_name: str = "atlas-tiny",
                 sink: EventSink | None = None, full_audit: bool = False, detokenize: bool = True,
                 vocab_size: int | None = None, drafter: Drafter | None = None, fingerprint: str = "unknown") -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.capacities = capacities or derive_capacities(config, spec)
        self.model_name = model_name
        self.model_fingerprint = fingerprint
        self.vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None)
        caps: Capabilities = backend.capabilities
        caps.check(config, self.capacities, backend.name, custom_drafter=drafter is not None)
        self.state = ControlState.create(self.capacities)
        # the running decode batch's cursors in numpy columns across the step, written through to the objects
        # (atlas.state.batch_columns; the engine's own state: every change goes through the journal)
        self.state.batch_cache = True
        self.journal = Journal(self.state, sink, full_audit=full_audit)
        self.book = RequestBook(tokenizer, config, detokenize=detokenize)
        self.lanes = Lanes(eos=tuple(getattr(tokenizer, "eos_token_ids", ())))
        if config.num_drafts:
            self.lanes.spec = SpeculativeLane(drafter or make_drafter(config.drafter), self.capacities,
                                              config.num_drafts, self.vocab_size, per_row_qsa=caps.per_row_qsa_verify,
                                              skip=self._snapshot_due,
                                              costs=VerifyCosts(config.verify_costs) if config.verify_costs else None)
        if self.capacities.prefix_caching:
            self.lanes.prefix = PrefixLane(self.capacities)
        self._dead: EngineDead | None = None
        log_capacities(self.capacities, model=model_name, backend=backend.name)

    @property
    def sink(self) -> EventSink | None:
        """Where events go: the server commits it after every step, before releasing that step's outputs."""
        return self.journal.sink

    trace_sink = sink

    # ------------------------------------------------------------------------------------------ inputs

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    stream: bool = False, prompt_logprobs: int | None = None) -> None:
        """Admit a request. `stream`: its tokens are handed out as they are sampled (a rollback past them then
        declines); otherwise they are held back and come in one RequestOutput when the request ends.
        `prompt_logprobs`: None off; N the logprob of every prompt token and its N best alternatives (0: none),
        in the request's first output (RequestOutput.prompt_logprobs); recorded with the params."""
        self._check_alive()
        if prompt_logprobs is not None:
            if not self.backend.capabilities.prompt_logprobs:
                raise AdmissionError(f"prompt_logprobs: backend {self.backend.name!r} does not compute them",
                                     param="prompt_logprobs")
            params = attrs.evolve(params, prompt_logprobs=prompt_logprobs)
        # a tuple of exact ints: RequestArrived's converter takes it as it is (a list was converted a second time; a
        # 2,048-token prompt's arrival is ~0.4 ms of host time before its prefill, control_plane.py --prefill)
        prompt, bounds = prompt_ints(prompt_token_ids)
        cap = self.capacities.max_seq_len
        if bounds is None:
            raise AdmissionError("prompt is empty", param="prompt")
        if self.vocab_size is not None and not (bounds[0] >= 0 and bounds[1] < self.vocab_size):
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise AdmissionError(f"prompt token id {bad} is outside the vocabulary of {self.vocab_size}",
                                 param="prompt")
        if params.max_tokens is not None:
            if len(prompt) + params.max_tokens > cap:
                raise AdmissionError(f"prompt {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                                     f"max_seq_len {cap}", param="max_tokens")
            max_new = params.max_tokens
        else:
            if len(prompt) >= cap:
                raise AdmissionError(f"prompt {len(prompt)} leaves no room to generate under max_seq_len {cap}",
                                     param="prompt")
            max_new = cap - len(prompt)
        if request_id in self.state.by_request:
            raise AdmissionError(f"request id {request_id!r} is already in use", param="request_id")
        if len(self.state.waiting) >= self.capacities.max_waiting:
            raise QueueFull(f"waiting queue is full: {len(self.state.waiting)} requests "
                            f"(max_waiting {self.capacities.max_waiting})")
        seq_id = self.state.next_seq_id
        self.journal.apply(RequestArrived(request_id, seq_id, prompt, params.to_json(), max_new, stream))
        self.book.admit(seq_id, params, max_new, len(prompt), stream)

    def cancel(self, request_id: str) -> None:
        """Cancel a live request: its blocks are freed now, its final output comes from the next step()."""
        self._check_alive()
        seq_id = self.state.by_request.get(request_id)
        if seq_id is None:
            return  # finished already, or never known: nothing to cancel
        c = self.state.seqs[seq_id].cursor
        prompt_len, generated = c.prompt_len, c.generated
        self.journal.apply(RequestCancelled(request_id, seq_id))
        self.book.forget(seq_id)
        self.book.pending.append(RequestOutput(request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                                               finish_detail="cancelled", prompt_tokens=prompt_len,
                                               completion_tokens=generated))

    def inject_fault(self, kind: Literal["step_error", "fatal"], request_id: str | None = None) -> None:
        self._check_alive()
        if kind not in ("step_error", "fatal"):
            raise ValueError(f"unknown fault kind {kind!r} (step_error, fatal)")
        self.journal.apply(FaultInjected(kind, request_id))

    # -------------------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        out = self.book.take_pending()
        self.journal.stepping = self.state.step
        try:
            self._fire_faults(out)
            drive(schedule(self.state, self.lanes), self.journal)
            if self.state.inflight is not None:  # else: nothing to do this step
                # the plan is the engine's, lent to the backend for this step (atlas.plan: who owns a plan): its
                # decode work may be moved to the next step unless the backend keeps plans
                plan = plan_step(self.state, self.lanes, not getattr(self.backend, "retains_plans", False))
                result = self._execute(plan, out)
                if result is not None:
                    self._fold(plan, result, out)
        except InvariantViolation as v:
            self._dead = v
            raise
        finally:
            self.journal.stepping = None
        return out

    def _execute(self, plan: StepPlan, out: list[RequestOutput]) -> StepResult | None:
        """The step's one call into the data plane; a failure ends the plan's requests with `error`."""
        try:
            return self.backend.execute(plan)
        except StateDigestMismatch as exc:  # audit mode: state bytes that are not what was saved or computed
            self.journal.violation(InvariantViolation(self.journal.index, "StateDigest", exc.what, {
                "step": plan.step, "seq_id": exc.seq_id, "differs": list(exc.differs)}))
        except DeviceFault as exc:
            if exc.fatal:
                self._die(plan.step, f"fatal device fault: {exc}", injected=False)
            self._fail_step(plan, exc, out)
        except Exception as exc:  # a non-fatal error fails this step's requests; the engine goes on
            self._fail_step(plan, exc, out)
        return None

    def _fold(self, plan: StepPlan, result: StepResult, out: list[RequestOutput]) -> None:
        journal, state = self.journal, self.state
        assert state.inflight is not None
        prefilled: list[int] = []
        if self.lanes.prefix is not None:  # prefill chunks: every work but a running sequence's decode
            admitted = set(state.inflight.admitted)
            prefilled = [w.seq_id for w in plan.work if len(w.tokens) > 1 or not w.sample or w.seq_id in admitted]
        folded = outcome(state, plan, result, self.vocab_size, journal.index)
        journal.apply_all(folded.events)
        journal.check(cursor_violation(state, plan, result, journal.index - 1 - len(plan.snapshots)))
        if self.lanes.spec is not None:
            self.lanes.spec.observe(plan, result)
        book = self.book
        rest = book.quiet_rows(state, folded.ordered, folded.refused)  # [] : every row settled quietly, no event
        if rest is None or rest:
            drive(book.settle(state, plan, folded.ordered, folded.refused, self.lanes, out, rest), journal)
        if self.lanes.prefix is not None:
            drive(self.lanes.prefix.after_step(state, prefilled, plan.step), journal)

    def _snapshot_due(self, seq: SequenceState) -> bool:
        """A boundary snapshot is due within a verify's reach (the next 1 + num_drafts tokens): plain decodes
        until it is taken, so a verify never steps over a boundary and the ring sees the same boundaries with
        speculation on as off."""
        c = seq.cursor
        if seq.ring.slots == 0:
            return False
        return next_boundary(c.computed, c.prompt_len, self.capacities.snapshot_interval) <= (
            c.computed + 1 + self.config.num_drafts)

    def roll_back(self, seq_id: int, keep: int, period: int = 0) -> tuple[FinishReason, str] | str:
        """Roll a running sequence back between steps so it keeps tokens[:keep] (the watchdog's action; tests
        drive any target with it): "rolled_back", or the `stop` a decline ends it with (the caller's to emit).
        A target outside (prompt_len, seq_len) raises ValueError having changed nothing."""
        seq = self.state.seqs[seq_id]
        return drive(self.book.roll_back(self.state, seq, keep, period, self.state.step), self.journal)

    # ------------------------------------------------------------------------------------------ faults

    def _fail_step(self, plan: StepPlan, exc: Exception, out: list[RequestOutput]) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        log.warning("step failed", step=plan.step, error=detail, requests=len(plan.work))
        planned = self.state.inflight
        self.journal.apply(EngineFaulted(plan.step, False, detail, False))
        assert planned is not None
        for seq_id in dict.fromkeys((*planned.seqs, *planned.restored)):
            if seq_id in self.state.seqs:
                drive(self.book.finish_error(self.state, seq_id, detail, out), self.journal)

    def _fire_faults(self, out: list[RequestOutput]) -> None:
        faults = list(self.state.pending_faults)
        if not faults:
            return
        if any(kind == "fatal" for kind, _ in faults):
            self._die(self.state.step, "injected fatal fault", injected=True)
        named = [rid for kind, rid in faults if kind == "step_error" and rid is not None]
        targets = list(self.state.running)
        if len(named) == len(faults):  # only named requests fail, in arrival order
            targets = sorted({self.state.by_request[rid] for rid in named if rid in self.state.by_request})
        self.journal.apply(EngineFaulted(self.state.step, False, "injected step_error", True))
        for seq_id in targets:
            drive(self.book.finish_error(self.state, seq_id, "injected step_error", out), self.journal)

    def _die(self, step: int, error: str, *, injected: bool) -> None:
        log.error("engine dead", step=step, error=error)
        self.journal.apply(EngineFaulted(step, True, error, injected))
        for seq_id in sorted(self.state.seqs):
            self.journal.apply(RequestFinished(seq_id, FinishReason.ERROR.value, f"engine dead: {error}"))
        self._dead = EngineDead(error)
        self.journal.flush()
        raise self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead}")

    # ------------------------------------------------------------------------------------------ status

    def has_unfinished(self) -> bool:
        s = self.state
        return bool(s.seqs or self.book.pending or s.pending_release or s.pending_faults)

    def stats(self) -> EngineStats:
        return engine_stats(self)

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def cause_of_death(self) -> EngineDead | None:
        """What killed the engine (an InvariantViolation names its machine, message and fields), or None."""
        return self._dead

    def close(self) -> None:
        """Flush the journal and let the backend give its device memory back (a backend with `close`)."""
        self.journal.close()
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()
