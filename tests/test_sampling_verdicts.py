"""Speculative verdicts on the keyed draws (atlas.sampling.verdicts), batched: point-mass drafts are judged on
the decode's own draw (so a verify emits exactly the tokens plain decoding would), rejection sampling against a
drafter's q preserves the target, the batched verify equals the per-sequence one with padding, and the
drafter's draws follow its q."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from atlas.sampling.keyed import distribution, rows_of, sample, sample_token
from atlas.sampling.params import SamplingParams
from atlas.sampling.verdicts import draft, draft_from, verify, verify_rows

DRAWS = 5000
TV_BOUND = 0.04  # as tests/test_sampling_keyed.py: 5000 draws over 8 tokens, E[TV] ~ 0.016


def tv(counts: Counter[int], p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - float(p[t])) for t in range(p.numel()))


def logits_of(seed: int, rows: int = 1, vocab: int = 8) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


def seeded(params: SamplingParams, n: int = DRAWS) -> list[SamplingParams]:
    return [SamplingParams(**{**params.to_json(), "seed": s}) for s in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=4), SamplingParams(seed=4),
                                    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=4)])
def test_point_mass_verdicts_emit_exactly_the_plain_decode_tokens(params: SamplingParams) -> None:
    """Every row's token is what a decode at its position samples; a draft is accepted iff it is that token."""
    rows = logits_of(1, 4)
    for start in range(30):
        plain = [sample_token(rows[i], params, start + i + 1) for i in range(4)]
        drafts = (plain[0], (plain[1] + 1) % 8, plain[2])  # accepted, rejected, accepted (not reached)
        v = verify_rows(rows, drafts, params, start)
        assert [x.token for x in v] == plain
        assert [x.accept for x in v] == [True, False, True, False]


def test_point_mass_acceptance_is_p_of_the_draft_and_the_emitted_token_follows_p() -> None:
    logits = logits_of(2)
    params = SamplingParams(temperature=1.0)
    p = distribution(logits, rows_of([params], [0]))[0]
    b = DRAWS
    out = verify(logits[:, None].expand(b, 2, -1), torch.full((b, 1), 3), torch.ones(b, dtype=torch.int64),
                 rows_of(seeded(params), [40] * b))
    assert abs(out.accept[:, 0].double().mean().item() - float(p[3])) < 0.02  # sd ~ 0.007
    first = Counter(out.tokens[:, 0].tolist())
    assert tv(first, p) < TV_BOUND


def test_rejection_sampling_against_a_drafters_q_preserves_the_target_batched() -> None:
    target, drafter = logits_of(3), logits_of(4)
    params = SamplingParams(temperature=1.0)
    b = DRAWS
    rows = rows_of(seeded(params), [41] * b)
    drafts, q = draft(drafter.expand(b, -1), rows_of(seeded(params), [42] * b))  # the draft is for position 42
    out = verify(target[:, None].expand(b, 2, -1), drafts[:, None], torch.ones(b, dtype=torch.int64), rows,
                 proposals=q[:, None], has_q=torch.ones(b, 1, dtype=torch.bool))
    p = distribution(target, rows_of([params], [0]))[0]
    assert tv(Counter(out.tokens[:, 0].tolist()), p) < TV_BOUND
    # acceptance is the overlap sum(min(p, q)) (sd ~ 0.007)
    assert abs(out.accept[:, 0].double().mean().item() - float(torch.minimum(p, q[0]).sum())) < 0.03
    assert torch.equal(out.tokens[:, 0][out.accept[:, 0]], drafts[out.accept[:, 0]])


def test_the_drafters_draws_follow_its_q_on_their_own_keys() -> None:
    logits = logits_of(5)
    params = SamplingParams(temperature=0.8, top_k=6)
    tokens, q = draft(logits.expand(DRAWS, -1), rows_of(seeded(params), [9] * DRAWS))
    assert tv(Counter(tokens.tolist()), q[0]) < TV_BOUND
    target = sample(logits.expand(DRAWS, -1), rows_of(seeded(params), [9] * DRAWS))
    assert (tokens != target).any()  # DRAFT_SALT: not the target's draw at the same position
    token, q1 = draft_from(logits[0], SamplingParams(), 9)
    assert q1 is None and token == int(logits[0].argmax())


def test_batched_verify_equals_each_sequence_alone_with_padding() -> None:
    g = torch.Generator().manual_seed(6)
    b, k, vocab = 6, 4, 50
    logits = torch.randn(b, k, vocab, generator=g) * 2
    counts = torch.tensor([3, 0, 1, 2, 3, 1])
    drafts = torch.randint(0, vocab, (b, k - 1), generator=g)
    params = [SamplingParams(temperature=0.9, seed=s, top_p=0.9 if s % 2 else 1.0) for s in range(b)]
    params[2] = SamplingParams()
    starts = [10, 20, 30, 40, 50, 60]
    # drafts that the target likes for some rows, so chains longer than 0 occur
    drafts[0] = torch.tensor([sample_token(logits[0, i], params[0], starts[0] + i + 1) for i in range(3)])
    out = verify(logits, drafts, counts, rows_of(params, starts))
    for s in range(b):
        n = int(counts[s])
        alone = verify_rows(logits[s, : n + 1], drafts[s, :n].tolist(), params[s], starts[s])
        assert out.accept[s, : n + 1].tolist() == [v.accept for v in alone]
        assert out.tokens[s, : n + 1].tolist() == [v.token for v in alone]
        assert not out.accept[s, n:].any()  # the bonus row and the padding accept nothing
        chain = next((i for i, v in enumerate(alone[:n]) if not v.accept), n)
        assert int(out.accepted[s]) == chain
    assert int(out.accepted[0]) == 3


def test_greedy_rows_ignore_a_proposal() -> None:
    logits = logits_of(7, 2)
    best = int(logits[0].argmax())
    q = torch.full((1, 1, 8), 1 / 8)
    out = verify(logits[None], torch.tensor([[best]]), torch.tensor([1]), rows_of([SamplingParams()], [0]),
                 proposals=q, has_q=torch.ones(1, 1, dtype=torch.bool))
    assert out.accept[0].tolist() == [True, False] and out.tokens[0].tolist() == [best, int(logits[1].argmax())]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_verdicts_equal_the_cpus_without_a_host_sync() -> None:
    g = torch.Generator().manual_seed(8)
    b, k, vocab = 32, 4, 32768
    logits = (torch.randn(b, k, vocab, generator=g) * 2).to(torch.bfloat16).float()
    drafts = logits[:, :-1].argmax(dim=-1)  # often accepted: long chains
    drafts[::3, 1] = 7
    counts = torch.randint(0, k, (b,), generator=g)
    params = [SamplingParams(temperature=0.9, seed=s, top_p=0.95 if s % 2 else 1.0) for s in range(b)]
    starts = list(range(100, 100 + b))
    q = torch.softmax(torch.randn(b, k - 1, vocab, generator=g), dim=-1).double()
    has_q = torch.rand(b, k - 1, generator=g) < 0.5
    want = verify(logits, drafts, counts, rows_of(params, starts), proposals=q, has_q=has_q)
    dev = [t.cuda() for t in (logits, drafts, counts, q, has_q)]
    rows = rows_of(params, starts, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = verify(dev[0], dev[1], dev[2], rows, proposals=dev[3], has_q=dev[4])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.accept.cpu(), want.accept) and torch.equal(got.tokens.cpu(), want.tokens)
    assert torch.equal(got.accepted.cpu(), want.accepted) and int(want.accepted.max()) >= 1
