"""A Gated DeltaNet layer over a `Group` on the CUDA backend: projections and causal conv (gdn_in), the recurrence
through the Triton kernels or the torch loop, its state and stamp in the pools (gdn_update), the gated norm and the
out projection (gdn_out)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.primitives import gated_rms_norm, put_conv, silu_conv
from atlas.backends.ops import acc_dtype, l2_normalise
from atlas.model.spec import ModelSpec

# (q, k, v, a, b, A_log, dt_bias, state_pool, slots) -> out [B, T, Hv, dv]; q/k [B, T, Hk, dk] raw (the
# kernel l2-normalises and scales), a/b the raw gate projections [B, T, Hv]. None: the torch loop below.
GdnKernel = Callable[..., torch.Tensor]


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


def triton_gdn() -> GdnKernel | None:
    """The Triton GDN kernels (decode: recurrent update; prefill: chunked, its intermediates and scan products in
    bf16 for bf16 inputs, fp32 for fp32 ones), or None when atlas_kernels is not importable. On a CPU they run only
    under TRITON_INTERPRET=1 (tests)."""
    try:
        from atlas_kernels.gdn_chunk_split import gdn_chunk_prefill_gated
        from atlas_kernels.gdn_recurrent import gdn_recurrent_gated
    except ImportError:
        return None

    def gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b_raw: torch.Tensor,
            a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, *, keep: bool = False,
            stamp: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, per-token states [B, T, ...] when `keep`: a wide verify, whose live state is left as it was).
        stamp: (the state's stamps [slots], each row's new stamp [B]), written with the state unless `keep`."""
        if keep:  # a verify: every row's state kept for the commit, the slot not written
            return gdn_recurrent_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, store_states=True,
                                       commit=False)
        if q.shape[1] == 1:  # g, beta and the stamp in the kernel: no separate launches for them per layer
            return gdn_recurrent_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, stamp=stamp)[0], None
        # the split chunk kernel (chunk-local products in a parallel kernel, then the state scan), the gates, the
        # sequences' bounds and the stamp in its kernels, q / k / v / a / b read in place. bf16 inputs: bf16 work and
        # the registers prepare (H200, a 2,048-token layer's call: 322.5 us with fp32 work and the scratch prepare,
        # 221.8 with bf16 work, 146.5 with the registers prepare; fla-core 0.6.0's chunk_gated_delta_rule 626 us);
        # fp32 inputs (the parity mode) fp32 work and the scratch prepare (the registers prepare spills there)
        low = v.dtype == torch.bfloat16
        return gdn_chunk_prefill_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, stamp=stamp,
                                       work="bf16" if low else "fp32", prepare="registers" if low else "scratch"), None

    return gdn
