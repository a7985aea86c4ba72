"""Gated DeltaNet chunked prefill: the gated delta rule over long prompts, 64 tokens at a time.

Within a chunk the T sequential rank-1 updates become a few [64, 64] and [64, dk] matrix products (the
WY / UT form of the delta rule, as in transformers' torch_chunk_gated_delta_rule); only the hop from one
chunk to the next is sequential. One program owns one (sequence, value head, dv tile) and walks its
chunks with the fp32 state tile in registers, so the state never leaves the chip between chunks.

The unit-lower-triangular solve (I + A)^-1, A strictly lower and so nilpotent (A^64 = 0), is done as the
product (I - A)(I + A^2)(I + A^4)...(I + A^32): ten [64, 64] products instead of a 64-step forward
substitution, all on the matrix units.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)
from atlas_kernels.reference import L2_EPS, check_gdn_state_pool

CHUNK = 64


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # packed tokens: q, k [L, Hk, DK]; v [L, Hv, DV]; g, beta [L, Hv]
    cu_seqlens_ptr, state_ptr, slot_ptr, out_ptr,  # cu_seqlens [N + 1]; state pool [slots, Hv, DK, DV]
    num_k_heads, num_v_heads, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, LOG2_C: tl.constexpr, PRECISION: tl.constexpr,
):
    v_tile = tl.program_id(0)
    seq_head = tl.program_id(1)
    seq = seq_head // num_v_heads
    head = seq_head % num_v_heads
    k_head = head // (num_v_heads // num_k_heads)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)

    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    lower = offs_c[:, None] >= offs_c[None, :]
    strictly_lower = offs_c[:, None] > offs_c[None, :]
    identity = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)

    slot = tl.load(slot_ptr + seq).to(tl.int64)
    state_tile = state_ptr + (slot * num_v_heads + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_tile, mask=state_mask, other=0.0)

    for chunk_start in range(start, end, C):
        tokens = chunk_start + offs_c
        valid = tokens < end
        # Padding rows load k = 0, beta = 0, g = 0: they neither decay nor write the state.
        qk_rows = (tokens * num_k_heads + k_head)[:, None] * DK + offs_k[None, :]
        qk_mask = valid[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_rows, mask=qk_mask, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
        v_rows = (tokens * num_v_heads + head)[:, None] * DV + offs_v[None, :]
        v_mask = valid[:, None] & mask_v[None, :]
        v = tl.load(v_ptr + v_rows, mask=v_mask, other=0.0).to(tl.float32)
        gate_rows = tokens * num_v_heads + head
        g = tl.load(g_ptr + gate_rows, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + gate_rows, mask=valid, other=0.0).to(tl.float32)

        g_cum = tl.cumsum(g, 0)  # log of the decay from the chunk start to each token
        g_last = tl.sum(tl.where(offs_c == C - 1, g_cum, 0.0), 0)
        # decay[i, j] = exp(g_cum_i - g_cum_j) for j <= i; the upper triangle is never exponentiated
        decay = tl.exp(tl.where(lower, g_cum[:, None] - g_cum[None, :], float("-inf")))

        k_dot_k = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        a = tl.where(strictly_lower, k_dot_k * beta[:, None] * decay, 0.0)
        # inverse of (I + a) as prod (I + (-a)^(2^i)): exact since a^C = 0
        inverse = identity - a
        power = a
        for _ in tl.static_range(LOG2_C - 1):
            power = tl.dot(power, power, input_precision=PRECISION)
            inverse = tl.dot(inverse, identity + power, input_precision=PRECISION)

        u = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)
        w = tl.dot(inverse, k * (beta * tl.exp(g_cum))[:, None], input_precision=PRECISION)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)  # the part the old state does not predict

        q_dot_k = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(q * tl.exp(g_cum)[:, None], state, input_precision=PRECISION)
        out += tl.dot(q_dot_k, v_new, input_precision=PRECISION)
        tl.store(out_ptr + v_rows, out.to(out_ptr.dtype.element_ty), mask=v_mask)

        k_to_end = k * tl.exp(g_last - g_cum)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision=PRECISION)

    tl.store(state_tile, state, mask=state_mask)


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    precision: str | None = None,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """Packed prompts of N sequences through the gated delta rule, continuing from and updating their states.

    q, k: [L, Hk, dk]; v: [L, Hv, dv]; g (log decay), beta: [L, Hv]; cu_seqlens: [N + 1] int32 offsets
    of each sequence's tokens in the packed dim; state_pool: fp32 [slots, Hv, dk, dv], read as the initial
    state and overwritten with the final state of each sequence's slot.
    precision: tl.dot's input_precision; default "ieee" for fp32 inputs (parity mode), "tf32" otherwise.
    Returns out [L, Hv, dv] in out_dtype (default v's dtype).
    """
    num_k_heads, dk = k.shape[1], k.shape[2]
    num_v_heads, dv = v.shape[1], v.shape[2]
    check_gdn_state_pool(state_pool, num_k_heads, num_v_heads, dk, dv)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    assert state_pool.is_contiguous()
    if precision is None:
        precision = "ieee" if v.dtype == torch.float32 else "tf32"
    num_seqs = cu_seqlens.numel() - 1
    out = torch.empty(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, block_v), num_seqs * num_v_heads)
    _gdn_chunk_kernel[grid](
        q, k, v, g, beta, cu_seqlens, state_pool, slots, out,
        num_k_heads, num_v_heads, dk**-0.5, L2_EPS,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        C=CHUNK, LOG2_C=CHUNK.bit_length() - 1, PRECISION=precision, num_warps=num_warps,
    )
    return out
