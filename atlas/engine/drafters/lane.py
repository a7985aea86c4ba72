"""The speculative lane: the engine's side of speculative decoding, kept out of `Engine.step`'s way.

Per step: `propose` asks the drafter for drafts for every decoding sequence (latching the lane off first for
one whose verify could cross the QSA inert bound on a backend that cannot select per row); the scheduler cuts
them to the budget; the backend verifies; `settle` turns each verify's per-row verdicts into the accepted
count (validated), cuts it at a stop, and asks the backend to commit exactly that prefix. A refused commit
changes nothing and the request ends with `error`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import structlog

from atlas.backends.base import BackendCursors, SeqOutcome
from atlas.config import Capacities
from atlas.engine.drafters.base import Drafter, DraftRequest
from atlas.engine.scheduler import Schedule
from atlas.engine.speculative import AcceptanceStats, VerifyRefused, accepted_prefix, verdict_bits
from atlas.engine.stopping import StopChecker, Tokenizer
from atlas.state.control import ControlState
from atlas.state.events import Event, SpeculationLatchedOff, StepPlanned

log = structlog.get_logger("atlas.speculative")


@attrs.frozen
class Verified:
    """One verify's outcome. `tokens`: what it emits (kept drafts, then the target's token), cut after a
    stop; accepted = len(tokens) - 1 drafts, or -1 when the commit was refused (`error` says why)."""

    tokens: tuple[int, ...] = ()
    accepted: int = -1
    bits: int = 0
    logprobs: tuple[float | None, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    cursors: BackendCursors | None = None
    error: str | None = None


def inert_bound(caps: Capacities) -> int | None:
    """The last visible-prefix length at which QSA attention is still dense (budget + ratio - 1)."""
    return caps.qsa_budget + caps.qsa_ratio - 1 if caps.num_qsa_layers and caps.qsa_budget else None


class SpeculativeLane:
    def __init__(self, drafter: Drafter, backend: object, caps: Capacities, num_drafts: int,
                 vocab_size: int | None, skip: Callable[[object], bool] | None = None) -> None:
        if not callable(getattr(backend, "commit_verify", None)):
            raise ValueError(f"backend {getattr(backend, 'name', '?')!r} cannot verify drafts; set num_drafts=0")
        self.drafter = drafter
        self.backend = backend
        self.caps = caps
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.bound = None if getattr(backend, "verify_crosses_qsa_bound", False) else inert_bound(caps)
        self.skip = skip  # sequences that plain-decode this step (e.g. a snapshot boundary is due)
        self.stats = AcceptanceStats()
        self.latched_total = 0

    def propose(self, state: ControlState, emit: Callable[[Event], None]) -> dict[int, tuple[int, ...]]:
        """Drafts per decoding sequence for this step, in arrival order."""
        out: dict[int, tuple[int, ...]] = {}
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            c = seq.cursor
            if not c.decoding or seq.drafter.latched:
                continue
            if self.bound is not None and c.computed + 1 + self.num_drafts > self.bound:
                # sticky, and decided on the widest verify the lane can issue: no verify ever crosses
                log.info("speculation latched off", seq_id=seq_id, position=c.computed, inert_bound=self.bound,
                         verify_width=self.num_drafts + 1)
                emit(SpeculationLatchedOff(state.step, seq_id, c.computed, self.bound,
                                           "backend cannot apply QSA selection per verify row"))
                self.latched_total += 1
                continue
            k = min(self.num_drafts, seq.max_new - c.generated - 1)
            banned = getattr(seq, "banned", None)
            if k < 1 or (banned and max(banned) >= len(c.tokens)) or (self.skip is not None and self.skip(seq)):
                continue  # no room, or a rollback's ban ahead: the plain decode applies it
            drafts = self.drafter.propose(DraftRequest(seq_id, seq.request_id, c.tokens, c.prompt_len, seq.params, k))
            drafts = tuple(int(t) for t in drafts[:k])
            if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in drafts):
                log.warning("drafter proposed tokens outside the vocabulary; dropped", seq_id=seq_id, drafts=drafts)
                continue
            if drafts:
                out[seq_id] = drafts
        return out

    def settle(self, planned: StepPlanned, outcomes: list[SeqOutcome], stops: dict[int, StopChecker],
               tokenizer: Tokenizer | None) -> dict[int, Verified]:
        """Each verify of the step: accepted count from the verdicts, cut at a stop, committed."""
        settled: dict[int, Verified] = {}
        for drafts, o in zip(planned.drafts, outcomes, strict=True):
            if not drafts:
                continue
            try:
                n = accepted_prefix(o.verdicts, drafts, self.vocab_size)
            except VerifyRefused as exc:
                settled[o.seq_id] = self._refused(o.seq_id, str(exc))
                continue
            bits = verdict_bits(o.verdicts, len(drafts))
            self.stats.record(len(drafts), bits)
            rows = o.verdicts[: n + 1]
            emitted = [*drafts[:n], rows[n].token]
            kept = _until_stop(emitted, stops.get(o.seq_id), tokenizer)
            try:
                cursors = self.backend.commit_verify(o.seq_id, kept)  # type: ignore[attr-defined]
            except VerifyRefused as exc:
                settled[o.seq_id] = self._refused(o.seq_id, str(exc))
                continue
            settled[o.seq_id] = Verified(
                tuple(emitted[:kept]), kept - 1, bits, tuple(r.logprob for r in rows[:kept]),
                tuple(r.top_logprobs for r in rows[:kept]), cursors)
        return settled

    def committed(self, outcomes: list[SeqOutcome], verified: dict[int, Verified]) -> list[SeqOutcome]:
        """The outcomes with each verify's cursors as they are after its commit (or its refusal)."""
        def cursors(o: SeqOutcome) -> BackendCursors:
            return verified[o.seq_id].cursors or self.backend.cursors(o.seq_id)  # type: ignore[attr-defined]

        return [attrs.evolve(o, cursors=cursors(o)) if o.seq_id in verified else o for o in outcomes]

    def _refused(self, seq_id: int, why: str) -> Verified:
        log.error("verify commit refused", seq_id=seq_id, error=why)
        return Verified(error=f"verify commit refused: {why}")


def planned_drafts(drafts: dict[int, tuple[int, ...]], decided: Schedule) -> tuple[tuple[int, ...], ...]:
    """The drafts each planned sequence verifies, as the scheduler cut them (aligned with decided.seqs)."""
    if not decided.drafts:
        return ()
    return tuple(drafts[seq_id][:k] if k else () for seq_id, k in zip(decided.seqs, decided.drafts, strict=True))


def _until_stop(tokens: list[int], stop: StopChecker | None, tokenizer: Tokenizer | None) -> int:
    """How many of `tokens` the request takes: up to and including the one that ends it. A dry run on a
    copy: the engine's checker sees the kept tokens afterwards, exactly as it would one decode at a time."""
    if stop is None:
        return len(tokens)
    probe = attrs.evolve(stop, unread=list(stop.unread))  # shallow: never copies the tokenizer it refers to
    for i, t in enumerate(tokens):
        ended = probe.on_token(t, tokenizer)
        if ended is not None:
            return i + 1
    return len(tokens)
