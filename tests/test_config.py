"""Capacities: one derivation, floors named with both numbers, and the chunk planner's contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import CapacityError

QWEN4_LIKE = {
    "max_position_embeddings": 4096,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"] * 2,
    "indexer_n_heads": 4,
    "indexer_compress_ratio": 4,
    "indexer_budget": 64,
    "ple_layer_ids": [0, 1],
    "ngram_size": 3,
}


def test_derived_sizes_follow_the_knobs_and_the_model() -> None:
    caps = derive_capacities(EngineConfig(max_seq_len=1000, max_batch_size=8, prefill_chunk_tokens=256,
                                          block_size=16, num_drafts=3), QWEN4_LIKE)
    assert caps.kv_blocks_per_seq == 63  # ceil(1000 / 16)
    assert caps.num_kv_blocks == 63 * 8
    assert caps.max_batch_tokens == 256
    assert caps.verify_width == 4
    assert caps.qsa_index_capacity == 1000
    assert caps.num_qsa_layers == 2
    assert (caps.qsa_ratio, caps.qsa_budget, caps.ngram_size) == (4, 64, 3)


def test_no_model_means_no_qsa_and_ratio_one() -> None:
    caps = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=8))
    assert (caps.num_qsa_layers, caps.qsa_ratio, caps.ngram_size) == (0, 1, 0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (EngineConfig(max_seq_len=128, num_kv_blocks=4, block_size=16, max_batch_size=1, prefill_chunk_tokens=8),
         "num_kv_blocks 4 is below its derived floor 8"),
        (EngineConfig(max_seq_len=128, max_batch_size=1, prefill_chunk_tokens=8, qsa_index_capacity=127),
         "qsa_index_capacity 127 is below its derived floor 128"),
        (EngineConfig(max_seq_len=128, max_batch_size=16, prefill_chunk_tokens=8),
         "prefill_chunk_tokens 8 is below its floor max_batch_size 16"),
        (EngineConfig(max_seq_len=8192, max_batch_size=1, prefill_chunk_tokens=8),
         "max_seq_len 8192 exceeds the model's max_position_embeddings 4096"),
    ],
)
def test_an_override_below_its_floor_fails_naming_both_numbers(config: EngineConfig, message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        derive_capacities(config, QWEN4_LIKE)


def test_config_round_trips_through_json() -> None:
    config = EngineConfig(max_seq_len=300, num_kv_blocks=40, num_drafts=2)
    assert EngineConfig.from_json(config.to_json()) == config


def test_every_derived_capacity_is_read_outside_config() -> None:
    """A capacity nobody reads sizes nothing: every field of Capacities is read somewhere in the package."""
    import attrs

    from atlas.config import Capacities

    root = Path(__file__).resolve().parents[1] / "atlas"
    source = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "config.py")
    unread = [f.name for f in attrs.fields(Capacities) if f".{f.name}" not in source]
    assert not unread, f"capacities nothing reads: {unread}"


def test_an_older_traces_capacities_load() -> None:
    from atlas.config import Capacities

    table = derive_capacities(EngineConfig(), None).table()
    old = {**table, "scratch_rows": 2048, "num_gdn_layers": 0, "ring_bytes_per_seq": 0}
    assert Capacities.from_table(old) == Capacities.from_table(table)
