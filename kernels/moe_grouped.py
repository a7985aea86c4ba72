"""Grouped MoE experts routed on the device: each chosen expert's weights read once, in place, no host sync.

    routed = moe_grouped(x [R, H], top_i [R, K], top_w [R, K], gate_up [E, 2I, H], down [E, H, I])
           = sum_k top_w[r, k] * down[e] @ (silu(g) * u),  (g, u) = gate_up[e] @ x[r],  e = top_i[r, k]

The (row, slot) pairs are sorted by expert on the device (`moe_route`: one stable sort and one searchsorted,
no host sync, CUDA-graph capturable); then two kernels, each program owning one (expert, tile of its
pairs, tile of output columns): programs of an expert nobody chose read nothing. At batch 1 this reads
4 of 16 experts' weights (6.3 MB a layer on the benchmark model) where the torch graph-safe path gathers
gate_up[top_i] / down[top_i] into fresh tensors (a ~25 MB copy a layer) and runs ~9 kernels.

Each pair's output row is written once (no atomics) and summed over its K slots in a fixed order by the
caller, and every reduction is over a fixed tile (BK) order whatever the batch, so a row's result does not
depend on which other rows share the launch (for a fixed block_m).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, order_ptr, offsets_ptr, w_ptr, act_ptr, hidden, inter, m_tiles, pairs,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    expert = tl.program_id(0) // m_tiles
    first = tl.load(offsets_ptr + expert) + (tl.program_id(0) % m_tiles) * BM
    end = tl.load(offsets_ptr + expert + 1)
    if first < end:  # experts nobody chose (or past their pairs): no weight read at all
        pos = first + tl.arange(0, BM)
        live = pos < end
        token = tl.load(order_ptr + pos, mask=live, other=0) // TOP_K
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < inter
        w_base = w_ptr + expert.to(tl.int64) * 2 * inter * hidden
        ks = tl.arange(0, BK)
        # pointers advanced by BK a step (fewer live 64-bit address tiles than recomputing them: registers)
        x_ptrs = x_ptr + token.to(tl.int64)[:, None] * hidden + ks[None, :]
        g_ptrs = w_base + cols[:, None].to(tl.int64) * hidden + ks[None, :]  # [BN, BK]: rows contiguous
        u_ptrs = g_ptrs + inter * hidden
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, hidden, BK):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=live[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=col_ok[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + ks) < hidden
                xt = tl.load(x_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tl.dot(xt, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, tl.trans(wu), acc_u, input_precision=PRECISION)
            x_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + pos.to(tl.int64)[:, None] * inter + cols[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr, order_ptr, offsets_ptr, top_w_ptr, w_ptr, out_ptr, hidden, inter, m_tiles, pairs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert = tl.program_id(0) // m_tiles
    first = tl.load(offsets_ptr + expert) + (tl.program_id(0) % m_tiles) * BM
    end = tl.load(offsets_ptr + expert + 1)
    if first < end:
        pos = first + tl.arange(0, BM)
        live = pos < end
        pair = tl.load(order_ptr + pos, mask=live, other=0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < hidden
        w_base = w_ptr + expert.to(tl.int64) * hidden * inter
        ks = tl.arange(0, BK)
        a_ptrs = act_ptr + pos.to(tl.int64)[:, None] * inter + ks[None, :]
        d_ptrs = w_base + cols[:, None].to(tl.int64) * inter + ks[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, inter, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
                wd = tl.load(d_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + ks) < inter
                a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
                wd = tl.load(d_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(wd), acc, input_precision=PRECISION)
            a_ptrs += BK
            d_ptrs += BK
        weight = tl.load(top_w_ptr + pair, mask=live, other=0.0).to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]  # round as torch does: out, then x w
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * hidden + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


def moe_route(top_i: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [R*K] int64: flat pair indices r*K + k sorted by expert, stable; offsets [E + 1] int32: expert e's
    pairs are order[offsets[e]:offsets[e + 1]]). On the device, no host sync: two kernels (sort, searchsorted)."""
    experts, order = torch.sort(top_i.flatten(), stable=True)
    offsets = torch.searchsorted(experts, _bounds(num_experts, experts.device, experts.dtype), out_int32=True)
    return order, offsets


@functools.cache
def _bounds(num_experts: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # made once per (E, device), in the decode graphs' warm-up run (before capture), then read in place
    return torch.arange(num_experts + 1, device=device, dtype=dtype)


def block_sizes(rows: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): decode-sized rows get 16-row tiles (bandwidth-bound), prefill 64 x 64
    tiles (FLOP-bound). block_m and block_k are the same for every batch up to 64 rows, so decode results do
    not depend on the batch size (block_n only tiles the columns: no reduction order changes with it).
    block_n 64 from `benchmarks/kernels.py --only moe` on the H200 (the whole call graph-timed, 2.7B
    shapes): rows 1 / 16 / 64 29.1 / 49.6 / 75.9 us against 42.0 / 55.7 / 94.4 us for block_n 16, the best
    block_k-128 tile at every size (block_k 256 won rows 1 by 0.5 us and lost rows 64; pipeline depth 2-4 within
    noise). Fewer, wider programs: at batch 1 the 16-column tiles left each program a short loop of loads. It
    spills (compile_report, sm_90: gate_up 11.6 KB, down 72 B; 16x32x128 spills 92 B in gate_up) and is faster
    all the same: the measurement decides (tests/test_kernels_compile.py allows exactly these).
    Prefill rows 128 x 64 x 64 (8 warps, Triton's default 3 stages) from `benchmarks/kernels.py --only moe_prefill`
    (H200, 49 tiles x warps x stages, the whole call graph-timed at 2,048 rows: 8,192 pairs): 255.6 us
    against 280.7 for the 64 x 64 x 64 before; 64x64x64 at 4 warps, 3 stages 265.2; 128 x 128 x 64 256.8; at 8,192
    rows 64 x 128 x 32 with 4 warps, 4 stages was best of the 18 reached (714.6 against 820.8 us)."""
    if rows <= 64:
        return 16, 64, 128
    return 128, 64, 64


# the down kernel's own (block_n, block_k, warps, stages) at prefill rows (> 64), from `benchmarks/kernels.py --only
# moe_prefill --no-sweep` (H200, the whole call graph-timed): at 2,048 rows 244.2 us against 250.9
# with the gate-up's 128 x 64 x 64 tile (243.1 at 128 x 64 with Triton's default stages), at 8,192 rows 618.4 against
# 671.2 (632.7). Wider output tiles read each pair's activations from L2 for fewer column tiles. It spills (sm_90
# compile report: 8.9 KB without divisibility hints) and is faster all the same; tests/test_kernels_compile.py allows it
PREFILL_DOWN_TILE = (256, 64, 8, 3)


def num_warps(block_m: int) -> int:
    return 4 if block_m <= 16 else 8  # 64-row tiles spill at 4 warps (1380 B in gate_up)


def moe_grouped(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, blocks: tuple[int, int, int] | None = None,
                route: tuple[torch.Tensor, torch.Tensor] | None = None, stages: int | None = None,
                summed: bool = True, warps: int | None = None,
                down_tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [R, H] in x's dtype (the shared expert is the caller's). `route`: the
    (order, offsets) moe_route would compute, if the caller has them; `stages`: the loops' pipeline depth
    (Triton's default when None); warps: the programs' warps (num_warps(block_m) when None); summed=False: each
    pair's weighted output [R, K, H] instead, for a caller that sums over the slots inside a fused kernel of its own
    (the sum is one more launch a layer here). down_tile: the down kernel's own (block_n, block_k, warps, stages) (its
    block_m is the gate-up's: the pairs' tiles are the same); None: PREFILL_DOWN_TILE at prefill rows (> 64) unless
    `blocks` names a tile, else the gate-up's; () the gate-up's."""
    rows, hidden = x.shape
    experts, two_inter, w_hidden = gate_up.shape
    inter = two_inter // 2
    top_k = top_i.shape[1]
    if w_hidden != hidden or down.shape != (experts, hidden, inter) or top_w.shape != top_i.shape:
        raise ValueError(f"moe_grouped: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, top_i {tuple(top_i.shape)}, top_w {tuple(top_w.shape)} disagree")
    bm, bn, bk = blocks or block_sizes(rows)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    x, gate_up, down, top_w = x.contiguous(), gate_up.contiguous(), down.contiguous(), top_w.contiguous()
    order, offsets = moe_route(top_i, experts) if route is None else route
    down_bk = min(bk, triton.next_power_of_2(inter))
    warps = warps or num_warps(bm)
    extra = {} if stages is None else {"num_stages": stages}
    m_tiles = triton.cdiv(rows, bm)  # an expert holds at most one pair per row
    act = torch.empty(rows * top_k, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(experts * m_tiles, triton.cdiv(inter, bn))](
        x, order, offsets, gate_up, act, hidden, inter, m_tiles, rows * top_k,
        TOP_K=top_k, BM=bm, BN=bn, BK=bk, EVEN_K=hidden % bk == 0, PRECISION=precision,
        num_warps=warps, **extra)
    outs = torch.empty(rows * top_k, hidden, dtype=x.dtype, device=x.device)
    down_bn, down_warps, down_extra = bn, warps, extra
    if down_tile is None and blocks is None and rows > 64:
        down_tile = PREFILL_DOWN_TILE
    if down_tile:
        down_bn, down_bk, down_warps, down_stages = down_tile
        down_bk = min(down_bk, triton.next_power_of_2(inter))
        down_extra = {} if down_stages is None else {"num_stages": down_stages}
    _moe_down_kernel[(experts * m_tiles, triton.cdiv(hidden, down_bn))](
        act, order, offsets, top_w, down, outs, hidden, inter, m_tiles, rows * top_k,
        BM=bm, BN=down_bn, BK=down_bk, EVEN_K=inter % down_bk == 0, PRECISION=precision,
        num_warps=down_warps, **down_extra)
    outs = outs.view(rows, top_k, hidden)
    return outs.sum(dim=1) if summed else outs
