"""StepPlanned's and StepExecuted's work over the step columns (atlas.state.columns), for atlas.state.steps: each
either does the whole event's per-sequence part in numpy and returns True, or flushes the columns, moves nothing
and returns False, and the scalar path then does the event on the objects (refusing or naming what broke)."""

from __future__ import annotations

import struct

import numpy as np

from atlas.hashing import MASK64
from atlas.state.columns import StepColumns, fingerprint_columns, step_rows
from atlas.state.control import Checked, ControlState
from atlas.state.events import StepPlanned
from atlas.state.orders import PlanOrders


def work_fits_columns(state: ControlState, e: StepPlanned, cols: StepColumns, new_blocks: dict[int, int]) -> bool:
    """steps._check_work's conditions over the step columns (every sequence is running: nothing admitted, none off
    the common path). False: one fails, and _check_work on the flushed objects names it."""
    row = cols.row
    for seq_id in new_blocks:
        if seq_id not in row:
            return False
    fed = np.fromiter(e.fed, np.int64, len(e.fed))
    end = cols.computed + fed
    if not ((fed >= 1) & (end <= cols.ntok)).all():
        return False
    short = end > cols.nblocks * state.caps.block_size  # KV past the blocks held: the plan's new ones must cover it
    if short.any():
        ids, ends, held = cols.ids, end.tolist(), cols.nblocks.tolist()
        for r in np.flatnonzero(short).tolist():
            if ends[r] > (held[r] + new_blocks.get(ids[r], 0)) * state.caps.block_size:
                return False
    cols.fed = fed
    return True


def refresh_rows(state: ControlState, cols: StepColumns, rows: list[int]) -> bool:
    """After StepPlanned moved the block counts of `rows` (a few a step): the invariants those counts enter
    (`_holds`: KV within the blocks, no block past the tokens; nothing else moved) and their fingerprints again,
    scalar over the few rows (a numpy pass over the batch cost ~15 us a plan). False, with the columns flushed,
    when one fails: apply and check_invariants then refresh and check them on the objects, naming it."""
    # the few rows' values by .item (four tolist calls of the whole batch were most of this)
    ntok, computed, limit, low = cols.ntok.item, cols.computed.item, cols.limit.item, cols.low.item
    for r in rows:
        if computed(r) > limit(r) or low(r) >= ntok(r):
            state.flush_columns()
            return False
    acc = state.seq_digest
    fps, th, terms = cols.fp, cols.token_hash, cols.blocks_term
    M = MASK64
    for r in dict.fromkeys(rows):  # sequence_fingerprint of the common path (running_fingerprints, scalar)
        h = (th.item(r) ^ (cols.ids[r] * 0x9E3779B97F4A7C15)) & M
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M
        done = computed(r)
        h = ((h ^ (h >> 31)) + ntok(r) * 0xC2B2AE3D27D4EB4F + done * 0x165667B19E3779F9
             + done * 0xC4CEB9FE1A85EC53 + terms.item(r)) & M
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M
        fp = h ^ (h >> 31)
        acc ^= fps.item(r) ^ fp
        fps[r] = fp
    state.seq_digest = acc
    return True


def advance_columns(state: ControlState, cols: StepColumns, tokens: tuple[int, ...]) -> bool:
    """steps._advance_all over the step columns, when every sequence of the step is on its plain path: one numpy
    expression each for Sequence.check_advance's conditions and `_holds`'s on the state the commit leaves (the
    plan's fed counts >= 1 were checked by StepPlanned; running, qsa.ingested == computed and no snapshots or
    drafter rows hold by construction), then the commit and the fingerprints. False, with the columns flushed
    and nothing moved, when any condition fails: steps._advance_all on the objects then refuses, or commits and names
    its suspects, exactly as without columns. ~35 numpy calls a step whatever the batch."""
    return advance_array(state, cols, np.fromiter(tokens, np.int64, len(tokens)))


def advance_array(state: ControlState, cols: StepColumns, tok: np.ndarray) -> bool:
    """advance_columns of the step's tokens as an int64 array."""
    fed = cols.fed
    assert fed is not None
    end = cols.computed + fed
    moved = step_rows(cols.ntok, end, tok, cols.limit, cols.budget_end, cols.low, cols.token_hash, cols.blocks_term)
    if moved is None:
        state.flush_columns()
        return False
    n2, th, terms, _ = moved
    fp = fingerprint_columns(th ^ cols.hid, terms)
    state.seq_digest ^= int(np.bitwise_xor.reduce(cols.fp ^ fp))
    cols.computed, cols.ntok, cols.token_hash, cols.fp, cols.fed = end, n2, th, fp, None
    cols.tokens.append(tok)
    return True




_HEAD2 = struct.Struct("<ii")
_Z8 = bytes(8)


def execute_blob(state: ControlState, payload: bytes) -> Checked | None:
    """StepExecuted (v2, a codec-1 blob: atlas.replay.codec) of the plan in flight over the step columns, without
    building the event (replay check's seventh pass: the event, the generic apply and `executed`'s dispatch were ~a
    third of an admission step's execution): `executed`'s column path, with its conditions on the blob as laid out
    (step, one token a planned sequence, no accepted counts or verdicts; the plan without drafts, over the columns'
    sequences). Returns what `executed` returns there, or None when the blob or the state is off that path: then
    nothing moved, or advance_columns failed and flushed the columns, and the event path (which refuses, or applies
    on the objects and names what broke) is the caller's, exactly as when `executed` meets either."""
    cols = state.columns
    plan = state.inflight
    if cols is None or cols.fed is None or plan is None or plan.drafts or state.batch is not None:
        return None
    n = len(cols.ids)
    if len(payload) != 17 + 4 * n or payload[0] != 1 or payload[-8:] != _Z8 or plan.seqs != cols.ids:
        return None
    step, m = _HEAD2.unpack_from(payload, 1)
    if step != plan.step or m != n:
        return None
    if not advance_array(state, cols, np.frombuffer(payload, "<i4", n, 9).astype(np.int64)):
        return None
    state.inflight = None
    state.inflight_hash = 0
    state.inflight_orders = PlanOrders()
    return Checked(plan.seqs, [])
