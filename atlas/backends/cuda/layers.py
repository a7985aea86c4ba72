"""The layer stack over a `Group` of B sequences x T tokens, batched on the device (forward_group).

The same formulas as the CPU reference (the shared ops of atlas.backends.ops and the decoder skeleton of
atlas.backends.decoder), arranged for fewer kernels (atlas.backends.cuda.weights.prepare_weights), with
per-sequence state read from and written back to slot-indexed pools. Each model part's ops are a module of their
own: gdn, attention (with QSA), moe, hyper (hyper-connection sites), ple; primitives holds what they share. No
host synchronisation on the decode path (`eager_moe=False`), so a decode group can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from atlas.backends.cuda.attention import attention_kind, attention_layer
from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.gdn import GdnKernel, gdn_layer
from atlas.backends.cuda.hyper import hyper_mix
from atlas.backends.cuda.moe import moe_layer, moe_mode_of
from atlas.backends.cuda.ple import ple_layer
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.primitives import library_conv, rms_norm
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.decoder import decoder_stack
from atlas.backends.ops import dense_mlp, rope_table
from atlas.model.spec import FULL_ATTENTION, ModelSpec


class GroupOps:
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
    ops = GroupOps(spec, w, pools, grp, eager_moe=eager_moe, gdn_kernel=gdn_kernel, tuning=tuning,
                    invariant=invariant)
    return decoder_stack(spec, w["embed_tokens.weight"][grp.tokens], ops)
