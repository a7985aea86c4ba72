"""One hyper-connection site (qwen4_exp's mix of hc residual streams into a block input) in two kernels.

    mixed, inject = hyper_site(streams [R, hc*H], norm_w [hc*H], down_w [lowrank (+ hc), hc*H],
                               up_w [hc*H, lowrank], hc, eps)
    normed  = rms_norm per stream (groups of H) * norm_w
    d       = normed @ down_w.T   (the first lowrank columns the mix-down, the last hc the injection if present)
    mixed   = mean_s sigmoid(silu(d[:lowrank]) @ up_w.T)[s] * normed[s]          [R, H]
    inject  = 2 * sigmoid(d[lowrank:])                                             [R, hc] (or None)

The torch path is ~13 kernels a site (norm, GEMM, split, silu, GEMM, sigmoid, the mix, the mean, the
injection's sigmoid and scale; 49 sites a step on the benchmark model); here kernel 1 computes each row's
per-stream rstd and the down product with silu / sigmoid applied, kernel 2 the up product, the mix and the
mean. Programs own a tile of rows and of output columns: the reductions run over fixed tiles in a fixed
order, so a row's result does not depend on the other rows (for a fixed block_m).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _hyper_down_kernel(
    x_ptr, norm_ptr, w_ptr, act_ptr, inject_ptr, rstd_ptr, rows, hidden, lowrank, n_out, eps,
    HC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = r < rows
    width = HC * hidden
    ks = tl.arange(0, BK)
    streams = tl.arange(0, HC)
    # pass 1: sum of squares per (row, stream); BK divides hidden, so a tile lies in one stream
    sq = tl.zeros((BM, HC), dtype=tl.float32)
    for k0 in range(0, width, BK):
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * width + (k0 + ks)[None, :], mask=r_ok[:, None],
                    other=0.0).to(tl.float32)
        part = tl.sum(x * x, 1)
        sq = tl.where(streams[None, :] == k0 // hidden, sq + part[:, None], sq)
    rstd = tl.rsqrt(sq / hidden + eps)  # [BM, HC]
    if tl.program_id(1) == 0:
        tl.store(rstd_ptr + r[:, None] * HC + streams[None, :], rstd, mask=r_ok[:, None])
    # pass 2: d = normed @ w.T for this program's output columns
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < n_out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, width, BK):
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * width + (k0 + ks)[None, :], mask=r_ok[:, None],
                    other=0.0).to(tl.float32)
        s_rstd = tl.sum(tl.where(streams[None, :] == k0 // hidden, rstd, 0.0), 1)
        scale = tl.load(norm_ptr + k0 + ks).to(tl.float32)
        normed = (x * s_rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * scale[None, :]
        normed = normed.to(w_ptr.dtype.element_ty)  # rounded as the torch path's normed tensor
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * width + (k0 + ks)[None, :], mask=c_ok[:, None], other=0.0)
        acc = tl.dot(normed, tl.trans(w), acc, input_precision=PRECISION)
    d = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    is_down = cols < lowrank
    tl.store(act_ptr + r[:, None] * lowrank + cols[None, :], (d * tl.sigmoid(d)).to(act_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (c_ok & is_down)[None, :])
    tl.store(inject_ptr + r[:, None] * HC + (cols - lowrank)[None, :],
             (2.0 * tl.sigmoid(d)).to(inject_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (c_ok & ~is_down)[None, :])


@triton.jit
def _hyper_up_kernel(
    x_ptr, norm_ptr, w_ptr, act_ptr, rstd_ptr, out_ptr, rows, hidden, lowrank,
    HC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = r < rows
    width = HC * hidden
    h = tl.program_id(1) * BN + tl.arange(0, BN)
    h_ok = h < hidden
    ks = tl.arange(0, BK)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in tl.static_range(HC):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, lowrank, BK):
            k_ok = (k0 + ks) < lowrank
            a = tl.load(act_ptr + r[:, None] * lowrank + (k0 + ks)[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + (s * hidden + h).to(tl.int64)[:, None] * lowrank + (k0 + ks)[None, :],
                        mask=h_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        mix = tl.sigmoid(acc.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        rstd = tl.load(rstd_ptr + r * HC + s, mask=r_ok, other=0.0)
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * width + (s * hidden + h)[None, :],
                    mask=r_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        scale = tl.load(norm_ptr + s * hidden + h, mask=h_ok, other=0.0).to(tl.float32)
        normed = ((x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32) * scale[None, :])
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        total += (mix.to(tl.float32) * normed).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r[:, None] * hidden + h[None, :], (total / HC).to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & h_ok[None, :])


def block_sizes(rows: int, hidden: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k); block_k divides hidden (a k tile lies in one stream)."""
    bk = 128
    while hidden % bk:
        bk //= 2
    if bk < 16:
        raise ValueError(f"hyper_site needs hidden divisible by 16, got {hidden}")
    return (16 if rows <= 16 else 64), 32, bk


def hyper_site(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
               lowrank: int, eps: float, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mixed [..., H], inject [..., hc] or None) for streams [..., hc*H] (see the module docstring)."""
    lead, width = streams.shape[:-1], streams.shape[-1]
    hidden = width // hc
    n_out = lowrank + (hc if combine else 0)
    if down_w.shape != (n_out, width) or up_w.shape != (width, lowrank) or norm_w.shape != (width,):
        raise ValueError(f"hyper_site: streams [.., {width}], hc {hc}, lowrank {lowrank}, combine {combine}: "
                         f"down_w {tuple(down_w.shape)}, up_w {tuple(up_w.shape)}, norm_w {tuple(norm_w.shape)}")
    x = streams.reshape(-1, width).contiguous()
    rows = x.shape[0]
    bm, bn, bk = block_sizes(rows, hidden)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(rows, lowrank, dtype=x.dtype, device=x.device)
    inject = torch.empty(rows, hc, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, hc, dtype=torch.float32, device=x.device)
    warps = 4 if bm <= 16 else 8
    _hyper_down_kernel[(triton.cdiv(rows, bm), triton.cdiv(n_out, bn))](
        x, norm_w, down_w.contiguous(), act, inject, rstd, rows, hidden, lowrank, n_out, eps,
        HC=hc, BM=bm, BN=bn, BK=bk, PRECISION=precision, num_warps=warps)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _hyper_up_kernel[(triton.cdiv(rows, bm), triton.cdiv(hidden, bn))](
        x, norm_w, up_w.contiguous(), act, rstd, out, rows, hidden, lowrank,
        HC=hc, BM=bm, BN=bn, BK=64, PRECISION=precision, num_warps=warps)
    return out.view(*lead, hidden), (inject.view(*lead, hc) if combine else None)
