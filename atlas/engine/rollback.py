"""Rollback planning: pure functions from the control plane to a decision. No tensors, no mutation.

Snapshots. A boundary is the prompt's end and every `snapshot_interval` tokens past it. When a step's work
leaves a sequence's computed tokens exactly on a boundary, the plan asks the data plane to store the state
there into the slot `SsmRing.place()` names (the lowest free one, else the oldest snapshot's).

Rollback. When the watchdog sees a loop whose second copy opens at position `keep`, the sequence keeps
tokens[:keep] and is rewound to the newest snapshot b < keep: every cursor moves to b in one event, the
tokens b..keep-1 are fed again (exact: the backend's bits depend only on the token and its prefix), and the
token that opened the loop is banned at position `keep`, so the resample there takes another path. A loop
that opens at the first generated token cannot be re-steered (no snapshot lies before it) and declines.

Declines, each a typed reason, are decided before anything moves; the request then ends with `stop`. The data
plane's restore is an order of the next plan (atlas.plan.RingRestore).
"""

from __future__ import annotations

from enum import Enum

import attrs

from atlas.plan import RingSnapshot
from atlas.state.machines import Phase, Sequence


class DeclineReason(str, Enum):  # noqa: UP042 (the value is the wire form, as FinishReason)
    RING_DISABLED = "ring_disabled"  # ring_slots 0: no state is ever kept to rewind to
    STREAMED = "streamed"  # tokens past the boundary already reached a streaming client
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"  # max_rollbacks taken already
    NO_SNAPSHOT = "no_snapshot"  # no snapshot at or before the target (the loop opens too early)
    BACKEND_REFUSED = "backend_refused"  # the data plane's pre-validation refused the restore


@attrs.frozen
class RollbackPlan:
    seq_id: int
    boundary: int
    slot: int
    keep: int
    ban_token: int
    blocks_freed: int


@attrs.frozen
class RollbackDecline:
    seq_id: int
    reason: DeclineReason
    keep: int


def is_boundary(position: int, prompt_len: int, interval: int) -> bool:
    return position >= prompt_len and (position - prompt_len) % interval == 0


def next_boundary(computed: int, prompt_len: int, interval: int) -> int:
    """The first boundary past `computed` tokens."""
    if computed < prompt_len:
        return prompt_len
    return prompt_len + ((computed - prompt_len) // interval + 1) * interval


def plan_snapshots(seqs: dict[int, Sequence], work: tuple[int, ...], fed: tuple[int, ...],
                   interval: int) -> tuple[RingSnapshot, ...]:
    """The snapshots a step takes after its work: a sequence whose work ends on a boundary it does not
    hold yet. Deterministic in plan order."""
    orders = []
    for seq_id, n in zip(work, fed, strict=True):
        seq = seqs[seq_id]
        if seq.ring.slots == 0:
            continue
        end = seq.cursor.computed + n
        last = seq.ring.snapshots[-1][0] if seq.ring.snapshots else -1
        if end > last and is_boundary(end, seq.cursor.prompt_len, interval):
            slot, evicted = seq.ring.place()
            orders.append(RingSnapshot(seq_id, end, slot, evicted))
    return tuple(orders)


def plan_rollback(seq: Sequence, keep: int, *, max_rollbacks: int,
                  block_size: int) -> RollbackPlan | RollbackDecline:
    """Rewind `seq` so that it keeps tokens[:keep] and resamples position `keep`, or say why not."""
    c = seq.cursor
    if not (c.phase is Phase.RUNNING and c.prompt_len < keep < len(c.tokens)):
        raise ValueError(f"sequence {seq.seq_id}: rollback target {keep} outside (prompt_len {c.prompt_len}, "
                         f"seq_len {len(c.tokens)}) or the sequence is not running")
    if seq.ring.slots == 0:
        return RollbackDecline(seq.seq_id, DeclineReason.RING_DISABLED, keep)
    if seq.stream:
        return RollbackDecline(seq.seq_id, DeclineReason.STREAMED, keep)
    if seq.rollbacks >= max_rollbacks:
        return RollbackDecline(seq.seq_id, DeclineReason.ATTEMPTS_EXHAUSTED, keep)
    snap = seq.ring.latest_before(keep)
    if snap is None or snap[0] > c.computed:
        return RollbackDecline(seq.seq_id, DeclineReason.NO_SNAPSHOT, keep)
    boundary, slot = snap
    blocks_freed = len(seq.blocks) - -(-keep // block_size)
    return RollbackPlan(seq.seq_id, boundary, slot, keep, c.tokens[keep], blocks_freed)
