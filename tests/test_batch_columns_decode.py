"""The batch columns' decode shortcuts: StepPlanned's check of a decode plan
(fed counts equal to the columns' ones) reads only the short rows (tokens past their blocks), computed once for
`batch` and the check; StepExecuted's bounds are one column (`hi`). On recorded null-engine events: the same digests
after every event with the columns on and off, the shortcut taken, every memo equal to what it stands for after every
event, and a decode plan that leaves a short row without its new block (or gives it one too few) refused exactly as
without columns."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from fixtures import null_workload

from atlas.engine.records import RecordingSink
from atlas.state.batch_columns import BatchColumns
from atlas.state.control import ControlState
from atlas.state.events import Event, StepPlanned


@pytest.fixture(scope="module")
def recorded() -> tuple[object, list[Event]]:
    sink = RecordingSink()
    caps = null_workload.run(24, lambda i: 14 + i % 9, sink=sink)
    return caps, [e for _, _, e, _ in sink.rows]


def _memos_hold(cols: BatchColumns) -> None:
    assert (cols.hi == np.minimum(cols.limit, cols.budget_end - 1)).all()
    if cols.short is not None:
        assert cols.short == np.flatnonzero(cols.ntok > cols.nblocks * cols.bs).tolist()
    if cols.ones_fed is not None:
        assert cols.ones_fed.tolist() == list(cols.ones)


def _apply_all(caps: object, events: list[Event], on: bool) -> tuple[list[str], tuple | None, set[int]]:
    """The digests after every event, the first failure, and the StepPlanned indices the decode shortcut took."""
    state = ControlState.create(caps)  # type: ignore[arg-type]
    state.batch_cache = on
    digests: list[str] = []
    shortcut: set[int] = set()
    for index, e in enumerate(events):
        cols = state.batch
        took = (cols is not None and isinstance(e, StepPlanned) and cols.next_decode and e.seqs == cols.ids
                and e.fed == cols.ones and not (e.admitted or e.drafts or e.restored or e.reset))
        failure = null_workload.apply_checked(state, e, index)
        if failure is not None:
            return digests, failure, shortcut
        if took and state.batch is cols:
            assert cols.decode and cols.fed is cols.ones_fed
            shortcut.add(index)
        if state.batch is not None:
            _memos_hold(state.batch)
        digests.append(state.digest())
    return digests, None, shortcut


def test_decode_plans_take_the_shortcut_with_the_same_digests(recorded: tuple[object, list[Event]]) -> None:
    caps, events = recorded
    on, failure_on, shortcut = _apply_all(caps, events, True)
    off, failure_off, _ = _apply_all(caps, events, False)
    assert failure_on is failure_off is None
    assert on == off
    assert len(shortcut) >= 8
    # some of them allocated a block for a short row (the only rows the shortcut looks at)
    assert any(events[i].alloc for i in shortcut)


def test_equal_fed_counts_not_the_same_tuple(recorded: tuple[object, list[Event]]) -> None:
    """A plan whose fed counts equal the ones but are another tuple (a trace's, a test's) takes the same path."""
    caps, events = recorded
    rebuilt = [attrs.evolve(e, fed=tuple(list(e.fed))) if isinstance(e, StepPlanned) else e for e in events]
    on, failure, shortcut = _apply_all(caps, rebuilt, True)
    assert failure is None
    assert on == _apply_all(caps, events, False)[0]
    assert len(shortcut) >= 8


@pytest.mark.parametrize("damage", ["no_new_block", "block_taken_from_another"])
def test_short_row_without_its_block_refused_as_without_columns(recorded: tuple[object, list[Event]],
                                                                 damage: str) -> None:
    caps, events = recorded
    _, _, shortcut = _apply_all(caps, events, True)
    i = next(i for i in sorted(shortcut) if events[i].alloc)
    e = events[i]
    if damage == "no_new_block":  # the short row's block left out of the plan
        bad_alloc = e.alloc[1:]
    else:  # the block given to another row instead (a row that did not need one): the short row is left short
        other = next(s for s in e.seqs if s not in {row[0] for row in e.alloc})
        bad_alloc = ((other, *e.alloc[0][1:]), *e.alloc[1:])
    bad = [*events[:i], attrs.evolve(e, alloc=bad_alloc), *events[i + 1:]]
    digests_on, failure_on, _ = _apply_all(caps, bad, True)
    digests_off, failure_off, _ = _apply_all(caps, bad, False)
    assert failure_off is not None and failure_off[1] == i
    assert failure_on == failure_off
    assert digests_on == digests_off
