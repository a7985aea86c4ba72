"""One hyper-connection site at decode's few rows (at most ROWS of them) in two GEMV-shaped kernels.

    mixed, inject = hyper_small(streams [R, hc*H], norm_w [hc*H], down_w [lowrank (+ hc), hc*H],
                                up_w [hc*H, lowrank], hc, lowrank, eps, combine)

the same function as atlas.backends.cuda.layers.hyper_block (and atlas_kernels.hyper.hyper_site), rounded where
the torch form rounds: normed = bf16(bf16(x * rstd) * norm_w); d = bf16(normed @ down_w.T); act = bf16(silu(d));
mix = bf16(sigmoid(bf16(act @ up_w.T))); mixed = bf16(mean_s bf16(mix_s * normed_s)); inject = 2 bf16(sigmoid(d')).

A b1 decode step has 49 sites, each two products of ~5 MB of weights. Inductor made each site ~5 kernels, ~12 us
(H200, session 17: 46 x 11.9 us of a 2.39 ms device step), against ~2.5 us of bytes; hyper_site's four kernels,
shaped for 64-row tiles (tl.dot), took 19.5 us at one row. Here the products are broadcast multiplies and sums
(no tensor-core tile to fill at one row), spread over enough programs to keep every SM loading:

1. `_down_kernel`: each program one (tile of BN outputs, split of SPLIT inputs inside one stream). It first
   reduces its stream's sum of squares (H elements a row, read from L2 by every program of that stream), then
   its split of the normed rows against its BN weight rows: fp32 partials [splits, R, n_out]; the split's first
   column tile also writes the stream's rstd [R, hc].
2. `_up_kernel`: each program BH hidden columns of every stream. It sums the partials in split order (fixed,
   whatever R), rounds, takes silu (and the injection's sigmoid: program 0), then the mix-up rows of its columns
   (hc x BH of them), the sigmoid, the normed streams at its columns (from the rstd), the mix and the mean.

Every reduction runs over fixed tiles in a fixed order per row (the sum of squares by BK chunks, a split's K by
BK chunks, the splits, the streams), so a row's result does not depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)
from atlas_kernels.hyper import site_op

ROWS = 4  # the most rows one launch takes (every row in one program's registers: [ROWS, BN, BK] products)
BN = 16  # mix-down outputs a program owns
MAX_SPLIT = 512  # mix-down inputs a program reduces (inside one stream: split_of(H) divides H)
MAX_BK = 128  # the k step of the mix-down (at most the split)
BH = 16  # hidden columns (of every stream) a mix-up program owns
LOWRANK_BLOCK = 64  # the mix-up's k step over the lowrank activations (it spills 224 B at 4 rows, and was fastest there)
WARPS = 4
# Every loop below has constexpr bounds and is unrolled (tl.static_range), and every product accumulates elementwise
# into a [.., BK] tile summed once after its loop. H200, session 17 run 2: the first form (runtime-bounded loops, a
# cross-lane sum every k step, the partials summed split by split) took 13.2 / 22.2 us a site at one row, its loads
# a serial chain of L2 / DRAM round trips (1 row x 128 elements a step: nothing else in flight). Run 3, this form
# alone (benchmarks/kernels.py --only hyper_decode --decode-rows 1,4): 9.3 / 18.0 us a site at 1 / 4 rows with these
# tiles (11.0-12.9 / 18.3-27.6 at the seven others swept), against the compiled torch form's 14.1 / 17.6 (cuBLAS) and
# 13.0 / 32.2 (Inductor's split reductions) alone; in the model the torch form's site was ~11.9 us (b1 profile)


@triton.jit
def _down_kernel(x_ptr, norm_ptr, w_ptr, part_ptr, rstd_ptr, rows, n_out, eps, HIDDEN: tl.constexpr,
                 HP: tl.constexpr, HC: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    c_ok = cols < n_out
    split = tl.program_id(1)
    width = HC * HIDDEN
    start = split * SPLIT  # inside stream `stream`
    stream = start // HIDDEN
    r = tl.arange(0, RB)
    r_ok = r < rows
    row_base = x_ptr + r.to(tl.int64)[:, None] * width
    # the stream's sum of squares in one load ([RB, HP]; its rows from L2 after the first program)
    hs = tl.arange(0, HP)
    whole = tl.load(row_base + (stream * HIDDEN + hs)[None, :], mask=r_ok[:, None] & (hs < HIDDEN)[None, :],
                    other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(whole * whole, 1) / HIDDEN + eps)
    if tl.program_id(0) == 0 and start % HIDDEN == 0:
        tl.store(rstd_ptr + r * HC + stream, rstd, mask=r_ok)
    ks = tl.arange(0, BK)
    acc = tl.zeros((RB, BN, BK), dtype=tl.float32)
    for k0 in tl.static_range(0, SPLIT, BK):
        k = start + k0 + ks
        x = tl.load(row_base + k[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
        scale = tl.load(norm_ptr + k).to(tl.float32)
        normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * scale[None, :]
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # [RB, BK], rounded as the torch form's
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * width + k[None, :], mask=c_ok[:, None],
                    other=0.0).to(tl.float32)  # [BN, BK]
        acc += normed[:, None, :] * w[None, :, :]
    at = (split * rows + r).to(tl.int64)[:, None] * n_out + cols[None, :]
    tl.store(part_ptr + at, tl.sum(acc, 2), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _up_kernel(x_ptr, norm_ptr, w_ptr, part_ptr, rstd_ptr, out_ptr, inject_ptr, rows, n_out, HIDDEN: tl.constexpr,
               LOWRANK: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr, HC: tl.constexpr, RB: tl.constexpr,
               BH: tl.constexpr, LB: tl.constexpr, COMBINE: tl.constexpr):
    r = tl.arange(0, RB)
    r_ok = r < rows
    dtype = out_ptr.dtype.element_ty
    sp = tl.arange(0, SP)  # SPLITS padded to a power of two
    # [SP, RB, 1] offsets of the partials: every split of a column loaded at once, summed over the splits after
    part_rows = part_ptr + (sp[:, None] * rows + r[None, :]).to(tl.int64)[:, :, None] * n_out
    p_ok = (sp < SPLITS)[:, None, None] & r_ok[None, :, None]
    if COMBINE:
        if tl.program_id(0) == 0:  # the injection: 2 sigmoid of the mix-down's last hc outputs
            s_idx = tl.arange(0, HC)
            e = tl.sum(tl.load(part_rows + LOWRANK + s_idx[None, None, :], mask=p_ok, other=0.0), 0)  # [RB, HC]
            e = tl.sigmoid(e.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            tl.store(inject_ptr + r[:, None] * HC + s_idx[None, :], (2.0 * e).to(dtype), mask=r_ok[:, None])
    # this program's mix-up rows: BH hidden columns of every stream, flattened m = s * BH + c
    m = tl.arange(0, HC * BH)
    stream = m // BH
    h = tl.program_id(0) * BH + m % BH
    w_rows = w_ptr + (stream * HIDDEN + h).to(tl.int64)[:, None] * LOWRANK
    acc = tl.zeros((RB, HC * BH, LB), dtype=tl.float32)
    for l0 in tl.static_range(0, LOWRANK, LB):
        j = l0 + tl.arange(0, LB)
        j_ok = j < LOWRANK
        d = tl.sum(tl.load(part_rows + j[None, None, :], mask=p_ok & j_ok[None, None, :], other=0.0), 0)  # [RB, LB]
        d = d.to(dtype).to(tl.float32)  # rounded as the GEMM's output
        act = (d * tl.sigmoid(d)).to(dtype).to(tl.float32)
        w = tl.load(w_rows + j[None, :], mask=j_ok[None, :], other=0.0).to(tl.float32)  # [HC * BH, LB]
        acc += act[:, None, :] * w[None, :, :]
    u = tl.sum(acc, 2)
    mix = tl.sigmoid(u.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rstd = tl.load(rstd_ptr + r[:, None] * HC + stream[None, :], mask=r_ok[:, None], other=0.0)
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * (HC * HIDDEN) + (stream * HIDDEN + h)[None, :], mask=r_ok[:, None],
                other=0.0).to(tl.float32)
    scale = tl.load(norm_ptr + stream * HIDDEN + h).to(tl.float32)
    normed = ((x * rstd).to(dtype).to(tl.float32) * scale[None, :]).to(dtype).to(tl.float32)
    term = (mix * normed).to(dtype).to(tl.float32)  # [RB, HC * BH]
    total = tl.sum(tl.reshape(term, (RB, HC, BH)), 1)
    out_h = tl.program_id(0) * BH + tl.arange(0, BH)
    tl.store(out_ptr + r[:, None] * HIDDEN + out_h[None, :], (total / HC).to(dtype), mask=r_ok[:, None])


def split_of(hidden: int) -> int:
    """The mix-down's split: the largest power of two up to MAX_SPLIT dividing hidden (a function of the model's size
    alone, never of the row count)."""
    split = MAX_SPLIT
    while split > 1 and hidden % split:
        split //= 2
    return split


def fits(rows: int, hc: int, hidden: int) -> bool:
    """Whether hyper_small takes a site of this shape: at most ROWS rows, hidden a multiple of BH (16; so the split is
    too), and hc a power of two (the injection's [R, hc] tile)."""
    return 0 < rows <= ROWS and hidden % BH == 0 and hc > 0 and hc & (hc - 1) == 0


def hyper_small(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
                lowrank: int, eps: float, combine: bool, tiles: tuple[int, int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mixed [..., H], inject [..., hc] or None) for streams [..., hc*H] of at most ROWS rows (module docstring).
    tiles: (mix-down outputs a program, its k step, the mix-up's k step, warps), the module's defaults when None
    (benchmarks/kernels.py sweeps them)."""
    lead, width = streams.shape[:-1], streams.shape[-1]
    hidden = width // hc
    n_out = lowrank + (hc if combine else 0)
    x = streams.reshape(-1, width)
    rows = x.shape[0]
    if not fits(rows, hc, hidden) or width != hc * hidden:
        raise ValueError(f"hyper_small: {rows} rows (at most {ROWS}), hc {hc} (a power of two), hidden {hidden} (a "
                         f"multiple of {BH})")
    if down_w.shape != (n_out, width) or up_w.shape != (width, lowrank) or norm_w.shape != (width,):
        raise ValueError(f"hyper_small: streams [.., {width}], hc {hc}, lowrank {lowrank}, combine {combine}: "
                         f"down_w {tuple(down_w.shape)}, up_w {tuple(up_w.shape)}, norm_w {tuple(norm_w.shape)}")
    x = x.contiguous()
    rb = triton.next_power_of_2(rows)
    split = split_of(hidden)
    splits = width // split
    part = torch.empty(splits, rows, n_out, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, hc, dtype=torch.float32, device=x.device)
    bn, bk, lb, warps = tiles or (BN, MAX_BK, LOWRANK_BLOCK, WARPS)
    _down_kernel[(triton.cdiv(n_out, bn), splits)](
        x, norm_w, down_w.contiguous(), part, rstd, rows, n_out, eps, HIDDEN=hidden,
        HP=triton.next_power_of_2(hidden), HC=hc, RB=rb, BN=bn, BK=min(bk, split), SPLIT=split, num_warps=warps)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    inject = torch.empty(rows, hc, dtype=x.dtype, device=x.device)
    _up_kernel[(hidden // BH,)](
        x, norm_w, up_w.contiguous(), part, rstd, out, inject, rows, n_out, HIDDEN=hidden, LOWRANK=lowrank,
        SPLITS=splits, SP=triton.next_power_of_2(splits), HC=hc, RB=rb, BH=BH, LB=min(lb, triton.next_power_of_2(lowrank)), COMBINE=combine,
        num_warps=warps)
    return out.view(*lead, hidden), (inject.view(*lead, hc) if combine else None)


site_op("hyper_small", hyper_small)  # torch.ops.atlas.hyper_small (atlas_kernels.hyper.site_op)
