"""A group of sequences fed together: B sequences with T new tokens each, as device tensors.

The host packs every per-step integer (tokens, start positions, state slots, block tables, PLE n-gram ids)
into one int64 tensor and copies it once; everything else is derived on the device, so a decode group is
a fixed-shape function of that one buffer and can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from atlas_kernels.rows import check_rows


@attrs.frozen(cache_hash=True)
class GroupShape:
    """What is static about a group: a CUDA graph is captured per shape. Its hash is computed once (a decode step
    looks its shape up in several dicts: the graphs, the hidden outputs)."""

    batch: int  # B rows of sequences (a graph bucket pads with scratch rows)
    width: int  # T tokens per sequence
    key_blocks: int  # KV blocks read per sequence: keys visible are [0, key_blocks * block_size)
    qsa_select: bool  # some row sees more than the QSA inert bound: compute the sparse selection
    ngram_heads: int  # PLE n-gram ids per token per PLE layer (0 without PLE)
    ple_layers: int
    # a verify: KV / QSA stamps written pending (-(position + 2), counted only once committed)
    pending: bool = False
    # a wide verify: per-slot state after each row goes to the pools' `inter`, the live state is left as it was
    keep: bool = False
    # a group whose PLE n-gram ids are computed on the device from its slots' n-gram context
    # (ple.device_ngram_ids, inside the decode / prefill graph) instead of packed by the host: no ids columns
    # (the runner's groups all do; a verify group packs the host's)
    ngram_on_device: bool = False

    @property
    def columns(self) -> int:
        # tokens, start, slot, sentinel, block table, n-gram ids (none when the device computes them)
        ids = 0 if self.ngram_on_device else self.ple_layers * self.width * self.ngram_heads
        return self.width + 3 + self.key_blocks + ids


@attrs.frozen
class Group:
    """Device views of a packed group buffer [B, columns]."""

    shape: GroupShape
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T] = start + t
    slots: torch.Tensor  # [B] state slot (GDN conv / recurrent, PLE conv)
    block_table: torch.Tensor  # [B, key_blocks]
    ngram_ids: torch.Tensor | None  # [P, B, T, heads]
    write_slots: torch.Tensor  # [B, T] flat KV slot of each new token
    read_slots: torch.Tensor  # [B, L] flat KV slot of key positions 0..L-1
    # [B, T] int32: the position stamp written with each new KV / QSA row (pending in a verify); [B] the flat KV
    # slot of the first position past the group (its stamp is cleared: the stamps' chain from 0 ends there)
    stamps: torch.Tensor
    sentinel: torch.Tensor
    # [B] int32: the stamp every per-slot state the group advances gets (its last position + 1), computed once
    # a group rather than at each of its ~40 state writes (two kernels each: 80 launches of a decode step)
    ends: torch.Tensor
    # the paged stamps' (flat slots, values) every attention layer writes: the new rows' stamps, then -1 at the
    # sentinel; the same for each layer, so built once a group (3 kernels x 6 layers of a decode step)
    stamp_at: torch.Tensor
    stamp_values: torch.Tensor

    @classmethod
    def view(cls, packed: torch.Tensor, shape: GroupShape, block_size: int,
             columns: Callable[..., tuple[torch.Tensor, ...]] | None = None) -> Group:
        """The group of a packed buffer. `columns`: group_columns itself (default) or a compiled version of it (a
        compiled decode's: its ~17 launches one region)."""
        b, t, kb = shape.batch, shape.width, shape.key_blocks
        tokens, positions, slots, sentinel, table, write, read, stamps, ends, stamp_at, stamp_values = (
            columns or group_columns)(packed, t, kb, block_size, shape.pending)
        ngram = None
        if shape.ple_layers and not shape.ngram_on_device:  # (on the device: filled in by the runner's group)
            ngram = packed[:, t + 3 + kb :].reshape(b, shape.ple_layers, t, shape.ngram_heads).transpose(0, 1)
        return cls(shape, tokens, positions, slots, table, ngram, write, read, stamps, sentinel, ends, stamp_at,
                   stamp_values)


def group_columns(packed: torch.Tensor, t: int, kb: int, block_size: int, pending: bool) -> tuple[torch.Tensor, ...]:
    """A packed buffer's columns and what every layer derives from them (pure): tokens, positions, slots, sentinel,
    the block table, the new rows' flat KV slots, the key positions' flat slots, the rows' stamps, the states' end
    stamp and the paged stamps' (flat slots, values)."""
    b = packed.shape[0]
    tokens = packed[:, :t]
    start = packed[:, t]
    # kernels index slots as a dense [B] array; a copy even at B = 1, where .contiguous() would keep the view's
    # stride (the packed width): a compiled prefill region guards on it and would recompile per chunk width
    slots = packed[:, t + 1].clone(memory_format=torch.contiguous_format)
    sentinel = packed[:, t + 2]
    table = packed[:, t + 3 : t + 3 + kb].contiguous()  # the paged kernel reads it as a dense [B, kb] array
    positions = start[:, None] + torch.arange(t, device=packed.device)[None, :]
    write = table.gather(1, positions // block_size) * block_size + positions % block_size
    offsets = torch.arange(block_size, device=packed.device)
    read = (table[:, :, None] * block_size + offsets).reshape(b, kb * block_size)
    stamps = (-(positions + 2) if pending else positions).to(torch.int32)
    ends = (start + t).to(torch.int32)
    stamp_at = torch.cat([write.reshape(-1), sentinel])
    stamp_values = torch.cat([stamps.reshape(-1), torch.full_like(sentinel, -1, dtype=torch.int32)])
    return tokens, positions, slots, sentinel, table, write, read, stamps, ends, stamp_at, stamp_values


Row = tuple[Sequence[int], int, int, Sequence[int], list[list[int]]]  # tokens, start, slot, block table, n-gram ids


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, or nested lists) as a tensor on `device`, queued behind the stream's work: through pinned
    memory on a CUDA device, where a pageable copy (torch.tensor(..., device=) included) first waits for the whole
    stream, so the host could not queue the next kernels while the device ran (the verify's verdicts and commit,
    the drafter's steps: each of them a round trip)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def sentinel_slot(table: list[int] | tuple[int, ...], end: int, block_size: int, scratch_block: int) -> int:
    """The flat KV slot of position `end` through the whole block table (the scratch block's if the table ends
    before it): a group clears its stamp, so rows a block held for an earlier owner never extend the chain."""
    block = table[end // block_size] if end // block_size < len(table) else scratch_block
    return block * block_size + end % block_size


def pack_rows(shape: GroupShape, rows: list[Row], scratch_slots: tuple[int, ...], scratch_block: int,
              block_size: int) -> torch.Tensor:
    """Host buffer for `rows` of (tokens, start, slot, block table, n-gram ids per PLE layer flattened),
    padded to shape.batch with scratch rows: each its own scratch state slot (kernels require distinct
    slots in one launch), all writing KV into the scratch block."""
    kb = shape.key_blocks
    out: list[int] = []  # one flat list, then numpy: torch.tensor of nested int lists is ~2x slower (64 x 16 ids)
    put = out.extend
    scratch = scratch_block * block_size
    for tokens, start, slot, table, ngram in rows:
        if len(tokens) > 1:  # a prefill chunk or a verify: its typed start, inside its table (a decode: one row)
            check_rows(start, len(tokens), len(table), block_size, what="group row")
        put(tokens)
        put((start, slot, sentinel_slot(table, start + len(tokens), block_size, scratch_block)))
        put(table[:kb])
        if len(table) < kb:
            put([scratch_block] * (kb - len(table)))
        for layer in ngram:
            put(layer)
    ids = 0 if shape.ngram_on_device else shape.ple_layers * shape.width * shape.ngram_heads
    for i in range(shape.batch - len(rows)):
        put([0] * shape.width + [0, scratch_slots[i], scratch] + [scratch_block] * kb + [0] * ids)
    return torch.from_numpy(np.array(out, dtype=np.int64).reshape(shape.batch, shape.columns))
