"""Gated DeltaNet recurrent update for decode (T = 1) and verify (T = 1 + drafts) rows.

One program owns one (sequence, value head, dv tile): its fp32 state tile [dk, BV] stays in registers for
all T tokens, so the state is read once and written once per step however many tokens are verified. The
state after every token can be written out as well, so a partial accept commits the state after token n
exactly instead of re-running the accepted tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)
from atlas_kernels.reference import L2_EPS, check_gdn_state_pool


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr,  # q, k: [N, T, Hk, DK], v: [N, T, Hv, DV], heads and dims packed, tokens strided
    g_ptr, beta_ptr,  # [N, T, Hv]: g and beta, or with FUSED_GATING the raw projections a and b (heads packed)
    a_log_ptr, dt_bias_ptr,  # [Hv], read only with FUSED_GATING
    state_ptr, slot_ptr,  # state pool [slots, Hv, DK, DV] fp32; slot of each sequence [N]
    out_ptr, states_out_ptr,  # out [N, T, Hv, DV]; per-token states [N, T, Hv, DK, DV] fp32
    stamp_ptr, end_ptr,  # with STAMP: the state's int32 position stamp per slot, and each sequence's new one [N]
    num_tokens, num_k_heads, num_v_heads, qk_token_stride, v_token_stride, g_token_stride, beta_token_stride,
    scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_STATES: tl.constexpr, COMMIT: tl.constexpr, FUSED_GATING: tl.constexpr, STAMP: tl.constexpr,
):
    v_tile = tl.program_id(0)
    seq_head = tl.program_id(1)
    seq = seq_head // num_v_heads
    head = seq_head % num_v_heads
    k_head = head // (num_v_heads // num_k_heads)

    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_kv = mask_k[:, None] & mask_v[None, :]

    slot = tl.load(slot_ptr + seq).to(tl.int64)
    state_tile = state_ptr + (slot * num_v_heads + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    state = tl.load(state_tile, mask=mask_kv, other=0.0)

    for t in range(num_tokens):
        token = seq * num_tokens + t
        qk_row = token.to(tl.int64) * qk_token_stride + k_head * DK
        q = tl.load(q_ptr + qk_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        v = tl.load(v_ptr + token.to(tl.int64) * v_token_stride + head * DV + offs_v, mask=mask_v,
                    other=0.0).to(tl.float32)
        g_at = g_ptr + token.to(tl.int64) * g_token_stride + head
        beta_at = beta_ptr + token.to(tl.int64) * beta_token_stride + head
        if FUSED_GATING:
            # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), as the GDN layer computes them
            x = tl.load(g_at).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
            g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
            beta = tl.sigmoid(tl.load(beta_at).to(tl.float32))
        else:
            g = tl.load(g_at).to(tl.float32)
            beta = tl.load(beta_at).to(tl.float32)

        state = state * tl.exp(g)
        predicted = tl.sum(state * k[:, None], 0)  # what the state already says for this key: [BV]
        delta = (v - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], 0)
        out_row = (token * num_v_heads + head) * DV
        tl.store(out_ptr + out_row + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)
        if STORE_STATES:
            states_row = states_out_ptr + (token * num_v_heads + head).to(tl.int64) * DK * DV
            tl.store(states_row + offs_k[:, None] * DV + offs_v[None, :], state, mask=mask_kv)

    if COMMIT:
        tl.store(state_tile, state, mask=mask_kv)
        if STAMP:  # the stamp goes with the state, by the same kernel (one program a sequence writes it)
            if (v_tile == 0) & (head == 0):
                tl.store(stamp_ptr + slot, tl.load(end_ptr + seq))


def _token_stride(x: torch.Tensor) -> int | None:
    """Elements between consecutive tokens of x [N, T, H, D] whose heads and dims are packed (a slice of
    the conv output, say), or None if x needs a copy."""
    num_tokens, heads, dim = x.shape[1], x.shape[2], x.shape[3]
    if x.stride(3) != 1 or (heads > 1 and x.stride(2) != dim):
        return None
    stride = x.stride(1) if num_tokens > 1 else x.stride(0)
    return stride if x.shape[0] == 1 or x.stride(0) == num_tokens * stride else None


def _gate_stride(x: torch.Tensor) -> int | None:
    """The same for a gate [N, T, H] whose heads are packed (a slice of the in-projection's output: at batch 64
    its copy was two launches a GDN layer, 36 a decode step), or None if it needs a copy."""
    return _token_stride(x[..., None])


def strided_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, (q/k, v, g, beta token strides)): each input as it is where the kernels can read it at a
    token stride (heads and dims packed), else a contiguous copy. q, k [N, T, Hk, dk], v [N, T, Hv, dv], g, beta
    [N, T, Hv] (the gates or the raw a, b)."""
    num_k_heads, dk = k.shape[2], k.shape[3]
    num_v_heads, dv = v.shape[2], v.shape[3]
    qk_stride = _token_stride(q)
    if qk_stride is None or _token_stride(k) != qk_stride:
        q, k = q.contiguous(), k.contiguous()
        qk_stride = num_k_heads * dk
    v_stride = _token_stride(v)
    if v_stride is None:
        v, v_stride = v.contiguous(), num_v_heads * dv
    g_stride, beta_stride = _gate_stride(g), _gate_stride(beta)
    if g_stride is None:
        g, g_stride = g.contiguous(), num_v_heads
    if beta_stride is None:
        beta, beta_stride = beta.contiguous(), num_v_heads
    return q, k, v, g, beta, (qk_stride, v_stride, g_stride, beta_stride)


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    store_states: bool = False,
    commit: bool = True,
    out_dtype: torch.dtype | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """T tokens of N sequences through the gated delta rule.

    q, k: [N, T, Hk, dk]; v: [N, T, Hv, dv] (each may be a token-strided view, e.g. a slice of the conv
    output: no copy is made when heads and dims are packed); g (log decay), beta: [N, T, Hv];
    state_pool: fp32 [slots, Hv, dk, dv]; slots: [N] int, each sequence's state slot (distinct).
    commit: write the state after the last token back into its slot (decode). For verify, pass
    commit=False, store_states=True and copy states[n, accepted - 1] into the slot once the accept is known.
    Returns (out [N, T, Hv, dv] in out_dtype (default v's dtype), states [N, T, Hv, dk, dv] fp32 or None).
    """
    return _launch(q, k, v, g, beta, None, state_pool, slots, store_states, commit, out_dtype, block_v)


def gdn_recurrent_gated(
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
    store_states: bool = False,
    commit: bool = True,
    out_dtype: torch.dtype | None = None,
    block_v: int | None = None,
    stamp: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gdn_recurrent with the gates computed in the kernel from the layer's raw projections a, b [N, T, Hv]
    and its A_log, dt_bias [Hv]: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b). At batch 1
    the recurrent update itself takes ~3.7 us a layer, so the separate elementwise launches for the gates
    would cost as much again. stamp: (the pool's int32 stamps [slots], each sequence's new stamp [N] int32),
    written by the same kernel as the committed state (the eager write after it was one launch a layer)."""
    return _launch(q, k, v, a, b, (a_log, dt_bias), state_pool, slots, store_states, commit, out_dtype, block_v,
                   stamp)


def _launch(q, k, v, g, beta, gating, state_pool, slots, store_states, commit, out_dtype, block_v, stamp=None):
    num_seqs, num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    check_gdn_state_pool(state_pool, num_k_heads, num_v_heads, dk, dv)
    assert state_pool.is_contiguous()
    q, k, v, g, beta, (qk_stride, v_stride, g_stride, beta_stride) = strided_inputs(q, k, v, g, beta)
    a_log, dt_bias = gating if gating is not None else (g, g)
    out = torch.empty(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    states = None
    if store_states:
        states = torch.empty((num_seqs, num_tokens, num_v_heads, dk, dv), dtype=torch.float32, device=v.device)
    block_k = triton.next_power_of_2(dk)
    # dv is split across programs so that small batches still fill the GPU. H200, 18 layers of 32 heads
    # of 128 x 128: tiles of 32 win at batch 1 (67 against 74 us a step), tiles of 64 from batch 16
    # (401 against 415 us; batch 64: 1303 against 1380 us, 88% of the copy bandwidth).
    if block_v is None:
        block_v = 32 if num_seqs * num_v_heads < 256 else 64
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, block_v), num_seqs * num_v_heads)
    if stamp is not None and (not commit or stamp[0].dtype != torch.int32 or stamp[1].dtype != torch.int32):
        raise ValueError("gdn_recurrent_gated: stamp= needs commit=True and int32 (stamps, ends)")
    stamps, ends = stamp if stamp is not None else (slots, slots)
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, state_pool, slots, out, states if states is not None else out,
        stamps, ends, num_tokens, num_k_heads, num_v_heads, qk_stride, v_stride, g_stride, beta_stride, dk**-0.5,
        L2_EPS,
        DK=dk, DV=dv, BK=block_k, BV=block_v, STORE_STATES=store_states, COMMIT=commit,
        FUSED_GATING=gating is not None, STAMP=stamp is not None,
    )
    return out, states
