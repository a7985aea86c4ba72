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


@triton.jit
def _conv_prefill_kernel(
    x_ptr, prev_ptr, weight_ptr, out_ptr,  # x [N, T, C] token-strided (channels packed); prev [N, C, S]; out [N, T, C]
    num_tokens, channels, x_seq_stride, x_token_stride,
    K: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    """One program a (token tile, channel tile, sequence), all parallel: every tap read time-major (coalesced along
    the channels), nothing written but out. A tile whose taps all fall in x (every tile but the first (K - 1) x DIL
    tokens') loads one shifted [BT, BC] tile a tap and nothing else; only the first tiles also read the state's
    columns (reading both for every tile: 250 registers, 97.9 us for a 2,048-token GDN head)."""
    t0 = tl.program_id(0) * BT
    offs_t = t0 + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    seq = tl.program_id(2).to(tl.int64)
    mask_t = offs_t < num_tokens
    mask_c = offs_c < channels
    io_mask = mask_t[:, None] & mask_c[None, :]
    x_base = x_ptr + seq * x_seq_stride
    out_base = out_ptr + seq * num_tokens * channels
    if t0 >= (K - 1) * DIL:  # every tap of every row in x: one shifted [BT, BC] tile a tap
        # int32 offsets from per-sequence base pointers (64-bit address tiles spilled 2 KB at 4 warps)
        x_tile = x_base + offs_t[:, None] * x_token_stride + offs_c[None, :]
        acc = tl.zeros([BT, BC], tl.float32)
        for j in tl.static_range(K):
            w = tl.load(weight_ptr + offs_c * K + j, mask=mask_c, other=0.0).to(tl.float32)
            col = tl.load(x_tile + (j - (K - 1)) * DIL * x_token_stride, mask=io_mask, other=0.0).to(tl.float32)
            acc += col * w[None, :]
        if SILU:  # on the conv's output rounded to out's dtype, as F.silu(conv) does
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = acc * tl.sigmoid(acc)
        tl.store(out_base + offs_t[:, None] * channels + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=io_mask)
    else:  # the first tile: row by row, a tap from x or from the state's columns (a [BT, BC] form of both loads
        # held 240 registers at 8 warps, sm_90 with the launch's divisibility, and capped the fast tiles' occupancy)
        _conv_rows(x_base, prev_ptr + seq * channels * S, weight_ptr, out_base, offs_c, mask_c, t0,
                   tl.minimum(t0 + BT, num_tokens), channels, x_token_stride, K, S, DIL, SILU)


@triton.jit
def _conv_rows(x_base, prev_base, weight_ptr, out_base, offs_c, mask_c, t_begin, t_end, channels, x_token_stride,
               K: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr, SILU: tl.constexpr):
    """Outputs t_begin..t_end - 1 of one channel tile, each a [BC] row: tap j of token t reads column
    t + (j - (K - 1)) x DIL of x, or of the state (its last S columns) when negative."""
    x_rows = x_base + offs_c
    prev_rows = prev_base + offs_c * S
    out_rows = out_base + offs_c
    for t in range(t_begin, t_end):
        acc = tl.zeros(offs_c.shape, tl.float32)
        for j in tl.static_range(K):
            src = t + (j - (K - 1)) * DIL
            w = tl.load(weight_ptr + offs_c * K + j, mask=mask_c, other=0.0).to(tl.float32)
            col = tl.load(x_rows + src * x_token_stride, mask=mask_c & (src >= 0), other=0.0).to(tl.float32)
            col += tl.load(prev_rows + S + src, mask=mask_c & (src < 0) & (S + src >= 0), other=0.0).to(tl.float32)
            acc += col * w
        if SILU:
            acc = acc.to(out_rows.dtype.element_ty).to(tl.float32)
            acc = acc * tl.sigmoid(acc)
        tl.store(out_rows + t * channels, acc.to(out_rows.dtype.element_ty), mask=mask_c)


@triton.jit
def _conv_prefill_rows_kernel(
    x_ptr, prev_ptr, weight_ptr, out_ptr, num_tokens, channels, x_seq_stride, x_token_stride,
    K: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    """_conv_prefill_kernel's values row by row: one program a (run of BT tokens, channel tile, sequence) walks its
    tokens, each tap a [BC] row (the taps' re-reads hit L1); 48 registers (sm_90 compile report). The tiled form
    runs its first tile this way."""
    t0 = tl.program_id(0) * BT
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    seq = tl.program_id(2).to(tl.int64)
    _conv_rows(x_ptr + seq * x_seq_stride, prev_ptr + seq * channels * S, weight_ptr,
               out_ptr + seq * num_tokens * channels, offs_c, offs_c < channels, t0, tl.minimum(t0 + BT, num_tokens),
               channels, x_token_stride, K, S, DIL, SILU)


# causal_conv_prefill's launch: a kernel form ("tiles": _conv_prefill_kernel, "rows": _conv_prefill_rows_kernel), its
# token and channel tiles and warps; benchmarks/kernels.py --only conv times every named schedule
PREFILL_SCHEDULES = {
    # H200, one 2,048-token GDN head (2,048 x 8,192 channels from a strided slice), us: tiles 67.5,
    # 32x128-w4 45.0, 16x128-w4 33.8, 64x64-w4 62.7, 64x128-w8 73.3, 32x256-w8 46.6, rows 87.0, rows-16x512-w4 84.7
    # (every tile reading x and the state, 32x128 at 8 warps: 97.9); a second sweep on the same card:
    # 16x128-w4 33.7, 16x128-w2 36.8, 8x128-w2 29.2, 16x256-w4 36.9, 8x256-w4 29.5, 16x64-w2 33.8
    "tiles-8x128-w2": ("tiles", 8, 128, 2),
    "tiles-16x128-w4": ("tiles", 16, 128, 4),
    "tiles": ("tiles", 32, 128, 8),
    "tiles-32x128-w4": ("tiles", 32, 128, 4),
    "tiles-16x128-w2": ("tiles", 16, 128, 2),
    "tiles-16x256-w4": ("tiles", 16, 256, 4),
    "tiles-8x256-w4": ("tiles", 8, 256, 4),
    "tiles-16x64-w2": ("tiles", 16, 64, 2),
    "rows": ("rows", 64, 512, 4),
}
PREFILL_SCHEDULE = "tiles-8x128-w2"


@torch.library.custom_op("atlas::causal_conv_prefill", mutates_args=())
def causal_conv_prefill(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, dilation: int = 1,
                        silu: bool = True) -> torch.Tensor:
    """A prefill chunk's depthwise causal conv, time-major: x [N, T, C] (a token-strided view is read in place, e.g.
    a slice of the in-projection's output), continuing the states prev [N, C, S] (S >= (K - 1) x dilation, the
    last S columns, oldest first), weight [C, K] or [C, 1, K]. Returns out [N, T, C] contiguous in x's dtype, with
    silu: silu of the conv rounded to that dtype (F.silu(conv)); fp32 accumulation, taps summed in order. Pure (the
    caller writes the new state); a torch custom op, so a compiled region calls it as one opaque kernel. Against
    the channel-major windowed product Inductor fused into the GDN heads (a 60 us kernel a 2,048-token layer on the
    H200 profile, for ~64 MB of traffic)."""
    num_seqs, num_tokens, channels = x.shape
    kernel_size = weight.shape[-1]
    state_len = prev.shape[-1]
    if state_len < (kernel_size - 1) * dilation:
        raise ValueError(f"causal_conv_prefill: the state holds {state_len} columns; kernel size {kernel_size} at "
                         f"dilation {dilation} needs {(kernel_size - 1) * dilation}")
    if x.stride(2) != 1:
        x = x.contiguous()
    prev, weight = prev.contiguous(), weight.reshape(channels, kernel_size).contiguous()
    out = torch.empty((num_seqs, num_tokens, channels), dtype=x.dtype, device=x.device)
    form, block_t, block_c, warps = PREFILL_SCHEDULES[PREFILL_SCHEDULE]
    kernel = _conv_prefill_rows_kernel if form == "rows" else _conv_prefill_kernel
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c), num_seqs)
    kernel[grid](
        x, prev, weight, out, num_tokens, channels, x.stride(0), x.stride(1),
        K=kernel_size, S=state_len, DIL=dilation, BT=block_t, BC=block_c, SILU=silu, num_warps=warps,
    )
    return out


@causal_conv_prefill.register_fake
def _(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, dilation: int = 1, silu: bool = True
      ) -> torch.Tensor:
    return x.new_empty(x.shape)
