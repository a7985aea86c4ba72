"""Events: the only way the control-plane state changes, and what the trace records.

Each event is a frozen attrs class with a `kind` and a schema `version`; its payload is its fields as plain
JSON values. Old versions stay readable: an upcaster registered for (kind, version) rewrites a payload to
version + 1, and `decode` applies them in a chain until the current version.

Two families: inputs (the only nondeterminism: arrivals, cancellations, injected faults), which replay
re-drives, and outcomes (what the scheduler decided and the backend produced), which replay compares.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import chain
from typing import Any, ClassVar

import attrs

from atlas.errors import UnknownEvent


class Event:
    """Base of every event. Subclasses are frozen attrs classes registered with @event(kind, version)."""

    kind: ClassVar[str]
    version: ClassVar[int]
    is_input: ClassVar[bool] = False

    def payload(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELD_NAMES[type(self)]}

    def payload_json(self) -> str:
        return _ENCODE(self.payload())


# json.dumps(payload, separators=(",", ":")) with its encoder built once: dumps builds a new JSONEncoder per
# call when given separators (a third of the cost of encoding a batch-64 step event); same output
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


EVENT_TYPES: dict[str, type[Event]] = {}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
# (kind, version) -> function rewriting a payload of that version to version + 1
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def event(kind: str, version: int, *, is_input: bool = False) -> Callable[[type], type]:
    def register(cls: type) -> type:
        cls = attrs.frozen(slots=True)(cls)
        cls.kind = kind
        cls.version = version
        cls.is_input = is_input
        if kind in EVENT_TYPES:
            raise ValueError(f"event kind {kind!r} registered twice")
        EVENT_TYPES[kind] = cls
        _FIELD_NAMES[cls] = tuple(f.name for f in attrs.fields(cls))
        return cls

    return register


def upcaster(kind: str, from_version: int) -> Callable[[Callable], Callable]:
    def register(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable:
        UPCASTERS[(kind, from_version)] = fn
        return fn

    return register


def upcast(kind: str, version: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a recorded payload to the current version of its kind."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise UnknownEvent(f"unknown event kind {kind!r}")
    if version > cls.version:
        raise UnknownEvent(f"{kind} version {version} is newer than this engine's {cls.version}")
    while version < cls.version:
        step = UPCASTERS.get((kind, version))
        if step is None:
            raise UnknownEvent(f"no upcaster for {kind} v{version} -> v{version + 1}")
        payload = step(payload)
        version += 1
    return payload


def decode(kind: str, version: int, payload: dict[str, Any]) -> Event:
    return EVENT_TYPES[kind](**upcast(kind, version, payload))


_EXACT_INT = frozenset((int,))
_TUPLE = frozenset((tuple,))


def _ints(value: Any) -> tuple[int, ...]:
    # a tuple of exact ints (what the engine and both trace readers build) is its own conversion: the type test is
    # under half of map(int)'s cost (15 against 35 K instructions at 64, callgrind); anything else (lists, bools,
    # numpy ints) is converted
    if type(value) is tuple and (not value or _EXACT_INT.issuperset(map(type, value))):  # () without the map
        return value
    return tuple(map(int, value))  # map, not a generator: half the cost of building a batch-64 step event


def _remembering_ints() -> Callable[[Any], tuple[int, ...]]:
    """_ints for one field, remembering the last tuple it passed: a tuple is immutable, so the very same object passes
    again at once (the engine's batch columns hand every decode step's StepPlanned the same seqs and fed tuples);
    holding it keeps its identity from being reused by another object."""
    last: list[tuple[int, ...]] = [()]

    def convert(value: Any) -> tuple[int, ...]:
        if value is last[0]:
            return value  # type: ignore[no-any-return]
        out = _ints(value)
        if out is value:
            last[0] = out
        return out

    return convert


_TOKENS_SEEN: list[tuple[int, ...]] = [()]  # the last tuple `exact_tokens` found to be exact ints


def exact_tokens(value: Any) -> bool:
    """True when `value` is a tuple of exact ints (no None, no bool, no numpy int), remembered so that StepExecuted's
    tokens converter takes that very tuple at once: the engine's decode outcome tests its tokens here instead of
    `None in tokens` there and the converter's own type pass again (one C pass over the batch instead of two)."""
    if type(value) is tuple and _EXACT_INT.issuperset(map(type, value)):
        _TOKENS_SEEN[0] = value  # held: its identity cannot be reused while remembered; a tuple of ints never changes
        return True
    return False


def _token_ints(value: Any) -> tuple[int, ...]:
    """StepExecuted.tokens' converter: _ints, but the tuple exact_tokens last passed is its own conversion."""
    if value is _TOKENS_SEEN[0]:
        return value  # type: ignore[no-any-return]
    return _ints(value)


def int_rows(value: Any) -> tuple[tuple[int, ...], ...]:
    if type(value) is tuple and not value:  # () (a step without allocations or drafts): no generator
        return value
    # a tuple of tuples of exact ints (the scheduler's alloc rows) as it is: C-level type tests, no tuple built a row
    if (type(value) is tuple and _TUPLE.issuperset(map(type, value))
            and _EXACT_INT.issuperset(map(type, chain.from_iterable(value)))):
        return value
    return tuple(tuple(map(int, row)) for row in value)


# ---------------------------------------------------------------------------------------------------- inputs


@event("request_arrived", 2, is_input=True)
class RequestArrived(Event):
    request_id: str
    seq_id: int
    prompt: tuple[int, ...] = attrs.field(converter=_ints)
    params: dict[str, Any]  # SamplingParams.to_json()
    max_new: int  # max_tokens, or what max_seq_len leaves when the request gives none
    stream: bool = False  # tokens go to the client as sampled; otherwise held back until the request ends


@upcaster("request_arrived", 1)
def _arrived_v1(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "stream": False}  # v1 predates held-back outputs: every request was streamed per step


@event("request_cancelled", 1, is_input=True)
class RequestCancelled(Event):
    request_id: str
    seq_id: int


@event("fault_injected", 1, is_input=True)
class FaultInjected(Event):
    fault: str  # "step_error" | "fatal"
    request_id: str | None


# -------------------------------------------------------------------------------------------------- outcomes


@event("sequence_preempted", 1)
class SequencePreempted(Event):
    """The reset: blocks freed, every cursor and the recurrent state back to zero, requeued."""

    seq_id: int
    blocks_freed: int
    reason: str


@event("step_planned", 3)
class StepPlanned(Event):
    step: int
    admitted: tuple[int, ...] = attrs.field(converter=_ints)  # waiting -> running this step
    seqs: tuple[int, ...] = attrs.field(converter=_remembering_ints())  # the work, in plan order
    fed: tuple[int, ...] = attrs.field(converter=_remembering_ints())  # tokens fed per sequence
    alloc: tuple[tuple[int, ...], ...] = attrs.field(converter=int_rows)  # (seq_id, block, ...) rows
    release: tuple[int, ...] = attrs.field(converter=_ints)  # data-plane state dropped (finished)
    reset: tuple[int, ...] = attrs.field(converter=_ints)  # data-plane state zeroed (preempted)
    # speculative decoding: drafts verified after the fed token, aligned with seqs (() = a plain feed); the
    # whole field is () when nothing drafts this step
    drafts: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=int_rows)
    # sequences whose content-loop rollback the data plane restores before the work (RingRestore orders)
    restored: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@upcaster("step_planned", 1)
def _planned_v1(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "drafts": []}  # v1 predates speculative decoding


@upcaster("step_planned", 2)
def _planned_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "restored": []}  # v2 restored a rollback between steps, outside any plan


@event("step_executed", 2)
class StepExecuted(Event):
    """Every cursor of every planned sequence moves by its fed count; sampled tokens are appended.

    A verify (drafts planned) moves every cursor by 1 + accepted and appends drafts[:accepted] + (token,):
    the drafts it kept and the target's own token after them. accepted -1: its commit was refused, nothing
    moved, and the request ends with `error` next. `verdicts` (bit i: row i accepted draft i + 1, whatever
    came before) feed the unconditional acceptance rates; both fields are () when nothing drafted."""

    step: int
    tokens: tuple[int, ...] = attrs.field(converter=_token_ints)  # aligned with StepPlanned.seqs; -1 = no sample
    accepted: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    verdicts: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@upcaster("step_executed", 1)
def _executed_v1(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "accepted": [], "verdicts": []}


@event("speculation_latched_off", 1)
class SpeculationLatchedOff(Event):
    """The speculative lane is off for this sequence from here on: the backend cannot apply QSA selection
    per verify row, and a verify from `position` could cross the inert bound. Sticky, decided before any
    verify could cross."""

    step: int
    seq_id: int
    position: int  # the sequence's computed tokens when latched
    inert_bound: int
    reason: str


@event("boundary_snapshotted", 1)
class BoundarySnapshotted(Event):
    """The data plane stored the sequence's state at `position` (its computed tokens) in ring `slot`."""

    step: int
    seq_id: int
    position: int
    slot: int
    evicted: int  # the position whose snapshot the slot held before, -1 if it was free


@event("rolled_back", 2)
class RolledBack(Event):
    """One event rewinds every control-plane cursor to `boundary`: tokens (kept up to `keep`, to be fed again
    from `boundary`), KV (blocks past `keep` freed), QSA keys, GDN and PLE state, drafter rows; `ban_token` is
    banned at position `keep`. The data plane's restore is an order of the next plan (RingRestore); its
    cursors are checked against the control plane's after that step."""

    step: int
    seq_id: int
    boundary: int
    slot: int
    keep: int
    ban_token: int
    blocks_freed: int
    period: int  # the loop's period, as the watchdog saw it
    attempt: int  # 1 for the request's first rollback


@upcaster("rolled_back", 1)
def _rolled_back_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 restored the data plane between steps and recorded its cursors here; v2 checks them after the step
    return {k: v for k, v in payload.items() if k != "cursors"}


@event("rollback_declined", 1)
class RollbackDeclined(Event):
    """A rollback that cannot be made exact, refused before anything moved (RequestFinished follows)."""

    step: int
    seq_id: int
    reason: str  # atlas.engine.rollback.DeclineReason value
    keep: int  # the tokens the rollback would have kept
    period: int


@event("prefix_cache_hit", 1)
class PrefixCacheHit(Event):
    """A waiting sequence starts running from the prefix cache: it shares `blocks` (cached full blocks, a
    reference each), gets `tail_block` (-1: none) for the partial block the snapshot supplies, and every
    cursor moves to `position` (the snapshot's): KV, QSA keys, recurrent and PLE state. `matched`: tokens
    covered by cached blocks; `replay` = matched - position of them are recomputed. The drafter holds keys
    drafter_first_key .. drafter_last_key (none when last < first): adopted from the carry, or none."""

    step: int
    seq_id: int
    key: int
    position: int
    matched: int
    replay: int
    blocks: tuple[int, ...] = attrs.field(converter=_ints)
    tail_block: int
    drafter_first_key: int
    drafter_last_key: int


@event("prefix_snapshotted", 1)
class PrefixSnapshotted(Event):
    """The data plane stores the sequence's recurrent state at `position` (its computed tokens) as prefix
    snapshot `key` before the next step's work, evicting snapshot `evicted` (-1: none)."""

    step: int
    seq_id: int
    position: int
    key: int
    evicted: int


@event("carry_stored", 1)
class CarryStored(Event):
    """A finishing sequence's drafter rows (keys first_key .. last_pair_key) become the one carried entry,
    replacing any other; the data plane keeps them when it releases the sequence."""

    step: int
    seq_id: int
    first_key: int
    last_pair_key: int


@event("carry_adopted", 1)
class CarryAdopted(Event):
    """A prefix hit kept `rows_kept` carried drafter rows (the prompt agrees with the carried tokens on
    `common` tokens); `rows_to_append` pair keys are missing and come from its own prefill."""

    step: int
    seq_id: int
    rows_kept: int
    rows_to_append: int
    common: int


@event("carry_released", 1)
class CarryReleased(Event):
    step: int
    reason: str  # "cold turn", "unusable"


@event("request_finished", 1)
class RequestFinished(Event):
    seq_id: int
    reason: str  # FinishReason value
    detail: str


@event("engine_faulted", 1)
class EngineFaulted(Event):
    step: int
    fatal: bool
    error: str
    injected: bool


@event("invariant_violated", 1)
class InvariantViolated(Event):
    event_index: int
    machine: str
    message: str
    fields: dict[str, Any]


INPUT_KINDS = tuple(k for k, cls in EVENT_TYPES.items() if cls.is_input)
