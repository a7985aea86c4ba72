"""The sampler's per-row inputs beyond the packed rows (atlas.sampling.keyed.RowBatch): logit_bias, and what the
repetition, frequency and presence penalties read from the tokens before the sampled position.

Built on the device from padded token ids (one host->device copy each), never from tensor values on the host, so a
row's adjusted logits are the same function of (logits, params, history) on every backend: the CPU reference
backend and the CUDA backend call `Adjust.of` and then the one sampler (atlas.sampling.keyed.sample). Every step
is elementwise float64 (a bias add, a division or product, a product-sum of small integer counts), so the CPU and
a GPU compute the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.sampling.params import SamplingParams


@attrs.frozen
class Adjust:
    """[B, V] tensors on the logits' device, each None when no row of the batch needs it."""

    bias: torch.Tensor | None = None  # float64: logit_bias, added to the raw logits
    seen: torch.Tensor | None = None  # bool: the prompt and output tokens so far (the repetition penalty's)
    offset: torch.Tensor | None = None  # float64: -(frequency_penalty * count + presence_penalty * [count > 0])

    @classmethod
    def of(cls, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], prompt_lens: Sequence[int],
           vocab: int, device: torch.device | str) -> Adjust | None:
        """The inputs of rows `params`, whose sampled positions follow `histories` (every token before it: the
        prompt's prompt_lens[i] tokens, then the output so far). None when no row needs any. Ids outside the
        vocabulary (the API refuses them) land in a scratch column and change nothing."""
        if not any(p.adjusted for p in params):
            return None
        bias = seen = offset = None
        if any(p.logit_bias for p in params):
            pairs = [p.logit_bias for p in params]
            ids = _padded([[t for t, _ in row] for row in pairs], vocab)
            values = _padded([[b for _, b in row] for row in pairs], 0.0, torch.float64)
            bias = _scatter(ids, values.to(device), vocab, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            ids = _padded([h if p.repetition_penalty != 1.0 else () for p, h in zip(params, histories, strict=True)],
                          vocab)
            seen = _scatter(ids, None, vocab, device) > 0
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            generated = [h[n:] if p.frequency_penalty or p.presence_penalty else ()
                         for p, h, n in zip(params, histories, prompt_lens, strict=True)]
            counts = _scatter(_padded(generated, vocab), None, vocab, device)
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64).to(device)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64).to(device)
            offset = -(freq[:, None] * counts + pres[:, None] * (counts > 0).to(torch.float64))
        return cls(bias, seen, offset)


def _padded(rows: Sequence[Sequence], pad: float, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return torch.tensor([[*row, *(pad,) * (width - len(row))] for row in rows], dtype=dtype)


def _scatter(ids: torch.Tensor, values: torch.Tensor | None, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] float64: values (1 each when None) summed at ids [B, L]; ids outside [0, vocab) go to a dropped column."""
    ids = ids.to(device)
    ids = torch.where((ids < 0) | (ids >= vocab), vocab, ids)
    src = torch.ones(ids.shape, dtype=torch.float64, device=ids.device) if values is None else values
    out = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float64, device=ids.device)
    return out.scatter_add_(1, ids, src)[:, :vocab]
