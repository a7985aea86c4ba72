"""The decoder's math over a `Group` of B sequences x T tokens, batched on the device.

The same formulas as the CPU reference (the shared ops of atlas.backends.ops and the decoder skeleton of
atlas.backends.decoder), arranged for fewer kernels (prepare_weights), with per-sequence state read from and
written back to slot-indexed pools. No host synchronisation on the decode
path (`eager_moe=False`), so a decode group can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.moe import ranked_topk, routed_triton
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.decoder import decoder_stack
from atlas.backends.ops import acc_dtype, apply_rope, dense_mlp, l2_normalise, rope_table
from atlas.model.spec import FULL_ATTENTION, ModelSpec, MoeSpec, PleSpec

# (q, k, v, a, b, A_log, dt_bias, state_pool, slots) -> out [B, T, Hv, dv]; q/k [B, T, Hk, dk] raw (the
# kernel l2-normalises and scales), a/b the raw gate projections [B, T, Hv]. None: the torch loop below.
GdnKernel = Callable[..., torch.Tensor]


def prepare_weights(spec: ModelSpec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights in the shapes the batched forward wants (a decode step is launch-bound: every kernel saved
    counts). One GEMM where the reference runs several over the same input: GDN's four input projections,
    attention's q/k/v (+ QSA index) projections, a hyper-connection's mix-down and inject weights (with their
    common 1/hc folded in), MoE's router + shared-expert gate/up + its gate; the parts are dropped, so no
    weight is held twice. Zero-centred norm weights become plain scales (1 + w); GDN's A_log becomes
    -exp(A_log) in fp32."""
    w = dict(w)

    def fuse(name: str, parts: list[str], align: int = 1) -> None:
        present = [p for p in parts if p in w]
        fused = torch.cat([w.pop(p) for p in present], dim=0)
        pad = -fused.shape[0] % align
        if pad:  # zero rows: the product's extra columns are dropped (split_out)
            fused = torch.cat([fused, fused.new_zeros(pad, *fused.shape[1:])])
        w[name] = fused.contiguous()

    acc = acc_dtype(next(iter(w.values())).dtype)
    for name in [n for n in w if _is_zero_centred_norm(n)]:
        w[name] = (1.0 + w[name].to(acc)).to(w[name].dtype)  # now a plain RMSNorm scale: one op fewer per norm
    for layer in range(spec.num_layers):
        pre = f"layers.{layer}."
        if spec.layer_types[layer] != FULL_ATTENTION:  # the decay's constant factor, once
            g = pre + "linear_attn."
            w[g + "neg_exp_A"] = -w[g + "A_log"].to(acc).exp()
            w[g + "dt_bias"] = w[g + "dt_bias"].to(acc)
        if spec.layer_types[layer] == FULL_ATTENTION:
            a = pre + "self_attn."
            fuse(a + "fused_in.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                         a + "indexer.index_qk_proj.weight"])
        else:
            g = pre + "linear_attn."
            fuse(g + "fused_in.weight", [g + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")])
        if spec.has_hyper_connections:
            for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
                fuse(pre + hc + "fused_down.weight", [pre + hc + "input_mix_weight_down.weight",
                                                      pre + hc + "block_inject_weight.weight"], ALIGN_ROWS)
                w[pre + hc + "fused_down.weight"] /= spec.hc_count  # both products are divided by hc: fold it
        m = pre + "mlp."
        if spec.moe_layers[layer] and spec.moe is not None:
            fuse(m + "fused_in.weight", [m + "gate.weight", m + "shared_expert.gate_proj.weight",
                                         m + "shared_expert.up_proj.weight", m + "shared_expert_gate.weight"],
                 ALIGN_ROWS)
    if spec.has_hyper_connections:
        w["hyper_connection_mixer.input_mix_weight_down.weight"] = (
            w["hyper_connection_mixer.input_mix_weight_down.weight"] / spec.hc_count)
    return w


# fused weights padded to a multiple of this many output rows (zeros): a product whose output rows are not 16-byte
# aligned cannot take cuBLAS's sm90 kernels. H200, session 7: the hyper mix-down + inject (324 columns) ran as
# cutlass_80 s16816 GEMMs (48 a step, 7.6 us each at batch 64, 55 us at 2,048 tokens) and the MoE router + shared
# expert input (1,041 columns) as cutlass_75 s1688 (12.2 us at batch 64, 133 us at 2,048 tokens)
ALIGN_ROWS = 8


def split_out(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """y's last dimension split into `sizes`, any padding columns past their sum dropped (prepare_weights pads
    fused weights to ALIGN_ROWS rows; a caller's own unpadded fusion has none)."""
    rest = y.shape[-1] - sum(sizes)
    parts = list(y.split([*sizes, rest], dim=-1)) if rest else list(y.split(sizes, dim=-1))
    return parts[: len(sizes)]


def _is_zero_centred_norm(name: str) -> bool:
    # every RMSNorm weight but GDN's gated output norm is zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w)
    ends = ("norm.weight", "layernorm.weight", "norm_key.weight", "norm_query.weight", "norm_conv.weight")
    return name.endswith(ends) and not name.endswith("linear_attn.norm.weight")


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    """RMSNorm with a plain scale (prepare_weights turned each zero-centred weight w into 1 + w), over groups
    of `group` features if set. torch's rms_norm: one fused kernel where torch has one (CUDA)."""
    if group is None:
        return F.rms_norm(x, (x.shape[-1],), scale, eps)
    y = F.rms_norm(x.unflatten(-1, (-1, group)), (group,), None, eps).flatten(-2)
    return y * scale


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """GDN's output norm: plain RMSNorm times act(gate) (atlas.backends.ops.gated_rms_norm)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps) * (F.silu(gate) if act == "silu" else torch.sigmoid(gate))


def hyper_mix(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, streams: torch.Tensor, *, combine: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """atlas.backends.cpu.hyper.hyper_mix with the mix-down and inject weights in one GEMM (prepare_weights)."""
    down_w = w[pre + "fused_down.weight"] if combine else w[pre + "input_mix_weight_down.weight"]
    return hyper_block(streams, w[pre + "hc_norm.weight"], down_w, w[pre + "input_mix_weight_up.weight"],
                       spec.hc_count, spec.hidden_size, spec.hc_lowrank, spec.rms_norm_eps, combine)


# linear(gemv="split"): the reduction over K cut into chunks of this many inputs where K is a multiple of it, >= 2 of them
SPLIT_K = 1024


def linear(x: torch.Tensor, w: torch.Tensor, gemv: str = "") -> torch.Tensor:
    """x [..., K] @ w.T [N, K]; gemv "" the GEMM. "split" (a compiled decode region of at most regions.GEMV_ROWS
    rows): the product written as a broadcast multiply and an fp32 sum over K, which Inductor lowers to a reduction kernel of
    its own, fused with what surrounds it, in place of a cuBLAS GEMV (H200, session 8: the hyper sites' 5 MB
    GEMVs 4-7 us each, + a split-K reduce, at 15-30% of the copy rate). Rounded once, as the GEMM rounds: fp32
    accumulation in either. Eagerly it materialises [..., N, K]: a compiled region's form only.

    Where K is a multiple of SPLIT_K (at least two chunks) the sum over K as partial sums over chunks of SPLIT_K,
    then their sum, so a product of few outputs and a long K (the mix-down: 328 outputs of 8,192 inputs, one 8 us
    reduction kernel of 328 programs at batch 1 on the H200) runs as N x K / SPLIT_K programs; the partials' sum
    fuses into the consumer (H200: b1 3.47 -> 3.30 ms a step against cuBLAS's GEMVs)."""
    if not gemv:
        return x @ w.T
    acc = acc_dtype(x.dtype)
    k = x.shape[-1]
    if gemv == "split" and k % SPLIT_K == 0 and k >= 2 * SPLIT_K:
        xs, ws = x.unflatten(-1, (k // SPLIT_K, SPLIT_K)), w.unflatten(-1, (k // SPLIT_K, SPLIT_K))
        return (xs.unsqueeze(-3).to(acc) * ws.to(acc)).sum(dim=-1).sum(dim=-1).to(x.dtype)
    return (x.unsqueeze(-2).to(acc) * w.to(acc)).sum(dim=-1).to(x.dtype)


def hyper_block(streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, hc: int,
                hidden: int, lowrank: int, eps: float, combine: bool, gemv: str = ""
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One hyper-connection site on tensors: (block input [.., H], injection weights [.., hc] or None). gemv: its
    two products' form (`linear`)."""
    normed = rms_norm(streams, norm_w, eps, group=hidden)
    product = linear(normed, down_w, gemv)
    if combine:  # 1/hc is folded into the weights (prepare_weights)
        down, inject = split_out(product, [lowrank, hc])
    else:
        down, inject = product, None
    mix = torch.sigmoid(linear(F.silu(down), up_w, gemv)).unflatten(-1, (hc, hidden))
    mixed = (mix * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    if inject is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(inject)


def conv_step(prev: torch.Tensor, new: torch.Tensor, weight: torch.Tensor, dilation: int = 1,
              library: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of new columns [B, C, T] continuing the states prev [B, C, S] (pure: nothing
    written): (out [B, C, T] with fp32 accumulation in new's dtype, the columns [B, C, S + T] whose last S are
    the state after the group).

    library (Tuning.library_conv; bf16/fp16 chunks of more than one token only): F.conv1d, depthwise (cuDNN, fp32
    accumulation), in place of the windowed product, which materialises [B, C, T, K] fp32 windows: at 2,048 tokens
    that product, its casts and its sum were ~20 ms of an 81 ms prefill on the H200. fp32 (the parity mode) and
    decode keep the windowed product: its order is the reference's, and T = 1 is tiny (and cuDNN's choice of
    algorithm by shape is not known to be batch-invariant, so the invariant modes keep the windowed product)."""
    state_len = prev.shape[-1]
    k = weight.shape[-1]
    base = state_len - (k - 1) * dilation  # first column the first new output reads
    if library and new.shape[-1] > 1 and new.dtype in (torch.bfloat16, torch.float16):
        cols = torch.cat([prev.to(new.dtype), new], dim=-1)  # [B, C, S + T]
        return F.conv1d(cols[:, :, base:], weight.to(new.dtype), groups=cols.shape[1], dilation=dilation), cols
    span = (k - 1) * dilation + 1
    acc = acc_dtype(new.dtype)
    cols = torch.cat([prev.to(new.dtype), new], dim=-1)  # [B, C, S + T]
    windows = cols[:, :, base:].unfold(-1, span, 1)[..., ::dilation]  # [B, C, T, K], a view
    return (windows.to(acc) * weight[None, :, None, 0, :].to(acc)).sum(-1).to(new.dtype), cols


def causal_conv_pooled(pools: DevicePools, grp: Group, name: str, new: torch.Tensor, weight: torch.Tensor,
                       dilation: int = 1, library: bool = False) -> torch.Tensor:
    """conv_step continuing each slot's state pools.state[name][slot] [C, S]; updates the state (and its stamp)
    in place, or with grp.shape.keep keeps the state after each column for the verify's commit."""
    out, cols = conv_step(pools.state[name][grp.slots], new, weight, dilation, library)
    put_conv(pools, grp, name, cols)
    return out


def put_conv(pools: DevicePools, grp: Group, name: str, cols: torch.Tensor) -> None:
    """conv_step's columns [B, C, S + T] into the conv state `name` (its last S columns, and the stamp), or with
    grp.shape.keep the state after each column for the verify's commit."""
    state_len = pools.state[name].shape[-1]
    per_token = cols.unfold(-1, state_len, 1)[:, :, 1:].permute(2, 0, 1, 3) if grp.shape.keep else None
    pools.put(name, grp.slots, grp.positions, cols[:, :, -state_len:], per_token, grp.shape.keep, grp.ends)


def gdn_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token. q/k [B, T, Hv, dk] normalised, v [B, T, Hv, dv], g/beta
    [B, T, Hv] (fp32); the state pool (fp32 [slots, Hv, dk, dv]) is read at `slots` (not written).
    Returns (out [B, T, Hv, dv], the state after each token [T, B, Hv, dk, dv])."""
    s = pool[slots]
    out = torch.empty(v.shape, dtype=s.dtype, device=v.device)
    decay = g.exp()
    states = []
    for t in range(q.shape[1]):
        s = s * decay[:, t, :, None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        states.append(s)
    return out, torch.stack(states)


def silu_conv(prev: torch.Tensor, new: torch.Tensor, weight: torch.Tensor, dilation: int = 1, library: bool = False,
              fused: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(conv) [B, T, C] time-major, conv_step's columns [B, C, S + T]) of the time-major new columns [B, T, C]
    (a view is fine). fused (a compiled prefill region): "" conv_step's windowed (or library) product, "triton"
    atlas_kernels.conv.causal_conv_prefill on a CUDA device (one kernel reading `new` in place, time-major; the
    windowed product elsewhere)."""
    if fused == "triton" and new.is_cuda and new.shape[1] > 1:
        prev = prev.to(new.dtype)
        out = torch.ops.atlas.causal_conv_prefill(new, prev, weight, dilation, True)
        return out, torch.cat([prev, new.transpose(1, 2)], dim=-1)
    conv, cols = conv_step(prev, new.transpose(1, 2), weight, dilation, library)
    return F.silu(conv).transpose(1, 2), cols


def gdn_in(spec: ModelSpec, x: torch.Tensor, fused_in: torch.Tensor, conv_w: torch.Tensor, conv_prev: torch.Tensor,
           library_conv: bool = False, fused_conv: str = "") -> tuple[torch.Tensor, ...]:
    """A GDN layer's projections and causal conv (pure): x [B, T, H], the slots' conv states [B, C, S] ->
    (q, k [B, T, nk, dk], v [B, T, nv, dv], z [B, T, nv, dv], beta_raw, a [B, T, nv], conv columns [B, C, S + T]);
    fused_conv as silu_conv's `fused`."""
    b, t, _ = x.shape
    nk, nv, dk, dv = spec.gdn_k_heads, spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim
    qkv, z, beta_raw, a = (x @ fused_in.T).split([spec.gdn_conv_dim, nv * dv, nv, nv], dim=-1)
    mixed, cols = silu_conv(conv_prev, qkv, conv_w, 1, library_conv, fused_conv)
    # [B, T, C] channels-last (a no-op at T = 1, for the Triton conv; the others' is copied, Inductor
    # fusing the copy with the silu): q / k / v are then token-strided slices the GDN kernels read in place (before,
    # each was copied a prefill layer)
    mixed = mixed.contiguous()
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    return (q.reshape(b, t, nk, dk), k.reshape(b, t, nk, dk), v.reshape(b, t, nv, dv), z.reshape(b, t, nv, dv),
            beta_raw, a, cols)


def gdn_out(spec: ModelSpec, out: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor
            ) -> torch.Tensor:
    """The recurrence's output [B, T, nv, dv] (any float dtype) through the gated norm and out_proj -> [B, T, H]."""
    b, t = out.shape[:2]
    o = gated_rms_norm(out.to(z.dtype), z, norm_w, spec.rms_norm_eps, spec.gdn_gate_act)
    return o.reshape(b, t, -1) @ out_w.T


def gdn_update(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, layer: int, parts: tuple[torch.Tensor, ...],
               grp: Group, pools: DevicePools, kernel: GdnKernel | None, conv_written: bool = False
               ) -> torch.Tensor:
    """gdn_in's parts -> the recurrence's output [B, T, nv, dv], writing the conv and recurrent state and their
    stamps at the group's slots (a wide verify keeps the state after each row instead). conv_written: the conv
    state's data is in its pool already (a compiled region's head wrote it; its stamp is the caller's)."""
    q, k, v, _z, beta_raw, a, cols = parts
    if not conv_written:
        put_conv(pools, grp, f"conv{layer}", cols)
    state_pool = pools.gdn_state[layer]
    if kernel is not None:  # the kernel computes the gates from the raw projections (decode: in-kernel)
        # the kernel writes the live state and its stamp itself (unless keep: then the kept rows, here)
        out, states = kernel(q, k, v, a, beta_raw, w[pre + "A_log"], w[pre + "dt_bias"], state_pool, grp.slots,
                             keep=grp.shape.keep, stamp=(pools.stamp[f"gdn{layer}"], grp.ends))
        if grp.shape.keep:
            pools.put(f"gdn{layer}", grp.slots, grp.positions, None, states.transpose(0, 1), True, grp.ends)
        return out
    acc = acc_dtype(v.dtype)
    nk, nv, dk = spec.gdn_k_heads, spec.gdn_v_heads, spec.gdn_k_dim
    g = w[pre + "neg_exp_A"] * F.softplus(a.to(acc) + w[pre + "dt_bias"])
    beta = torch.sigmoid(beta_raw).to(acc)
    # each key head serves nv / nk consecutive value heads
    q = l2_normalise(q.repeat_interleave(nv // nk, dim=2).to(acc)) * dk**-0.5
    k = l2_normalise(k.repeat_interleave(nv // nk, dim=2).to(acc))
    out, states = gdn_recurrence(q, k, v.to(acc), g, beta, state_pool, grp.slots)
    pools.put(f"gdn{layer}", grp.slots, grp.positions, states[-1], states, grp.shape.keep, grp.ends)
    return out


def gdn_layer(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, layer: int, x: torch.Tensor, grp: Group,
              pools: DevicePools, kernel: GdnKernel | None, library_conv: bool = False) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H] through one Gated DeltaNet layer (conv and recurrent state, with their stamps,
    at the group's slots; a wide verify keeps the state after each row instead)."""
    parts = gdn_in(spec, x, w[pre + "fused_in.weight"], w[pre + "conv1d.weight"], pools.state[f"conv{layer}"][grp.slots],
                   library_conv)
    out = gdn_update(spec, w, pre, layer, parts, grp, pools, kernel)
    return gdn_out(spec, out, parts[3], w[pre + "norm.weight"], w[pre + "out_proj.weight"])


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
    """A decode group's attention (T = 1, dense: no QSA selection) over the paged KV through the split-K kernel
    (Tuning.attention_kernels): q [R, nh, hd] normed and roped -> [R, nh, hd]. Keys are read in place through the
    block table; each row sees positions [0, grp.ends) (its own key written before the call)."""
    from atlas_kernels.paged_attention import paged_attention

    b, t = grp.positions.shape
    block_size = k_pool.shape[1]
    out = paged_attention(q.view(b, t, *q.shape[1:]), k_pool, v_pool, grp.block_table, grp.ends, q.shape[-1] ** -0.5,
                          grp.shape.key_blocks * block_size)
    return out.view(b * t, *q.shape[1:])


def attention_kind(grp: Group, tuning: Tuning) -> tuple[bool, bool]:
    """(sdpa, paged) of a group's attention (Tuning.attention_kernels): the paged kernel for a decode-shaped group
    without QSA selection, sdpa for the others; the materialised fp32 scores with the knob off."""
    paged = tuning.attention_kernels and grp.shape.width == 1 and not grp.shape.qsa_select
    return tuning.attention_kernels and not paged, paged


def library_conv(tuning: Tuning, grp: Group, invariant: bool) -> bool:
    """Whether a group's eager causal convs take the library conv (Tuning.library_conv): prefill chunks only, never
    in a batch-invariant mode (see conv_step). A compiled prefill region's GDN and PLE convs take the windowed
    product or the Triton conv instead (regions.regions_stack)."""
    return tuning.library_conv and grp.shape.width > 1 and not invariant


def moe_mode_of(tuning: Tuning, prefill: bool) -> str:
    """moe_routed's mode for a group (Tuning.moe_kernels): "triton" the device-routed kernels;
    else a prefill chunk's "grouped" (one host sync a layer) and a decode group's "torch" (fixed shapes)."""
    if not tuning.moe_kernels:
        return "grouped" if prefill else "torch"
    return "triton"


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


def moe_router(moe: MoeSpec, x: torch.Tensor, fused_in: torch.Tensor, shared_down: torch.Tensor,
               ranked: bool = False, gemv: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing and the shared expert on tensors: (top_w [R, K] in x's dtype, top_i [R, K], the gated
    shared expert's output [R, H]). ranked: the top-k as moe.ranked_topk (fusable; torch.topk's result); gemv:
    the two products' form (`linear`)."""
    shared_width = moe.shared_intermediate_size
    logits, shared_gate, shared_up, shared_scale = split_out(
        linear(x, fused_in, gemv), [moe.num_experts, shared_width, shared_width, 1])
    probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)
    top_w, top_i = ranked_topk(probs, moe.top_k) if ranked else torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    shared = linear(F.silu(shared_gate) * shared_up, shared_down, gemv)
    return top_w.to(x.dtype), top_i, torch.sigmoid(shared_scale) * shared


def moe_layer(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, *, eager: bool = False,
              mode: str | None = None) -> torch.Tensor:
    """x [R, H] -> [R, H]: top-k routed experts (moe_routed) + sigmoid-gated shared expert."""
    top_w, top_i, shared = moe_router(moe, x, w[pre + "fused_in.weight"], w[pre + "shared_expert.down_proj.weight"])
    return moe_routed(moe, w, pre, x, top_w, top_i, eager=eager, mode=mode) + shared


def moe_routed(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, top_w: torch.Tensor,
               top_i: torch.Tensor, *, eager: bool = False, mode: str | None = None,
               route: tuple[torch.Tensor, torch.Tensor] | None = None, summed: bool = True) -> torch.Tensor:
    """sum_k top_w * expert_{top_i}(x) [R, H] (summed=False with mode "triton": the pairs' weighted outputs
    [R, K, H], each the row's own slot k, the sum over k the caller's; every other mode sums here).

    eager: group tokens by expert (one host sync for the counts; right for prefill, where each expert
    sees many tokens). Otherwise fixed shapes for CUDA graphs: with fewer routed slots than experts, the
    chosen experts' weights are gathered per slot; else every expert runs on every row, weighted by a
    routing matrix that is zero off the top-k (decode at batch >= E / top_k touches most experts anyway).
    mode (moe_mode_of) overrides eager: "grouped" is eager; "torch" the fixed shapes; "triton" routes on the
    device and reads the chosen experts in place (atlas.backends.cuda.moe: no host sync, graph-capturable). route: the pairs' (order,
    offsets) for "triton" if the caller counted them (moe.counted_route)."""
    eager = mode == "grouped" if mode is not None else eager
    rows = x.shape[0]
    gate_up, down = w[pre + "experts.gate_up_proj"], w[pre + "experts.down_proj"]
    if mode == "triton":
        return routed_triton(x, top_i, top_w, gate_up, down, route, summed)
    if eager:
        # (token, slot) pairs sorted by expert: one host sync for the counts, each pair's output written once
        # (no atomics), then summed over the slots in a fixed order
        pairs = top_i.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=moe.num_experts).tolist()
        outs = torch.empty(rows * moe.top_k, x.shape[-1], dtype=x.dtype, device=x.device)
        for expert, picked in enumerate(torch.split(order, counts)):
            if not counts[expert]:
                continue
            g, u = (x[picked // moe.top_k] @ gate_up[expert].T).chunk(2, dim=-1)
            outs[picked] = (F.silu(g) * u) @ down[expert].T
        return (outs.view(rows, moe.top_k, -1) * top_w[..., None]).sum(dim=1)
    if rows * moe.top_k < moe.num_experts:
        gu = torch.einsum("rh,rkih->rki", x, gate_up[top_i])
        g, u = gu.chunk(2, dim=-1)
        out = torch.einsum("rki,rkhi->rkh", F.silu(g) * u, down[top_i])
        return (out * top_w[..., None]).sum(dim=1)
    gu = torch.einsum("rh,eih->eri", x, gate_up)
    g, u = gu.chunk(2, dim=-1)
    out = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [E, R, H]
    weights = torch.zeros(rows, moe.num_experts, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w)
    return torch.einsum("re,erh->rh", weights, out)


def ple_layer(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, streams: torch.Tensor, ids: torch.Tensor,
              grp: Group, pools: DevicePools, layer: int, library_conv: bool = False) -> torch.Tensor:
    """streams [B, T, hc*H], n-gram ids [B, T, heads] -> the addition to the streams (PLE, see
    atlas.backends.cpu.ple); the dilated short conv's state lives in conv_pool at the group's slots."""
    name = f"pconv{layer}"
    add, cols = ple_mix(spec, streams, ids, *ple_weights(w, pre), pools.state[name][grp.slots], library_conv)
    put_conv(pools, grp, name, cols)
    return add


def ple_weights(w: dict[str, torch.Tensor], pre: str) -> tuple[torch.Tensor, ...]:
    """A PLE layer's weights in ple_mix's order."""
    return tuple(w[pre + name] for name in ("ngram_embedding.weight", "key_proj.weight", "norm_key.weight",
                                             "norm_query.weight", "value_proj.weight", "norm_conv.weight",
                                             "conv1d.weight"))


def ple_mix(spec: ModelSpec, streams: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, key_w: torch.Tensor,
            key_norm: torch.Tensor, query_norm: torch.Tensor, value_w: torch.Tensor, conv_norm: torch.Tensor,
            conv_w: torch.Tensor, prev: torch.Tensor, library_conv: bool = False, fused_conv: str = ""
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the PLE addition to the streams [B, T, hc*H], the conv's columns [B, C, S + T] whose last S are its new
    state) from the n-gram ids [B, T, heads] and the conv state before the group `prev` [B, C, S]; pure."""
    assert spec.ple is not None
    hc, hidden = spec.hc_count, spec.hidden_size
    b, t, _ = streams.shape
    eps = spec.rms_norm_eps
    emb = table[ids].flatten(-2)  # [B, T, embed_dim]
    key = rms_norm(emb @ key_w.T, key_norm, eps, group=hidden)
    query = rms_norm(streams, query_norm, eps, group=hidden)
    value = emb @ value_w.T
    gate = (key.view(b, t, hc, hidden) * query.view(b, t, hc, hidden)).sum(-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [B, T, hc*H]
    normed = rms_norm(gated, conv_norm, eps, group=hidden)
    conv, cols = silu_conv(prev, normed, conv_w, spec.ple.ngram_size, library_conv, fused_conv)
    return gated + conv, cols


def device_ngram_ids(pools: DevicePools, grp: Group, ple: PleSpec, tables: Sequence[tuple[torch.Tensor, ...]]
                     ) -> torch.Tensor:
    """[P, B, T, heads] int64: the PLE n-gram ids of a group's tokens, from each slot's n-gram context on the
    device (pools "pctx", the last context_len ids) continued by the tokens: what atlas.model.ngram.ngram_ids
    gives for the last T positions of context + tokens (the token `order - 1` back, or EOS when an EOS lies
    between; int64 arithmetic as there). `tables`: per PLE layer (multipliers, head vocab sizes, head offsets)
    as device int64 tensors. Replaces the host's per-row Python ids: for decode (H200, session 5: 2,048
    `_ngram_one` calls a batch-64 step, ~0.4 ms of host time before the graph could launch) and for prefill
    chunks (session 11: a 2,048-token chunk's ids, their `tolist` and packing were ~2-4 ms of host time)."""
    return ngram_ids_from(pools.state["pctx"][grp.slots], grp.tokens, ple, tables)


def ngram_ids_from(ctx: torch.Tensor, tokens: torch.Tensor, ple: PleSpec, tables: Sequence[tuple[torch.Tensor, ...]]
                   ) -> torch.Tensor:
    """device_ngram_ids' arithmetic (pure): the slots' n-gram context ctx [B, L] continued by tokens [B, T]. A
    table with a fourth tensor (the n-gram row cache's remap, atlas.backends.cuda.ngram) gives the rows' slots."""
    length, width = ctx.shape[1], tokens.shape[1]
    if length < ple.ngram_size - 1:
        raise ValueError(f"the PLE context holds {length} ids; n-grams of {ple.ngram_size} need {ple.ngram_size - 1}")
    history = torch.cat([ctx, tokens], dim=1)  # [B, L + T]; the new tokens at L .. L + T - 1
    eos = ple.eos_token_id
    shifted = [history[:, length:]]
    eos_between = torch.zeros_like(tokens, dtype=torch.bool)
    for back in range(1, ple.ngram_size):  # the token `back` positions before, or EOS past an EOS
        before = history[:, length - back : length - back + width]
        eos_between = eos_between | (before == eos)  # an EOS among the `back` tokens before
        shifted.append(torch.where(eos_between, eos, before))
    out = []
    for mult, sizes, offsets, *remap in tables:
        mixed = shifted[0] * mult[0]
        blocks = []
        for order in range(2, ple.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[order - 1] * mult[order - 1])
            lo = (order - 2) * ple.heads_per_ngram
            blocks.append(torch.remainder(mixed[..., None], sizes[lo : lo + ple.heads_per_ngram])
                          + offsets[lo : lo + ple.heads_per_ngram])
        ids = torch.cat(blocks, dim=-1)
        out.append(remap[0][ids].long() if remap else ids)
    return torch.stack(out)


def ple_context_update(pools: DevicePools, grp: Group) -> None:
    """The device's PLE n-gram context (the last context_len ids) continued by the group's tokens, with its
    stamp; a wide verify keeps the context after each row."""
    ctx = pools.state["pctx"]
    length = ctx.shape[1]
    history = torch.cat([ctx[grp.slots], grp.tokens], dim=1)  # [B, L + T]
    per_token = history.unfold(1, length, 1)[:, 1:].transpose(0, 1) if grp.shape.keep else None
    pools.put("pctx", grp.slots, grp.positions, history[:, -length:], per_token, grp.shape.keep, grp.ends)


class _GroupOps:
    """The layer ops of one group: batched [B, T, ...] tensors, state in the pools at the group's slots."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], pools: DevicePools, grp: Group, *,
                 eager_moe: bool, gdn_kernel: GdnKernel | None, tuning: Tuning | None = None,
                 invariant: bool = False) -> None:
        self.spec, self.w, self.pools, self.grp = spec, w, pools, grp
        self.gdn_kernel = gdn_kernel
        self.tuning = tuning = tuning or Tuning()
        # eager groups (prefill chunks) may sync with the host; the rest must stay graph-capturable
        self.moe_mode = moe_mode_of(tuning, eager_moe)
        self.library_conv = library_conv(tuning, grp, invariant)
        dtype = w["embed_tokens.weight"].dtype
        self.cos, self.sin = rope_table(grp.positions.reshape(-1), spec.rotary_dim, spec.rope_theta, dtype)

    def mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        spec, w, pre = self.spec, self.w, f"layers.{layer}."
        if spec.layer_types[layer] == FULL_ATTENTION:
            sdpa, paged = attention_kind(self.grp, self.tuning)
            return attention_layer(spec, w, pre + "self_attn.", layer, x, self.grp, self.pools, self.cos, self.sin,
                                   sdpa=sdpa, paged=paged)
        return gdn_layer(spec, w, pre + "linear_attn.", layer, x, self.grp, self.pools, self.gdn_kernel,
                         self.library_conv)

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        b, t = self.grp.tokens.shape
        pre = f"layers.{layer}.mlp."
        rows = x.reshape(b * t, -1)
        if self.spec.moe_layers[layer] and self.spec.moe is not None:
            return moe_layer(self.spec.moe, self.w, pre, rows, mode=self.moe_mode).view(b, t, -1)
        return dense_mlp(self.w, pre, rows).view(b, t, -1)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.spec.rms_norm_eps)  # a plain scale since prepare_weights

    def ple(self, layer: int, rank: int, streams: torch.Tensor) -> torch.Tensor:
        assert self.grp.ngram_ids is not None
        return ple_layer(self.spec, self.w, f"layers.{layer}.ple.", streams, self.grp.ngram_ids[rank], self.grp,
                         self.pools, layer, self.library_conv)

    def hyper_mix(self, pre: str, streams: torch.Tensor, *, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_mix(self.spec, self.w, pre, streams, combine=combine)


def forward_group(spec: ModelSpec, w: dict[str, torch.Tensor], pools: DevicePools, grp: Group, *,
                  eager_moe: bool, gdn_kernel: GdnKernel | None = None, tuning: Tuning | None = None,
                  invariant: bool = False) -> torch.Tensor:
    """Feed the group's tokens through the stack: the final hidden states [B, T, H].

    eager_moe: the group runs eagerly (a prefill chunk), so its MoE may sync with the host (moe_mode_of);
    otherwise it stays graph-capturable. invariant: the backend is batch-invariant."""
    ops = _GroupOps(spec, w, pools, grp, eager_moe=eager_moe, gdn_kernel=gdn_kernel, tuning=tuning,
                    invariant=invariant)
    return decoder_stack(spec, w["embed_tokens.weight"][grp.tokens], ops)
