"""How many drafts a step verifies: the expected tokens of a verify over what it costs, a pure function.

    k* = argmax over k in 0..max_drafts of  E[tokens | k] / cost(batch, k),   cost(batch, 0) = 1, E[tokens | 0] = 1

`cost(batch, k)` is a speculative step's time over a plain decode step's at that batch (`VerifyCosts`: measured by
the backend at start and recorded in the trace's config, so a replay decides as the run did); E[tokens | k] =
1 + sum_{i<=k} prod_{j<=i} p_j from the conditional acceptance p_j the engine observed (smoothed towards a prior
so the first steps try drafting, plus one standard error so a position seen rarely is tried again). A k must beat a plain decode by `MARGIN` to be chosen: drafting never makes a
step slower by the model's own reckoning, and where speculation loses (a batch at which the verify costs more
than its tokens) the step verifies nothing, as vLLM and SGLang turn speculation off by batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

PRIOR = 0.7  # acceptance assumed per draft before any is observed (the oracle drafter)
PRIOR_WEIGHT = 4  # observations the prior counts as
MARGIN = 1.05  # tokens per unit time a k must beat a plain decode by


def _costs(value: object) -> tuple[tuple[int, tuple[float, ...]], ...]:
    return tuple((int(b), tuple(float(c) for c in row)) for b, row in value)  # type: ignore[attr-defined]


@attrs.frozen
class VerifyCosts:
    """rows[i] = (batch, (cost of 1 draft, 2 drafts, ...)): a speculative step's time over a plain decode step's,
    measured at `batch`; a batch between two rows takes the lower one's (the first row's below it)."""

    rows: tuple[tuple[int, tuple[float, ...]], ...] = attrs.field(converter=_costs)

    def cost(self, batch: int, drafts: int) -> float:
        if drafts == 0:
            return 1.0
        row = self.rows[0][1]
        for at, costs in self.rows:
            if at <= batch:
                row = costs
        return row[min(drafts, len(row)) - 1] if drafts <= len(row) else float("inf")

    @property
    def max_drafts(self) -> int:
        return min(len(costs) for _, costs in self.rows)


def smoothed_rates(reached: Sequence[int], accepted: Sequence[int], drafts: int) -> tuple[float, ...]:
    """p_j for j = 1..drafts, as the policy plans with them: accepted / reached at position j (given every earlier
    draft accepted), with the prior counted as PRIOR_WEIGHT observations, plus one standard error of that estimate.
    The optimism is for positions seen rarely: a sequence that verifies fewer drafts than it may never reaches the
    deeper ones again, so a few early rejections there would keep it from them for good; a position tried often
    is planned at what it measured."""
    out = []
    for j in range(drafts):
        r = reached[j] if j < len(reached) else 0
        a = accepted[j] if j < len(accepted) else 0
        p = (a + PRIOR * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
        out.append(min(1.0, p + math.sqrt(p * (1 - p) / (r + PRIOR_WEIGHT))))
    return tuple(out)


def expected_tokens(rates: Sequence[float], drafts: int) -> float:
    """Tokens a verify of `drafts` drafts emits on average: 1 + sum over i of the chance drafts 1..i all hold."""
    total, chain = 1.0, 1.0
    for p in rates[:drafts]:
        chain *= p
        total += chain
    return total


def worth_probing(batch: int, max_drafts: int, costs: VerifyCosts) -> bool:
    """Whether some k could pay at this batch if every draft held (k + 1 tokens over its cost beats MARGIN): where
    none can, a sequence at 0 drafts is not probed either (a probe would only make the step slower)."""
    return any((k + 1) / costs.cost(batch, k) > MARGIN for k in range(1, min(max_drafts, costs.max_drafts) + 1))


def choose_drafts(batch: int, max_drafts: int, rates: Sequence[float], costs: VerifyCosts) -> int:
    """The drafts this step verifies, 0..max_drafts (ties to the fewer drafts)."""
    best, best_gain = 0, MARGIN
    for k in range(1, min(max_drafts, costs.max_drafts, len(rates)) + 1):
        gain = expected_tokens(rates, k) / costs.cost(batch, k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best
