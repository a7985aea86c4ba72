"""The draft-count policy (atlas.engine.drafters.policy), without a model: speculation off where it loses, the
widest verify where acceptance is high and the verify cheap, and the engine's choices recomputed on replay."""

from __future__ import annotations

import math

import pytest

from atlas.engine.drafters.policy import VerifyCosts, choose_drafts, expected_tokens, smoothed_rates

CHEAP = VerifyCosts(((1, (1.05, 1.1, 1.15, 1.2)),))
BY_BATCH = VerifyCosts(((1, (1.2, 1.4, 1.6, 1.8)), (16, (1.6, 2.2, 2.9, 3.6)), (64, (2.5, 4.5, 6.5, 9.0))))


def test_expected_tokens_is_one_plus_the_chain_of_acceptances() -> None:
    assert expected_tokens((0.7, 0.7), 2) == pytest.approx(1 + 0.7 + 0.49)
    assert expected_tokens((0.7, 0.7), 0) == 1.0
    assert expected_tokens((1.0, 0.0, 1.0), 3) == 2.0  # the chain stops at the first rejection


def test_high_acceptance_and_a_cheap_verify_take_every_draft() -> None:
    assert choose_drafts(1, 4, (0.95,) * 4, CHEAP) == 4


def test_speculation_that_loses_at_a_batch_verifies_nothing_there() -> None:
    rates = (0.8, 0.75, 0.7, 0.65)
    assert choose_drafts(1, 4, rates, BY_BATCH) >= 2  # 2.8 tokens for 1.6: pays
    assert choose_drafts(64, 4, rates, BY_BATCH) == 0  # 1.8 tokens for 2.5 at best: a plain decode is faster
    assert choose_drafts(100, 4, rates, BY_BATCH) == 0  # past the last row, its costs
    assert choose_drafts(16, 4, rates, BY_BATCH) == 1  # 1.8 / 1.6 beats 2.4 / 2.2 and the rest


def test_low_acceptance_turns_drafting_off_and_max_drafts_bounds_the_choice() -> None:
    assert choose_drafts(1, 4, (0.05,) * 4, CHEAP) == 0
    assert choose_drafts(1, 2, (0.95,) * 4, CHEAP) == 2  # --num-drafts is an upper bound


def test_a_gain_within_the_margin_is_not_taken() -> None:
    costs = VerifyCosts(((1, (1.68,)),))
    assert choose_drafts(1, 1, (0.7,), costs) == 0  # 1.7 tokens for 1.68: within 5% of a decode


def test_smoothed_rates_start_at_the_prior_and_follow_what_is_observed() -> None:
    def planned(p: float, seen: int) -> float:  # the estimate plus one standard error
        return p + math.sqrt(p * (1 - p) / (seen + 4))

    assert smoothed_rates((), (), 2) == pytest.approx((planned(0.7, 0), planned(0.7, 0)))
    rates = smoothed_rates((100, 50), (10, 50), 3)
    assert rates[0] == pytest.approx(planned((10 + 2.8) / 104, 100))
    assert rates[1] == pytest.approx(planned((50 + 2.8) / 54, 50))
    assert rates[2] == pytest.approx(planned(0.7, 0))  # never reached: the prior
    assert smoothed_rates((1000,), (1000,), 1)[0] <= 1.0


def test_a_deeper_position_rejected_early_is_tried_again_once_the_first_drafts_hold() -> None:
    """Position 2 reached 4 times and rejected every time, then only single drafts verified (so never reached
    again): with the measured CPU costs the optimism for a position seen so rarely takes two drafts again once the
    first draft keeps holding, where the plain smoothed rate ((0 + 2.8) / 8 = 0.35) would stay at one for good."""
    costs = VerifyCosts(((1, (1.50, 1.84)),))
    assert choose_drafts(1, 2, smoothed_rates((6, 4), (3, 0), 2), costs) < 2
    assert choose_drafts(1, 2, smoothed_rates((30, 4), (27, 0), 2), costs) == 2
    plain = (27 + 2.8) / 34, 2.8 / 8
    assert choose_drafts(1, 2, plain, costs) == 1


def test_the_engine_cuts_drafts_to_its_choice_deterministically() -> None:
    """A drafter that is always wrong: after a few verifies the policy stops drafting for each sequence, the tokens
    are speculation off's, and a second run plans every step alike (the choice is a function of the recorded
    costs and the verdicts, never the clock)."""
    from atlas.config import EngineConfig
    from atlas.engine.drafters.scripted import ScriptedDrafter
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.model import load_model
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    tiny = load_model("atlas-tiny")
    prompts, params = [list(b"policy: "), list(b"draft count")], SamplingParams(max_tokens=24)
    config = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32, num_drafts=3, drafter="scripted",
                          verify_costs=((1, (1.3, 1.6, 1.9)),))

    def run():  # type: ignore[no-untyped-def]
        sink = RecordingSink()
        engine = build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=sink,
                              drafter=ScriptedDrafter(lambda req: [(t + 7) % 256 for t in req.tokens[-req.k:]]))
        out = [r.token_ids for r in generate(engine, prompts, [params] * 2)]
        stats = engine.stats()
        engine.close()
        return out, stats, [e for _, _, e, _ in sink.rows if e.kind == "step_planned"]

    out, stats, planned = run()
    off = build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32),
                       loaded=tiny)
    assert out == [r.token_ids for r in generate(off, prompts, [params] * 2)]
    assert stats.spec_drafts_accepted == 0 and 0 < stats.spec_verify_steps < 24  # probes every 8 tokens at 0
    by_drafts = stats.spec_steps_by_drafts
    assert len(by_drafts) == 4 and by_drafts[0] > 0 and sum(by_drafts[1:]) > 0 and stats.spec_draft_choice == 0
    # nothing observed yet: the prior plus its standard error (0.93 a draft): 3.59 tokens for 1.9 beats 2.79 for 1.6
    # and 1.93 for 1.3, so the first verifies take every draft
    assert max(len(d) for e in planned for d in e.drafts) == 3
    assert run()[2] == planned


def test_no_probe_where_no_draft_could_pay_at_the_batch() -> None:
    from atlas.engine.drafters.policy import worth_probing

    assert worth_probing(1, 4, CHEAP)
    assert worth_probing(16, 4, BY_BATCH)  # 2 tokens for 1.6 at perfect acceptance
    assert not worth_probing(64, 4, BY_BATCH)  # k + 1 tokens for at least 2.5 x (k + 1) ... never back
    assert not worth_probing(1, 1, VerifyCosts(((1, (1.95,)),)))  # 2 tokens for 1.95: within the margin


def test_the_cuda_cost_model_follows_the_measured_gains() -> None:
    """The CUDA verify as measured on an H100: with the compiled default, at the oracle's 0.7 a draft, no draft
    count pays at any batch (the measured 0.54x / 0.74x at batch 1), so the policy drafts nothing; only a drafter
    right nearly every time would pay at batch 1 or 16, so those batches still probe and batch 64 does not. The
    eager arrangement's cheaper verify pays at batch 1 with 4 drafts at 0.7 (the measured 1.16x), not at 64."""
    from atlas.backends.cuda.costs import verify_costs
    from atlas.engine.drafters.policy import worth_probing

    compiled = VerifyCosts(verify_costs(4, compiled=True))
    for batch in (1, 8, 16, 32, 64, 128):
        assert choose_drafts(batch, 4, (0.7,) * 4, compiled) == 0
    assert choose_drafts(1, 4, (1.0,) * 4, compiled) == 4  # 5 tokens for 3.8
    assert [worth_probing(b, 4, compiled) for b in (1, 16, 64)] == [True, True, False]
    eager = VerifyCosts(verify_costs(4, compiled=False))
    assert choose_drafts(1, 4, (0.7,) * 4, eager) == 4
    assert choose_drafts(1, 2, (0.7,) * 4, eager) == 0  # 2.19 tokens for 2.2: the measured 0.99x
    assert choose_drafts(64, 4, (0.7,) * 4, eager) == 0


def test_a_step_where_no_draft_could_pay_is_a_plain_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation on at a batch where no draft count could pay (the verify costs more than k + 1 decodes): every
    step plans exactly what speculation off plans, and its decode rows come from the batch columns as with
    speculation off (the planner's per-sequence loop runs only for the prefill), so the configured lane costs a
    decode step nothing but its one check."""
    import atlas.engine.planner as planner
    from atlas.config import EngineConfig
    from atlas.engine.drafters.scripted import ScriptedDrafter
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.model import load_model
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    tiny = load_model("atlas-tiny")
    # 16 sequences, prefix caching off: the batch columns hold such a batch (atlas.state.steps._gather_batch)
    prompts, params = [list(b"plain %d: " % i) for i in range(16)], SamplingParams(max_tokens=12, ignore_eos=True)
    base = dict(max_seq_len=64, max_batch_size=16, prefill_chunk_tokens=256, enable_prefix_caching=False)
    loops = []
    real = planner._work
    monkeypatch.setattr(planner, "_work", lambda state, planned, lanes: loops.append(planned.step) or real(
        state, planned, lanes))

    def run(config: EngineConfig, **kwargs):  # type: ignore[no-untyped-def]
        loops.clear()
        sink = RecordingSink()
        engine = build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=sink, **kwargs)
        out = [r.token_ids for r in generate(engine, prompts, [params] * len(prompts))]
        stats = engine.stats()
        engine.close()
        return out, stats, [e for _, _, e, _ in sink.rows if e.kind == "step_planned"], list(loops)

    off = run(EngineConfig(**base))
    spec = run(EngineConfig(**base, num_drafts=2, drafter="scripted", verify_costs=((1, (3.2, 3.4)),)),
               drafter=ScriptedDrafter(lambda req: [t % 256 for t in req.tokens[-req.k:]]))
    assert spec[0] == off[0]
    assert spec[1].spec_verify_steps == 0 and spec[1].spec_steps_by_drafts[1:] == (0, 0)
    assert spec[2] == off[2]  # the same plans, step for step
    assert spec[3] == off[3] and len(spec[3]) < len(spec[2]) / 2  # the loop for the prefill steps alone
