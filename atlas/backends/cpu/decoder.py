"""The decoder stack for one chunk of one sequence on the CPU reference: the shared skeleton
(atlas.backends.decoder) over per-token layer ops that read the sequence's state and build a new one."""

from __future__ import annotations

import torch

from atlas.backends.cpu.attention import attention_forward
from atlas.backends.cpu.gdn import gdn_forward
from atlas.backends.cpu.hyper import hyper_mix
from atlas.backends.cpu.moe import moe_block
from atlas.backends.cpu.ple import advance_context, ple_forward
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.backends.decoder import decoder_stack
from atlas.backends.ops import dense_mlp, rms_norm, rope_table
from atlas.model.spec import FULL_ATTENTION, ModelSpec


class _ChunkOps:
    """The layer ops for one chunk at positions [start, start + n): reads `state`, fills `new`."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], kv: KvPool, state: SequenceState,
                 new: SequenceState, tokens: torch.Tensor, start: int, block_table: tuple[int, ...],
                 history: torch.Tensor | None) -> None:
        self.spec, self.w, self.kv, self.state, self.new = spec, w, kv, state, new
        self.start, self.block_table, self.history = start, block_table, history
        dtype = w["embed_tokens.weight"].dtype
        self.cos, self.sin = rope_table(torch.arange(start, start + tokens.shape[0]), spec.rotary_dim,
                                        spec.rope_theta, dtype)

    def mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        spec, w, pre = self.spec, self.w, f"layers.{layer}."
        if spec.layer_types[layer] == FULL_ATTENTION:
            out, keys = attention_forward(spec, w, pre + "self_attn.", layer, x, self.cos, self.sin, self.kv,
                                          self.block_table, self.start, self.state.qsa_keys.get(layer))
            if keys is not None:
                self.new.qsa_keys[layer] = keys
            return out
        out, self.new.gdn_conv[layer], self.new.gdn_recurrent[layer], at = gdn_forward(
            spec, w, pre + "linear_attn.", x, self.state.gdn_conv[layer], self.state.gdn_recurrent[layer],
            self.state.stamps[("gdn", layer)])
        self.new.stamps[("conv", layer)] = self.new.stamps[("gdn", layer)] = at
        return out

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"layers.{layer}.mlp."
        if self.spec.moe_layers[layer] and self.spec.moe is not None:
            return moe_block(self.spec.moe, self.w, pre, x)
        return dense_mlp(self.w, pre, x)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.spec.rms_norm_eps)

    def ple(self, layer: int, rank: int, streams: torch.Tensor) -> torch.Tensor:
        assert self.history is not None
        added, self.new.ple_conv[layer], self.new.stamps[("ple_conv", layer)] = ple_forward(
            self.spec, self.w, f"layers.{layer}.ple.", rank, streams, self.history, self.state.ple_conv[layer],
            self.state.stamps[("ple_conv", layer)])
        return added

    def hyper_mix(self, pre: str, streams: torch.Tensor, *, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_mix(self.w, pre, streams, self.spec.hc_count, self.spec.rms_norm_eps, combine=combine)


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
    end = start + tokens.shape[0]
    new = SequenceState(kv_tokens=end, ssm_position=end, ple_position=end)
    history = None
    if spec.ple is not None:
        assert state.ple_context is not None
        history, new.ple_context, new.stamps[("ple", -1)] = advance_context(
            state.ple_context, state.stamps[("ple", -1)], tokens, spec.ple.context_len)
    ops = _ChunkOps(spec, w, kv, state, new, tokens, start, block_table, history)
    return decoder_stack(spec, w["embed_tokens.weight"][tokens], ops), new
