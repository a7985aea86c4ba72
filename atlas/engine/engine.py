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
from typing import Any, Literal, Protocol

import attrs
import structlog

from atlas.backends.base import Backend, DeviceFault, SeqOutcome, SeqWork, StepPlan, StepResult
from atlas.config import Capacities, EngineConfig, derive_capacities, log_capacities
from atlas.engine.factory import TINY_MODEL, build_engine, build_engine_for_loaded
from atlas.engine.outputs import AdmissionError, EngineDead, FinishReason, QueueFull, RequestOutput
from atlas.engine.sampling import SamplingParams
from atlas.engine.scheduler import schedule
from atlas.engine.stopping import StopChecker, Tokenizer
from atlas.state.control import ControlState
from atlas.state.events import (
    EngineFaulted,
    Event,
    FaultInjected,
    InvariantViolated,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    SequencePreempted,
    StepExecuted,
    StepPlanned,
)
from atlas.state.invariants import InvariantViolation, audit, check_invariants
from atlas.state.machines import TransitionRefused

log = structlog.get_logger("atlas.engine")


class EventSink(Protocol):
    def append(self, index: int, step: int, e: Event, digest: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RecordingSink:
    """Keeps events in memory (replay verify, tests)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, Event, str]] = []

    def append(self, index: int, step: int, e: Event, digest: str) -> None:
        self.rows.append((index, step, e, digest))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@attrs.frozen
class EngineStats:
    step: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    invariant_checks: int
    trace_events_written: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int


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

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
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
        self._emit(RequestArrived(request_id, seq_id, prompt, params.to_json(), max_new))
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
        decided = schedule(self.state)
        if decided.idle and not self.state.pending_release:
            return outputs
        step = self.state.step
        for seq_id in decided.preempt:
            self._emit(SequencePreempted(seq_id, len(self.state.seqs[seq_id].blocks), "kv blocks exhausted"))
            self._preemptions += 1
        planned = StepPlanned(step, decided.admitted, decided.seqs, decided.fed, decided.alloc,
                              tuple(self.state.pending_release), decided.preempt)
        self._emit(planned)
        try:
            result = self.backend.execute(self._plan(planned))
        except DeviceFault as exc:
            if exc.fatal:
                self._die(step, f"fatal device fault: {exc}", injected=False)
            self._fail_step(planned, exc, outputs)
            return outputs
        except Exception as exc:  # a non-fatal error fails this step's requests; the engine goes on
            self._fail_step(planned, exc, outputs)
            return outputs
        by_seq = self._outcomes(planned, result)
        tokens = tuple(-1 if o.token is None else o.token for o in by_seq)
        self._emit(StepExecuted(step, tokens))
        self._check_cursors(planned, by_seq)
        self._finish_sampled(planned, by_seq, outputs)
        return outputs

    def _plan(self, planned: StepPlanned) -> StepPlan:
        seqs = self.state.seqs
        work = []
        for seq_id, n in zip(planned.seqs, planned.fed, strict=True):
            seq = seqs[seq_id]
            tokens = seq.cursor.tokens
            start = seq.cursor.computed
            end = start + n
            work.append(SeqWork(seq_id, tuple(tokens[start:end]), start, tuple(seq.blocks), end == len(tokens),
                                seq.params))
        return StepPlan(planned.step, tuple(work), planned.release, planned.reset)

    def _outcomes(self, planned: StepPlanned, result: StepResult) -> list[SeqOutcome]:
        """The backend's outcomes in plan order; a missing or extra outcome or token is a desync."""
        by_id = {o.seq_id: o for o in result.outcomes}
        ordered = [by_id.get(seq_id) for seq_id in planned.seqs]
        problem = None
        if result.step != planned.step or len(result.outcomes) != len(planned.seqs) or None in ordered:
            problem = "one outcome per planned sequence"
        else:
            seqs = self.state.seqs
            for seq_id, n, o in zip(planned.seqs, planned.fed, ordered, strict=True):
                c = seqs[seq_id].cursor
                sample = c.computed + n == len(c.tokens)
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

    def _finish_sampled(self, planned: StepPlanned, outcomes: list[SeqOutcome], out: list[RequestOutput]) -> None:
        seqs = self.state.seqs
        tokenizer = self.tokenizer if self._detokenize else None
        for o in outcomes:
            token = o.token
            if token is None:
                continue
            self._generated_tokens += 1
            seq = seqs[o.seq_id]
            stop = self._stops[o.seq_id]
            ended = stop.on_token(token, tokenizer)
            p = seq.params
            out.append(RequestOutput(
                seq.request_id,
                new_token_ids=(token,),
                new_logprobs=(o.logprob,) if p.logprobs and o.logprob is not None else (),
                new_top_logprobs=(o.top_logprobs,) if p.logprobs and p.top_logprobs else (),
                finished=ended is not None,
                finish_reason=None if ended is None else ended[0],
                finish_detail=None if ended is None else ended[1],
                prompt_tokens=seq.cursor.prompt_len,
                completion_tokens=seq.cursor.generated,
                new_text=stop.take_text(ended is not None) if tokenizer is not None else "",
            ))
            if ended is not None:
                self._emit(RequestFinished(o.seq_id, ended[0].value, ended[1]))
                del self._stops[o.seq_id]

    # ------------------------------------------------------------------------------------------ faults

    def _error_finish(self, seq_id: int, detail: str, out: list[RequestOutput]) -> None:
        seq = self.state.seqs[seq_id]
        request_id, prompt_len, generated = seq.request_id, seq.cursor.prompt_len, seq.cursor.generated
        self._emit(RequestFinished(seq_id, FinishReason.ERROR.value, detail))
        self._stops.pop(seq_id, None)
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
        )

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None
