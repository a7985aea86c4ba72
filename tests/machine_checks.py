"""The checks the hypothesis state machines share (test_engine_stateful, test_rollback_stateful, test_spec_machine,
test_prefix_machine and their CUDA subclasses), run after every rule:

- the control plane: every machine's invariants (`audit`);
- the data plane's cursors against the control plane (`check_cursors`);
- the outputs (`Outputs`): nothing after a finish, an `error` finish only where the rule injected one, and each
  request's tokens so far a prefix of a reference run's (un-speculated, un-cached, alone);
- the data itself (`DataReference`): beside the engine a CPU backend holds, for every running sequence, a fresh
  sequence fed the same tokens; the two states' digests (KV rows, QSA keys, GDN, PLE, the MTP drafter's pair keys)
  must be equal. Cursors, stamps and the audit miss an error that keeps every position right (a pair key built
  from the next position's hidden, a prefix snapshot holding a stale GDN state); this sees it at the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from atlas.backends.cpu import CpuBackend
from atlas.engine.outputs import FinishReason
from atlas.plan import SeqWork
from atlas.state.invariants import audit
from atlas.state.machines import Phase


def checkable(engine: Any) -> Iterable[Any]:
    """The running sequences whose data plane is where the control plane says: on the device, running, not
    released, no rollback restore queued for the next plan, some tokens computed."""
    state = engine.state
    pending = {r.seq_id for r in state.orders.rollbacks}
    backend = engine.backend
    has = getattr(backend, "has_sequence", None)
    for seq_id in state.running:
        seq = state.seqs[seq_id]
        if (seq.on_device and seq.cursor.phase is Phase.RUNNING and seq_id not in state.pending_release
                and seq_id not in pending and seq.cursor.computed and (has is None or has(seq_id))):
            yield seq


def check_cursors(engine: Any, *, every: bool = True, drafter: bool = False) -> None:
    """The control plane's invariants, then each checkable sequence's cursors: the KV rows (`every`: and QSA, GDN,
    PLE positions too), the drafter's rows (`drafter`)."""
    audit(engine.state, -1)
    for seq in checkable(engine):
        cur = engine.backend.cursors(seq.seq_id)
        n = seq.cursor.computed
        if every:
            assert (cur.kv_tokens, cur.qsa_ingested, cur.ssm_position, cur.ple_position) == (n, n, n, n), seq.seq_id
        else:
            assert cur.kv_tokens == n, seq.seq_id
        if drafter:
            assert cur.drafter_rows == seq.drafter.rows, seq.seq_id


class Outputs:
    """What each request streamed and how it finished, checked as it arrives: no output after a finish; `error`
    only for a request the rule marked (`inject`); the tokens so far a prefix of `reference(rid)`, and all of them
    at a `stop` or `length` finish (an injected request too: an error reported as `length` is short), unless the
    request was `touch`ed (rolled back or cancelled: no reference run has its tokens) or `reference(rid)` is None."""

    def __init__(self, reference: Callable[[str], list[int] | tuple[int, ...] | None] | None = None) -> None:
        self.reference = reference
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason | None] = {}
        self.injected: set[str] = set()  # rules that injected an error into these requests
        self.touched: set[str] = set()

    def expect(self, rid: str) -> None:
        self.tokens[rid] = []

    def inject(self, rid: str) -> None:
        self.injected.add(rid)

    def touch(self, rid: str) -> None:
        self.touched.add(rid)

    def collect(self, outputs: Iterable[Any]) -> None:
        for o in outputs:
            rid = o.request_id
            assert rid not in self.finished, f"{rid}: output after finish"
            self.tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[rid] = o.finish_reason
                if o.finish_reason is FinishReason.ERROR:
                    assert rid in self.injected, f"{rid} finished with error no rule injected: {o.finish_detail}"
                elif o.finish_reason is FinishReason.CANCELLED:
                    self.touched.add(rid)
            self._compare(rid, whole=o.finished and o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH))

    def _compare(self, rid: str, *, whole: bool) -> None:
        if self.reference is None or rid in self.touched:
            return
        want = self.reference(rid)
        if want is None:  # no reference run has this request's tokens
            return
        ref = list(want)
        got = self.tokens[rid]
        assert got == (ref if whole else ref[: len(got)]), (rid, got, ref)


class DataReference:
    """A CPU backend beside the engine: for every checkable sequence a fresh one fed the same tokens from 0 (with
    the same drafter first key), advanced incrementally as the engine's grows and refed when it diverges
    (a rollback, a preemption, a prefix hit), whose state digest must equal the engine's. Exact mode: a sequence's
    bits do not depend on how its tokens were chunked, verified or restored. CPU engines only (bitwise)."""

    def __init__(self, loaded: Any, engine: Any) -> None:
        caps = engine.capacities
        self.per_seq = -(-caps.max_seq_len // caps.block_size)
        self.slots = 2 * caps.max_batch_size + 2  # running ones, and those the control plane holds to release
        self.backend = CpuBackend(loaded, num_kv_blocks=self.per_seq * self.slots, block_size=caps.block_size,
                                  mtp_drafter=getattr(engine.backend, "drafter", None) is not None)
        self.held: dict[int, tuple[int, tuple[int, ...], int]] = {}  # engine seq_id -> (slot, tokens, first_key)

    @staticmethod
    def applies(engine: Any) -> bool:
        return isinstance(engine.backend, CpuBackend)

    def check(self, engine: Any) -> None:
        live = {seq.seq_id: seq for seq in checkable(engine)}
        for seq_id in [s for s in self.held if s not in live]:
            self.backend.release(self.held.pop(seq_id)[0])
        for seq_id, seq in live.items():
            slot = self._feed(seq_id, tuple(seq.cursor.tokens[: seq.cursor.computed]), seq.drafter.first_key)
            want, got = self.backend.store.state_digest(slot), engine.backend.store.state_digest(seq_id)
            assert got == want, (f"sequence {seq_id} at {seq.cursor.computed}: its data-plane state differs from a "
                                 "fresh sequence fed the same tokens")

    def _feed(self, seq_id: int, tokens: tuple[int, ...], first_key: int) -> int:
        used = {slot for slot, _, _ in self.held.values()}
        slot, fed, key = self.held.get(seq_id, (min(set(range(self.slots)) - used), (), first_key))
        if key != first_key or tokens[: len(fed)] != fed:
            fed = ()
        if len(tokens) > len(fed):
            table = tuple(range(slot * self.per_seq, (slot + 1) * self.per_seq))
            self.backend.forward_hidden([SeqWork(slot, tokens[len(fed):], len(fed), table, False,
                                                 drafter_first_key=first_key)])
        self.held[seq_id] = (slot, tokens, first_key)
        return slot


class AloneRuns:
    """The reference tokens of a request: run alone on the CPU backend, speculation off, no prefix cache, no ring
    (cached by prompt and parameters)."""

    def __init__(self, loaded: Any, max_seq_len: int) -> None:
        from atlas.config import EngineConfig
        from atlas.registry import build_engine

        self.engine = build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=max_seq_len, max_batch_size=1,
                                                                    prefill_chunk_tokens=16), loaded=loaded)
        self.runs: dict[tuple[Any, ...], list[int]] = {}

    def __call__(self, prompt: list[int], params: Any) -> list[int]:
        key = (tuple(prompt), params)
        if key not in self.runs:
            self.engine.add_request(f"a{len(self.runs)}", prompt, params)
            out: list[int] = []
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    out.extend(o.new_token_ids)
            self.runs[key] = out
        return self.runs[key]
