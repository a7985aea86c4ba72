"""The decoder stack for one chunk of one sequence on the CPU reference: the shared skeleton
(atlas.backends.decoder) over per-token layer ops that read the sequence's state and build a new one.

`forward_chunk` returns the state after the chunk; `forward_rows` (a verify's rows) computes every row's bits
as a token-by-token feed would (atlas.backends.cpu.rows) in one pass through the stack, and returns the state
after every position: the GDN recurrence and the convolutions run position by position in any case, and KV
rows, QSA keys and the PLE context are positional, so each row's state is a slice of what the pass computed.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.attention import attention_forward, attention_rows
from atlas.backends.cpu.gdn import gdn_forward, gdn_rows
from atlas.backends.cpu.hyper import hyper_mix
from atlas.backends.cpu.moe import dense_mlp, moe_block
from atlas.backends.cpu.ple import advance_context, ple_forward, ple_rows
from atlas.backends.cpu.rows import CHUNK, EXACT, RowMath
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.backends.decoder import decoder_stack
from atlas.backends.ops import rms_norm, rope_table
from atlas.model.spec import FULL_ATTENTION, ModelSpec


class _ChunkOps:
    """The layer ops for one chunk at positions [start, start + n): reads `state`, fills `new`; with
    `rows` (row-exact), also the conv and recurrent state after each position (`per_row`)."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], kv: KvPool, state: SequenceState,
                 new: SequenceState, tokens: torch.Tensor, start: int, block_table: tuple[int, ...],
                 history: torch.Tensor | None, rows: RowMath = CHUNK) -> None:
        self.spec, self.w, self.kv, self.state, self.new = spec, w, kv, state, new
        self.start, self.block_table, self.history, self.rows = start, block_table, history, rows
        self.per_row: dict[tuple[str, int], list[torch.Tensor]] = {}
        dtype = w["embed_tokens.weight"].dtype
        self.cos, self.sin = rope_table(torch.arange(start, start + tokens.shape[0]), spec.rotary_dim,
                                        spec.rope_theta, dtype)

    def mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        spec, w, pre = self.spec, self.w, f"layers.{layer}."
        state = self.state
        if spec.layer_types[layer] == FULL_ATTENTION:
            attend = attention_rows if self.rows.exact else attention_forward
            out, keys = attend(spec, w, pre + "self_attn.", layer, x, self.cos, self.sin, self.kv, self.block_table,
                               self.start, state.qsa_keys.get(layer))
            if keys is not None:
                self.new.qsa_keys[layer] = keys
            return out
        if self.rows.exact:
            out, self.per_row[("conv", layer)], self.per_row[("gdn", layer)] = gdn_rows(
                spec, w, pre + "linear_attn.", x, state.gdn_conv[layer], state.gdn_recurrent[layer])
            return out
        out, self.new.gdn_conv[layer], self.new.gdn_recurrent[layer], at = gdn_forward(
            spec, w, pre + "linear_attn.", x, state.gdn_conv[layer], state.gdn_recurrent[layer],
            state.stamps[("gdn", layer)])
        self.new.stamps[("conv", layer)] = self.new.stamps[("gdn", layer)] = at
        return out

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"layers.{layer}.mlp."
        if self.spec.moe_layers[layer] and self.spec.moe is not None:
            return moe_block(self.spec.moe, self.w, pre, x, self.rows)
        return dense_mlp(self.w, pre, x, self.rows)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.spec.rms_norm_eps)

    def ple(self, layer: int, rank: int, streams: torch.Tensor) -> torch.Tensor:
        assert self.history is not None
        pre, conv = f"layers.{layer}.ple.", self.state.ple_conv[layer]
        if self.rows.exact:
            added, self.per_row[("ple_conv", layer)] = ple_rows(self.spec, self.w, pre, rank, streams, self.history,
                                                                conv)
            return added
        added, self.new.ple_conv[layer], self.new.stamps[("ple_conv", layer)] = ple_forward(
            self.spec, self.w, pre, rank, streams, self.history, conv, self.state.stamps[("ple_conv", layer)])
        return added

    def hyper_mix(self, pre: str, streams: torch.Tensor, *, combine: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_mix(self.w, pre, streams, self.spec.hc_count, self.spec.rms_norm_eps, combine=combine,
                         rows=self.rows)


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


def forward_rows(
    spec: ModelSpec,
    w: dict[str, torch.Tensor],
    kv: KvPool,
    state: SequenceState,
    tokens: torch.Tensor,
    start: int,
    block_table: tuple[int, ...],
) -> tuple[torch.Tensor, tuple[SequenceState, ...]]:
    """Feed `tokens` at [start, start + n) in one pass, each row's bits those of feeding the tokens one at a time:
    (final hidden states [n, H], the state after each position). `state` is not modified; KV rows are written."""
    n = tokens.shape[0]
    history = None
    if spec.ple is not None:
        assert state.ple_context is not None
        history = torch.cat([state.ple_context, tokens])
    ops = _ChunkOps(spec, w, kv, state, SequenceState(), tokens, start, block_table, history, EXACT)
    hidden = decoder_stack(spec, w["embed_tokens.weight"][tokens], ops)
    states = []
    for t in range(n):
        end = start + t + 1
        after = SequenceState(kv_tokens=end, ssm_position=end, ple_position=end)
        after.qsa_keys = {layer: keys[:end] for layer, keys in ops.new.qsa_keys.items()}
        after.stamps = {key: at + t + 1 for key, at in state.stamps.items()}
        for (kind, layer), per_position in ops.per_row.items():
            target = {"conv": after.gdn_conv, "gdn": after.gdn_recurrent, "ple_conv": after.ple_conv}[kind]
            target[layer] = per_position[t]
        if history is not None:
            assert spec.ple is not None
            after.ple_context = history[t + 1 : t + 1 + spec.ple.context_len].clone()
        states.append(after)
    return hidden, tuple(states)
