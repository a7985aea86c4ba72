"""The Engine: arrivals in, one scheduler step at a time, RequestOutputs out; every change an event.

    plan    = schedule(state)                  # pure: state -> decisions
    result  = backend.execute(plan)            # tensors
    events  = outcome(plan, result)            # StepExecuted, RequestFinished...
    for e in events: state.apply(e); check_invariants(...); trace.append(e, digest)

Single-threaded: exactly one thread (the engine loop) calls it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import structlog

from atlas.backends.base import Backend, DeviceFault, SeqOutcome, SeqWork, StepPlan, StepResult
from atlas.config import Capacities, CapacityError, EngineConfig, derive_capacities, log_capacities
from atlas.engine.drafters import Drafter, make_drafter
from atlas.engine.drafters.lane import SpeculativeLane, Verified, planned_drafts
from atlas.engine.factory import TINY_MODEL, build_engine, build_engine_for_loaded
from atlas.engine.outputs import AdmissionError, EngineDead, FinishReason, QueueFull, RequestOutput
from atlas.engine.prefix_lane import PrefixLane
from atlas.engine.records import EngineStats, EventSink, _Held
from atlas.engine.rollback import (
    DeclineReason,
    RollbackDecline,
    RollbackPlan,
    next_boundary,
    plan_rollback,
    plan_snapshots,
)
from atlas.engine.sampling import SamplingParams
from atlas.engine.scheduler import schedule
from atlas.engine.stopping import StopChecker, Tokenizer
from atlas.engine.watchdog import WatchdogConfig, detect_loop
from atlas.state.control import ControlState
from atlas.state.events import (
    BoundarySnapshotted,
    EngineFaulted,
    Event,
    FaultInjected,
    InvariantViolated,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    RollbackDeclined,
    RolledBack,
    SequencePreempted,
    StepExecuted,
    StepPlanned,
)
from atlas.state.invariants import InvariantViolation, audit, check_invariants
from atlas.state.machines import Sequence as SequenceState
from atlas.state.machines import TransitionRefused

log = structlog.get_logger("atlas.engine")


class Engine:
    def __init__(
        self,
        backend: Backend,
        *,
        tokenizer: Tokenizer,
        config: EngineConfig,
        capacities: Capacities | None = None,
        spec: Any = None,
        model_name: str = TINY_MODEL,
        sink: EventSink | None = None,
        full_audit: bool = False,
        detokenize: bool = True,
        vocab_size: int | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.capacities = capacities or derive_capacities(config, spec)
        self.model_name = model_name
        self.model_fingerprint = "unknown"
        self.vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None)
        self.state = ControlState.create(self.capacities)
        self._sink = sink
        self._full_audit = full_audit
        self._detokenize = detokenize
        self._event_index = 0
        self._stepping: int | None = None  # the step being run: outcome events are stamped with it
        self._dead: EngineDead | None = None
        self._stops: dict[int, StopChecker] = {}
        self._pending: list[RequestOutput] = []
        self._invariant_checks = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._preemptions = 0
        self._rollbacks = 0
        self._rollback_declines = 0
        # non-streaming requests: tokens held back until the request ends, so a rollback never retracts text
        self._held: dict[int, _Held] = {}
        self._watchdog = WatchdogConfig(config.watchdog_max_period, config.watchdog_min_repeats,
                                        config.watchdog_min_span, config.watchdog_window) if config.loop_watchdog else None
        # speculative decoding: None when num_drafts == 0 (every decode is a plain one)
        self._lane: SpeculativeLane | None = None
        if config.num_drafts:
            self._lane = SpeculativeLane(drafter or make_drafter(config.drafter, backend), backend, self.capacities,
                                         config.num_drafts, self.vocab_size, skip=self._snapshot_due)
        if self.capacities.ring_slots and not callable(getattr(backend, "restore_boundary", None)):
            # snapshots the control plane records but no data plane holds would only ever decline
            raise CapacityError(f"ring_slots {self.capacities.ring_slots} needs a backend with a snapshot ring; "
                                f"backend {getattr(backend, 'name', '?')!r} has none (set ring_slots 0)")
        # prefix caching and the drafter carry: None when prefix caching is off
        self._prefix = PrefixLane(self.capacities, backend) if self.capacities.prefix_caching else None
        log_capacities(self.capacities, model=model_name, backend=getattr(backend, "name", "?"))

    @classmethod
    def from_model(
        cls,
        model: str = TINY_MODEL,
        backend: Literal["cpu", "null"] = "cpu",
        config: EngineConfig | None = None,
        trace: str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Build the engine for a model (the built-in "atlas-tiny" or a checkpoint dir) on a backend;
        `trace` is a SQLite path or any SQLAlchemy URL."""
        return build_engine(cls, model, backend, config, trace, **kwargs)

    @classmethod
    def from_loaded(cls, loaded: Any, *, model: str, config: EngineConfig | None = None, trace: str | None = None,
                    dtype: Any = None, **kwargs: Any) -> Engine:
        """The engine on the CPU backend for an already loaded model (atlas.model.LoadedModel); `model` is
        the name or dir recorded in the trace so that a replay can load it again."""
        return build_engine_for_loaded(cls, loaded, model=model, config=config, trace=trace, dtype=dtype, **kwargs)

    # ------------------------------------------------------------------------------------------ inputs

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    stream: bool = False) -> None:
        """Admit a request. `stream`: its tokens are handed out as they are sampled (a rollback past them then
        declines); otherwise they are held back and come in one RequestOutput when the request ends."""
        self._check_alive()
        prompt = [int(t) for t in prompt_token_ids]
        cap = self.capacities.max_seq_len
        if not prompt:
            raise AdmissionError("prompt is empty", param="prompt")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in prompt):
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
        self._emit(RequestArrived(request_id, seq_id, prompt, params.to_json(), max_new, stream))
        if not stream:
            self._held[seq_id] = _Held()
        eos = tuple(getattr(self.tokenizer, "eos_token_ids", ()))
        self._stops[seq_id] = StopChecker.create(params, max_new, eos)
        self._prompt_tokens += len(prompt)

    def cancel(self, request_id: str) -> None:
        """Cancel a live request: its blocks are freed now, its final output comes from the next step()."""
        self._check_alive()
        seq_id = self.state.by_request.get(request_id)
        if seq_id is None:
            return  # finished already, or never known: nothing to cancel
        seq = self.state.seqs[seq_id]
        prompt_len, generated = seq.cursor.prompt_len, seq.cursor.generated
        self._emit(RequestCancelled(request_id, seq_id))
        self._stops.pop(seq_id, None)
        self._held.pop(seq_id, None)
        self._pending.append(RequestOutput(request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                                           finish_detail="cancelled", prompt_tokens=prompt_len,
                                           completion_tokens=generated))

    def inject_fault(self, kind: Literal["step_error", "fatal"], request_id: str | None = None) -> None:
        self._check_alive()
        if kind not in ("step_error", "fatal"):
            raise ValueError(f"unknown fault kind {kind!r} (step_error, fatal)")
        self._emit(FaultInjected(kind, request_id))

    # -------------------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        self._stepping = self.state.step
        try:
            return self._step()
        finally:
            self._stepping = None

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.state.pending_faults:
            self._fire_faults(outputs)
        drafts = self._lane.propose(self.state, self._emit) if self._lane is not None else {}
        if self._prefix is not None:  # waiting sequences that hit the cache start running from it
            self._prefix.admit(self.state, self._emit, self.state.step)
        decided = schedule(self.state, {seq_id: len(d) for seq_id, d in drafts.items()})
        if decided.idle and not self.state.pending_release:
            return outputs
        step = self.state.step
        for seq_id in decided.preempt:
            self._emit(SequencePreempted(seq_id, len(self.state.seqs[seq_id].blocks), "kv blocks exhausted"))
            self._preemptions += 1
        planned = StepPlanned(step, decided.admitted, decided.seqs, decided.fed, decided.alloc,
                              tuple(self.state.pending_release), decided.preempt, planned_drafts(drafts, decided))
        if self._prefix is not None:
            self._prefix.admitted(self.state, decided.admitted, self._emit, step)
            prefix_orders = PrefixLane.capture(self.state)  # the plan's; StepPlanned clears them
            prefilled = [s for s in planned.seqs if not self.state.seqs[s].cursor.decoding]
        self._emit(planned)
        snapshots = plan_snapshots(self.state.seqs, planned.seqs, planned.fed, self.capacities.snapshot_interval)
        try:
            plan = self._plan(planned, snapshots)
            if self._prefix is not None:
                plan = PrefixLane.into(plan, prefix_orders)
            result = self.backend.execute(plan)
        except DeviceFault as exc:
            if exc.fatal:
                self._die(step, f"fatal device fault: {exc}", injected=False)
            self._fail_step(planned, exc, outputs)
            return outputs
        except Exception as exc:  # a non-fatal error fails this step's requests; the engine goes on
            self._fail_step(planned, exc, outputs)
            return outputs
        by_seq = self._outcomes(planned, result)
        verified: dict[int, Verified] = {}
        if planned.drafts and self._lane is not None:  # accepted counts, cut at stops, committed
            verified = self._lane.settle(planned, by_seq, self._stops, self.tokenizer if self._detokenize else None)
        self._emit(self._executed(planned, by_seq, verified))
        self._check_cursors(planned, self._lane.committed(by_seq, verified) if verified else by_seq)
        for seq_id, v in verified.items():
            if v.error is not None:
                self._error_finish(seq_id, v.error, outputs)
        for snap in snapshots:
            self._emit(BoundarySnapshotted(step, snap.seq_id, snap.position, snap.slot, snap.evicted))
        self._finish_sampled(planned, by_seq, outputs, verified)
        if self._prefix is not None:
            self._prefix.after_step(self.state, prefilled, self._emit, step)
        return outputs

    def _executed(self, planned: StepPlanned, outcomes: list[SeqOutcome], verified: dict[int, Verified]
                  ) -> StepExecuted:
        tokens = tuple(-1 if o.token is None else o.token for o in outcomes)
        if not planned.drafts:
            return StepExecuted(planned.step, tokens)
        none = Verified(accepted=0)
        rows = [verified.get(o.seq_id, none) for o in outcomes]
        tokens = tuple(v.tokens[-1] if v.tokens else t for v, t in zip(rows, tokens, strict=True))
        return StepExecuted(planned.step, tokens, tuple(v.accepted for v in rows), tuple(v.bits for v in rows))

    def _snapshot_due(self, seq: SequenceState) -> bool:
        """A boundary snapshot is due within a verify's reach (the next 1 + num_drafts tokens): plain decodes
        until it is taken, so a verify never steps over a boundary and the ring sees the same boundaries with
        speculation on as off."""
        c = seq.cursor
        if seq.ring.slots == 0:
            return False
        return next_boundary(c.computed, c.prompt_len, self.capacities.snapshot_interval) <= (
            c.computed + 1 + self.config.num_drafts)

    def _plan(self, planned: StepPlanned, snapshots: tuple = ()) -> StepPlan:
        seqs = self.state.seqs
        work = []
        drafts = planned.drafts or ((),) * len(planned.seqs)
        for seq_id, n, verify in zip(planned.seqs, planned.fed, drafts, strict=True):
            seq = seqs[seq_id]
            tokens = seq.cursor.tokens
            start = seq.cursor.computed
            end = start + n
            banned = seq.banned.get(end, ()) if end == len(tokens) else ()
            if end == len(tokens) and seq.params.min_tokens and seq_id in self._stops:  # min_tokens: no EOS yet
                banned = tuple(sorted({*banned, *self._stops[seq_id].banned_now()}))
            work.append(SeqWork(seq_id, tuple(tokens[start:end]), start, tuple(seq.blocks), end == len(tokens),
                                seq.params, drafts=verify, drafter_first_key=seq.drafter.first_key,
                                banned=banned))
        orders = tuple((o.seq_id, o.position, o.slot) for o in snapshots)
        return StepPlan(planned.step, tuple(work), planned.release, planned.reset, snapshots=orders)

    def _outcomes(self, planned: StepPlanned, result: StepResult) -> list[SeqOutcome]:
        """The backend's outcomes in plan order; a missing or extra outcome or token is a desync."""
        by_id = {o.seq_id: o for o in result.outcomes}
        ordered = [by_id.get(seq_id) for seq_id in planned.seqs]
        problem = None
        if result.step != planned.step or len(result.outcomes) != len(planned.seqs) or None in ordered:
            problem = "one outcome per planned sequence"
        else:
            seqs = self.state.seqs
            drafts = planned.drafts or ((),) * len(planned.seqs)
            for seq_id, n, o, d in zip(planned.seqs, planned.fed, ordered, drafts, strict=True):
                c = seqs[seq_id].cursor
                sample = c.computed + n == len(c.tokens) and not d  # a verify returns verdicts instead
                if d and (o.token is not None or not o.verdicts):
                    problem = f"verdicts, not a token, for a verify (seq {seq_id})"
                    break
                if sample != (o.token is not None) or (sample and self.vocab_size is not None
                                                       and not 0 <= o.token < self.vocab_size):
                    problem = f"a token exactly for the sampled sequences (seq {seq_id}: {o.token})"
                    break
        if problem:
            self._violation(InvariantViolation(self._event_index, "Backend", problem, {
                "step": planned.step, "result_step": result.step, "planned": list(planned.seqs),
                "returned": [o.seq_id for o in result.outcomes]}))
        return ordered  # type: ignore[return-value]

    def _check_cursors(self, planned: StepPlanned, outcomes: list[SeqOutcome]) -> None:
        """The data plane's own cursors must equal the control plane's after every step."""
        seqs = self.state.seqs
        for o in outcomes:
            seq = seqs[o.seq_id]
            n = seq.cursor.computed
            cur = o.cursors
            if (cur.kv_tokens != n or cur.qsa_ingested != seq.qsa.ingested or cur.ssm_position != n
                    or cur.ple_position != n or cur.drafter_rows != seq.drafter.rows):
                self._violation(InvariantViolation(self._event_index - 1, "BackendCursors",
                                                   "data-plane cursors equal the control plane's", {
                    "step": planned.step, "seq_id": o.seq_id, "computed": n, "qsa_ingested": seq.qsa.ingested,
                    "drafter_rows": seq.drafter.rows, "backend": attrs.asdict(cur)}))

    def _finish_sampled(self, planned: StepPlanned, outcomes: list[SeqOutcome], out: list[RequestOutput],
                        verified: dict[int, Verified] | None = None) -> None:
        seqs = self.state.seqs
        tokenizer = self.tokenizer if self._detokenize else None
        verified = verified or {}
        for o in outcomes:
            v = verified.get(o.seq_id)
            if v is not None:  # a verify: its kept tokens, already cut at a stop (none when refused)
                sampled = list(zip(v.tokens, v.logprobs, v.top_logprobs, strict=True))
            else:
                sampled = [] if o.token is None else [(o.token, o.logprob, o.top_logprobs)]
            if not sampled:
                continue
            seq = seqs[o.seq_id]
            stop = self._stops[o.seq_id]
            p = seq.params
            held = self._held.get(o.seq_id)
            new_tokens: list[int] = []
            logprobs: tuple[float, ...] = ()
            top: tuple[tuple[tuple[int, float], ...], ...] = ()
            ended = None
            for token, token_logprob, token_top in sampled:
                self._generated_tokens += 1
                ended = stop.on_token(token, tokenizer)
                lp = (token_logprob,) if p.logprobs and token_logprob is not None else ()
                tp = (token_top,) if p.logprobs and p.top_logprobs else ()
                new_tokens.append(token)
                logprobs, top = logprobs + lp, top + tp
                if held is not None:
                    held.add(token, lp, tp)
                if ended is not None:  # the lane cuts a verify at its stop: this is its last token
                    break
            if ended is None and self._watchdog is not None:
                watched = self._watch(seq, planned.step)
                if watched == "rolled_back":  # the tokens are gone with the loop; a held request goes on
                    continue
                ended = watched
            request_id, prompt_len, generated = seq.request_id, seq.cursor.prompt_len, seq.cursor.generated
            if ended is not None:
                if self._prefix is not None:
                    self._prefix.on_finish(self.state, seq, ended[0], self._emit, planned.step)
                self._emit(RequestFinished(o.seq_id, ended[0].value, ended[1]))
                del self._stops[o.seq_id]
                self._held.pop(o.seq_id, None)
            if held is None or ended is not None:
                token_ids = tuple(new_tokens)
                if held is not None:  # the whole completion, in one output
                    token_ids, logprobs, top = tuple(held.tokens), tuple(held.logprobs), tuple(held.top)
                out.append(RequestOutput(
                    request_id,
                    new_token_ids=token_ids,
                    new_logprobs=logprobs,
                    new_top_logprobs=top,
                    finished=ended is not None,
                    finish_reason=None if ended is None else ended[0],
                    finish_detail=None if ended is None else ended[1],
                    prompt_tokens=prompt_len,
                    completion_tokens=generated,
                    new_text=stop.take_text(ended is not None) if tokenizer is not None else "",
                ))

    def _watch(self, seq: SequenceState, step: int) -> tuple[FinishReason, str] | Literal["rolled_back"] | None:
        """Run the content-loop watchdog on a sequence that just sampled: None when it does not loop. A loop is
        rolled back ("rolled_back": the request goes on) or, when that cannot be made exact, declined (the
        finish: `stop` with the typed reason)."""
        assert self._watchdog is not None
        c = seq.cursor
        verdict = detect_loop(c.tokens[c.prompt_len:], self._watchdog)
        if verdict is None:
            return None
        return self._roll_back(seq, c.prompt_len + verdict.opens_at, verdict.period, step)

    def _roll_back(self, seq: SequenceState, keep: int, period: int, step: int
                   ) -> tuple[FinishReason, str] | Literal["rolled_back"]:
        """Rewind `seq` between steps so it keeps tokens[:keep] and resamples position `keep` with the token
        there banned, or decline (RollbackDeclined; the caller finishes the request with the returned `stop`).
        The watchdog's action; tests call it directly to drive any target. A target outside
        (prompt_len, seq_len) raises ValueError having changed nothing."""
        decision = plan_rollback(seq, keep, max_rollbacks=self.config.max_rollbacks,
                                 block_size=self.capacities.block_size)
        if isinstance(decision, RollbackPlan):
            restore = getattr(self.backend, "restore_boundary", None)
            try:
                if restore is None:
                    raise ValueError(f"backend {getattr(self.backend, 'name', '?')} has no snapshot ring")
                cursors = restore(seq.seq_id, decision.slot, decision.boundary)
            except ValueError as exc:
                log.warning("rollback refused by the backend", seq_id=seq.seq_id, error=str(exc))
                self._check_refused_restore(seq)
                decision = RollbackDecline(seq.seq_id, DeclineReason.BACKEND_REFUSED, keep)
            else:
                self._emit(RolledBack(step, seq.seq_id, decision.boundary, decision.slot, keep, decision.ban_token,
                                      decision.blocks_freed, period, seq.rollbacks + 1, attrs.asdict(cursors)))
                self._rollbacks += 1
                self._rewind_outputs(seq)
                return "rolled_back"
        reason = decision.reason.value
        self._emit(RollbackDeclined(step, seq.seq_id, reason, keep, period))
        self._rollback_declines += 1
        return FinishReason.STOP, f"content loop (period {period}): rollback declined: {reason}"

    def _check_refused_restore(self, seq: SequenceState) -> None:
        """A refused restore must have changed nothing: the data plane's cursors are still the control plane's
        (a restore that rewinds some layers and then fails leaves the sequence torn)."""
        cur = self.backend.cursors(seq.seq_id)
        n = seq.cursor.computed
        if (cur.kv_tokens, cur.qsa_ingested, cur.ssm_position, cur.ple_position, cur.drafter_rows) != (
                n, seq.qsa.ingested, n, n, seq.drafter.rows):
            self._violation(InvariantViolation(self._event_index, "BackendCursors", "a refused restore changes nothing",
                                               {"seq_id": seq.seq_id, "computed": n, "backend": attrs.asdict(cur)}))

    def _rewind_outputs(self, seq: SequenceState) -> None:
        """After a rollback: the stop checker and the held-back output as if the dropped tokens never came."""
        tokenizer = self.tokenizer if self._detokenize else None
        c = seq.cursor
        stop = StopChecker.create(seq.params, seq.max_new, tuple(getattr(self.tokenizer, "eos_token_ids", ())))
        for t in c.tokens[c.prompt_len:]:
            stop.on_token(t, tokenizer)
        self._stops[seq.seq_id] = stop
        held = self._held.get(seq.seq_id)
        if held is not None:
            held.truncate(c.generated)

    # ------------------------------------------------------------------------------------------ faults

    def _error_finish(self, seq_id: int, detail: str, out: list[RequestOutput]) -> None:
        seq = self.state.seqs[seq_id]
        request_id, prompt_len, generated = seq.request_id, seq.cursor.prompt_len, seq.cursor.generated
        self._emit(RequestFinished(seq_id, FinishReason.ERROR.value, detail))
        self._stops.pop(seq_id, None)
        self._held.pop(seq_id, None)
        out.append(RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, finish_detail=detail,
                                 prompt_tokens=prompt_len, completion_tokens=generated))

    def _fail_step(self, planned: StepPlanned, exc: Exception, out: list[RequestOutput]) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        log.warning("step failed", step=planned.step, error=detail, requests=len(planned.seqs))
        self._emit(EngineFaulted(planned.step, False, detail, False))
        for seq_id in planned.seqs:
            self._error_finish(seq_id, detail, out)

    def _fire_faults(self, out: list[RequestOutput]) -> None:
        faults = list(self.state.pending_faults)
        if any(kind == "fatal" for kind, _ in faults):
            self._die(self.state.step, "injected fatal fault", injected=True)
        named = [rid for kind, rid in faults if kind == "step_error" and rid is not None]
        targets = list(self.state.running)
        if len(named) == len(faults):  # only named requests fail, in arrival order
            wanted = {self.state.by_request[rid] for rid in named if rid in self.state.by_request}
            targets = sorted(wanted)
        self._emit(EngineFaulted(self.state.step, False, "injected step_error", True))
        for seq_id in targets:
            self._error_finish(seq_id, "injected step_error", out)

    def _die(self, step: int, error: str, *, injected: bool) -> None:
        log.error("engine dead", step=step, error=error)
        self._emit(EngineFaulted(step, True, error, injected))
        for seq_id in sorted(self.state.seqs):
            self._emit(RequestFinished(seq_id, FinishReason.ERROR.value, f"engine dead: {error}"))
        self._dead = EngineDead(error)
        if self._sink is not None:
            self._sink.flush()
        raise self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead}")

    # ---------------------------------------------------------------------------------------- events

    def _emit(self, e: Event) -> None:
        index = self._event_index
        step = getattr(e, "step", self.state.step if self._stepping is None else self._stepping)
        violation: InvariantViolation | None = None
        try:
            touched = self.state.apply(e)
            check_invariants(self.state, touched, index)
            if self._full_audit:
                audit(self.state, index)
        except TransitionRefused as exc:
            violation = InvariantViolation(index, exc.machine, exc.why, exc.fields)
        except InvariantViolation as exc:
            violation = exc
        self._invariant_checks += 1
        if self._sink is not None:
            self._sink.append(index, step, e, self.state.digest())
        self._event_index = index + 1
        if violation is not None:
            self._violation(violation)

    def _violation(self, v: InvariantViolation) -> None:
        """Record the violation in the trace, flush, and stop the engine: its state cannot be trusted."""
        log.error("invariant violated", event_index=v.event_index, machine=v.machine, message=v.message)
        fields = json.loads(json.dumps(v.fields, default=str))
        e = InvariantViolated(v.event_index, v.machine, v.message, fields)
        self.state.apply(e)
        if self._sink is not None:
            self._sink.append(self._event_index, self.state.step, e, self.state.digest())
            self._sink.flush()
        self._event_index += 1
        self._dead = v
        raise v

    # ------------------------------------------------------------------------------------------ status

    def has_unfinished(self) -> bool:
        return bool(self.state.seqs or self._pending or self.state.pending_release or self.state.pending_faults)

    def stats(self) -> EngineStats:
        pool = self.state.pool
        return EngineStats(
            step=self.state.step,
            num_running=len(self.state.running),
            num_waiting=len(self.state.waiting),
            kv_blocks_total=pool.total,
            kv_blocks_used=pool.used,
            kv_usage=pool.used / pool.total,
            invariant_checks=self._invariant_checks,
            trace_events_written=self._event_index if self._sink is not None else 0,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generated_tokens,
            preemptions_total=self._preemptions,
            rollbacks_total=self._rollbacks,
            rollback_declines_total=self._rollback_declines,
            **self._spec_stats(),
            **self._prefix_stats(),
        )

    def _prefix_stats(self) -> dict[str, Any]:
        if self._prefix is None:
            return {}
        s = self._prefix.stats
        return {"prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_tokens_saved": s.tokens_saved,
                "prefix_tokens_replayed": s.tokens_replayed, "carry_adopted_total": s.carry_adopted,
                "drafter_coverage_warm": s.warm_coverage, "drafter_coverage_cold": s.cold_coverage}

    def _spec_stats(self) -> dict[str, Any]:
        if self._lane is None:
            return {}
        acc = self._lane.stats
        unc = acc.p_unconditional()
        return {"spec_verify_steps": acc.verify_steps, "spec_drafts_proposed": acc.drafts_proposed,
                "spec_drafts_accepted": acc.drafts_accepted, "spec_tokens_per_verify": acc.tokens_per_verify,
                "spec_acceptance_p1": unc[0] if unc else 0.0, "spec_acceptance_unconditional": tuple(unc),
                "spec_acceptance_conditional": tuple(acc.p_conditional()),
                "spec_latched_off_total": self._lane.latched_total}

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def trace_sink(self) -> EventSink | None:
        """Where events go: the server commits it after every step, before releasing that step's outputs."""
        return self._sink

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None
