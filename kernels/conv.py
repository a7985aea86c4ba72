"""Causal depthwise conv1d over T new tokens with SiLU, continuing from and updating the conv state in place.

The GDN layers run their q/k/v projections through this before the delta rule (decode: T = 1; verify:
T = 1 + drafts). One program owns a tile of channels of one sequence: it reads that tile's state once,
produces all T outputs, and only then overwrites the state, so the in-place update never races.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, slot_ptr, weight_ptr, bias_ptr, out_ptr,  # x, out [N, T, C]; state [slots, C, S]
    num_tokens, channels,
    K: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    channel_tile = tl.program_id(0)
    seq = tl.program_id(1)
    offs_c = channel_tile * BC + tl.arange(0, BC)
    mask_c = offs_c < channels
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    state_rows = state_ptr + slot * channels * S + offs_c * S
    x_rows = x_ptr + seq * num_tokens * channels + offs_c

    # The new state (last S columns of state ++ x), gathered before anything is written.
    offs_s = tl.arange(0, BS)
    column = num_tokens + offs_s  # index into state ++ x
    from_state = column < S
    tile_mask = mask_c[:, None] & (offs_s < S)[None, :]
    new_state = tl.load(state_rows[:, None] + column[None, :], mask=tile_mask & from_state[None, :],
                        other=0.0).to(tl.float32)
    new_state += tl.load(x_rows[:, None] + ((column - S) * channels)[None, :],
                         mask=tile_mask & ~from_state[None, :], other=0.0).to(tl.float32)

    bias = tl.zeros([BC], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in range(num_tokens):
        acc = bias
        for j in tl.static_range(K):
            # tap j of output t reads column t + j - (K - 1) of x, or of the state when negative
            src = t + j - (K - 1)
            w = tl.load(weight_ptr + offs_c * K + j, mask=mask_c, other=0.0).to(tl.float32)
            col = tl.load(x_rows + src * channels, mask=mask_c & (src >= 0), other=0.0).to(tl.float32)
            col += tl.load(state_rows + S + src, mask=mask_c & (src < 0), other=0.0).to(tl.float32)
            acc += w * col
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (seq * num_tokens + t) * channels + offs_c, acc.to(out_ptr.dtype.element_ty),
                 mask=mask_c)

    tl.store(state_rows[:, None] + offs_s[None, :], new_state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def causal_conv1d_update(
    x: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = True,
    block_c: int = 256,
) -> torch.Tensor:
    """x [N, T, C] (new pre-activation columns) through the depthwise causal conv of width K.

    state_pool: [slots, C, S] with S >= K - 1, each slot the last S columns, oldest first (transformers
    keeps S == K); slots: [N] int. weight: [C, K]. Updates the sequences' state slots in place.
    Returns out [N, T, C] in x's dtype.
    """
    num_seqs, num_tokens, channels = x.shape
    kernel_size = weight.shape[1]
    state_len = state_pool.shape[2]
    if state_len < kernel_size - 1:
        raise ValueError(f"conv state holds {state_len} columns; kernel size {kernel_size} needs {kernel_size - 1}")
    assert state_pool.is_contiguous() and state_pool.shape[1] == channels
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    grid = (triton.cdiv(channels, block_c), num_seqs)
    _conv_update_kernel[grid](
        x, state_pool, slots, weight, bias if bias is not None else weight, out,
        num_tokens, channels,
        K=kernel_size, S=state_len, BS=triton.next_power_of_2(state_len), BC=block_c,
        HAS_BIAS=bias is not None, SILU=silu,
    )
    return out
