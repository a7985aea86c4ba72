"""The prefix cache's index: pure Python, no tensors, owned by the control plane.

KV blocks are keyed by content, chained over full blocks: block i's key is block_key(key of block i - 1, its
tokens) (atlas.hashing: BLAKE2b over the token bytes), so equal hashes mean equal prefixes; the tokens are re-checked on a hit anyway. A cached block is a
pool block whose KV holds committed tokens only (it is registered once every position in it is computed,
never over draft positions). Live sequences may share a cached block (reference counts in the BlockPool);
an unreferenced cached block sits on the free list and is evictable, least recently used first.

Recurrent state (GDN conv + recurrent, PLE context + short conv) cannot be cut at an arbitrary position,
so the data plane stores snapshots at chosen positions (the end of every prefill chunk and the end of a
finished sequence), each keyed by the chain hash of the full blocks before it plus the tokens of the
partial block it ends in (the snapshot carries that partial block's KV rows and the QSA raw keys itself).
A hit is the longest prefix with a snapshot whose full blocks are all cached: attention from cache never
meets recurrent state from zero. Prefill resumes at the snapshot position.

The drafter carry: one finished sequence's MTP drafter rows; `plan_adoption` says which of them a new
prompt can keep (pair key k is valid iff tokens 0..k+1 agree: the longest common prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from atlas.hashing import ROOT, snapshot_key
from atlas.hashing import block_key as chain_hash


def block_chain(tokens: Sequence[int], block_size: int, start: int = 0, parent: int = ROOT) -> list[int]:
    """Chain hashes of the full blocks of `tokens` from block `start` (whose parent chain is `parent`)."""
    out = []
    for i in range(start, len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@attrs.frozen
class CachedBlock:
    block: int
    tokens: tuple[int, ...]


@attrs.frozen
class PrefixSnapshot:
    key: int
    full_blocks: int  # the chain it continues: hash of its first `full_blocks` blocks
    chain: int
    position: int
    tail: tuple[int, ...]  # tokens [full_blocks * block_size, position)


@attrs.frozen
class PrefixHit:
    """Resume at `position` from snapshot `key`: share `blocks` (full, cached), the snapshot supplies the
    KV of the partial block and the recurrent state. `matched`: tokens covered by cached full blocks
    (the prefix the KV alone could give); tokens position..matched - 1 are recomputed (the replay)."""

    key: int
    position: int
    matched: int
    blocks: tuple[int, ...]
    chain: tuple[int, ...]  # chain hashes of the shared blocks

    @property
    def replay(self) -> int:
        return max(0, self.matched - self.position)


@attrs.frozen
class CarriedEntry:
    """One finished sequence's drafter rows: pair keys first_key .. last_pair_key, built over `tokens`."""

    seq_id: int
    tokens: tuple[int, ...]
    first_key: int
    last_pair_key: int

    @property
    def rows(self) -> int:
        return max(0, self.last_pair_key - self.first_key + 1)


@attrs.frozen
class Adoption:
    """The carried rows a new sequence keeps (keys first_key .. last_pair_key; rows 0 when none)."""

    first_key: int
    last_pair_key: int
    common: int  # longest common prefix of the carried tokens and the new prompt

    @property
    def rows(self) -> int:
        return max(0, self.last_pair_key - self.first_key + 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def plan_adoption(carry: CarriedEntry, tokens: Sequence[int], position: int) -> Adoption | None:
    """Which carried rows a sequence resuming its prefill at `position` keeps, or None when it cannot use
    the carry. Pair key k = (embed(t_{k+1}), hidden_k) and hidden_k depends on tokens 0..k only, so key k is
    valid iff the first k + 2 tokens agree: keep keys up to common - 2 (a re-tokenised tail costs only the
    tail). The warm prefill builds keys from position - 1 on (hidden_{position - 1} comes with the
    snapshot), so the kept rows must reach key position - 2 or the drafter's rows would have a hole."""
    common = common_prefix(carry.tokens, tokens)
    last = min(carry.last_pair_key, common - 2, len(tokens) - 2)
    if carry.first_key != 0 or last < position - 2 or last < 0:
        return None
    return Adoption(first_key=0, last_pair_key=last, common=common)


class PrefixCache:
    """Cached blocks by chain hash, and recurrent snapshots with LRU eviction at `snapshot_capacity`."""

    def __init__(self, block_size: int, snapshot_capacity: int) -> None:
        if snapshot_capacity < 1:
            raise ValueError(f"prefix snapshot capacity must be >= 1, got {snapshot_capacity}")
        self.block_size = block_size
        self.snapshot_capacity = snapshot_capacity
        self.blocks: dict[int, CachedBlock] = {}  # chain hash -> block
        self.hash_of: dict[int, int] = {}  # block -> chain hash
        self.snapshots: dict[int, PrefixSnapshot] = {}  # key -> snapshot, least recently used first
        self._by_chain: dict[tuple[int, int], list[int]] = {}  # (full_blocks, chain) -> snapshot keys

    # -- blocks ----------------------------------------------------------------------------------------

    def register_block(self, block: int, chain: int, tokens: Sequence[int]) -> None:
        """`block` holds the committed KV of a full block whose chain hash is `chain`. A second block with
        the same content is not registered (the first one serves hits)."""
        if chain in self.blocks or block in self.hash_of:
            return
        self.blocks[chain] = CachedBlock(block, tuple(tokens))
        self.hash_of[block] = chain

    def evict_block(self, block: int) -> None:
        """The block is being reused for other content: forget what it held."""
        chain = self.hash_of.pop(block, None)
        if chain is not None:
            del self.blocks[chain]

    def matched_blocks(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """(blocks, chain hashes) of the longest run of cached full blocks at the start of `tokens`."""
        bs = self.block_size
        blocks: list[int] = []
        chain: list[int] = []
        parent = ROOT
        for i in range(len(tokens) // bs):
            span = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, span)
            cached = self.blocks.get(h)
            if cached is None or cached.tokens != span:  # tokens re-checked: a hash is not proof
                break
            blocks.append(cached.block)
            chain.append(h)
            parent = h
        return blocks, chain

    # -- snapshots --------------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The longest usable prefix of `tokens`: a snapshot at position s (0 < s < len(tokens): at least
        one token is left to feed, for the logits of the next) whose full blocks are all cached."""
        blocks, chain = self.matched_blocks(tokens)
        bs = self.block_size
        for j in range(len(blocks), -1, -1):
            parent = chain[j - 1] if j else ROOT
            best: PrefixSnapshot | None = None
            for key in self._by_chain.get((j, parent), ()):
                snap = self.snapshots[key]
                if (0 < snap.position < len(tokens) and tuple(tokens[j * bs:snap.position]) == snap.tail
                        and (best is None or snap.position > best.position)):
                    best = snap
            if best is not None:
                return PrefixHit(best.key, best.position, len(blocks) * bs, tuple(blocks[:j]), tuple(chain[:j]))
        return None

    def snapshot_for(self, tokens: Sequence[int], position: int, chain: Sequence[int]) -> PrefixSnapshot:
        """The snapshot a sequence with full-block chain `chain` would store at `position`."""
        j = position // self.block_size
        parent = chain[j - 1] if j else ROOT
        tail = tuple(tokens[j * self.block_size:position])
        return PrefixSnapshot(snapshot_key(parent, tail), j, parent, position, tail)

    def placement(self, key: int) -> int | None:
        """None when `key` is held already; else the key the store evicts (-1: none)."""
        if key in self.snapshots:
            return None
        if len(self.snapshots) < self.snapshot_capacity:
            return -1
        return next(iter(self.snapshots))

    def store(self, snap: PrefixSnapshot, evicted: int) -> None:
        if snap.key in self.snapshots:
            raise ValueError(f"prefix snapshot {snap.key:016x} is stored already")
        if evicted != self.placement(snap.key):
            raise ValueError(f"prefix snapshot store evicts {evicted}, expected {self.placement(snap.key)}")
        if evicted >= 0:
            old = self.snapshots.pop(evicted)
            self._by_chain[(old.full_blocks, old.chain)].remove(evicted)
        self.snapshots[snap.key] = snap
        self._by_chain.setdefault((snap.full_blocks, snap.chain), []).append(snap.key)

    def touch(self, key: int) -> None:
        """A hit: the snapshot becomes the most recently used."""
        self.snapshots[key] = self.snapshots.pop(key)
