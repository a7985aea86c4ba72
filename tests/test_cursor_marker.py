"""BackendCursors.uniform(), the marker that lets the engine's cursor check take a healthy sequence in three
comparisons: it is computed from the stamps (never passed in), it cannot outlive the stamps it was computed from,
and whenever the stamps disagree with the control plane the check still names the first wrong stamp exactly as
the walk over every stamp does (step, sequence, layer, state kind, both positions)."""

from __future__ import annotations

import attrs
import pytest
from test_cuda_features import CPU_PATH, TINY

from atlas.config import EngineConfig
from atlas.engine.outcome import cursor_violation
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation
from atlas.plan import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

NAMES = (("kv", 3), ("qsa", 3), ("kv", 7), ("qsa", 7), ("conv", 0), ("gdn", 0), ("conv", 1), ("gdn", 1), ("ple", -1), ("ple_conv", 0))


def healthy(n: int, drafter: int | None = None) -> BackendCursors:
    stamps = tuple((kind, layer, n) for kind, layer in NAMES)
    if drafter is not None:
        stamps += (("drafter", -1, drafter),)
    return BackendCursors(n, n, n, n, drafter or 0, stamps)


def damaged(cur: BackendCursors, at: int, position: int) -> tuple[tuple[str, int, int], ...]:
    stamps = list(cur.stamps)
    kind, layer, _ = stamps[at]
    stamps[at] = (kind, layer, position)
    return tuple(stamps)


class _Seq:  # the control plane's view of one sequence, as cursor_violation reads it
    def __init__(self, n: int, qsa: int, rows: int) -> None:
        self.cursor = attrs.make_class("C", ["computed"])(n)
        self.qsa = attrs.make_class("Q", ["ingested"])(qsa)
        self.drafter = attrs.make_class("D", ["rows"])(rows)


class _State:
    def __init__(self, **seqs: _Seq) -> None:
        self.seqs = {int(k[1:]): v for k, v in seqs.items()}
        self.failing: set[int] = set()


def check(cur: BackendCursors, n: int, qsa: int | None = None, rows: int = 0, seq_id: int = 0
          ) -> InvariantViolation | None:
    state = _State(**{f"s{seq_id}": _Seq(n, n if qsa is None else qsa, rows)})
    result = StepResult(7, (SeqOutcome(seq_id, cur, token=1),))
    return cursor_violation(state, StepPlan(7, ()), result, 0)  # type: ignore[arg-type]


def walked(cur: BackendCursors, n: int, qsa: int, rows: int) -> tuple[str, int, int, int] | None:
    """What the walk over every stamp reports first: (state, layer, data plane, control plane)."""
    for kind, layer, at in cur.stamps:
        expected = rows if kind == "drafter" else qsa if kind == "qsa" else n
        if at != expected:
            return kind, layer, at, expected
    return None


def named(v: InvariantViolation | None) -> tuple[str, int, int, int] | None:
    if v is None:
        return None
    f = v.fields
    assert v.machine == "BackendCursors" and f["step"] == 7 and f["seq_id"] == 0, v
    return f["state"], f["layer"], f["data_plane"], f["control_plane"]


def test_the_marker_is_each_class_one_position_computed_from_the_stamps() -> None:
    assert healthy(5).uniform() == (5, 5, None)
    assert healthy(5, drafter=3).uniform() == (5, 5, 3)
    qsa_apart = BackendCursors(5, 4, 5, 5, 0, tuple((k, layer, 4 if k == "qsa" else 5) for k, layer in NAMES))
    assert qsa_apart.uniform() == (5, 4, None)
    assert BackendCursors(0, 0, 0, 0).uniform() == (None, None, None)
    for i in range(len(NAMES)):  # any one stamp off its class's position (each class holds two or more): none
        cur = healthy(5, drafter=3)
        cur.stamps = damaged(cur, i, 6)
        assert cur.uniform() is None
    two_drafters = BackendCursors(5, 5, 5, 5, 3, healthy(5).stamps + (("drafter", -1, 3), ("drafter", -1, 2)))
    assert two_drafters.uniform() is None


def test_the_check_uses_only_a_marker_computed_for_these_very_stamps() -> None:
    cur = healthy(5)
    assert cur.uniform(compute=False) is None and check(cur, 5) is None  # not computed: walked, nothing computed
    assert cur.uniform(compute=False) is None
    assert cur.uniform() == (5, 5, None) and cur.uniform(compute=False) == (5, 5, None)
    cur.stamps = tuple(cur.stamps)[:-1] + (("ple_conv", 0, 5),)  # equal values, another tuple: not this memo's
    assert cur.uniform(compute=False) is None


def test_the_marker_is_no_argument_and_no_part_of_the_value() -> None:
    with pytest.raises(TypeError):
        BackendCursors(5, 5, 5, 5, 0, healthy(5).stamps, (healthy(5).stamps, (5, 5, None)))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        BackendCursors(5, 5, 5, 5, 0, (), _uniform=((), (5, 5, None)))  # type: ignore[call-arg]
    a, b = healthy(5), healthy(5)
    a.uniform()
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert a.summary() == {"kv_tokens": 5, "qsa_ingested": 5, "ssm_position": 5, "ple_position": 5, "drafter_rows": 0}


@pytest.mark.parametrize("at", range(len(NAMES) + 1))
@pytest.mark.parametrize("how", ["built", "replaced", "evolved"])
def test_disagreeing_stamps_cannot_carry_a_marker_that_hides_them(at: int, how: str) -> None:
    """One stamp off (a hand-built BackendCursors; a marked one whose stamps are then replaced; one evolved from a
    marked one): the check names exactly that layer and both positions, as the full walk does."""
    marked = healthy(9, drafter=4)
    assert marked.uniform() == (9, 9, 4) and check(marked, 9, rows=4) is None  # the memo is set
    wrong = damaged(marked, at, 8 if at < len(NAMES) else 5)
    if how == "built":
        cur = BackendCursors(9, 9, 9, 9, 4, wrong)
    elif how == "replaced":
        cur = marked
        cur.stamps = wrong
    else:
        cur = attrs.evolve(marked, stamps=wrong)
    kind, layer = NAMES[at] if at < len(NAMES) else ("drafter", -1)
    want = (kind, layer, 8 if at < len(NAMES) else 5, 9 if at < len(NAMES) else 4)
    assert walked(cur, 9, 9, 4) == want
    assert named(check(cur, 9, rows=4)) == want


def test_a_uniform_marker_at_the_wrong_position_reports_the_first_stamp() -> None:
    """Every stamp one position ahead (a marker that exists but disagrees): the walk's first stamp is named."""
    cur = healthy(10, drafter=2)
    assert cur.uniform() == (10, 10, 2)
    assert named(check(cur, 9, rows=2)) == ("kv", 3, 10, 9)
    assert named(check(cur, 10, qsa=11, rows=2)) == ("qsa", 3, 10, 11)
    assert named(check(cur, 10, rows=1)) == ("drafter", -1, 2, 1)
    assert check(cur, 10, rows=2) is None


def test_the_summary_fields_are_still_checked_beside_a_marker() -> None:
    cur = BackendCursors(9, 9, 8, 9, 0, healthy(9).stamps)  # stamps right, a summary field wrong
    v = check(cur, 9)
    assert v is not None and v.fields["backend"]["ssm_position"] == 8 and "layer" not in v.fields


@pytest.mark.parametrize("state", ["gdn", "conv", "ple", "kv"])
def test_the_cuda_reader_shares_marked_cursors_and_a_damaged_stamp_is_named(state: str) -> None:
    """Through the CUDA backend's reader (CPU path): two healthy sequences at one position share one marked
    BackendCursors; one layer's stamp of one of them damaged before the step's read is named by the engine's check
    at that step, with its layer and both positions."""
    config = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32)
    engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=TINY, sink=RecordingSink(), backend_options=CPU_PATH)
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    store, pools = engine.backend.store, engine.backend.pools  # type: ignore[attr-defined]
    seq_a, seq_b = sorted(store.seqs)
    got = store.read_cursors([seq_a, seq_b])
    assert got[seq_a] is got[seq_b] and got[seq_a].uniform(compute=False) is not None  # shared, marked by the reader
    read, step = store.read_cursors, engine.state.step
    if state == "kv":
        kind, layer = pools.paged_kinds[0]
    else:
        j = next(j for j, n in enumerate(pools.names) if pools.kinds[n][0] == state)
        kind, layer = pools.kinds[pools.names[j]]

    early, damaged = store.prefetch, []

    def damage() -> None:  # after the step wrote its stamps, before its read starts: one layer of sequence b, once
        if damaged:
            return
        damaged.append(True)
        s = store.seqs[seq_b]
        if state == "kv":  # its last KV position's stamp cleared: the leading run ends one short
            view = pools.paged_pos.view(len(pools.paged_kinds), -1)
            p = s.position - 1
            view[0, s.table[p // pools.block_size] * pools.block_size + p % pools.block_size] = -1
        else:
            pools.stamps[j, s.slot] += 1

    def damaging_early(seq_ids):  # a plain step starts its read behind the forward (CudaStateStore.prefetch)
        damage()
        return early(seq_ids)

    def damaging(seq_ids):
        damage()
        return read(seq_ids)

    early_held, read_held = store.prefetch_held, store.read_held

    def damaging_early_held(key, states):  # the same, as the steady decode step starts it (the states in hand)
        damage()
        return early_held(key, states)

    def damaging_held(key, live, states):
        damage()
        return read_held(key, live, states)

    store.prefetch = damaging_early
    store.read_cursors = damaging
    store.prefetch_held, store.read_held = damaging_early_held, damaging_held
    with pytest.raises(InvariantViolation):
        engine.step()
    v = engine.cause_of_death
    assert isinstance(v, InvariantViolation) and v.machine == "BackendCursors", v
    f = v.fields
    n = f["control_plane"]
    assert (f["step"], f["seq_id"], f["state"], f["layer"]) == (step, seq_b, kind, layer), f
    assert f["data_plane"] == (n - 1 if state == "kv" else n + 1), f
