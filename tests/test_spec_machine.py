"""Speculative decoding under a hypothesis state machine, on the CPU backend and the tiny model.

Arrivals, chunked prefill, decodes and verifies interleave (three sequences share an 8-token step budget and
14 KV blocks, so drafts get cut and sequences get preempted and recomputed); a scripted drafter proposes, per
verify, a drawn number of correct drafts and then a wrong one (0: full reject; >= K - 1: full accept).
Prompts of 17-22 tokens cross the QSA inert bound (19) while verifying. The engine audits every machine after
every event; after every rule (tests/machine_checks.py) the backend's cursors, each request's tokens so far
against a run with speculation off (greedy; all of them once it finishes), no `error` finish, and every running
sequence's data-plane state against a fresh sequence fed the same tokens. `RowBlindSpeculativeMachine`: the
same on the CPU backend with per_row_qsa_verify=False, whose verify refuses rows past the inert bound: the
lane's latch must come exactly in time (a late one ends a request in `error`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_checks import DataReference, Outputs, check_cursors

from atlas.config import EngineConfig
from atlas.engine.drafters import DraftRequest, ScriptedDrafter
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import SequencePreempted, StepExecuted, StepPlanned

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
PROMPTS = [list(b"hi"), list(b"speculate!"), list(b"cross the bound!!"), list(b"a verify across QSA, ok")]
PARAMS = SamplingParams(max_tokens=14)
# max_seq_len 37: the longest prompt (23) and its 14 tokens fill it, so every capacity sized by it is reached; every
# verify 3 wide: no draft-count policy
CONFIG = EngineConfig(max_seq_len=37, max_batch_size=3, prefill_chunk_tokens=8, block_size=4, num_kv_blocks=14,
                      num_drafts=3, drafter="scripted", verify_costs=())
OFF = EngineConfig(max_seq_len=40, max_batch_size=1, prefill_chunk_tokens=40)


def reference() -> list[tuple[int, ...]]:
    engine = build_engine("atlas-tiny", "cpu", OFF, loaded=TINY)
    return [r.token_ids for r in generate(engine, PROMPTS, [PARAMS] * len(PROMPTS))]


REFERENCE = reference()


class SpeculativeMachine(RuleBasedStateMachine):
    backend_name = "cpu"  # tests/test_cuda_machines.py runs the same machine on cuda-fp32
    backend_options: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.patterns: list[int] = [0]
        self.calls = 0
        self.prompt_of: dict[str, int] = {}
        self.engine = build_engine("atlas-tiny", self.backend_name, CONFIG, loaded=TINY, sink=RecordingSink(),
                                   full_audit=True, drafter=ScriptedDrafter(self.script),
                                   backend_options=self.backend_options)
        self.out = Outputs(lambda rid: REFERENCE[self.prompt_of[rid]])
        self.data = DataReference(TINY, self.engine) if DataReference.applies(self.engine) else None

    def script(self, req: DraftRequest) -> list[int]:
        """The reference's next tokens, correct for a drawn count, then a wrong one."""
        ref = REFERENCE[self.prompt_of[req.request_id]]
        correct = self.patterns[self.calls % len(self.patterns)]
        self.calls += 1
        g = req.generated  # ref[:g] is sampled; the drafts propose ref[g:]
        drafts = list(ref[g : g + min(correct, req.k)])
        if len(drafts) < req.k:
            drafts.append((ref[len(drafts) + g] + 1) % 256 if len(drafts) + g < len(ref) else 7)
        return drafts

    @initialize(patterns=st.lists(st.integers(0, 4), min_size=1, max_size=6))
    def accept_patterns(self, patterns: list[int]) -> None:
        self.patterns = patterns

    @precondition(lambda self: len(self.prompt_of) < 6)
    @rule(prompt=st.integers(0, len(PROMPTS) - 1))
    def arrive(self, prompt: int) -> None:
        rid = f"r{len(self.prompt_of)}"
        self.prompt_of[rid] = prompt
        self.out.expect(rid)
        self.engine.add_request(rid, PROMPTS[prompt], PARAMS)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(self.engine.state.by_request)
        if live and data.draw(st.integers(0, 3)) == 0:  # rarely: most requests should run to the end
            rid = data.draw(st.sampled_from(live))
            self.out.touch(rid)
            self.engine.cancel(rid)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.out.collect(self.engine.step())

    @invariant()
    def control_and_data_plane_agree(self) -> None:
        check_cursors(self.engine, every=False)
        if self.data is not None:
            self.data.check(self.engine)

    def teardown(self) -> None:
        for _ in range(300):
            if not self.engine.has_unfinished():
                break
            self.step(1)
        assert not self.engine.has_unfinished() and self.engine.state.pool.used == 0
        assert set(self.out.finished) == set(self.prompt_of)
        for rid, reason in self.out.finished.items():
            if reason is not FinishReason.CANCELLED:
                assert reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, reason)
                assert tuple(self.out.tokens[rid]) == REFERENCE[self.prompt_of[rid]], rid


class RowBlindSpeculativeMachine(SpeculativeMachine):
    backend_options = {"per_row_qsa_verify": False}


SpeculativeMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=14, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
RowBlindSpeculativeMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=14, deadline=None,
                                                        suppress_health_check=[HealthCheck.too_slow])
TestSpeculativeMachine = SpeculativeMachine.TestCase
TestRowBlindSpeculativeMachine = RowBlindSpeculativeMachine.TestCase


def verifies(engine: Engine) -> list[tuple[int, int, tuple[int, ...], int]]:
    """(seq_id, computed at the verify, drafts, accepted) for every verify in the engine's trace."""
    out: list[tuple[int, int, tuple[int, ...], int]] = []
    computed: dict[int, int] = {}
    plan = None
    for _, _, e, _ in engine.sink.rows:  # type: ignore[union-attr]
        if isinstance(e, StepPlanned):
            plan = e
        elif isinstance(e, SequencePreempted):
            computed[e.seq_id] = 0
        elif isinstance(e, StepExecuted) and plan is not None:
            for i, (seq_id, fed) in enumerate(zip(plan.seqs, plan.fed, strict=True)):
                drafts = plan.drafts[i] if plan.drafts else ()
                if drafts:
                    out.append((seq_id, computed.get(seq_id, 0), drafts, e.accepted[i]))
                computed[seq_id] = computed.get(seq_id, 0) + fed + (max(e.accepted[i], 0) if drafts else 0)
    return out


def test_a_full_accept_and_a_full_reject_are_both_exercised() -> None:
    machine_like = SpeculativeMachine()
    machine_like.patterns = [0, 9, 1]
    machine_like.arrive(3)
    machine_like.arrive(2)
    machine_like.step(60)
    machine_like.teardown()
    seen = verifies(machine_like.engine)
    accepted = [a for *_, a in seen]
    assert 0 in accepted and 3 in accepted and 1 in accepted
    bound = TINY.spec.qsa.inert_bound
    # a verify whose rows straddle the inert bound: dense attention for the first, QSA selection after
    assert any(c + 1 <= bound < c + 1 + len(d) for _, c, d, _ in seen)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_the_real_drafters_give_the_tokens_of_speculation_off(drafter: str) -> None:
    config = EngineConfig(max_seq_len=40, max_batch_size=4, prefill_chunk_tokens=16, num_drafts=3, drafter=drafter)
    engine = build_engine("atlas-tiny", "cpu", config, loaded=TINY, sink=RecordingSink(), full_audit=True)
    results = generate(engine, PROMPTS, [PARAMS] * len(PROMPTS))
    assert [r.token_ids for r in results] == REFERENCE
    stats = engine.stats()
    assert stats.spec_verify_steps > 0 if drafter == "mtp" else stats.spec_verify_steps >= 0
    assert 1.0 <= stats.spec_tokens_per_verify <= 4.0 or stats.spec_verify_steps == 0
