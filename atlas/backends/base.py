"""What a backend is: the Backend protocol, its declared Capabilities, and the StateStore contract.

A backend owns every tensor: weights, paged KV, QSA raw index keys, GDN conv/recurrent state, PLE n-gram
context and short-conv state, the MTP drafter's rows. It never decides; it executes one StepPlan
(atlas.plan) per step and reports its own cursors, which the engine checks against the state machines after
every step. What it can do is a frozen Capabilities record, checked against the configuration once, when
the engine is built (`Capabilities.check`): one clear error naming the knob, never a feature probe later.

Per-sequence data-plane state is behind the `StateStore` contract: snapshot at a boundary, restore, commit
the first rows of a verify, release, prefix-snapshot store/load and the drafter carry, each covering the KV
rows, QSA keys, GDN conv and recurrent state, PLE state and drafter rows together. The CPU reference
implements it over immutable per-chunk states, the CUDA backend over slot pools in device memory; the
conformance tests (tests/backends/test_state_store.py) run against any backend that declares it.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import attrs

from atlas.errors import CapabilityError, RestoreRefused
from atlas.plan import (
    BackendCursors,
    CarryOrder,
    PrefixRestore,
    PrefixStore,
    RingRestore,
    RingSnapshot,
    SeqWork,
    StepPlan,
    StepResult,
)

STATE_AUDIT_ENV = "ATLAS_STATE_AUDIT"


def state_audit_default() -> bool:
    """The state-digest audit mode (StateStore implementations) is off by default: it hashes state bytes at every
    snapshot, restore and commit. The test suite and replay turn it on (ATLAS_STATE_AUDIT=1, or state_audit=True)."""
    return os.environ.get(STATE_AUDIT_ENV) == "1"


@attrs.frozen
class Capabilities:
    """What a backend can do, declared once (frozen), read by the engine builder and the lanes."""

    verify: bool = False  # K-wide verify of drafts with the accepted prefix committed exactly
    per_row_qsa_verify: bool = False  # QSA selection per verify row: a verify across the inert bound is exact
    mtp_drafting: bool = False  # the backend's own MTP drafter proposes (SeqWork.propose)
    snapshot_ring: bool = False  # boundary snapshots and restores (content-loop rollback)
    prefix_snapshots: bool = False  # prefix-cache snapshots and the drafter carry
    batch_invariant: bool = False  # a request's tokens do not depend on the batch it runs in
    fp32_parity: bool = False  # fp32 numerics whose greedy tokens equal the CPU reference's
    max_verify_width: int = 1  # rows per verify the backend holds per-token intermediates for
    prompt_logprobs: bool = False  # logprobs of prompt tokens (SeqWork.prompt_logprobs)

    def check(self, config: Any, caps: Any, backend: str, *, custom_drafter: bool = False) -> None:
        """Refuse, before anything runs, a configuration this backend cannot serve (atlas.config types)."""
        def refuse(feature: str, knob: str) -> CapabilityError:
            return CapabilityError(f"backend {backend!r} does not support {feature}: set {knob}")

        if config.num_drafts:
            if not self.verify:
                raise refuse("speculative decoding", f"num_drafts 0 (got {config.num_drafts}; --num-drafts 0)")
            if caps.verify_width > self.max_verify_width:
                raise CapabilityError(f"num_drafts {config.num_drafts} needs verify width {caps.verify_width}; "
                                      f"backend {backend!r} holds {self.max_verify_width} rows per verify")
            if config.drafter == "mtp" and not custom_drafter and not self.mtp_drafting:
                raise refuse("the MTP drafter (the model has no mtp.* weights, or the backend runs none)",
                             "--drafter ngram, or num_drafts 0")
        if config.ring_slots and not self.snapshot_ring:
            raise refuse("the snapshot ring for rollback", f"ring_slots 0 (got {config.ring_slots}; --ring-slots 0)")
        if config.enable_prefix_caching and not self.prefix_snapshots:
            raise refuse("prefix caching", "enable_prefix_caching False (--no-prefix-caching)")


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan (atlas.plan's order). A refused order or commit is reported per sequence
        (SeqOutcome.refused / StepResult.refused); anything else that goes wrong raises, and the engine fails the
        plan's requests (DeviceFault(fatal=True): the engine dies).

        The plan is lent for this call (atlas.plan: who owns a plan): keep no reference to it or to any SeqWork in
        it once execute returns (the values in them may be kept: the steady CUDA step keeps the last rows' ids,
        block tables and params). The engine moves a decode's SeqWork objects to the next step in place. A
        backend, or a wrapper around one, that keeps plans says so with a class or instance attribute
        `retains_plans = True` (read by the engine every step, default False): its plans' work is then built
        afresh every step and never moved. tests/test_plan_ownership.py checks the repository's backends keep
        none."""
        ...

    def cursors(self, seq_id: int) -> BackendCursors: ...


@runtime_checkable
class StateStore(Protocol):
    """Per-sequence data-plane state. Every method checks its preconditions first and raises RestoreRefused
    (VerifyRefused for a commit) having changed nothing."""

    def reset(self, seq_id: int) -> None:
        """Back to empty (a sequence starting afresh, or preempted); its KV blocks are the caller's."""
        ...

    def release(self, seq_id: int) -> None:
        """Drop everything held for the sequence (finished); unknown sequences are ignored."""
        ...

    def snapshot(self, order: RingSnapshot) -> None:
        """Store the sequence's state, which must be exactly at `order.position`, into its ring slot."""
        ...

    def restore(self, order: RingRestore) -> BackendCursors:
        """Rewind every cursor and all state to the ring snapshot at `order.position`, dropping later ones."""
        ...

    def commit(self, seq_id: int, rows: int) -> BackendCursors:
        """Keep the first `rows` rows of the sequence's pending verify (1 <= rows <= K), dropping the rest."""
        ...

    def store_prefix(self, order: PrefixStore) -> None: ...

    def load_prefix(self, order: PrefixRestore) -> None: ...

    def carry(self, order: CarryOrder) -> None: ...

    def cursors(self, seq_id: int) -> BackendCursors: ...

    def state_digest(self, seq_id: int, *, drafter: bool = True) -> str:
        """A digest of every state byte the sequence's data-plane state holds up to its position (KV rows,
        QSA keys, GDN conv + recurrent, PLE, and the drafter rows unless `drafter` is False): equal digests mean
        equal states."""
        ...


@attrs.frozen
class OrdersDone:
    """What running a plan's orders left: sequences whose restore was refused (why), and the cursors of every
    sequence a rollback restore named, refused or not (StepResult.touched when it has no work in the plan)."""

    refused: dict[int, str]
    restored: dict[int, BackendCursors]


def run_orders(store: StateStore, plan: StepPlan) -> OrdersDone:
    """Steps 1-4 of a plan (atlas.plan): prefix stores, the carry, releases, resets, then the restores.
    A refused restore leaves its sequence as it was and is reported; the step goes on for the others."""
    for o in plan.prefix_stores:
        store.store_prefix(o)
    store.carry(plan.carry)
    for seq_id in plan.release:
        store.release(seq_id)
    for seq_id in plan.reset:
        store.reset(seq_id)
    refused: dict[int, str] = {}
    restored: dict[int, BackendCursors] = {}
    for r in plan.restores:
        try:
            restored[r.seq_id] = store.restore(r)
        except RestoreRefused as exc:
            refused[r.seq_id] = f"rollback restore refused: {exc}"
            restored[r.seq_id] = store.cursors(r.seq_id)  # what it left: a refusal must have moved nothing
    for p in plan.prefix_restores:
        try:
            store.load_prefix(p)
        except RestoreRefused as exc:
            refused[p.seq_id] = f"prefix restore refused: {exc}"
    return OrdersDone(refused, restored)


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
    tokens = chunk.tokens
    # min/max first (C speed: a batch-64 decode step checks 64 chunks); the list only to name the bad ids
    if len(tokens) == 1:  # a decode row: one comparison
        bad = [] if 0 <= tokens[0] < vocab_size else list(tokens)
    else:
        bad = [t for t in tokens if not 0 <= t < vocab_size] if min(tokens) < 0 or max(tokens) >= vocab_size else []
    if bad:
        raise ValueError(f"sequence {chunk.seq_id}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if chunk.start != 0 and chunk.start != held:
        raise ValueError(f"sequence {chunk.seq_id}: chunk starts at {chunk.start} but the backend holds {held} tokens")


def check_verify(work: SeqWork, verify_width: int, held: int, known: bool) -> None:
    """Refuse a verify a backend cannot run, before anything moves: anything but the last sampled token followed
    by its drafts, wider than the `verify_width` per-token intermediates the backend holds, or not at the `held`
    tokens of a sequence the backend knows. The backend then checks the K rows as a chunk (check_chunk)."""
    if len(work.tokens) != 1 or not work.sample:
        raise ValueError(f"sequence {work.seq_id}: a verify feeds exactly the last sampled token and its drafts")
    k = len(work.tokens) + len(work.drafts)
    if k > verify_width:
        raise ValueError(f"sequence {work.seq_id}: verify of width {k} exceeds the {verify_width} "
                         "per-token intermediates this backend holds (Capacities.verify_width)")
    if not known or held != work.start:
        raise ValueError(f"sequence {work.seq_id}: verify at {work.start} but the backend holds {held} tokens")


def check_dense_verify(work: SeqWork, inert_bound: int | None) -> None:
    """Refuse, before anything moves, a verify a backend that cannot apply QSA selection per verify row would run
    wrongly: one whose last row sees a visible prefix past the QSA `inert_bound` (every row of a verify attends
    densely there). The engine's speculative lane latches such a sequence off before it gets here
    (atlas.engine.drafters.lane); a verify arriving anyway is a lane bug, and fails loudly rather than silently."""
    if inert_bound is None or not work.drafts:
        return
    visible = work.start + len(work.tokens) + len(work.drafts)
    if visible > inert_bound:
        raise ValueError(f"sequence {work.seq_id}: verify rows reach visible prefix {visible} past the QSA inert "
                         f"bound {inert_bound}; this backend cannot apply QSA selection per verify row")
