"""Transitions of the snapshot ring and rollback, and of the speculative lane's latch (registered on ControlState):
each between two steps, on a running sequence the data plane holds."""

from __future__ import annotations

from atlas.errors import TransitionRefused
from atlas.plan import RingRestore
from atlas.state.control import ControlState, transition
from atlas.state.events import BoundarySnapshotted, RollbackDeclined, RolledBack, SpeculationLatchedOff
from atlas.state.prefix import forget_blocks


@transition(SpeculationLatchedOff)
def latched(state: ControlState, e: SpeculationLatchedOff) -> tuple[int, ...]:
    seq = state.running_between_steps(e.seq_id, "speculation latch")
    if seq.drafter.latched:
        raise TransitionRefused("Speculative", "the lane latches off once", seq_id=e.seq_id)
    if e.position != seq.cursor.computed:
        raise TransitionRefused("Speculative", "latched at the sequence's computed tokens", seq_id=e.seq_id,
                                position=e.position, computed=seq.cursor.computed)
    seq.drafter.latched = True
    return (e.seq_id,)


@transition(BoundarySnapshotted)
def snapshotted(state: ControlState, e: BoundarySnapshotted) -> tuple[int, ...]:
    seq = state.running_between_steps(e.seq_id, "snapshot")
    if e.position != seq.cursor.computed:
        raise TransitionRefused("SsmRing", "a snapshot holds the sequence's computed tokens", seq_id=e.seq_id,
                                position=e.position, computed=seq.cursor.computed)
    seq.ring.record(e.position, e.slot, e.evicted)
    return (e.seq_id,)


@transition(RolledBack)
def rolled_back(state: ControlState, e: RolledBack) -> tuple[int, ...]:
    """Every control-plane cursor moves to the boundary now; the data plane's restore is an order of the next
    plan (RingRestore), and the data plane's cursors are checked against these after that step."""
    seq = state.running_between_steps(e.seq_id, "rollback")
    if e.attempt != seq.rollbacks + 1:
        raise TransitionRefused("Request", "rollback attempts count up from 1", seq_id=e.seq_id,
                                attempt=e.attempt, taken=seq.rollbacks)
    c = seq.cursor
    held = (c.computed, seq.qsa.ingested, c.computed, c.computed, seq.drafter.rows)
    rollbacks = state.orders.rollbacks
    earlier = next((i for i, r in enumerate(rollbacks) if r.seq_id == e.seq_id), None)
    if earlier is not None:  # a second rollback before the data plane ran the first: the data plane still holds
        held = rollbacks.pop(earlier).held  # the first one's position, and this boundary's snapshot (b2 <= b1)
    freed = seq.rollback(e.boundary, e.slot, e.keep, e.ban_token, e.blocks_freed, state.caps.block_size)
    forget_blocks(state, seq.blocks + freed, e.boundary)
    state.pool.release(seq.seq_id, freed)
    rollbacks.append(RingRestore(e.seq_id, e.slot, e.boundary, held))
    return (e.seq_id,)


@transition(RollbackDeclined)
def declined(state: ControlState, e: RollbackDeclined) -> tuple[int, ...]:
    state.seq(e.seq_id)  # a decline moves nothing; the request's finish follows as its own event
    return (e.seq_id,)
