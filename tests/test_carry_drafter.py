"""The MTP drafter's context across turns on the CPU backend and atlas-tiny: a warm turn's state after its
prefill equals a cold prefill of the same prompt to the bit (target state restored from the prefix snapshot,
drafter rows adopted from the carry plus the appended tail); a re-tokenised tail costs only the tail; a cold
turn releases the carry; the one switch (ATLAS_NO_MTP_DRAFTER_CONTEXT=1, nothing else) turns prefill and
carry off together, and a carry without the prefill is refused by its transition."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.runner import Chunk
from atlas.config import EngineConfig, derive_capacities, resolve_drafter_context
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.errors import TransitionRefused
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState
from atlas.state.events import CarryAdopted, CarryReleased, CarryStored, PrefixCacheHit, RequestArrived

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")


def config(**kw) -> EngineConfig:
    base = dict(max_seq_len=128, max_batch_size=2, prefill_chunk_tokens=16, block_size=4, num_kv_blocks=80,
                enable_prefix_caching=True, num_drafts=2, drafter="mtp")
    return EngineConfig(**{**base, **kw})


def finish(engine: Engine, rid: str, prompt: list[int], n: int = 6) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def prefill(engine: Engine, rid: str, prompt: list[int]) -> int:
    """Admit and step until the prompt is fed; returns the sequence id."""
    seq_id = engine.state.next_seq_id
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    while engine.state.seqs[seq_id].cursor.computed < len(prompt):
        engine.step()
    return seq_id


def events(engine: Engine, kind: type) -> list:
    return [e for _, _, e, _ in engine.sink.rows if isinstance(e, kind)]  # type: ignore[union-attr]


def assert_equals_cold_prefill(engine: Engine, seq_id: int, prompt: list[int]) -> None:
    backend = engine.backend
    fresh = CpuBackend(TINY, num_kv_blocks=64, block_size=4, mtp_drafter=True)
    fresh.reset(seq_id)
    fresh.forward([Chunk(seq_id, prompt, 0, tuple(range(64)))])
    warm, cold = backend.store.seqs[seq_id], fresh.store.seqs[seq_id]  # type: ignore[attr-defined]
    assert backend.cursors(seq_id) == fresh.cursors(seq_id)
    for name in ("gdn_conv", "gdn_recurrent", "ple_conv", "qsa_keys"):
        for layer, t in getattr(cold, name).items():
            assert torch.equal(getattr(warm, name)[layer], t), (name, layer)
    assert torch.equal(warm.ple_context, cold.ple_context)
    table = tuple(engine.state.seqs[seq_id].blocks)
    slots = backend.kv.slots(table, 0, len(prompt))
    for layer in backend.kv.keys:
        k, v = backend.kv.read(layer, slots)
        rk, rv = fresh.kv.read(layer, fresh.kv.slots(tuple(range(64)), 0, len(prompt)))
        assert torch.equal(k, rk) and torch.equal(v, rv), layer
    d, ref = backend.store.drafts[seq_id], fresh.store.drafts[seq_id]  # type: ignore[attr-defined]
    assert d.first_key == 0 and d.rows == ref.rows == len(prompt) - 1
    for layer in ref.kv.keys:
        n = ref.rows
        assert torch.equal(d.kv.keys[layer].flatten(0, 1)[:n], ref.kv.keys[layer].flatten(0, 1)[:n])
        assert torch.equal(d.kv.values[layer].flatten(0, 1)[:n], ref.kv.values[layer].flatten(0, 1)[:n])


@pytest.mark.parametrize("retokenised", [0, 3])
def test_warm_turn_equals_a_cold_prefill_to_the_bit(retokenised: int) -> None:
    engine = build_engine("atlas-tiny", "cpu", config(), loaded=TINY, sink=RecordingSink(), full_audit=True)
    first = list(range(20, 57))
    answer = finish(engine, "t0", first)
    kept = answer[: len(answer) - 1 - retokenised]
    second = first + kept + [7, 8, 9] * (1 + retokenised)  # the boundary re-tokenised: the tail differs
    stored = events(engine, CarryStored)[-1]
    seq_id = prefill(engine, "t1", second)
    hit = events(engine, PrefixCacheHit)[-1]
    adopted = events(engine, CarryAdopted)[-1]
    assert hit.seq_id == adopted.seq_id == seq_id and hit.position >= len(first)
    assert adopted.common == len(first) + len(kept)
    assert adopted.rows_kept == min(stored.last_pair_key + 1, adopted.common - 1)
    assert adopted.rows_kept + adopted.rows_to_append == len(second) - 1  # only the missing keys are appended
    assert_equals_cold_prefill(engine, seq_id, second)
    assert engine.stats().drafter_coverage_warm >= 0.95


def test_a_cold_turn_releases_the_carry() -> None:
    engine = build_engine("atlas-tiny", "cpu", config(), loaded=TINY, sink=RecordingSink(), full_audit=True)
    finish(engine, "t0", list(range(20, 50)))
    assert engine.state.carry is not None
    finish(engine, "other", list(range(100, 130)))  # an unrelated session: no hit
    released = events(engine, CarryReleased)
    assert [e.reason for e in released] == ["cold turn"]
    assert engine.state.carry is not None and engine.state.carry.seq_id == 1  # the new turn's own, at its end
    assert engine.backend.store.prefix.carry is not None  # type: ignore[attr-defined]


@pytest.mark.parametrize("value,on", [(None, True), ("0", True), ("", True), ("true", True), ("yes", True),
                                      ("1", False)])
def test_only_the_value_1_turns_the_drafter_context_off(value: str | None, on: bool) -> None:
    env = {} if value is None else {"ATLAS_NO_MTP_DRAFTER_CONTEXT": value}
    resolved = resolve_drafter_context(config(), env)
    assert resolved.drafter_context is on
    assert derive_capacities(resolved).drafter_context is on  # prefill and carry: one field, never apart


@pytest.mark.parametrize("name", ["ATLAS_MTP_DRAFTER_PREFILL", "ATLAS_MTP_CARRY_DRAFTER"])
def test_an_obsolete_switch_is_warned_about_and_changes_nothing(name: str) -> None:
    from structlog.testing import capture_logs

    for value in ("0", "1"):
        with capture_logs() as logs:
            resolved = resolve_drafter_context(config(), {name: value})
        assert resolved.drafter_context is True
        warned = [e for e in logs if e["log_level"] == "warning" and e.get("switch") == name]
        assert len(warned) == 1 and "ATLAS_NO_MTP_DRAFTER_CONTEXT=1" in warned[0]["event"]
    with capture_logs() as logs:
        resolve_drafter_context(config(), {})
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_context_off_drafts_blind_and_never_carries() -> None:
    engine = build_engine("atlas-tiny", "cpu", config(drafter_context=False), loaded=TINY, sink=RecordingSink(),
                                full_audit=True)
    first = list(range(20, 50))
    answer = finish(engine, "t0", first)
    assert not events(engine, CarryStored) and engine.state.carry is None
    seq_id = prefill(engine, "t1", first + answer[:-1] + [5, 6])
    d = engine.state.seqs[seq_id].drafter
    assert d.first_key >= len(first) - 1 and not d.carried  # no prompt rows: keys from the snapshot on
    assert engine.stats().drafter_coverage_cold < 0.1


def test_a_carry_without_the_prefill_is_refused() -> None:
    caps = derive_capacities(config(drafter_context=False))
    state = ControlState.create(caps)
    state.apply(RequestArrived("r", 0, list(range(20, 40)), {}, 4))
    digest = state.digest()
    with pytest.raises(TransitionRefused, match="unreachable"):
        state.apply(CarryStored(0, 0, 0, 10))
    assert state.digest() == digest and state.carry is None
