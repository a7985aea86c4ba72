"""A full-attention layer over a `Group` on the CUDA backend: projections (attn_in), the new KV rows into the paged
pools (attn_write), attention over the paged KV, QSA-selected where the group needs it (attn_core), or through the
split-K paged kernel for a dense decode group (attn_paged); the gate and out projection (attn_gate_out)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.primitives import rms_norm
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.ops import acc_dtype, apply_rope, rope_table
from atlas.model.spec import ModelSpec


def qsa_selection(spec: ModelSpec, k_norm: torch.Tensor, queries: torch.Tensor, raw_keys: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Which key positions each row attends under QSA: [B, T, L] bool (before the causal mask).

    queries [B, T, heads, d] normed and roped, raw_keys [B, L, d] (L a multiple of the ratio). Ties in
    block scores go to the lowest block index (a stable descending sort), as the kernels do."""
    assert spec.qsa is not None
    ratio, topk = spec.qsa.ratio, spec.qsa.block_topk
    b, length, d = raw_keys.shape
    nb = length // ratio
    acc = acc_dtype(raw_keys.dtype)
    pooled = raw_keys.view(b, nb, ratio, d).to(acc).mean(dim=2).to(raw_keys.dtype)
    pooled = rms_norm(pooled, k_norm, spec.rms_norm_eps)
    block_pos = torch.arange(nb, device=raw_keys.device) * ratio
    cos, sin = rope_table(block_pos, spec.rotary_dim, spec.rope_theta, raw_keys.dtype)
    blocks = apply_rope(pooled.transpose(0, 1), cos, sin).transpose(0, 1)  # [B, NB, d]
    scores = torch.einsum("bthd,bjd->btjh", queries.to(acc), blocks.to(acc))
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)  # [B, T, NB]
    complete = (positions + 1) // ratio  # [B, T] blocks wholly visible to the row
    block_idx = torch.arange(nb, device=raw_keys.device)
    valid = block_idx[None, None, :] < complete[..., None]
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = torch.zeros_like(valid).scatter_(-1, order, True) & valid
    key_pos = torch.arange(length, device=raw_keys.device)
    keep = chosen[..., key_pos // ratio] | (key_pos[None, None, :] >= (complete * ratio)[..., None])
    sparse = (complete > topk)[..., None]  # dense while every complete block fits the budget
    return keep | ~sparse


def _attend_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Materialised fp32 scores. q [B, T, nkv, group, hd], keys/values [B, L, nkv, hd], mask [B, T, L] ->
    [B, T, nkv * group, hd]."""
    b, t, nkv, group, hd = q.shape
    length = keys.shape[1]
    # query head h reads KV head h // group: fold the group into the rows of each KV head
    qg = q.permute(0, 2, 1, 3, 4).reshape(b, nkv, t * group, hd)
    scores = qg @ keys.permute(0, 2, 3, 1) * hd**-0.5  # [B, nkv, T*group, L]
    m = mask[:, None, :, None, :].expand(b, 1, t, group, length).reshape(b, 1, t * group, length)
    scores = scores.masked_fill(~m, float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    out = probs @ values.permute(0, 2, 1, 3)  # [B, nkv, T*group, hd]
    return out.view(b, nkv, t, group, hd).permute(0, 2, 1, 3, 4)


def _attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 group: int) -> torch.Tensor:
    """F.scaled_dot_product_attention (the memory-efficient kernel on CUDA: no [T, L] fp32 score tensor per
    head). q [B, T, nh, hd], keys/values [B, L, nkv, hd], mask [B, T, L] (causal & QSA-selected) ->
    [B, T, nh, hd]. The KV heads are repeated to the query heads (a [B, nh, L, hd] copy: 8 MB at 2,048 keys)
    rather than enable_gqa=True, which with a mask falls back to the math kernel (it materialises the scores)."""
    k = keys.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    v = values.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
    return out.transpose(1, 2)


def attn_in(spec: ModelSpec, x: torch.Tensor, fused_in: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An attention layer's projections (pure): x [B, T, H] -> (q [R, nh, hd] normed and roped, gate [R, nh, hd],
    k [R, nkv, hd] normed and roped, v [R, nkv, hd], the QSA index projection [R, index width]), R = B * T."""
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = x.shape[0] * x.shape[1]
    index_width = (spec.qsa.n_heads + 1) * spec.qsa.head_dim if spec.qsa is not None else 0
    q, k, v, qk = (x.reshape(rows, -1) @ fused_in.T).split([nh * 2 * hd, nkv * hd, nkv * hd, index_width], dim=-1)
    q, gate = q.reshape(rows, nh, 2 * hd).chunk(2, dim=-1)
    q = rms_norm(q, q_norm, spec.rms_norm_eps)
    k = rms_norm(k.reshape(rows, nkv, hd), k_norm, spec.rms_norm_eps)
    return apply_rope(q, cos, sin), gate, apply_rope(k, cos, sin), v.reshape(rows, nkv, hd), qk


def attn_write(spec: ModelSpec, layer: int, k: torch.Tensor, v: torch.Tensor, qk: torch.Tensor, grp: Group,
               pools: DevicePools) -> None:
    """The group's new KV rows (and QSA raw index keys) into the paged pools, with their position stamps; the
    slot past the group's end loses its stale stamp."""
    attn_store(spec, k, v, qk, grp.write_slots.reshape(-1), pools.keys[layer], pools.values[layer],
               pools.index_keys.get(layer))
    pools.kv_pos[layer].view(-1).index_copy_(0, grp.stamp_at, grp.stamp_values)
    if spec.qsa is not None:
        pools.index_pos[layer].view(-1).index_copy_(0, grp.stamp_at, grp.stamp_values)


def attn_store(spec: ModelSpec, k: torch.Tensor, v: torch.Tensor, qk: torch.Tensor, write: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, raw_pool: torch.Tensor | None) -> None:
    """attn_write's data half: the new KV rows (and QSA raw index keys) at the flat KV slots `write` [R], on the
    pools handed in (a compiled region's head calls it, its stamps written once a step after the layers)."""
    nkv, hd = spec.num_kv_heads, spec.head_dim
    k_pool.view(-1, nkv, hd).index_copy_(0, write, k)
    v_pool.view(-1, nkv, hd).index_copy_(0, write, v)
    if spec.qsa is not None:
        assert raw_pool is not None
        d = spec.qsa.head_dim
        raw_pool.view(-1, d).index_copy_(0, write, qk[:, spec.qsa.n_heads * d :])


def attn_core(spec: ModelSpec, q: torch.Tensor, gate: torch.Tensor, qk: torch.Tensor, k_pool: torch.Tensor,
              v_pool: torch.Tensor, raw_pool: torch.Tensor | None, read_slots: torch.Tensor, positions: torch.Tensor,
              o_w: torch.Tensor, iq_norm: torch.Tensor | None, ik_norm: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, qsa_select: bool, sdpa: bool) -> torch.Tensor:
    """Gated attention over the paged KV (pure: reads the pools at read_slots), QSA-selected where the group
    needs it: q/gate [R, nh, hd], qk the QSA index projection [R, width] -> [B, T, H]."""
    b, t = positions.shape
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = b * t
    keys = k_pool.view(-1, nkv, hd)[read_slots]  # [B, L, nkv, hd]
    values = v_pool.view(-1, nkv, hd)[read_slots]
    key_pos = torch.arange(keys.shape[1], device=q.device)
    mask = key_pos[None, None, :] <= positions[..., None]  # [B, T, L]
    if spec.qsa is not None and qsa_select:
        assert raw_pool is not None and iq_norm is not None and ik_norm is not None
        heads, d = spec.qsa.n_heads, spec.qsa.head_dim
        iq = rms_norm(qk[:, : heads * d].reshape(rows, heads, d), iq_norm, spec.rms_norm_eps)
        iq = apply_rope(iq, cos, sin).view(b, t, heads, d)
        mask = mask & qsa_selection(spec, ik_norm, iq, raw_pool.view(-1, d)[read_slots], positions)
    group = nh // nkv
    if sdpa:
        out = _attend_sdpa(q.view(b, t, nh, hd), keys, values, mask, group).reshape(rows, nh * hd)
    else:
        out = _attend_torch(q.view(b, t, nkv, group, hd), keys, values, mask).reshape(rows, nh * hd)
    return attn_gate_out(out, gate, o_w, b, t)


def attn_gate_out(out: torch.Tensor, gate: torch.Tensor, o_w: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """The attention output [R, nh, hd] (or [R, nh * hd]) gated by sigmoid(gate) and projected -> [B, T, H]."""
    rows = b * t
    out = out.reshape(rows, -1) * torch.sigmoid(gate.reshape(rows, -1))
    return (out @ o_w.T).view(b, t, -1)


def attn_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, grp: Group) -> torch.Tensor:
    """A decode group's or a wide verify's attention (dense: no QSA selection) over the paged KV through the split-K
    kernel (Tuning.attention_kernels): q [R, nh, hd] normed and roped -> [R, nh, hd]. Keys are read in place through
    the block table; row t of a sequence sees positions [0, grp.ends - T + t] (its own key, and a verify's earlier
    rows' pending ones, written before the call)."""
    from atlas_kernels.paged_attention import paged_attention

    b, t = grp.positions.shape
    block_size = k_pool.shape[1]
    out = paged_attention(q.view(b, t, *q.shape[1:]), k_pool, v_pool, grp.block_table, grp.ends, q.shape[-1] ** -0.5,
                          grp.shape.key_blocks * block_size)
    return out.view(b * t, *q.shape[1:])


def attention_kind(grp: Group, tuning: Tuning) -> tuple[bool, bool]:
    """(sdpa, paged) of a group's attention (Tuning.attention_kernels): the paged kernel for a decode group or a wide
    verify without QSA selection, sdpa for the others; the materialised fp32 scores with the knob off."""
    paged = tuning.attention_kernels and (grp.shape.width == 1 or grp.shape.keep) and not grp.shape.qsa_select
    return tuning.attention_kernels and not paged, paged


def attention_layer(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, layer: int, x: torch.Tensor,
                    grp: Group, pools: DevicePools, cos: torch.Tensor, sin: torch.Tensor, *,
                    sdpa: bool = False, paged: bool = False) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]: gated attention over the paged KV (QSA-selected past the inert bound).
    sdpa: the scores through F.scaled_dot_product_attention, paged: the split-K kernel (attn_paged; a dense decode
    group only), attention_kind's."""
    q, gate, k, v, qk = attn_in(spec, x, w[pre + "fused_in.weight"], w[pre + "q_norm.weight"],
                                w[pre + "k_norm.weight"], cos, sin)
    attn_write(spec, layer, k, v, qk, grp, pools)
    if paged:
        b, t = grp.positions.shape
        return attn_gate_out(attn_paged(q, pools.keys[layer], pools.values[layer], grp), gate,
                             w[pre + "o_proj.weight"], b, t)
    return attn_core(spec, q, gate, qk, *attn_sources(spec, w, pre, layer, grp, pools), cos, sin,
                     grp.shape.qsa_select, sdpa)


def attn_sources(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, layer: int, grp: Group,
                 pools: DevicePools) -> tuple[torch.Tensor | None, ...]:
    """attn_core's arguments after qk, up to cos: the layer's KV (and QSA raw-key) pools, the group's read slots
    and positions, the output projection and the QSA norms (None without QSA)."""
    return (pools.keys[layer], pools.values[layer], pools.index_keys[layer] if spec.qsa is not None else None,
            grp.read_slots, grp.positions, w[pre + "o_proj.weight"], w.get(pre + "indexer.q_layernorm.weight"),
            w.get(pre + "indexer.k_layernorm.weight"))
