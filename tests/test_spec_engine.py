"""Speculative decoding through the engine: the QSA latch on a backend that cannot select per verify row, a
refused verify or commit ends the request with `error` (never `stop`) and leaves others untouched, seeded
sampling with speculation is keyed (replays, batch-invariant), and acceptance statistics reach the trace."""

from __future__ import annotations

import pytest
import structlog
import torch

from atlas.backends.cpu import CpuBackend
from atlas.config import EngineConfig, derive_capacities
from atlas.engine.drafters import DraftRequest, ScriptedDrafter
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.errors import CapabilityError
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import SpeculationLatchedOff, StepExecuted, StepPlanned

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
PROMPTS = [list(b"short"), list(b"twelve chars")]
PARAMS = SamplingParams(max_tokens=16)
OFF = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32)
SPEC = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32, num_drafts=3, drafter="scripted")
REFERENCE = [r.token_ids for r in generate(build_engine("atlas-tiny", "cpu", OFF, loaded=TINY), PROMPTS,
                                           [PARAMS] * 2)]


def oracle(req: DraftRequest) -> list[int]:
    """Always right: the reference's next tokens."""
    ref = REFERENCE[PROMPTS.index(list(req.tokens[: req.prompt_len]))]
    return list(ref[req.generated : req.generated + req.k])


def engine_on(backend: CpuBackend, config: EngineConfig = SPEC, drafter=None) -> Engine:
    caps = derive_capacities(config, TINY.spec)
    return Engine(backend, tokenizer=TINY.tokenizer, config=config, capacities=caps, spec=TINY.spec,
                  sink=RecordingSink(), full_audit=True, drafter=drafter or ScriptedDrafter(oracle))


def events(engine: Engine) -> list:
    return [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]


def test_a_backend_that_cannot_select_per_row_latches_the_lane_off_before_the_bound() -> None:
    backend = CpuBackend(TINY, num_kv_blocks=8, verify_width=4, per_row_qsa_verify=False)
    engine = engine_on(backend)
    with structlog.testing.capture_logs() as logs:
        results = generate(engine, PROMPTS, [PARAMS] * 2)
    assert [r.token_ids for r in results] == REFERENCE
    bound = TINY.spec.qsa.inert_bound
    latched = [e for e in events(engine) if isinstance(e, SpeculationLatchedOff)]
    assert sorted(e.seq_id for e in latched) == [0, 1]  # both grow past the bound, each latches once
    assert [line["event"] for line in logs].count("speculation latched off") == 2
    computed = {0: 0, 1: 0}
    widest = 0
    plan = None
    for e in events(engine):
        if isinstance(e, StepPlanned):
            plan = e
        elif isinstance(e, StepExecuted) and plan is not None:
            for i, (seq_id, fed) in enumerate(zip(plan.seqs, plan.fed, strict=True)):
                drafts = plan.drafts[i] if plan.drafts else ()
                if drafts:  # every verify's rows stay inside the dense regime
                    assert computed[seq_id] + 1 + len(drafts) <= bound
                    widest = max(widest, len(drafts))
                computed[seq_id] += fed + (e.accepted[i] if drafts else 0)
        elif isinstance(e, SpeculationLatchedOff):
            assert e.position == computed[e.seq_id] and e.position + 1 + 3 > bound
    assert widest == 3  # the oracle's drafts were verified before the latch


def test_speculation_crosses_the_bound_on_the_cpu_backend() -> None:
    """The CPU backend selects per verify row: no latch, and the tokens are still speculation off's."""
    engine = build_engine("atlas-tiny", "cpu", SPEC, loaded=TINY, sink=RecordingSink(), full_audit=True,
                                drafter=ScriptedDrafter(oracle))
    assert [r.token_ids for r in generate(engine, PROMPTS, [PARAMS] * 2)] == REFERENCE
    assert not any(isinstance(e, SpeculationLatchedOff) for e in events(engine))
    stats = engine.stats()
    assert stats.spec_acceptance_p1 == 1.0 and stats.spec_tokens_per_verify > 3.0


class TruncatedVerdicts(CpuBackend):
    """Returns one verdict too few for sequence 1's verifies: a malformed result, not a clean token."""

    def verify(self, work):  # type: ignore[no-untyped-def]
        verdicts = super().verify(work)
        return verdicts[:-1] if work.seq_id == 1 else verdicts


class ShallowIntermediates(CpuBackend):
    """Loses the per-token intermediates past row 0 before sequence 1's commit (a pool shallower than K)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        store, commit = self.store, self.store.commit

        def shallow(seq_id: int, rows: int):  # type: ignore[no-untyped-def]
            if seq_id == 1:
                pending = store.pending[seq_id]
                store.pending[seq_id] = type(pending)(pending.start, pending.tokens, pending.states[:1], pending.hidden)
            return commit(seq_id, rows)

        store.commit = shallow  # type: ignore[method-assign]


def test_a_refused_verify_or_commit_ends_that_request_with_error_only() -> None:
    for backend_type in (TruncatedVerdicts, ShallowIntermediates):
        engine = engine_on(backend_type(TINY, num_kv_blocks=8, verify_width=4))
        results = generate(engine, PROMPTS, [PARAMS] * 2)
        assert results[0].finish_reason is FinishReason.LENGTH and results[0].token_ids == REFERENCE[0]
        assert results[1].finish_reason is FinishReason.ERROR, backend_type
        assert "verify commit refused" in (results[1].finish_detail or "")
        assert engine.state.pool.used == 0


def test_a_verify_wider_than_the_backends_intermediates_is_refused_at_start() -> None:
    with pytest.raises(CapabilityError, match="num_drafts 3 needs verify width 4; backend 'cpu' holds 2"):
        engine_on(CpuBackend(TINY, num_kv_blocks=8, verify_width=2))


def test_sampled_speculation_is_keyed_and_batch_invariant() -> None:
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=5), SamplingParams(max_tokens=16, temperature=1.2,
                                                                                      seed=6, top_k=40)]
    config = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32, num_drafts=2, drafter="mtp")

    def run(prompts, ps):  # type: ignore[no-untyped-def]
        engine = build_engine("atlas-tiny", "cpu", config, loaded=TINY, full_audit=True)
        return [r.token_ids for r in generate(engine, prompts, ps)], engine

    batched, engine = run(PROMPTS, params)
    assert engine.stats().spec_verify_steps > 0
    assert batched == run(PROMPTS, params)[0]  # keyed by (seed, position): a replay gives the same tokens
    assert [run([p], [s])[0][0] for p, s in zip(PROMPTS, params, strict=True)] == batched


def test_logprobs_with_speculation_are_speculation_offs() -> None:
    params = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2)

    def run(engine: Engine) -> tuple[list[int], list[float], list]:
        engine.add_request("r", PROMPTS[1], params)
        tokens, lps, tops = [], [], []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
                lps += o.new_logprobs
                tops += o.new_top_logprobs
        return tokens, lps, tops

    off = run(build_engine("atlas-tiny", "cpu", OFF, loaded=TINY))
    on = run(engine_on(CpuBackend(TINY, num_kv_blocks=8, verify_width=4)))
    assert on[0] == off[0] and len(on[1]) == len(off[1]) == 12
    assert on[1] == off[1] and on[2] == off[2]  # bitwise: a verify row's logits are a decode's


def test_a_stop_inside_a_verify_cuts_the_commit_there() -> None:
    """The oracle's drafts run past the stop token; the request ends exactly where speculation off ends it."""
    stop_token = REFERENCE[1][6]
    stop_text = bytes(REFERENCE[0][4:6]).decode("utf-8", errors="replace")
    for params in (SamplingParams(max_tokens=16, stop_token_ids=(stop_token,)),
                   SamplingParams(max_tokens=16, stop=(stop_text,))):
        off = generate(build_engine("atlas-tiny", "cpu", OFF, loaded=TINY), PROMPTS, [params] * 2)
        engine = engine_on(CpuBackend(TINY, num_kv_blocks=8, verify_width=4))
        on = generate(engine, PROMPTS, [params] * 2)
        assert [(r.token_ids, r.finish_reason, r.text) for r in on] == [(r.token_ids, r.finish_reason, r.text)
                                                                       for r in off]
        assert FinishReason.STOP in {r.finish_reason for r in on}
        assert engine.state.pool.used == 0


def test_point_mass_drafts_never_change_a_sampled_requests_tokens() -> None:
    """Scripted and n-gram drafts are point masses, judged on the decode's own keyed draw (a verify row's logits
    are a decode's, bitwise): with them a sampled request's tokens are exactly its tokens with speculation off,
    however many drafts are accepted."""
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=5),
              SamplingParams(max_tokens=16, temperature=1.2, seed=6, top_k=40, top_p=0.9)]
    off = [r.token_ids for r in generate(build_engine("atlas-tiny", "cpu", OFF, loaded=TINY), PROMPTS, params)]

    def half_right(req: DraftRequest) -> list[int]:  # the sampled reference's next tokens, every other one wrong
        ref = off[PROMPTS.index(list(req.tokens[: req.prompt_len]))]
        return [t if i % 2 == 0 else (t + 1) % 256 for i, t in enumerate(ref[req.generated : req.generated + req.k])]

    engine = engine_on(CpuBackend(TINY, num_kv_blocks=8, verify_width=4), drafter=ScriptedDrafter(half_right))
    assert [r.token_ids for r in generate(engine, PROMPTS, params)] == off
    stats = engine.stats()
    assert stats.spec_drafts_accepted > 0 and stats.spec_drafts_accepted < stats.spec_drafts_proposed
    ngram = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32, num_drafts=3, drafter="ngram")
    assert [r.token_ids for r in generate(build_engine("atlas-tiny", "cpu", ngram, loaded=TINY), PROMPTS,
                                          params)] == off
