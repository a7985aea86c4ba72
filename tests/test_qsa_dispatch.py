"""The QSA dispatch table: on a backend whose verify cannot apply QSA selection per row (the CPU backend with the
option per_row_qsa_verify=False, built the way serving builds it), each decode around the inert bound either
verifies its drafts or, once a verify could reach past the bound, latches speculation off and decodes serially.

The table is the seed's (sequence lengths around the bound x drafts 1-3, each step's outcome), written out for
atlas-tiny's bound (19) rather than computed from the latch's own condition. The latch one position late is
caught: the backend refuses the verify, and the request ends in `error`."""

from __future__ import annotations

import pytest
import torch

import atlas.engine.drafters.lane as lane_module
from atlas.config import EngineConfig
from atlas.engine.drafters import DraftRequest, ScriptedDrafter
from atlas.engine.offline import generate
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import SpeculationLatchedOff, StepPlanned

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
BOUND = 19  # atlas-tiny: QSA budget 16 + ratio 4 - 1
PARAMS = SamplingParams(max_tokens=6)
ROW_BLIND = {"per_row_qsa_verify": False}
# (position of the first decode, drafts per verify) -> what that decode does: "verify" its drafts, or "serial"
# (the lane latched off: a verify of 1 + drafts rows from there would see a prefix past the bound)
DISPATCH = {
    (15, 1): "verify", (15, 2): "verify", (15, 3): "verify",
    (16, 1): "verify", (16, 2): "verify", (16, 3): "serial",
    (17, 1): "verify", (17, 2): "serial", (17, 3): "serial",
    (18, 1): "serial", (18, 2): "serial", (18, 3): "serial",
    (19, 1): "serial", (19, 2): "serial", (19, 3): "serial",
    (20, 1): "serial", (20, 2): "serial", (20, 3): "serial",
}
_REFERENCE: dict[int, tuple[int, ...]] = {}


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 200 + 20 for i in range(n)]


def reference(n: int) -> tuple[int, ...]:
    if n not in _REFERENCE:
        engine = build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=40, max_batch_size=1), loaded=TINY)
        _REFERENCE[n] = generate(engine, [prompt(n)], [PARAMS])[0].token_ids
    return _REFERENCE[n]


def first_decode(position: int, drafts: int) -> tuple[str, FinishReason | None, tuple[int, ...], list]:
    """Serve one prompt of `position` tokens with `drafts` always-right drafts per verify on the row-blind CPU
    backend: (the first decode's outcome, the finish reason, the tokens, the events)."""
    ref = reference(position)
    # verify_costs=(): every verify at its full width (the table is a property of widths; no draft-count policy)
    config = EngineConfig(max_seq_len=40, max_batch_size=1, prefill_chunk_tokens=32, num_drafts=drafts,
                          drafter="scripted", verify_costs=())
    engine = build_engine("atlas-tiny", "cpu", config, loaded=TINY, sink=RecordingSink(), full_audit=True,
                          backend_options=ROW_BLIND,
                          drafter=ScriptedDrafter(lambda r: list(ref[r.generated: r.generated + r.k])))
    result = generate(engine, [prompt(position)], [PARAMS])[0]
    rows = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
    plans = [e for e in rows if isinstance(e, StepPlanned)]
    second = plans[1]  # the first after the prompt's one chunk: the decode at `position`
    latched = [e.position for e in rows if isinstance(e, SpeculationLatchedOff)]
    outcome = "verify" if second.drafts and second.drafts[0] else "serial"
    if outcome == "serial":
        assert latched == [position], latched  # it latched at this decode, once
    return outcome, result.finish_reason, result.token_ids, rows


@pytest.mark.parametrize(("position", "drafts"), sorted(DISPATCH))
def test_each_decode_around_the_bound_dispatches_as_the_table_says(position: int, drafts: int) -> None:
    assert TINY.spec.qsa.inert_bound == BOUND
    outcome, reason, tokens, _ = first_decode(position, drafts)
    assert outcome == DISPATCH[(position, drafts)]
    assert reason is FinishReason.LENGTH and tokens == reference(position)  # speculation off's tokens, no error


def test_the_latch_one_position_late_is_refused_by_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's cells where the latch comes exactly in time: latched a position late, the verify reaches the
    backend, which refuses it before anything moves; the request ends in error, never in a silent dense verify."""
    bound = lane_module.inert_bound
    monkeypatch.setattr(lane_module, "inert_bound", lambda caps: bound(caps) + 1)
    late = [(p, k) for (p, k), o in DISPATCH.items() if o == "serial" and DISPATCH.get((p - 1, k)) == "verify"]
    assert late == [(16, 3), (17, 2), (18, 1)]
    for position, drafts in late:
        outcome, reason, _, rows = first_decode(position, drafts)
        assert outcome == "verify" and reason is FinishReason.ERROR, (position, drafts)
        assert any("cannot apply QSA selection per verify row" in str(getattr(e, "detail", "")) for e in rows)


def test_the_backend_option_reaches_the_lane_through_the_registry() -> None:
    config = EngineConfig(max_seq_len=40, max_batch_size=1, num_drafts=2, drafter="ngram")
    blind = build_engine("atlas-tiny", "cpu", config, loaded=TINY, backend_options=ROW_BLIND)
    default = build_engine("atlas-tiny", "cpu", config, loaded=TINY)
    assert blind.lanes.spec is not None and blind.lanes.spec.bound == BOUND
    assert default.lanes.spec is not None and default.lanes.spec.bound is None


def test_a_request_past_the_bound_never_verifies_on_the_row_blind_backend() -> None:
    def always(r: DraftRequest) -> list[int]:
        return [5] * r.k

    config = EngineConfig(max_seq_len=40, max_batch_size=1, num_drafts=3, drafter="scripted", verify_costs=())
    engine = build_engine("atlas-tiny", "cpu", config, loaded=TINY, sink=RecordingSink(), full_audit=True,
                          backend_options=ROW_BLIND, drafter=ScriptedDrafter(always))
    result = generate(engine, [prompt(25)], [PARAMS])[0]
    rows = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
    assert result.finish_reason is FinishReason.LENGTH and result.token_ids == reference(25)
    assert not any(e.drafts for e in rows if isinstance(e, StepPlanned))
