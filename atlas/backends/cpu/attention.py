"""Gated full attention over paged KV, with the optional QSA token selection.

q_proj yields per head a query and an output gate; q and k are RMS-normed per head (zero-centred), roped
on their first rotary_dim features, and the output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.qsa import index_projections, selection_mask
from atlas.backends.cpu.state import KvPool
from atlas.backends.ops import acc_dtype, apply_rope, rms_norm
from atlas.model.spec import ModelSpec


def attention_forward(
    spec: ModelSpec,
    w: dict[str, torch.Tensor],
    pre: str,
    layer: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: KvPool,
    block_table: tuple[int, ...],
    start: int,
    index_keys: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [n, H] at positions [start, start + n) -> (out [n, H], all raw index keys after this chunk)."""
    n, nh, nkv, hd = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    end = start + n
    q, gate = (x @ w[pre + "q_proj.weight"].T).view(n, nh, 2 * hd).chunk(2, dim=-1)
    q = rms_norm(q, w[pre + "q_norm.weight"], spec.rms_norm_eps)
    k = rms_norm((x @ w[pre + "k_proj.weight"].T).view(n, nkv, hd), w[pre + "k_norm.weight"], spec.rms_norm_eps)
    v = (x @ w[pre + "v_proj.weight"].T).view(n, nkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    kv.write(layer, kv.slots(block_table, start, end), k, v, torch.arange(start, end))
    kv.forget_after(layer, block_table, end)  # a reused block's stale stamps never pass for this sequence's rows
    keys, values = kv.read(layer, kv.slots(block_table, 0, end))  # [end, nkv, hd]

    if index_keys is not None and spec.qsa is not None:
        queries, raw = index_projections(spec, w, pre, x, cos, sin)
        index_keys = torch.cat([index_keys, raw], dim=0)
        mask = selection_mask(spec, w, pre, queries, index_keys, start)
    else:
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]

    group = nh // nkv
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * hd**-0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(x.dtype)), dim=-1).to(x.dtype)
    out = torch.einsum("hqk,khd->qhd", probs, values).reshape(n, nh * hd)
    out = out * torch.sigmoid(gate.reshape(n, nh * hd))
    return out @ w[pre + "o_proj.weight"].T, index_keys
