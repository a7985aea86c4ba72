"""The per-step stamp summary (atlas.backends.cuda.stamp_read) as one kernel: a program per state slot.

For slot r, with L = tables[r, 0] (its block table's length in positions) and the table's blocks tables[r, 1:]:

- per paged kind a (KV rows, QSA keys of each attention layer): the leading run of positions p = 0, 1, ... below
  min(L, width * block_size) whose row holds its own position (paged_pos[a, block(p), p % block_size] == p);
- every per-slot stamp (stamps[:, r]: GDN conv and recurrent, PLE conv and context);
- the drafter's leading run of rows holding their own index (drafter_pos[r, i] == i), when there is a drafter;
- the least and the greatest of the paged runs and per-slot stamps (equal: a uniform, healthy row).

The torch form it replaces (`StampReader._summary`, still the CPU path and this kernel's reference in
tests/test_kernels_stamp_summary.py) is ~20 small ops; measured on the H200 (benchmarks/stamp_read.py --device cuda)
its graph replay, copy and wait took 0.11 ms at batch 1 and 0.17 ms at batch 64, most of it those
kernels' launches inside the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _stamp_summary_kernel(
    tables_ptr, table_stride, pos_ptr, pos_kind_stride, stamps_ptr, slots_total, drafter_ptr, drafter_cap,
    out_ptr, out_stride, span,
    A: tl.constexpr, AP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr,
    HAS_DRAFTER: tl.constexpr,
):
    # every paged kind's run in one [AP, BLOCK] tile a chunk of positions (one table load, one dependent load of
    # all kinds' rows), not a kind at a time: the program's time is its chain of dependent loads
    r = tl.program_id(0)
    row = tables_ptr + r.to(tl.int64) * table_stride
    length = tl.load(row).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    kinds = tl.arange(0, AP)
    big = 2147483647
    least = big
    greatest = -big - 1
    if A > 0:
        first = tl.full([AP], big, tl.int32)
        for c0 in range(0, span, BLOCK):
            p = c0 + offs
            inb = p < span
            blk = tl.load(row + 1 + p // BS, mask=inb, other=0)
            cell = blk * BS + p % BS
            ok = (kinds < A)[:, None] & inb[None, :]
            got = tl.load(pos_ptr + kinds[:, None] * pos_kind_stride + cell[None, :], mask=ok, other=-1)
            bad = (got != p[None, :]) | (p >= length)[None, :]
            first = tl.minimum(first, tl.min(tl.where(bad & inb[None, :], p[None, :], big), axis=1))
        first = tl.minimum(first, span)  # a run with no failure below the span is the span
        tl.store(out_ptr + r * out_stride + kinds, first, mask=kinds < A)
        least = tl.min(tl.where(kinds < A, first, big), axis=0)
        greatest = tl.max(tl.where(kinds < A, first, -big - 1), axis=0)
    if S > 0:
        so = tl.arange(0, SP)
        st = tl.load(stamps_ptr + so * slots_total + r, mask=so < S, other=0)
        tl.store(out_ptr + r * out_stride + A + so, st, mask=so < S)
        least = tl.minimum(least, tl.min(tl.where(so < S, st, big), axis=0))
        greatest = tl.maximum(greatest, tl.max(tl.where(so < S, st, -big - 1), axis=0))
    col = A + S
    if HAS_DRAFTER:
        run = drafter_cap
        drow = drafter_ptr + r.to(tl.int64) * drafter_cap
        for c0 in range(0, drafter_cap, BLOCK):
            p = c0 + offs
            inb = p < drafter_cap
            got = tl.load(drow + p, mask=inb, other=-1)
            run = tl.minimum(run, tl.min(tl.where(inb & (got != p), p, big), axis=0))
        tl.store(out_ptr + r * out_stride + col, run)
        col += 1
    tl.store(out_ptr + r * out_stride + col, least)
    tl.store(out_ptr + r * out_stride + col + 1, greatest)


def stamp_summary(tables: torch.Tensor, paged_pos: torch.Tensor, stamps: torch.Tensor,
                  drafter_pos: torch.Tensor | None, *, hi: int, width: int, block_size: int) -> torch.Tensor:
    """[hi, A + S (+ 1) + 2] int32, as StampReader._summary lays it out (see the module docstring).

    tables: [slots, 1 + cols] int64 (column 0 the length in positions); paged_pos: [A, blocks, block_size] int32;
    stamps: [S, slots] int32; drafter_pos: [slots, capacity] int32 or None. Slots [0, hi), table columns [0, width).
    """
    a = paged_pos.shape[0]
    s = stamps.shape[0]
    if a + s == 0:
        raise ValueError("stamp_summary needs at least one paged kind or per-slot stamp (the torch summary covers "
                         "a model of drafter rows only)")
    if width > tables.shape[1] - 1:
        raise ValueError(f"width {width} is past the tables' {tables.shape[1] - 1} block columns")
    tables, paged_pos, stamps = tables.contiguous(), paged_pos.contiguous(), stamps.contiguous()
    dr = drafter_pos is not None
    cols = a + s + (1 if dr else 0) + 2
    out = torch.empty(hi, cols, dtype=torch.int32, device=tables.device)
    if hi == 0:
        return out
    if dr:
        drafter_pos = drafter_pos.contiguous()
    _stamp_summary_kernel[(hi,)](
        tables, tables.shape[1], paged_pos, paged_pos.shape[1] * paged_pos.shape[2], stamps, stamps.shape[1],
        drafter_pos if dr else stamps, drafter_pos.shape[1] if dr else 0, out, cols, width * block_size,
        A=a, AP=triton.next_power_of_2(max(a, 1)), S=s, SP=triton.next_power_of_2(max(s, 1)), BS=block_size,
        BLOCK=max(16, min(256, 4096 // triton.next_power_of_2(max(a, 1)))), HAS_DRAFTER=dr,
    )
    return out
