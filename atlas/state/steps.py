"""Transitions of a step (planned, executed) and of preemption (registered on ControlState); the snapshot ring's,
rollback's and the speculative lane's latch are atlas.state.rollbacks'."""

from __future__ import annotations

from bisect import insort
from operator import itemgetter

import numpy as np

from atlas.errors import TransitionRefused
from atlas.hashing import ints_key
from atlas.state.batch_columns import BatchColumns
from atlas.state.column_steps import advance_columns, refresh_rows, work_fits_columns
from atlas.state.columns import StepColumns
from atlas.state.control import (
    Checked,
    ControlState,
    Refreshed,
    common_fingerprint,
    fold_fingerprints,
    sequence_fingerprint,
    transition,
)
from atlas.state.events import (
    SequencePreempted,
    StepExecuted,
    StepPlanned,
)
from atlas.state.invariants import holds as _holds
from atlas.state.machines import Phase, Sequence
from atlas.state.orders import empty_or_new
from atlas.state.prefix import register_blocks


@transition(SequencePreempted)
def preempted(state: ControlState, e: SequencePreempted) -> tuple[int, ...]:
    seq = state.seq(e.seq_id)
    if e.blocks_freed != len(seq.blocks):
        raise TransitionRefused("BlockPool", "preemption frees every block of the sequence",
                                seq_id=e.seq_id, blocks_freed=e.blocks_freed, blocks=len(seq.blocks))
    seq.reset()  # validates the phase before anything moves
    state.pool.release(seq.seq_id, seq.blocks)
    seq.blocks.clear()
    state.running.remove(seq.seq_id)
    insort(state.waiting, seq.seq_id)
    state.orders.forget(seq.seq_id)
    state.preemptions_total += 1
    return (e.seq_id,)


def _check_drafts(state: ControlState, seq: Sequence, fed: int, drafts: tuple[int, ...]) -> None:
    c = seq.cursor
    if fed != 1 or not c.decoding:
        raise TransitionRefused("Speculative", "drafts only for a decoding sequence feeding its last token",
                                seq_id=seq.seq_id, fed=fed, computed=c.computed, seq_len=len(c.tokens))
    if seq.drafter.latched:
        raise TransitionRefused("Speculative", "drafts for a sequence whose lane is latched off", seq_id=seq.seq_id)
    if len(drafts) > state.caps.verify_width - 1 or c.generated + len(drafts) + 1 > seq.max_new:
        raise TransitionRefused("Speculative", "drafts within the verify width and the request's budget",
                                seq_id=seq.seq_id, drafts=len(drafts), verify_width=state.caps.verify_width,
                                generated=c.generated, max_new=seq.max_new)


def _check_planned(state: ControlState, e: StepPlanned, i: int, admitted: set[int], new_blocks: dict[int, int]
                   ) -> None:
    """Every condition on the plan's i-th sequence, each refusing with its own message."""
    seq_id, n = e.seqs[i], e.fed[i]
    seq = state.seq(seq_id)
    c = seq.cursor
    drafts = e.drafts[i] if e.drafts else ()
    if c.phase is not Phase.RUNNING and seq_id not in admitted:
        raise TransitionRefused("Scheduler", "work for a sequence that is neither running nor admitted",
                                seq_id=seq_id, phase=c.phase.name)
    if n < 1 or c.computed + n > len(c.tokens):
        raise TransitionRefused("SequenceCursor", "fed tokens beyond the known tokens", seq_id=seq_id,
                                computed=c.computed, fed=n, seq_len=len(c.tokens))
    if drafts:
        _check_drafts(state, seq, n, drafts)
    end = c.computed + n + len(drafts)  # a verify writes KV for its draft positions too
    if end > (len(seq.blocks) + new_blocks.get(seq_id, 0)) * state.caps.block_size:
        raise TransitionRefused("BlockPool", "KV written past the sequence's blocks", seq_id=seq_id,
                                end=end, blocks=len(seq.blocks) + new_blocks.get(seq_id, 0))


def _check_plan(state: ControlState, e: StepPlanned, cols: StepColumns | None = None) -> None:
    if e.step != state.step:
        raise TransitionRefused("Engine", "steps are planned in order", step=e.step, expected=state.step)
    if state.inflight is not None:
        raise TransitionRefused("Engine", "a step is already in flight", inflight=state.inflight.step)
    if len(e.seqs) != len(e.fed):
        raise TransitionRefused("Engine", "one fed count per planned sequence", seqs=len(e.seqs), fed=len(e.fed))
    for seq_id in e.admitted:
        if state.seq(seq_id).cursor.phase is not Phase.WAITING:
            raise TransitionRefused("Request", "admission of a sequence that is not waiting", seq_id=seq_id)
    if (e.release or state.pending_release) and list(e.release) != state.pending_release:  # (both empty: equal)
        raise TransitionRefused("Engine", "the plan releases exactly the finished sequences",
                                release=list(e.release), pending=list(state.pending_release))
    if (e.restored or state.orders.rollbacks) and list(e.restored) != [r.seq_id for r in state.orders.rollbacks]:
        raise TransitionRefused("SsmRing", "the plan restores exactly the rolled-back sequences",
                                restored=list(e.restored), queued=[r.seq_id for r in state.orders.rollbacks])
    if e.drafts and len(e.drafts) != len(e.seqs):
        raise TransitionRefused("Engine", "drafts aligned with the planned sequences", drafts=len(e.drafts),
                                seqs=len(e.seqs))
    batch = state.batch
    # the batch columns' decode counts (`ones`, every one 1: a decode plan's, from scheduler.batch) sum to their length
    fed_total = (len(e.fed) if batch is not None and e.fed is batch.ones else sum(e.fed)) + (
        sum(map(len, e.drafts)) if e.drafts else 0)
    if fed_total > state.caps.max_batch_tokens:  # the size every per-step buffer is derived from
        raise TransitionRefused("Scheduler", "a step feeds at most max_batch_tokens (drafts included)",
                                fed=fed_total, max_batch_tokens=state.caps.max_batch_tokens)
    alloc = e.alloc
    # every alloc row (seq_id, block): one block each (the scheduler's decode allocation), read as two columns
    pairs = bool(alloc) and _PAIR.issuperset(map(len, alloc))
    if pairs:
        new_blocks = dict.fromkeys(map(_FIRST, alloc), 1)  # {row[0]: len(row) - 1}, the same dict
    else:
        new_blocks = {row[0]: len(row) - 1 for row in alloc}
    if batch is not None:  # the engine's batch columns (the plan is over exactly their rows: planned checked it)
        if not batch.fits(e.fed, new_blocks):
            state.batch = None
            _check_work(state, e, new_blocks)  # names what failed
    elif cols is None or not work_fits_columns(state, e, cols, new_blocks):
        state.flush_columns()
        _check_work(state, e, new_blocks)
    if pairs:  # the loop below's conditions for every row at once; anything failing goes to the loop, which names it
        blocks = list(map(_SECOND, alloc))
        claim = set(blocks)
        pool = state.pool
        if (len(claim) == len(blocks) and min(blocks) >= 0 and max(blocks) < pool.total and pool.free.keys() >= claim
                and all(map(state.seqs.__contains__, new_blocks))):
            return
    claimed: set[int] = set()
    for row in e.alloc:
        state.seq(row[0])
        for b in row[1:]:
            if b in claimed or not 0 <= b < state.pool.total or b not in state.pool.free:
                raise TransitionRefused("BlockPool", "allocation of a block that is not free", seq_id=row[0], block=b)
            claimed.add(b)


_PAIR = frozenset((2,))
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _check_work(state: ControlState, e: StepPlanned, new_blocks: dict[int, int]) -> None:
    admitted = set(e.admitted)
    bs = state.caps.block_size
    seqs = state.seqs
    running = Phase.RUNNING
    drafted = bool(e.drafts)
    nb = new_blocks.get
    for i, (seq_id, n) in enumerate(zip(e.seqs, e.fed, strict=True)):
        seq = seqs.get(seq_id)
        # the common case in one test (every condition of _check_planned holds); anything else goes through them
        if seq is not None and not drafted:
            c = seq.cursor
            end = c.computed + n
            blocks = len(seq.blocks)  # the new blocks looked up only when its own do not cover the end
            if ((c.phase is running or seq_id in admitted) and n >= 1 and end <= len(c.tokens)
                    and (end <= blocks * bs or end <= (blocks + nb(seq_id, 0)) * bs)):
                continue
        _check_planned(state, e, i, admitted, new_blocks)


@transition(StepPlanned)
def planned(state: ControlState, e: StepPlanned) -> tuple[int, ...]:
    cols = state.columns
    if cols is not None and (e.admitted or e.drafts or cols.fed is not None or e.seqs != cols.ids):
        state.flush_columns()  # another batch: the scalar path, and columns gathered anew below
        cols = None
    batch = state.batch
    if batch is not None and (e.admitted or e.drafts or e.restored or e.reset or batch.fed is not None
                              or (e.seqs is not batch.ids and e.seqs != batch.ids)):
        state.batch = None  # not the cached batch's plain step: the objects alone (gathered again after a step)
    _check_plan(state, e, cols)
    batch = state.batch  # None again if its check stood aside
    cols = state.columns  # None again if the check fell back to the objects
    for seq_id in e.admitted:
        seq = state.seqs[seq_id]
        # the drafter sees the prompt unless its context is off (then its keys start at the first decode)
        seq.admit(0 if state.caps.drafter_context else seq.cursor.prompt_len - 1)
        state.waiting.remove(seq_id)
        insort(state.running, seq_id)
    # many rows' blocks at once on the batch columns (one pass; their digest shares and `_holds` with it)
    allocated = batch.allocate(state.pool, e.alloc) if (
        batch is not None and len(e.alloc) >= ALLOC_ROWS and cols is None and state.prefix is None) else None
    for row in () if allocated is not None else e.alloc:
        state.pool.allocate(row[0], row[1:])
        if state.prefix is not None:  # a cached block handed out again is evicted
            for b in row[1:]:
                state.prefix.evict_block(b)
        state.seqs[row[0]].blocks.extend(row[1:])
        if cols is not None:
            cols.add_blocks(cols.row[row[0]], len(row) - 1)
        if batch is not None:
            batch.add_blocks(state.seqs[row[0]], batch.row[row[0]])
    state.pending_release.clear()
    # the plan carries them; new ones queue anew (in the executed plan's, when it left them empty)
    state.inflight_orders, state.orders = state.orders, empty_or_new(state.inflight_orders)
    state.inflight = e
    if batch is not None:  # the same key, the batch's head converted once (BatchColumns.plan_hash)
        state.inflight_hash = batch.plan_hash(e)
    else:  # the last plan's key again when the rows are the same (a decode step's, but for its step number)
        key = (e.seqs, e.fed, e.alloc, e.release, e.reset, e.restored, e.drafts)
        memo = state.plan_memo
        if memo is not None and memo[0] == key:
            state.inflight_hash = memo[1]
        else:
            state.inflight_hash = ints_key(b"atlas.plan", (e.seqs, e.fed, *e.alloc, e.release, e.reset, e.restored,
                                                           *e.drafts))
            state.plan_memo = (key, state.inflight_hash)
    state.step = e.step + 1
    touched = tuple(e.admitted) + tuple(map(_FIRST, e.alloc))  # (each row's seq_id; map: no generator)
    if allocated is not None:  # e.admitted is empty (the batch stood aside otherwise): touched is the alloc'd rows
        state.seq_digest ^= allocated[0]
        return Checked(touched, allocated[1])  # check_invariants gives the suspects to check_sequence
    if batch is not None:  # apply's refresh of the alloc'd rows, their new fingerprints kept in the column too
        fps = batch.fp
        for seq_id in touched:
            seq = state.seqs[seq_id]
            state.refresh(seq)
            fps[batch.row[seq_id]] = seq.fingerprint
        return Refreshed(touched)  # check_invariants tests each of them (`_holds`, then check_sequence)
    if cols is not None:  # the alloc'd sequences' digest shares and invariants, from the columns
        if not touched or refresh_rows(state, cols, [cols.row[s] for s in touched]):
            return Checked(touched, [])
        return touched  # flushed: apply refreshes them and check_invariants names what broke, on the objects
    if state.columnar and not e.drafts and state.prefix is None and len(e.seqs) >= VECTOR_MIN:
        for seq_id in touched:  # apply's refresh, before the columns copy the fingerprints
            state.refresh(state.seqs[seq_id])
        # this batch in columns from here on
        cols = state.columns = StepColumns.gather(state.seqs, e.seqs, state.caps.block_size)
        if cols is not None:
            cols.fed = np.array(e.fed, dtype=np.int64)
        return Refreshed(touched)
    return touched


@transition(StepExecuted)
def executed(state: ControlState, e: StepExecuted) -> tuple[int, ...]:
    plan = state.inflight
    if plan is None or plan.step != e.step:
        raise TransitionRefused("Engine", "execution of a step that was not planned", step=e.step,
                                inflight=None if plan is None else plan.step)
    if len(e.tokens) != len(plan.seqs):
        raise TransitionRefused("Engine", "one token slot per planned sequence", tokens=len(e.tokens),
                                seqs=len(plan.seqs))
    if (e.accepted or e.verdicts or plan.drafts) and not len(e.accepted) == len(e.verdicts) == len(plan.seqs):
        raise TransitionRefused("Speculative", "accepted counts and verdicts aligned with the planned sequences",
                                accepted=len(e.accepted), verdicts=len(e.verdicts), seqs=len(plan.seqs))
    bs = state.caps.block_size
    seqs = state.seqs
    batch = state.batch
    if batch is not None:
        if batch.fed is not None and not plan.drafts and not e.accepted and plan.seqs == batch.ids:
            change = batch.advance(e.tokens)
            if change is not None:
                state.seq_digest ^= change
                state.inflight = None
                state.inflight_hash = 0
                state.inflight_orders = empty_or_new(state.inflight_orders)
                return Checked(plan.seqs, [])
        state.batch = None  # the objects below (which refuse, if that is why the columns stood aside)
    cols = state.columns
    if cols is not None:
        if (cols.fed is not None and not plan.drafts and not e.accepted and plan.seqs == cols.ids
                and advance_columns(state, cols, e.tokens)):
            state.inflight = None
            state.inflight_hash = 0
            state.inflight_orders = empty_or_new(state.inflight_orders)
            return Checked(plan.seqs, [])
        state.flush_columns()  # the scalar path below (which refuses, if that is why the columns stepped aside)
    if not plan.drafts and not e.accepted:  # no verify and nothing refused: every sequence advances
        suspects = _advance_all(state, plan, e.tokens, bs)
        state.inflight = None
        state.inflight_hash = 0
        state.inflight_orders = empty_or_new(state.inflight_orders)
        if state.batch_cache and not suspects:
            _gather_batch(state, plan.seqs)
        return Checked(plan.seqs, suspects)
    work = []
    refused: list[Sequence] = []
    for i, (seq_id, fed, token) in enumerate(zip(plan.seqs, plan.fed, e.tokens, strict=True)):
        seq = seqs.get(seq_id)
        if seq is None:
            raise TransitionRefused("Request", "token for a sequence that is not live", seq_id=seq_id)
        drafts = plan.drafts[i] if plan.drafts else ()
        accepted = e.accepted[i] if e.accepted else 0
        if accepted == -1 and token == -1:
            refused.append(seq)
            continue  # its commit (or an order for it) was refused: nothing moves, the request fails next
        if drafts:
            seq.check_verify(drafts, accepted, token, bs)
        else:
            if accepted:
                raise TransitionRefused("Speculative", "accepted drafts without a verify", seq_id=seq_id,
                                        accepted=accepted)
            seq.check_advance(fed, token, bs)
        work.append((seq, fed, token, drafts, accepted))
    for seq in refused:  # the blocks its drafts took go now; the request ends with `error` next
        state.failing.add(seq.seq_id)
        keep = -(-len(seq.cursor.tokens) // bs)
        freed = seq.blocks[keep:]
        del seq.blocks[keep:]
        state.pool.release(seq.seq_id, freed)
    for seq, fed, token, drafts, accepted in work:  # every check passed: commit them all
        if drafts:
            state.pool.release(seq.seq_id, seq.commit_verify(drafts, accepted, token, bs))
        else:
            seq.commit_advance(fed, token)
        register_blocks(state, seq)
    state.inflight = None
    state.inflight_hash = 0
    state.inflight_orders = empty_or_new(state.inflight_orders)
    return plan.seqs


def _gather_batch(state: ControlState, ids: tuple[int, ...]) -> None:
    """The engine's batch columns of the step just executed, when it was the whole running queue on the common path
    (atlas.state.batch_columns); a batch that could not be gathered is not tried again while its ids stay."""
    if (ids == state.batch_tried or len(ids) < VECTOR_MIN or state.prefix is not None or state.caps.drafter_rows
            or state.columns is not None or list(ids) != state.running):
        return
    state.batch = BatchColumns.gather(state.seqs, ids, state.caps.block_size)
    state.batch_tried = () if state.batch is not None else ids


# from this many sequences StepExecuted fingerprints the common ones as numpy columns (running_fingerprints): the
# per-call cost of numpy loses to the scalar form below ~16 (measured: 27 vs 68 us at 64)
VECTOR_MIN = 16
# StepPlanned's allocation through BatchColumns.allocate from this many alloc rows (fewer: add_blocks per row)
ALLOC_ROWS = 2


def _advance_all(state: ControlState, plan: StepPlanned, tokens: tuple[int, ...], bs: int) -> list[int]:
    """StepExecuted of a step without drafts: every sequence advances by its fed count. One pass checks them
    all (Sequence.check_advance's conditions inline; a sequence that fails one goes through check_advance,
    which refuses naming it, before anything moved), a second commits them (Sequence.commit_advance: the
    one place a step's advance moves a sequence's cursors), refreshes each one's digest share and runs check_invariants'
    per-sequence test on the state it leaves (`_holds`'s conditions inline for a sequence without ring
    snapshots, drafter rows, MTP or rollbacks, `_holds` itself otherwise). Returns the ids that test could
    not pass, in plan order (the caller's Checked: check_invariants gives them to check_sequence, which names
    the broken invariant)."""
    seqs = state.seqs
    running = Phase.RUNNING
    work = []
    append = work.append
    get = seqs.get
    for seq_id, fed, token in zip(plan.seqs, plan.fed, tokens, strict=True):
        seq = get(seq_id)
        if seq is None:
            raise TransitionRefused("Request", "token for a sequence that is not live", seq_id=seq_id)
        c = seq.cursor
        end = c.computed + fed
        n = len(c.tokens)
        # check_advance's conditions: a sampled token exactly when every known token is fed, within the budget
        if (c.phase is not running or fed < 1 or end > n or end > seq.qsa.capacity or end > len(seq.blocks) * bs
                or ((end != n or n - c.prompt_len >= seq.max_new) if token >= 0 else end == n)):
            seq.check_advance(fed, token, bs)  # raises (the conditions above are its own)
        append((seq, c, end, token))  # the cursor and the end the commit pass needs, read once
    prefix = state.prefix
    acc = state.seq_digest
    suspects: list[int] = []
    vector = len(work) >= VECTOR_MIN
    # (sequence, token hash, id, length, computed, blocks) of the sequences fingerprinted as columns below: one
    # tuple a sequence, transposed once (six list appends a sequence were ~a tenth of this pass)
    v_rows: list[tuple[Sequence, int, int, int, int, int]] = []
    v_add = v_rows.append
    for seq, c, end, token in work:  # every check passed: commit them all (and refresh their digest share)
        seq.commit_advance(end - c.computed, token)
        q = seq.qsa
        d = seq.drafter
        toks = c.tokens
        th = c.token_hash
        if prefix is not None:
            register_blocks(state, seq)
        snaps = seq.ring.snapshots
        if snaps or seq.rollbacks or d.rows or d.mtp or d.carried:  # the rare fields: the functions themselves
            fp = sequence_fingerprint(seq)
            if not _holds(seq, bs, 0):
                suspects.append(seq.seq_id)
        else:
            n = len(toks)
            blocks = len(seq.blocks)
            # _holds's conditions for this case (no snapshots, no drafter rows, not MTP, not carried)
            pl = c.prompt_len
            if (end < 0 or end > n or pl > n or n - pl > seq.max_new or q.ingested != end or end > q.capacity
                    or c.phase is not running or end > blocks * bs or (blocks - 1) * bs >= max(n, 1)):
                suspects.append(seq.seq_id)
            if vector and not seq.preemptions and not d.latched and c.phase is running:
                v_add((seq, th, seq.seq_id, n, end, blocks))  # fingerprinted below, all at once
                continue
            # sequence_fingerprint without its rare-field round (no snapshots, no rollbacks, no drafter rows)
            fp = common_fingerprint(th, seq.seq_id, n, end, c.phase, blocks, seq.preemptions, d.latched)
        acc ^= seq.fingerprint ^ fp
        seq.fingerprint = fp
    fold_fingerprints(state, acc, v_rows)
    return suspects
