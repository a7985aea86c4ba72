"""The batched control-plane paths decide exactly what the per-sequence ones do.

`holds` (check_invariants' one-expression test) must pass exactly the sequences check_sequence passes;
StepExecuted's batched advance must refuse what Sequence.check_advance refuses (same machine, message,
fields) and leave the same state (digest) when it commits; the inline fingerprint must equal the
specified one (two mix64 rounds over the fields)."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import InvariantViolation, TransitionRefused
from atlas.hashing import mix64
from atlas.sampling.params import SamplingParams
from atlas.state import events as ev
from atlas.state.control import ControlState, common_fingerprint, sequence_fingerprint
from atlas.state.invariants import check_sequence, holds
from atlas.state.machines import DrafterCarry, Phase, QsaCursor, Sequence, SequenceCursor, SsmRing

CAPS = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=4, prefill_chunk_tokens=16,
                                      block_size=8, num_kv_blocks=24))


def _reference_fingerprint(seq: Sequence) -> int:
    """The fingerprint as specified (before mix64 was written out inline)."""
    c = seq.cursor
    h = mix64(c.token_hash ^ (seq.seq_id * 0x9E3779B97F4A7C15))
    h += (len(c.tokens) * 0xC2B2AE3D27D4EB4F + c.computed * 0x165667B19E3779F9 + c.phase * 0xD6E8FEB86659FD93
          + len(seq.blocks) * 0xFF51AFD7ED558CCD + seq.qsa.ingested * 0xC4CEB9FE1A85EC53
          + seq.drafter.rows * 0x27D4EB2F165667C5 + len(seq.ring.snapshots) * 0x94D049BB133111EB
          + seq.preemptions * 0xBF58476D1CE4E5B9 + seq.drafter.latched * 0x2545F4914F6CDD1D)
    if seq.ring.snapshots or seq.rollbacks:
        last, slot = seq.ring.snapshots[-1] if seq.ring.snapshots else (-1, -1)
        h = mix64(h ^ (last * 0x9E3779B97F4A7C15 + slot * 0xC2B2AE3D27D4EB4F + seq.rollbacks * 0x165667B19E3779F9))
    return mix64(h)


small = st.integers(-2, 12)


@st.composite
def sequences(draw: st.DrawFn) -> Sequence:
    prompt_len = draw(st.integers(1, 6))
    n = draw(st.integers(prompt_len - 1, prompt_len + 6))
    slots = draw(st.integers(0, 3))
    snaps = draw(st.lists(st.tuples(small, st.integers(-1, 3)), max_size=4))
    seq = Sequence(
        seq_id=draw(st.integers(0, 5)), request_id="r", arrival_step=0, params=SamplingParams(),
        max_new=draw(st.integers(0, 6)),
        cursor=SequenceCursor(tokens=list(range(max(n, 0))), prompt_len=prompt_len, computed=draw(small),
                              phase=draw(st.sampled_from(list(Phase))), token_hash=draw(st.integers(0, 2**64 - 1))),
        qsa=QsaCursor(capacity=draw(st.integers(0, 14)), ratio=1, ingested=draw(small)),
        ring=SsmRing(slots=slots, snapshots=snaps),
        drafter=DrafterCarry(rows=draw(st.integers(0, 6)), last_pair_key=draw(small), carried=draw(st.booleans()),
                             mtp=draw(st.booleans()), latched=draw(st.booleans()), first_key=draw(small)),
        blocks=list(range(draw(st.integers(0, 4)))), on_device=draw(st.booleans()),
        preemptions=draw(st.integers(0, 2)), rollbacks=draw(st.integers(0, 2)),
    )
    return seq


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=sequences(), block_size=st.sampled_from([1, 2, 4]), drafts=st.integers(0, 3))
def test_holds_passes_exactly_what_check_sequence_passes(seq: Sequence, block_size: int, drafts: int) -> None:
    try:
        check_sequence(seq, block_size, 0, drafts)
        passes = True
    except InvariantViolation:
        passes = False
    assert holds(seq, block_size, drafts) == passes


@settings(max_examples=500, deadline=None)
@given(seq=sequences())
def test_the_inline_fingerprint_is_the_specified_one(seq: Sequence) -> None:
    assert sequence_fingerprint(seq) == _reference_fingerprint(seq)
    c, d = seq.cursor, seq.drafter
    if not seq.ring.snapshots and not seq.rollbacks and not d.rows and c.computed == seq.qsa.ingested:
        # the hot paths' form for such a sequence (the advance's common case)
        assert common_fingerprint(c.token_hash, seq.seq_id, len(c.tokens), c.computed, c.phase, len(seq.blocks),
                                  seq.preemptions, d.latched) == _reference_fingerprint(seq)


def _running(prompts: list[int], max_new: list[int], full: list[bool], blocks: int = 2) -> ControlState:
    """A state with one running sequence per prompt length: prefilled but for its last prompt token, or
    (`full`) wholly, with one token sampled; `blocks` each."""
    state = ControlState.create(CAPS)
    ids = []
    for i, n in enumerate(prompts):
        ids.append(state.next_seq_id)
        state.apply(ev.RequestArrived(f"r{i}", state.next_seq_id, list(range(1, n + 1)),
                                      SamplingParams(max_tokens=max_new[i]).to_json(), max_new[i]))
    alloc = tuple((s, *range(blocks * i, blocks * (i + 1))) for i, s in enumerate(ids))
    fed = tuple(n if f else n - 1 for n, f in zip(prompts, full, strict=True))
    state.apply(ev.StepPlanned(0, tuple(ids), tuple(ids), fed, alloc, (), ()))
    state.apply(ev.StepExecuted(0, tuple(5 if f else -1 for f in full)))
    return state


def _per_sequence(state: ControlState, fed: tuple[int, ...], tokens: tuple[int, ...]) -> None:
    """StepExecuted as it was written before the batched pass: check every sequence, then commit each."""
    plan = state.inflight
    assert plan is not None
    work = []
    for seq_id, n, token in zip(plan.seqs, fed, tokens, strict=True):
        seq = state.seq(seq_id) if seq_id in state.seqs else None
        if seq is None:
            raise TransitionRefused("Request", "token for a sequence that is not live", seq_id=seq_id)
        seq.check_advance(n, token, CAPS.block_size)
        work.append((seq, n, token))
    for seq, n, token in work:
        seq.commit_advance(n, token)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(2, 4), min_size=1, max_size=4), data=st.data())
def test_the_batched_advance_refuses_and_commits_as_the_per_sequence_one(prompts: list[int],
                                                                        data: st.DataObject) -> None:
    k = len(prompts)
    state = _running(prompts, data.draw(st.lists(st.integers(1, 2), min_size=k, max_size=k)),
                     data.draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    fed = tuple(data.draw(st.lists(st.integers(-1, 3), min_size=k, max_size=k)))
    tokens = tuple(data.draw(st.lists(st.integers(-1, 9), min_size=k, max_size=k)))
    seqs = tuple(state.running)
    planned = ev.StepPlanned(1, (), seqs, fed, (), (), ())
    state.inflight, state.step = planned, 2  # planned as given, unchecked: the advance must catch what is wrong
    reference = copy.deepcopy(state)
    try:
        _per_sequence(reference, fed, tokens)
        expected: tuple | None = None
    except TransitionRefused as exc:
        expected = (exc.machine, exc.why, exc.fields)
    try:
        state.apply(ev.StepExecuted(1, tokens))
        got: tuple | None = None
    except TransitionRefused as exc:
        got = (exc.machine, exc.why, exc.fields)
    assert got == expected
    if expected is None:  # committed: every sequence's fields (and so its fingerprint) as the reference has them
        for seq_id in seqs:
            a, b = state.seqs[seq_id], reference.seqs[seq_id]
            assert (a.cursor.tokens, a.cursor.computed, a.cursor.token_hash, a.qsa.ingested) == (
                b.cursor.tokens, b.cursor.computed, b.cursor.token_hash, b.qsa.ingested)
            assert a.fingerprint == sequence_fingerprint(b)
        assert state.inflight is None and state.inflight_hash == 0


def _corrupt(seq: Sequence, how: int, amount: int) -> None:
    """Break one field the advance itself does not look at (or does: then it refuses, and the test skips)."""
    if how == 0:
        seq.blocks.extend(range(100, 100 + amount))  # blocks past the tokens
    elif how == 1:
        seq.cursor.prompt_len += amount
    elif how == 2:
        seq.max_new = max(0, seq.max_new - amount)
    elif how == 3:
        seq.drafter.hold(0, amount)  # drafter rows running ahead of the fed tokens
    elif how == 4:
        seq.ring.slots = 1
        seq.ring.snapshots.append((amount, 0))  # a snapshot past (or at) the computed tokens
    elif how == 5:
        seq.drafter.carried = True
    elif how == 6:
        seq.qsa.capacity = amount


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(2, 4), min_size=1, max_size=4), data=st.data())
def test_the_batched_advance_names_the_violation_the_per_sequence_walk_names(prompts: list[int],
                                                                             data: st.DataObject) -> None:
    """StepExecuted's commit pass runs check_invariants' per-sequence test itself (Checked): a broken invariant
    after it is the one check_sequence names walking the touched sequences in order (machine, message, fields)."""
    from atlas.state.control import Checked
    from atlas.state.invariants import check_invariants

    k = len(prompts)
    state = _running(prompts, [3] * k, [True] * k, blocks=1)  # every invariant holds before the corruption
    seqs = tuple(state.running)
    broken = data.draw(st.lists(st.sampled_from(seqs), max_size=3))
    for seq_id in broken:
        _corrupt(state.seqs[seq_id], data.draw(st.integers(0, 6)), data.draw(st.integers(0, 8)))
    planned = ev.StepPlanned(1, (), seqs, (1,) * k, (), (), ())
    state.inflight, state.step = planned, 2
    try:
        touched = state.apply(ev.StepExecuted(1, (7,) * k))
    except TransitionRefused:
        return  # the advance's own checks caught it first
    assert type(touched) is Checked
    expected = None
    for seq_id in touched:  # the walk check_invariants did before the batched pass
        try:
            check_sequence(state.seqs[seq_id], CAPS.block_size, 7, 0)
        except InvariantViolation as exc:
            expected = (exc.machine, exc.message, exc.fields)
            break
    try:
        check_invariants(state, touched, 7)
        got = None
    except InvariantViolation as exc:
        got = (exc.machine, exc.message, exc.fields)
    assert got == expected
    if not broken:  # nothing corrupted: every sequence passes the batched test itself
        assert touched.suspects == [] and got is None
    assert set(touched.suspects) >= {s for s in touched if not holds(state.seqs[s], CAPS.block_size, 0)}


def test_a_block_past_the_tokens_after_a_batched_advance_is_named() -> None:
    from atlas.state.invariants import check_invariants

    state = _running([3, 4], [3, 3], [True, True], blocks=1)
    a, b = state.running
    state.seqs[b].blocks.extend([100, 101])  # two blocks past its 5 tokens (block size 8)
    state.inflight, state.step = ev.StepPlanned(1, (), (a, b), (1, 1), (), (), ()), 2
    touched = state.apply(ev.StepExecuted(1, (7, 7)))
    assert list(touched.suspects) == [b]
    try:
        check_invariants(state, touched, 9)
    except InvariantViolation as exc:
        assert (exc.event_index, exc.machine, exc.message) == (9, "BlockPool", "no block beyond the sequence's tokens")
        assert exc.fields["seq_id"] == b and exc.fields["blocks"] == 3
    else:
        raise AssertionError("the extra blocks were not named")


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**20), st.integers(0, 2**20),
                               st.integers(0, 2**20), st.integers(0, 2**10)), min_size=1, max_size=70))
def test_the_column_fingerprint_is_the_scalar_one(rows: list[tuple[int, int, int, int, int]]) -> None:
    """running_fingerprints (numpy uint64 columns) equals sequence_fingerprint on each running sequence."""
    from atlas.state.control import running_fingerprints

    seqs = []
    for token_hash, seq_id, n, computed, blocks in rows:
        seqs.append(Sequence(seq_id=seq_id, request_id="r", arrival_step=0, params=SamplingParams(), max_new=0,
                             cursor=SequenceCursor(tokens=[0] * n, prompt_len=0, computed=computed,
                                                   phase=Phase.RUNNING, token_hash=token_hash),
                             qsa=QsaCursor(capacity=0, ratio=1, ingested=computed), ring=SsmRing(slots=0),
                             drafter=DrafterCarry(), blocks=[0] * blocks))
    got = running_fingerprints(*(list(col) for col in zip(*rows, strict=True)))
    assert got == [sequence_fingerprint(s) for s in seqs]
    assert all(type(fp) is int for fp in got)


def test_the_batched_advance_fingerprints_columns_as_the_scalar_form(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Above VECTOR_MIN sequences the common ones go through running_fingerprints: the digest is the same."""
    from atlas.state import steps

    def advanced(vector_min: int) -> tuple[str, list[int]]:
        monkeypatch.setattr(steps, "VECTOR_MIN", vector_min)
        state = _running([2, 3, 4, 3], [3] * 4, [True] * 4, blocks=1)
        state.seqs[state.running[1]].preemptions = 1  # one scalar among the columns
        seqs = tuple(state.running)
        state.inflight, state.step = ev.StepPlanned(1, (), seqs, (1,) * 4, (), (), ()), 2
        state.apply(ev.StepExecuted(1, (7, 8, 9, 10)))
        return state.digest(), [state.seqs[s].fingerprint for s in seqs]

    columns, scalar = advanced(1), advanced(10**9)
    assert columns == scalar
