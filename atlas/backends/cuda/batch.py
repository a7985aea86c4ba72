"""A group of sequences fed together: B sequences with T new tokens each, as device tensors.

The host packs every per-step integer (tokens, start positions, state slots, block tables, PLE n-gram ids)
into one int64 tensor and copies it once; everything else is derived on the device, so a decode group is
a fixed-shape function of that one buffer and can be captured in a CUDA graph.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class GroupShape:
    """What is static about a group: a CUDA graph is captured per shape."""

    batch: int  # B rows of sequences (a graph bucket pads with scratch rows)
    width: int  # T tokens per sequence
    key_blocks: int  # KV blocks read per sequence: keys visible are [0, key_blocks * block_size)
    qsa_select: bool  # some row sees more than the QSA inert bound: compute the sparse selection
    ngram_heads: int  # PLE n-gram ids per token per PLE layer (0 without PLE)
    ple_layers: int

    @property
    def columns(self) -> int:
        # tokens, start, slot, block table, n-gram ids
        return self.width + 2 + self.key_blocks + self.ple_layers * self.width * self.ngram_heads


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

    @classmethod
    def view(cls, packed: torch.Tensor, shape: GroupShape, block_size: int) -> Group:
        b, t, kb = shape.batch, shape.width, shape.key_blocks
        tokens = packed[:, :t]
        start = packed[:, t]
        slots = packed[:, t + 1].contiguous()  # kernels index slots as a dense [B] array
        table = packed[:, t + 2 : t + 2 + kb]
        ngram = None
        if shape.ple_layers:
            ngram = packed[:, t + 2 + kb :].reshape(b, shape.ple_layers, t, shape.ngram_heads).transpose(0, 1)
        positions = start[:, None] + torch.arange(t, device=packed.device)[None, :]
        write = table.gather(1, positions // block_size) * block_size + positions % block_size
        offsets = torch.arange(block_size, device=packed.device)
        read = (table[:, :, None] * block_size + offsets).reshape(b, kb * block_size)
        return cls(shape, tokens, positions, slots, table, ngram, write, read)


Row = tuple[list[int], int, int, list[int], list[list[int]]]


def pack_rows(shape: GroupShape, rows: list[Row], scratch_slots: tuple[int, ...], scratch_block: int) -> torch.Tensor:
    """Host buffer for `rows` of (tokens, start, slot, block table, n-gram ids per PLE layer flattened),
    padded to shape.batch with scratch rows: each its own scratch state slot (kernels require distinct
    slots in one launch), all writing KV into the scratch block."""
    kb = shape.key_blocks
    out = []
    for tokens, start, slot, table, ngram in rows:
        table = list(table[:kb]) + [scratch_block] * (kb - min(kb, len(table)))
        flat = [i for layer in ngram for i in layer]
        out.append([*tokens, start, slot, *table, *flat])
    for i in range(shape.batch - len(rows)):
        pad = [0] * shape.width + [0, scratch_slots[i]] + [scratch_block] * kb
        out.append(pad + [0] * (shape.ple_layers * shape.width * shape.ngram_heads))
    return torch.tensor(out, dtype=torch.long)
