"""The mutation campaign catches each broken variant within 200 generated workloads and minimises its failing
run to at most 20 events. Two CPU-model variants are left to benchmarks/mutation_campaign.py for the CI budget:
the verify across the QSA bound (~1 min) and the drafter carry across turns (~4-7 min: 50 generated two-turn
workloads before one re-tokenises a turn boundary)."""

from __future__ import annotations

import pytest
from fixtures.campaign import hunt

FAST = ["chunk_planner_off_by_one", "qsa_capacity_below_max_seq_len", "rollback_keeps_qsa_cursor",
        "rollback_restores_some_layers_then_fails", "drafter_rows_off_by_one"]


@pytest.mark.parametrize("name", FAST)
def test_each_variant_is_detected_and_minimised(name: str) -> None:
    d = hunt(name)
    assert d.examples is not None and d.examples <= 200, d
    assert d.minimized_events is not None and d.minimized_events <= 20, d
    assert d.minimized_events <= d.hypothesis_events
