"""A hypothesis state machine over the engine on the CPU backend and atlas-tiny: arrivals (streaming or not,
prompts past the QSA inert bound of 19), steps (prefill, decode, boundary snapshots, preemption), rollbacks to
valid and invalid targets, cancellations. After every rule: every invariant (full audit after every event),
the backend's cursors and snapshot ring against the control plane, and (tests/machine_checks.py) every running
sequence's state against a fresh one fed the same tokens, each request's tokens so far against its run alone
(speculation and ring off; not for a request rolled back or cancelled) and no `error` finish. After every
rollback: the sequence is, to the bit, a fresh one fed the boundary's tokens. A decline or a refused target
changes nothing."""

from __future__ import annotations

import attrs
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_checks import AloneRuns, DataReference, Outputs, check_cursors
from store_views import ring_positions

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.runner import Chunk
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import RollbackDeclined, RolledBack
from atlas.state.machines import Phase

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
# 40 blocks of 4 for three sequences of up to 64 tokens: preemption happens, and clears the ring
CONFIG = EngineConfig(max_seq_len=64, max_batch_size=3, prefill_chunk_tokens=16, block_size=4, num_kv_blocks=40,
                      ring_slots=3, snapshot_interval=3, max_rollbacks=3, max_waiting=4)
ALONE = AloneRuns(TINY, CONFIG.max_seq_len)


def assert_never_took(engine: Engine, seq_id: int, tokens: list[int], boundary: int) -> None:
    backend = engine.backend
    with_drafter = getattr(backend, "drafter", None) is not None
    fresh = CpuBackend(TINY, num_kv_blocks=16, block_size=4, mtp_drafter=with_drafter)
    fresh.reset(seq_id)
    fresh.forward([Chunk(seq_id, tokens[:boundary], 0, tuple(range(16)))])
    rolled, reference = backend.store.seqs[seq_id], fresh.store.seqs[seq_id]  # type: ignore[attr-defined]
    assert backend.cursors(seq_id) == fresh.cursors(seq_id)
    for name in ("gdn_conv", "gdn_recurrent", "ple_conv", "qsa_keys"):
        for layer, t in getattr(reference, name).items():
            assert torch.equal(getattr(rolled, name)[layer], t), (name, layer)
    assert torch.equal(rolled.ple_context, reference.ple_context)
    if with_drafter:  # the MTP drafter's pair keys and the target hiddens it drafts from
        d, ref = backend.store.drafts[seq_id], fresh.store.drafts[seq_id]  # type: ignore[attr-defined]
        assert d.rows == ref.rows == max(0, boundary - 1)
        assert all(torch.equal(a, b) for a, b in zip(d.target_hidden, ref.target_hidden, strict=True))
        for layer in ref.kv.keys:
            n = ref.rows
            assert torch.equal(d.kv.keys[layer].flatten(0, 1)[:n], ref.kv.keys[layer].flatten(0, 1)[:n])
            assert torch.equal(d.kv.values[layer].flatten(0, 1)[:n], ref.kv.values[layer].flatten(0, 1)[:n])


class RollbackMachine(RuleBasedStateMachine):
    config = CONFIG
    backend_name = "cpu"  # tests/test_cuda_machines.py runs the same machine on cuda-fp32
    backend_options: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.engine = build_engine("atlas-tiny", self.backend_name, self.config, loaded=TINY, sink=RecordingSink(),
                                   full_audit=True, backend_options=self.backend_options)
        self.arrivals = 0
        self.rollbacks = 0
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.out = Outputs(self.alone)
        self.data = DataReference(TINY, self.engine) if DataReference.applies(self.engine) else None

    def alone(self, rid: str) -> list[int] | None:
        """The request's tokens run alone, ring and speculation off; None for a sampled request that verifies MTP
        drafts (rejection sampling keeps the distribution, not the draws)."""
        prompt, params = self.requests[rid]
        return ALONE(prompt, params) if params.temperature == 0 or not self.config.num_drafts else None

    def digest(self) -> str:
        return self.engine.state.digest()

    @initialize(long_prompt=st.lists(st.integers(0, 255), min_size=20, max_size=30),
                short_prompt=st.lists(st.integers(0, 255), min_size=1, max_size=8))
    def two_requests(self, long_prompt: list[int], short_prompt: list[int]) -> None:
        """One prompt past the QSA inert bound (selection active from its first decode), one short."""
        self.arrive(long_prompt, 30, False, 0.0)
        self.arrive(short_prompt, 30, False, 0.9)

    @precondition(lambda self: len(self.engine.state.waiting) < CONFIG.max_waiting)
    @rule(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=30), max_tokens=st.integers(1, 30),
          stream=st.booleans(), temperature=st.sampled_from([0.0, 0.9]))
    def arrive(self, prompt: list[int], max_tokens: int, stream: bool, temperature: float) -> None:
        params = SamplingParams(max_tokens=min(max_tokens, CONFIG.max_seq_len - len(prompt)),
                                temperature=temperature, seed=self.arrivals, ignore_eos=True)
        rid = f"r{self.arrivals}"
        self.engine.add_request(rid, prompt, params, stream=stream)
        self.requests[rid] = (prompt, params)
        self.out.expect(rid)
        self.arrivals += 1

    @rule(n=st.integers(1, 8))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.out.collect(self.engine.step())

    @precondition(lambda self: self.arrivals > 2)  # the opening requests live long enough to roll back
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(self.engine.state.by_request)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.out.touch(rid)
            self.engine.cancel(rid)

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        state = self.engine.state
        candidates = [s for s in state.running if state.seqs[s].cursor.generated >= 1 and state.seqs[s].on_device]
        if not candidates:
            return
        seq = state.seqs[data.draw(st.sampled_from(candidates))]
        c = seq.cursor
        # mostly a recent target (the ring holds the newest boundaries), sometimes anything, invalid included
        recent = st.integers(max(c.prompt_len + 1, c.seq_len - 9), c.seq_len - 1) if c.generated >= 2 else st.nothing()
        keep = data.draw(st.one_of(recent, recent, st.integers(c.prompt_len - 1, c.seq_len + 1)))
        tokens = list(c.tokens)
        before, events = self.digest(), len(self.engine.sink.rows)  # type: ignore[union-attr]
        if not c.prompt_len < keep < c.seq_len:
            try:
                self.engine.roll_back(seq.seq_id, keep, 0)
            except ValueError:
                assert self.digest() == before and len(self.engine.sink.rows) == events  # type: ignore[union-attr]
                return
            raise AssertionError(f"target {keep} outside ({c.prompt_len}, {c.seq_len}) was not refused")
        self.out.touch(seq.request_id)
        outcome = self.engine.roll_back(seq.seq_id, keep, 0)
        last = self.engine.sink.rows[-1]  # type: ignore[union-attr]
        if outcome == "rolled_back":
            e = last[2]
            assert isinstance(e, RolledBack) and c.tokens == tokens[:keep] and c.computed == e.boundary
            assert seq.banned[keep][-1] == tokens[keep]
            # the restore is the next plan's order: after that step (which re-feeds from the boundary) the data
            # plane is a fresh sequence fed the same tokens, to the bit
            self.out.collect(self.engine.step())
            live = state.seqs.get(seq.seq_id)
            if live is not None and live.on_device and live.cursor.computed >= e.boundary:
                self.assert_never_took(seq.seq_id, list(live.cursor.tokens), live.cursor.computed)
            self.rollbacks += 1
        else:
            assert isinstance(last[2], RollbackDeclined) and last[3] == before  # declined: nothing moved
            assert c.tokens == tokens
            self.engine.cancel(seq.request_id)

    def assert_never_took(self, seq_id: int, tokens: list[int], boundary: int) -> None:
        assert_never_took(self.engine, seq_id, tokens, boundary)

    @invariant()
    def every_machine_and_the_data_plane_agree(self) -> None:
        check_cursors(self.engine)
        if self.data is not None:
            self.data.check(self.engine)
        state = self.engine.state
        backend = self.engine.backend
        pending = {r.seq_id for r in state.orders.rollbacks}  # restored by the next plan
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            if not seq.on_device or seq.cursor.phase is not Phase.RUNNING or seq_id in pending:
                continue
            assert ring_positions(backend, seq_id) == {slot: pos for pos, slot in seq.ring.snapshots}
            if not seq.preemptions and not seq.rollbacks:
                # every boundary reached was snapshotted (a verify never steps over one); the newest R are kept
                c, interval = seq.cursor, self.config.snapshot_interval
                reached = list(range(c.prompt_len, c.computed + 1, interval))
                assert [p for p, _ in seq.ring.snapshots] == reached[-self.config.ring_slots:]


class SpeculativeRollbackMachine(RollbackMachine):
    """The same, with speculative decoding on (the MTP drafter, two drafts per verify): verifies interleave
    with snapshots (a step due for a boundary is a plain decode; boundaries every 6 positions leave room for
    verifies between them) and rollbacks rewind the drafter rows too."""

    config = attrs.evolve(CONFIG, num_drafts=2, drafter="mtp", snapshot_interval=6, verify_costs=())


RollbackMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
SpeculativeRollbackMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                                        suppress_health_check=[HealthCheck.too_slow])
TestRollbackMachine = RollbackMachine.TestCase
TestSpeculativeRollbackMachine = SpeculativeRollbackMachine.TestCase
