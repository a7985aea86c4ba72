"""PLE: hashed n-gram embeddings gated into every hyper-connection stream, plus a dilated short conv.

State per sequence: the last ngram_size - 1 token ids (shared by all PLE layers: they hash the same
history) and, per PLE layer, the last (K - 1) * ngram_size normed gated values for the conv.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from atlas.backends.cpu.gdn import causal_conv
from atlas.backends.cpu.rows import CHUNK, EXACT, RowMath
from atlas.backends.cpu.weights import PLE_IN, joined
from atlas.backends.ops import rms_norm
from atlas.model.ngram import ngram_ids, ngram_tables
from atlas.model.spec import ModelSpec


def _ple(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, rank: int, streams: torch.Tensor,
         history: torch.Tensor, conv: torch.Tensor, rows: RowMath) -> tuple[torch.Tensor, torch.Tensor]:
    """(addition to the streams [n, hc*H], every short-conv column [hc*H, S + n])."""
    assert spec.ple is not None
    ple, hc, hidden = spec.ple, spec.hc_count, spec.hidden_size
    n = streams.shape[0]
    ids = ngram_ids(history, n, ple, ngram_tables(ple, spec.vocab_size, rank))
    emb = w[pre + "ngram_embedding.weight"][ids].flatten(-2)  # [n, embed_dim]

    eps = spec.rms_norm_eps
    proj, sizes = joined(w, pre, PLE_IN)
    key, value = rows.mm(emb, proj).split(sizes, dim=-1)  # value [n, H] is shared by every stream
    key = rms_norm(key, w[pre + "norm_key.weight"], eps, group=hidden)
    query = rms_norm(streams, w[pre + "norm_query.weight"], eps, group=hidden)
    gate = (key.view(n, hc, hidden) * query.view(n, hc, hidden)).sum(-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
    gated = (rows.each(torch.sigmoid, gate) * value.unsqueeze(-2)).flatten(-2)  # [n, hc*H]
    gated_normed = rms_norm(gated, w[pre + "norm_conv.weight"], eps, group=hidden)

    conv_out, _, cols = causal_conv(conv, gated_normed.T, w[pre + "conv1d.weight"], dilation=ple.ngram_size)
    return gated + F.silu(conv_out).T, cols


def ple_forward(
    spec: ModelSpec,
    w: dict[str, torch.Tensor],
    pre: str,
    rank: int,
    streams: torch.Tensor,
    history: torch.Tensor,
    conv: torch.Tensor,
    position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """streams [n, hc*H], history [ctx + n] ids -> (addition to the streams [n, hc*H], new conv state, the
    position it encodes: `position` + n)."""
    added, cols = _ple(spec, w, pre, rank, streams, history, conv, CHUNK)
    return added, cols[:, -conv.shape[-1] :], position + streams.shape[0]


def ple_rows(spec: ModelSpec, w: dict[str, torch.Tensor], pre: str, rank: int, streams: torch.Tensor,
             history: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """ple_forward with each row's bits those of a token-by-token feed, and the conv state after each position."""
    added, cols = _ple(spec, w, pre, rank, streams, history, conv, EXACT)
    width = conv.shape[-1]
    return added, [cols[:, t + 1 : t + 1 + width] for t in range(streams.shape[0])]


def advance_context(context: torch.Tensor, position: int, tokens: torch.Tensor, context_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The n-gram history the chunk hashes (context + tokens), the new context and the position it encodes."""
    history = torch.cat([context, tokens])
    return history, history[-context_len:].clone(), position + tokens.shape[0]
