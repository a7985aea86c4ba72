"""A hypothesis state machine over the CPU engine with prefix caching, the drafter carry, MTP speculation and
the rollback ring all on: chat turns arrive (extending a session's last finished turn, its boundary sometimes
re-tokenised, or unrelated), steps run, requests are cancelled, sequences are rolled back. After every rule:
the full audit and the data plane's cursors (KV, QSA, GDN, PLE, drafter rows, ring) against the control plane,
and (tests/machine_checks.py) every running sequence's state, the drafter's pair keys included, against a fresh
sequence fed the same tokens; every turn that was neither rolled back nor cancelled streams a cold run's tokens
(all of them once it finishes); no `error` finish. At the end: no block leaks."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_checks import AloneRuns, DataReference, Outputs, check_cursors
from store_views import drafter_first_key, ring_positions

from atlas.config import EngineConfig
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import PrefixCacheHit, RollbackDeclined, RolledBack
from atlas.state.invariants import audit
from atlas.state.machines import Phase

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
CONFIG = EngineConfig(max_seq_len=64, max_batch_size=3, prefill_chunk_tokens=16, block_size=4, num_kv_blocks=40,
                      ring_slots=3, snapshot_interval=3, max_rollbacks=3, max_waiting=4, enable_prefix_caching=True,
                      prefix_snapshots=5, num_drafts=2, drafter="mtp", verify_costs=())
ALONE = AloneRuns(TINY, CONFIG.max_seq_len)


def cold_tokens(prompt: list[int], n: int) -> list[int]:
    return ALONE(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


class PrefixMachine(RuleBasedStateMachine):
    backend_name = "cpu"  # tests/test_cuda_machines.py runs the same machine on cuda-fp32
    backend_options: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.engine = build_engine("atlas-tiny", self.backend_name, CONFIG, loaded=TINY, sink=RecordingSink(),
                                   full_audit=True, backend_options=self.backend_options)
        self.sessions: list[list[int]] = [list(range(20, 38)), list(range(60, 72))]  # last finished turn's tokens
        self.requests: dict[str, tuple[int, list[int], int]] = {}  # rid -> (session, prompt, max_tokens)
        # rolled back or cancelled requests are `touch`ed: their tokens are not a cold run's
        self.out = Outputs(lambda rid: cold_tokens(*self.requests[rid][1:]))
        self.data = DataReference(TINY, self.engine) if DataReference.applies(self.engine) else None

    def collect(self, outputs) -> None:
        outputs = list(outputs)
        self.out.collect(outputs)
        for o in outputs:
            if o.finished:
                session, prompt, _ = self.requests[o.request_id]
                if session >= 0 and o.finish_reason is FinishReason.LENGTH:
                    self.sessions[session] = prompt + self.out.tokens[o.request_id]

    @initialize(n=st.integers(4, 10), drop=st.integers(0, 3), alter=st.booleans())
    def first_turns(self, n: int, drop: int, alter: bool) -> None:
        """Both sessions' first turns, finished (the cache and the carry hold something from the start), and a
        warm second turn of the first session arrived: the carry is that session's cold turn, so the second turn
        adopts its rows (up to where its prompt, cut by `drop` and its last token `alter`ed, agrees)."""
        for session in (1, 0):
            self.turn(session, 0, False, [5], n)
            self.steps(60)
        self.turn(0, drop, alter, [7, 7], 16)

    @precondition(lambda self: len(self.engine.state.waiting) < CONFIG.max_waiting)
    @rule(session=st.integers(-1, 1), drop=st.integers(0, 3), alter=st.booleans(),
          user=st.lists(st.integers(3, 250), min_size=1, max_size=6), max_tokens=st.integers(4, 16))
    def turn(self, session: int, drop: int, alter: bool, user: list[int], max_tokens: int) -> None:
        """A session's next turn (-1: an unrelated prompt)."""
        base = list(self.sessions[session]) if session >= 0 else [251, 252]
        base = base[: len(base) - drop]
        if alter and base:
            base[-1] = (base[-1] + 1) % 250 + 3
        prompt = base + user
        if len(prompt) + max_tokens > CONFIG.max_seq_len:  # the session is full: it starts over
            prompt = base[:6] + user
        rid = f"r{len(self.requests)}"
        self.requests[rid] = (session, prompt, max_tokens)
        self.out.expect(rid)
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    @rule(n=st.integers(1, 2))
    def steps(self, n: int) -> None:
        for _ in range(n):
            if not self.engine.has_unfinished():
                return
            self.collect(self.engine.step())

    @precondition(lambda self: len(self.engine.state.by_request) >= 2)  # never the last one: turns get to run
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
        candidates = [s for s in state.running if state.seqs[s].cursor.generated >= 2 and state.seqs[s].on_device]
        if not candidates:
            return
        seq = state.seqs[data.draw(st.sampled_from(candidates))]
        c = seq.cursor
        keep = data.draw(st.integers(max(c.prompt_len + 1, c.seq_len - 6), c.seq_len - 1))
        rid = seq.request_id
        self.out.touch(rid)
        outcome = self.engine.roll_back(seq.seq_id, keep, 0)
        if outcome != "rolled_back":
            self.engine.cancel(rid)
        else:
            assert isinstance(self.engine.sink.rows[-1][2], RolledBack)  # type: ignore[union-attr]

    @invariant()
    def every_machine_and_the_data_plane_agree(self) -> None:
        check_cursors(self.engine, drafter=True)
        if self.data is not None:
            self.data.check(self.engine)
        state = self.engine.state
        backend = self.engine.backend
        pending = {r.seq_id for r in state.orders.rollbacks}  # restored by the next plan
        for seq_id in state.running:
            seq = state.seqs[seq_id]
            if (not seq.on_device or seq.cursor.phase is not Phase.RUNNING or not backend.has_sequence(seq_id)  # type: ignore[attr-defined]
                    or seq_id in pending or seq.cursor.computed == 0):
                continue
            assert drafter_first_key(backend, seq_id) == seq.drafter.first_key
            assert ring_positions(backend, seq_id) == {slot: pos for pos, slot in seq.ring.snapshots}

    def teardown(self) -> None:
        while self.engine.has_unfinished():
            self.collect(self.engine.step())
        pool = self.engine.state.pool
        audit(self.engine.state, -1)
        assert pool.used == 0 and len(pool.free) == pool.total and not any(pool.refs)
        # what the run exercised (pytest --hypothesis-show-statistics)
        rows = [e for _, _, e, _ in self.engine.sink.rows]  # type: ignore[union-attr]
        hit = {e.seq_id for e in rows if isinstance(e, PrefixCacheHit)}
        event(f"prefix hits: {min(3, sum(isinstance(e, PrefixCacheHit) for e in rows))}+")
        event(f"rollbacks: {min(2, sum(isinstance(e, RolledBack) for e in rows))}+")
        event(f"declines: {min(2, sum(isinstance(e, RollbackDeclined) for e in rows))}+")
        event(f"rolled back after a hit: {any(isinstance(e, RolledBack) and e.seq_id in hit for e in rows)}")
        for rid, (_session, prompt, n) in self.requests.items():
            if rid not in self.out.touched and self.out.finished.get(rid) is FinishReason.LENGTH:
                assert self.out.tokens[rid] == cold_tokens(prompt, n), rid


PrefixMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestPrefixMachine = PrefixMachine.TestCase
