"""Gated DeltaNet: causal depthwise conv over q/k/v, then the gated delta rule on an fp32 state.

State per layer: the last K conv input columns, and S [Hv, dk, dv]. Per token t (per value head):
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - k_t^T S));  o_t = q_t^T S
with q, k l2-normalised and q scaled by dk^-0.5, g_t = -exp(A_log) softplus(a_t + dt_bias), beta = sigmoid(b).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.ops import acc_dtype, gated_rms_norm, l2_normalise
from atlas.model.spec import ModelSpec


def causal_conv(cols_state: torch.Tensor, new_cols: torch.Tensor, weight: torch.Tensor, dilation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of `new_cols` [C, n] continuing `cols_state` [C, S]; returns (out [C, n], new state)."""
    cols = torch.cat([cols_state, new_cols], dim=-1)
    reach = (weight.shape[-1] - 1) * dilation  # columns before a position that its output reads
    out = F.conv1d(cols[None, :, cols.shape[-1] - new_cols.shape[-1] - reach :], weight,
                   groups=cols.shape[0], dilation=dilation)[0]
    return out, cols[:, -cols_state.shape[-1] :]


def gdn_forward(
    spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
    position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x [n, H] -> (out [n, H], new conv state, new recurrent state, the position they encode: `position` + n).
    Inputs are not modified."""
    n = x.shape[0]
    nk, nv, dk, dv = spec.gdn_k_heads, spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim
    qkv = x @ w[pre + "in_proj_qkv.weight"].T
    z = (x @ w[pre + "in_proj_z.weight"].T).view(n, nv, dv)
    b = x @ w[pre + "in_proj_b.weight"].T
    a = x @ w[pre + "in_proj_a.weight"].T

    mixed, new_conv = causal_conv(conv, qkv.T, w[pre + "conv1d.weight"])
    mixed = F.silu(mixed).T
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    acc = acc_dtype(x.dtype)
    # each key head serves nv / nk consecutive value heads
    q = q.reshape(n, nk, dk).repeat_interleave(nv // nk, dim=1).to(acc)
    k = k.reshape(n, nk, dk).repeat_interleave(nv // nk, dim=1).to(acc)
    v = v.reshape(n, nv, dv).to(acc)
    q = l2_normalise(q) * dk**-0.5
    k = l2_normalise(k)
    beta = torch.sigmoid(b).to(acc)
    decay = (-w[pre + "A_log"].to(acc).exp() * F.softplus(a.to(acc) + w[pre + "dt_bias"].to(acc))).exp()

    s = state.to(acc)
    out = torch.empty(n, nv, dv, dtype=acc)
    for t in range(n):
        s = s * decay[t, :, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - predicted) * beta[t, :, None]
        s = s + k[t, :, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)

    o = gated_rms_norm(out.to(x.dtype), z, w[pre + "norm.weight"], spec.rms_norm_eps, spec.gdn_gate_act)
    return o.reshape(n, nv * dv) @ w[pre + "out_proj.weight"].T, new_conv, s, position + n
