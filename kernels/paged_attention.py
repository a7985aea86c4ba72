"""Paged attention for decode (T = 1) and verify (T > 1, causal within the rows) query rows, dense or over
a QSA selection of token positions.

Split-K ("flash decoding"): the keys a row sees are cut into fixed partitions of PARTITION positions, one
program per (row, KV head, partition) runs an online softmax over its partition for all the query heads
sharing that KV head (K and V are read once per group), and a second kernel merges the partitions in a
fixed order. The partition size does not depend on the batch, so a row's result does not depend on what
else is in the batch (batch invariance), and the merge order is fixed (run-to-run determinism).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)
from atlas_kernels.rows import check_table_covers

PARTITION = 256


@triton.jit
def _attention_partition_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, seq_lens_ptr, selected_ptr, selected_count_ptr,
    m_ptr, l_ptr, acc_ptr,  # per-partition softmax max, denominator and unnormalised output
    num_rows, num_q_heads, num_kv_heads, block_size, max_blocks, max_selected, num_partitions, scale,
    D: tl.constexpr, BD: tl.constexpr, GROUP: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr,
    PART: tl.constexpr, SELECTED: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0)  # b * num_rows + t
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq = row // num_rows
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - num_rows + row % num_rows
    if SELECTED:
        num_keys = tl.load(selected_count_ptr + row)
    else:
        num_keys = position + 1
    key_start = part * PART
    key_end = tl.minimum(key_start + PART, num_keys)

    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, BD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + (row * num_q_heads + heads)[:, None] * D + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for n0 in range(key_start, key_end, BN):
        idx = n0 + tl.arange(0, BN)
        valid = idx < key_end
        if SELECTED:
            key_pos = tl.load(selected_ptr + row * max_selected + idx, mask=valid, other=0)
        else:
            key_pos = idx
        page = tl.load(block_tables_ptr + seq * max_blocks + key_pos // block_size, mask=valid, other=0)
        kv_rows = ((page.to(tl.int64) * block_size + key_pos % block_size) * num_kv_heads + kv_head) * D
        kv_mask = valid[:, None] & mask_d[None, :]
        keys = tl.load(k_pool_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        values = tl.load(v_pool_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m_i = m_new

    stat = (row * num_q_heads + heads) * num_partitions + part
    tl.store(m_ptr + stat, m_i, mask=mask_g)
    tl.store(l_ptr + stat, l_i, mask=mask_g)
    tl.store(acc_ptr + stat[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _attention_merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, num_partitions,
    D: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
):
    row_head = tl.program_id(0)
    offs_p = tl.arange(0, BP)
    offs_d = tl.arange(0, BD)
    mask_p = offs_p < num_partitions
    stat = row_head * num_partitions + offs_p
    m = tl.load(m_ptr + stat, mask=mask_p, other=float("-inf"))
    denominator = tl.load(l_ptr + stat, mask=mask_p, other=0.0)
    acc = tl.load(acc_ptr + stat[:, None] * D + offs_d[None, :], mask=mask_p[:, None] & (offs_d < D)[None, :],
                  other=0.0)
    # empty partitions carry m = -inf and weigh exactly 0
    weight = tl.exp(m - tl.max(m, 0))
    weight = tl.where(mask_p, weight, 0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(denominator * weight, 0)
    tl.store(out_ptr + row_head * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_keys: int,
    selected: torch.Tensor | None = None,
    selected_count: torch.Tensor | None = None,
    *,
    partition: int = PARTITION,
    block_n: int = 64,
    num_warps: int = 8,
    precision: str | None = None,
) -> torch.Tensor:
    """Attention of T query rows per sequence over its paged KV (see reference.paged_attention).

    q: [B, T, Hq, D]; k_pool, v_pool: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]
    int32; seq_lens: [B] int32, counting the rows' own keys. Row t sits at position seq_len - T + t.
    max_keys: an upper bound on the keys any row sees (max seq_len, or the selection width), known to
    the host without a device sync; it sizes the grid only, never the result.
    num_warps 8: at block_n 64, head dim 128 and 8 query heads per KV head, 4 warps spill registers on
    sm_90 (compile_report: 255 registers, 456 spill bytes) and 8 do not.
    selected, selected_count: optional QSA selection [B, T, max_sel] int32 positions and [B, T] counts.
    Returns [B, T, Hq, D] in q's dtype.
    """
    batch, num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} must be a multiple of KV heads {num_kv_heads}")
    if (selected is None) != (selected_count is None):
        raise ValueError("selected and selected_count go together")
    group = num_q_heads // num_kv_heads
    # the rows' start (seq_len - T) becomes a page and an in-page row through the block tables: they must reach
    # every key a row may read (no device sync: max_keys is the host's bound)
    if selected is None:
        check_table_covers(block_tables.shape[1], block_size, max_keys, what="paged_attention")
    q = q.contiguous()
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    if precision is None:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
    num_partitions = max(1, triton.cdiv(max_keys, partition))
    stats_shape = (batch * num_rows, num_q_heads, num_partitions)
    m = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    denominator = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    acc = torch.empty((*stats_shape, head_dim), dtype=torch.float32, device=q.device)
    if selected is not None:
        selected, selected_count = selected.contiguous(), selected_count.contiguous()
    _attention_partition_kernel[(batch * num_rows, num_kv_heads, num_partitions)](
        q, k_pool, v_pool, block_tables, seq_lens,
        selected if selected is not None else seq_lens, selected_count if selected_count is not None else seq_lens,
        m, denominator, acc,
        num_rows, num_q_heads, num_kv_heads, block_size, block_tables.shape[1],
        selected.shape[-1] if selected is not None else 0, num_partitions, scale,
        D=head_dim, BD=triton.next_power_of_2(head_dim), GROUP=group, BG=max(16, triton.next_power_of_2(group)),
        BN=block_n, PART=partition, SELECTED=selected is not None, PRECISION=precision,
        num_warps=num_warps,
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _attention_merge_kernel[(batch * num_rows * num_q_heads,)](
        m, denominator, acc, out, num_partitions,
        D=head_dim, BD=triton.next_power_of_2(head_dim), BP=max(2, triton.next_power_of_2(num_partitions)),
    )
    return out
