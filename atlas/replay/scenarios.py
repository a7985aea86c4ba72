"""The scenario backends of the failure library, and rebuilding the engine a trace was recorded with.

A trace's run row names its backend. "cpu" and "null" are the engine's own; the scenario backends below are
the data planes of the failure library (traces/), deterministic and recordable by name, so that
`atlas replay verify/against` rebuild exactly the engine that recorded a trace:

- "null-looping": the null backend whose sampler is caught in a content loop (`LOOP_TOKEN` from position
  `LOOP_FROM` on) until a rollback bans the looping token there; then the model's own re-steered token.
- "cpu-looping": the CPU reference on atlas-tiny with the same scripted loop (real GDN, PLE, QSA and KV state
  behind every rollback, so a restore that misses one of them shows in that layer's position stamp);
- "cpu-row-blind": the CPU backend declaring it cannot apply QSA selection per verify row
  (per_row_qsa_verify=False) and refusing a verify whose rows cross the inert bound, as a backend
  that attends densely per verify would have to.
"""

from __future__ import annotations

from typing import Any

import attrs

from atlas.backends.null import NullBackend
from atlas.config import Capacities
from atlas.plan import StepPlan, StepResult

LOOP_TOKEN = 65  # "A": a period-1 loop, the shortest the watchdog can see
LOOP_FROM = 6  # sampled positions from here on loop


def loop(plan: StepPlan, result: StepResult, steered: set[int]) -> StepResult:
    """The scripted loop: every sampled position from LOOP_FROM on samples LOOP_TOKEN, until a rollback bans it
    there; then the model's own token, and the sequence has left the loop (`steered`)."""
    for seq_id in (*plan.release, *plan.reset):
        steered.discard(seq_id)
    outcomes = []
    for work, o in zip(plan.work, result.outcomes, strict=True):
        if o.token is not None and not work.drafts and work.end >= LOOP_FROM and work.seq_id not in steered:
            if LOOP_TOKEN in work.banned:  # the re-steer: the model's own (non-banned) token, loop left
                steered.add(work.seq_id)
            else:
                o = attrs.evolve(o, token=LOOP_TOKEN)
        outcomes.append(o)
    return attrs.evolve(result, outcomes=tuple(outcomes))


class LoopingNullBackend(NullBackend):
    name = "null-looping"

    def __init__(self) -> None:
        super().__init__()
        self.steered: set[int] = set()  # sequences a rollback re-steered out of the loop

    def execute(self, plan: StepPlan) -> StepResult:
        return loop(plan, super().execute(plan), self.steered)


def looping_null() -> LoopingNullBackend:
    return LoopingNullBackend()


def looping_cpu(loaded: Any, caps: Capacities, **options: Any) -> Any:
    from atlas.backends.cpu import CpuBackend

    class LoopingCpuBackend(CpuBackend):
        name = "cpu-looping"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.steered: set[int] = set()

        def execute(self, plan: StepPlan) -> StepResult:
            return loop(plan, super().execute(plan), self.steered)

    return LoopingCpuBackend.for_capacities(loaded, caps, **options)


def row_blind_cpu(loaded: Any, caps: Capacities, **options: Any) -> Any:
    """The CPU backend with per_row_qsa_verify=False (it refuses a verify whose rows pass the inert bound,
    atlas.backends.base.check_dense_verify), under its own name."""
    from atlas.backends.cpu import CpuBackend

    class RowBlindCpuBackend(CpuBackend):
        name = "cpu-row-blind"

    return RowBlindCpuBackend.for_capacities(loaded, caps, **{**options, "per_row_qsa_verify": False})
