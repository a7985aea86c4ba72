"""One hyper-connection site (qwen4_exp's mix of hc residual streams into a block input) in four kernels.

    mixed, inject = hyper_site(streams [R, hc*H], norm_w [hc*H], down_w [lowrank (+ hc), hc*H],
                               up_w [hc*H, lowrank], hc, eps)
    normed  = rms_norm per stream (groups of H) * norm_w
    d       = normed @ down_w.T   (the first lowrank columns the mix-down, the last hc the injection if present)
    mixed   = mean_s sigmoid(silu(d[:lowrank]) @ up_w.T)[s] * normed[s]          [R, H]
    inject  = 2 * sigmoid(d[lowrank:])                                             [R, hc] (or None)

The torch path is ~13 kernels a site (norm, GEMM, split, silu, GEMM, sigmoid, the mix, the mean, the
injection's sigmoid and scale; 49 sites a step on the benchmark model). Here:

1. `_hyper_norm_kernel`: each program one (tile of 4 rows, stream): the stream's sum of squares in one
   [4, H] tile, the normed rows written (rounded as the torch path's normed tensor).
2. `_hyper_down_kernel`: split-K mix-down GEMM. Each program one (64-row tile, 32-column tile, split of
   SPLIT = min(512, H) input columns) and writes an fp32 partial [splits, R, n_out]. H200 run 3 measured the
   previous one-pass kernel (rstd and the whole 8,192-column reduction serial in each of 11 programs at batch
   1) at 3.75 ms of an 8.1 ms decode step (76 us a site): at batch 1 it now has 11 x 16 = 176 programs of
   4 k-steps each instead of 11 of 128.
3. `_hyper_act_kernel`: the partials summed in split order, silu (mix-down) / 2 sigmoid (injection).
4. `_hyper_up_kernel`: the mix-up product, sigmoid, the mix with the normed streams, the mean over streams.

Batch invariance: every tile size (rows, columns, k step, split) is a constant of the model's sizes, never of
the row count, and every reduction (the sum of squares, the k loop inside a split, the splits, the streams)
runs over fixed tiles in a fixed order, so a row's result does not depend on the other rows or how many
there are (tested: one row alone equals the same row among 100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)

BLOCK_M = 64  # rows a GEMM program owns (fixed: a row-count-dependent tile would change tl.dot's shape)
BLOCK_N = 32  # output columns a mix-down / mix-up program owns
NORM_ROWS = 4  # rows a norm program owns ([4, H] fp32 in registers: 32 a thread at H = 2048, 8 warps)
MAX_SPLIT = 512  # mix-down input columns a program reduces (16 splits at hc = 4, H = 2048)
# warps per kernel, from the sm_90 compile report (compile_report.py): 4 warps spill the mix-up kernel (255
# registers + 448 bytes) and put the norm at 255; 8 warps spill nothing (178 / 168). The mix-down at 4 warps
# and a 128-column k step: 168 registers, no spill (its k loop fully unrolled: 255 and 1,192 bytes of spills)
NORM_WARPS, DOWN_WARPS, ACT_WARPS, UP_WARPS = 8, 4, 4, 8


@triton.jit
def _hyper_norm_kernel(x_ptr, norm_ptr, normed_ptr, rows, hidden, eps, HC: tl.constexpr, BM: tl.constexpr,
                       BH: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    s = tl.program_id(1)
    h = tl.arange(0, BH)
    h_ok = h < hidden
    ok = (r < rows)[:, None] & h_ok[None, :]
    offs = r.to(tl.int64)[:, None] * (HC * hidden) + (s * hidden + h)[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)  # [BM]
    scale = tl.load(norm_ptr + s * hidden + h, mask=h_ok, other=0.0).to(tl.float32)
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * scale[None, :]
    tl.store(normed_ptr + offs, normed.to(normed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _hyper_down_kernel(normed_ptr, w_ptr, part_ptr, rows, width, n_out, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = r < rows
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < n_out
    split = tl.program_id(2)
    ks = split * SPLIT + tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, SPLIT, BK):
        a = tl.load(normed_ptr + r.to(tl.int64)[:, None] * width + (k0 + ks)[None, :], mask=r_ok[:, None],
                    other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * width + (k0 + ks)[None, :], mask=c_ok[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    at = (split * rows + r).to(tl.int64)[:, None] * n_out + cols[None, :]
    tl.store(part_ptr + at, acc, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _hyper_act_kernel(part_ptr, act_ptr, inject_ptr, rows, lowrank, n_out, splits, HC: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = r < rows
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < n_out
    ok = r_ok[:, None] & c_ok[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for split in range(0, splits):  # the splits in a fixed order, whatever the row count
        acc += tl.load(part_ptr + (split * rows + r).to(tl.int64)[:, None] * n_out + cols[None, :], mask=ok,
                       other=0.0)
    d = acc.to(act_ptr.dtype.element_ty).to(tl.float32)  # rounded as the torch path's GEMM output
    is_down = cols < lowrank
    tl.store(act_ptr + r[:, None] * lowrank + cols[None, :], (d * tl.sigmoid(d)).to(act_ptr.dtype.element_ty),
             mask=ok & is_down[None, :])
    tl.store(inject_ptr + r[:, None] * HC + (cols - lowrank)[None, :],
             (2.0 * tl.sigmoid(d)).to(inject_ptr.dtype.element_ty), mask=ok & ~is_down[None, :])


@triton.jit
def _hyper_up_kernel(normed_ptr, w_ptr, act_ptr, out_ptr, rows, hidden, lowrank, HC: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
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
        normed = tl.load(normed_ptr + r.to(tl.int64)[:, None] * width + (s * hidden + h)[None, :],
                         mask=r_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        total += (mix.to(tl.float32) * normed).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r[:, None] * hidden + h[None, :], (total / HC).to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & h_ok[None, :])


def split_sizes(hidden: int) -> tuple[int, int]:
    """(split, block_k) of the mix-down: functions of the hidden size alone (never of the row count), so a
    row's reduction order is the same whatever the batch. A split lies in one stream and block_k divides it."""
    if hidden % 16:
        raise ValueError(f"hyper_site needs hidden divisible by 16, got {hidden}")
    split = MAX_SPLIT
    while hidden % split:
        split //= 2
    return split, min(128, split)


def hyper_site(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
               lowrank: int, eps: float, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mixed [..., H], inject [..., hc] or None) for streams [..., hc*H] (see the module docstring)."""
    lead, width = streams.shape[:-1], streams.shape[-1]
    hidden = width // hc
    n_out = lowrank + (hc if combine else 0)
    if down_w.shape != (n_out, width) or up_w.shape != (width, lowrank) or norm_w.shape != (width,):
        raise ValueError(f"hyper_site: streams [.., {width}], hc {hc}, lowrank {lowrank}, combine {combine}: "
                         f"down_w {tuple(down_w.shape)}, up_w {tuple(up_w.shape)}, norm_w {tuple(norm_w.shape)}")
    split, bk = split_sizes(hidden)
    splits = width // split
    x = streams.reshape(-1, width).contiguous()
    rows = x.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    normed = torch.empty_like(x)
    _hyper_norm_kernel[(triton.cdiv(rows, NORM_ROWS), hc)](
        x, norm_w, normed, rows, hidden, eps, HC=hc, BM=NORM_ROWS, BH=triton.next_power_of_2(hidden),
        num_warps=NORM_WARPS)
    part = torch.empty(splits, rows, n_out, dtype=torch.float32, device=x.device)
    _hyper_down_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n_out, BLOCK_N), splits)](
        normed, down_w.contiguous(), part, rows, width, n_out, BM=BLOCK_M, BN=BLOCK_N, BK=bk, SPLIT=split,
        PRECISION=precision, num_warps=DOWN_WARPS)
    act = torch.empty(rows, lowrank, dtype=x.dtype, device=x.device)
    inject = torch.empty(rows, hc, dtype=x.dtype, device=x.device)
    _hyper_act_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n_out, BLOCK_N))](
        part, act, inject, rows, lowrank, n_out, splits, HC=hc, BM=BLOCK_M, BN=BLOCK_N, num_warps=ACT_WARPS)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _hyper_up_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(hidden, BLOCK_N))](
        normed, up_w.contiguous(), act, out, rows, hidden, lowrank, HC=hc, BM=BLOCK_M, BN=BLOCK_N, BK=64,
        PRECISION=precision, num_warps=UP_WARPS)
    return out.view(*lead, hidden), (inject.view(*lead, hc) if combine else None)


def site_op(name: str, site):  # type: ignore[no-untyped-def]
    """A whole-site function (hyper_site, hyper_small.hyper_small) as the torch custom op atlas::{name}, so a compiled
    decode region (Tuning.decode_hyper) calls its kernels as opaque launches: (mixed [.., H], inject [.., hc], or
    [.., 0] when not combine). down_w has exactly lowrank (+ hc) rows (the caller drops the fused weight's alignment
    rows)."""

    def run(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
            lowrank: int, eps: float, combine: bool) -> tuple[torch.Tensor, torch.Tensor]:
        mixed, inject = site(streams, norm_w, down_w, up_w, hc, lowrank, eps, combine)
        return mixed, (inject if inject is not None else streams.new_empty((*streams.shape[:-1], 0)))

    def fake(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
             lowrank: int, eps: float, combine: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lead = streams.shape[:-1]
        return streams.new_empty((*lead, streams.shape[-1] // hc)), streams.new_empty((*lead, hc if combine else 0))

    op = torch.library.custom_op(f"atlas::{name}", run, mutates_args=())
    op.register_fake(fake)
    return op


site_op("hyper_site", hyper_site)


@triton.jit
def _stream_term(acc, normed_rows, r_ok, ty: tl.constexpr):
    """One stream's share of the mix: sigmoid(its mix-up product) x its normed tile, rounded as the torch form's."""
    mix = tl.sigmoid(acc.to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return (mix * tl.load(normed_rows, mask=r_ok[:, None], other=0.0).to(tl.float32)).to(ty).to(tl.float32)


@triton.jit
def _k_tile(ptrs, k_ok, EVEN: tl.constexpr):
    """One stream's [BN, BK] up_w tile: unmasked when the lowrank is a multiple of the k step."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_ok[None, :], other=0.0)


@triton.jit
def _mix_up_kernel(normed_ptr, w_ptr, act_ptr, out_ptr, rows, normed_stride, act_stride,
                   HIDDEN: tl.constexpr, LOWRANK: tl.constexpr, HC: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """mix_up's program: one [BM rows, BN hidden columns] tile of the mixed output, every stream's product in one k
    loop (HC <= 4): one load of an act tile serves the HC products, HC accumulators live at once. A loop over the
    streams (an act tile reloaded a stream) measured slower at every tile (H200 session 15 run 2: 85.0 us at best
    against 65.0, 2,048 rows) and was removed."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = r < rows
    h = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_rows = act_ptr + r.to(tl.int64)[:, None] * act_stride + ks[None, :]
    w_rows = w_ptr + h[:, None] * LOWRANK + ks[None, :]
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, LOWRANK, BK):
        if LOWRANK % BK == 0:  # unmasked (masks the compiler cannot fold cost 190 -> 255 registers and a spill)
            a = tl.load(a_rows + k0, mask=r_ok[:, None], other=0.0)
            k_ok = tl.full((BK,), 1, tl.int1)
        else:
            k_ok = (k0 + ks) < LOWRANK
            a = tl.load(a_rows + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc0 = tl.dot(a, tl.trans(_k_tile(w_rows + k0, k_ok, LOWRANK % BK == 0)), acc0, input_precision=PRECISION)
        if HC > 1:
            acc1 = tl.dot(a, tl.trans(_k_tile(w_rows + HIDDEN * LOWRANK + k0, k_ok, LOWRANK % BK == 0)), acc1,
                          input_precision=PRECISION)
        if HC > 2:
            acc2 = tl.dot(a, tl.trans(_k_tile(w_rows + 2 * HIDDEN * LOWRANK + k0, k_ok, LOWRANK % BK == 0)), acc2,
                          input_precision=PRECISION)
        if HC > 3:
            acc3 = tl.dot(a, tl.trans(_k_tile(w_rows + 3 * HIDDEN * LOWRANK + k0, k_ok, LOWRANK % BK == 0)), acc3,
                          input_precision=PRECISION)
    n_rows = normed_ptr + r.to(tl.int64)[:, None] * normed_stride + h[None, :]
    ty: tl.constexpr = out_ptr.dtype.element_ty
    total = _stream_term(acc0, n_rows, r_ok, ty)
    if HC > 1:
        total += _stream_term(acc1, n_rows + HIDDEN, r_ok, ty)
    if HC > 2:
        total += _stream_term(acc2, n_rows + 2 * HIDDEN, r_ok, ty)
    if HC > 3:
        total += _stream_term(acc3, n_rows + 3 * HIDDEN, r_ok, ty)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * HIDDEN + h[None, :], (total / HC).to(ty), mask=r_ok[:, None])


# mix_up's launch schedules: (rows, columns, k step, warps, pipeline stages) of a program. A prefill chunk's site
# (2,048 rows at H = 2,048, lowrank 320, hc 4) is ~11 GFLOP of mix-up product over 32 MB of normed streams.
# sm_90 compile report (bf16): 186 / 134 / 190 / 182 registers, no spill. H200, session 15 run 2 (`benchmarks/kernels.py
# --only mix_up`, 2,048 / 8,192 rows): 75.3 / 282.4, 72.5 / 264.5, **65.0 / 235.9**, 77.1 / 294.5 us, against the torch
# form compiled (cuBLAS's product + Inductor's pass) 45.6 / 158.2 us; in the model (run 1, the loop form removed since)
# the prefill's device time went 21.8 -> 23.2 ms, so prefill_mix_up stays "inductor"
MIX_UP_SCHEDULES = {
    "streams-128x64x64-w8-s2": (128, 64, 64, 8, 2),
    "streams-64x64x64-w8-s3": (64, 64, 64, 8, 3),
    "streams-64x128x64-w8-s2": (64, 128, 64, 8, 2),
    "streams-64x64x64-w4-s2": (64, 64, 64, 4, 2),
}
MIX_UP_SCHEDULE = "streams-64x128x64-w8-s2"


@torch.library.custom_op("atlas::hyper_mix_up", mutates_args=())
def mix_up(normed: torch.Tensor, act: torch.Tensor, up_w: torch.Tensor, hc: int, schedule: str = "") -> torch.Tensor:
    """A hyper-connection site's mix after its mix-down, as one kernel: mean_s sigmoid(act @ up_w.T)[s] * normed[s]
    [.., H] for the normed streams [.., hc*H], act = silu(mix-down) [.., lowrank] and up_w [hc*H, lowrank] (rows may
    be strided: a slice of the mix-down's output is read in place). The torch form (layers.hyper_block) writes the
    mix-up product [.., hc*H] and reads it back with the normed streams: at a 2,048-token prefill chunk two passes
    of 32 MB a site, 49 sites. A torch custom op, so a compiled region calls it as one opaque kernel (the norm and
    mix-down before it stay Inductor's and cuBLAS's). schedule: a MIX_UP_SCHEDULES name ("" the default)."""
    lead, width = normed.shape[:-1], normed.shape[-1]
    lowrank = act.shape[-1]
    hidden = width // hc
    if up_w.shape != (width, lowrank) or act.shape[:-1] != lead or width % hc:
        raise ValueError(f"hyper_mix_up: normed [.., {width}], hc {hc}, act {tuple(act.shape)}, "
                         f"up_w {tuple(up_w.shape)} (want [{width}, {lowrank}])")
    if schedule and schedule not in MIX_UP_SCHEDULES:
        raise ValueError(f"hyper_mix_up: schedule {schedule!r}; choose one of {', '.join(MIX_UP_SCHEDULES)}")
    block_m, block_n, block_k, warps, stages = MIX_UP_SCHEDULES[schedule or MIX_UP_SCHEDULE]
    if hc > 4:
        raise ValueError(f"hyper_mix_up holds at most 4 streams' accumulators, got hc {hc}")
    if hidden % 16:
        raise ValueError(f"hyper_mix_up needs hidden divisible by 16, got {hidden}")
    while hidden % block_n:  # a small model's hidden size: narrower column tiles (the kernel masks no column)
        block_n //= 2
    x, a = normed.reshape(-1, width), act.reshape(-1, lowrank)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, hidden, dtype=normed.dtype, device=normed.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _mix_up_kernel[(triton.cdiv(rows, block_m), hidden // block_n)](
        x, up_w.contiguous(), a, out, rows, x.stride(0), a.stride(0), HIDDEN=hidden, LOWRANK=lowrank, HC=hc,
        BM=block_m, BN=block_n, BK=block_k, PRECISION=precision, num_warps=warps, num_stages=stages)
    return out.view(*lead, hidden)


@mix_up.register_fake
def _(normed: torch.Tensor, act: torch.Tensor, up_w: torch.Tensor, hc: int, schedule: str = "") -> torch.Tensor:
    return normed.new_empty((*normed.shape[:-1], normed.shape[-1] // hc))
