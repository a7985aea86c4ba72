"""A hypothesis state machine drives the real engine (null backend) with arrivals, cancellations, steps and
injected step errors, and checks after every rule (tests/machine_checks.py): every machine's invariants (full
audit), the backend's cursors against the control plane, each request's tokens so far a prefix of what it
produces alone (all of them once it finishes), and no `error` finish but where the rule injected one."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from machine_checks import Outputs, check_cursors

from atlas.backends.null import ByteTokenizer, NullBackend
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.sampling.params import SamplingParams

CONFIG = EngineConfig(max_seq_len=32, max_batch_size=3, prefill_chunk_tokens=6, block_size=4, num_kv_blocks=10,
                      max_waiting=6)


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine(NullBackend(eos_rate=25), tokenizer=ByteTokenizer(),
                    config=EngineConfig(max_seq_len=32, max_batch_size=1, prefill_chunk_tokens=32))
    engine.add_request("x", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
    return tokens


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(NullBackend(eos_rate=25), tokenizer=ByteTokenizer(), config=CONFIG,
                             sink=RecordingSink(), full_audit=True)
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.alone: dict[str, list[int]] = {}
        self.out = Outputs(self.reference)

    def reference(self, rid: str) -> list[int]:
        if rid not in self.alone:
            self.alone[rid] = alone(*self.requests[rid])
        return self.alone[rid]

    @precondition(lambda self: len(self.engine.state.waiting) < CONFIG.max_waiting)
    @rule(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20), max_tokens=st.integers(1, 12),
          temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2))
    def arrive(self, prompt: list[int], max_tokens: int, temperature: float, seed: int) -> None:
        max_tokens = min(max_tokens, CONFIG.max_seq_len - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        rid = f"r{len(self.requests)}"
        self.engine.add_request(rid, prompt, params)
        self.requests[rid] = (prompt, params)
        self.out.expect(rid)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(self.engine.state.by_request)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.out.touch(rid)
            self.engine.cancel(rid)

    @rule(data=st.data())
    def step_error(self, data: st.DataObject) -> None:
        live = sorted(self.engine.state.by_request)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.out.inject(rid)
            self.engine.inject_fault("step_error", rid)

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.out.collect(self.engine.step())

    @invariant()
    def control_and_data_plane_agree(self) -> None:
        check_cursors(self.engine, every=False)

    def teardown(self) -> None:
        for _ in range(500):
            if not self.engine.has_unfinished():
                break
            self.step(1)
        assert not self.engine.has_unfinished()
        assert self.engine.state.pool.used == 0 and self.engine.backend.live_sequences() == []
        assert set(self.out.finished) == set(self.requests)


EngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestEngineMachine = EngineMachine.TestCase
