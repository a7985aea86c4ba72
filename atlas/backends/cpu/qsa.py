"""QSA, the sparse top-k indexer on full-attention layers: which earlier tokens each query attends to.

Raw per-token index keys are cached un-normed and un-roped. For a query seeing n tokens, the first
n // ratio complete blocks of `ratio` keys are mean-pooled, normed and roped at the block's first
position; the budget / ratio best blocks by score sum_h relu(q_h . k_block) / sqrt(d) are kept, and the
incomplete tail block is always kept. While n <= budget + ratio - 1 every block is kept: dense attention.
When n % ratio == 0 the query's own block is complete, so it competes and can be dropped.
"""

from __future__ import annotations

import math

import torch

from atlas.backends.ops import acc_dtype, apply_rope, rms_norm, rope_table
from atlas.model.spec import ModelSpec


def index_projections(
    spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index projection's output qk [n, (heads + 1) * d] (x @ indexer.index_qk_proj.T) -> (index queries
    [n, heads, d] normed and roped, raw index keys [n, d])."""
    assert spec.qsa is not None
    q_heads, d = spec.qsa.n_heads, spec.qsa.head_dim
    q, raw_keys = qk.split([q_heads * d, d], dim=-1)
    q = rms_norm(q.reshape(-1, q_heads, d), w[pre + "indexer.q_layernorm.weight"], spec.rms_norm_eps)
    return apply_rope(q, cos, sin), raw_keys


def selection_mask(
    spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, queries: torch.Tensor, raw_keys: torch.Tensor, start: int
) -> torch.Tensor:
    """Which of the `len(raw_keys)` visible tokens each query (at positions start..) attends: [n, T] bool."""
    assert spec.qsa is not None
    ratio, topk = spec.qsa.ratio, spec.qsa.block_topk
    n, total = queries.shape[0], raw_keys.shape[0]
    positions = torch.arange(start, start + n)
    key_pos = torch.arange(total)
    mask = key_pos[None, :] <= positions[:, None]  # causal: dense unless the budget bites
    num_blocks = total // ratio
    if num_blocks <= topk:
        return mask

    d = raw_keys.shape[-1]
    pooled = raw_keys[: num_blocks * ratio].view(num_blocks, ratio, d).to(acc_dtype(raw_keys.dtype)).mean(dim=1)
    pooled = rms_norm(pooled.to(raw_keys.dtype), w[pre + "indexer.k_layernorm.weight"], spec.rms_norm_eps)
    cos, sin = rope_table(torch.arange(num_blocks) * ratio, spec.rotary_dim, spec.rope_theta, raw_keys.dtype)
    blocks = apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)  # [blocks, d]

    acc = acc_dtype(raw_keys.dtype)
    queries, blocks = queries.to(acc), blocks.to(acc)
    for i in range(n):
        visible = start + i + 1
        complete = visible // ratio
        if complete <= topk:
            continue
        scores = (queries[i] @ blocks[:complete].T).T  # [complete, heads]
        scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)
        chosen = scores.topk(topk, dim=0).indices
        keep = torch.zeros(total, dtype=torch.bool)
        keep[(chosen[:, None] * ratio + torch.arange(ratio)[None, :]).flatten()] = True
        keep[complete * ratio : visible] = True  # the incomplete tail block
        mask[i] = keep
    return mask
