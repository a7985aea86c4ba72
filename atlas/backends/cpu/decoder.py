"""The decoder stack for one chunk of one sequence: embeddings -> layers -> final hidden states.

Two residual shapes: qwen3_next / qwen3_5 use input/post-attention norms around a plain residual;
qwen4_exp keeps `hc_count` hyper-connection streams, adds PLE into them on its PLE layers, and mixes
them down with a final mixer instead of a final norm.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.attention import attention_forward
from atlas.backends.cpu.gdn import gdn_forward
from atlas.backends.cpu.hyper import hyper_inject, hyper_mix
from atlas.backends.cpu.moe import dense_mlp, moe_block
from atlas.backends.cpu.norms import rms_norm
from atlas.backends.cpu.ple import ple_forward
from atlas.backends.cpu.rope import rope_table
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.model.spec import FULL_ATTENTION, ModelSpec


def forward_chunk(
    spec: ModelSpec,
    w: dict[str, torch.Tensor],
    kv: KvPool,
    state: SequenceState,
    tokens: torch.Tensor,
    start: int,
    block_table: tuple[int, ...],
) -> tuple[torch.Tensor, SequenceState]:
    """Feed `tokens` at positions [start, start + n): (final hidden states [n, H], the sequence's new state).

    KV is written into the pool (positions past a sequence's cursor are never read, so this is safe on
    failure); everything else is returned as a new state for the caller to commit.
    """
    n = tokens.shape[0]
    end = start + n
    dtype = w["embed_tokens.weight"].dtype
    cos, sin = rope_table(torch.arange(start, end), spec.rotary_dim, spec.rope_theta, dtype)
    new = SequenceState(kv_tokens=end, ssm_position=end, ple_position=end)
    history = None
    if spec.ple is not None:
        assert state.ple_context is not None
        history = torch.cat([state.ple_context, tokens])
        new.ple_context = history[-spec.ple.context_len :].clone()

    def mixer(layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"layers.{layer}."
        if spec.layer_types[layer] == FULL_ATTENTION:
            out, keys = attention_forward(
                spec, w, pre + "self_attn.", layer, x, cos, sin, kv, block_table, start, state.qsa_keys.get(layer)
            )
            if keys is not None:
                new.qsa_keys[layer] = keys
            return out
        out, new.gdn_conv[layer], new.gdn_recurrent[layer] = gdn_forward(
            spec, w, pre + "linear_attn.", x, state.gdn_conv[layer], state.gdn_recurrent[layer]
        )
        return out

    def ffn(layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"layers.{layer}.mlp."
        if spec.moe_layers[layer] and spec.moe is not None:
            return moe_block(spec.moe, w, pre, x)
        return dense_mlp(w, pre, x)

    x = w["embed_tokens.weight"][tokens]
    eps = spec.rms_norm_eps
    if not spec.has_hyper_connections:
        for layer in range(spec.num_layers):
            pre = f"layers.{layer}."
            x = x + mixer(layer, rms_norm(x, w[pre + "input_layernorm.weight"], eps))
            x = x + ffn(layer, rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps))
        return rms_norm(x, w["norm.weight"], eps), new

    hc = spec.hc_count
    streams = x.repeat(1, hc)
    for layer in range(spec.num_layers):
        pre = f"layers.{layer}."
        if spec.ple is not None and layer in spec.ple.layers:
            assert history is not None
            added, new.ple_conv[layer] = ple_forward(
                spec, w, pre + "ple.", spec.ple.layers.index(layer), streams, history, state.ple_conv[layer]
            )
            streams = streams + added
        block_in, inject = hyper_mix(w, pre + "attn_hyper_connection.", streams, hc, eps, combine=True)
        assert inject is not None
        streams = hyper_inject(streams, mixer(layer, block_in), inject)
        block_in, inject = hyper_mix(w, pre + "mlp_hyper_connection.", streams, hc, eps, combine=True)
        assert inject is not None
        streams = hyper_inject(streams, ffn(layer, block_in), inject)
    final, _ = hyper_mix(w, "hyper_connection_mixer.", streams, hc, eps, combine=False)
    return final, new
