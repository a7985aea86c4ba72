"""The speculative lane: the engine's side of speculative decoding.

Per step, at schedule time: `latches` decides which sequences' lanes latch off (a verify that could cross the
QSA inert bound on a backend that cannot select per row), and `drafts` gives each decoding sequence its drafts:
the n-gram and scripted drafters are pure functions of the tokens; the MTP drafter's drafts were proposed by
the backend in the previous step's execute (SeqWork.propose -> SeqOutcome.drafts) and are cached here by the
position they continue. The backend verifies and commits the accepted prefix in the same execute; the engine
checks the count against the verdicts (atlas.engine.outcome) and records acceptance statistics (`observe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import structlog

from atlas.config import Capacities
from atlas.engine.drafters.base import Drafter, DraftRequest
from atlas.plan import StepPlan, StepResult
from atlas.sampling.acceptance import AcceptanceStats, verdict_bits
from atlas.state.control import ControlState
from atlas.state.events import Event, SpeculationLatchedOff
from atlas.state.machines import Sequence

log = structlog.get_logger("atlas.speculative")


def inert_bound(caps: Capacities) -> int | None:
    """The last visible-prefix length at which QSA attention is still dense (budget + ratio - 1)."""
    return caps.qsa_budget + caps.qsa_ratio - 1 if caps.num_qsa_layers and caps.qsa_budget else None


class SpeculativeLane:
    def __init__(self, drafter: Drafter | None, caps: Capacities, num_drafts: int, vocab_size: int | None, *,
                 per_row_qsa: bool, skip: Callable[[Sequence], bool] | None = None) -> None:
        """`drafter` None: the backend's own MTP drafter proposes (SeqWork.propose)."""
        self.drafter = drafter
        self.caps = caps
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.bound = None if per_row_qsa else inert_bound(caps)
        self.skip = skip  # sequences that plain-decode this step (e.g. a snapshot boundary is due)
        self.stats = AcceptanceStats()
        self.latched_total = 0
        self._proposed: dict[int, tuple[int, tuple[int, ...]]] = {}  # MTP: seq_id -> (position, drafts)

    @property
    def backend_drafts(self) -> bool:
        return self.drafter is None

    def latches(self, state: ControlState) -> Iterator[Event]:
        """Latch the lane off, before a verify could cross the bound (sticky; decided on the widest verify)."""
        if self.bound is None:
            return
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            c = seq.cursor
            if c.decoding and not seq.drafter.latched and c.computed + 1 + self.num_drafts > self.bound:
                log.info("speculation latched off", seq_id=seq_id, position=c.computed, inert_bound=self.bound,
                         verify_width=self.num_drafts + 1)
                self.latched_total += 1
                yield SpeculationLatchedOff(state.step, seq_id, c.computed, self.bound,
                                            "backend cannot apply QSA selection per verify row")

    def drafts(self, state: ControlState) -> dict[int, tuple[int, ...]]:
        """Drafts per decoding sequence for this step, in arrival order (the scheduler cuts them to budget)."""
        out: dict[int, tuple[int, ...]] = {}
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            c = seq.cursor
            if not c.decoding or seq.drafter.latched:
                continue
            k = min(self.num_drafts, seq.max_new - c.generated - 1)
            if k < 1 or (seq.banned and max(seq.banned) >= len(c.tokens)) or seq.params.adjusted or (
                    self.skip is not None and self.skip(seq)):
                # no room, a rollback's ban ahead, or a logit_bias or penalty (a verify row's inputs would depend
                # on the drafts before it): the plain decode applies it
                continue
            if self.drafter is None:
                position, drafts = self._proposed.get(seq_id, (-1, ()))
                if position != c.computed:
                    continue
            else:
                drafts = self.drafter.propose(DraftRequest(seq_id, seq.request_id, c.tokens, c.prompt_len,
                                                           seq.params, k))
            drafts = tuple(int(t) for t in drafts[:k])
            if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in drafts):
                log.warning("drafter proposed tokens outside the vocabulary; dropped", seq_id=seq_id, drafts=drafts)
                continue
            if drafts:
                out[seq_id] = drafts
        return out

    def proposes(self, seq: Sequence) -> int:
        """How many drafts the backend's drafter proposes after this step's sampled token (0: none)."""
        if self.drafter is not None or seq.drafter.latched or seq.params.adjusted:
            return 0
        return self.num_drafts

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """After a step: acceptance statistics of its verifies, and the MTP drafts for the next step."""
        for seq_id in (*plan.release, *plan.reset):
            self._proposed.pop(seq_id, None)
        for work, o in zip(plan.work, result.outcomes, strict=True):
            if work.drafts and o.accepted >= 0 and len(o.verdicts) == len(work.drafts) + 1:
                self.stats.record(len(work.drafts), verdict_bits(o.verdicts, len(work.drafts)))
            if self.drafter is None:
                if o.drafts:
                    end = work.end + (o.accepted if work.drafts else 0)  # where the next verify starts
                    self._proposed[o.seq_id] = (end, tuple(o.drafts))
                else:
                    self._proposed.pop(o.seq_id, None)
