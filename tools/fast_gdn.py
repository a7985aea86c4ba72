"""A fast, differentiable chunked gated delta rule for training (pure torch, autograd does the backward).

transformers' `torch_chunk_gated_delta_rule` is the fallback when flash-linear-attention is absent, and FLA's
backward refuses Triton 3.6 on Hopper (issue 16), so training needs its own. This is the same chunked (WY / UT
transform) algorithm, written for speed under autograd:
- every chunk of every head of every sequence is solved at once: ONE batched `solve_triangular` of the unit
  lower-triangular system (I + A) X = [beta v, beta k exp(G)] per chunk, no Python loop over rows;
- only the state passing between chunks is sequential (T / chunk_size iterations, 8 at T = 512), each a few
  batched matmuls; outputs are stacked, not written in place, so autograd keeps no CopySlices chain;
- it computes in fp32 (fp64 if given fp64) with autocast off: under bf16 autocast transformers' version runs the
  intra-chunk products in bf16, which the triangular solve then amplifies.

Recurrence (per value head; q, k l2-normalised when asked, q scaled by dk^-0.5):
    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - S_{t-1}^T k_t exp(g_t))^T ,   o_t = S_t^T q_t
The signature is transformers' (so it can replace it in the module); `cu_seqlens` is not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log decay, <= 0), beta [B, T, Hv]; initial_state
    [B, Hv, dk, dv]. Returns (out [B, T, Hv, dv] in q's dtype, final state [B, Hv, dk, dv] fp32 or None)."""
    if cu_seqlens is not None:
        raise ValueError("fast_gdn.chunk_gated_delta_rule: cu_seqlens (packed varlen batches) is not supported")
    out_dtype = query.dtype
    acc = torch.promote_types(query.dtype, torch.float32)
    with torch.autocast(device_type=query.device.type, enabled=False):
        b, t, hk, dk = key.shape
        hv, dv = value.shape[-2:]
        if hk != hv:  # grouped values: each q/k head serves hv / hk consecutive value heads
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        q, k, v = (x.transpose(1, 2).to(acc) for x in (query, key, value))  # [B, H, T, d]
        beta_, g_ = (x.transpose(1, 2).to(acc) for x in (beta, g))  # [B, H, T]
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        q = q * dk**-0.5

        c = chunk_size
        pad = (-t) % c
        if pad:  # g = 0 and beta = 0 on padding: no decay, no write, so the state passes through unchanged
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            beta_, g_ = (F.pad(x, (0, pad)) for x in (beta_, g_))
        n = (t + pad) // c
        q, k, v = (x.reshape(b, hv, n, c, x.shape[-1]) for x in (q, k, v))
        beta_, g_ = beta_.reshape(b, hv, n, c), g_.reshape(b, hv, n, c)

        gc = g_.cumsum(-1)  # [B, H, N, C]: log decay from the chunk's start through position i
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        strictly_lower = causal.tril(-1)
        # decay between positions j <= i of a chunk; masked BEFORE exp so the upper triangle (positive) cannot
        # overflow to inf and poison the gradient through the mask
        pair = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        k_beta = k * beta_[..., None]
        strict = (k_beta @ k.transpose(-1, -2)) * (pair * strictly_lower)
        rhs = torch.cat([v * beta_[..., None], k_beta * gc.exp()[..., None]], dim=-1)
        # (I + strict) X = rhs; unitriangular reads only the strictly lower part, the diagonal is taken as 1
        u, w = torch.linalg.solve_triangular(strict, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
        attn = (q @ k.transpose(-1, -2)) * pair  # intra-chunk q.k with decay, diagonal included
        q_in = q * gc.exp()[..., None]  # reads the state carried into the chunk
        last = gc[..., -1:]  # [B, H, N, 1]
        k_out = k * (last - gc).exp()[..., None]  # writes decayed to the chunk's end
        chunk_decay = last.exp()[..., None]  # [B, H, N, 1, 1]

        state = (torch.zeros(b, hv, dk, dv, dtype=acc, device=q.device) if initial_state is None
                 else initial_state.to(acc))
        outs = []
        for i in range(n):
            v_new = u[:, :, i] - w[:, :, i] @ state
            outs.append(q_in[:, :, i] @ state + attn[:, :, i] @ v_new)
            state = state * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ v_new
        out = torch.stack(outs, dim=2).reshape(b, hv, n * c, dv)[:, :, :t]
        out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (state if output_final_state else None)


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence in the input's precision (fp64 in tests): the ground truth."""
    b, t, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * dk**-0.5
    state = torch.zeros(b, hv, dk, dv, dtype=value.dtype) if initial_state is None else initial_state
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", key[:, i], state)
        delta = (value[:, i] - predicted) * beta[:, i, :, None]
        state = state + key[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", query[:, i], state))
    return torch.stack(outs, dim=1), state
