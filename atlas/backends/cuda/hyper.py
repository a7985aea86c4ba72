"""A hyper-connection site on the CUDA backend: the streams' norm, the mix-down (with the inject weights in one
product) and the mix-up, atlas.backends.cpu.hyper's math."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cuda.primitives import linear, rms_norm, split_out
from atlas.model.spec import ModelSpec


def hyper_mix(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, streams: torch.Tensor, *, combine: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """atlas.backends.cpu.hyper.hyper_mix with the mix-down and inject weights in one GEMM (prepare_weights)."""
    down_w = w[pre + "fused_down.weight"] if combine else w[pre + "input_mix_weight_down.weight"]
    return hyper_block(streams, w[pre + "hc_norm.weight"], down_w, w[pre + "input_mix_weight_up.weight"],
                       spec.hc_count, spec.hidden_size, spec.hc_lowrank, spec.rms_norm_eps, combine)


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
