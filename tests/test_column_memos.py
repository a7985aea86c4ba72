"""The engine's memos and shortcuts over the batch columns: each is a cache of
a pure function of the batch columns or of the state, so after every event it must equal what it stands for, and runs
with it on and off must record the same events and digests."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import null_workload

from atlas.engine.records import RecordingSink
from atlas.state.batch_columns import BatchColumns
from atlas.state.control import ControlState
from atlas.state.events import Event


@pytest.fixture(scope="module")
def recorded() -> tuple[object, list[Event], list[str]]:
    sink = RecordingSink()
    caps = null_workload.run(24, lambda i: 14 + i % 9, sink=sink)
    return caps, [e for _, _, e, _ in sink.rows], [d for _, _, _, d in sink.rows]


def _slack_of(cols: BatchColumns) -> tuple[int, int, int]:
    n = cols.ntok
    return int((cols.hi - n).min()), int((n - cols.low).min()), int((cols.nblocks * cols.bs - n).min())


def _apply(caps: object, events: list[Event], on: bool, check=None) -> tuple[list[str], tuple | None]:
    state = ControlState.create(caps)  # type: ignore[arg-type]
    state.batch_cache = on
    digests: list[str] = []
    for index, e in enumerate(events):
        failure = null_workload.apply_checked(state, e, index)
        if failure is not None:
            return digests, failure
        if check is not None and state.batch is not None:
            check(state.batch)
        digests.append(state.digest())
    return digests, None


def test_slack_memo_equals_its_minima_after_every_event(recorded: tuple[object, list[Event], list[str]]) -> None:
    caps, events, digests = recorded
    kept = []

    def check(cols: BatchColumns) -> None:
        if cols.slack is not None:
            assert cols.slack == _slack_of(cols)
            kept.append(cols.slack)
        if cols.short is not None:
            assert cols.short == np.flatnonzero(cols.ntok > cols.nblocks * cols.bs).tolist()

    on, failure = _apply(caps, events, True, check)
    assert failure is None
    assert on == digests  # the engine's own digests, recorded with the memo
    assert len(kept) >= 8  # carried across decode steps, not only computed
    off, failure_off = _apply(caps, events, False)
    assert failure_off is None and off == on
