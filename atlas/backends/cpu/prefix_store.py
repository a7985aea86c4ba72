"""The CPU backend's prefix-cache storage: recurrent snapshots keyed by prefix, and the drafter carry.

A prefix snapshot is what a sequence resuming at `position` needs beyond the cached full KV blocks: the
ring's StateSnapshot (GDN conv + recurrent state, PLE context + short-conv state, the same shape and copy
code as a rollback boundary), the QSA raw index keys of positions 0 .. position - 1, the KV rows of the
partial block the position ends in, and the target's final hidden at position - 1 (the MTP drafter's next
pair key needs it). The control plane's PrefixCache decides which keys exist; this only holds tensors.
"""

from __future__ import annotations

import attrs
import torch

from atlas.backends.cpu.drafter import DrafterState
from atlas.backends.cpu.state import StateSnapshot
from atlas.errors import RestoreRefused


@attrs.frozen
class PrefixEntry:
    state: StateSnapshot
    qsa_keys: dict[int, torch.Tensor]  # layer -> [position, index_head_dim]
    tail_keys: dict[int, torch.Tensor]  # layer -> [position % block_size, kv_heads, head_dim]
    tail_values: dict[int, torch.Tensor]
    last_hidden: torch.Tensor | None  # the target's final hidden at position - 1 (None without a drafter)

    @property
    def position(self) -> int:
        return self.state.position


class PrefixStore:
    def __init__(self) -> None:
        self._entries: dict[int, PrefixEntry] = {}
        self.carry: DrafterState | None = None  # one finished sequence's drafter rows

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, key: int, entry: PrefixEntry, evicted: int) -> None:
        if evicted >= 0:
            if evicted not in self._entries:
                raise RestoreRefused(f"prefix snapshot {evicted:016x} to evict is not held")
            del self._entries[evicted]
        self._entries[key] = entry

    def get(self, key: int, position: int) -> PrefixEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise RestoreRefused(f"prefix snapshot {key:016x} is not held")
        if entry.position != position:
            raise RestoreRefused(f"prefix snapshot {key:016x} holds position {entry.position}, not {position}")
        return entry
