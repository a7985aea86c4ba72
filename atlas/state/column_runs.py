"""A run of step events over the step columns at once: what `replay check` runs.

A run is R consecutive StepPlanned / StepExecuted pairs over the batch the step columns hold (atlas.state.columns),
every plan without admissions, drafts, restores or an allocation the columns cannot take, every execution without
verdicts, each stored as a codec-1 blob (atlas.replay.codec). Its fed counts and tokens are read straight from the
blobs as [R x batch] int32 arrays (np.frombuffer, no event object built); every condition the per-event path checks
(StepPlanned's work and allocation, StepExecuted's advance, the invariants `_holds` tests on what moved) is one
expression over the whole run; the token hash is its recurrence, one step at a time over the batch; computed, token
count and block count are cumulative sums; every row's fingerprint after each StepExecuted is one mix over
[R x batch] and after each StepPlanned only the rows that got blocks are mixed again; the sequences' share of each
event's digest is their XOR, the global share splitmix64 over the 2R events' step, pool count and in-flight plan hash
(BLAKE2b per plan, over the same bytes `ints_key` hashes). Each event's digest is compared with the one the trace
recorded for it.

All or nothing: `apply_run` moves the state only when every event of the run passes every check and matches its
recorded digest. Otherwise it flushes the columns and moves nothing (returns False), and the caller applies the
run's events one at a time, which refuses, names the violation or reports the digest exactly as without runs.

Here: the blobs read, the plans' tails and allocations checked, the plan hashes and digests, the state moved; the
cursors' [steps x batch] arithmetic is atlas.state.column_run_cursors (`run_cursors`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array

import numpy as np

from atlas.hashing import MASK64
from atlas.state.column_run_cursors import run_cursors
from atlas.state.columns import K_BLOCKS, K_RUNNING, StepColumns, digest_rounds
from atlas.state.control import ControlState
from atlas.state.orders import PlanOrders

_LITTLE = sys.byteorder == "little"
_U = np.uint64
_S20 = _U(20)
_Z8 = bytes(8)


def _orders_empty(o: PlanOrders) -> bool:
    return not (o.stores or o.restores or o.rollbacks) and o.carry_store == -1 and not o.carry_drop


def apply_run(state: ControlState, plans: list[bytes], execs: list[bytes], digests: list[str] | None) -> bool:
    """Apply the pairs (plans[k], execs[k]) over `state.columns`, comparing the state digest after each of the 2R
    events with `digests` (None: a trace whose digests are not comparable). True: every event applied. False: the
    columns flushed, nothing else moved (the caller replays the run event by event)."""
    if not _apply(state, plans, execs, digests):
        state.flush_columns()
        return False
    return True


def _apply(state: ControlState, plans: list[bytes], execs: list[bytes], digests: list[str] | None) -> bool:
    cols = state.columns
    pool = state.pool
    caps = state.caps
    if (cols is None or cols.fed is not None or cols.gone or state.inflight is not None or state.prefix is not None
            or not _LITTLE or not _orders_empty(state.orders) or len(pool.free) + pool.used != pool.total
            or len(state.running) > caps.max_batch_size or len(plans) != len(execs) or not plans):
        return False
    ids = cols.ids
    n = len(ids)
    R = len(plans)
    head = 3 + 2 * n  # step, len(admitted) = 0, len(seqs), seqs, fed
    xlen = 1 + 4 * (n + 4)
    sizes = []
    for p in plans:
        if p[0] != 1 or len(p) % 4 != 1:
            return False
        sizes.append(len(p) >> 2)  # integers
    for x in execs:
        if len(x) != xlen or x[0] != 1:
            return False
    L = np.array(sizes, dtype=np.int64)
    if (L < head + 5).any():  # the tail is at least the alloc count and 4 lengths
        return False
    o = np.cumsum(L)
    o -= L  # each plan's first integer in A
    A = np.frombuffer(b"".join([p[1:] for p in plans]), dtype="<i4")
    # the heads joined as bytes: a gather of A by [R x head] indices was ~0.6 M instructions a run (mapiter)
    hb = 1 + 4 * head
    H = np.frombuffer(b"".join([p[1:hb] for p in plans]), dtype="<i4").reshape(R, head)
    E = np.frombuffer(b"".join([x[1:] for x in execs]), dtype="<i4").reshape(R, n + 4)
    s0 = state.step
    stepno = np.arange(s0, s0 + R, dtype=np.int64)
    if not ((H[:, 0] == stepno).all() and (E[:, 0] == stepno).all() and not H[:, 1].any() and (H[:, 2] == n).all()
            and (E[:, 1] == n).all() and not E[:, n + 2:].any()
            and (H[:, 3:3 + n] == np.array(ids, dtype=np.int64)).all()):
        return False
    F = H[:, 3 + n:]
    if (F.sum(axis=1) > caps.max_batch_tokens).any():
        return False
    alloc = _allocations(state, cols, A, o + head, L - head)
    if alloc is None:
        return False
    G, kk, rr, blocks, used, single = alloc

    # the in-flight plan's hash of each plan: ints_key's bytes are (n, seqs, n, fed, alloc rows, release, reset,
    # restored) as int64, the blob's are (.., fed, len(alloc), alloc rows, release, reset, len(drafts) = 0, restored)
    mv = memoryview(A.astype("<i8")).cast("B")
    pre = hashlib.blake2b(array("q", (n, *ids, n)).tobytes(), digest_size=8, person=b"atlas.plan")
    fed0 = (8 * (o + 3 + n)).tolist()
    tail0 = (8 * (o + head)).tolist()
    end = (8 * (o + L - 2)).tolist()
    hashed = []
    for a, b, c in zip(fed0, tail0, end, strict=True):
        h = pre.copy()
        h.update(mv[a:b])
        h.update(mv[b + 8:c])
        h.update(_Z8)
        hashed.append(h.digest())
    hashes = np.frombuffer(b"".join(hashed), dtype="<u8")

    T = E[:, 2:2 + n]
    seq_x = np.empty(R, dtype=np.uint64)  # the batch's XOR of fingerprints after X_k
    delta_p = np.zeros(R, dtype=np.uint64)  # what P_k's allocations change in it
    final = run_cursors(cols, F, T, G, kk, rr, caps.block_size, seq_x, delta_p)
    if final is None:
        return False
    rest = state.seq_digest ^ int(np.bitwise_xor.reduce(cols.fp))  # the sequences outside the batch
    seq_x ^= _U(rest)
    seqd = np.empty(2 * R, dtype=np.uint64)
    seqd[1::2] = seq_x
    seqd[0] = state.seq_digest
    seqd[2::2] = seq_x[:-1]
    seqd[0::2] ^= delta_p

    if digests is not None:
        # ControlState.digest() of each event: step and pool after the plan, the in-flight hash between P_k and X_k
        g = np.repeat(stepno + 1, 2).view(np.uint64)
        g ^= np.repeat(used, 2).view(np.uint64) << _S20
        g ^= _U((state.next_seq_id << 40) & MASK64)
        inflight = np.zeros(2 * R, dtype=np.uint64)  # the plan's hash between P_k and X_k, none after X_k
        inflight[0::2] = hashes
        inflight ^= _U(state.outcomes_hash)
        g = digest_rounds(g, _U(((len(state.waiting) << 32) ^ len(state.running) ^ (state.finished_count << 16))
                                & MASK64),
                          _U((len(state.pending_faults) ^ (state.dead << 62)) & MASK64),  # no release pending after P_0
                          inflight)
        g ^= seqd
        if set(map(len, digests)) != {16} or g.astype(">u8").tobytes().hex() != "".join(digests):
            return False

    # every event holds: move the state as the 2R events would have
    free = pool.free
    refs = pool.refs
    objs = cols.objs
    if single:  # one block a row (a decode's tail): the blocks as they are, no list a row
        for r, x in zip(rr.tolist(), blocks, strict=True):
            del free[x]
            refs[x] = 1
            objs[r].blocks.append(x)
    else:
        for r, b in zip(rr.tolist(), blocks, strict=True):
            for x in b:
                del free[x]
                refs[x] = 1
            objs[r].blocks.extend(b)
    pool.used = int(used[-1])
    computed, ntok, token_hash, fp, nblocks = final
    cols.computed, cols.ntok, cols.token_hash, cols.fp, cols.nblocks = computed, ntok, token_hash, fp, nblocks
    cols.limit = np.minimum(cols.capacity, nblocks * caps.block_size)
    cols.low = (nblocks - 1) * caps.block_size
    cols.blocks_term = nblocks.view(np.uint64) * K_BLOCKS + K_RUNNING
    cols.tokens.append(T)  # [R x batch]: flush takes one-step rows and runs alike
    state.seq_digest = int(seqd[-1])
    state.pending_release.clear()
    state.step = s0 + R
    state.inflight = None
    state.inflight_hash = 0
    state.orders = PlanOrders()
    state.inflight_orders = PlanOrders()
    return True


def _allocations(state: ControlState, cols: StepColumns, A: np.ndarray, to: np.ndarray, tl: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int] | list[list[int]], np.ndarray,
                            bool] | None:
    """The plans' tails (alloc rows, release, reset, drafts, restored: `tl` integers of A from `to`), checked as
    StepPlanned checks them: every row's sequence in the batch and once a plan, every block in the pool, free and
    allocated once in the run (no block is freed within one), the first plan's release the pending one, then none,
    no drafts, nothing restored. Returns ([R x batch] blocks given, each row's plan and batch row, its blocks (one
    block a row when the last value is True: then the blocks themselves, a list of lists otherwise), the
    pool's used count after each plan), or None when one fails."""
    R, n = len(to), len(cols.ids)
    pool = state.pool
    if not state.pending_release:
        # the common tail (a decode's): rows of one block each, nothing released, reset, drafted or restored; all
        # of it at once
        na = A[to]
        if (na >= 0).all() and (tl == 5 + 3 * na).all():
            count = int(na.sum())
            first = np.cumsum(na)
            first -= na
            kk = np.repeat(np.arange(R), na)
            at = np.repeat(to + 1 - 3 * first, na) + 3 * np.arange(count)
            last = to + tl
            if (A[at] == 2).all() and not A[last[:, None] - np.arange(1, 5)].any():
                seqs = A[at + 1].astype(np.int64)
                b = A[at + 2].astype(np.int64)
                ids = np.array(cols.ids, dtype=np.int64)  # seq id -> batch row
                order = np.argsort(ids)
                pos = np.minimum(np.searchsorted(ids[order], seqs), n - 1)
                rr = order[pos]
                if (ids[rr] != seqs).any() or (b < 0).any() or (b >= pool.total).any():
                    return None  # a sequence the batch does not hold, or a block outside the pool
                G = np.bincount(kk * n + rr, minlength=R * n).reshape(R, n)
                if count and (G.max() > 1 or np.bincount(b, minlength=pool.total).max() > 1):
                    return None  # a sequence twice in one plan, or a block twice in the run
                blocks = b.tolist()
                if not all(map(pool.free.__contains__, blocks)):
                    return None
                return G, kk, rr, blocks, pool.used + np.cumsum(na, dtype=np.int64), True
    return _allocations_rows(state, cols, A, to, tl)


def _allocations_rows(state: ControlState, cols: StepColumns, A: np.ndarray, to: np.ndarray, tl: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]], np.ndarray, bool] | None:
    """_allocations for any tail, row by row in Python."""
    R, n = len(to), len(cols.ids)
    row = cols.row
    pool = state.pool
    free = pool.free
    total = pool.total
    claimed: set[int] = set()
    kk: list[int] = []
    rr: list[int] = []
    given: list[int] = []
    blocks: list[list[int]] = []
    used = np.empty(R, dtype=np.int64)
    n_used = pool.used
    release = state.pending_release
    for k, (a, size) in enumerate(zip(to.tolist(), tl.tolist(), strict=True)):
        t = A[a:a + size].tolist()
        na = t[0]
        if na < 0 or na > size:
            return None
        i = 1
        seen: set[int] = set()
        for _ in range(na):
            m = t[i]
            if m < 1 or i + 1 + m > size:
                return None
            seq_id = t[i + 1]
            r = row.get(seq_id)
            if r is None or seq_id in seen:  # a sequence the columns do not hold, or twice in one plan
                return None
            seen.add(seq_id)
            b = t[i + 2:i + 1 + m]
            for x in b:
                if x in claimed or not 0 <= x < total or x not in free:
                    return None
                claimed.add(x)
            if b:
                kk.append(k)
                rr.append(r)
                given.append(m - 1)
                blocks.append(b)
                n_used += m - 1
            i += 1 + m
        if i >= size or t[i] < 0 or t[i + 1:i + 1 + t[i]] != release:
            return None
        release = []  # the first plan releases the finished sequences; the rest release none
        i += 1 + t[i]
        if i >= size or t[i] < 0:
            return None
        i += 1 + t[i]  # reset: carried in the plan and hashed, not checked (as StepPlanned)
        if i + 2 != size or t[i] != 0 or t[i + 1] != 0:  # no drafts, nothing restored
            return None
        used[k] = n_used
    G = np.zeros((R, n), dtype=np.int64)
    if kk:
        G[kk, rr] = given
    return G, np.array(kk, dtype=np.int64), np.array(rr, dtype=np.int64), blocks, used, False
