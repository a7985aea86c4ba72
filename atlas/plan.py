"""The boundary between deciding and computing: one `StepPlan` down, one `StepResult` up.

Both are plain values (no tensors), so the control plane can log, diff and replay them, and they live below
both sides: the engine builds plans, the state machines queue their orders, the backends execute them.

Who owns a plan: the engine, which lends it to the data plane for its own step. A StepPlan and its SeqWork are
valid from `plan_step` until the step's outcome is folded; after that the engine may move a decode step's SeqWork
objects to the next step's tokens, positions and block tables in place (BatchColumns.decode_work: a SeqWork costs
~3.5 K instructions to build against ~0.3 K to move, ~42 against ~10 us at 64 rows). So a backend, and anything
wrapped around one, keeps no StepPlan or SeqWork past `execute` (the values in them may be kept: tuples, ints and
SamplingParams are immutable, and a move replaces a field, never changes the value it held). One that must keep
them declares it: a true `retains_plans` attribute on the object the engine calls (atlas.backends.base.Backend);
the engine then builds every plan's work afresh and moves none (tests/test_plan_ownership.py). Events carry no plan
objects (StepPlanned holds the ids and counts as ints), so a sink that keeps events keeps nothing the engine moves.

A backend runs one plan in this order (atlas.backends.orders.run_orders and each backend's execute):
  1. prefix stores (the state of sequences exactly where it is, before anything moves);
  2. the drafter carry (drop, then store);
  3. releases, then resets;
  4. restores: rollback rewinds to a ring slot, prefix-cache hits from a prefix snapshot;
  5. the work: prefill chunks, decodes and verifies; a verify's accepted prefix is committed in the same
     call (the backend applies the shared verdict functions, the engine checks the count it reports);
  6. ring snapshots at the end of the work that lands on a boundary;
  7. drafts for the next step (MTP) after each sampled token that asked for them.
"""

from __future__ import annotations

import operator

import attrs
from atlas_kernels.rows import RowOffset

from atlas.sampling.params import SamplingParams

__all__ = ["RowOffset"]  # SeqWork.start's type (atlas_kernels.rows): a row offset, not a count


@attrs.frozen
class RowVerdict:
    """The target's verdict on one verify row. `token` is what the row emits if the chain reaches it: the
    draft when accepted, else the correction (or, on the last row, the bonus token)."""

    accept: bool
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


# SeqWork, BackendCursors and SeqOutcome are built once per sequence per step: plain slotted classes rather than
# frozen ones (a frozen attrs __init__ sets each field through object.__setattr__: 2.9 us for a SeqWork against
# 0.44 us, 185 us of a batch-64 step). Still values: hashable and compared by field; the one mutation is
# BatchColumns.decode_work moving the engine's own decode rows to the next step once their step is over, unless the
# backend declares `retains_plans` (the module's note: who owns a plan).
_VALUE = attrs.define(slots=True, unsafe_hash=True)


@_VALUE
class SeqWork:
    """One sequence's share of a step: feed `tokens` at positions [start, start + len(tokens))."""

    seq_id: int
    tokens: tuple[int, ...]
    # where the rows start: a RowOffset for every chunk the planner builds (a decode of the batch columns' fast
    # path, one row, may carry a plain int); the backends check it where it becomes an address
    start: RowOffset | int
    # KV block ids in order; block i holds positions [i * block_size, (i + 1) * block_size). It covers at
    # least start + len(tokens) + len(drafts) positions.
    block_table: tuple[int, ...]
    # sample one token from the logits of the last fed position (last prefill chunk, or decode)
    sample: bool
    sampling: SamplingParams = SamplingParams()
    # tokens the sampler may not pick at the sampled position (a content-loop rollback's re-steer)
    banned: tuple[int, ...] = ()
    # a verify when non-empty: the drafts are fed after `tokens` (exactly one, the last sampled token) at
    # [end, end + len(drafts)), verdicts come back per row, and the accepted prefix is committed
    drafts: tuple[int, ...] = ()
    # the MTP drafter's lowest pair key (0: it sees the prompt; prompt_len - 1 with its context off)
    drafter_first_key: int = 0
    # drafts the backend's own drafter (MTP) proposes after this step's sampled token, for the next step
    propose: int = 0
    # prompt logprobs: None off; n >= 0: the logprob of every fed prompt token under the logits of the position
    # before it (the previous chunk's last row for a chunk's first token), with the n best alternatives
    prompt_logprobs: int | None = None
    # every token before the sampled position (the prompt's first `prompt_len`, then the output so far): given only
    # when the request's sampling reads it (SamplingParams.reads_history: a repetition, frequency or presence
    # penalty), for the sampler's inputs (atlas.sampling.adjust.Adjust)
    history: tuple[int, ...] = ()
    prompt_len: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@attrs.frozen
class RingSnapshot:
    """After the work: store the sequence's state (its work ends at `position`) into its ring `slot`."""

    seq_id: int
    position: int
    slot: int
    evicted: int = -1  # the position the slot held before, -1 if it was free


@attrs.frozen
class RingRestore:
    """Before the work: rewind every cursor of the sequence to the snapshot at `position` in ring `slot`,
    dropping the snapshots past it (a content-loop rollback). `held`: the cursors the data plane holds before
    it (BackendCursors.as_tuple()); a refused restore must leave them so."""

    seq_id: int
    slot: int
    position: int
    held: tuple[int, ...] = ()


@attrs.frozen
class PrefixStore:
    """Before anything moves: store the sequence's state at `position` (its current one) as prefix snapshot
    `key`, evicting prefix snapshot `evicted` (-1: none)."""

    seq_id: int
    position: int
    key: int
    evicted: int


@attrs.frozen
class PrefixRestore:
    """After the releases: start the sequence at `position` from prefix snapshot `key`; `block_table` holds
    the shared full blocks (and the tail block the snapshot's partial KV rows go into). The drafter holds
    keys first_key .. last_key: adopted from the carry when `adopt`, else none (first_key - 1 == last_key)."""

    seq_id: int
    key: int
    position: int
    block_table: tuple[int, ...]
    drafter_first_key: int
    drafter_last_key: int
    adopt: bool


@attrs.frozen
class CarryOrder:
    """The drafter carry: drop the carried entry, and/or keep released sequence `store`'s rows as it."""

    drop: bool = False
    store: int = -1


@attrs.frozen
class StepPlan:
    step: int
    work: tuple[SeqWork, ...]
    # sequences whose data-plane state is dropped before the work runs (finished, cancelled)
    release: tuple[int, ...] = ()
    # sequences whose data-plane state is reset to empty before the work runs (preempted, requeued)
    reset: tuple[int, ...] = ()
    snapshots: tuple[RingSnapshot, ...] = ()
    restores: tuple[RingRestore, ...] = ()
    prefix_stores: tuple[PrefixStore, ...] = ()
    prefix_restores: tuple[PrefixRestore, ...] = ()
    carry: CarryOrder = CarryOrder()

    @property
    def idle(self) -> bool:
        return not (self.work or self.release or self.reset or self.restores or self.prefix_stores
                    or self.prefix_restores or self.carry.drop or self.carry.store >= 0)


_AT, _KIND = operator.itemgetter(2), operator.itemgetter(0)
_CLASS = {"qsa": 1, "drafter": 2}  # a stamp's comparison class (BackendCursors.uniform); every other kind: 0
_APART = frozenset(_CLASS)

# BackendCursors.uniform(): the single position of (the computed count's kinds, "qsa", "drafter"), None if absent
UniformStamps = tuple[int | None, int | None, int | None]


@_VALUE
class BackendCursors:
    """What the data plane says it holds for one sequence. Each must equal the control plane's view.

    `stamps` is the measurement: one (kind, layer, position) per per-layer state of the sequence, each read from
    the data plane's own position record written by the same operation that writes the data, never a host counter:
    "kv" and "qsa" per attention / QSA layer (how many consecutive positions from 0 the paged KV / raw index keys
    hold), "conv" and "gdn" per GDN layer, "ple" (layer -1: the n-gram context) and "ple_conv" per PLE layer,
    "drafter" (layer -1: MTP pair keys held). The summary fields are the minimum over each kind."""

    kv_tokens: int  # positions written to KV (attention layers)
    qsa_ingested: int  # raw index keys ingested (QSA layers; equals kv_tokens when the model has none)
    ssm_position: int  # tokens folded into GDN conv + recurrent state
    ple_position: int  # tokens folded into the PLE n-gram context and short-conv state
    drafter_rows: int = 0  # MTP drafter pair keys held
    stamps: tuple[tuple[str, int, int], ...] = ()
    # `uniform()`'s memo: (the very stamps tuple it was computed from, its value). Never a constructor argument,
    # never compared, hashed or shown: a value derived from `stamps`, not a claim about them
    _uniform: tuple[object, UniformStamps | None] | None = attrs.field(default=None, init=False, eq=False, hash=False,
                                                                        repr=False)

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.kv_tokens, self.qsa_ingested, self.ssm_position, self.ple_position, self.drafter_rows)

    def summary(self) -> dict[str, int]:
        """The summary fields by name (what a cursor violation reports of the backend's side)."""
        return {"kv_tokens": self.kv_tokens, "qsa_ingested": self.qsa_ingested, "ssm_position": self.ssm_position,
                "ple_position": self.ple_position, "drafter_rows": self.drafter_rows}

    def uniform(self, compute: bool = True) -> UniformStamps | None:
        """The one position every stamp of each comparison class holds: (every kind but "qsa" and "drafter", which
        the control plane's computed count must equal; "qsa", its ingested keys; "drafter", its rows), None for a
        class without stamps; or None when two stamps of one class differ (the check then walks them one by one).

        Computed from `stamps` and memoised against that very tuple (identity): a BackendCursors whose stamps are
        replaced computes it anew, and nothing can set it. A builder that shares one BackendCursors among many
        sequences and steps (the CUDA stamp reader: every healthy sequence at one position) computes it once, so
        the engine's check of a healthy sequence is three comparisons instead of a walk over its ~51 stamps.
        `compute=False` (the check): only what is already computed for these very stamps, else None (computing it
        costs about the walk it would save: 4-5 us over 51 stamps, so a BackendCursors built for one check, as the
        CPU store's are, is walked as before)."""
        memo = self._uniform
        stamps = self.stamps
        if memo is not None and memo[0] is stamps:
            return memo[1]
        if not compute:
            return None
        positions = set(map(_AT, stamps))  # C-level passes: ~2 us each over 51 stamps, a walk's cost
        value: UniformStamps | None = None
        if len(positions) == 1:  # every stamp at one position (a healthy sequence without drafter rows)
            kinds = set(map(_KIND, stamps))
            p = next(iter(positions))
            value = (p if kinds - _APART else None, p if "qsa" in kinds else None, p if "drafter" in kinds else None)
        elif positions:
            classes: tuple[set[int], set[int], set[int]] = (set(), set(), set())
            for kind, _, at in stamps:
                classes[_CLASS.get(kind, 0)].add(at)
            if all(len(c) <= 1 for c in classes):
                value = tuple(next(iter(c)) if c else None for c in classes)  # type: ignore[assignment]
        else:
            value = (None, None, None)
        self._uniform = (stamps, value)
        return value


STAMP_KINDS = ("kv", "qsa", "conv", "gdn", "ple", "ple_conv", "drafter")  # BackendCursors.stamps' kinds


# (position, logprob or None at position 0, top alternatives)
PromptLogprob = tuple[int, float | None, tuple[tuple[int, float], ...]]


@_VALUE
class SeqOutcome:
    seq_id: int
    cursors: BackendCursors
    token: int | None = None  # sampled token when SeqWork.sample (a verify: the token after the kept drafts)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    verdicts: tuple[RowVerdict, ...] = ()  # a verify's per-row verdicts (K = drafts + 1), else empty
    # a verify: drafts the backend committed (0..K-1); -1 when the backend refused the sequence's commit or one
    # of its orders (`refused` says why): nothing moved for it, and the request ends with `error`
    accepted: int = 0
    refused: str | None = None
    drafts: tuple[int, ...] = ()  # proposed for the next step (SeqWork.propose)
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # one per fed token (SeqWork.prompt_logprobs)


@attrs.frozen
class StepResult:
    step: int
    outcomes: tuple[SeqOutcome, ...]
    # cursors of the sequences the plan's orders moved that have no work in it (a restore without a re-feed)
    touched: tuple[tuple[int, BackendCursors], ...] = ()
    # sequences without work in the plan whose order the backend refused (nothing moved for them), and why
    refused: tuple[tuple[int, str], ...] = ()
