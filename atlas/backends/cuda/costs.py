"""The CUDA backend's verify cost model for the draft-count policy (atlas.engine.drafters.policy): a verify step's
time over a plain decode step's, by batch, for 1..4 drafts, measured on an H100 (qwen4exp-2p7b bf16, steady steps,
2026-12-07, when the verify ran the eager layer stack under its own graphs; it now runs the decode's compiled
regions, its graphs capturing them, so DEFAULT's figures are an upper bound until measured again:
`python benchmarks/cuda_features.py`, the oracle's verify steps against K = 1).

Measured: 3 rows (2 drafts) and 5 rows (4 drafts). 1 and 3 drafts are not measured: 1 takes 2's cost (the verify's
fixed cost dominates), 3 the mean of 2's and 4's. With the compiled default no draft count pays at the oracle's
0.7 a draft at any batch (the measured 0.54x / 0.74x at batch 1), so the policy drafts nothing until the verify
rides the decode's own fast path; only a drafter right nearly every time would pay (5 tokens for 3.8 at batch 1).
"""

from __future__ import annotations

# (batch, (1, 2, 3, 4 drafts)): the default arrangement (compiled regions) and the eager one (--tuning eager)
DEFAULT = ((1, (4.1, 4.1, 3.95, 3.8)), (16, (3.6, 3.6, 4.0, 4.4)), (64, (4.5, 4.5, 6.8, 9.1)))
EAGER = ((1, (2.2, 2.2, 2.3, 2.4)), (64, (3.2, 3.2, 4.8, 6.4)))


def verify_costs(num_drafts: int, *, compiled: bool) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """The table cut to num_drafts (drafts past 4 are unmeasured: the policy never picks them)."""
    return tuple((batch, costs[:num_drafts]) for batch, costs in (DEFAULT if compiled else EAGER))
