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


def empty_or_new(orders: PlanOrders) -> PlanOrders:
    """`orders` itself when it holds no order, else a new empty PlanOrders: what a step event leaves where it used to
    build a new empty one each time (two a step, ~4.5 K instructions each: three lists and an attrs __init__). Only
    the state holds its PlanOrders (the planner copies what it reads into the StepPlan's tuples), so an empty one
    kept is indistinguishable from a new one."""
    if orders.stores or orders.restores or orders.rollbacks or orders.carry_drop or orders.carry_store != -1:
        return PlanOrders()
    return orders
