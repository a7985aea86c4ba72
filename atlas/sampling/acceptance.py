"""Speculative decoding's bookkeeping, torch-free: a row's verdict, the accepted prefix (validated), verdict bits
and acceptance statistics per draft position. The verdicts themselves are computed by atlas.sampling.verdicts.

The backend turns its verdicts into the accepted count (`accepted_prefix`) and commits exactly that prefix in the
same execute; the engine checks the count it reports against the same function.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from atlas.errors import VerifyRefused
from atlas.plan import RowVerdict


def accepted_prefix(verdicts: Sequence[RowVerdict], drafts: Sequence[int], vocab_size: int | None) -> int:
    """The number n of drafts accepted (0 <= n <= K - 1): the chain of leading accepts. Refuses verdicts
    that cannot be committed exactly, so a malformed result never becomes a clean-looking token."""
    k = len(drafts) + 1
    if len(verdicts) != k:
        raise VerifyRefused(f"a verify of width {k} needs {k} verdicts, got {len(verdicts)}")
    n = 0
    while n < k - 1 and verdicts[n].accept:
        if verdicts[n].token != drafts[n]:
            raise VerifyRefused(f"row {n} accepts draft {drafts[n]} but emits {verdicts[n].token}")
        n += 1
    token = verdicts[n].token
    if vocab_size is not None and not 0 <= token < vocab_size:
        raise VerifyRefused(f"row {n} emits token {token} outside the vocabulary of {vocab_size}")
    if not 0 <= n <= k - 1:  # by construction; stated where the commit relies on it
        raise VerifyRefused(f"accepted {n} outside [0, {k - 1}]")
    return n


def verdict_bits(verdicts: Sequence[RowVerdict], num_drafts: int) -> int:
    """Bit i set when row i accepts draft i + 1, regardless of the chain: what unconditional rates need."""
    return sum(1 << i for i in range(num_drafts) if verdicts[i].accept)


def chain_length(bits: int, num_drafts: int) -> int:
    n = 0
    while n < num_drafts and bits >> n & 1:
        n += 1
    return n


@attrs.define
class AcceptanceStats:
    """Per draft position: scored (verifies that drafted it), accepted unconditionally (its own row
    accepted it, whatever came before: free of the chain's survivorship bias), reached (every earlier draft
    accepted) and accepted conditionally (reached and accepted: what the chain keeps). Caveat: row i's
    context holds drafts 1..i, so after a rejection the unconditional verdict scores the drafter against a
    counterfactual context; it is the same position over an unbiased sample of contexts, not a verified one."""

    verify_steps: int = 0
    tokens: int = 0  # tokens emitted by verifies (accepted chain + 1 each)
    scored: list[int] = attrs.Factory(list)
    unconditional: list[int] = attrs.Factory(list)
    reached: list[int] = attrs.Factory(list)
    conditional: list[int] = attrs.Factory(list)

    def record(self, num_drafts: int, bits: int) -> None:
        while len(self.scored) < num_drafts:
            for counts in (self.scored, self.unconditional, self.reached, self.conditional):
                counts.append(0)
        chain = chain_length(bits, num_drafts)
        self.verify_steps += 1
        self.tokens += chain + 1
        for i in range(num_drafts):
            self.scored[i] += 1
            self.unconditional[i] += bits >> i & 1
            if i <= chain:
                self.reached[i] += 1
                self.conditional[i] += int(i < chain)

    @property
    def drafts_proposed(self) -> int:
        return sum(self.scored)

    @property
    def drafts_accepted(self) -> int:
        return sum(self.conditional)

    @property
    def tokens_per_verify(self) -> float:
        return self.tokens / self.verify_steps if self.verify_steps else 0.0

    def p_unconditional(self) -> list[float]:
        return [a / s if s else 0.0 for a, s in zip(self.unconditional, self.scored, strict=True)]

    def p_conditional(self) -> list[float]:
        """p(i | 1..i-1 accepted); position 1's equals p1."""
        return [a / r if r else 0.0 for a, r in zip(self.conditional, self.reached, strict=True)]

    def summary(self) -> dict[str, float | int | list[float]]:
        unc = self.p_unconditional()
        return {
            "verify_steps": self.verify_steps,
            "drafts_proposed": self.drafts_proposed,
            "drafts_accepted": self.drafts_accepted,
            "tokens_per_verify": round(self.tokens_per_verify, 4),
            "p1": round(unc[0], 4) if unc else 0.0,
            "p_unconditional": [round(p, 4) for p in unc],
            "p_conditional": [round(p, 4) for p in self.p_conditional()],
        }
