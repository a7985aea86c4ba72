"""Gated DeltaNet chunked prefill in two kernels: the chunk-local work in parallel over every chunk, then
the sequential hop of the state from chunk to chunk.

Within a chunk the T sequential rank-1 updates become a few [64, 64] and [64, dk] matrix products (the WY / UT
form of the delta rule, as in transformers' torch_chunk_gated_delta_rule). Done in one program per (sequence,
head, dv tile), the ~15 chunk-local products (the (I + A)^-1 solve above all) sit on the sequential path, 32 times
for a 2048-token prompt, and the [64, 128] fp32 working set spills registers. Nothing chunk-local depends on the
state, so here:

1. prepare (grid: chunk x sequence x head, all parallel): normalise q/k, solve the WY form, and write per
   token w = (I + A)^-1 (beta k e^gcum), u = (I + A)^-1 (beta v), the masked intra-chunk attention matrix
   P = (q k^T) * decay, the cumulative log decay and q's / k's norms.
2. scan (grid: dv tile x sequence x head, sequential over chunks): per chunk only four products,
   v_new = u - w S;  out = q_decayed S + P v_new;  S = e^glast S + k_decayed^T v_new,
   the decayed q and k rebuilt from the inputs (bf16: half the bytes of storing [C, DK] fp32 tiles) with the
   same float operations, so the same values.

With work="fp32" the intermediates are stored in fp32 and the products run in tf32 for bf16 inputs (ieee fp32
for fp32 inputs, the parity mode); work="bf16" (bf16 inputs only) stores w / u in bf16 and runs the scan's
products on bf16 operands, the state fp32 throughout.

Two prepare kernels (prepare=):
- "scratch" (_prepare_kernel, the default): whole-chunk [64, *] products; a's block inverse goes through this
  program's rows of p in global memory as fp32 scratch, between tl.debug_barrier()s (so p is an fp32 buffer),
  and its products stay tf32 on fp32 operands even with bf16 work. sm_90 compile report (4 warps, gated, uniform):
  255 registers, 1.7 KB of spills a thread, 112 KB of shared memory.
- "registers" (_prepare_registers_kernel): everything by 16-row blocks of the chunk held in registers, the blocks
  of a computed straight from k's row blocks (a_ij = (k_i k_j^T) beta_i e^(gcum_i - gcum_j)), as
  flash-linear-attention's solve_tril inverts by 16 x 16 blocks: no global scratch, no debug barrier (the
  compiler's layout conversions through shared memory still synchronise the warps: 127 bar.sync in its PTX
  against the scratch prepare's 62, all its products mma.sync on 16-row tiles, no wgmma). Its products take
  `work` operands (bf16 with bf16 work, the inverse rounded to bf16 for w / u as fla stores it; the inverse itself
  solved in fp32 / tf32) and p is stored in `work` (the scan rounds it to `work` anyway). Same report at bf16
  work: 240 registers, no spills, 30 KB of shared memory (2 warps: 245, no spills). Error against the fp32
  reference with bf16 work (CPU interpreter, 150 tokens): output 4.1e-3 against the scratch prepare's 3.0e-3, the
  state 2.9e-3 against 2.5e-3 (the bf16 operands of q k^T / k k^T and of w / u's products account for about
  half each); with fp32 work both prepares' errors are the same (output 1.7e-3, the output's own rounding; state
  2-4e-7). fp32 inputs (ieee) at dk = 128 spill 118 KB a thread in it: the parity mode stays on "scratch".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)
from atlas_kernels.reference import L2_EPS, check_gdn_state_pool

CHUNK = 64  # tokens a chunk

# the intermediates w, u (and p's values) the scan reads, and its products' operands: "fp32" (tf32 products for
# bf16 inputs, ieee for fp32) or "bf16" (bf16 products at twice the tensor rate, half of w / u's bytes; the
# state itself stays fp32 in registers and in the pool), as flash-linear-attention runs its chunk kernels
WORK = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the prepare kernel: "scratch" (_prepare_kernel: whole-chunk products, the block inverse through p's rows in global
# memory between barriers) or "registers" (_prepare_registers_kernel: 16-row blocks in registers, p stored in `work`)
PREPARES = ("scratch", "registers")


@triton.jit
def _tile16(rows, row_stride, num_rows, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [16, 16] of the [C, C] fp32 matrix at rows (row r at rows + r x row_stride); rows past
    num_rows read 0."""
    r = i * 16 + tl.arange(0, 16)
    c = j * 16 + tl.arange(0, 16)
    return tl.load(rows + r[:, None] * row_stride + c[None, :], mask=(r < num_rows)[:, None], other=0.0)


@triton.jit
def _put16(rows, row_stride, num_rows, i: tl.constexpr, j: tl.constexpr, value):
    r = i * 16 + tl.arange(0, 16)
    c = j * 16 + tl.arange(0, 16)
    tl.store(rows + r[:, None] * row_stride + c[None, :], value, mask=(r < num_rows)[:, None])


@triton.jit
def _diag_inverse(a, PRECISION: tl.constexpr):
    """(I + a)^-1 of a strictly lower [16, 16] block: (I - a)(I + a^2)(I + a^4)(I + a^8), exact since a^16 = 0."""
    offs = tl.arange(0, 16)
    identity = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    inverse = identity - a
    power = a
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse = tl.dot(inverse, identity + power, input_precision=PRECISION)
    return inverse


@triton.jit
def _block_inverse(rows, row_stride, num_rows, PRECISION: tl.constexpr):
    """In place: the strictly lower [64, 64] a at rows becomes X = (I + a)^-1 (lower, diagonal included; the
    blocks above the diagonal are left as they were), by 16 x 16 blocks: X_ii = (I + a_ii)^-1, and for i > j
    X_ij = -X_ii sum_{k=j}^{i-1} a_ik X_kj: 40 products of [16, 16] (0.3 MFLOP a chunk and head) against the
    squaring's 10 sequential ones of [64, 64] (5.2 MFLOP)."""
    a10 = _tile16(rows, row_stride, num_rows, 1, 0)
    a20 = _tile16(rows, row_stride, num_rows, 2, 0)
    a21 = _tile16(rows, row_stride, num_rows, 2, 1)
    a30 = _tile16(rows, row_stride, num_rows, 3, 0)
    a31 = _tile16(rows, row_stride, num_rows, 3, 1)
    a32 = _tile16(rows, row_stride, num_rows, 3, 2)
    x00 = _diag_inverse(_tile16(rows, row_stride, num_rows, 0, 0), PRECISION)
    x11 = _diag_inverse(_tile16(rows, row_stride, num_rows, 1, 1), PRECISION)
    x22 = _diag_inverse(_tile16(rows, row_stride, num_rows, 2, 2), PRECISION)
    x33 = _diag_inverse(_tile16(rows, row_stride, num_rows, 3, 3), PRECISION)
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PRECISION), input_precision=PRECISION)
    x21 = -tl.dot(x22, tl.dot(a21, x11, input_precision=PRECISION), input_precision=PRECISION)
    x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=PRECISION), input_precision=PRECISION)
    x20 = tl.dot(a20, x00, input_precision=PRECISION)
    x20 = -tl.dot(x22, tl.dot(a21, x10, x20, input_precision=PRECISION), input_precision=PRECISION)
    x31 = tl.dot(a31, x11, input_precision=PRECISION)
    x31 = -tl.dot(x33, tl.dot(a32, x21, x31, input_precision=PRECISION), input_precision=PRECISION)
    x30 = tl.dot(a30, x00, input_precision=PRECISION)
    x30 = tl.dot(a31, x10, x30, input_precision=PRECISION)
    x30 = -tl.dot(x33, tl.dot(a32, x20, x30, input_precision=PRECISION), input_precision=PRECISION)
    _put16(rows, row_stride, num_rows, 0, 0, x00)
    _put16(rows, row_stride, num_rows, 1, 0, x10)
    _put16(rows, row_stride, num_rows, 1, 1, x11)
    _put16(rows, row_stride, num_rows, 2, 0, x20)
    _put16(rows, row_stride, num_rows, 2, 1, x21)
    _put16(rows, row_stride, num_rows, 2, 2, x22)
    _put16(rows, row_stride, num_rows, 3, 0, x30)
    _put16(rows, row_stride, num_rows, 3, 1, x31)
    _put16(rows, row_stride, num_rows, 3, 2, x32)
    _put16(rows, row_stride, num_rows, 3, 3, x33)


@triton.jit
def _sequence_bounds(cu_seqlens_ptr, seq, seq_len, UNIFORM: tl.constexpr):
    """(first token, end) of sequence `seq`: every sequence seq_len tokens when UNIFORM (no cu_seqlens tensor to build
    a layer), else cu_seqlens[seq], cu_seqlens[seq + 1]."""
    if UNIFORM:
        start = seq * seq_len
        end = start + seq_len
    else:
        start = tl.load(cu_seqlens_ptr + seq)
        end = tl.load(cu_seqlens_ptr + seq + 1)
    return start, end


@triton.jit
def _gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, rows, valid, g_stride, beta_stride, head,
           FUSED_GATING: tl.constexpr):
    """(g, beta) fp32 of the tokens at `rows` (int64) for v head `head`, 0 past `valid`. FUSED_GATING: g_ptr / beta_ptr
    hold the raw a, b and g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), as the GDN layer computes them."""
    g = tl.load(g_ptr + rows * g_stride + head, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * beta_stride + head, mask=valid, other=0.0).to(tl.float32)
    if FUSED_GATING:
        x = g + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        g = tl.where(valid, -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus, 0.0)
        beta = tl.where(valid, tl.sigmoid(beta), 0.0)
    return g, beta


@triton.jit
def _prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_seqlens_ptr,  # tokens [L, H, D], heads and dims packed, tokens strided
    a_log_ptr, dt_bias_ptr,  # [Hv], read only with FUSED_GATING (g_ptr, beta_ptr are then the raw a, b)
    w_ptr, u_ptr, q_norm_ptr, k_norm_ptr, p_ptr, g_cum_ptr,  # per token: [L, Hv, DK|DV], [L, Hv], [L, Hv, C], [L, Hv]
    num_k_heads, num_v_heads, qk_stride, v_stride, g_stride, beta_stride, seq_len, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
    C: tl.constexpr, LOG2_C: tl.constexpr, PRECISION: tl.constexpr, FUSED_GATING: tl.constexpr,
    UNIFORM: tl.constexpr, BLOCK_INVERSE: tl.constexpr,
):
    chunk = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    k_head = head // (num_v_heads // num_k_heads)
    seq_start, end = _sequence_bounds(cu_seqlens_ptr, seq, seq_len, UNIFORM)
    chunk_start = seq_start + chunk * C
    if chunk_start >= end:
        return

    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BDV)
    tokens = chunk_start + offs_c
    valid = tokens < end
    lower = offs_c[:, None] >= offs_c[None, :]
    strictly_lower = offs_c[:, None] > offs_c[None, :]
    identity = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)

    wide = tokens.to(tl.int64)
    qk_rows = (wide * qk_stride + k_head * DK)[:, None] + offs_k[None, :]
    qk_mask = valid[:, None] & (offs_k < DK)[None, :]
    q = tl.load(q_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
    q_norm = tl.rsqrt(tl.sum(q * q, 1) + eps) * scale
    k_norm = tl.rsqrt(tl.sum(k * k, 1) + eps)
    q = q * q_norm[:, None]
    k = k * k_norm[:, None]
    head_rows = tokens * num_v_heads + head
    v_mask = valid[:, None] & (offs_v < DV)[None, :]
    v = tl.load(v_ptr + (wide * v_stride + head * DV)[:, None] + offs_v[None, :], mask=v_mask,
                other=0.0).to(tl.float32)
    g, beta = _gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, wide, valid, g_stride, beta_stride, head, FUSED_GATING)

    g_cum = tl.cumsum(g, 0)
    decay = tl.exp(tl.where(lower, g_cum[:, None] - g_cum[None, :], float("-inf")))
    a = tl.where(strictly_lower, tl.dot(k, tl.trans(k), input_precision=PRECISION) * beta[:, None] * decay, 0.0)
    if BLOCK_INVERSE:  # through this program's rows of p (written last) as scratch, in 16 x 16 blocks
        p_tile = p_ptr + head_rows[:, None] * C + offs_c[None, :]
        tl.store(p_tile, a, mask=valid[:, None])
        tl.debug_barrier()
        p_rows = p_ptr + (chunk_start * num_v_heads + head) * C
        _block_inverse(p_rows, num_v_heads * C, end - chunk_start, PRECISION)
        tl.debug_barrier()
        inverse = tl.load(p_tile, mask=valid[:, None] & lower, other=0.0)
        tl.debug_barrier()  # every thread's read of the inverse before p overwrites it
    else:
        inverse = identity - a  # (I + a)^-1 = prod (I + (-a)^(2^i)), exact since a^C = 0
        power = a
        for _ in tl.static_range(LOG2_C - 1):
            power = tl.dot(power, power, input_precision=PRECISION)
            inverse = tl.dot(inverse, identity + power, input_precision=PRECISION)

    work = w_ptr.dtype.element_ty
    w = tl.dot(inverse, k * (beta * tl.exp(g_cum))[:, None], input_precision=PRECISION)
    u = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)
    p = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
    key_rows = head_rows[:, None] * DK + offs_k[None, :]
    tl.store(w_ptr + key_rows, w.to(work), mask=qk_mask)
    # the decayed q and k are not stored: the scan rebuilds them from q / k and these per-token norms with the
    # same float operations (the same values: half the bytes of [C, DK] fp32 tiles read a chunk)
    tl.store(q_norm_ptr + head_rows, q_norm, mask=valid)
    tl.store(k_norm_ptr + head_rows, k_norm, mask=valid)
    tl.store(u_ptr + head_rows[:, None] * DV + offs_v[None, :], u.to(work), mask=v_mask)
    tl.store(p_ptr + head_rows[:, None] * C + offs_c[None, :], p.to(work), mask=valid[:, None])
    tl.store(g_cum_ptr + head_rows, g_cum, mask=valid)


@triton.jit
def _keys16(q_ptr, k_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, q_norm_ptr, k_norm_ptr, g_cum_ptr, chunk_start, end,
            head, k_head, num_v_heads, qk_stride, g_stride, beta_stride, scale, eps, g_carry, i: tl.constexpr,
            DK: tl.constexpr, BK: tl.constexpr, FUSED_GATING: tl.constexpr, OPERAND: tl.constexpr):
    """Rows i x 16 ... i x 16 + 15 of the chunk (g_carry: the log decay summed over the rows before them): stores
    their q / k norms and cumulative log decay; returns the normalised q and k and beta k e^gcum in OPERAND (the
    products' operand type), beta and g_cum (fp32), and the next block's carry."""
    tokens = chunk_start + i * 16 + tl.arange(0, 16)
    valid = tokens < end
    offs_k = tl.arange(0, BK)
    wide = tokens.to(tl.int64)
    qk_rows = (wide * qk_stride + k_head * DK)[:, None] + offs_k[None, :]
    qk_mask = valid[:, None] & (offs_k < DK)[None, :]
    q = tl.load(q_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
    q_norm = tl.rsqrt(tl.sum(q * q, 1) + eps) * scale
    k_norm = tl.rsqrt(tl.sum(k * k, 1) + eps)
    g, beta = _gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, wide, valid, g_stride, beta_stride, head, FUSED_GATING)
    g_cum = tl.cumsum(g, 0) + g_carry
    head_rows = tokens * num_v_heads + head
    tl.store(q_norm_ptr + head_rows, q_norm, mask=valid)
    tl.store(k_norm_ptr + head_rows, k_norm, mask=valid)
    tl.store(g_cum_ptr + head_rows, g_cum, mask=valid)
    k = k * k_norm[:, None]
    return ((q * q_norm[:, None]).to(OPERAND), k.to(OPERAND), (k * (beta * tl.exp(g_cum))[:, None]).to(OPERAND),
            beta, g_cum, g_carry + tl.sum(g, 0))


@triton.jit
def _values16(v_ptr, chunk_start, end, head, v_stride, beta, i: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
              OPERAND: tl.constexpr):
    """beta v of rows i x 16 ... of the chunk, in OPERAND."""
    tokens = chunk_start + i * 16 + tl.arange(0, 16)
    offs_v = tl.arange(0, BDV)
    mask = (tokens < end)[:, None] & (offs_v < DV)[None, :]
    v = tl.load(v_ptr + (tokens.to(tl.int64) * v_stride + head * DV)[:, None] + offs_v[None, :], mask=mask, other=0.0)
    return (v.to(tl.float32) * beta[:, None]).to(OPERAND)


@triton.jit
def _pair16(q_i, k_i, k_j, beta_i, g_cum_i, g_cum_j, DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Block (i, j), i >= j, [16, 16] fp32, of P = (q k^T) * decay and of a = strictly_lower(beta k k^T * decay)."""
    if DIAGONAL:  # the decay's exponent is positive above the diagonal: masked before the exp
        offs = tl.arange(0, 16)
        decay = tl.exp(tl.where(offs[:, None] >= offs[None, :], g_cum_i[:, None] - g_cum_j[None, :], float("-inf")))
        a = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION) * beta_i[:, None] * decay
        a = tl.where(offs[:, None] > offs[None, :], a, 0.0)
    else:
        decay = tl.exp(g_cum_i[:, None] - g_cum_j[None, :])
        a = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION) * beta_i[:, None] * decay
    return tl.dot(q_i, tl.trans(k_j), input_precision=PRECISION) * decay, a


@triton.jit
def _store16(ptr, chunk_start, end, num_v_heads, head, width: tl.constexpr, i: tl.constexpr, j: tl.constexpr,
             value, COLUMNS: tl.constexpr):
    """value [16, COLUMNS] at rows i x 16 ... of the chunk, columns j x COLUMNS ..., of a per-token [L, Hv, width]
    buffer in its type (rows past end not written)."""
    tokens = chunk_start + i * 16 + tl.arange(0, 16)
    columns = j * COLUMNS + tl.arange(0, COLUMNS)
    rows = (tokens * num_v_heads + head) * width
    tl.store(ptr + rows[:, None] + columns[None, :], value.to(ptr.dtype.element_ty),
             mask=(tokens < end)[:, None] & (columns < width)[None, :])


@triton.jit
def _prepare_registers_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_seqlens_ptr,  # as _prepare_kernel's
    a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, q_norm_ptr, k_norm_ptr, p_ptr, g_cum_ptr,  # w, u, p in `work` (the products' operand type)
    num_k_heads, num_v_heads, qk_stride, v_stride, g_stride, beta_stride, seq_len, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
    C: tl.constexpr, PRECISION: tl.constexpr, FUSED_GATING: tl.constexpr, UNIFORM: tl.constexpr,
):
    """_prepare_kernel's outputs, every product by 16-row blocks of the chunk (C = 64: 4 blocks) held in registers:
    no scratch in global memory, no barrier. Block row by block row, a_ij = (k_i k_j^T) beta_i e^(gcum_i - gcum_j)
    (strictly lower on the diagonal) and P_ij = (q_i k_j^T) e^(gcum_i - gcum_j) (lower), stored with zeros above the
    diagonal (the scan reads whole rows); then X = (I + a)^-1 by blocks as _block_inverse, then block row by block
    row w_i = sum_{j<=i} X_ij (beta k e^gcum)_j, u_i = sum_{j<=i} X_ij (beta v)_j. The products' operands are `work`
    (w_ptr's type): bf16 with bf16 work (X rounded to bf16 for w / u, as flash-linear-attention stores its
    inverse), fp32 otherwise (tf32 products for bf16 inputs, ieee for fp32 ones); X itself is solved from fp32
    blocks in PRECISION, and every product accumulates in fp32."""
    chunk = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    k_head = head // (num_v_heads // num_k_heads)
    seq_start, end = _sequence_bounds(cu_seqlens_ptr, seq, seq_len, UNIFORM)
    chunk_start = seq_start + chunk * C
    if chunk_start >= end:
        return
    tl.static_assert(C == 64, "the registers prepare solves 4 row blocks of 16")
    work = w_ptr.dtype.element_ty
    zero = tl.zeros([16, 16], dtype=tl.float32)

    # block row 0 .. 3: its keys, then P's and a's blocks (the decay shared), q_i dead after its row
    q, k0, kb0, beta0, gc0, carry = _keys16(
        q_ptr, k_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, q_norm_ptr, k_norm_ptr, g_cum_ptr, chunk_start, end,
        head, k_head, num_v_heads, qk_stride, g_stride, beta_stride, scale, eps, 0.0, 0, DK, BK, FUSED_GATING, work)
    p, a00 = _pair16(q, k0, k0, beta0, gc0, gc0, True, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 0, 0, p, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 0, 1, zero, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 0, 2, zero, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 0, 3, zero, 16)

    q, k1, kb1, beta1, gc1, carry = _keys16(
        q_ptr, k_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, q_norm_ptr, k_norm_ptr, g_cum_ptr, chunk_start, end,
        head, k_head, num_v_heads, qk_stride, g_stride, beta_stride, scale, eps, carry, 1, DK, BK, FUSED_GATING, work)
    p, a10 = _pair16(q, k1, k0, beta1, gc1, gc0, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 1, 0, p, 16)
    p, a11 = _pair16(q, k1, k1, beta1, gc1, gc1, True, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 1, 1, p, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 1, 2, zero, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 1, 3, zero, 16)

    q, k2, kb2, beta2, gc2, carry = _keys16(
        q_ptr, k_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, q_norm_ptr, k_norm_ptr, g_cum_ptr, chunk_start, end,
        head, k_head, num_v_heads, qk_stride, g_stride, beta_stride, scale, eps, carry, 2, DK, BK, FUSED_GATING, work)
    p, a20 = _pair16(q, k2, k0, beta2, gc2, gc0, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 2, 0, p, 16)
    p, a21 = _pair16(q, k2, k1, beta2, gc2, gc1, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 2, 1, p, 16)
    p, a22 = _pair16(q, k2, k2, beta2, gc2, gc2, True, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 2, 2, p, 16)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 2, 3, zero, 16)

    q, k3, kb3, beta3, gc3, carry = _keys16(
        q_ptr, k_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, q_norm_ptr, k_norm_ptr, g_cum_ptr, chunk_start, end,
        head, k_head, num_v_heads, qk_stride, g_stride, beta_stride, scale, eps, carry, 3, DK, BK, FUSED_GATING, work)
    p, a30 = _pair16(q, k3, k0, beta3, gc3, gc0, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 3, 0, p, 16)
    p, a31 = _pair16(q, k3, k1, beta3, gc3, gc1, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 3, 1, p, 16)
    p, a32 = _pair16(q, k3, k2, beta3, gc3, gc2, False, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 3, 2, p, 16)
    p, a33 = _pair16(q, k3, k3, beta3, gc3, gc3, True, PRECISION)
    _store16(p_ptr, chunk_start, end, num_v_heads, head, C, 3, 3, p, 16)

    # X = (I + a)^-1 by blocks (as _block_inverse), from the fp32 blocks in PRECISION
    x00 = _diag_inverse(a00, PRECISION)
    x11 = _diag_inverse(a11, PRECISION)
    x22 = _diag_inverse(a22, PRECISION)
    x33 = _diag_inverse(a33, PRECISION)
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PRECISION), input_precision=PRECISION)
    x21 = -tl.dot(x22, tl.dot(a21, x11, input_precision=PRECISION), input_precision=PRECISION)
    x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=PRECISION), input_precision=PRECISION)
    x20 = tl.dot(a20, x00, input_precision=PRECISION)
    x20 = -tl.dot(x22, tl.dot(a21, x10, x20, input_precision=PRECISION), input_precision=PRECISION)
    x31 = tl.dot(a31, x11, input_precision=PRECISION)
    x31 = -tl.dot(x33, tl.dot(a32, x21, x31, input_precision=PRECISION), input_precision=PRECISION)
    x30 = tl.dot(a30, x00, input_precision=PRECISION)
    x30 = tl.dot(a31, x10, x30, input_precision=PRECISION)
    x30 = -tl.dot(x33, tl.dot(a32, x20, x30, input_precision=PRECISION), input_precision=PRECISION)
    x00, x10, x11, x20, x21, x22 = x00.to(work), x10.to(work), x11.to(work), x20.to(work), x21.to(work), x22.to(work)
    x30, x31, x32, x33 = x30.to(work), x31.to(work), x32.to(work), x33.to(work)

    # block row by block row: w_i = sum_{j<=i} X_ij (beta k e^gcum)_j, u_i = sum_{j<=i} X_ij (beta v)_j (v read here)
    vb0 = _values16(v_ptr, chunk_start, end, head, v_stride, beta0, 0, DV, BDV, work)
    w = tl.dot(x00, kb0, input_precision=PRECISION)
    _store16(w_ptr, chunk_start, end, num_v_heads, head, DK, 0, 0, w, BK)
    u = tl.dot(x00, vb0, input_precision=PRECISION)
    _store16(u_ptr, chunk_start, end, num_v_heads, head, DV, 0, 0, u, BDV)
    vb1 = _values16(v_ptr, chunk_start, end, head, v_stride, beta1, 1, DV, BDV, work)
    w = tl.dot(x11, kb1, tl.dot(x10, kb0, input_precision=PRECISION), input_precision=PRECISION)
    _store16(w_ptr, chunk_start, end, num_v_heads, head, DK, 1, 0, w, BK)
    u = tl.dot(x11, vb1, tl.dot(x10, vb0, input_precision=PRECISION), input_precision=PRECISION)
    _store16(u_ptr, chunk_start, end, num_v_heads, head, DV, 1, 0, u, BDV)
    vb2 = _values16(v_ptr, chunk_start, end, head, v_stride, beta2, 2, DV, BDV, work)
    w = tl.dot(x21, kb1, tl.dot(x20, kb0, input_precision=PRECISION), input_precision=PRECISION)
    w = tl.dot(x22, kb2, w, input_precision=PRECISION)
    _store16(w_ptr, chunk_start, end, num_v_heads, head, DK, 2, 0, w, BK)
    u = tl.dot(x21, vb1, tl.dot(x20, vb0, input_precision=PRECISION), input_precision=PRECISION)
    u = tl.dot(x22, vb2, u, input_precision=PRECISION)
    _store16(u_ptr, chunk_start, end, num_v_heads, head, DV, 2, 0, u, BDV)
    vb3 = _values16(v_ptr, chunk_start, end, head, v_stride, beta3, 3, DV, BDV, work)
    w = tl.dot(x31, kb1, tl.dot(x30, kb0, input_precision=PRECISION), input_precision=PRECISION)
    w = tl.dot(x33, kb3, tl.dot(x32, kb2, w, input_precision=PRECISION), input_precision=PRECISION)
    _store16(w_ptr, chunk_start, end, num_v_heads, head, DK, 3, 0, w, BK)
    u = tl.dot(x31, vb1, tl.dot(x30, vb0, input_precision=PRECISION), input_precision=PRECISION)
    u = tl.dot(x33, vb3, tl.dot(x32, vb2, u, input_precision=PRECISION), input_precision=PRECISION)
    _store16(u_ptr, chunk_start, end, num_v_heads, head, DV, 3, 0, u, BDV)


@triton.jit
def _scan_kernel(
    w_ptr, u_ptr, q_ptr, k_ptr, q_norm_ptr, k_norm_ptr, p_ptr, g_cum_ptr, cu_seqlens_ptr,
    state_ptr, slot_ptr, out_ptr, stamp_ptr, end_ptr, num_k_heads, num_v_heads, qk_stride, seq_len,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    PRECISION: tl.constexpr, UNIFORM: tl.constexpr, STAMP: tl.constexpr,
):
    v_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    k_head = head // (num_v_heads // num_k_heads)
    start, end = _sequence_bounds(cu_seqlens_ptr, seq, seq_len, UNIFORM)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV

    slot = tl.load(slot_ptr + seq).to(tl.int64)
    state_tile = state_ptr + (slot * num_v_heads + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_tile, mask=state_mask, other=0.0)
    work = w_ptr.dtype.element_ty

    for chunk_start in range(start, end, C):
        tokens = chunk_start + offs_c
        valid = tokens < end
        head_rows = tokens * num_v_heads + head
        key_rows = head_rows[:, None] * DK + offs_k[None, :]
        key_mask = valid[:, None] & mask_k[None, :]
        value_rows = head_rows[:, None] * DV + offs_v[None, :]
        value_mask = valid[:, None] & mask_v[None, :]
        w = tl.load(w_ptr + key_rows, mask=key_mask, other=0.0)
        qk_rows = (tokens.to(tl.int64) * qk_stride + k_head * DK)[:, None] + offs_k[None, :]
        g_cum = tl.load(g_cum_ptr + head_rows, mask=valid, other=0.0)
        g_last = tl.min(tl.where(valid, g_cum, float("inf")), 0)
        # the prepare kernel's decayed q and k, rebuilt with its float operations (normalise, then decay)
        q_decayed = tl.load(q_ptr + qk_rows, mask=key_mask, other=0.0).to(tl.float32)
        q_decayed = q_decayed * tl.load(q_norm_ptr + head_rows, mask=valid, other=0.0)[:, None]
        q_decayed = (q_decayed * tl.exp(g_cum)[:, None]).to(work)
        k_decayed = tl.load(k_ptr + qk_rows, mask=key_mask, other=0.0).to(tl.float32)
        k_decayed = k_decayed * tl.load(k_norm_ptr + head_rows, mask=valid, other=0.0)[:, None]
        k_decayed = (k_decayed * tl.exp(g_last - g_cum)[:, None]).to(work)
        u = tl.load(u_ptr + value_rows, mask=value_mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + head_rows[:, None] * C + offs_c[None, :], mask=valid[:, None], other=0.0).to(work)

        state_operand = state.to(work)
        v_new = u - tl.dot(w, state_operand, input_precision=PRECISION)
        out = tl.dot(q_decayed, state_operand, input_precision=PRECISION)
        out += tl.dot(p, v_new.to(work), input_precision=PRECISION)
        tl.store(out_ptr + value_rows, out.to(out_ptr.dtype.element_ty), mask=value_mask)
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new.to(work), input_precision=PRECISION)

    tl.store(state_tile, state, mask=state_mask)
    if STAMP:  # the stamp goes with the state, by the same kernel (one program a sequence writes it)
        if (v_tile == 0) & (head == 0):
            tl.store(stamp_ptr + slot, tl.load(end_ptr + seq))


def gdn_chunk_prefill_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    max_seqlen: int,
    *,
    out_dtype: torch.dtype | None = None,
    block_v: int = 64,
    prepare_warps: int = 8,
    scan_warps: int = 8,
    scan_stages: int = 1,
    inverse: str = "blocks",
    work: str = "fp32",
    prepare: str = "scratch",
    prepare_maxnreg: int | None = None,
) -> torch.Tensor:
    """Packed prompts of N sequences through the gated delta rule, continuing from and updating their states.

    q, k: [L, Hk, dk]; v: [L, Hv, dv]; g (log decay), beta: [L, Hv]; cu_seqlens: [N + 1] int32 offsets of each
    sequence's tokens in the packed dim; state_pool: fp32 [slots, Hv, dk, dv], read as the initial state and
    overwritten with the final state of each sequence's slot; max_seqlen: a host-known bound on the longest
    sequence in the batch (sizes the prepare grid only). Returns out [L, Hv, dv] in out_dtype (default v's dtype).

    Launch shapes from the sm_90 compile report (no GPU timing yet): the scan at dv tile 64 with 8 warps
    and no software pipelining spills 128 bytes and needs 147 KB of shared memory; with the default 3
    pipeline stages its three [64, 128] fp32 operand tiles would need 426 KB, over the 227 KB limit.

    prepare: "scratch" or "registers" (the module's docstring; "registers" needs inverse="blocks");
    prepare_maxnreg: a cap on the prepare kernel's registers a thread (Triton's maxnreg), None for ptxas's own."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    num_k_heads, dk = k.shape[1], k.shape[2]
    num_v_heads, dv = v.shape[1], v.shape[2]
    strides = (num_k_heads * dk, num_v_heads * dv, num_v_heads, num_v_heads)
    return _launch(q, k, v, g, beta, None, cu_seqlens, None, state_pool, slots, max_seqlen, strides, None,
                   out_dtype, block_v, prepare_warps, scan_warps, scan_stages, inverse, work, prepare, prepare_maxnreg)


def gdn_chunk_prefill_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    stamp: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    block_v: int = 32,
    prepare_warps: int | None = None,
    scan_warps: int = 4,
    scan_stages: int | None = None,
    inverse: str = "blocks",
    work: str = "fp32",
    prepare: str = "scratch",
    prepare_maxnreg: int | None = None,
) -> torch.Tensor:
    """N sequences of T tokens each through the chunked gated delta rule, as a GDN layer's prefill feeds them:
    q, k [N, T, Hk, dk], v [N, T, Hv, dv] and the raw gates a, b [N, T, Hv] may be token-strided views (slices
    of the in-projection's or the conv's output: no copy when heads and dims are packed), the gates computed in
    the prepare kernel (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), A_log / dt_bias [Hv]), the
    sequences' bounds from T (no cu_seqlens tensor), and with `stamp` (the pool's int32 stamps [slots], each
    sequence's new stamp [N] int32) the state's stamp written by the scan that writes the state. Before it a
    2,048-token GDN layer ran ~12 eager launches around the two kernels (the gates, cu_seqlens, q / k / v copies,
    the stamp). Returns out [N, T, Hv, dv] (default v's dtype). Same numbers as gdn_chunk_prefill_split given
    the same gates (the tests check both against the reference).

    Launch defaults from `benchmarks/kernels.py --only chunk` (H200, one 2,048-token layer of the 2.7B
    config, this call): 4 prepare warps and the scan loop pipelined 2 deep (its next chunk's loads issued
    before this chunk's products) against 8 warps and no pipelining: 8 -> 4 prepare warps 377 -> 346 us (the
    prepare no longer keeps the decayed q / k tiles: 8 warps lose to 4), 1 -> 2 stages 378 -> 350 us.
    Tried and dropped (same session): the outputs off the sequential scan (the scan storing each chunk's fp32
    state and v_new, a third kernel computing every chunk's output in parallel, as fla's chunk_o): 398 us, 380
    with 2 stages; the 64 MB of states written and read back cost more than the two products it took off the
    sequential path (a 2,048-token prefill 28.8 -> 29.1 ms).

    work="bf16" (same call): 322.5 -> 255.7 us with 2 scan stages, **221.8 us** with 3 (the default
    for bf16 work: its operand tiles are half the size, so a third stage fits; fp32 work's 3 stages need 272 KB);
    dv tile 16 257.6, dv tile 64 / 8 warps 312.8.

    prepare="registers" (the module's docstring): the prepare kernel by 16-row blocks in registers,
    without the scratch prepare's global-memory block inverse and its barriers (137 us of the ~222 above were that
    prepare, for a floor of ~20 us), its products on `work` operands, p in `work`. Left alone ptxas gives it 240
    registers at 4 warps (2 programs an SM, as the scratch prepare's 255); prepare_maxnreg 168 fits 3 for 120 bytes
    of spills a thread, 128 fits 4 for 664 (sm_90 compile report, bf16 work). H200, this call
    with bf16 work: **146.5 us at 2 prepare warps** (its default: prepare_warps None is 2 for the registers prepare,
    4 for the scratch one), 164.3 at 4, 228.9 at 8; at 4 warps maxnreg 168 156.2, 128 152.5 (8 warps + 128:
    190.9); the scratch prepare 221.9 us in the same run. In the model its kernel took 78.8 us a layer against the
    scratch prepare's 137.6. With fp32 work it gains nothing (318.2 against 326.0 us).
"""
    if prepare_warps is None:
        prepare_warps = 2 if prepare == "registers" else 4
    from atlas_kernels.gdn_recurrent import strided_inputs

    if scan_stages is None:  # bf16 work's operand tiles are half the size: a third stage fits in shared memory
        scan_stages = 3 if work == "bf16" else 2
    num_seqs, seq_len = k.shape[:2]
    num_v_heads, dv = v.shape[2], v.shape[3]
    q, k, v, a, b, strides = strided_inputs(q, k, v, a, b)
    if stamp is not None and (stamp[0].dtype != torch.int32 or stamp[1].dtype != torch.int32):
        raise ValueError("gdn_chunk_prefill_gated: stamp= needs int32 (stamps, ends)")
    out = _launch(q, k, v, a, b, (a_log, dt_bias), None, seq_len, state_pool, slots, seq_len, strides, stamp,
                  out_dtype, block_v, prepare_warps, scan_warps, scan_stages, inverse, work, prepare, prepare_maxnreg)
    return out.view(num_seqs, seq_len, num_v_heads, dv)


def _launch(q, k, v, g, beta, gating, cu_seqlens, seq_len, state_pool, slots, max_seqlen, strides, stamp,
            out_dtype, block_v, prepare_warps, scan_warps, scan_stages, inverse, work, prepare, prepare_maxnreg):
    """Both entry points' two launches. q, k, v, g, beta: token-strided by `strides` (elements from one token to
    the next: q/k, v, g, beta), indexed as flat tokens [L, ...] (N sequences of seq_len tokens when seq_len is
    not None: cu_seqlens unused)."""
    num_k_heads, dk = k.shape[-2], k.shape[-1]
    num_v_heads, dv = v.shape[-2], v.shape[-1]
    check_gdn_state_pool(state_pool, num_k_heads, num_v_heads, dk, dv)
    assert state_pool.is_contiguous()
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    if inverse not in ("blocks", "squaring"):
        raise ValueError(f"gdn chunk prefill: inverse={inverse!r}; choose 'blocks' or 'squaring'")
    num_tokens = v.numel() // (num_v_heads * dv)
    uniform = seq_len is not None
    num_seqs = num_tokens // seq_len if uniform else cu_seqlens.numel() - 1
    a_log, dt_bias = gating if gating is not None else (g, g)
    bounds = slots if uniform else cu_seqlens  # (unread when uniform)
    stamps, ends = stamp if stamp is not None else (slots, slots)

    if work not in WORK:
        raise ValueError(f"gdn chunk prefill: work={work!r}; choose {' or '.join(map(repr, WORK))}")
    if work == "bf16" and v.dtype == torch.float32:
        raise ValueError("gdn chunk prefill: work='bf16' is for bf16 inputs (fp32 inputs are the parity mode)")
    if prepare not in PREPARES:
        raise ValueError(f"gdn chunk prefill: prepare={prepare!r}; choose {' or '.join(map(repr, PREPARES))}")
    registers = prepare == "registers"
    if registers and (inverse != "blocks" or CHUNK != 64):
        raise ValueError(f"gdn chunk prefill: prepare={prepare!r} solves by 16 x 16 blocks of a 64-token chunk "
                         f"(inverse={inverse!r}, chunk {CHUNK})")

    def scratch(width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty((num_tokens, num_v_heads, width), dtype=dtype, device=v.device)

    # the scratch prepare's block inverse uses p's rows as fp32 scratch, so p is fp32 there (the scan rounds it to
    # `work`); the registers prepare stores it in `work`
    w, u = scratch(dk, WORK[work]), scratch(dv, WORK[work])
    p = scratch(CHUNK, WORK[work] if registers else torch.float32)
    g_cum, q_norm, k_norm = (torch.empty((num_tokens, num_v_heads), dtype=torch.float32, device=v.device)
                             for _ in range(3))
    block_k = triton.next_power_of_2(dk)
    prepare_grid = (triton.cdiv(max_seqlen, CHUNK), num_seqs, num_v_heads)
    prepare_args = (q, k, v, g, beta, bounds, a_log, dt_bias, w, u, q_norm, k_norm, p, g_cum,
                    num_k_heads, num_v_heads, *strides, seq_len or 0, dk**-0.5, L2_EPS)
    shapes = dict(DK=dk, DV=dv, BK=block_k, BDV=triton.next_power_of_2(dv), C=CHUNK, PRECISION=precision,
                  FUSED_GATING=gating is not None, UNIFORM=uniform)
    # prepare_maxnreg: a cap on the prepare's registers a thread (Triton's maxnreg; None: ptxas's choice), for more
    # programs an SM at the cost of spills
    launch = dict(num_warps=prepare_warps, num_stages=1, **({} if prepare_maxnreg is None else
                                                            {"maxnreg": prepare_maxnreg}))
    if registers:
        _prepare_registers_kernel[prepare_grid](*prepare_args, **shapes, **launch)
    else:
        _prepare_kernel[prepare_grid](*prepare_args, **shapes, LOG2_C=CHUNK.bit_length() - 1,
                                      BLOCK_INVERSE=inverse == "blocks" and CHUNK == 64, **launch)
    out = torch.empty((num_tokens, num_v_heads, dv), dtype=out_dtype or v.dtype, device=v.device)
    block_v = min(block_v, triton.next_power_of_2(dv))
    _scan_kernel[(triton.cdiv(dv, block_v), num_seqs, num_v_heads)](
        w, u, q, k, q_norm, k_norm, p, g_cum, bounds, state_pool, slots, out, stamps, ends, num_k_heads, num_v_heads,
        strides[0], seq_len or 0,
        DK=dk, DV=dv, BK=block_k, BV=block_v, C=CHUNK, PRECISION=precision, UNIFORM=uniform,
        STAMP=stamp is not None, num_warps=scan_warps, num_stages=scan_stages,
    )
    return out
