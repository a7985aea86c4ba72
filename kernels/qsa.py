"""QSA indexer: pooled block keys, block scores, and the top-k block selection.

Per query row (decode or verify), the indexer keeps the budget // ratio best complete blocks of `ratio`
tokens plus the incomplete tail block; attention then runs over those token positions only
(paged_attention with `selected`). Three steps, in this order within a layer:

1. qsa_pool_keys: once a block of `ratio` raw index keys is complete, mean-pool it, RMS-norm it
   (zero-centred, (1 + w)) and rope it at the block's first position (partial rotary). Pooled keys live in
   a paged pool indexed by the KV block table: KV page p holds pooled keys of blocks
   [p * block_size / ratio, (p + 1) * block_size / ratio), so they need no allocator of their own.
2. qsa_block_scores: score_j = sum over index heads of relu(q_h . k_j) / sqrt(d) (Triton).
3. qsa_select: top-k blocks by score, ties to the lowest block index, returned ascending, then the tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _pool_keys_kernel(
    raw_pool_ptr, pooled_pool_ptr, block_tables_ptr, first_block_ptr, end_block_ptr, norm_weight_ptr,
    inv_freq_ptr, block_size, max_pages, eps,
    D: tl.constexpr, BD: tl.constexpr, ROTARY: tl.constexpr, RATIO: tl.constexpr, BJ: tl.constexpr,
):
    seq = tl.program_id(0)
    blocks = tl.load(first_block_ptr + seq) + tl.program_id(1) * BJ + tl.arange(0, BJ)
    valid = blocks < tl.load(end_block_ptr + seq)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    half: tl.constexpr = ROTARY // 2
    # rotate-half partner of each dim inside the rotary part; the rest is its own partner
    partner = tl.where(offs_d < half, offs_d + half, tl.where(offs_d < ROTARY, offs_d - half, offs_d))
    tile_mask = valid[:, None] & mask_d[None, :]

    pooled = tl.zeros([BJ, BD], tl.float32)
    pooled_partner = tl.zeros([BJ, BD], tl.float32)
    for i in tl.static_range(RATIO):
        token = blocks * RATIO + i
        page = tl.load(block_tables_ptr + seq * max_pages + token // block_size, mask=valid, other=0)
        row = (page.to(tl.int64) * block_size + token % block_size) * D
        pooled += tl.load(raw_pool_ptr + row[:, None] + offs_d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        pooled_partner += tl.load(raw_pool_ptr + row[:, None] + partner[None, :], mask=tile_mask,
                                  other=0.0).to(tl.float32)
    pooled = pooled / RATIO
    pooled_partner = pooled_partner / RATIO

    inv_rms = tl.rsqrt(tl.sum(pooled * pooled, 1) / D + eps)
    scale = 1.0 + tl.load(norm_weight_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    scale_partner = 1.0 + tl.load(norm_weight_ptr + partner, mask=mask_d, other=0.0).to(tl.float32)
    normed = pooled * inv_rms[:, None] * scale[None, :]
    normed_partner = pooled_partner * inv_rms[:, None] * scale_partner[None, :]

    freq = tl.load(inv_freq_ptr + offs_d % half, mask=offs_d < ROTARY, other=0.0)
    angle = (blocks * RATIO).to(tl.float32)[:, None] * freq[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)
    roped = normed * tl.cos(angle) + sign[None, :] * normed_partner * tl.sin(angle)
    out = tl.where((offs_d < ROTARY)[None, :], roped, normed)

    per_page = block_size // RATIO
    out_page = tl.load(block_tables_ptr + seq * max_pages + blocks // per_page, mask=valid, other=0)
    out_row = (out_page.to(tl.int64) * per_page + blocks % per_page) * D
    tl.store(pooled_pool_ptr + out_row[:, None] + offs_d[None, :], out.to(pooled_pool_ptr.dtype.element_ty),
             mask=tile_mask)


def qsa_pool_keys(
    raw_pool: torch.Tensor,
    pooled_pool: torch.Tensor,
    block_tables: torch.Tensor,
    first_block: torch.Tensor,
    end_block: torch.Tensor,
    norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    ratio: int,
    eps: float,
    max_new_blocks: int,
    *,
    block_j: int = 16,
) -> None:
    """Pool blocks [first_block[b], end_block[b]) of each sequence b into pooled_pool, in place.

    raw_pool: [num_pages, block_size, d] raw (un-normed, un-roped) index keys; pooled_pool:
    [num_pages, block_size // ratio, d]; block_tables: [B, max_pages] int32; inv_freq: [rotary_dim / 2]
    fp32, the model's RoPE frequencies. max_new_blocks bounds end - first (sizes the grid only).
    """
    num_pages, block_size, head_dim = raw_pool.shape
    if block_size % ratio or tuple(pooled_pool.shape) != (num_pages, block_size // ratio, head_dim):
        raise ValueError(f"pooled pool must be [{num_pages}, {block_size} // {ratio}, {head_dim}], "
                         f"got {tuple(pooled_pool.shape)}")
    if max_new_blocks <= 0:
        return
    batch = block_tables.shape[0]
    grid = (batch, triton.cdiv(max_new_blocks, block_j))
    _pool_keys_kernel[grid](
        raw_pool, pooled_pool, block_tables, first_block, end_block, norm_weight, inv_freq.float().contiguous(),
        block_size, block_tables.shape[1], eps,
        D=head_dim, BD=triton.next_power_of_2(head_dim), ROTARY=2 * inv_freq.numel(), RATIO=ratio, BJ=block_j,

    )


@triton.jit
def _block_scores_kernel(
    q_ptr, pooled_pool_ptr, block_tables_ptr, seq_lens_ptr, scores_ptr,
    num_rows, num_heads, max_pages, per_page, max_blocks, scale,
    RATIO: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)  # b * num_rows + t
    seq = row // num_rows
    num_visible = tl.load(seq_lens_ptr + seq) - num_rows + row % num_rows + 1
    num_blocks = num_visible // RATIO
    blocks = tl.program_id(1) * BB + tl.arange(0, BB)
    valid = blocks < num_blocks
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BH)
    mask_d = offs_d < D
    q = tl.load(q_ptr + (row * num_heads + offs_h)[:, None] * D + offs_d[None, :],
                mask=(offs_h < num_heads)[:, None] & mask_d[None, :], other=0.0)
    page = tl.load(block_tables_ptr + seq * max_pages + blocks // per_page, mask=valid, other=0)
    key_rows = (page.to(tl.int64) * per_page + blocks % per_page) * D
    keys = tl.load(pooled_pool_ptr + key_rows[:, None] + offs_d[None, :], mask=valid[:, None] & mask_d[None, :],
                   other=0.0)
    # padded heads have q = 0 and so add relu(0) = 0
    logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BH, BB]
    scores = tl.sum(tl.maximum(logits, 0.0), 0) * scale
    scores = tl.where(valid, scores, float("-inf"))
    tl.store(scores_ptr + row * max_blocks + blocks, scores, mask=blocks < max_blocks)


def qsa_block_scores(
    q: torch.Tensor,
    pooled_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    ratio: int,
    max_blocks: int,
    *,
    block_b: int = 64,
    precision: str | None = None,
) -> torch.Tensor:
    """Block scores for T query rows per sequence. q: [B, T, H_index, d], normed and roped at each row's
    position; row t of sequence b sees seq_lens[b] - T + t + 1 tokens, hence that // ratio blocks.
    max_blocks: host-known bound on any row's block count (sizes the output).
    Returns scores [B, T, max_blocks] fp32, -inf past each row's complete blocks."""
    batch, num_rows, num_heads, head_dim = q.shape
    per_page = pooled_pool.shape[1]
    if precision is None:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
    q = q.contiguous()
    scores = torch.empty((batch, num_rows, max_blocks), dtype=torch.float32, device=q.device)
    if max_blocks == 0:
        return scores
    block_b = max(16, block_b)  # tl.dot needs every dim >= 16 when compiled
    grid = (batch * num_rows, triton.cdiv(max_blocks, block_b))
    _block_scores_kernel[grid](
        q, pooled_pool, block_tables, seq_lens, scores,
        num_rows, num_heads, block_tables.shape[1], per_page, max_blocks, head_dim**-0.5,
        RATIO=ratio, D=head_dim, BD=triton.next_power_of_2(head_dim),
        BH=max(16, triton.next_power_of_2(num_heads)), BB=block_b, PRECISION=precision,
    )
    return scores


def qsa_select(
    scores: torch.Tensor, seq_lens: torch.Tensor, ratio: int, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token positions each row attends to, ascending, without a host sync.

    scores: [B, T, max_blocks] from qsa_block_scores. Returns (selected [B, T, budget + ratio - 1] int32,
    -1 padded, counts [B, T] int32). Ties go to the lowest block index: torch.topk does not promise an
    order among equal scores, so we use a stable descending sort, which keeps equal scores in index order.
    """
    batch, num_rows, max_blocks = scores.shape
    device = scores.device
    width = budget + ratio - 1
    num_visible = seq_lens.long()[:, None] - num_rows + torch.arange(num_rows, device=device)[None, :] + 1
    num_blocks = num_visible // ratio
    top = min(budget // ratio, max_blocks)
    kept = num_blocks.clamp(max=budget // ratio)  # [B, T]; no host tensor, so CUDA-graph capturable

    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top]
    rank_ok = torch.arange(top, device=device) < kept[..., None]
    chosen = torch.where(rank_ok, order, max_blocks).sort(dim=-1).values  # ascending, invalid last
    offsets = torch.arange(ratio, device=device)
    block_tokens = torch.where(rank_ok[..., None], chosen[..., None] * ratio + offsets, -1).flatten(-2)
    tail = (num_blocks * ratio)[..., None] + offsets[: ratio - 1]
    tail = torch.where(tail < num_visible[..., None], tail, -1)

    tokens = torch.cat([block_tokens, tail], dim=-1)
    # compact: valid entries to the front, keeping their (ascending) order
    tokens = tokens.gather(-1, torch.sort((tokens < 0).to(torch.uint8), dim=-1, stable=True).indices)
    selected = torch.full((batch, num_rows, width), -1, dtype=torch.int32, device=device)
    selected[..., : tokens.shape[-1]] = tokens.to(torch.int32)
    counts = kept * ratio + num_visible - num_blocks * ratio
    return selected, counts.to(torch.int32)
