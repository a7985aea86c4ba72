"""Speculative decoding's verdicts on the keyed draws, batched on the device with no host synchronisation.

A verify feeds K = drafts + 1 rows [last token, d1 .. d_{K-1}]; row i's logits are the target's view of
position start + i + 1, where draft d_{i+1} proposes a token. Every row first draws s, the token a plain
decode would sample at its position (atlas.sampling.keyed.sample, SAMPLE_SALT: same keys, same token). Then:
- greedy, and a point-mass proposal (n-gram, scripted drafts): accept iff s == d, and the row emits s.
  With Gumbel-max, P(s == d) = p(d) and s given s != d follows p with d removed, renormalised: this IS the
  standard rule "accept with probability p(d), else sample the residual p without d", drawn on the decode's
  own keys, so with point-mass drafts a request's tokens are exactly its non-speculative tokens;
- a drafter's distribution q (MTP), temperature > 0: standard rejection sampling, accept d with probability
  min(1, p(d) / q(d)) (u * q(d) < p(d), u keyed with ACCEPT_SALT), else emit a draw from norm(max(0, p - q))
  (Gumbel-max on log of the residual, RESIDUAL_SALT). Both preserve the target distribution p.
The last row (and padding past a row's draft count) has no draft: its token is s, the bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.sampling.acceptance import RowVerdict, VerifyRefused
from atlas.sampling.keyed import (
    ACCEPT_SALT,
    DRAFT_SALT,
    RESIDUAL_SALT,
    SAMPLE_SALT,
    Rows,
    distribution,
    kept_mask,
    keyed_argmax,
    keyed_uniform,
    logprobs,
    penalised,
    rows_of,
    scaled,
    threshold,
)
from atlas.sampling.params import SamplingParams

_NEG_INF = float("-inf")


@attrs.frozen
class Verdicts:
    """A batch of verifies' verdicts, on the device."""

    accept: torch.Tensor  # [B, K] bool: row i accepts draft i + 1 (False on the bonus row and past the drafts)
    tokens: torch.Tensor  # [B, K] int64: what row i emits if the chain reaches it
    accepted: torch.Tensor  # [B] int64: leading accepts; the sequence emits tokens[b, : accepted[b] + 1]


def judge(logits: torch.Tensor, drafts: torch.Tensor, rows: Rows, *, proposals: torch.Tensor | None = None,
          has_q: torch.Tensor | None = None, banned: torch.Tensor | None = None,
          seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verdicts on N independent rows: logits [N, V], drafts [N] int64 (-1: no draft, a plain sample), rows
    at the drafted positions, proposals [N, V] (the drafter's q; rows where has_q [N] is False are point
    masses). Returns (accept [N] bool, token [N] int64)."""
    key = penalised(logits, rows, banned, seen)
    has_d = drafts >= 0
    d = drafts.clamp(min=0)[:, None]
    if not rows.sampled:
        s = key.argmax(dim=-1)
        return has_d & (s == d[:, 0]), s
    last = threshold(key, rows) if rows.filtered else None
    s = keyed_argmax(key, rows, last, SAMPLE_SALT)  # what a plain decode at the row's position samples
    accept = has_d & (s == d[:, 0])
    if proposals is None:
        return accept, s
    z = scaled(key.to(torch.float64), rows)
    e = torch.where(kept_mask(z, rows, last), torch.exp(z - z.max(dim=-1, keepdim=True).values), 0.0)
    p = e / e.sum(dim=-1, keepdim=True)
    q = proposals.to(torch.float64)
    p_d, q_d = p.gather(1, d)[:, 0], q.gather(1, d)[:, 0]
    q_accept = (q_d > 0) & (keyed_uniform(rows, ACCEPT_SALT) * q_d < p_d)
    residual = torch.clamp(p - q, min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: a reject has prob 0
    # a draw proportional to the residual: Gumbel-max on its log at temperature 1, nothing else filtered
    unit = attrs.evolve(rows, temperature=torch.ones_like(rows.temperature),
                        log_min_p=torch.full_like(rows.log_min_p, _NEG_INF), filtered=False)
    correction = keyed_argmax(torch.log(residual), unit, None, RESIDUAL_SALT)
    use_q = has_d & (rows.temperature > 0)
    if has_q is not None:
        use_q = use_q & has_q
    accept = torch.where(use_q, q_accept, accept)
    return accept, torch.where(use_q, torch.where(q_accept, d[:, 0], correction), s)


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, rows: Rows, *,
           proposals: torch.Tensor | None = None, has_q: torch.Tensor | None = None,
           banned: torch.Tensor | None = None, seen: torch.Tensor | None = None) -> Verdicts:
    """B verifies at once: logits [B, K, V], drafts [B, K - 1] int64 (padded), num_drafts [B] int64, rows
    per sequence with position = the verify's start; proposals [B, K - 1, V] and has_q [B, K - 1] for drafts
    with a drafter distribution; banned/seen: [B, K, V] masks or [B, K, L] ids. Row i judges position
    start + i + 1."""
    b, k, vocab = logits.shape
    dev = logits.device
    i = torch.arange(k, device=dev, dtype=torch.int64)
    pos = (rows.position[:, None] + i + 1).reshape(-1)
    pad = torch.full((b, 1), -1, dtype=torch.int64, device=dev)
    d = torch.cat([drafts.to(torch.int64), pad], dim=1)
    d = torch.where(i[None] < num_drafts[:, None], d, -1).reshape(-1)
    q = hq = None
    if proposals is not None:
        q = torch.cat([proposals, torch.zeros_like(proposals[:, :1])], dim=1).reshape(b * k, vocab)
        if has_q is not None:
            hq = torch.cat([has_q, torch.zeros_like(has_q[:, :1])], dim=1).reshape(-1)
    flat = lambda t: None if t is None else t.reshape(b * k, -1)  # noqa: E731
    accept, tokens = judge(logits.reshape(b * k, vocab), d, rows.at(pos, k), proposals=q, has_q=hq,
                           banned=flat(banned), seen=flat(seen))
    accept, tokens = accept.view(b, k), tokens.view(b, k)
    accepted = torch.cumprod(accept[:, : k - 1].to(torch.int64), dim=1).sum(dim=1)
    return Verdicts(accept, tokens, accepted)


def draft(logits: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter-side draw: tokens [B] from the drafter's logits on keyed noise (DRAFT_SALT, independent of
    the target's draws) and its proposal distribution q [B, V] float64 (greedy rows: the point mass)."""
    key = penalised(logits, rows)
    if not rows.sampled:
        greedy = key.argmax(dim=-1)
        return greedy, torch.zeros_like(key, dtype=torch.float64).scatter_(1, greedy[:, None], 1.0)
    tokens = keyed_argmax(key, rows, threshold(key, rows) if rows.filtered else None, DRAFT_SALT)
    return tokens, distribution(logits, rows)


# -- one sequence on the host: what the CPU reference backend and its drafter call ---------------------------


def draft_from(logits: torch.Tensor, params: SamplingParams, position: int) -> tuple[int, torch.Tensor | None]:
    """A drafter's token for `position` from its own logits [vocab], and its proposal distribution q (None
    for greedy, where the proposal is the point mass on the argmax)."""
    row = logits.detach()[None]
    tokens, q = draft(row, rows_of([params], [position], row.device))
    return int(tokens[0]), None if params.greedy else q[0]


def _verdicts(logits: torch.Tensor, accept: list[bool], tokens: list[int], params: SamplingParams
              ) -> tuple[RowVerdict, ...]:
    if not params.logprobs:
        return tuple(RowVerdict(a, t) for a, t in zip(accept, tokens, strict=True))
    lp, v, ids = logprobs(logits, torch.tensor(tokens, device=logits.device), params.top_logprobs)
    return tuple(RowVerdict(a, t, float(lp[r]), tuple(zip(ids[r].tolist(), v[r].tolist(), strict=True)))
                 for r, (a, t) in enumerate(zip(accept, tokens, strict=True)))


def row_verdict(logits: torch.Tensor, draft_token: int | None, params: SamplingParams, position: int,
                proposal: torch.Tensor | None = None) -> RowVerdict:
    """The verdict on one row: `logits` [vocab] is the target at the row, `draft_token` the token proposed for
    `position` (None on the last row), `proposal` the drafter's q for it (None = point mass on the draft)."""
    row = logits.detach()[None]
    d = torch.tensor([-1 if draft_token is None else draft_token], device=row.device)
    q = None if proposal is None else proposal[None]
    accept, token = judge(row, d, rows_of([params], [position], row.device), proposals=q)
    return _verdicts(row, [bool(accept[0])], [int(token[0])], params)[0]


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
    rows = logits.detach()
    dev = rows.device
    q = has_q = None
    if proposals is not None and any(p is not None for p in proposals[: k - 1]):
        q = torch.zeros(k - 1, rows.shape[-1], dtype=torch.float64, device=dev)
        has_q = torch.zeros(k - 1, dtype=torch.bool, device=dev)
        for i, p in enumerate(proposals[: k - 1]):
            if p is not None:
                q[i], has_q[i] = p.to(dev, torch.float64), True
        q, has_q = q[None], has_q[None]
    drafts_t = torch.tensor([list(drafts)], dtype=torch.int64, device=dev).reshape(1, k - 1)
    out = verify(rows[None], drafts_t, torch.tensor([k - 1], device=dev), rows_of([params], [start], dev),
                 proposals=q, has_q=has_q)
    return _verdicts(rows, out.accept[0].tolist(), out.tokens[0].tolist(), params)
