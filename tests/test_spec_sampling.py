"""Speculative acceptance as pure functions: greedy verdicts, and rejection sampling that preserves the target
distribution (checked by total-variation distance over many seeds on a small vocabulary), keyed by (seed,
position); the accepted prefix is validated; acceptance statistics per draft position."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from atlas.errors import VerifyRefused
from atlas.plan import RowVerdict
from atlas.sampling.acceptance import AcceptanceStats, accepted_prefix
from atlas.sampling.keyed import filtered_probs, sample_token
from atlas.sampling.params import SamplingParams
from atlas.sampling.verdicts import draft_from, row_verdict, verify_rows

VOCAB = 8
SEEDS = 5000
# 5000 draws over 8 tokens: the TV distance of an exact sampler stays below ~0.03 (sd per token ~0.007)
TV_BOUND = 0.04


def tv(counts: Counter[int], p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - float(p[t])) for t in range(p.numel()))


def target_logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
@pytest.mark.parametrize("draft", [0, 3])
def test_rejection_sampling_with_a_point_mass_proposal_preserves_the_target(params: SamplingParams,
                                                                            draft: int) -> None:
    logits = target_logits(1)
    p = filtered_probs(logits, params)
    emitted = Counter(row_verdict(logits, draft, SamplingParams(**{**params.to_json(), "seed": s}), 40).token
                      for s in range(SEEDS))
    assert tv(emitted, p) < TV_BOUND


def test_rejection_sampling_against_the_drafters_distribution_preserves_the_target() -> None:
    logits, drafter_logits = target_logits(2), target_logits(3)
    p = filtered_probs(logits, SamplingParams(temperature=1.0))
    emitted: Counter[int] = Counter()
    accepted = 0
    for s in range(SEEDS):
        params = SamplingParams(temperature=1.0, seed=s)
        draft, q = draft_from(drafter_logits, params, 41)
        v = row_verdict(logits, draft, params, 41, q)
        emitted[v.token] += 1
        accepted += v.accept
    assert tv(emitted, p) < TV_BOUND
    # and acceptance is the overlap sum(min(p, q)), what the proposal buys
    q = filtered_probs(drafter_logits, SamplingParams(temperature=1.0))
    assert abs(accepted / SEEDS - float(torch.minimum(p, q).sum())) < 0.03


def test_a_verify_of_two_rows_emits_target_distributed_tokens() -> None:
    """The second emitted token, on the runs that accepted the first draft, follows row 1's target."""
    rows = torch.stack([target_logits(4), target_logits(5)])
    draft = int(torch.argmax(rows[0]))  # likely accepted, so row 1 is reached often
    second: Counter[int] = Counter()
    for s in range(SEEDS):
        verdicts = verify_rows(rows, (draft,), SamplingParams(temperature=1.0, seed=s), 30)
        if accepted_prefix(verdicts, (draft,), VOCAB) == 1:
            second[verdicts[1].token] += 1
    assert sum(second.values()) > 1000
    assert tv(second, filtered_probs(rows[1], SamplingParams(temperature=1.0))) < TV_BOUND + 0.02


def test_verdicts_are_keyed_by_seed_and_position() -> None:
    rows = torch.stack([target_logits(6), target_logits(7), target_logits(8)])
    a = verify_rows(rows, (1, 2), SamplingParams(temperature=1.0, seed=9), 100)
    assert a == verify_rows(rows, (1, 2), SamplingParams(temperature=1.0, seed=9), 100)
    many = {verify_rows(rows, (1, 2), SamplingParams(temperature=1.0, seed=9), start) for start in range(20)}
    assert len(many) > 1
    # the last (bonus) row, fed at 102, samples the token for 103 exactly as a plain decode there would
    assert a[2].token == sample_token(rows[2], SamplingParams(temperature=1.0, seed=9), 103)


def test_greedy_verdicts_take_the_targets_argmax() -> None:
    rows = torch.stack([target_logits(10), target_logits(11), target_logits(12)])
    best = [int(torch.argmax(r)) for r in rows]
    v = verify_rows(rows, (best[0], (best[1] + 1) % VOCAB), SamplingParams(), 5)
    assert [x.accept for x in v] == [True, False, False]
    assert [x.token for x in v] == best
    assert accepted_prefix(v, (best[0], (best[1] + 1) % VOCAB), VOCAB) == 1


def test_malformed_verdicts_are_refused_not_committed() -> None:
    ok = (RowVerdict(True, 3), RowVerdict(False, 4))
    assert accepted_prefix(ok, (3,), VOCAB) == 1
    with pytest.raises(VerifyRefused):
        accepted_prefix(ok[:1], (3,), VOCAB)  # fewer verdicts than rows
    with pytest.raises(VerifyRefused):
        accepted_prefix((RowVerdict(True, 5), RowVerdict(False, 4)), (3,), VOCAB)  # accepts 3, emits 5
    with pytest.raises(VerifyRefused):
        accepted_prefix((RowVerdict(False, 99), RowVerdict(False, 4)), (3,), VOCAB)  # outside the vocabulary


def test_acceptance_statistics_per_position() -> None:
    stats = AcceptanceStats()
    for bits in (0b111, 0b101, 0b110, 0b000):  # 3 drafts each; chains 3, 1, 0, 0
        stats.record(3, bits)
    assert stats.verify_steps == 4 and stats.tokens == (3 + 1) + (1 + 1) + (0 + 1) + (0 + 1)
    assert stats.p_unconditional() == [0.5, 0.5, 0.75]
    # position 2 reached twice (chains >= 1), accepted once; position 3 reached once, accepted once
    assert stats.p_conditional() == [0.5, 0.5, 1.0]
    assert stats.drafts_accepted == 4 and stats.drafts_proposed == 12
    assert stats.tokens_per_verify == 2.0
