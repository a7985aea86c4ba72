"""Gated DeltaNet: causal depthwise conv over q/k/v, then the gated delta rule on an fp32 state.

State per layer: the last K conv input columns, and S [Hv, dk, dv]. Per token t (per value head):
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - k_t^T S));  o_t = q_t^T S
with q, k l2-normalised and q scaled by dk^-0.5, g_t = -exp(A_log) softplus(a_t + dt_bias), beta = sigmoid(b).
The recurrence runs token by token in every form, so the state after each position of a chunk is at hand:
`gdn_rows` keeps them all (a verify commits the one of its kept row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cpu.rows import CHUNK, EXACT, RowMath
from atlas.backends.cpu.weights import GDN_IN, joined
from atlas.backends.ops import acc_dtype, gated_rms_norm, l2_normalise
from atlas.model.spec import ModelSpec


def causal_conv(cols_state: torch.Tensor, new_cols: torch.Tensor, weight: torch.Tensor, dilation: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of `new_cols` [C, n] continuing `cols_state` [C, S]: (out [C, n], new state, and every
    column [C, S + n]: the state after new column i is columns [i + 1, i + 1 + S)).

    Tap by tap, a fused multiply-add each (addcmul): the bits of F.conv1d's depthwise kernel (an FMA chain from
    the first tap, checked on every width, dilation and column count the models use), elementwise, so a column's
    bits never depend on how many columns are computed with it, and one call per tap instead of conv1d's fixed
    cost (~90 us a call on atlas-mini, six calls a decode step)."""
    cols = torch.cat([cols_state, new_cols], dim=-1)
    n, s = new_cols.shape[-1], cols_state.shape[-1]
    taps = weight.shape[-1]
    first = s - (taps - 1) * dilation  # the column of the first output's first tap
    acc = acc_dtype(cols.dtype)
    w, x = weight[:, 0, :].to(acc), cols.to(acc)
    out = x[:, first : first + n] * w[:, :1]
    for tap in range(1, taps):
        at = first + tap * dilation
        out = torch.addcmul(out, x[:, at : at + n], w[:, tap : tap + 1])
    return out.to(cols.dtype), cols[:, -s:], cols


def _gdn(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, conv: torch.Tensor,
         state: torch.Tensor, rows: RowMath, keep: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(out [n, H], every conv column [C, S + n], the recurrent state after each position (all if `keep`, else
    the last))."""
    n = x.shape[0]
    nk, nv, dk, dv = spec.gdn_k_heads, spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim
    proj, sizes = joined(w, pre, GDN_IN)
    qkv, z, b, a = rows.mm(x, proj).split(sizes, dim=-1)
    z = z.reshape(n, nv, dv)

    mixed, _, cols = causal_conv(conv, qkv.T, w[pre + "conv1d.weight"])
    mixed = F.silu(mixed).T
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    acc = acc_dtype(x.dtype)
    # each key head serves nv / nk consecutive value heads
    q = q.reshape(n, nk, dk).repeat_interleave(nv // nk, dim=1).to(acc)
    k = k.reshape(n, nk, dk).repeat_interleave(nv // nk, dim=1).to(acc)
    v = v.reshape(n, nv, dv).to(acc)
    q = l2_normalise(q) * dk**-0.5
    k = l2_normalise(k)
    beta = rows.each(torch.sigmoid, b).to(acc)
    neg_a, dt_bias = -w[pre + "A_log"].to(acc).exp(), w[pre + "dt_bias"].to(acc)
    decay = (neg_a * rows.each(F.softplus, a.to(acc) + dt_bias)).exp()

    s = state.to(acc)
    states, outs = [], []
    # each position's operands as views, cut once: the loop is seven ops a position (k^T S and q^T S as the
    # batched one-row products einsum would make of them, bitwise)
    decays, betas = decay[:, :, None, None].unbind(0), beta[:, :, None, None].unbind(0)
    k_rows, k_cols = k[:, :, None, :].unbind(0), k[:, :, :, None].unbind(0)
    q_rows, v_rows = q[:, :, None, :].unbind(0), v[:, :, None, :].unbind(0)
    for t in range(n):
        s = s * decays[t]  # a new tensor each position (the kept states), updated in place from here
        delta = (v_rows[t] - torch.bmm(k_rows[t], s)) * betas[t]  # [h, 1, dv]
        s.add_(k_cols[t] * delta)
        outs.append(torch.bmm(q_rows[t], s))
        if keep:
            states.append(s)
    out = (torch.cat(outs, dim=1) if n > 1 else outs[0]).transpose(0, 1).contiguous()  # [n, h, dv]

    o = gated_rms_norm(out.to(x.dtype), z, w[pre + "norm.weight"], spec.rms_norm_eps, spec.gdn_gate_act)
    return rows.mm(o.reshape(n, nv * dv), w[pre + "out_proj.weight"]), cols, states if keep else [s]


def gdn_forward(
    spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
    position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x [n, H] -> (out [n, H], new conv state, new recurrent state, the position they encode: `position` + n).
    Inputs are not modified."""
    out, cols, (s,) = _gdn(spec, w, pre, x, conv, state, CHUNK, keep=False)
    return out, cols[:, -conv.shape[-1] :], s, position + x.shape[0]


def gdn_rows(
    spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """x [n, H], each row's bits those of a token-by-token feed -> (out [n, H], the conv state after each position,
    the recurrent state after each position)."""
    out, cols, states = _gdn(spec, w, pre, x, conv, state, EXACT, keep=True)
    width = conv.shape[-1]
    return out, [cols[:, t + 1 : t + 1 + width] for t in range(x.shape[0])], states
