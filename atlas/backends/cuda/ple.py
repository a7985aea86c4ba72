"""PLE on the CUDA backend: the n-gram embeddings' gated mix with its dilated short conv (ple_mix, ple_layer), and
the n-gram ids computed on the device from each slot's context (device_ngram_ids, ple_context_update)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atlas.backends.cuda.batch import Group
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.primitives import put_conv, rms_norm, silu_conv
from atlas.model.spec import ModelSpec, PleSpec


def ple_layer(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, streams: torch.Tensor, ids: torch.Tensor,
              grp: Group, pools: DevicePools, layer: int, library_conv: bool = False) -> torch.Tensor:
    """streams [B, T, hc*H], n-gram ids [B, T, heads] -> the addition to the streams (PLE, see
    atlas.backends.cpu.ple); the dilated short conv's state lives in conv_pool at the group's slots."""
    name = f"pconv{layer}"
    add, cols = ple_mix(spec, streams, ids, *ple_weights(w, pre), pools.state[name][grp.slots], library_conv)
    put_conv(pools, grp, name, cols)
    return add


def ple_weights(w: dict[str, torch.Tensor], pre: str) -> tuple[torch.Tensor, ...]:
    """A PLE layer's weights in ple_mix's order."""
    return tuple(w[pre + name] for name in ("ngram_embedding.weight", "key_proj.weight", "norm_key.weight",
                                             "norm_query.weight", "value_proj.weight", "norm_conv.weight",
                                             "conv1d.weight"))


def ple_mix(spec: ModelSpec, streams: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, key_w: torch.Tensor,
            key_norm: torch.Tensor, query_norm: torch.Tensor, value_w: torch.Tensor, conv_norm: torch.Tensor,
            conv_w: torch.Tensor, prev: torch.Tensor, library_conv: bool = False, fused_conv: str = ""
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the PLE addition to the streams [B, T, hc*H], the conv's columns [B, C, S + T] whose last S are its new
    state) from the n-gram ids [B, T, heads] and the conv state before the group `prev` [B, C, S]; pure."""
    assert spec.ple is not None
    hc, hidden = spec.hc_count, spec.hidden_size
    b, t, _ = streams.shape
    eps = spec.rms_norm_eps
    emb = table[ids].flatten(-2)  # [B, T, embed_dim]
    key = rms_norm(emb @ key_w.T, key_norm, eps, group=hidden)
    query = rms_norm(streams, query_norm, eps, group=hidden)
    value = emb @ value_w.T
    gate = (key.view(b, t, hc, hidden) * query.view(b, t, hc, hidden)).sum(-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [B, T, hc*H]
    normed = rms_norm(gated, conv_norm, eps, group=hidden)
    conv, cols = silu_conv(prev, normed, conv_w, spec.ple.ngram_size, library_conv, fused_conv)
    return gated + conv, cols


def device_ngram_ids(pools: DevicePools, grp: Group, ple: PleSpec, tables: Sequence[tuple[torch.Tensor, ...]]
                     ) -> torch.Tensor:
    """[P, B, T, heads] int64: the PLE n-gram ids of a group's tokens, from each slot's n-gram context on the
    device (pools "pctx", the last context_len ids) continued by the tokens: what atlas.model.ngram.ngram_ids
    gives for the last T positions of context + tokens (the token `order - 1` back, or EOS when an EOS lies
    between; int64 arithmetic as there). `tables`: per PLE layer (multipliers, head vocab sizes, head offsets)
    as device int64 tensors. On the device because the host's per-row ids cost ~0.4 ms of host time a batch-64
    decode step (2,048 `ngram_one` calls, H200) and ~2-4 ms a 2,048-token prefill chunk (the ids, their `tolist`
    and packing)."""
    return ngram_ids_from(pools.state["pctx"][grp.slots], grp.tokens, ple, tables)


def ngram_ids_from(ctx: torch.Tensor, tokens: torch.Tensor, ple: PleSpec, tables: Sequence[tuple[torch.Tensor, ...]]
                   ) -> torch.Tensor:
    """device_ngram_ids' arithmetic (pure): the slots' n-gram context ctx [B, L] continued by tokens [B, T]. A
    table with a fourth tensor (the n-gram row cache's remap, atlas.backends.cuda.ngram) gives the rows' slots."""
    length, width = ctx.shape[1], tokens.shape[1]
    if length < ple.ngram_size - 1:
        raise ValueError(f"the PLE context holds {length} ids; n-grams of {ple.ngram_size} need {ple.ngram_size - 1}")
    history = torch.cat([ctx, tokens], dim=1)  # [B, L + T]; the new tokens at L .. L + T - 1
    eos = ple.eos_token_id
    shifted = [history[:, length:]]
    eos_between = torch.zeros_like(tokens, dtype=torch.bool)
    for back in range(1, ple.ngram_size):  # the token `back` positions before, or EOS past an EOS
        before = history[:, length - back : length - back + width]
        eos_between = eos_between | (before == eos)  # an EOS among the `back` tokens before
        shifted.append(torch.where(eos_between, eos, before))
    out = []
    for mult, sizes, offsets, *remap in tables:
        mixed = shifted[0] * mult[0]
        blocks = []
        for order in range(2, ple.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[order - 1] * mult[order - 1])
            lo = (order - 2) * ple.heads_per_ngram
            blocks.append(torch.remainder(mixed[..., None], sizes[lo : lo + ple.heads_per_ngram])
                          + offsets[lo : lo + ple.heads_per_ngram])
        ids = torch.cat(blocks, dim=-1)
        out.append(remap[0][ids].long() if remap else ids)
    return torch.stack(out)


def ple_context_update(pools: DevicePools, grp: Group) -> None:
    """The device's PLE n-gram context (the last context_len ids) continued by the group's tokens, with its
    stamp; a wide verify keeps the context after each row."""
    ctx = pools.state["pctx"]
    length = ctx.shape[1]
    history = torch.cat([ctx[grp.slots], grp.tokens], dim=1)  # [B, L + T]
    per_token = history.unfold(1, length, 1)[:, 1:].transpose(0, 1) if grp.shape.keep else None
    pools.put("pctx", grp.slots, grp.positions, history[:, -length:], per_token, grp.shape.keep, grp.ends)
