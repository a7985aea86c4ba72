"""The routed experts at decode's few rows (at most ROWS) in two GEMV-shaped kernels, each chosen expert's weights read
once, in place.

    routed = moe_small(x [R, H], top_i [R, K], top_w [R, K], gate_up [E, 2I, H], down [E, H, I])

the same function and rounding as atlas_kernels.moe_grouped (act = silu(g) * u in fp32, rounded; each pair's output
rounded, then times its weight, rounded), over the same route (order, offsets: the pairs sorted by expert). An expert
is chosen at most once a row, so it holds at most R <= ROWS pairs: a program keeps all of them in registers and
multiplies each weight tile it loads with every one (broadcast products and sums: no tensor-core tile to fill with
one to four rows).

moe_grouped's 16-row tl.dot tiles at one row (H200, session 16 profile): the gate-up 12.0 us and the down 6.0 us a
layer for ~4 + 2 us of bytes (4 experts of 16 a row; a tile sweep moved the call by at most 1 us, session 17), 24
layers a step. Here each program owns BN gate (and up) columns of one expert (128 programs with work at one row) or
BN_DOWN output columns (256).

Batch invariance: each pair's sums run over fixed BK chunks in a fixed order whatever the other pairs are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)

ROWS = 4  # the most rows a launch takes (an expert's pairs, at most one a row, all in one program's registers)
BN = 16  # gate (and up) columns a gate-up program owns
BK = 64  # the gate-up's k step over the hidden size (128 spills at 4 rows: sm_90 compile report)
BN_DOWN = 32  # output columns a down program owns
BK_DOWN = 128  # the down's k step over the intermediate size
WARPS = 4
# Both loops have constexpr bounds and are unrolled (tl.static_range), and the products accumulate elementwise into
# [PB, BN, BK] tiles summed once after the loop. H200, session 17 run 2: the first form (a runtime-bounded loop and a
# cross-lane sum every k step) took 46.7 / 18.2 us a layer at one row (its loads a serial chain of round trips). Run
# 3, this form alone (benchmarks/kernels.py --only moe_decode --decode-rows 1,4, the whole call): 36.3-49.5 us at one
# row and 84-121 us at four over eight tiles, against moe_grouped's 29.8 / 40.9: slower. Without tl.dot Triton does not
# pipeline these loads (no cp.async stages), and the unrolled loop keeps too few of them in flight per SM


@triton.jit
def _small_gate_up_kernel(x_ptr, order_ptr, offsets_ptr, w_ptr, act_ptr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                          TOP_K: tl.constexpr, PB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    expert = tl.program_id(0)
    first = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    if first < end:  # experts nobody chose: no weight read
        pos = first + tl.arange(0, PB)
        live = pos < end
        token = tl.load(order_ptr + pos, mask=live, other=0) // TOP_K
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < INTER
        ks = tl.arange(0, BK)
        x_rows = x_ptr + token.to(tl.int64)[:, None] * HIDDEN
        g_rows = w_ptr + expert.to(tl.int64) * 2 * INTER * HIDDEN + cols.to(tl.int64)[:, None] * HIDDEN
        u_rows = g_rows + INTER * HIDDEN
        acc_g = tl.zeros((PB, BN, BK), dtype=tl.float32)
        acc_u = tl.zeros((PB, BN, BK), dtype=tl.float32)
        for k0 in tl.static_range(0, HIDDEN, BK):
            k = k0 + ks
            k_ok = k < HIDDEN
            xt = tl.load(x_rows + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wg = tl.load(g_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wu = tl.load(u_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc_g += xt[:, None, :] * wg[None, :, :]
            acc_u += xt[:, None, :] * wu[None, :, :]
        g = tl.sum(acc_g, 2)
        act = g * tl.sigmoid(g) * tl.sum(acc_u, 2)
        tl.store(act_ptr + pos.to(tl.int64)[:, None] * INTER + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton.jit
def _small_down_kernel(act_ptr, order_ptr, offsets_ptr, top_w_ptr, w_ptr, out_ptr, HIDDEN: tl.constexpr,
                       INTER: tl.constexpr, PB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    expert = tl.program_id(0)
    first = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    if first < end:
        pos = first + tl.arange(0, PB)
        live = pos < end
        pair = tl.load(order_ptr + pos, mask=live, other=0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < HIDDEN
        ks = tl.arange(0, BK)
        a_rows = act_ptr + pos.to(tl.int64)[:, None] * INTER
        d_rows = w_ptr + expert.to(tl.int64) * HIDDEN * INTER + cols.to(tl.int64)[:, None] * INTER
        acc = tl.zeros((PB, BN, BK), dtype=tl.float32)
        for k0 in tl.static_range(0, INTER, BK):
            k = k0 + ks
            k_ok = k < INTER
            a = tl.load(a_rows + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wd = tl.load(d_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += a[:, None, :] * wd[None, :, :]
        weight = tl.load(top_w_ptr + pair, mask=live, other=0.0).to(tl.float32)
        out = tl.sum(acc, 2).to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]  # out, then x w
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * HIDDEN + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


def fits(rows: int) -> bool:
    """Whether moe_small takes a group of this many rows."""
    return 0 < rows <= ROWS


def moe_small(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              *, route: tuple[torch.Tensor, torch.Tensor] | None = None, summed: bool = True,
              tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [R, H] in x's dtype for at most ROWS rows (summed=False: each pair's weighted
    output [R, K, H]); route: the pairs' (order, offsets) as moe_grouped.moe_route gives them (computed here if None);
    tiles: (gate-up columns, its k step, down columns, its k step, warps), the module's defaults when None
    (benchmarks/kernels.py sweeps them)."""
    from atlas_kernels.moe_grouped import moe_route

    rows, hidden = x.shape
    experts, two_inter, w_hidden = gate_up.shape
    inter = two_inter // 2
    top_k = top_i.shape[1]
    if not fits(rows):
        raise ValueError(f"moe_small: {rows} rows; it takes 1 to {ROWS} (moe_grouped takes more)")
    if w_hidden != hidden or down.shape != (experts, hidden, inter) or top_w.shape != top_i.shape:
        raise ValueError(f"moe_small: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, top_i {tuple(top_i.shape)}, top_w {tuple(top_w.shape)} disagree")
    x, gate_up, down, top_w = x.contiguous(), gate_up.contiguous(), down.contiguous(), top_w.contiguous()
    order, offsets = moe_route(top_i, experts) if route is None else route
    pb = triton.next_power_of_2(rows)
    bn, bk, bn_down, bk_down, warps = tiles or (BN, BK, BN_DOWN, BK_DOWN, WARPS)
    act = torch.empty(rows * top_k, inter, dtype=x.dtype, device=x.device)
    _small_gate_up_kernel[(experts, triton.cdiv(inter, bn))](
        x, order, offsets, gate_up, act, HIDDEN=hidden, INTER=inter, TOP_K=top_k, PB=pb, BN=bn, BK=bk,
        num_warps=warps)
    outs = torch.empty(rows * top_k, hidden, dtype=x.dtype, device=x.device)
    _small_down_kernel[(experts, triton.cdiv(hidden, bn_down))](
        act, order, offsets, top_w, down, outs, HIDDEN=hidden, INTER=inter, PB=pb, BN=bn_down, BK=bk_down,
        num_warps=warps)
    outs = outs.view(rows, top_k, hidden)
    return outs.sum(dim=1) if summed else outs
