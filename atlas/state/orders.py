"""Data-plane work the control plane's events queue for the next plan (`PlanOrders`).

A prefix hit, a prefix snapshot, a carry store or release and a content-loop rollback all happen between two
steps in the control plane; the tensors follow in the next plan, which the scheduler builds from these orders
(atlas.engine.planner) and whose StepPlanned event clears them.
"""

from __future__ import annotations

import attrs

from atlas.plan import CarryOrder, PrefixRestore, PrefixStore, RingRestore


@attrs.define
class PlanOrders:
    stores: list[PrefixStore] = attrs.Factory(list)
    restores: list[PrefixRestore] = attrs.Factory(list)
    rollbacks: list[RingRestore] = attrs.Factory(list)
    carry_store: int = -1  # the sequence whose drafter rows the data plane keeps when it releases it
    carry_drop: bool = False  # drop the carried entry the data plane holds (before carry_store's)

    def clear(self) -> None:
        self.stores.clear()
        self.restores.clear()
        self.rollbacks.clear()
        self.carry_store = -1
        self.carry_drop = False

    def forget(self, seq_id: int) -> None:
        """A sequence whose data-plane state goes (finished, preempted) needs none of its restores."""
        self.rollbacks[:] = [r for r in self.rollbacks if r.seq_id != seq_id]
        self.restores[:] = [r for r in self.restores if r.seq_id != seq_id]

    @property
    def carry(self) -> CarryOrder:
        return CarryOrder(self.carry_drop, self.carry_store)
