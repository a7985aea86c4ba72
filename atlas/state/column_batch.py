"""The batch of the step columns changed in place: finishes and admissions without a flush (what replay check
runs).

Before this, every finish flushed the step columns (any event but a step's does), the next plan went the scalar
path over the whole batch and gathered the columns again: 46 such steps were 70 M of a 304 M-instruction check
(benchmarks/replay_check.py's trace). Here:

- `finish_in_columns`: RequestFinished of a sequence the columns hold, as `requests.finished` and
  `ControlState.finish` do it, with the columns' fingerprint of that row (the object's lags); the row is then gone
  (`StepColumns.gone`). Its object leaves the state, so its lagging fields are never read again.
- `plan_in_columns`: a StepPlanned whose work is the rows still there, in order, then the admitted sequences:
  `steps.planned`'s checks over the columns and the few admitted objects, its moves, and new columns of the rows
  kept plus the admitted (the old ones, with their pending tokens, flushed first whenever these are:
  `StepColumns.prior`).

Either returns None, moving nothing, when anything is off that path (a condition fails, another shape of plan);
the caller then applies the event through `ControlState.apply`, which flushes and refuses or reports exactly as
without this. Both return what `apply` would (the touched ids; Checked when the invariants' per-sequence test
already ran), for check_invariants.
"""

from __future__ import annotations

import hashlib
import json
import json.scanner
import sys
from bisect import insort
from itertools import chain

import numpy as np

from atlas.hashing import ints_key
from atlas.state.column_steps import refresh_rows
from atlas.state.columns import K_BLOCKS, K_ID, K_RUNNING, StepColumns, common
from atlas.state.control import Checked, ControlState
from atlas.state.events import RequestFinished, StepPlanned
from atlas.state.invariants import holds as _holds
from atlas.state.machines import FinishReason, Phase
from atlas.state.orders import PlanOrders

_REASONS = frozenset(r.value for r in FinishReason)
# the enum members as constants: an attribute of an Enum class is looked up through its metaclass's hook (3.11)
_WAITING, _ERROR = Phase.WAITING, FinishReason.ERROR.value
_I = np.int64
_LITTLE = sys.byteorder == "little"
_U = np.uint64
# the scalar path gathers columns from this many sequences a plan (steps.VECTOR_MIN): the same batches here
VECTOR_MIN = 16


def finish_in_columns(state: ControlState, e: RequestFinished) -> tuple[int, ...] | None:
    cols = state.columns
    if cols is None:
        return None
    r = cols.row.get(e.seq_id)
    seq = state.seqs.get(e.seq_id)
    if r is None or r in cols.gone or seq is None or type(e.reason) is not str or e.reason not in _REASONS:
        return None
    plan = state.inflight
    if plan is not None and e.seq_id in plan.seqs:
        return None
    if e.seq_id in state.failing and e.reason != _ERROR:
        return None
    refs = state.pool.refs
    if not all(refs[b] > 0 for b in seq.blocks):  # BlockPool.release would refuse (after finish moved some)
        return None
    seq.fingerprint = int(cols.fp[r])  # the share the digest holds (the object's lags behind the columns)
    state.finish(seq, e.reason, e.detail)
    cols.gone.add(r)
    return (e.seq_id,)


def plan_key_of_blob(blob: bytes) -> int:
    """`ints_key(b"atlas.plan", (seqs, fed, *alloc, release, reset, restored, *drafts))` of a codec-1 StepPlanned
    blob without drafts or restored sequences (the caller knows it decodes to such an event), hashed off its
    integers as int64 bytes (the runs' way, atlas.state.column_runs) instead of a flat list built in Python: the
    blob's integers from len(seqs) on are (n, seqs, fed, len(alloc), alloc rows, release, reset, len(drafts) = 0,
    len(restored) = 0), the key's (n, seqs, n, fed, alloc rows, release, reset, len(restored) = 0)."""
    v = np.frombuffer(blob, "<i4", offset=1).astype("<i8")
    p = 2 + int(v[1])  # past step and the admitted
    n = int(v[p])
    w = v[p:len(v) - 1]  # as long as the key's: fed moves one up over the alloc count, gets its length before it
    w[n + 2:2 * n + 2] = w[n + 1:2 * n + 1]  # (an overlapping copy: numpy buffers it)
    w[n + 1] = n
    w[-1] = 0  # len(drafts) = 0 read as len(restored)
    return int.from_bytes(hashlib.blake2b(w.data, digest_size=8, person=b"atlas.plan").digest(), "little")


def plan_in_columns(state: ControlState, e: StepPlanned, blob: bytes | None = None) -> tuple[int, ...] | None:
    """`blob`: the codec-1 payload `e` was decoded from, if it was (its in-flight hash is read off it)."""
    cols = state.columns
    caps = state.caps
    if (cols is None or cols.fed is not None or e.drafts or e.restored or state.prefix is not None
            or state.inflight is not None or e.step != state.step or len(e.seqs) != len(e.fed)
            or len(e.seqs) < VECTOR_MIN or list(e.release) != state.pending_release or state.orders.rollbacks
            or sum(e.fed) > caps.max_batch_tokens):
        return None
    gone = cols.gone
    keep = [r for r in range(len(cols.ids)) if r not in gone]
    k = len(keep)
    ids = cols.ids
    run = bool(keep) and keep[-1] - keep[0] + 1 == k  # the kept rows are one range (see `kept` below)
    if (ids[keep[0]:keep[-1] + 1] if run else tuple(ids[r] for r in keep)) != e.seqs[:k] or e.seqs[k:] != e.admitted:
        return None
    seqs = state.seqs
    admitted = []
    for seq_id in e.admitted:
        seq = seqs.get(seq_id)
        if seq is None or seq.cursor.phase is not _WAITING or seq.blocks or seq.on_device or seq.preemptions:
            return None
        admitted.append(seq)
    new_blocks: dict[int, int] = {}
    claimed: set[int] = set()
    pool = state.pool
    free, total = pool.free, pool.total
    batch = set(e.seqs)
    if len(batch) != len(e.seqs):
        return None  # a sequence twice in one plan: the scalar path meets it
    for row in e.alloc:
        if len(row) < 1 or row[0] not in batch or row[0] in new_blocks:
            return None
        new_blocks[row[0]] = len(row) - 1
        for b in row[1:]:
            if b in claimed or not 0 <= b < total or b not in free:
                return None
            claimed.add(b)
    bs = caps.block_size
    fed = np.fromiter(e.fed, _I, len(e.fed))
    # the rows kept as a slice when they are one range (the finished rows are the oldest: a prefix), a gather else:
    # a slice is a view, a fancy index a copy at ~4 K instructions (12 of them a plan, here and in _combined)
    kept: slice | np.ndarray = slice(keep[0], keep[-1] + 1) if run else np.array(keep, dtype=_I)
    held = cols.nblocks[kept]
    computed = cols.computed[kept]
    ntok = cols.ntok[kept]
    add = np.array([new_blocks.get(s, 0) for s in e.seqs[:k]], dtype=_I)
    end = computed + fed[:k]
    if not ((fed[:k] >= 1) & (end <= ntok) & (end <= (held + add) * bs)).all():
        return None
    for seq, n in zip(admitted, e.fed[k:], strict=True):
        c = seq.cursor
        if n < 1 or c.computed + n > len(c.tokens) or c.computed + n > new_blocks.get(seq.seq_id, 0) * bs:
            return None

    # every check of StepPlanned passed: its moves (steps.planned's, in its order)
    first_key = caps.drafter_context
    for seq in admitted:
        seq.admit(0 if first_key else seq.cursor.prompt_len - 1)
        state.waiting.remove(seq.seq_id)
        insort(state.running, seq.seq_id)
    # BlockPool.allocate's moves (its checks are the loop above's: every block in the pool, free, once in the plan)
    refs = pool.refs
    given = 0
    for row in e.alloc:
        b = row[1:]
        for x in b:
            del free[x]
            refs[x] = 1
        given += len(b)
        seqs[row[0]].blocks.extend(b)
    pool.used += given
    state.pending_release.clear()
    state.inflight_orders, state.orders = state.orders, PlanOrders()
    state.inflight = e
    state.inflight_hash = (plan_key_of_blob(blob) if blob is not None and _LITTLE else
                           ints_key(b"atlas.plan", (e.seqs, e.fed, *e.alloc, e.release, e.reset, e.restored,
                                                    *e.drafts)))
    state.step = e.step + 1
    touched = tuple(e.admitted) + tuple(row[0] for row in e.alloc)
    for seq in admitted:  # apply's refresh and check_invariants' test, on the objects (current: never in columns)
        state.refresh(seq)
        if not common(seq) or not _holds(seq, bs, 0):
            state.flush_columns()
            return touched  # apply's caller refreshes them (again: the same) and check_invariants names it
    new = _combined(cols, kept, held + add, admitted, [new_blocks.get(s, 0) for s in e.admitted], e.seqs, bs)
    new.fed = fed
    state.columns = new
    row = new.row
    if refresh_rows(state, new, [row[s] for s in e.seqs[:k] if s in new_blocks]):
        return Checked(touched, [])
    return touched  # flushed by refresh_rows: check_invariants names what broke, on the objects


def _combined(cols: StepColumns, kept: slice | np.ndarray, kept_blocks: np.ndarray, admitted: list,
              admitted_blocks: list[int], ids: tuple[int, ...], bs: int) -> StepColumns:
    """The columns of `ids`: the rows `kept` of `cols` (holding `kept_blocks` blocks now), then the admitted
    sequences from their objects (holding `admitted_blocks`). `cols` (and its pending tokens) flush first whenever
    these do. The admitted rows' fields in two conversions (int64 and uint64), not one a column."""
    new = StepColumns.__new__(StepColumns)
    new.ids = ids
    new.objs = (cols.objs[kept] if type(kept) is slice else [cols.objs[r] for r in kept.tolist()]) + admitted
    new.row = {s: i for i, s in enumerate(ids)}
    new.bs = bs
    a = len(admitted)
    # flat iterables: np.array of a list of tuples discovers its shape element by element (~2x the instructions)
    ints = np.fromiter(chain.from_iterable((c.computed, len(c.tokens), s.qsa.capacity, c.prompt_len + s.max_new)
                                           for s, c in zip(admitted, [s.cursor for s in admitted], strict=True)),
                       _I, 4 * a).reshape(a, 4)
    words = np.fromiter(chain.from_iterable((s.cursor.token_hash, s.fingerprint, s.seq_id) for s in admitted),
                        _U, 3 * a).reshape(a, 3)
    new.hid = np.concatenate((cols.hid[kept], words[:, 2] * K_ID))
    new.computed = np.concatenate((cols.computed[kept], ints[:, 0]))
    new.ntok = np.concatenate((cols.ntok[kept], ints[:, 1]))
    new.token_hash = np.concatenate((cols.token_hash[kept], words[:, 0]))
    new.nblocks = np.concatenate((kept_blocks, np.array(admitted_blocks, dtype=_I)))
    new.capacity = np.concatenate((cols.capacity[kept], ints[:, 2]))
    new.fp = np.concatenate((cols.fp[kept], words[:, 1]))
    new.fed = None
    new.tokens = []
    new.gone = set()
    new.prior = cols if cols.tokens or cols.prior is not None else None
    new.budget_end = np.concatenate((cols.budget_end[kept], ints[:, 3]))
    new.limit = np.minimum(new.capacity, new.nblocks * bs)
    new.low = (new.nblocks - 1) * bs
    new.blocks_term = new.nblocks.view(_U) * K_BLOCKS + K_RUNNING
    return new


_FINISH_KEYS = frozenset(("seq_id", "reason", "detail"))
_scan = json.scanner.make_scanner(json.JSONDecoder())  # json.loads' own (the C scanner where there is one)


def finish_text_in_columns(state: ControlState, payload: str) -> int | None:
    """finish_in_columns of a RequestFinished v1 JSON payload without building the event (replay check's sixth pass:
    the event, its converters, the generic apply and check_invariants' call were most of a finish's ~85 K
    instructions): the same checks, then ControlState.finish of a row the columns hold (no batch columns). Returns the finished sequence's id, or None, moving nothing, when the payload or
    the state is off that path (the caller then builds the event and applies it, which refuses or reports)."""
    cols = state.columns
    if cols is None or state.batch is not None:
        return None
    try:  # json.loads' scanner without its wrapper (two whitespace matches and a frame: ~8 K instructions a call)
        d, end = _scan(payload, 0)
    except (StopIteration, ValueError, RecursionError):
        return None  # not a JSON document here (surrounding whitespace included): the event path parses it
    if end != len(payload):
        return None
    if type(d) is not dict or d.keys() != _FINISH_KEYS:
        return None
    seq_id, reason, detail = d["seq_id"], d["reason"], d["detail"]
    if type(seq_id) is not int or type(reason) is not str or type(detail) is not str or reason not in _REASONS:
        return None
    r = cols.row.get(seq_id)
    seq = state.seqs.get(seq_id)
    if r is None or r in cols.gone or seq is None:
        return None
    plan = state.inflight
    if plan is not None and seq_id in plan.seqs:
        return None
    failing = state.failing
    if seq_id in failing and reason != _ERROR:
        return None
    refs = state.pool.refs
    blocks = seq.blocks
    try:
        if blocks and min(map(refs.__getitem__, blocks)) <= 0:  # BlockPool.release would refuse
            return None
    except IndexError:
        return None
    seq.fingerprint = cols.fp.item(r)  # the share the digest holds (the object's lags behind the columns)
    state.finish(seq, reason, detail)
    cols.gone.add(r)
    return seq_id
