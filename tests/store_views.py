"""What the hypothesis state machines read from a backend's state store, for the CPU reference and the CUDA
backend alike (their stores keep the ring's positions and the drafter's first key in their own structures)."""

from __future__ import annotations

from typing import Any


def ring_positions(backend: Any, seq_id: int) -> dict[int, int]:
    """slot -> position of every ring snapshot the data plane holds for the sequence."""
    store = backend.store
    if hasattr(store, "ring"):  # the CPU reference's SnapshotRing
        return store.ring.positions(seq_id)
    s = store.seqs.get(seq_id)
    return {} if s is None else {slot: pos for slot, (pos, _) in s.ring.items()}


def drafter_first_key(backend: Any, seq_id: int) -> int:
    store = backend.store
    if hasattr(store, "drafts"):
        return store.drafts[seq_id].first_key
    return store.drafter.seqs[seq_id].first_key
