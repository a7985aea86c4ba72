"""StepPlanned's block allocation over the engine's batch columns (atlas.state.batch_columns): many alloc rows in one
pass, and the whole columns at once when every row takes one block. A mixin of `BatchColumns`, whose columns it
reads and writes (every one of them defined there); it moves the pool, the sequences' block lists and fingerprints
and the block columns exactly as `BatchColumns.add_blocks` row by row would."""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from atlas.state.columns import K_BLOCKS, K_COMPUTED_QSA, K_LEN, K_RUNNING, count_nonzero, fingerprint_columns
from atlas.state.machines import BlockPool

_U = np.uint64
_I = np.int64
_A_ONE_I = np.array(1, _I)  # 0-d constants (columns.mix64_column's note: ~0.2 us less a ufunc call than a scalar's)
_A_K_BLOCKS = np.array(K_BLOCKS)
_PAIR = frozenset((2,))  # an alloc row (seq_id, block)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def one_block_each(alloc: tuple[tuple[int, ...], ...], ids: tuple[int, ...]) -> bool:
    """`alloc` gives every row of `ids`, in order, exactly one block (a decode's allocation when the rows' tokens
    reach their blocks' end together): the form plan_hash and allocate take as whole columns."""
    return len(alloc) == len(ids) and _PAIR.issuperset(map(len, alloc)) and tuple(map(_FIRST, alloc)) == ids


def second_column(alloc: tuple[tuple[int, ...], ...]) -> list[int]:
    """The blocks of an allocation `one_block_each` accepted, by row."""
    return list(map(_SECOND, alloc))


class BatchAllocation:
    """BatchColumns' StepPlanned allocation (no state of its own)."""

    __slots__ = ()

    def allocate(self, pool: BlockPool, alloc: tuple[tuple[int, ...], ...]) -> tuple[int, list[int]] | None:
        """StepPlanned's allocation of `alloc`'s rows (seq_id, block, ...), every seq_id a row here and once, as one
        pass: the blocks taken from the pool (StepPlanned's check proved each free, in range and claimed once), each
        sequence's blocks extended, the block columns moved, the rows' fingerprints as advance computes them (only
        their blocks term moved) and `_holds`'s conditions on them: an allocation moves only the block count, under
        which every condition but `(blocks - 1) * bs < len(tokens)` held before (a sequence's fields move only in a
        transition, each checked after it) and holds after (computed <= blocks * bs stays true with more blocks).
        Returns (the digest's change, the ids failing that condition, in alloc order), or None having moved nothing
        (a seq_id twice or not a row: the per-row path). add_blocks' arithmetic for many rows at once: at batch 64 an
        allocation step of every row was ~60 K instructions a row on that path."""
        if one_block_each(alloc, self.ids):
            return self._allocate_every_row(pool, second_column(alloc))
        row = self.row
        rows = [row.get(a[0], -1) for a in alloc]
        if min(rows) < 0 or len(set(rows)) != len(rows):
            return None
        free, refs = pool.free, pool.refs
        objs = self.objs
        tables = self.tables
        taken = 0
        for r, a in zip(rows, alloc, strict=True):
            for b in a[1:]:
                del free[b]
                refs[b] = 1
            blocks = objs[r].blocks
            blocks.extend(a[1:])
            taken += len(a) - 1
            tables[r] = tuple(blocks)
        pool.used += taken
        self.tables_moved = True
        idx = np.array(rows, dtype=np.intp)
        bs = self.bs
        nb = self.nblocks[idx] + np.array([len(a) - 1 for a in alloc], dtype=_I)
        self.nblocks[idx] = nb
        limit = np.minimum(self.capacity[idx], nb * bs)
        self.limit[idx] = limit
        low = (nb - 1) * bs
        self.low[idx] = low
        term = nb.view(_U) * K_BLOCKS + K_RUNNING
        self.blocks_term[idx] = term
        ntok = self.ntok[idx]
        terms = ntok.view(_U) * K_LEN + self.computed[idx].view(_U) * K_COMPUTED_QSA + term
        self.terms[idx] = terms
        self.hi[idx] = np.minimum(limit, self.budget_end[idx] - 1)
        self.short = None
        self.slack = None
        h = fingerprint_columns(self.token_hash[idx] ^ self.hid[idx], terms)  # advance's fingerprint arithmetic for these rows
        change = int(np.bitwise_xor.reduce(self.fp[idx] ^ h))
        self.fp[idx] = h
        for r, fp in zip(rows, h.tolist(), strict=True):
            objs[r].fingerprint = fp
        ok = ntok > low
        suspects = [] if count_nonzero(ok) == len(rows) else [alloc[i][0] for i in np.flatnonzero(~ok).tolist()]
        return change, suspects

    def _allocate_every_row(self, pool: BlockPool, new: list[int]) -> tuple[int, list[int]]:
        """allocate's pass when every row, in row order, takes one block (`new`, by row): what the batch's decode
        allocation is when the rows' tokens reach the end of their blocks together (one prompt length). The same
        moves on whole columns instead of gathered and scattered rows: one more block a row moves the block count by
        1, `low` by bs, the blocks term and the fingerprint terms by K_BLOCKS (mod 2**64), and `limit` and `hi` are
        computed again."""
        free, refs = pool.free, pool.refs
        tables = []
        add = tables.append
        for seq, b in zip(self.objs, new, strict=True):
            del free[b]
            refs[b] = 1
            blocks = seq.blocks
            blocks.append(b)
            add(tuple(blocks))
        self.tables = tables
        self.tables_moved = True
        pool.used += len(new)
        bs = self.bs
        nb = self.nblocks = self.nblocks + _A_ONE_I
        limit = self.limit = np.minimum(self.capacity, nb * bs)
        low = self.low = self.low + bs
        self.blocks_term = self.blocks_term + _A_K_BLOCKS
        terms = self.terms = self.terms + _A_K_BLOCKS
        self.hi = np.minimum(limit, self.budget_end - _A_ONE_I)
        self.short = None
        self.slack = None
        h = fingerprint_columns(self.token_hash ^ self.hid, terms)
        change = int(np.bitwise_xor.reduce(self.fp ^ h))
        self.fp = h
        for seq, fp in zip(self.objs, h.tolist(), strict=True):
            seq.fingerprint = fp
        ok = self.ntok > low
        suspects = [] if count_nonzero(ok) == len(new) else [self.ids[i] for i in np.flatnonzero(~ok).tolist()]
        return change, suspects
