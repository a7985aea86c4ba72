"""The engine's side of prefix caching and the drafter carry, kept out of `Engine.step`'s way.

Per step, each a generator of events that reads the live state between them (the engine applies every
event before the next decision is made):
- `admit` (before the scheduler): each waiting sequence whose tokens hit the cache starts running from the
  hit (PrefixCacheHit, then CarryAdopted when it keeps the carried drafter rows);
- `admitted` (the scheduler's cold admissions): a cold new turn releases the carried entry (CarryReleased);
- `after_step`: every sequence that fed a prefill chunk this step stores a snapshot where the chunk ended
  (PrefixSnapshotted), and warm/cold drafter coverage is sampled when a prompt's prefill completes;
- `on_finish` (before a stop/length RequestFinished): a snapshot at the sequence's end and, with the drafter
  context on, its drafter rows as the carried entry (CarryStored).
Decisions depend only on the control-plane state, so replay reproduces them.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import structlog

from atlas.config import Capacities
from atlas.engine.outputs import FinishReason
from atlas.state.control import ControlState
from atlas.state.events import (
    CarryAdopted,
    CarryReleased,
    CarryStored,
    Event,
    PrefixCacheHit,
    PrefixSnapshotted,
)
from atlas.state.machines import Sequence
from atlas.state.prefix import expected_first_key, free_order
from atlas.state.prefix_index import plan_adoption

log = structlog.get_logger("atlas.prefix")


@attrs.define
class PrefixStats:
    queries: int = 0  # admissions looked up (hits + cold admissions)
    hits: int = 0
    tokens_saved: int = 0  # prefill tokens not fed thanks to hits (the resume positions)
    tokens_replayed: int = 0  # cached-block tokens fed again (between the snapshot and the matched blocks)
    carry_adopted: int = 0
    carry_rows_kept: int = 0
    carry_rows_appended: int = 0
    # drafter rows / prompt length when a new turn's prefill completes, warm (prefix hit) and cold turns
    warm_prompt_tokens: int = 0
    warm_drafter_rows: int = 0
    cold_prompt_tokens: int = 0
    cold_drafter_rows: int = 0

    @property
    def warm_coverage(self) -> float:
        return self.warm_drafter_rows / self.warm_prompt_tokens if self.warm_prompt_tokens else 0.0

    @property
    def cold_coverage(self) -> float:
        return self.cold_drafter_rows / self.cold_prompt_tokens if self.cold_prompt_tokens else 0.0


class PrefixLane:
    def __init__(self, caps: Capacities) -> None:
        self.caps = caps
        self.stats = PrefixStats()
        self._turns: dict[int, bool] = {}  # new turns whose prefill is running -> warm (hit) or cold

    # -- admission ------------------------------------------------------------------------------------

    def admit(self, state: ControlState) -> Iterator[Event]:
        cache = state.prefix
        assert cache is not None
        caps, bs, pool, step = self.caps, self.caps.block_size, state.pool, state.step
        slots = caps.max_batch_size - len(state.running)
        available = len(pool.free)
        # arrival order, only as many as there are batch slots (a sequence waiting for a slot is not hashed again
        # every step); a miss leaves the sequence to the scheduler's cold admission
        for seq_id in state.waiting[:max(0, slots)]:
            seq = state.seqs[seq_id]
            if seq.params.prompt_logprobs is not None:  # every prompt position must be fed to be scored
                continue
            tokens = seq.cursor.tokens
            hit = cache.lookup(tokens)
            if hit is None:
                continue
            revived = sum(1 for b in hit.blocks if pool.refs[b] == 0)
            need = -(-min(len(tokens), hit.position + caps.max_batch_tokens) // bs) - len(hit.blocks)
            if available - revived < need:  # the first chunk's blocks must be free; no preemption for a hit
                break
            tail = -1
            if hit.position % bs:
                tail = next(b for b in free_order(pool.free, cache.hash_of) if b not in hit.blocks)
            first, last, adopt, release = self._drafter_keys(state, seq, hit.position)
            if release:
                yield CarryReleased(step, "unusable")
            yield (PrefixCacheHit(step, seq_id, hit.key, hit.position, hit.matched, hit.replay, hit.blocks, tail,
                                first, last))
            if adopt is not None:
                appended = len(tokens) - 2 - adopt.last_pair_key
                yield CarryAdopted(step, seq_id, adopt.rows, appended, adopt.common)
                self.stats.carry_adopted += 1
                self.stats.carry_rows_kept += adopt.rows
                self.stats.carry_rows_appended += appended
            self.stats.queries += 1
            self.stats.hits += 1
            self.stats.tokens_saved += hit.position
            self.stats.tokens_replayed += hit.replay
            if seq.preemptions == 0:
                self._turns[seq_id] = True
            available -= revived + need

    def _drafter_keys(self, state: ControlState, seq: Sequence, position: int):
        """The drafter keys a hit starts with: the carry's usable rows, else none from the snapshot on; and
        whether the carry goes first, when the prompt cannot use it (one slot: it is another session's)."""
        if not seq.drafter.mtp:
            return 0, -1, None, False
        adopt = None
        release = False
        if state.carry is not None and seq.preemptions == 0:
            adopt = plan_adoption(state.carry, seq.cursor.tokens, position)
            release = adopt is None
        if adopt is not None:
            return adopt.first_key, adopt.last_pair_key, adopt, False
        first = expected_first_key(state, seq, position)
        return first, first - 1, None, release

    def admitted(self, state: ControlState, admitted: tuple[int, ...]) -> Iterator[Event]:
        """Cold admissions (the scheduler's): counted as queries; a new cold turn releases the carry."""
        released = False
        for seq_id in admitted:
            seq = state.seqs[seq_id]
            self.stats.queries += 1
            if seq.preemptions == 0:
                self._turns[seq_id] = False
                if state.carry is not None and not released:
                    released = True
                    yield CarryReleased(state.step, "cold turn")

    # -- snapshots and the carry ----------------------------------------------------------------------

    def after_step(self, state: ControlState, prefilled: list[int], step: int) -> Iterator[Event]:
        for seq_id in prefilled:
            seq = state.seqs.get(seq_id)
            if seq is None or not seq.on_device or seq.cursor.computed == 0:
                continue
            yield from self._snapshot(state, seq, step)
            if seq_id in self._turns and seq.cursor.computed >= seq.cursor.prompt_len:
                self._coverage(seq, self._turns.pop(seq_id))

    def on_finish(self, state: ControlState, seq: Sequence, reason: FinishReason, step: int) -> Iterator[Event]:
        """Before a finished sequence's RequestFinished: its end becomes a snapshot and, with the drafter
        context on, its drafter rows the carried entry. An error's state is not trusted: nothing is kept."""
        self._turns.pop(seq.seq_id, None)
        if reason not in (FinishReason.STOP, FinishReason.LENGTH) or not seq.on_device or seq.cursor.computed == 0:
            return
        yield from self._snapshot(state, seq, step)
        d = seq.drafter
        if self.caps.drafter_context and d.mtp and d.rows:
            yield CarryStored(step, seq.seq_id, d.first_key, d.last_pair_key)

    def _snapshot(self, state: ControlState, seq: Sequence, step: int) -> Iterator[Event]:
        cache = state.prefix
        assert cache is not None
        snap = cache.snapshot_for(seq.cursor.tokens, seq.cursor.computed, seq.prefix_chain)
        evicted = cache.placement(snap.key)
        if evicted is not None:
            yield PrefixSnapshotted(step, seq.seq_id, snap.position, snap.key, evicted)

    def _coverage(self, seq: Sequence, warm: bool) -> None:
        if not seq.drafter.mtp:
            return
        if warm:
            self.stats.warm_prompt_tokens += seq.cursor.prompt_len
            self.stats.warm_drafter_rows += seq.drafter.rows
        else:
            self.stats.cold_prompt_tokens += seq.cursor.prompt_len
            self.stats.cold_drafter_rows += seq.drafter.rows
