"""The CPU backend's snapshot ring: per sequence, up to `ring_slots` boundary snapshots in numbered slots.

A slot holds a StateSnapshot (deep copies of the GDN conv + recurrent state of every layer and the PLE
n-gram context + short-conv state); KV, QSA raw keys and drafter rows are positional, so a restore only
moves their cursors back and the positions past the boundary are dropped. The control plane's SsmRing
says which (position, slot) pairs exist; this is where their tensors live.
"""

from __future__ import annotations

from atlas.backends.cpu.state import StateSnapshot
from atlas.errors import RestoreRefused


class SnapshotRing:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._held: dict[int, dict[int, StateSnapshot]] = {}  # seq_id -> slot -> snapshot

    def check_store(self, seq_id: int, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"sequence {seq_id}: ring slot {slot} outside [0, {self.slots}) (ring_slots)")

    def store(self, seq_id: int, slot: int, snap: StateSnapshot) -> None:
        self.check_store(seq_id, slot)
        self._held.setdefault(seq_id, {})[slot] = snap

    def get(self, seq_id: int, slot: int, position: int) -> StateSnapshot:
        """The snapshot in `slot`, which must be the one taken at `position`."""
        snap = self._held.get(seq_id, {}).get(slot)
        if snap is None:
            raise RestoreRefused(f"sequence {seq_id}: ring slot {slot} holds no snapshot")
        if snap.position != position:
            raise RestoreRefused(f"sequence {seq_id}: ring slot {slot} holds position {snap.position}, "
                                 f"not {position}")
        return snap

    def positions(self, seq_id: int) -> dict[int, int]:
        """slot -> position of every snapshot the sequence holds."""
        return {slot: snap.position for slot, snap in self._held.get(seq_id, {}).items()}

    def truncate_after(self, seq_id: int, position: int) -> None:
        held = self._held.get(seq_id, {})
        for slot in [s for s, snap in held.items() if snap.position > position]:
            del held[slot]

    def release(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)
