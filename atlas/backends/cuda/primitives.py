"""The pieces the CUDA layers share: the norms, the product (`linear`, with its reduction form for compiled
decode regions), a fused product's output split, and the depthwise causal conv with its state in the pools."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.ops import acc_dtype


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


# linear(gemv="split"): the reduction over K cut into chunks of this many inputs where K is a multiple of it, >= 2 of them
SPLIT_K = 1024


def linear(x: torch.Tensor, w: torch.Tensor, gemv: str = "") -> torch.Tensor:
    """x [..., K] @ w.T [N, K]; gemv "" the GEMM. "split" (a compiled decode region of at most regions.GEMV_ROWS
    rows): the product written as a broadcast multiply and an fp32 sum over K, which Inductor lowers to a reduction kernel of
    its own, fused with what surrounds it, in place of a cuBLAS GEMV (H200: the hyper sites' 5 MB
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


def split_out(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """y's last dimension split into `sizes`, any padding columns past their sum dropped (prepare_weights pads
    fused weights to ALIGN_ROWS rows; a caller's own unpadded fusion has none)."""
    rest = y.shape[-1] - sum(sizes)
    parts = list(y.split([*sizes, rest], dim=-1)) if rest else list(y.split(sizes, dim=-1))
    return parts[: len(sizes)]


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


def library_conv(tuning: Tuning, grp: Group, invariant: bool) -> bool:
    """Whether a group's eager causal convs take the library conv (Tuning.library_conv): prefill chunks only, never
    in a batch-invariant mode (see conv_step). A compiled prefill region's GDN and PLE convs take the windowed
    product or the Triton conv instead (regions.regions_stack)."""
    return tuning.library_conv and grp.shape.width > 1 and not invariant
