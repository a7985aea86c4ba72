"""Speculative decoding's decisions, as pure functions: per-row verdicts, the accepted prefix, statistics.

A verify feeds K = drafts + 1 rows [last token, d1 .. d_{K-1}]; row i's logits are the target's view of
position start + i + 1, where draft d_{i+1} proposes a token. Each row gets a verdict:
- greedy: accept iff the draft is the target's argmax (lowest index among ties, as sample_token), and the
  row's own token is that argmax;
- temperature > 0: standard speculative rejection sampling, which preserves the target distribution p:
  accept d with probability min(1, p(d) / q(d)); on reject emit a sample from norm(max(0, p - q)). q is
  the drafter's distribution (MTP), or a point mass on d (n-gram, scripted), where the rule reduces to
  "accept with probability p(d)" and the residual to p with d removed.
The last row has no draft: its token is a plain sample from p (the bonus token), keyed exactly like a
decode at that position. Randomness is keyed by (seed, position) with a salt per use, never a global RNG.

The engine, not the backend, turns verdicts into the accepted count (`accepted_prefix`), validates it, and
asks the backend to commit exactly that prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.engine.sampling import SamplingParams, filtered_probs, logprobs_of, sample_token, uniform_for
from atlas.errors import VerifyRefused

# salts keep the acceptance draw and the residual draw of a position independent of each other and of the
# plain sampling draw at that position (which the bonus token reuses, so a verify's last row samples the
# same token a decode would)
_ACCEPT_SALT = 0x5EC0_0001
_RESIDUAL_SALT = 0x5EC0_0002
_DRAFT_SALT = 0x5EC0_0003


@attrs.frozen
class RowVerdict:
    """The target's verdict on one verify row. `token` is what the row emits if the chain reaches it: the
    draft when accepted, else the correction (or, on the last row, the bonus token)."""

    accept: bool
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def keyed_uniform(seed: int, position: int, salt: int) -> float:
    return uniform_for(seed ^ salt, position)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)).item())
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0.0 and idx > 0:  # never land on a zero-probability token through rounding
        idx -= 1
    return idx


def draft_from(logits: torch.Tensor, params: SamplingParams, position: int) -> tuple[int, torch.Tensor | None]:
    """A drafter's token for `position` from its own logits, and its proposal distribution q (None for
    greedy, where the proposal is the point mass on the argmax)."""
    if params.greedy:
        return int(torch.argmax(logits.detach().to("cpu", torch.float64)).item()), None
    q = filtered_probs(logits, params)
    return _inverse_cdf(q, keyed_uniform(params.seed, position, _DRAFT_SALT)), q


def row_verdict(
    logits: torch.Tensor, draft: int | None, params: SamplingParams, position: int, proposal: torch.Tensor | None = None
) -> RowVerdict:
    """The verdict on one row: `logits` [vocab] is the target at the row, `draft` the token proposed for
    `position` (None on the last row), `proposal` the drafter's q for it (None = point mass on `draft`)."""
    if draft is None:
        token = sample_token(logits, params, position)
        return _with_logprob(RowVerdict(False, token), logits, params)
    if params.greedy:
        target = int(torch.argmax(logits.detach().to("cpu", torch.float64)).item())
        return _with_logprob(RowVerdict(draft == target, draft if draft == target else target), logits, params)
    p = filtered_probs(logits, params)
    q_d = 1.0 if proposal is None else float(proposal[draft])
    ratio = float(p[draft]) / q_d if q_d > 0.0 else 0.0
    if keyed_uniform(params.seed, position, _ACCEPT_SALT) < ratio:
        return _with_logprob(RowVerdict(True, draft), logits, params)
    if proposal is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - proposal.to(p.dtype), min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q exactly: a reject has probability 0, any p-sample is exact
        residual = p
    token = _inverse_cdf(residual, keyed_uniform(params.seed, position, _RESIDUAL_SALT))
    return _with_logprob(RowVerdict(False, token), logits, params)


def _with_logprob(v: RowVerdict, logits: torch.Tensor, params: SamplingParams) -> RowVerdict:
    if not params.logprobs:
        return v
    lp, top = logprobs_of(logits, v.token, params.top_logprobs)
    return attrs.evolve(v, logprob=lp, top_logprobs=top)


def verify_rows(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    start: int,
    proposals: Sequence[torch.Tensor | None] | None = None,
) -> tuple[RowVerdict, ...]:
    """Verdicts for a verify fed at positions [start, start + K): logits [K, vocab], K = len(drafts) + 1.
    Row i judges the token for position start + i + 1."""
    k = len(drafts) + 1
    if logits.shape[0] != k:
        raise VerifyRefused(f"verify of {len(drafts)} drafts needs {k} logit rows, got {logits.shape[0]}")
    out = []
    for i in range(k):
        draft = drafts[i] if i < len(drafts) else None
        q = proposals[i] if proposals is not None and i < len(drafts) else None
        out.append(row_verdict(logits[i], draft, params, start + i + 1, q))
    return tuple(out)


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
