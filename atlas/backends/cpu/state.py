"""Explicit per-sequence data-plane state, and the paged KV pool.

Everything a sequence carries between steps lives here, so later issues can move, snapshot and rewind it:
- KV: global pool tensors per attention layer [num_blocks, block_size, kv_heads, head_dim], addressed
  through the block table the caller gives with each chunk;
- QSA: raw (un-normed, un-roped) index keys per QSA layer, [tokens, index_head_dim];
- GDN: conv state (the last K pre-activation columns) and the recurrent state [Hv, dk, dv] per layer;
- PLE: the n-gram context (last ngram_size - 1 ids) and the short-conv state per PLE layer.
Chunks never mutate these tensors in place: a step builds new ones and commits them at its end, so a
failing step leaves the sequence as it was.
"""

from __future__ import annotations

import attrs
import torch
from atlas_kernels.rows import check_rows

from atlas.backends.ops import acc_dtype
from atlas.model.spec import ModelSpec


@attrs.define
class SequenceState:
    kv_tokens: int = 0  # positions written to KV
    ssm_position: int = 0  # tokens folded into GDN conv + recurrent state
    ple_position: int = 0  # tokens folded into the PLE context and short-conv state
    qsa_keys: dict[int, torch.Tensor] = attrs.field(factory=dict)  # layer -> [tokens, index_head_dim]
    gdn_conv: dict[int, torch.Tensor] = attrs.field(factory=dict)  # layer -> [conv_dim, K]
    gdn_recurrent: dict[int, torch.Tensor] = attrs.field(factory=dict)  # layer -> [Hv, dk, dv], >= fp32
    ple_context: torch.Tensor | None = None  # [ngram_size - 1] token ids, EOS-filled at the start
    ple_conv: dict[int, torch.Tensor] = attrs.field(factory=dict)  # layer -> [hc*H, (K-1)*ngram_size]
    # the position each per-layer state encodes, returned by the very function that computed that state
    # (gdn_forward, ple_forward, the PLE context's advance) and moved with it by snapshot, restore and commit:
    # ("conv" | "gdn", layer), ("ple", -1), ("ple_conv", layer). KV rows and QSA keys are measured from the data.
    stamps: dict[tuple[str, int], int] = attrs.field(factory=dict)

    @classmethod
    def empty(cls, spec: ModelSpec, dtype: torch.dtype) -> SequenceState:
        state = cls()
        for layer in spec.gdn_layers:
            state.stamps[("conv", layer)] = state.stamps[("gdn", layer)] = 0
            state.gdn_conv[layer] = torch.zeros(spec.gdn_conv_dim, spec.gdn_conv_kernel, dtype=dtype)
            state.gdn_recurrent[layer] = torch.zeros(
                spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim, dtype=acc_dtype(dtype)
            )
        if spec.qsa is not None:
            for layer in spec.attention_layers:
                state.qsa_keys[layer] = torch.zeros(0, spec.qsa.head_dim, dtype=dtype)
        if spec.ple is not None:
            state.ple_context = torch.full((spec.ple.context_len,), spec.ple.eos_token_id, dtype=torch.long)
            state.stamps[("ple", -1)] = 0
            for layer in spec.ple.layers:
                state.stamps[("ple_conv", layer)] = 0
                state.ple_conv[layer] = torch.zeros(spec.hc_count * spec.hidden_size, spec.ple.conv_state_len, dtype=dtype)
        return state

    @property
    def qsa_ingested(self) -> int:
        if not self.qsa_keys:
            return self.kv_tokens
        counts = {int(k.shape[0]) for k in self.qsa_keys.values()}
        # every QSA layer ingests the same tokens; a disagreement is itself a desync worth surfacing
        return min(counts) if len(counts) == 1 else -1


@attrs.frozen
class StateSnapshot:
    """The non-KV state of a sequence at `position` (deep copies). KV and QSA keys are positional: a
    restore rewinds their cursors to `position` and drops what lies past it."""

    position: int
    gdn_conv: dict[int, torch.Tensor]
    gdn_recurrent: dict[int, torch.Tensor]
    ple_context: torch.Tensor | None
    ple_conv: dict[int, torch.Tensor]
    stamps: dict[tuple[str, int], int] = attrs.Factory(dict)

    @property
    def nbytes(self) -> int:
        """What it holds, the quantity Capacities.ring_slot_bytes derives."""
        tensors = [*self.gdn_conv.values(), *self.gdn_recurrent.values(), *self.ple_conv.values()]
        if self.ple_context is not None:
            tensors.append(self.ple_context)
        return sum(t.numel() * t.element_size() for t in tensors)


class KvPool:
    """Paged KV for every attention layer: [num_blocks, block_size, kv_heads, head_dim] per layer."""

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, layers: tuple[int, ...] | None = None
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_kv_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        layers = spec.attention_layers if layers is None else layers
        self.keys = {layer: torch.zeros(shape, dtype=dtype) for layer in layers}
        self.values = {layer: torch.zeros(shape, dtype=dtype) for layer in layers}
        # each slot's position stamp, written with its K/V row (-1: never written): a sequence's KV cursor is
        # measured from these, never counted beside them
        self.positions = {layer: torch.full((num_blocks * block_size,), -1, dtype=torch.long) for layer in layers}

    def slots(self, block_table: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset) of positions [start, end): `start` a RowOffset where the rows
        continue a sequence (atlas_kernels.rows.check_rows: typed, inside the table)."""
        check_rows(start, end - start, len(block_table), self.block_size, what="kv slots")
        needed = -(-end // self.block_size)
        table = torch.tensor(block_table[:needed], dtype=torch.long)
        if needed and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block table {list(block_table[:needed])} names a block outside [0, {self.num_blocks})")
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys[layer].view(-1, *k.shape[1:])[slots] = k
        self.values[layer].view(-1, *v.shape[1:])[slots] = v
        self.positions[layer][slots] = positions

    def forget(self, layer: int, slots: torch.Tensor) -> None:
        """Invalidate the stamps of `slots`: a table's slots past what its sequence has written, which may still
        carry another sequence's stamps (a reused block)."""
        self.positions[layer][slots] = -1

    def stamped(self, layer: int, block_table: tuple[int, ...], upto: int) -> int:
        """How many consecutive positions from 0 (up to `upto`) hold their own row in `block_table`'s slots."""
        if upto <= 0:
            return 0
        upto = min(upto, len(block_table) * self.block_size)
        slots = self.slots(block_table, 0, upto)
        good = self.positions[layer][slots] == torch.arange(upto)
        return upto if bool(good.all()) else int(torch.argmin(good.to(torch.int8)))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.keys[layer].view(-1, *self.keys[layer].shape[2:])[slots],
                self.values[layer].view(-1, *self.values[layer].shape[2:])[slots])
