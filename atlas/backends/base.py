"""The boundary between deciding and computing: StepPlan in, StepResult out.

Both are plain values (no tensors), so the control plane can log, diff and replay them. A backend owns
every tensor: weights, paged KV, QSA raw index keys, GDN conv/recurrent state, PLE n-gram context and
short-conv state. It never decides; it executes the plan and reports its own cursors, which the engine
checks against the state machines after every step.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from atlas.engine.sampling import SamplingParams


@attrs.frozen
class SeqWork:
    """One sequence's share of a step: feed `tokens` at positions [start, start + len(tokens))."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    # KV block ids in order; block i holds positions [i * block_size, (i + 1) * block_size). It covers at
    # least start + len(tokens) positions.
    block_table: tuple[int, ...]
    # sample one token from the logits of the last fed position (last prefill chunk, or decode)
    sample: bool
    sampling: SamplingParams = SamplingParams()

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@attrs.frozen
class StepPlan:
    step: int
    work: tuple[SeqWork, ...]
    # sequences whose data-plane state is dropped before the work runs (finished, cancelled)
    release: tuple[int, ...] = ()
    # sequences whose data-plane state is reset to empty before the work runs (preempted, requeued)
    reset: tuple[int, ...] = ()


@attrs.frozen
class BackendCursors:
    """What the data plane says it holds for one sequence. Each must equal the control plane's view."""

    kv_tokens: int  # positions written to KV (attention layers)
    qsa_ingested: int  # raw index keys ingested (QSA layers; equals kv_tokens when the model has none)
    ssm_position: int  # tokens folded into GDN conv + recurrent state
    ple_position: int  # tokens folded into the PLE n-gram context and short-conv state
    drafter_rows: int = 0  # MTP drafter pair keys held


@attrs.frozen
class SeqOutcome:
    seq_id: int
    cursors: BackendCursors
    token: int | None = None  # sampled token when SeqWork.sample
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class StepResult:
    step: int
    outcomes: tuple[SeqOutcome, ...]


class DeviceFault(RuntimeError):
    """A fault raised by the data plane. `fatal` faults (sticky CUDA errors) mean the context is dead."""

    def __init__(self, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class Backend(Protocol):
    name: str

    def execute(self, plan: StepPlan) -> StepResult: ...

    def cursors(self, seq_id: int) -> BackendCursors: ...
