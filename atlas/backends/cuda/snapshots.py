"""The snapshots of the CUDA state store (a base of `CudaStateStore`, atlas.backends.cuda.store, which sets the
attributes it reads and gives `_clear_stamp`, `_forget` and `cursors`): the snapshot ring and prefix caching.

A ring snapshot copies the per-slot state and its stamps into the slot's ring row; KV, QSA keys and drafter rows
are positional, so a restore copies the state back and clears the stamp of the first position past the boundary
(every row past it stops counting). A prefix snapshot is a device copy of the per-slot state, the partial block's
KV rows, QSA keys and stamps, and the target's last hidden (the drafter's next pair key needs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from atlas.backends.audit import StateAudit
from atlas.backends.cuda.audit import slot_digest
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.seq_state import PrefixEntry, SeqState
from atlas.errors import RestoreRefused
from atlas.plan import BackendCursors, CarryOrder, PrefixRestore, RingRestore, RingSnapshot
from atlas.plan import PrefixStore as PrefixStoreOrder


class Snapshots:
    """The ring snapshots, prefix snapshots and the drafter's carry of CudaStateStore."""

    pools: DevicePools
    block_size: int
    drafter: Any
    audit: StateAudit | None
    seqs: dict[int, SeqState]
    prefix: dict[int, PrefixEntry]
    prompt_tail: dict[int, torch.Tensor]
    _launched: Any

    def _check_ring(self, seq_id: int, slot: int) -> None:
        if not 0 <= slot < self.pools.ring_slots:
            raise ValueError(f"sequence {seq_id}: ring slot {slot} outside [0, {self.pools.ring_slots}) (ring_slots)")

    def check_snapshot(self, order: RingSnapshot) -> None:
        self._check_ring(order.seq_id, order.slot)

    def snapshot(self, order: RingSnapshot) -> None:
        self._check_ring(order.seq_id, order.slot)
        s = self.seqs.get(order.seq_id)
        if s is None or s.position != order.position or s.pending is not None:
            raise RestoreRefused(f"sequence {order.seq_id}: a ring snapshot at {order.position} needs the sequence "
                                 f"there, committed (holds {None if s is None else s.position})")
        self.pools.ring_store(s.slot, order.slot)
        if self.audit is not None:  # what the snapshot must hold: the live slot's state (atlas.backends.cuda.audit)
            self.audit.record(("ring", order.seq_id, order.slot), slot_digest(self.pools, s.slot))
        s.ring[order.slot] = (order.position, list(s.ple_context))
        if self.drafter is not None:
            self.drafter.snapshot(order.seq_id, order.slot, order.position)

    def restore(self, order: RingRestore) -> BackendCursors:
        self._launched = None  # a write: a prefetched read is stale
        seq_id, position = order.seq_id, order.position
        s = self.seqs.get(seq_id)
        if s is None:
            raise RestoreRefused(f"sequence {seq_id} is not held by this backend")
        held = s.ring.get(order.slot)
        if held is None:
            raise RestoreRefused(f"sequence {seq_id}: ring slot {order.slot} holds no snapshot")
        if held[0] != position:
            raise RestoreRefused(f"sequence {seq_id}: ring slot {order.slot} holds position {held[0]}, not {position}")
        if position > s.position:
            raise RestoreRefused(f"sequence {seq_id}: snapshot at {position} is past the {s.position} tokens held")
        self.pools.ring_load(s.slot, order.slot)
        self._clear_stamp(s.table, position)  # KV / QSA rows past the boundary stop counting
        s.position, s.pending, s.ple_context = position, None, list(held[1])
        self._forget(seq_id)
        if self.audit is not None:
            self.audit.check(seq_id, "ring restore", ("ring", seq_id, order.slot), slot_digest(self.pools, s.slot))
        s.ring = {slot: v for slot, v in s.ring.items() if v[0] <= position}
        self.prompt_tail.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.rewind(seq_id, position, order.slot)
        return self.cursors(seq_id)

    def _tail_slots(self, table: Sequence[int], position: int) -> torch.Tensor:
        bs = self.block_size
        lo = position - position % bs
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(lo, position)], dtype=torch.long,
                            device=self.pools.device)

    def store_prefix(self, order: PrefixStoreOrder) -> None:
        seq_id, position = order.seq_id, order.position
        s = self.seqs.get(seq_id)
        if s is None or s.position != position or s.pending is not None:
            raise RestoreRefused(f"sequence {seq_id}: a prefix snapshot at {position} needs the sequence at exactly "
                                 f"that position, committed (holds {None if s is None else s.position})")
        if order.evicted >= 0 and order.evicted not in self.prefix:
            raise RestoreRefused(f"prefix snapshot {order.evicted:016x} to evict is not held")
        pools = self.pools
        tail: dict[str, torch.Tensor] = {}
        if position % self.block_size:
            slots = self._tail_slots(s.table, position)
            for layer in pools.keys:
                tail[f"k{layer}"] = pools.keys[layer].view(-1, *pools.keys[layer].shape[2:])[slots].clone()
                tail[f"v{layer}"] = pools.values[layer].view(-1, *pools.values[layer].shape[2:])[slots].clone()
            for layer in pools.index_keys:
                tail[f"i{layer}"] = pools.index_keys[layer].view(-1, pools.index_keys[layer].shape[-1])[slots].clone()
        state, stamps = pools.copy_slot(s.slot)
        hidden = self.drafter.last_hidden(seq_id) if self.drafter is not None else None
        if order.evicted >= 0:
            del self.prefix[order.evicted]
        self.prefix[order.key] = PrefixEntry(position, state, stamps, list(s.ple_context), tail, hidden)
        if self.audit is not None:
            self.audit.record(("prefix", order.key, 0), slot_digest(pools, s.slot))

    def load_prefix(self, order: PrefixRestore) -> None:
        """Start the sequence at `position` from prefix snapshot `key`: the shared full blocks of the table hold
        the KV and QSA keys (with stamps) already; the snapshot's tail rows go into the block `position` ends in."""
        self._launched = None  # a write: a prefetched read is stale
        seq_id, position, table = order.seq_id, order.position, tuple(order.block_table)
        entry = self.prefix.get(order.key)
        if entry is None:
            raise RestoreRefused(f"prefix snapshot {order.key:016x} is not held")
        if entry.position != position:
            raise RestoreRefused(f"prefix snapshot {order.key:016x} holds position {entry.position}, not {position}")
        if len(table) * self.block_size < position:
            raise RestoreRefused(f"sequence {seq_id}: block table of {len(table)} blocks cannot hold {position} tokens")
        if order.adopt and (self.drafter is None or not self.drafter.has_carry()):
            raise RestoreRefused(f"sequence {seq_id}: adoption of a drafter carry this backend does not hold")
        if seq_id not in self.seqs:
            self.seqs[seq_id] = SeqState(slot=self.pools.allocate())
        s = self.seqs[seq_id]
        pools = self.pools
        pools.load_slot(s.slot, entry.state, entry.stamps)
        if entry.tail:
            slots = self._tail_slots(table, position)
            for layer in pools.keys:
                pools.keys[layer].view(-1, *pools.keys[layer].shape[2:]).index_copy_(0, slots, entry.tail[f"k{layer}"])
                pools.values[layer].view(-1, *pools.values[layer].shape[2:]).index_copy_(0, slots,
                                                                                          entry.tail[f"v{layer}"])
            for layer in pools.index_keys:
                pools.index_keys[layer].view(-1, pools.index_keys[layer].shape[-1]).index_copy_(
                    0, slots, entry.tail[f"i{layer}"])
            lo = position - position % self.block_size
            pools.stamp_rows(slots, torch.arange(lo, position, dtype=torch.int32, device=pools.device))
        self._clear_stamp(table, position)
        s.position, s.table, s.pending, s.ring = position, table, None, {}
        self._forget(seq_id)
        if self.audit is not None:
            self.audit.check(seq_id, "prefix restore", ("prefix", order.key, 0), slot_digest(pools, s.slot))
        s.ple_context = list(entry.ple_context)
        self.prompt_tail.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.resume(seq_id, s.slot, order, entry.last_hidden)

    def carry(self, order: CarryOrder) -> None:
        self._launched = None  # a write: a prefetched read is stale
        if self.drafter is None:  # nothing to carry without a drafter (the carry is the drafter's rows)
            return
        if order.drop:
            self.drafter.drop_carry()
        if order.store >= 0:
            self.drafter.store_carry(order.store)
