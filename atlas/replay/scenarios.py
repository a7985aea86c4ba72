"""Rebuilding the engine a trace was recorded with, including the scenario backends of captured failures.

A trace's run row names its backend. "cpu" and "null" are the engine's own; the scenario backends below are
the data planes of the failure library (traces/), deterministic and recordable by name, so that
`atlas replay verify/against` rebuild exactly the engine that recorded a trace:

- "null-looping": the null backend whose sampler is caught in a content loop (`LOOP_TOKEN` from position
  `LOOP_FROM` on) until a rollback bans the looping token there; then the model's own re-steered token.
- "cpu-row-blind": the CPU backend declaring it cannot apply QSA selection per verify row
  (verify_crosses_qsa_bound=False) and refusing a verify whose rows cross the inert bound, as a backend
  that attends densely per verify would have to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from atlas.backends.base import StepPlan, StepResult
from atlas.backends.null import ByteTokenizer, NullBackend
from atlas.config import Capacities, EngineConfig, derive_capacities

if TYPE_CHECKING:
    from atlas.engine.engine import Engine
    from atlas.engine.records import EventSink
    from atlas.replay.store import RunRecord

LOOP_TOKEN = 65  # "A": a period-1 loop, the shortest the watchdog can see
LOOP_FROM = 6  # sampled positions from here on loop


class LoopingNullBackend(NullBackend):
    name = "null-looping"

    def __init__(self) -> None:
        super().__init__()
        self.steered: set[int] = set()  # sequences a rollback re-steered out of the loop

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in (*plan.release, *plan.reset):
            self.steered.discard(seq_id)
        result = super().execute(plan)
        outcomes = []
        for work, o in zip(plan.work, result.outcomes, strict=True):
            if o.token is not None and work.end >= LOOP_FROM and work.seq_id not in self.steered:
                if LOOP_TOKEN in work.banned:  # the re-steer: the model's own (non-banned) token, loop left
                    self.steered.add(work.seq_id)
                else:
                    o = attrs.evolve(o, token=LOOP_TOKEN)
            outcomes.append(o)
        return StepResult(result.step, tuple(outcomes))


def _row_blind_cpu(loaded: Any, caps: Capacities) -> Any:
    from atlas.backends.cpu import CpuBackend

    # the model's own bound, from the capacities (never the engine's lane: a lane bug must not move it)
    bound = caps.qsa_budget + caps.qsa_ratio - 1 if caps.num_qsa_layers and caps.qsa_budget else None

    class RowBlindCpuBackend(CpuBackend):
        name = "cpu-row-blind"

        def execute(self, plan: StepPlan) -> StepResult:
            for w in plan.work:
                if w.drafts and bound is not None and w.start + 1 + len(w.drafts) > bound:
                    raise ValueError(f"sequence {w.seq_id}: verify rows reach visible prefix "
                                     f"{w.start + 1 + len(w.drafts)} past the QSA inert bound {bound}; this "
                                     "backend cannot apply QSA selection per verify row")
            return super().execute(plan)

    backend = RowBlindCpuBackend(loaded, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size,
                                 ring_slots=caps.ring_slots, verify_width=caps.verify_width,
                                 mtp_drafter=caps.drafter_rows > 0, verify_crosses_qsa_bound=False)
    return backend


SCENARIO_BACKENDS = ("null-looping", "cpu-row-blind")


def build_engine(model: str, backend: str, config: EngineConfig, *, trace: str | None = None,
                 sink: EventSink | None = None, **kwargs: Any) -> Engine:
    """The engine for (model, backend, config): the engine's own backends through Engine.from_model, a
    scenario backend here. `trace` records a new run; `sink` collects events in memory instead."""
    from atlas.engine.engine import Engine
    from atlas.engine.factory import TINY_MODEL, open_trace

    if backend not in SCENARIO_BACKENDS:
        return Engine.from_model(model, backend=backend, config=config, trace=trace, sink=sink,  # type: ignore[arg-type]
                                 **kwargs)
    if backend == "null-looping":
        caps = derive_capacities(config, None)
        data_plane, tokenizer, spec, fingerprint = LoopingNullBackend(), ByteTokenizer(), None, f"null:{model}"
    else:
        from atlas.model import load_model

        loaded = load_model(model)
        caps = derive_capacities(config, loaded.spec, activation_bytes=loaded.dtype.itemsize)
        data_plane, tokenizer, spec, fingerprint = _row_blind_cpu(loaded, caps), loaded.tokenizer, loaded.spec, \
            loaded.fingerprint
    if trace is not None:
        sink = open_trace(trace, model=model, fingerprint=fingerprint, backend=backend, config=config, caps=caps)
    engine = Engine(data_plane, tokenizer=tokenizer, config=config, capacities=caps, spec=spec,
                    model_name=model or TINY_MODEL, sink=sink, **kwargs)
    engine.model_fingerprint = fingerprint
    return engine


EngineBuilder = Callable[..., "Engine"]


def engine_for_run(run: RunRecord, sink: EventSink, **kwargs: Any) -> Engine:
    """A fresh engine like the one that recorded `run`, its events going to `sink`."""
    return build_engine(run.model, run.backend, EngineConfig.from_json(run.config), sink=sink, **kwargs)
