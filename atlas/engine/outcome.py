"""The fold of a step's result into events, and the checks of what the data plane reports. Pure functions:
no model, no backend; tests give them a plan and a hand-made StepResult.

    events = outcome(state, plan, result, vocab_size)      # StepExecuted, BoundarySnapshotted
    journal.apply_all(events)
    journal.check(cursor_violation(state, plan, result))   # every data-plane cursor == the control plane's

A verify's commit is the backend's (it applies the shared verdict functions in the same execute); the
engine checks the count it reports against its verdicts. A commit the backend refused (accepted -1), or
verdicts that cannot be committed exactly, end that request with `error`: the sequence is `failing`.
"""

from __future__ import annotations

from operator import attrgetter

import attrs

from atlas.errors import InvariantViolation, VerifyRefused
from atlas.plan import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.sampling.acceptance import accepted_prefix, verdict_bits
from atlas.state.batch_columns import BatchColumns
from atlas.state.control import ControlState
from atlas.state.events import BoundarySnapshotted, Event, StepExecuted, exact_tokens


@attrs.frozen
class Outcome:
    events: tuple[Event, ...]
    ordered: tuple[SeqOutcome, ...]  # the backend's outcomes in plan order
    refused: dict[int, str]  # sequences whose verify was refused (or could not be committed), and why


def align(plan: StepPlan, result: StepResult, vocab_size: int | None, index: int) -> tuple[SeqOutcome, ...]:
    """The outcomes in plan order; a missing or extra outcome, or a token where none belongs, is a desync."""
    by_id = {o.seq_id: o for o in result.outcomes}
    ordered = [by_id.get(w.seq_id) for w in plan.work]
    problem = None
    if result.step != plan.step or len(result.outcomes) != len(plan.work) or None in ordered:
        problem = "one outcome per planned sequence"
    else:
        for w, o in zip(plan.work, ordered, strict=True):
            assert o is not None
            if o.refused is not None:
                continue
            if w.drafts:
                if o.accepted >= 0 and (o.token is None or not o.verdicts):
                    problem = f"verdicts and the token after them for a verify (seq {w.seq_id})"
                    break
                continue
            if w.sample != (o.token is not None) or (w.sample and vocab_size is not None
                                                     and not 0 <= o.token < vocab_size):  # type: ignore[operator]
                problem = f"a token exactly for the sampled sequences (seq {w.seq_id}: {o.token})"
                break
    if problem:
        raise InvariantViolation(index, "Backend", problem, {
            "step": plan.step, "result_step": result.step, "planned": [w.seq_id for w in plan.work],
            "returned": [o.seq_id for o in result.outcomes]})
    return tuple(ordered)  # type: ignore[arg-type]


_SEQ_ID, _TOKEN, _REFUSED = attrgetter("seq_id"), attrgetter("token"), attrgetter("refused")
_SAMPLE, _DRAFTS = attrgetter("sample"), attrgetter("drafts")


def _decode_step(plan: StepPlan, result: StepResult, vocab_size: int | None, cols: BatchColumns | None = None
                 ) -> tuple[int, ...] | None:
    """StepExecuted's tokens when the result is a decode step's in its plain form: every planned sequence samples,
    none verifies, nothing is refused, the outcomes come in plan order and each token is in the vocabulary; else
    None (align and the loop below then check, and name, whatever differs). align's and the plain fold's tests as
    C-level passes over the batch (map, min/max): at batch 64 their two Python loops were ~6% of the control plane."""
    work, outs = plan.work, result.outcomes
    if result.step != plan.step or len(outs) != len(work) or result.refused or not work:
        return None
    target = None
    if cols is not None and work is cols.work:  # built by BatchColumns.decode_work: every row samples, no drafts
        target = cols.ntok_values()  # each row's computed count after the decode (one token left to feed: ntok)
        walked = _walk(outs, cols.ids, target)
        if walked is None:
            target = None
            tokens = tuple(map(_TOKEN, outs))
            if None in tokens or any(map(_REFUSED, outs)) or tuple(map(_SEQ_ID, outs)) != cols.ids:
                return None
        else:
            tokens = tuple(walked)
            if not exact_tokens(tokens) and None in tokens:  # exact ints: no None (and StepExecuted takes them as is)
                return None
    elif (None in (tokens := tuple(map(_TOKEN, outs))) or not all(map(_SAMPLE, work)) or any(map(_DRAFTS, work))
            or any(map(_REFUSED, outs)) or tuple(map(_SEQ_ID, outs)) != tuple(map(_SEQ_ID, work))):
        return None
    lo, top = min(tokens), max(tokens)
    if lo < 0 or (vocab_size is not None and top >= vocab_size):
        return None
    if cols is not None:
        cols.aligned = result  # outcomes in the rows' order, none refused (cursor_violation need not look again)
        cols.token_range = (tokens, lo, top)  # advance's bounds of these very tokens (StepExecuted keeps the tuple)
        cols.cursor_target = None if target is None else (result, target)
    return tokens


def _walk(outs: tuple[SeqOutcome, ...], ids: tuple[int, ...], target: list[int]) -> list[int | None] | None:
    """The tokens of a decode's outcomes when, row by row, each is the row's sequence (`ids`, in order), none refused,
    none with prompt logprobs, and its cursors have no drafter rows, every other field the row's `target`, and no
    stamps or stamps whose memoised uniform positions (BackendCursors.uniform, computed by their builder) are those;
    else None. One walk reading each outcome and its cursors once: what _decode_step's, settle's quiet
    path's and _batch_cursors_hold's C-level passes test (thirteen over the batch; at 64 rows ~19 against ~7.5 us,
    timeit). The cursor verdict holds for `target`: _batch_cursors_hold takes it only when the computed column after
    the step is that very list of numbers."""
    tokens = []
    add = tokens.append
    passed = None  # the last cursors that passed, and at what count (the CUDA reader shares one per position)
    passed_n = -1
    # strict=False: ~0.4 us less at 64; the lengths are equal (_decode_step's len(outs) == len(work), work the rows')
    for o, sid, n in zip(outs, ids, target, strict=False):
        if o.seq_id != sid or o.refused is not None or o.prompt_logprobs:
            return None
        add(o.token)
        c = o.cursors
        if c is passed and n == passed_n:
            continue
        stamps = c.stamps
        if stamps:  # _batch_cursors_hold's test of stamps: each class's one position, memoised for these very stamps
            memo = c._uniform
            u = memo[1] if memo is not None and memo[0] is stamps else None
            if u is None or (u[0] is not None and u[0] != n) or (u[1] is not None and u[1] != n) or (
                    u[2] is not None and u[2] != 0):
                return None
        if c.kv_tokens != n or c.qsa_ingested != n or c.ssm_position != n or c.ple_position != n or c.drafter_rows:
            return None
        passed, passed_n = c, n
    return tokens


def outcome(state: ControlState, plan: StepPlan, result: StepResult, vocab_size: int | None, index: int) -> Outcome:
    """StepExecuted (every cursor moves by its fed count, or 1 + accepted for a verify) and the ring snapshots
    the backend took. Raises InvariantViolation when the result cannot be the plan's."""
    decoded = _decode_step(plan, result, vocab_size, getattr(state, "batch", None))
    if decoded is not None:  # a decode step: align's every test passed (outcomes already in plan order)
        events: list[Event] = [StepExecuted(plan.step, decoded)]
        if plan.snapshots:
            events += [BoundarySnapshotted(plan.step, s.seq_id, s.position, s.slot, s.evicted) for s in plan.snapshots]
        return Outcome(tuple(events), result.outcomes, {})
    ordered = align(plan, result, vocab_size, index)
    if not result.refused:  # the common step: no verify, nothing refused (one pass, no per-sequence appends)
        plain = [-1 if o.token is None else o.token for w, o in zip(plan.work, ordered, strict=True)
                 if not w.drafts and o.refused is None]
        if len(plain) == len(ordered):
            events = [StepExecuted(plan.step, tuple(plain))]
            events += [BoundarySnapshotted(plan.step, s.seq_id, s.position, s.slot, s.evicted) for s in plan.snapshots]
            return Outcome(tuple(events), ordered, {})
    tokens: list[int] = []
    accepted: list[int] = []
    bits: list[int] = []
    refused: dict[int, str] = {}
    for w, o in zip(plan.work, ordered, strict=True):
        if not w.drafts and o.refused is not None:  # one of its orders was refused: nothing ran for it
            refused[w.seq_id] = o.refused
            tokens.append(-1)
            accepted.append(-1)
            bits.append(0)
            continue
        if not w.drafts:
            tokens.append(-1 if o.token is None else o.token)
            accepted.append(0)
            bits.append(0)
            continue
        why = o.refused if o.accepted < 0 else None
        if why is None:
            try:
                n = accepted_prefix(o.verdicts, w.drafts, vocab_size)
            except VerifyRefused as exc:
                why = str(exc)
            else:
                if n != o.accepted or o.token != o.verdicts[n].token:
                    raise InvariantViolation(index, "Backend", "a verify commits the accepted chain of its verdicts",
                                             {"step": plan.step, "seq_id": w.seq_id, "committed": o.accepted,
                                              "verdicts_accept": n, "token": o.token})
        if why is not None:
            refused[w.seq_id] = f"verify commit refused: {why or 'by the backend'}"
            tokens.append(-1)
            accepted.append(-1)
            bits.append(0)
            continue
        tokens.append(o.token)  # type: ignore[arg-type]
        accepted.append(o.accepted)
        bits.append(verdict_bits(o.verdicts, len(w.drafts)))
    if any(w.drafts for w in plan.work) or refused:
        events = [StepExecuted(plan.step, tuple(tokens), tuple(accepted), tuple(bits))]
    else:
        events = [StepExecuted(plan.step, tuple(tokens))]
    events += [BoundarySnapshotted(plan.step, s.seq_id, s.position, s.slot, s.evicted) for s in plan.snapshots]
    for seq_id, why in result.refused:  # an order refused for a sequence with no work in the plan
        refused[seq_id] = why
    return Outcome(tuple(events), ordered, refused)


def expected_cursors(state: ControlState, seq_id: int) -> BackendCursors | None:
    """What the data plane must hold for a live sequence, or None when nothing is owed (gone, or failing)."""
    seq = state.seqs.get(seq_id)
    if seq is None or seq_id in state.failing:
        return None
    n = seq.cursor.computed
    return BackendCursors(n, seq.qsa.ingested, n, n, seq.drafter.rows)


def cursor_violation(state: ControlState, plan: StepPlan, result: StepResult, index: int
                     ) -> InvariantViolation | None:
    """After the step's events: every sequence the plan touched holds exactly what the control plane says, and a
    refused rollback restore left the data plane where it was.

    expected_cursors' comparison written out per sequence (no BackendCursors built for the control plane's
    side, no tuples): at batch 64 the objects were most of this check's cost."""
    outcomes = result.outcomes
    cols = getattr(state, "batch", None)  # (tests hand this check a bare stand-in for the state)
    if (cols is not None and cols.fed is None and not result.refused and not result.touched and not plan.restores
            and not state.failing and _batch_cursors_hold(cols, result)):
        return None
    refused = {o.seq_id for o in outcomes if o.refused is not None} if any(map(_REFUSED, outcomes)) else set()
    if result.refused:
        refused |= {s for s, _ in result.refused}
    held = {r.seq_id: r.held for r in plan.restores}
    seqs = state.seqs
    failing = state.failing
    reported = [(o.seq_id, o.cursors) for o in outcomes]
    if result.touched:
        reported += result.touched
    passed = None  # (cursors, computed, qsa, rows) of the last sequence that passed: a shared BackendCursors (the
    # CUDA stamp reader's for every healthy sequence at one position) against the same numbers passes again
    for seq_id, cur in reported:
        if refused and seq_id in refused and held.get(seq_id):
            if cur.as_tuple() != held[seq_id]:
                return InvariantViolation(index, "BackendCursors", "a refused restore changes nothing", {
                    "step": plan.step, "seq_id": seq_id, "held": list(held[seq_id]),
                    "backend": cur.summary()})
            continue
        seq = seqs.get(seq_id)
        if seq is None or seq_id in failing:  # nothing is owed (expected_cursors' None)
            continue
        n = seq.cursor.computed
        qsa = seq.qsa.ingested
        rows = seq.drafter.rows
        if passed is not None and passed[0] is cur and passed[1] == n and passed[2] == qsa and passed[3] == rows:
            continue
        stamps = cur.stamps
        if stamps:
            memo = cur._uniform  # uniform(compute=False) read inline: each class's one position, if computed
            u = memo[1] if memo is not None and memo[0] is stamps else None
            if u is None or (u[0] is not None and u[0] != n) or (u[1] is not None and u[1] != qsa) or (
                    u[2] is not None and u[2] != rows):
                violation = _stamp_violation(cur, n, qsa, rows, plan.step, seq_id, index)
                if violation is not None:
                    return violation
        if (cur.kv_tokens != n or cur.qsa_ingested != qsa or cur.ssm_position != n or cur.ple_position != n
                or cur.drafter_rows != rows):
            return InvariantViolation(index, "BackendCursors", "data-plane cursors equal the control plane's", {
                "step": plan.step, "seq_id": seq_id, "computed": n, "qsa_ingested": qsa,
                "drafter_rows": rows, "backend": cur.summary()})
        passed = (cur, n, qsa, rows)
    return None


_CURSORS, _STAMPS = attrgetter("cursors"), attrgetter("stamps")
_KV, _QSA, _SSM, _PLE, _ROWS = (attrgetter(f) for f in ("kv_tokens", "qsa_ingested", "ssm_position", "ple_position",
                                                         "drafter_rows"))


def _batch_cursors_hold(cols: BatchColumns, result: StepResult) -> bool:
    """cursor_violation's verdict for a result over exactly the engine's batch columns (atlas.state.batch_columns:
    every row running, computed == QSA keys, no drafter rows, none failing) when every reported cursor has no stamps
    and equals (computed, computed, computed, computed, 0): C-level passes over the batch instead of a field read of
    three objects a sequence. False: the loop checks them, and names the first that differs."""
    known = cols.cursor_target
    if known is not None and known[0] is result and known[1] == cols.ends:  # _walk's verdict, against these numbers
        return True
    outcomes = result.outcomes
    if cols.aligned is not result and (len(outcomes) != len(cols.ids) or tuple(map(_SEQ_ID, outcomes)) != cols.ids
                                       or any(map(_REFUSED, outcomes))):
        return False
    reported = tuple(map(_CURSORS, outcomes))
    if not any(map(_STAMPS, reported)):
        # four single-field passes against the computed column and one count, no tuple built a row
        ends = cols.ends
        return (list(map(_KV, reported)) == ends and list(map(_QSA, reported)) == ends
                and list(map(_SSM, reported)) == ends and list(map(_PLE, reported)) == ends
                and list(map(_ROWS, reported)).count(0) == len(ends))
    # stamps (the CUDA reader's, one shared BackendCursors per position): the loop's own tests, with the computed
    # column for the three numbers; anything the loop would walk or name goes back to it
    passed = None
    passed_n = -1
    for cur, n in zip(reported, cols.ends, strict=True):
        if cur is passed and n == passed_n:
            continue
        stamps = cur.stamps
        if stamps:
            memo = cur._uniform
            u = memo[1] if memo is not None and memo[0] is stamps else None
            if u is None or (u[0] is not None and u[0] != n) or (u[1] is not None and u[1] != n) or (
                    u[2] is not None and u[2] != 0):
                return False
        if (cur.kv_tokens != n or cur.qsa_ingested != n or cur.ssm_position != n or cur.ple_position != n
                or cur.drafter_rows != 0):
            return False
        passed, passed_n = cur, n
    return True


def _stamp_violation(cur: BackendCursors, n: int, qsa: int, rows: int, step: int, seq_id: int, index: int
                     ) -> InvariantViolation | None:
    """The first stamp of `cur` that is not the control plane's position, named (the walk cursor_violation takes
    when the stamps are not all at their class's expected position)."""
    for kind, layer, at in cur.stamps:  # every layer's own stamp, named
        expected = rows if kind == "drafter" else qsa if kind == "qsa" else n
        if at != expected:
            return InvariantViolation(index, "BackendCursors", "every layer's position stamp equals the control "
                                      "plane's", {"step": step, "seq_id": seq_id, "layer": layer, "state": kind,
                                                  "data_plane": at, "control_plane": expected})
    return None
