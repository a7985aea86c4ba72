"""Hyper-connections: `hc_count` residual streams, mixed into one block input and re-injected after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cpu.rows import CHUNK, RowMath
from atlas.backends.cpu.weights import HYPER_DOWN, joined
from atlas.backends.ops import rms_norm


def hyper_mix(
    w: dict[str, torch.Tensor], pre: str, streams: torch.Tensor, hc: int, eps: float, *, combine: bool,
    rows: RowMath = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [n, hc*H] -> (block input [n, H], injection weights [n, hc] or None for the final mixer)."""
    hidden = streams.shape[-1] // hc
    normed = rms_norm(streams, w[pre + "hc_norm.weight"], eps, group=hidden)
    down, sizes = joined(w, pre, HYPER_DOWN)  # the mix-down and (combine) the inject weights: one product
    mix, *inject = (rows.mm(normed, down) / hc).split(sizes, dim=-1)
    mix = rows.each(F.silu, mix)
    mix = rows.each(torch.sigmoid, rows.mm(mix, w[pre + "input_mix_weight_up.weight"])).unflatten(-1, (hc, hidden))
    mixed = (mix * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    if not combine:
        return mixed, None
    return mixed, 2 * rows.each(torch.sigmoid, inject[0])
