"""Invariants of the control plane, checked after every event on what the event touched.

`check_invariants` is the cheap per-event check (the touched sequences and the pool's counters);
`audit` is the full check (every block's owner and reference count), run at the end of a test workload or
after every event when the engine is built with `full_audit=True`.
"""

from __future__ import annotations

from typing import Any

from atlas.errors import InvariantViolation
from atlas.state.control import Checked, ControlState
from atlas.state.machines import Phase, Sequence


def _fail(index: int, machine: str, message: str, **fields: Any) -> None:
    raise InvariantViolation(index, machine, message, fields)


def check_sequence(seq: Sequence, block_size: int, index: int, drafts_in_flight: int = 0) -> None:
    """`drafts_in_flight`: drafts the in-flight step verifies for this sequence; their KV positions have
    blocks until the verify's commit frees those past the kept tokens."""
    c = seq.cursor
    n = len(c.tokens)
    if not 0 <= c.computed <= n:
        _fail(index, "SequenceCursor", "computed within the tokens", seq_id=seq.seq_id, computed=c.computed,
              seq_len=n)
    if n < c.prompt_len or n - c.prompt_len > seq.max_new:
        _fail(index, "Request", "generated within the budget", seq_id=seq.seq_id, seq_len=n,
              prompt_len=c.prompt_len, max_new=seq.max_new)
    q = seq.qsa
    if q.ingested != c.computed:
        _fail(index, "QsaCursor", "ingested == computed", seq_id=seq.seq_id, ingested=q.ingested,
              computed=c.computed)
    if q.ingested > q.capacity:
        _fail(index, "QsaCursor", "ingested <= capacity", seq_id=seq.seq_id, ingested=q.ingested,
              capacity=q.capacity)
    if c.phase is Phase.WAITING:
        if c.computed or seq.blocks or seq.on_device:
            _fail(index, "SequenceCursor", "a waiting sequence holds nothing", seq_id=seq.seq_id,
                  computed=c.computed, blocks=len(seq.blocks), on_device=seq.on_device)
    elif c.phase is Phase.RUNNING:
        if c.computed > len(seq.blocks) * block_size:
            _fail(index, "BlockPool", "a running sequence's KV fits its blocks", seq_id=seq.seq_id,
                  computed=c.computed, blocks=len(seq.blocks), block_size=block_size)
        if (len(seq.blocks) - 1) * block_size >= max(n + drafts_in_flight, 1):
            _fail(index, "BlockPool", "no block beyond the sequence's tokens", seq_id=seq.seq_id,
                  seq_len=n, drafts_in_flight=drafts_in_flight, blocks=len(seq.blocks), block_size=block_size)
    else:
        _fail(index, "Request", "a finished sequence is not live", seq_id=seq.seq_id)
    prev = -1
    for position, _slot in seq.ring.snapshots:
        if position <= prev or position > c.computed:
            _fail(index, "SsmRing", "snapshot positions strictly increasing and <= computed",
                  seq_id=seq.seq_id, positions=[p for p, _ in seq.ring.snapshots], computed=c.computed)
        prev = position
    if len(seq.ring.snapshots) > seq.ring.slots:
        _fail(index, "SsmRing", "at most `slots` snapshots", seq_id=seq.seq_id,
              snapshots=len(seq.ring.snapshots), slots=seq.ring.slots)
    slots = [slot for _, slot in seq.ring.snapshots]
    if len(set(slots)) != len(slots) or any(not 0 <= s < seq.ring.slots for s in slots):
        _fail(index, "SsmRing", "each snapshot in its own slot of the ring", seq_id=seq.seq_id, slots=slots,
              ring_slots=seq.ring.slots)
    d = seq.drafter
    if d.rows and (d.last_pair_key >= n - 1 or d.rows != d.last_pair_key - d.first_key + 1 or d.first_key < 0):
        _fail(index, "DrafterCarry", "drafter keys first_key .. last_pair_key, contiguous, < seq_len - 1",
              seq_id=seq.seq_id, rows=d.rows, first_key=d.first_key, last_pair_key=d.last_pair_key, seq_len=n)
    if not d.carried and d.rows and d.last_pair_key > c.computed - 2:
        _fail(index, "DrafterCarry", "only carried rows run ahead of the fed tokens", seq_id=seq.seq_id,
              last_pair_key=d.last_pair_key, computed=c.computed)
    if d.mtp and c.phase is Phase.RUNNING and c.computed - 2 >= d.first_key and d.last_pair_key < c.computed - 2:
        _fail(index, "DrafterCarry", "an MTP drafter holds every pair key of the fed tokens from its first key",
              seq_id=seq.seq_id, rows=d.rows, first_key=d.first_key, last_pair_key=d.last_pair_key,
              computed=c.computed)
    if d.carried and c.computed == 0:
        _fail(index, "DrafterCarry", "a carry implies a prefill", seq_id=seq.seq_id)


def _drafts_in_flight(state: ControlState, seq_id: int) -> int:
    plan = state.inflight
    if plan is None or not plan.drafts or seq_id not in plan.seqs:
        return 0
    return len(plan.drafts[plan.seqs.index(seq_id)])


def check_invariants(state: ControlState, touched: tuple[int, ...], index: int) -> None:
    """After every event: the sequences it touched, and the pool's and queues' counters.

    Each touched sequence goes through `holds`, one expression with every condition of check_sequence (on
    its common path): only a sequence it cannot pass is given to check_sequence, which names the broken
    invariant exactly as before. At batch 64 this was the largest per-sequence cost of a step (6.9 us of
    ~37 us per sequence-step, benchmarks/control_plane.py)."""
    pool = state.pool
    if len(pool.free) + pool.used != pool.total:
        _fail(index, "BlockPool", "free + used == total", free=len(pool.free), used=pool.used, total=pool.total)
    if len(state.running) > state.caps.max_batch_size:
        _fail(index, "Scheduler", "running <= max_batch_size", running=len(state.running),
              max_batch_size=state.caps.max_batch_size)
    bs = state.caps.block_size
    seqs = state.seqs
    if type(touched) is Checked:  # the handler ran `holds`'s test in its commit pass: what it could not pass
        for seq_id in touched.suspects:
            check_sequence(seqs[seq_id], bs, index, _drafts_in_flight(state, seq_id))
        return
    plan = state.inflight
    drafting = plan is not None and bool(plan.drafts)
    for seq_id in touched:
        seq = seqs.get(seq_id)
        if seq is not None:
            in_flight = _drafts_in_flight(state, seq_id) if drafting else 0
            if not holds(seq, bs, in_flight):
                check_sequence(seq, bs, index, in_flight)


def holds(seq: Sequence, bs: int, drafts_in_flight: int) -> bool:
    """True only when check_sequence would pass: its conditions, negated and joined (False for anything not
    RUNNING or WAITING, which check_sequence refuses)."""
    c = seq.cursor
    n = len(c.tokens)
    computed = c.computed
    q = seq.qsa
    d = seq.drafter
    ring = seq.ring
    snaps = ring.snapshots
    if snaps:
        if len(snaps) > ring.slots or len({slot for _, slot in snaps}) != len(snaps):
            return False
        prev = -1
        for position, slot in snaps:
            if position <= prev or position > computed or not 0 <= slot < ring.slots:
                return False
            prev = position
    if not (0 <= computed <= n and c.prompt_len <= n and n - c.prompt_len <= seq.max_new
            and q.ingested == computed and q.ingested <= q.capacity):
        return False
    phase = c.phase
    blocks = len(seq.blocks)
    if phase is Phase.RUNNING:
        if computed > blocks * bs or (blocks - 1) * bs >= max(n + drafts_in_flight, 1):
            return False
    elif phase is not Phase.WAITING or computed or blocks or seq.on_device:
        return False
    rows = d.rows
    if rows and (d.last_pair_key >= n - 1 or rows != d.last_pair_key - d.first_key + 1 or d.first_key < 0
                 or (not d.carried and d.last_pair_key > computed - 2)):
        return False
    if d.mtp and phase is Phase.RUNNING and computed - 2 >= d.first_key and d.last_pair_key < computed - 2:
        return False
    return not (d.carried and computed == 0)


def audit(state: ControlState, index: int) -> None:
    """Every invariant of every machine, including block ownership. O(blocks + tokens): tests and debug."""
    pool = state.pool
    owner: dict[int, int] = {}
    owners: dict[int, int] = {}  # block -> live sequences holding it (prefix-cached blocks are shared)
    cached = state.prefix.hash_of if state.prefix is not None else {}
    for seq in state.seqs.values():
        check_sequence(seq, state.caps.block_size, index, _drafts_in_flight(state, seq.seq_id))
        if len(set(seq.blocks)) != len(seq.blocks):
            _fail(index, "BlockPool", "a sequence holds a block once", seq_id=seq.seq_id, blocks=seq.blocks)
        for b in seq.blocks:
            if b in owner and b not in cached:
                _fail(index, "BlockPool", "a block has one owner", block=b, owners=[owner[b], seq.seq_id])
            owner[b] = seq.seq_id
            owners[b] = owners.get(b, 0) + 1
    for b in range(pool.total):
        expected = owners.get(b, 0)
        if pool.refs[b] != expected or (b in pool.free) != (expected == 0):
            _fail(index, "BlockPool", "ref counts match owners and the free list", block=b, ref=pool.refs[b],
                  owner=owner.get(b), free=b in pool.free)
    if pool.used != len(owner):
        _fail(index, "BlockPool", "used == blocks owned", used=pool.used, owned=len(owner))
    if state.prefix is not None:  # only committed tokens are cached: never a block holding draft positions
        bs = state.caps.block_size
        for seq in state.seqs.values():
            for i, b in enumerate(seq.blocks):
                h = state.prefix.hash_of.get(b)
                if h is None:
                    continue
                if (i >= len(seq.prefix_chain) or seq.prefix_chain[i] != h or (i + 1) * bs > seq.cursor.computed
                        or state.prefix.blocks[h].tokens != tuple(seq.cursor.tokens[i * bs:(i + 1) * bs])):
                    _fail(index, "PrefixCache", "a cached block a sequence holds is one of its full blocks of "
                          "computed tokens, same chain and tokens", seq_id=seq.seq_id, block=b, index=i,
                          computed=seq.cursor.computed, chain=len(seq.prefix_chain))
    live = sorted(state.seqs)
    queued = sorted(state.waiting + state.running)
    if live != queued or state.waiting != sorted(state.waiting) or state.running != sorted(state.running):
        _fail(index, "Scheduler", "every live sequence is in exactly one ordered queue", live=live,
              waiting=state.waiting, running=state.running)
    for seq_id in state.waiting:
        if state.seqs[seq_id].cursor.phase is not Phase.WAITING:
            _fail(index, "Scheduler", "the waiting queue holds waiting sequences", seq_id=seq_id)
    for seq_id in state.running:
        if state.seqs[seq_id].cursor.phase is not Phase.RUNNING:
            _fail(index, "Scheduler", "the running queue holds running sequences", seq_id=seq_id)
