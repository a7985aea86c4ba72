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
from atlas.engine.speculative import RowVerdict


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
    # tokens the sampler may not pick at the sampled position (a content-loop rollback's re-steer)
    banned: tuple[int, ...] = ()
    # a verify when non-empty: the drafts are fed after `tokens` (exactly one, the last sampled token) at
    # [end, end + len(drafts)), verdicts come back per row, and nothing is committed until commit_verify
    drafts: tuple[int, ...] = ()
    # the MTP drafter's lowest pair key (0: it sees the prompt; prompt_len - 1 with its context off)
    drafter_first_key: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class ChunkLike(Protocol):
    """What a backend's forward takes: a SeqWork, or a bare chunk in tests and LLM.logits."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]


def check_chunk(chunk: ChunkLike, vocab_size: int, held: int) -> None:
    """Refuse a chunk a backend cannot run, before anything moves: empty, a token outside the vocabulary, or a
    start other than 0 (a fresh sequence) or the `held` tokens the backend has for the sequence."""
    if not chunk.tokens:
        raise ValueError(f"sequence {chunk.seq_id}: empty chunk at position {chunk.start}")
    bad = [t for t in chunk.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"sequence {chunk.seq_id}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if chunk.start != 0 and chunk.start != held:
        raise ValueError(f"sequence {chunk.seq_id}: chunk starts at {chunk.start} but the backend holds {held} tokens")


@attrs.frozen
class StepPlan:
    step: int
    work: tuple[SeqWork, ...]
    # sequences whose data-plane state is dropped before the work runs (finished, cancelled)
    release: tuple[int, ...] = ()
    # sequences whose data-plane state is reset to empty before the work runs (preempted, requeued)
    reset: tuple[int, ...] = ()
    # (seq_id, position, slot): after the work, store the sequence's state (its work ends at `position`) into
    # its ring slot, for a later rollback (Backend.restore_boundary)
    snapshots: tuple[tuple[int, int, int], ...] = ()
    # prefix caching (atlas.state.prefix.PrefixOrders), in this order, before the releases and the work:
    # (seq_id, position, key, evicted): store the sequence's state at `position` as prefix snapshot `key`
    prefix_stores: tuple[tuple[int, int, int, int], ...] = ()
    carry_drop: bool = False  # drop the carried drafter entry
    carry_store: int = -1  # keep this released sequence's drafter rows as the carried entry
    # (seq_id, key, position, block table, drafter first key, drafter last key, adopt): after the releases,
    # start the sequence at `position` from prefix snapshot `key` (the drafter from the carry when adopt)
    prefix_restores: tuple[tuple[int, int, int, tuple[int, ...], int, int, bool], ...] = ()


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
    verdicts: tuple[RowVerdict, ...] = ()  # a verify's per-row verdicts (K = drafts + 1), else empty
    # SeqWork.sampling.prompt_logprobs set: (position, logprob, top) for every fed prompt position (logprob None
    # at position 0), from the same forward that fed it
    prompt_logprobs: tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...] = ()


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


class RollbackBackend(Backend, Protocol):
    """A backend with a snapshot ring (StepPlan.snapshots fill it)."""

    def restore_boundary(self, seq_id: int, slot: int, position: int) -> BackendCursors:
        """Rewind every cursor and all recurrent state of the sequence to the snapshot at `position` held in
        `slot`, dropping the snapshots past it; pre-validates and raises ValueError having changed nothing."""
        ...


class SpeculativeBackend(Backend, Protocol):
    """A backend that can verify drafts. `verify_crosses_qsa_bound`: verify applies QSA selection per row,
    so a verify across the inert bound is exact (False makes the engine latch the lane off before one could
    cross)."""

    verify_crosses_qsa_bound: bool

    def commit_verify(self, seq_id: int, rows: int) -> BackendCursors:
        """Keep the first `rows` rows of the sequence's pending verify (1 <= rows <= K), dropping the rest
        from every cursor; pre-validates every layer and raises VerifyRefused having changed nothing."""
        ...

    def propose_drafts(self, seq_id: int, next_token: int, k: int, params: SamplingParams) -> tuple[int, ...]:
        """Drafts from the backend's own drafter (MTP) for the token after `next_token`."""
        ...
