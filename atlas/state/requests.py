"""Transitions of a request's lifecycle and of the engine's faults (registered on ControlState)."""

from __future__ import annotations

from atlas.errors import TransitionRefused
from atlas.hashing import roll_tokens
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState, transition
from atlas.state.events import (
    EngineFaulted,
    FaultInjected,
    InvariantViolated,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
)
from atlas.state.machines import FinishReason, Sequence
from atlas.state.orders import PlanOrders


@transition(RequestArrived)
def arrived(state: ControlState, e: RequestArrived) -> tuple[int, ...]:
    if e.seq_id != state.next_seq_id:
        raise TransitionRefused("Request", "sequence ids are given in arrival order",
                                seq_id=e.seq_id, expected=state.next_seq_id)
    if e.request_id in state.by_request:
        raise TransitionRefused("Request", "request id already live", request_id=e.request_id)
    caps = state.caps
    if not e.prompt or len(e.prompt) + e.max_new > caps.max_seq_len or e.max_new < 1:
        raise TransitionRefused("Request", "prompt + budget outside capacity", prompt=len(e.prompt),
                                max_new=e.max_new, max_seq_len=caps.max_seq_len)
    seq = Sequence.arrive(e.seq_id, e.request_id, state.step, SamplingParams.from_json(e.params), e.max_new,
                          list(e.prompt), roll_tokens(0, e.prompt), e.stream, caps.qsa_index_capacity, caps.qsa_ratio,
                          caps.ring_slots, caps.drafter_rows > 0)
    state.next_seq_id += 1
    state.seqs[e.seq_id] = seq
    state.by_request[e.request_id] = e.seq_id
    state.waiting.append(e.seq_id)  # the newest arrival: the end keeps the list ordered
    return (e.seq_id,)


@transition(RequestCancelled)
def cancelled(state: ControlState, e: RequestCancelled) -> tuple[int, ...]:
    seq = state.seq(e.seq_id)
    if seq.request_id != e.request_id:
        raise TransitionRefused("Request", "cancel names another request", seq_id=e.seq_id,
                                request_id=e.request_id, live=seq.request_id)
    state.finish(seq, "cancelled", "")
    return (e.seq_id,)


@transition(RequestFinished)
def finished(state: ControlState, e: RequestFinished) -> tuple[int, ...]:
    seq = state.seq(e.seq_id)
    FinishReason(e.reason)  # refuses an unknown reason
    if state.inflight is not None and e.seq_id in state.inflight.seqs:
        raise TransitionRefused("Request", "finish of a sequence whose step is in flight", seq_id=e.seq_id)
    if e.seq_id in state.failing and e.reason != FinishReason.ERROR.value:
        raise TransitionRefused("Request", "an engine error is reported as `error`, never `stop` or `length`",
                                seq_id=e.seq_id, reason=e.reason, detail=e.detail)
    state.finish(seq, e.reason, e.detail)
    return (e.seq_id,)


@transition(FaultInjected)
def fault_injected(state: ControlState, e: FaultInjected) -> tuple[int, ...]:
    if e.fault not in ("step_error", "fatal"):
        raise TransitionRefused("Engine", "unknown fault kind", fault=e.fault)
    state.pending_faults.append((e.fault, e.request_id))
    return ()


@transition(EngineFaulted)
def faulted(state: ControlState, e: EngineFaulted) -> tuple[int, ...]:
    if e.injected:
        kind = "fatal" if e.fatal else "step_error"
        state.pending_faults = [f for f in state.pending_faults if f[0] != kind]
    # a failed step's data plane cannot be trusted for any sequence its plan named: they end with error next
    if not e.injected and state.inflight is not None:
        state.failing.update(state.inflight.seqs)
        state.failing.update(state.inflight.restored)
    if e.fatal:
        state.failing.update(state.seqs)
        state.dead = True
    state.inflight = None
    state.inflight_hash = 0
    state.inflight_orders = PlanOrders()
    return ()


@transition(InvariantViolated)
def violated(state: ControlState, e: InvariantViolated) -> tuple[int, ...]:
    state.dead = True
    return ()
