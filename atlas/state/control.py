"""ControlState: every state machine of the engine, changed only by `apply(event)`.

The transitions live beside it, one module per family (atlas.state.requests, .steps, .prefix), each
registering its handlers with `transition(EventType)`; `atlas.state` imports them all, so a ControlState is
always complete. A handler validates everything first, refuses (TransitionRefused) before mutating, and
returns the ids of the sequences it touched: `apply` refreshes their share of the digest, and invariants
are checked where state moved (cheap at batch 256).

The digest is kept incrementally: each sequence carries a 64-bit fingerprint of its fields, the digest is
the XOR of them with the global fields, all mixed with splitmix64 (atlas.hashing): the same in every
process, so a replay compares digests directly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from atlas.config import Capacities
from atlas.errors import TransitionRefused
from atlas.hashing import MASK64 as _M
from atlas.hashing import mix64
from atlas.state.batch_columns import BatchColumns
from atlas.state.columns import K_BLOCKS, K_ID, K_RUNNING, StepColumns, mix_columns
from atlas.state.events import Event, RequestArrived, RequestFinished, StepExecuted, StepPlanned
from atlas.state.machines import BlockPool, Phase, Sequence
from atlas.state.orders import PlanOrders
from atlas.state.prefix_index import CarriedEntry, PrefixCache

Handler = Callable[[Any, Any], tuple[int, ...]]
Ints = list[int] | tuple[int, ...]
_HANDLERS: dict[type, Handler] = {}


def transition(kind: type[Event]) -> Callable[[Handler], Handler]:
    """Register the ControlState transition for one event type."""

    def register(fn: Handler) -> Handler:
        if kind in _HANDLERS:
            raise ValueError(f"a transition for {kind.__name__} is registered twice")
        _HANDLERS[kind] = fn
        return fn

    return register


def sequence_fingerprint(seq: Sequence) -> int:
    """64 bits over every field the sequence's machines hold. Two mixing rounds: this runs once per
    sequence per step, and it is most of the digest's cost at batch 256. mix64 is written out inline (the
    same arithmetic as atlas.hashing.mix64): two calls were a third of this function's cost."""
    c = seq.cursor
    h = (c.token_hash ^ (seq.seq_id * 0x9E3779B97F4A7C15)) & _M
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M
    h ^= h >> 31
    ring = seq.ring.snapshots
    d = seq.drafter
    h += (len(c.tokens) * 0xC2B2AE3D27D4EB4F + c.computed * 0x165667B19E3779F9 + c.phase * 0xD6E8FEB86659FD93
          + len(seq.blocks) * 0xFF51AFD7ED558CCD + seq.qsa.ingested * 0xC4CEB9FE1A85EC53
          + d.rows * 0x27D4EB2F165667C5 + len(ring) * 0x94D049BB133111EB
          + seq.preemptions * 0xBF58476D1CE4E5B9 + d.latched * 0x2545F4914F6CDD1D)
    if ring or seq.rollbacks:  # rare fields: one more round only when they are in use
        last, slot = ring[-1] if ring else (-1, -1)
        h = mix64(h ^ (last * 0x9E3779B97F4A7C15 + slot * 0xC2B2AE3D27D4EB4F + seq.rollbacks * 0x165667B19E3779F9))
    h &= _M
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M
    return h ^ (h >> 31)


def common_fingerprint(th: int, seq_id: int, n: int, end: int, phase: int, blocks: int, preemptions: int,
                       latched: int) -> int:
    """sequence_fingerprint of a sequence without its rare fields (no ring snapshots, rollbacks, drafter rows),
    computed == qsa.ingested == `end`, from the fields a step's advance already holds (the hot paths of
    atlas/state/steps.py and advance.py; tested equal to sequence_fingerprint in tests/test_state_batched.py)."""
    h = (th ^ (seq_id * 0x9E3779B97F4A7C15)) & _M
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M
    h = (h ^ (h >> 31)) + (n * 0xC2B2AE3D27D4EB4F + end * 0x165667B19E3779F9 + phase * 0xD6E8FEB86659FD93
                           + blocks * 0xFF51AFD7ED558CCD + end * 0xC4CEB9FE1A85EC53
                           + preemptions * 0xBF58476D1CE4E5B9 + latched * 0x2545F4914F6CDD1D) & _M
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M
    return h ^ (h >> 31)


def fold_fingerprints(state: ControlState, acc: int, rows: list) -> None:
    """The digest share `acc` with `rows` (sequence, token hash, id, length, end, blocks) fingerprinted as columns
    (running_fingerprints) and each sequence's fingerprint replaced; the result is the state's sequence digest."""
    if rows:
        seqs, hashes, ids, lengths, ends, blocks = zip(*rows, strict=True)
        for seq, fp in zip(seqs, running_fingerprints(hashes, ids, lengths, ends, blocks), strict=True):
            acc ^= seq.fingerprint ^ fp
            seq.fingerprint = fp
    state.seq_digest = acc


def running_fingerprints(token_hash: Ints, seq_id: Ints, seq_len: Ints, computed: Ints,
                         blocks: Ints) -> list[int]:
    """sequence_fingerprint of many running sequences at once, each with qsa.ingested == computed and no
    drafter rows, ring snapshots, rollbacks, preemptions or latch (the fields that are then 0): the same
    arithmetic over uint64 columns (numpy wraps mod 2**64 where the scalar form masks). 27 against 68 us for 64
    sequences (benchmarks/replay_check.py's batch); tested against the scalar form."""
    # the five columns in one conversion (one np.array call instead of five: ~1.5 us each at batch 64)
    th, ids, length, done, held = np.array((token_hash, seq_id, seq_len, computed, blocks), dtype=np.uint64)
    return mix_columns(th ^ (ids * K_ID), length, done, held * K_BLOCKS + K_RUNNING).tolist()


_COLUMN_EVENTS = (StepPlanned, StepExecuted)  # the transitions that keep the step columns current
# the transitions that keep the engine's batch columns (atlas.state.batch_columns): the step events themselves, an
# arrival (a new waiting sequence; no running one moves) and a finish (`finish` takes its row out)
_BATCH_EVENTS = (StepPlanned, StepExecuted, RequestArrived, RequestFinished)


class Refreshed(tuple):  # type: ignore[type-arg]
    """The ids a handler touched when it already refreshed their share of the digest itself (the batched
    StepExecuted, in the pass that commits them): `apply` does not walk them again."""

    __slots__ = ()


class Checked(Refreshed):
    """Refreshed, and the handler also ran check_invariants' per-sequence test (`_holds`'s conditions) on each
    touched sequence's state after the event, in that same pass: `suspects` are the ids it could not pass,
    in touched order. check_invariants gives exactly those to check_sequence (which names the broken
    invariant) instead of testing every touched sequence again."""

    suspects: list[int]

    def __new__(cls, ids: tuple[int, ...], suspects: list[int]) -> Checked:
        self = super().__new__(cls, ids)
        self.suspects = suspects
        return self


@attrs.define(slots=True)
class ControlState:
    caps: Capacities
    pool: BlockPool
    step: int = 0
    next_seq_id: int = 0
    seqs: dict[int, Sequence] = attrs.Factory(dict)  # live (not finished) sequences
    by_request: dict[str, int] = attrs.Factory(dict)
    waiting: list[int] = attrs.Factory(list)  # seq ids, ordered by arrival
    running: list[int] = attrs.Factory(list)  # seq ids, ordered by arrival
    pending_release: list[int] = attrs.Factory(list)  # finished with data-plane state still held
    pending_faults: list[tuple[str, str | None]] = attrs.Factory(list)
    inflight: StepPlanned | None = None  # planned, not yet executed
    inflight_hash: int = 0  # the in-flight plan's share of the digest (atlas.hashing.ints_key)
    dead: bool = False
    finished_count: int = 0
    preemptions_total: int = 0  # statistics only (not in the digest)
    outcomes_hash: int = 0  # folds in every finished request's reason and detail, in order
    seq_digest: int = 0  # XOR of the live sequences' fingerprints
    # prefix caching (atlas.state.prefix): the index (None when off) and the drafter carry
    prefix: PrefixCache | None = None
    carry: CarriedEntry | None = None
    # data-plane work the events between two steps queued for the next plan (rollback restores, prefix
    # stores and restores, the carry): the next StepPlanned carries and clears it
    orders: PlanOrders = attrs.Factory(PlanOrders)
    inflight_orders: PlanOrders = attrs.Factory(PlanOrders)  # the in-flight plan's (moved by StepPlanned)
    # sequences an engine error ended (a failed step, a refused verify commit, a fatal fault): their
    # RequestFinished must say `error`, never `stop` or `length`
    failing: set[int] = attrs.Factory(set)
    # columnar steps (atlas.state.columns): on only where nothing but `apply` touches the state (replay check);
    # `columns` holds the current cursors of the last plan's sequences while its objects lag (flush_columns)
    columnar: bool = attrs.field(default=False, eq=False, repr=False)
    columns: StepColumns | None = attrs.field(default=None, eq=False, repr=False)
    # the engine's batch columns (atlas.state.batch_columns): on only in an Engine's state (`batch_cache`); `batch`
    # holds the running queue's cursors, always equal to the objects'; `batch_tried`: the plan whose sequences could
    # not be gathered (not tried again until the plan's sequences change)
    batch_cache: bool = attrs.field(default=False, eq=False, repr=False)
    batch: BatchColumns | None = attrs.field(default=None, eq=False, repr=False)
    batch_tried: tuple[int, ...] = attrs.field(default=(), eq=False, repr=False)
    # digest()'s first three rounds and the counters they were computed from (a cache of a pure function of them)
    digest_memo: tuple[tuple[Any, ...], int] | None = attrs.field(default=None, eq=False, repr=False)
    # the last StepPlanned's rows (seqs, fed, alloc, release, reset, restored, drafts) and their ints_key (the plan's
    # share of the digest: a pure function of them)
    plan_memo: tuple[tuple[Any, ...], int] | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def create(cls, caps: Capacities) -> ControlState:
        prefix = PrefixCache(caps.block_size, caps.prefix_snapshots) if caps.prefix_caching else None
        return cls(caps=caps, pool=BlockPool.create(caps.num_kv_blocks), prefix=prefix)

    # ------------------------------------------------------------------------------------------ digest

    def digest(self) -> str:
        # atlas.hashing.mix64 written out four times (the same arithmetic; this runs after every event, and the four
        # calls were ~a fifth of it). The first three rounds read only the counters below, which a StepExecuted, a
        # finish's RequestFinished after it and most events between two steps leave as they were: those rounds are
        # kept with the counters they were computed from (~16 K instructions of Python integer arithmetic a hit,
        # callgrind; the key ~1.5 K), the last round (the in-flight plan's and the outcomes' hashes) always runs
        key = (self.step, self.pool.used, self.next_seq_id, len(self.waiting), len(self.running), self.finished_count,
               len(self.pending_release), len(self.pending_faults), self.dead)
        memo = self.digest_memo
        if memo is not None and memo[0] == key:
            g = memo[1]
        else:
            g = (self.step ^ (self.pool.used << 20) ^ (self.next_seq_id << 40)) & _M
            g = ((g ^ (g >> 30)) * 0xBF58476D1CE4E5B9) & _M
            g = ((g ^ (g >> 27)) * 0x94D049BB133111EB) & _M
            g = (g ^ (g >> 31) ^ (len(self.waiting) << 32) ^ len(self.running) ^ (self.finished_count << 16)) & _M
            g = ((g ^ (g >> 30)) * 0xBF58476D1CE4E5B9) & _M
            g = ((g ^ (g >> 27)) * 0x94D049BB133111EB) & _M
            g = (g ^ (g >> 31) ^ (len(self.pending_release) << 8) ^ len(self.pending_faults) ^ (self.dead << 62)) & _M
            g = ((g ^ (g >> 30)) * 0xBF58476D1CE4E5B9) & _M
            g = ((g ^ (g >> 27)) * 0x94D049BB133111EB) & _M
            g ^= g >> 31
            self.digest_memo = (key, g)
        g = (g ^ self.inflight_hash ^ self.outcomes_hash) & _M
        g = ((g ^ (g >> 30)) * 0xBF58476D1CE4E5B9) & _M
        g = ((g ^ (g >> 27)) * 0x94D049BB133111EB) & _M
        g ^= g >> 31
        if self.prefix is not None:
            carried = -1 if self.carry is None else self.carry.last_pair_key
            g = mix64(g ^ len(self.prefix.blocks) ^ (len(self.prefix.snapshots) << 24) ^ (carried << 40))
        return f"{g ^ self.seq_digest:016x}"

    def refresh(self, seq: Sequence) -> None:
        """Recompute a live sequence's share of the digest after its fields moved."""
        fp = sequence_fingerprint(seq)
        self.seq_digest ^= seq.fingerprint ^ fp
        seq.fingerprint = fp

    # ------------------------------------------------------------------------------------------- apply

    def apply(self, e: Event) -> tuple[int, ...]:
        """Apply one event; returns the ids of the sequences it touched. Refuses before mutating."""
        handler = _HANDLERS.get(type(e))
        if handler is None:
            raise TransitionRefused("ControlState", f"no transition for event kind {e.kind!r}")
        if self.batch is not None and type(e) not in _BATCH_EVENTS:
            self.batch = None  # another transition may move a running sequence: the objects alone from here
        if self.columns is not None:
            if type(e) not in _COLUMN_EVENTS:  # every other transition reads and writes the objects
                self.flush_columns()
            try:
                touched = handler(self, e)
            except BaseException:
                self.flush_columns()  # a refusal leaves the typed state current (what a report reads)
                raise
        elif self.batch is not None:
            try:
                touched = handler(self, e)
            except BaseException:
                self.batch = None  # a refusal: the columns stand aside (the objects are current)
                raise
        else:
            touched = handler(self, e)
        if isinstance(touched, Refreshed):
            return touched
        seqs = self.seqs
        acc = self.seq_digest
        for seq_id in touched:  # refresh(seq) for each, with the XOR kept in a local
            seq = seqs.get(seq_id)
            if seq is not None:
                fp = sequence_fingerprint(seq)
                acc ^= seq.fingerprint ^ fp
                seq.fingerprint = fp
        self.seq_digest = acc
        return touched

    def flush_columns(self) -> None:
        """Write the step columns back into the sequences and drop them (see atlas.state.columns)."""
        cols = self.columns
        if cols is not None:
            self.columns = None
            cols.flush()

    def seq(self, seq_id: int) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise TransitionRefused("Request", "event for a sequence that is not live (finished or unknown)",
                                    seq_id=seq_id)
        return seq

    def finish(self, seq: Sequence, reason: str, detail: str) -> None:
        """A request ends (finished or cancelled): its blocks are freed, its data-plane state is released by
        the next plan, and its share of the digest goes."""
        # crc32: a stable hash of the text (Python's str hash is salted per process)
        self.outcomes_hash = mix64(self.outcomes_hash ^ (seq.seq_id << 40) ^ zlib.crc32(f"{reason}:{detail}".encode()))
        if seq.blocks:
            self.pool.release(seq.seq_id, seq.blocks)
        if seq.cursor.phase is Phase.WAITING:
            self.waiting.remove(seq.seq_id)
        else:
            self.running.remove(seq.seq_id)
        if seq.on_device:
            self.pending_release.append(seq.seq_id)
        self.seq_digest ^= seq.fingerprint
        if self.batch is not None:
            self.batch = self.batch.without(seq.seq_id)
        self.orders.forget(seq.seq_id)
        self.failing.discard(seq.seq_id)
        seq.end()
        del self.seqs[seq.seq_id]
        del self.by_request[seq.request_id]
        self.finished_count += 1

    def running_between_steps(self, seq_id: int, what: str) -> Sequence:
        """A running sequence the data plane holds, with no step in flight (snapshots, rollbacks, latches)."""
        seq = self.seq(seq_id)
        if self.inflight is not None:
            raise TransitionRefused("Engine", f"{what} while a step is in flight", seq_id=seq_id,
                                    inflight=self.inflight.step)
        if seq.cursor.phase is not Phase.RUNNING or not seq.on_device:
            raise TransitionRefused("SequenceCursor", f"{what} of a sequence the data plane does not hold",
                                    seq_id=seq_id, phase=seq.cursor.phase.name)
        return seq
