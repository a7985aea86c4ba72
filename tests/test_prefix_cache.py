"""The prefix cache's pure index (no model): chained block hashes, the longest usable prefix (cached blocks AND
a snapshot at or before it), tokens re-checked on a hit, LRU snapshot eviction; the control-plane transitions
refuse a hit that is not the lookup's answer, and free cached blocks are handed out last, least recent first."""

from __future__ import annotations

import attrs
import pytest

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import TransitionRefused
from atlas.state.control import ControlState
from atlas.state.events import PrefixCacheHit, RequestArrived
from atlas.state.prefix import free_order
from atlas.state.prefix_index import (
    ROOT,
    CarriedEntry,
    PrefixCache,
    block_chain,
    chain_hash,
    plan_adoption,
)

BS = 4


def cache_with(tokens: list[int], blocks: list[int], snapshots: list[int], capacity: int = 8) -> PrefixCache:
    cache = PrefixCache(BS, capacity)
    chain = block_chain(tokens, BS)
    for i, (b, h) in enumerate(zip(blocks, chain, strict=False)):
        cache.register_block(b, h, tokens[i * BS:(i + 1) * BS])
    for position in snapshots:
        snap = cache.snapshot_for(tokens, position, chain)
        cache.store(snap, cache.placement(snap.key))
    return cache


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    a = block_chain([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = block_chain([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parents
    assert a[1] == chain_hash(chain_hash(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_hit_is_the_longest_prefix_with_blocks_and_a_snapshot() -> None:
    tokens = list(range(10, 30))
    cache = cache_with(tokens, blocks=[7, 3, 5], snapshots=[6, 10])
    hit = cache.lookup(tokens + [99])
    assert hit is not None and hit.position == 10 and hit.blocks == (7, 3) and hit.matched == 12
    assert hit.replay == 2  # tokens 10, 11: KV cached but the recurrent state is only at 10
    # a snapshot past the cached blocks is unusable (attention from cache, recurrent state from nothing)
    cache = cache_with(tokens, blocks=[7], snapshots=[6, 10])
    hit = cache.lookup(tokens)
    assert hit is not None and hit.position == 6 and hit.blocks == (7,)
    # no snapshot at or before the blocks: no hit at all
    assert cache_with(tokens, blocks=[7, 3, 5], snapshots=[]).lookup(tokens) is None


def test_a_hit_leaves_one_token_to_feed_and_checks_the_tail() -> None:
    tokens = list(range(10, 22))
    cache = cache_with(tokens, blocks=[1, 2, 3], snapshots=[6, 12])
    hit = cache.lookup(tokens)  # a snapshot at the very end would leave nothing to sample from
    assert hit is not None and hit.position == 6
    other = tokens[:5] + [77] + tokens[6:]  # the partial block's tokens differ: snapshot 6 is not this prefix
    assert cache.lookup(other) is None


def test_tokens_are_rechecked_on_a_hash_hit() -> None:
    tokens = list(range(10, 22))
    cache = cache_with(tokens, blocks=[1, 2], snapshots=[8])
    h = block_chain(tokens, BS)[0]
    cache.blocks[h] = attrs.evolve(cache.blocks[h], tokens=(0, 0, 0, 0))  # a collision: same hash, other tokens
    assert cache.lookup(tokens) is None


def test_snapshots_are_evicted_least_recently_used_first() -> None:
    tokens = list(range(10, 40))
    chain = block_chain(tokens, BS)
    cache = PrefixCache(BS, 2)
    s1, s2, s3 = (cache.snapshot_for(tokens, p, chain) for p in (4, 8, 12))
    cache.store(s1, -1)
    cache.store(s2, -1)
    cache.touch(s1.key)  # a hit makes s1 the most recent
    assert cache.placement(s3.key) == s2.key
    with pytest.raises(ValueError):
        cache.store(s3, s1.key)  # not where placement() puts it
    cache.store(s3, s2.key)
    assert set(cache.snapshots) == {s1.key, s3.key} and cache.placement(s1.key) is None


def test_evicting_a_block_breaks_the_chain_after_it() -> None:
    tokens = list(range(10, 30))
    cache = cache_with(tokens, blocks=[7, 3, 5], snapshots=[4, 12])
    cache.evict_block(3)
    hit = cache.lookup(tokens)
    assert hit is not None and hit.position == 4 and hit.blocks == (7,)


def test_adoption_keeps_the_common_prefix_and_refuses_a_hole() -> None:
    carried = CarriedEntry(seq_id=0, tokens=tuple(range(100, 150)), first_key=0, last_pair_key=48)
    same = list(range(100, 150)) + [1, 2, 3]
    a = plan_adoption(carried, same, position=49)
    assert a is not None and a.last_pair_key == 48 and a.rows == 49
    retokenised = list(range(100, 146)) + [7, 8, 9, 1]  # the last 4 carried tokens differ
    a = plan_adoption(carried, retokenised, position=40)
    assert a is not None and a.common == 46 and a.last_pair_key == 44  # key k needs tokens 0..k+1
    assert plan_adoption(carried, retokenised, position=47) is None  # keys 45, 46 missing: a hole
    assert plan_adoption(CarriedEntry(0, carried.tokens, 30, 48), same, 49) is None  # rows must start at 0


def test_free_cached_blocks_are_handed_out_last_least_recent_first() -> None:
    free = dict.fromkeys([9, 4, 6, 2, 8])
    assert list(free_order(free, {})) == [8, 2, 6, 4, 9]
    assert list(free_order(free, {4: 1, 2: 2})) == [8, 6, 9, 4, 2]


def test_a_hit_that_is_not_the_lookups_answer_is_refused() -> None:
    caps = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=16, block_size=BS,
                                          num_kv_blocks=32, enable_prefix_caching=True))
    state = ControlState.create(caps)
    prompt = list(range(10, 30))
    state.apply(RequestArrived("r", 0, prompt, {}, 4))
    assert state.prefix is not None
    chain = block_chain(prompt, BS)
    for i, h in enumerate(chain[:3]):
        state.prefix.register_block(20 + i, h, prompt[i * BS:(i + 1) * BS])
    snap = state.prefix.snapshot_for(prompt, 10, chain)
    state.prefix.store(snap, -1)
    digest = state.digest()
    bad = [PrefixCacheHit(0, 0, snap.key, 10, 12, 2, (20, 21), -1, 9, 8),  # needs a tail block
           PrefixCacheHit(0, 0, snap.key, 8, 12, 4, (20, 21), 3, 7, 6),  # not the snapshot's position
           PrefixCacheHit(0, 0, snap.key, 10, 12, 2, (20, 21), 20, 9, 8)]  # the tail block is a shared one
    for e in bad:
        with pytest.raises(TransitionRefused):
            state.apply(e)
        assert state.digest() == digest and state.pool.used == 0
    state.apply(PrefixCacheHit(0, 0, snap.key, 10, 12, 2, (20, 21), 3, 9, 8))  # no MTP drafter: its keys unused
    seq = state.seqs[0]
    assert seq.cursor.computed == seq.qsa.ingested == 10 and seq.blocks == [20, 21, 3]
    assert state.pool.refs[20] == state.pool.refs[21] == state.pool.refs[3] == 1 and state.pool.used == 3
