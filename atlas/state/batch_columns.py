"""The engine's running decode batch held in numpy columns across the step, written through to the objects.

The replay's StepColumns (atlas.state.columns) let the objects lag and flush them before anything else reads them;
the engine cannot: its planner, settle, lanes, server and tests read the `Sequence` objects between any two events.
So these columns are a cache that is never ahead of the objects: every field a step moves is written to both in the
same transition, and the columns only spare the step the *reads* and the per-sequence arithmetic: `batch` reads the
token counts, computed counts and block counts here, StepPlanned's check and StepExecuted's check, commit, invariant
test and fingerprints are numpy expressions over the batch, `plan_step` builds a decode's SeqWork from the per-row
lists (token, start, block table, params, drafter key) and `cursor_violation` compares the reported cursors with the
computed column. At batch 64 each of those walks read the same few fields of each Sequence through two or three
attribute hops (~48 K instructions a sequence-step, ~3.1 M a step).

Validity: the columns are dropped (`ControlState.batch = None`; the objects are current, so nothing is lost) by any
event other than StepPlanned, StepExecuted and RequestArrived (which creates a waiting sequence and touches no
running one), by either step event that is not the cached batch's plain step, and by any refusal. They are gathered
again after a StepExecuted whose plan was exactly the running queue, every sequence on the common path (running, no
ring snapshots, rollbacks, preemptions, drafter rows, MTP, carry, latch; prefix caching off; no MTP drafter rows in
the capacities). A batch that could not be gathered is not tried again until the plan's sequences change: each of
those conditions, once false for a live sequence, stays false. Only `apply` moves a sequence (every mutation in the
package is in a transition); a test that writes a field directly must set `state.batch = None` (or leave
`state.batch_cache` off, the default of a bare ControlState: only the Engine turns it on).

Here: the columns themselves (gather, a finish's row taken out), StepPlanned's check and digest share, a row's new
blocks, and plan_step's decode work. StepPlanned's allocation of many rows at once is atlas.state.batch_alloc's
`BatchAllocation`, StepExecuted's commit atlas.state.batch_advance's `BatchAdvance`: mixins of this class (methods
over its columns, no state of their own).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat

import numpy as np

from atlas.hashing import MASK64, hash64_after, token_bytes
from atlas.state.batch_advance import BatchAdvance
from atlas.state.batch_alloc import BatchAllocation, one_block_each, second_column
from atlas.state.columns import K_BLOCKS, K_COMPUTED_QSA, K_ID, K_LEN, K_RUNNING, common, count_nonzero
from atlas.state.events import StepPlanned
from atlas.state.machines import Sequence

_U = np.uint64
_I = np.int64
_K_RUNNING_INT = int(K_RUNNING)
_A_ONE_I = np.array(1, _I)  # 0-d (columns.mix64_column's note: ~0.2 us less a ufunc call than a scalar's)
_MIN_ROWS = 16  # steps.VECTOR_MIN: below this many rows numpy's per-call cost loses to the objects' walk


def _plain_request(seq: Sequence) -> bool:
    """plan_step's SeqWork needs nothing per request beyond the columns: no bans, no min_tokens, no prompt logprobs, no
    history for the sampler (SeqWork.history)."""
    p = seq.params
    return not seq.banned and not p.min_tokens and p.prompt_logprobs is None and not p.reads_history


_NOTHING_AFTER = token_bytes([0, 0, 0])  # a plan's rows after the head when it only feeds: release, reset, restored


class BatchColumns(BatchAllocation, BatchAdvance):
    """The running queue `ids` (in order) as columns. Every field here equals the objects' after each event."""

    __slots__ = ("ids", "objs", "cursors", "qsas", "row", "bs", "computed", "ends", "ntok", "token_hash", "nblocks",
                 "capacity", "fp", "hid", "limit", "low", "blocks_term", "budget_end", "params", "tables",
                 "first_keys", "keys_at_zero", "plain", "last", "fed", "decode", "work", "movable", "aligned", "terms", "plan_head",
                 "next_decode", "ones",
                 "hi", "short", "ones_fed", "slack", "tables_moved", "token_range", "flat_alloc",
                 "cursor_target", "ntok_list")

    def __init__(self, ids: tuple[int, ...], objs: list[Sequence], bs: int) -> None:
        self.ids = ids
        self.objs = objs
        self.cursors = cur = [s.cursor for s in objs]
        self.qsas = [s.qsa for s in objs]
        self.row = {s: i for i, s in enumerate(ids)}
        self.ones = (1,) * len(ids)  # a decode step's fed counts
        self.bs = bs
        self.ends = [c.computed for c in cur]  # the computed column as Python ints (plan_step, cursor_violation)
        self.computed = np.array(self.ends, dtype=_I)
        self.ntok = np.array([len(c.tokens) for c in cur], dtype=_I)
        self.token_hash = np.array([c.token_hash for c in cur], dtype=_U)
        self.nblocks = np.array([len(s.blocks) for s in objs], dtype=_I)
        self.capacity = np.array([s.qsa.capacity for s in objs], dtype=_I)
        self.fp = np.array([s.fingerprint for s in objs], dtype=_U)
        self.hid = np.array(ids, dtype=_U) * K_ID
        self.budget_end = np.array([c.prompt_len + s.max_new for c, s in zip(cur, objs, strict=True)], dtype=_I)
        self.limit = np.minimum(self.capacity, self.nblocks * bs)  # KV and QSA keys end within both
        # a decode step's upper bound on the token count before it: within `limit`, and the new token within the
        # budget (n <= limit and n < budget_end as one comparison)
        self.hi = np.minimum(self.limit, self.budget_end - 1)
        self.low = (self.nblocks - 1) * bs  # the tokens reach past this (no block beyond them)
        self.blocks_term = self.nblocks.astype(_U) * K_BLOCKS + K_RUNNING
        # the fingerprint's sum of field terms (token count, computed == QSA keys, blocks, phase) for the fields now
        self.terms = self.ntok.view(_U) * K_LEN + self.computed.view(_U) * K_COMPUTED_QSA + self.blocks_term
        self.params = [s.params for s in objs]
        self.tables = [tuple(s.blocks) for s in objs]
        self.first_keys = [s.drafter.first_key for s in objs]
        self.keys_at_zero = not any(self.first_keys)
        self.plain = all(map(_plain_request, objs))
        # the last token of every row when the last step sampled each (a decode's SeqWork token), else None
        self.last: list[int] | None = [c.tokens[-1] for c in cur]
        # every row has exactly its last token left to feed (its next step is a decode of one token)
        self.next_decode = bool((self.ntok - self.computed == 1).all())
        self.short: list[int] | None = None  # short_rows' memo (None: not computed since ntok or nblocks moved)
        self.slack: tuple[int, int, int] | None = None  # slack_bounds' memo (None: not computed since a column moved)
        self.ones_fed: np.ndarray | None = None  # `ones` as an array (a decode plan's fed column)
        self.fed: np.ndarray | None = None  # the in-flight plan's fed counts (StepPlanned)
        self.decode = False  # the in-flight plan feeds every row its one last token (a decode step)
        # (fed counts, plan_hash's key of the head and a tail, the key of a plan with nothing after the head)
        self.plan_head: tuple[tuple[int, ...], Callable[[bytes], int], int] | None = None
        self.work: tuple | None = None  # the SeqWork tuple decode_work built last (outcome knows its rows decode)
        self.movable = False  # `work` is the engine's to move to a later step (decode_work's `reuse` when built)
        self.tables_moved = True  # a block table changed since decode_work last wrote them into `work`
        # (the tokens tuple outcome checked, its min, its max): advance's bounds of those very tokens
        self.token_range: tuple[tuple[int, ...], int, int] | None = None
        self.flat_alloc: np.ndarray | None = None  # plan_hash's rows (2, seq_id, block) of an every-row allocation
        # (the StepResult outcome's one walk found exactly as a decode of these rows leaves them: in the rows' order,
        # none refused, no prompt logprobs, no stamps, no drafter rows, every other cursor the `ends` given here)
        self.cursor_target: tuple[object, list[int]] | None = None
        self.aligned: object = None  # the StepResult outcome found in the rows' order, none refused
        # (the ntok array, its tolist()): `ntok_values`' memo. ntok is never written in place (every move makes a new
        # array), and the memo holds the array, so `is` identifies it
        self.ntok_list: tuple[np.ndarray, list[int]] | None = None

    @classmethod
    def gather(cls, seqs: dict[int, Sequence], ids: tuple[int, ...], bs: int) -> BatchColumns | None:
        objs = [seqs[s] for s in ids]
        if not all(map(common, objs)):  # the replay columns' common path
            return None
        return cls(ids, objs, bs)

    def without(self, seq_id: int) -> BatchColumns | None:
        """The columns after a running sequence finished (RequestFinished between steps): its row taken out of every
        column, in place (a finish every few steps at batch 64 would otherwise cost a scalar step and a gather),
        or None when a plan is in flight or the batch gets too small for columns."""
        r = self.row.get(seq_id)
        if r is None:
            return self
        if self.fed is not None or len(self.ids) <= _MIN_ROWS:
            return None
        ids = list(self.ids)
        del ids[r]
        self.ids = tuple(ids)
        self.row = {s: i for i, s in enumerate(ids)}
        self.ones = (1,) * len(ids)
        self.ones_fed = None
        self.short = None
        self.slack = None
        for name in ("computed", "ntok", "token_hash", "nblocks", "capacity", "fp", "hid", "limit", "low",
                     "blocks_term", "budget_end", "terms", "hi"):
            setattr(self, name, np.delete(getattr(self, name), r))
        for rows in (self.objs, self.cursors, self.qsas, self.ends, self.params, self.tables, self.first_keys):
            del rows[r]
        if self.last is not None:  # a new list: settle's lag (atlas.engine.quiet) holds the earlier ones
            self.last = self.last[:r] + self.last[r + 1:]
        self.work = None
        self.aligned = None
        self.cursor_target = None  # its list may be `ends`, which lost a row above
        self.ntok_list = None
        self.plan_head = None
        self.flat_alloc = None
        self.tables_moved = True
        return self

    def plan_hash(self, e: StepPlanned) -> int:
        """ints_key(b"atlas.plan", (seqs, fed, *alloc, release, reset, restored, *drafts)) of a plan over exactly
        these rows (StepPlanned's share of the digest): the same bytes, with the head (the rows' ids and the fed
        counts, the same every decode step) converted and absorbed into BLAKE2b once per batch instead of every plan
        (hash64_after), and the key of a plan with nothing after the head (no allocation, release, reset, restore or
        draft: release, reset and restored each its length 0) kept with it."""
        head = self.plan_head
        if head is None or head[0] != e.fed:
            ids = self.ids
            finish = hash64_after(b"atlas.plan", token_bytes([len(ids), *ids, len(e.fed), *e.fed]))
            head = self.plan_head = (e.fed, finish, finish(_NOTHING_AFTER))
        if not (e.alloc or e.release or e.reset or e.restored or e.drafts):
            return head[2]
        alloc = e.alloc
        ids = self.ids
        if one_block_each(alloc, ids):
            # every row, in order, one block each: the rows (2, seq_id, block) as int64 columns (the first two
            # kept per batch), their bytes token_bytes' little-endian int64s
            flat_alloc = self.flat_alloc
            if flat_alloc is None:
                flat_alloc = self.flat_alloc = np.empty((len(ids), 3), dtype="<i8")
                flat_alloc[:, 0] = 2
                flat_alloc[:, 1] = ids
            flat_alloc[:, 2] = second_column(alloc)
            alloc_bytes = flat_alloc.tobytes()
            alloc = ()
        else:
            alloc_bytes = b""
        flat: list[int] = []
        for row in (*alloc, e.release, e.reset, e.restored, *e.drafts):
            flat.append(len(row))
            flat.extend(row)
        return head[1](alloc_bytes + token_bytes(flat))

    # ------------------------------------------------------------------------------------------ StepPlanned

    def short_rows(self) -> list[int]:
        """The rows whose tokens reach past their blocks (a decode of each needs one more block), in order; computed
        once while the token and block counts stay (batch's decode shortcut and StepPlanned's check both ask)."""
        short = self.short
        if short is None:
            slack = self.slack
            if slack is not None and slack[2] >= 0:  # no row's tokens past its blocks (min(blocks * bs - ntok) >= 0)
                short = self.short = []
            else:
                short = self.short = (self.ntok > self.nblocks * self.bs).nonzero()[0].tolist()
        return short

    def slack_bounds(self) -> tuple[int, int, int]:
        """(min(hi - ntok), min(ntok - low), min(nblocks * bs - ntok)) over the rows: a decode step's bounds (every
        row within `hi` and at or past `low`: both >= 0) and whether any row is short (the third < 0). A decode
        step moves every row's token count by one and nothing else these read, so advance moves the three by
        (-1, +1, -1) instead of recomputing them (exact: the same minima); anything else that moves a token count,
        a block count or the rows sets it to None, and it is computed again here when next asked."""
        n = self.ntok
        mn = np.minimum.reduce
        slack = self.slack = (int(mn(self.hi - n)), int(mn(n - self.low)), int(mn(self.nblocks * self.bs - n)))
        return slack

    def fits(self, fed_counts: tuple[int, ...], new_blocks: dict[int, int]) -> bool:
        """steps._check_work's conditions for a plan over exactly these rows (all running): every fed count >= 1,
        within the known tokens, and its KV within the blocks held plus the plan's new ones. Sets `fed`."""
        if not self.row.keys() >= new_blocks.keys():  # a seq_id that is not a row
            return False
        if self.next_decode and (fed_counts is self.ones or fed_counts == self.ones):
            # a decode: every row feeds its one token left (computed + 1 == ntok), so each count is >= 1 and within
            # the tokens, and its KV is within its blocks except for the short rows, which the new ones must cover;
            # the general test below needs ~12 numpy calls and an array of the counts (~90 K instructions at 64)
            short = self.short_rows()
            if short:
                bs, ids, get = self.bs, self.ids, new_blocks.get
                # enough when every short row gets a block or more and no row's tokens reach past one block more
                # than it holds (a row that is not short is within its own): two C-level passes and four numpy calls
                # instead of the loop (64 rows allocate at once when their tokens reach their blocks' end together)
                every = len(short) == len(ids) == len(new_blocks)  # (then every row has new blocks: its keys are rows)
                if not ((min(new_blocks.values()) if every else min(map(get, map(ids.__getitem__, short), repeat(0))))
                        >= 1 and count_nonzero(self.ntok <= (self.nblocks + _A_ONE_I) * bs) == len(ids)):
                    # the counts as Python ints once (a numpy scalar read a row was ~0.5 us)
                    ntok, nblocks = self.ntok.tolist(), self.nblocks.tolist()
                    for r in short:
                        if ntok[r] > (nblocks[r] + get(ids[r], 0)) * bs:
                            return False
            fed = self.ones_fed
            if fed is None:
                fed = self.ones_fed = np.ones(len(self.ids), dtype=_I)
            self.fed = fed
            self.decode = True
            return True
        fed = np.array(fed_counts, dtype=_I)
        end = self.computed + fed
        if not ((fed >= 1) & (end <= self.ntok)).all():
            return False
        bs = self.bs
        short = end > self.nblocks * bs  # past the blocks held: the plan's new ones must cover it
        if short.any():
            ids, ends, held = self.ids, end.tolist(), self.nblocks.tolist()
            for r in np.flatnonzero(short).tolist():
                if ends[r] > (held[r] + new_blocks.get(ids[r], 0)) * bs:
                    return False
        self.fed = fed
        self.decode = bool((end == self.ntok).all()) and bool((fed == 1).all())
        return True

    def add_blocks(self, seq: Sequence, r: int) -> None:
        """Row r's sequence got blocks (StepPlanned's alloc, already extended on the object)."""
        b = len(seq.blocks)
        self.nblocks[r] = b
        self.limit[r] = min(int(self.capacity[r]), b * self.bs)
        self.low[r] = (b - 1) * self.bs
        term = (b * 0xFF51AFD7ED558CCD + _K_RUNNING_INT) & MASK64
        self.blocks_term[r] = term
        self.terms[r] = (int(self.ntok[r]) * 0xC2B2AE3D27D4EB4F + int(self.computed[r]) * int(K_COMPUTED_QSA)
                         + term) & MASK64
        self.hi[r] = min(int(self.limit[r]), int(self.budget_end[r]) - 1)
        self.short = None
        self.slack = None
        self.tables[r] = tuple(seq.blocks)
        self.tables_moved = True

    def ntok_values(self) -> list[int]:
        """`ntok.tolist()`, once per ntok array: a decode's outcome walk takes it as each row's computed count after the
        step, and `advance` of that decode as its `ends` (the same numbers: end == ntok), one list for both."""
        memo = self.ntok_list
        if memo is not None and memo[0] is self.ntok:
            return memo[1]
        values = self.ntok.tolist()
        self.ntok_list = (self.ntok, values)
        return values

    # ----------------------------------------------------------------------------------------- StepExecuted

    # ------------------------------------------------------------------------------------------------ plan

    def decode_work(self, seq_work: type, reuse: bool = False) -> tuple | None:
        """plan_step's SeqWork of every row for a decode step over these rows (the plan `fits` marked `decode`),
        when no row needs anything per request (bans, min_tokens, prompt logprobs) and the last tokens are known;
        else None (plan_step's loop then builds them from the objects). Positional as plan_step passes them:
        (seq_id, (token,), start, block_table, True, params, (), (), drafter_first_key, 0, None); the one-token
        tuples from zip(last) (C-level, against a list comprehension's ~20 K instructions at 64 rows).

        `reuse`: the caller owns the plan this work goes into and lends it for its step only (atlas.plan: who owns a
        plan; the Engine, unless its backend declares `retains_plans`). Then the last decode's tuple, built under
        the same promise, is moved to this step's tokens, positions and block tables in place and returned again:
        a SeqWork costs ~3.5 K instructions to build against ~0.3 K to move (~190 K of a batch-64 step). Without
        it every call builds new objects, and the tuple it returns is never moved later."""
        last = self.last
        if not self.decode or not self.plain or last is None:
            return None
        prev = self.work
        if reuse and self.movable and prev is not None and type(prev[0]) is seq_work:
            if self.tables_moved:
                for w, t, start, table in zip(prev, zip(last), self.ends, self.tables, strict=True):
                    w.tokens = t
                    w.start = start
                    w.block_table = table
                self.tables_moved = False
            else:  # each block table is the one this tuple was last given (no block since): two stores a row
                for w, t, start in zip(prev, zip(last), self.ends, strict=True):
                    w.tokens = t
                    w.start = start
            return prev
        n = len(self.ids)
        if self.keys_at_zero:  # the trailing fields all at SeqWork's defaults: six arguments, not eleven
            work = tuple(map(seq_work, self.ids, zip(last), self.ends, self.tables, repeat(True, n), self.params))
        else:
            work = tuple(map(seq_work, self.ids, zip(last), self.ends, self.tables, repeat(True, n), self.params,
                             repeat((), n), repeat((), n), self.first_keys, repeat(0, n), repeat(None, n)))
        self.work = work
        self.movable = reuse
        self.tables_moved = False
        return work
