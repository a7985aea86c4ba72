"""The speculative lane: the engine's side of speculative decoding.

Per step, at schedule time: `latches` decides which sequences' lanes latch off (a verify that could cross the
QSA inert bound on a backend that cannot select per row), and `drafts` gives each decoding sequence its drafts:
the n-gram and scripted drafters are pure functions of the tokens; the MTP drafter's drafts were proposed by
the backend in the previous step's execute (SeqWork.propose -> SeqOutcome.drafts) and are cached here by the
position they continue. The backend verifies and commits the accepted prefix in the same execute; the engine
checks the count against the verdicts (atlas.engine.outcome) and records acceptance statistics (`observe`).

How many drafts a sequence verifies this step (0..num_drafts) is `choose_drafts`'s (atlas.engine.drafters.policy)
when the engine has a cost model: from the step's decoding batch, the acceptance observed on that sequence's own
verifies and the recorded costs, never the clock, so a replay recomputes every choice (and where the costs do
not vary with the batch, as on the CPU backend, a sequence's drafts do not depend on what runs beside it: sampled
speculation stays batch-invariant). The drafts are cut to it, the MTP drafter proposes that many for the next
step, and `choices` counts the sequences' steps by their choice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import structlog

from atlas.config import Capacities
from atlas.engine.drafters.base import Drafter, DraftRequest
from atlas.engine.drafters.policy import VerifyCosts, choose_drafts, smoothed_rates, worth_probing
from atlas.plan import StepPlan, StepResult
from atlas.sampling.acceptance import AcceptanceStats, verdict_bits
from atlas.state.control import ControlState
from atlas.state.events import Event, SpeculationLatchedOff
from atlas.state.machines import Sequence

log = structlog.get_logger("atlas.speculative")
PROBE = 8  # tokens between the one-draft verifies of a sequence the policy has at 0 drafts


def inert_bound(caps: Capacities) -> int | None:
    """The last visible-prefix length at which QSA attention is still dense (budget + ratio - 1)."""
    return caps.qsa_budget + caps.qsa_ratio - 1 if caps.num_qsa_layers and caps.qsa_budget else None


class SpeculativeLane:
    def __init__(self, drafter: Drafter | None, caps: Capacities, num_drafts: int, vocab_size: int | None, *,
                 per_row_qsa: bool, skip: Callable[[Sequence], bool] | None = None,
                 costs: VerifyCosts | None = None) -> None:
        """`drafter` None: the backend's own MTP drafter proposes (SeqWork.propose). `costs` None: every step
        verifies num_drafts."""
        self.drafter = drafter
        self.caps = caps
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.bound = None if per_row_qsa else inert_bound(caps)
        self.skip = skip  # sequences that plain-decode this step (e.g. a snapshot boundary is due)
        self.stats = AcceptanceStats()
        self.latched_total = 0
        self._proposed: dict[int, tuple[int, tuple[int, ...]]] = {}  # MTP: seq_id -> (position, drafts)
        self.costs = costs
        self.choice = num_drafts  # the last step's largest draft count
        self.choices: Counter[int] = Counter()  # decoding sequences' steps, by their draft count
        self._chosen: dict[int, int] = {}  # this step's draft count per decoding sequence
        self._probing = True  # this step's batch could pay for a draft (policy.worth_probing)
        self._seen: dict[int, AcceptanceStats] = {}  # each sequence's own verifies (the policy's acceptance)

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

    def decide(self, state: ControlState) -> dict[int, int]:
        """This step's draft count per decoding sequence: the policy's, or num_drafts without a cost model."""
        decoding = [seq_id for seq_id in state.running if state.seqs[seq_id].cursor.decoding]
        if self.costs is None:
            return dict.fromkeys(decoding, self.num_drafts)
        out = {}
        # a sequence at 0 drafts still verifies one every PROBE tokens, so its acceptance keeps being observed,
        # where drafting could pay at this batch at all
        self._probing = worth_probing(len(decoding), self.num_drafts, self.costs)
        if not self._probing:  # no k pays at this batch even if every draft held: 0 whatever a sequence observed
            return dict.fromkeys(decoding, 0)
        for seq_id in decoding:
            seen = self._seen.get(seq_id)
            rates = smoothed_rates(seen.reached if seen else (), seen.conditional if seen else (), self.num_drafts)
            k = choose_drafts(len(decoding), self.num_drafts, rates, self.costs)
            out[seq_id] = self._probed(k, state.seqs[seq_id].cursor.generated)
        return out

    def _probed(self, k: int, generated: int) -> int:
        """k, or 1 where a sequence at 0 drafts is due its probe at `generated` tokens (where drafts can pay)."""
        return 1 if self._probing and k == 0 and generated % PROBE == 0 else k

    def drafts(self, state: ControlState) -> dict[int, tuple[int, ...]]:
        """Drafts per decoding sequence for this step, in arrival order (the scheduler cuts them to budget)."""
        out: dict[int, tuple[int, ...]] = {}
        self._chosen = self.decide(state)
        if self._chosen:
            self.choice = max(self._chosen.values())
            self.choices.update(self._chosen.values())
            if not self.choice:  # every decoding sequence at 0 drafts (the rest are not decoding): none drafts
                return out
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            c = seq.cursor
            if not c.decoding or seq.drafter.latched:
                continue
            k = min(self._chosen.get(seq_id, self.num_drafts), seq.max_new - c.generated - 1)
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

    def plain(self, planned_drafts: tuple[tuple[int, ...], ...]) -> bool:
        """Whether this step's work is a plain decode's, as with speculation off: no sequence verifies drafts and none
        asks the backend's drafter to propose (an engine-side drafter proposes on its own; the backend's only for a
        sequence chosen drafts or due a probe). Decided after `drafts` this step."""
        if any(planned_drafts):
            return False
        return self.drafter is not None or (self.costs is not None and not self._probing
                                            and not any(self._chosen.values()))

    def proposes(self, seq: Sequence) -> int:
        """How many drafts the backend's drafter proposes after this step's sampled token (0: none)."""
        if self.drafter is not None or seq.drafter.latched or seq.params.adjusted:
            return 0
        k = self._chosen.get(seq.seq_id, self.num_drafts)
        return self._probed(k, seq.cursor.generated + 1)  # the next step's probe

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """After a step: acceptance statistics of its verifies, and the MTP drafts for the next step."""
        for seq_id in (*plan.release, *plan.reset):
            self._proposed.pop(seq_id, None)
            self._seen.pop(seq_id, None)
        for work, o in zip(plan.work, result.outcomes, strict=True):
            if work.drafts and o.accepted >= 0 and len(o.verdicts) == len(work.drafts) + 1:
                bits = verdict_bits(o.verdicts, len(work.drafts))
                self.stats.record(len(work.drafts), bits)
                if self.costs is not None:
                    self._seen.setdefault(o.seq_id, AcceptanceStats()).record(len(work.drafts), bits)
            if self.drafter is None:
                if o.drafts:
                    end = work.end + (o.accepted if work.drafts else 0)  # where the next verify starts
                    self._proposed[o.seq_id] = (end, tuple(o.drafts))
                else:
                    self._proposed.pop(o.seq_id, None)
