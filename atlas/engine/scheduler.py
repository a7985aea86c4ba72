"""The batching decision: a pure function from the control-plane state to the next step's work.

Continuous batching under one token budget per step (Capacities.max_batch_tokens): running sequences
first, in arrival order (a decode takes one token, an unfinished prefill takes a chunk of what is left),
then waiting sequences in arrival order while budget, batch slots and free KV blocks allow. When a
running sequence needs a KV block and none is free, the newest running sequence is preempted (its blocks
freed, every cursor reset; it is recomputed later), possibly itself. Nothing here mutates the state: the
decisions become events that the engine applies.

Aligned chunks (Capacities.prefill_align = A > 0): a prefill chunk runs from where the prompt stands to the
next multiple of A (or the prompt's end, or a branch / snapshot point before either), never further, so a
prompt's chunk boundaries are the same whatever else shares the step and its prefill kernels see the same
shapes (issue 15.4: `cuda-invariant` gave 3 distinct completions in 30 of one prompt under varying load,
because the chunks followed the budget the other sequences left). When the budget left is smaller than that
chunk, the sequence feeds nothing this step (a running one waits for the next step, a waiting one is not
admitted and, first come first served, nor is anyone behind it): a shorter chunk would end at a
load-dependent point. derive_capacities keeps A <= max_batch_tokens - (max_batch_size - 1) * verify_width, so a
full chunk always fits beside every other sequence's decode or verify; only other prefill chunks can push one
back, and those are older and finish. A = 0: chunks as the budget allows (the behaviour before A; traces
recorded before it replay as recorded).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any, NamedTuple

import numpy as np

from atlas.state.batch_columns import BatchColumns
from atlas.state.control import ControlState
from atlas.state.prefix import free_order


class Schedule(NamedTuple):
    preempt: tuple[int, ...] = ()
    admitted: tuple[int, ...] = ()
    seqs: tuple[int, ...] = ()
    fed: tuple[int, ...] = ()
    alloc: tuple[tuple[int, ...], ...] = ()
    drafts: tuple[int, ...] = ()  # drafts verified per sequence (aligned with seqs); () when none drafts

    @property
    def idle(self) -> bool:
        return not self.seqs and not self.preempt


class _FreeBlocks:
    """The pool's free blocks as this step would hand them out, without touching the pool: blocks freed by
    this step's preemptions first (newest first), then the pool's free list from its end."""

    def __init__(self, free: dict[int, None], cached: dict[int, int] | None = None) -> None:
        # prefix-cached blocks last, LRU first (none cached: the pool's own order, newest freed first)
        self._base: Iterator[int] = free_order(free, cached) if cached else reversed(free)
        self.available = len(free)
        self._reclaimed: list[int] = []

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(self._reclaimed.pop() if self._reclaimed else next(self._base))
        self.available -= n
        return out

    def one_each(self, ids: Iterable[int], n: int) -> list[tuple[int, int]]:
        """(seq_id, block) for n sequences taking one block each, in order: take(1) per sequence (one zip when
        nothing was given back)."""
        self.available -= n
        if self._reclaimed:
            self.available += n
            return [(seq_id, *self.take(1)) for seq_id in ids]
        return list(zip(ids, islice(self._base, n), strict=True))

    def give_back(self, blocks: list[int]) -> None:
        self._reclaimed.extend(blocks)
        self.available += len(blocks)


def batch(state: ControlState, drafts: Mapping[int, int] | None = None) -> Schedule:
    """`drafts`: how many drafts each decoding sequence offers. A verify takes 1 + drafts tokens of budget
    and KV for all of them; drafts are cut to what the budget leaves, never below a plain decode."""
    drafts = drafts or {}
    caps = state.caps
    bs = caps.block_size
    budget = caps.max_batch_tokens
    free = _FreeBlocks(state.pool.free, state.prefix.hash_of if state.prefix is not None else None)
    seqs = state.seqs
    preempted: list[int] = []
    work: list[int] = []
    fed: list[int] = []
    alloc: list[tuple[int, ...]] = []
    verified: list[int] = []

    # no prefix cache, no aligned chunks: _chunk is min(tokens left, budget), inlined (two calls a sequence were
    # ~a third of this loop at batch 64, benchmarks/control_plane.py)
    plain = state.prefix is None and not caps.prefill_align
    cols = state.batch
    running = state.running
    head: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # the running sequences' (seqs, fed) from the columns
    if cols is not None and plain and not drafts and cols.fed is None and list(cols.ids) == running:
        fast = _running_from_columns(cols, budget, free)
        if fast is not None:
            head, alloc, budget = fast[:2], fast[2], fast[3]
            running = []  # every running sequence decided, exactly as the loop below decides them
            if not state.waiting or not budget or caps.max_batch_size <= len(head[0]):  # nothing to admit
                return Schedule((), (), head[0], head[1], tuple(alloc))
    victims = list(state.running) if running else []  # newest last: preemption takes from the end
    for seq_id in running:
        if budget == 0:
            break
        if seq_id in preempted:
            continue
        seq = seqs[seq_id]
        c = seq.cursor
        computed = c.computed
        if plain:
            n = len(c.tokens) - computed
            if n > budget:
                n = budget
        else:
            n = _chunk(state, seq, computed, budget)
        if n == 0:  # its aligned chunk does not fit in what this step's budget has left: next step
            continue
        k = min(drafts.get(seq_id, 0), budget - n) if drafts and c.decoding else 0  # no drafts: k is 0
        if k:  # drafts never preempt anyone: cut them to the blocks that are free
            k = max(0, min(k, (len(seq.blocks) + free.available) * bs - computed - n))
        need = -(-(computed + n + k) // bs) - len(seq.blocks)
        while need > free.available:
            victim = victims.pop()
            preempted.append(victim)
            free.give_back(seqs[victim].blocks)
            if victim == seq_id:
                break
        if seq_id in preempted:
            continue
        work.append(seq_id)
        fed.append(n)
        verified.append(k)
        budget -= n + k
        if need > 0:
            alloc.append((seq_id, *free.take(need)))

    # admissions: not in a step that had to preempt (it would only thrash), in arrival order, FCFS
    admitted: list[int] = []
    if not preempted:
        slots = caps.max_batch_size - len(state.running)
        for seq_id in state.waiting:
            if budget == 0 or slots == 0:
                break
            seq = seqs[seq_id]
            n = _chunk(state, seq, 0, budget, cold=True)
            need = -(-n // bs)
            if n == 0 or need > free.available:
                break
            admitted.append(seq_id)
            work.append(seq_id)
            fed.append(n)
            verified.append(0)
            alloc.append((seq_id, *free.take(need)))
            budget -= n
            slots -= 1
    return Schedule(
        preempt=tuple(preempted),
        admitted=tuple(admitted),
        seqs=head[0] + tuple(work) if work else head[0],  # the columns' own tuples when nothing is admitted
        fed=head[1] + tuple(fed) if fed else head[1],
        alloc=tuple(alloc),
        drafts=tuple(verified) if any(verified) else (),
    )


def _running_from_columns(cols: BatchColumns, budget: int, free: _FreeBlocks
                          ) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, ...]], int] | None:
    """batch's loop over the running queue, from the engine's batch columns (atlas.state.batch_columns), when its
    outcome is the plain one: every sequence feeds all it has left (>= 1; a decode: 1), their sum fits the budget
    and the blocks they need are free, so the loop would neither stop on the budget nor preempt. Then it feeds each
    in order, and takes the blocks each needs from `free` in the same order. (work, fed, alloc, budget left), or
    None (the loop decides, from the objects). At batch 64 the loop's field reads were ~8% of the control plane."""
    if cols.next_decode:  # every row feeds one token: a block for exactly the rows whose tokens fill theirs
        total = len(cols.ids)
        if total > budget:
            return None
        fed = cols.ones  # the same tuple objects every decode step: the event's converters pass them at once
        rows = cols.short_rows()  # computed <= blocks: 1 block at most (StepPlanned's check reads the same list)
        counts: list[int] = []  # one block each
        wanted = len(rows)
    else:
        n = cols.ntok - cols.computed
        total = int(n.sum())
        if total > budget or int(n.min()) < 1:
            return None
        fed = tuple(n.tolist())
        need = -((cols.computed + n) // -cols.bs) - cols.nblocks
        rows = np.flatnonzero(need > 0).tolist()
        counts = need[rows].tolist() if rows else []
        wanted = sum(counts)
    if rows:
        if wanted > free.available:
            return None
        ids = cols.ids
        if cols.next_decode:  # one block a short row (a decode step's allocation: every row at once, often)
            alloc = free.one_each(ids if len(rows) == len(ids) else map(ids.__getitem__, rows), len(rows))
        else:
            alloc = [(ids[r], *free.take(k)) for r, k in zip(rows, counts, strict=True)]
    else:
        alloc = []
    return cols.ids, fed, alloc, budget - total


def _chunk(state: ControlState, seq: Any, computed: int, budget: int, *, cold: bool = False) -> int:
    """How many tokens the sequence feeds this step from `computed` (a decode: 1), within `budget`; 0 when its
    aligned chunk does not fit (see the module docstring)."""
    left = len(seq.cursor.tokens) - computed
    align = state.caps.prefill_align
    if not align:
        return _to_branch(state, seq, computed, min(left, budget), cold=cold)
    n = _to_branch(state, seq, computed, min(left, align - computed % align), cold=cold)
    return n if n <= budget else 0


def _to_branch(state: ControlState, seq: Any, computed: int, n: int, *, cold: bool = False) -> int:
    """A prefill chunk of `n` tokens from `computed`, cut to end at the first branch point inside it, so the
    prefix cache snapshots the recurrent state there (every prefill chunk's end is snapshotted): the request's
    snapshot_points (the server's chat message boundaries), and for a cold admission the end of the full blocks
    it shares with a cached chain that has no snapshot there (where this prompt branches off another: Marconi's
    insertion at branch points; not for a preempted sequence coming back, whose own blocks those are). Prefix
    caching off: chunks are never cut."""
    if state.prefix is None or n <= 1:
        return n
    tokens = seq.cursor.tokens
    points = [p for p in seq.params.snapshot_points if computed < p < computed + n]
    if cold and seq.preemptions == 0:  # a preempted one finds its own old blocks: no branch there
        shared = len(state.prefix.matched_blocks(tokens)[0]) * state.caps.block_size
        if computed < shared < min(computed + n, len(tokens)):
            points.append(shared)
    return min(points, default=computed + n) - computed
