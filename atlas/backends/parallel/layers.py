"""The tensor-parallel forward of one group: the CUDA backend's layer functions on a rank's shard, with the
collectives where the math needs them.

Per layer: the mixer (attention or GDN, each on the rank's heads) ends in a row-parallel projection whose output
is a partial sum -> one all-reduce; the FFN (dense MLP, or MoE: shared expert split by width, routed experts
split by width ("tp") or by expert ("ep")) likewise -> one all-reduce. The embedding is vocab parallel (rows
outside the rank's range contribute exact zeros) -> one all-reduce; the lm_head is vocab parallel -> one
all-gather. Everything between (norms, hyper-connections, PLE, residuals) is replicated and computed on every
rank from identical inputs, so ranks hold the same residual stream bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cuda.attention import attention_layer
from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.gdn import GdnKernel, gdn_layer
from atlas.backends.cuda.hyper import hyper_mix
from atlas.backends.cuda.moe import moe_layer
from atlas.backends.cuda.ple import ple_layer
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.primitives import rms_norm, split_out
from atlas.backends.decoder import decoder_stack
from atlas.backends.ops import acc_dtype, dense_mlp, rope_table
from atlas.backends.parallel.comm import Comm
from atlas.backends.parallel.shard import TpLayout
from atlas.model.spec import FULL_ATTENTION, ModelSpec, MoeSpec


def ep_moe_layer(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, first_expert: int, *,
                 eager: bool) -> torch.Tensor:
    """x [R, H] -> this rank's partial [R, H] of the MoE block under expert parallelism: the routing over all
    `moe.num_experts` (the router is replicated), the routed slots whose expert this rank holds
    ([first_expert, first_expert + local experts)), plus its share of the width-split shared expert. The same
    three paths as atlas.backends.cuda.moe.moe_layer, on the local experts."""
    shared_width = moe.shared_intermediate_size
    logits, shared_gate, shared_up, shared_scale = split_out(  # (prepare_weights pads the fused rows)
        x @ w[pre + "fused_in.weight"].T, [moe.num_experts, shared_width, shared_width, 1])
    probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)
    top_w, top_i = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x.dtype)
    gate_up, down = w[pre + "experts.gate_up_proj"], w[pre + "experts.down_proj"]
    n_local = gate_up.shape[0]
    rows = x.shape[0]
    mine = (top_i >= first_expert) & (top_i < first_expert + n_local)
    # slots routed elsewhere go to a dummy expert index n_local with weight 0
    local_i = torch.where(mine, top_i - first_expert, n_local)
    local_w = torch.where(mine, top_w, torch.zeros_like(top_w))
    if eager:
        pairs = local_i.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=n_local + 1).tolist()
        outs = torch.zeros(rows * moe.top_k, x.shape[-1], dtype=x.dtype, device=x.device)
        for expert, picked in enumerate(torch.split(order, counts)[:n_local]):
            if not counts[expert]:
                continue
            g, u = (x[picked // moe.top_k] @ gate_up[expert].T).chunk(2, dim=-1)
            outs[picked] = (F.silu(g) * u) @ down[expert].T
        routed = (outs.view(rows, moe.top_k, -1) * local_w[..., None]).sum(dim=1)
    elif rows * moe.top_k < moe.num_experts:
        # gathers expert 0 for the slots routed elsewhere (weight 0): fixed shapes, no host sync
        idx = local_i.clamp_max(n_local - 1)
        gu = torch.einsum("rh,rkih->rki", x, gate_up[idx])
        g, u = gu.chunk(2, dim=-1)
        out = torch.einsum("rki,rkhi->rkh", F.silu(g) * u, down[idx])
        routed = (out * local_w[..., None]).sum(dim=1)
    else:
        gu = torch.einsum("rh,eih->eri", x, gate_up)
        g, u = gu.chunk(2, dim=-1)
        out = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [E_local, R, H]
        weights = torch.zeros(rows, n_local + 1, dtype=x.dtype, device=x.device).scatter_(1, local_i, local_w)
        routed = torch.einsum("re,erh->rh", weights[:, :n_local], out)
    shared = (F.silu(shared_gate) * shared_up) @ w[pre + "shared_expert.down_proj.weight"].T
    return routed + torch.sigmoid(shared_scale) * shared


def vocab_parallel_embed(table: torch.Tensor, tokens: torch.Tensor, first_id: int, comm: Comm) -> torch.Tensor:
    """Rows of the rank's embedding slice for the tokens it holds, exact zeros for the rest, summed over ranks:
    each token's row comes from exactly one rank, so the sum is that row bit for bit."""
    local = tokens - first_id
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)]
    return comm.all_reduce(torch.where(inside[..., None], rows, torch.zeros_like(rows)))


class VocabParallelHead:
    """Stands in for "lm_head.weight" in a TpBackend's weights: the CudaBackend computes every logit as
    `hidden @ weights["lm_head.weight"].T` (decode, prefill ends, verify rows, prompt logprobs), and here that
    product is the rank's vocabulary slice all-gathered (vocab_parallel_logits). (A hook in CudaBackend for the
    head would replace this stand-in.)"""

    def __init__(self, shard: torch.Tensor, vocab_size: int, comm: Comm) -> None:
        self.shard, self.vocab_size, self.comm = shard, vocab_size, comm

    @property
    def T(self) -> VocabParallelHead:  # the tensor attribute it stands in for
        return self

    def __rmatmul__(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.shard, self.vocab_size, self.comm)


def vocab_parallel_logits(hidden: torch.Tensor, head: torch.Tensor, vocab_size: int, comm: Comm) -> torch.Tensor:
    """hidden [..., H] -> logits [..., vocab]: each rank's vocabulary slice, gathered in rank order (no sums across
    ranks: every logit is computed whole on one rank), padding columns dropped."""
    return comm.all_gather_last(hidden @ head.T)[..., :vocab_size]


class TpGroupOps:
    """atlas.backends.decoder.LayerOps of one group on one rank (cf. the CUDA backend's _GroupOps)."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], pools: DevicePools, grp: Group,
                 layout: TpLayout, comm: Comm, *, eager_moe: bool, gdn_kernel: GdnKernel | None) -> None:
        self.spec, self.w, self.pools, self.grp = spec, w, pools, grp
        self.layout, self.comm = layout, comm
        self.eager_moe, self.gdn_kernel = eager_moe, gdn_kernel
        dtype = w["embed_tokens.weight"].dtype
        self.cos, self.sin = rope_table(grp.positions.reshape(-1), spec.rotary_dim, spec.rope_theta, dtype)

    def mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        spec, w, pre = self.spec, self.w, f"layers.{layer}."
        if spec.layer_types[layer] == FULL_ATTENTION:
            out = attention_layer(spec, w, pre + "self_attn.", layer, x, self.grp, self.pools, self.cos, self.sin)
        else:
            out = gdn_layer(spec, w, pre + "linear_attn.", layer, x, self.grp, self.pools, self.gdn_kernel)
        return self.comm.all_reduce(out)  # o_proj / out_proj are row parallel: partial sums

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        b, t = self.grp.tokens.shape
        pre = f"layers.{layer}.mlp."
        rows = x.reshape(b * t, -1)
        moe = self.spec.moe
        if self.spec.moe_layers[layer] and moe is not None:
            if self.layout.experts == "ep":
                first = self.layout.rank * (moe.num_experts // self.layout.tp)
                out = ep_moe_layer(moe, self.w, pre, rows, first, eager=self.eager_moe)
            else:
                out = moe_layer(moe, self.w, pre, rows, eager=self.eager_moe)
        else:
            out = dense_mlp(self.w, pre, rows)
        return self.comm.all_reduce(out).view(b, t, -1)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.spec.rms_norm_eps)

    def ple(self, layer: int, rank: int, streams: torch.Tensor) -> torch.Tensor:
        assert self.grp.ngram_ids is not None
        return ple_layer(self.spec, self.w, f"layers.{layer}.ple.", streams, self.grp.ngram_ids[rank], self.grp,
                         self.pools, layer)

    def hyper_mix(self, pre: str, streams: torch.Tensor, *, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_mix(self.spec, self.w, pre, streams, combine=combine)


def tp_forward_group(spec: ModelSpec, w: dict[str, torch.Tensor], pools: DevicePools, grp: Group, layout: TpLayout,
                     comm: Comm, first_id: int, *, eager_moe: bool, gdn_kernel: GdnKernel | None = None
                     ) -> torch.Tensor:
    """Feed the group's tokens through the stack on this rank: the final hidden states [B, T, H] (replicated)."""
    x = vocab_parallel_embed(w["embed_tokens.weight"], grp.tokens, first_id, comm)
    ops = TpGroupOps(spec, w, pools, grp, layout, comm, eager_moe=eager_moe, gdn_kernel=gdn_kernel)
    return decoder_stack(spec, x, ops)
