"""Gated full attention over paged KV, with the optional QSA token selection.

q_proj yields per head a query and an output gate; q and k are RMS-normed per head (zero-centred), roped
on their first rotary_dim features, and the output is multiplied by sigmoid(gate) before o_proj. Row-exact
(`rows.exact`, a verify's rows): the projections batched, each query's attention (and its QSA selection) over
exactly the prefix it sees, as the one-row feed of its position computes it.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.qsa import index_projections, selection_mask
from atlas.backends.cpu.rows import CHUNK, EXACT, RowMath
from atlas.backends.cpu.state import KvPool
from atlas.backends.cpu.weights import ATTENTION_IN, joined
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
    rows: RowMath = CHUNK,
    attend_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [n, H] at positions [start, start + n) -> (out [n - attend_from, H], all raw index keys after this chunk).
    Rows before `attend_from` only write their keys and values (a drafter's appended keys, whose output no
    later layer reads)."""
    n, nh, nkv, hd = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    end = start + n
    proj, sizes = joined(w, pre, ATTENTION_IN)  # q (with its gate), k, v and the QSA index projection if any
    q, k, v, *index = rows.mm(x, proj).split(sizes, dim=-1)
    k = rms_norm(k.reshape(n, nkv, hd), w[pre + "k_norm.weight"], spec.rms_norm_eps)
    v = v.reshape(n, nkv, hd)
    k = apply_rope(k, cos, sin)
    first, n = start + attend_from, n - attend_from  # the rows that attend: positions [first, end)
    q, gate = q[attend_from:].reshape(n, nh, 2 * hd).chunk(2, dim=-1)
    q = apply_rope(rms_norm(q, w[pre + "q_norm.weight"], spec.rms_norm_eps), cos[attend_from:], sin[attend_from:])

    slots = kv.slots(block_table, 0, max(end, len(block_table) * kv.block_size))  # every slot of the table
    kv.write(layer, slots[start:end], k, v, torch.arange(start, end))
    kv.forget(layer, slots[end:])  # a reused block's stale stamps never pass for this sequence's rows
    queries = None
    if index_keys is not None and spec.qsa is not None:
        queries, raw = index_projections(spec, w, pre, index[0], cos, sin)
        index_keys = torch.cat([index_keys, raw], dim=0)
        queries = queries[attend_from:]
    if n == 0:
        return x[:0], index_keys
    keys, values = kv.read(layer, slots[:end])  # [end, nkv, hd]
    if queries is not None and index_keys is not None:
        mask = selection_mask(spec, w, pre, queries, index_keys, first)
    else:
        mask = torch.arange(end)[None, :] <= torch.arange(first, end)[:, None]
    group = nh // nkv
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    if rows.exact and n > 1:  # each query over exactly its own prefix, as its one-row feed
        out = torch.cat([_attend(q[i : i + 1], keys[: first + i + 1], values[: first + i + 1],
                                 mask[i : i + 1, : first + i + 1]) for i in range(n)])
    else:
        out = _attend(q, keys, values, mask)
    out = out * torch.sigmoid(gate.reshape(n, nh * hd))
    return rows.mm(out, w[pre + "o_proj.weight"]), index_keys


def attention_rows(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, layer: int, x: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, kv: KvPool, block_table: tuple[int, ...], start: int,
                   index_keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """attention_forward with each row's bits those of a token-by-token feed."""
    return attention_forward(spec, w, pre, layer, x, cos, sin, kv, block_table, start, index_keys, EXACT)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Queries q [n, nh, hd] over keys and values [T, nh, hd] where `mask` [n, T] allows: [n, nh * hd]."""
    n, nh, hd = q.shape
    scores = torch.einsum("qhd,khd->hqk", q, keys) * hd**-0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, values).reshape(n, nh * hd)
