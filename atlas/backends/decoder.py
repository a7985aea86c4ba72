"""One decoder skeleton for every backend: embeddings -> layers -> final hidden states, parameterised by the
backend's layer ops (`LayerOps`): per-token tensors on the CPU reference, batched groups on CUDA.

Two residual shapes: qwen3_next / qwen3_5 use input/post-attention norms around a plain residual; qwen4_exp
keeps `hc_count` hyper-connection streams, adds PLE into them on its PLE layers, and mixes them down with a
final mixer instead of a final norm.
"""

from __future__ import annotations

from typing import Protocol

import torch

from atlas.backends.ops import hyper_inject
from atlas.model.spec import ModelSpec


class LayerOps(Protocol):
    def mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Attention (QSA-selected where it applies) or Gated DeltaNet, with the layer's state."""
        ...

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor: ...

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The RMSNorm whose weight is `name` (zero-centred as the checkpoint stores it, or prepared)."""
        ...

    def ple(self, layer: int, rank: int, streams: torch.Tensor) -> torch.Tensor:
        """What PLE layer `layer` (the `rank`-th PLE layer) adds to the streams."""
        ...

    def hyper_mix(self, pre: str, streams: torch.Tensor, *, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(block input, injection weights, or None for the final mixer) of the hyper-connection `pre`."""
        ...


def decoder_stack(spec: ModelSpec, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
    """x: the embedded tokens [..., H] -> the final hidden states [..., H] (the lm_head input)."""
    if not spec.has_hyper_connections:
        for layer in range(spec.num_layers):
            pre = f"layers.{layer}."
            x = x + ops.mixer(layer, ops.norm(x, pre + "input_layernorm.weight"))
            x = x + ops.ffn(layer, ops.norm(x, pre + "post_attention_layernorm.weight"))
        return ops.norm(x, "norm.weight")
    ple_layers = spec.ple.layers if spec.ple is not None else ()
    streams = torch.cat([x] * spec.hc_count, dim=-1)
    for layer in range(spec.num_layers):
        pre = f"layers.{layer}."
        if layer in ple_layers:
            streams = streams + ops.ple(layer, ple_layers.index(layer), streams)
        block_in, inject = ops.hyper_mix(pre + "attn_hyper_connection.", streams, combine=True)
        assert inject is not None
        streams = hyper_inject(streams, ops.mixer(layer, block_in), inject)
        block_in, inject = ops.hyper_mix(pre + "mlp_hyper_connection.", streams, combine=True)
        assert inject is not None
        streams = hyper_inject(streams, ops.ffn(layer, block_in), inject)
    final, _ = ops.hyper_mix("hyper_connection_mixer.", streams, combine=False)
    return final
