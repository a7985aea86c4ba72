"""What a CUDA step picks from its logits: the sampled tokens (with their logprobs) and the prompt logprobs,
on the device with one device->host copy each (CudaBackend._sample / _prompt_logprobs delegate here; `backend`
is that CudaBackend, typed Any so that this module does not import the runner back)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from atlas.plan import PromptLogprob, SeqWork
from atlas.sampling.adjust import Adjust
from atlas.sampling.keyed import RowBatch, logprobs, sample
from atlas.sampling.params import SamplingParams

GREEDY = SamplingParams()  # a graph's padding rows (one object: the packer compares rows by identity)


def prompt_logprobs(backend: Any, w: SeqWork, rows: torch.Tensor) -> tuple[PromptLogprob, ...]:
    """Each fed prompt token's logprob under the logits of the position before it (this chunk's rows, or the
    previous chunk's last row): one batched call and one copy (atlas.backends.cpu's reference semantics)."""
    tails = backend.store.prompt_tail
    before: list[torch.Tensor] = []
    for i in range(len(w.tokens)):
        position = w.start + i
        if position == 0:
            continue
        row = rows[i - 1] if i else tails.pop(w.seq_id, None)
        if row is None:
            raise ValueError(f"sequence {w.seq_id}: prompt logprobs at {position} need the logits of position "
                             f"{position - 1}, which no chunk of this request computed")
        before.append(row)
    if not w.sample:  # the prompt goes on: its next token is scored by this chunk's last row
        tails[w.seq_id] = rows[-1]
    top = w.prompt_logprobs or 0
    scored: list[list[float]] = []
    if before:
        tokens = torch.tensor([t for i, t in enumerate(w.tokens) if w.start + i], device=backend.device)
        lp, values, ids = logprobs(torch.stack(before), tokens, top)
        scored = torch.cat([lp[:, None], values, ids.to(torch.float64)], dim=1).tolist()  # one copy
    out: list[PromptLogprob] = []
    rows_left = iter(scored)
    for i in range(len(w.tokens)):
        if w.start + i == 0:
            out.append((0, None, ()))
            continue
        row = next(rows_left)
        out.append((w.start + i, row[0], tuple((int(t), v) for t, v in zip(row[1 + top :], row[1 : 1 + top],
                                                                          strict=True))))
    return tuple(out)


def sample_rows(backend: Any, work: Sequence[SeqWork], logits: dict[int, torch.Tensor]
                ) -> dict[int, tuple[int, float | None, tuple[tuple[int, float], ...]]]:
    """The keyed sampler (atlas.sampling.keyed) on the device for every sampled row: decode rows replayed
    from a graph through the sampler graph, the rest (prefill ends, banned tokens, a logit_bias or penalty, eager
    mode) in one batched call; one device->host copy of the tokens, and one of the logprobs when a row asks."""
    sampled = [i for i, w in enumerate(work) if w.sample]
    if not sampled:
        return {}
    pin = backend.device.type == "cuda"
    parts: list[torch.Tensor] = []
    in_graph: dict[int, int] = {}  # chunk index -> its row of the replayed decode graph
    if backend._replayed is not None and backend.graphs is not None:
        shape, idx = backend._replayed
        params, positions = [GREEDY] * shape.batch, [0] * shape.batch
        for j, i in enumerate(idx):  # one pass: the graph's rows and their sampler parameters
            w = work[i]
            if w.sample and not w.banned and not w.sampling.adjusted:
                in_graph[i] = j
                params[j], positions[j] = w.sampling, w.end
        if in_graph:
            # the decode group's rows repeat step after step: the packer keeps them and writes the positions
            parts.append(backend.graphs.sample(shape, backend.row_packer.of(params, positions)))
    rest = [i for i in sampled if i not in in_graph] if len(in_graph) < len(sampled) else []
    if rest:
        rows = torch.stack([logits[i] for i in rest])
        banned = None
        if any(work[i].banned for i in rest):  # a rollback's re-steer: these tokens may not be sampled here
            width = max(len(work[i].banned) for i in rest)
            ids = torch.tensor([list(work[i].banned) + [-1] * (width - len(work[i].banned)) for i in rest],
                               dtype=torch.int64)
            banned = (ids.pin_memory() if pin else ids).to(backend.device, non_blocking=pin)
        params = [work[i].sampling for i in rest]
        batch = RowBatch.of(params, [work[i].end for i in rest], pin=pin)
        # logit_bias and the penalties' history (SeqWork.history): the same inputs the CPU backend builds
        adjust = Adjust.of(params, [work[i].history for i in rest], [work[i].prompt_len for i in rest],
                           rows.shape[-1], backend.device)
        parts.append(sample(rows, batch.to(backend.device), banned=banned, adjust=adjust))
    tokens = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # one copy
    # the graph's rows first (every one comes back; padding is dropped), then the rest in order
    chosen = {i: tokens[j] for i, j in in_graph.items()}
    if rest:
        base = len(tokens) - len(rest)
        chosen.update((i, tokens[base + r]) for r, i in enumerate(rest))
    asked = [i for i in sampled if work[i].sampling.logprobs]
    lps: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}
    if asked:
        top = max(work[i].sampling.top_logprobs for i in asked)
        lp, values, ids = logprobs(torch.stack([logits[i] for i in asked]),
                                   torch.tensor([chosen[i] for i in asked], device=backend.device), top)
        host = torch.cat([lp[:, None], values, ids.to(torch.float64)], dim=1).tolist()  # one copy
        for r, i in enumerate(asked):
            n = work[i].sampling.top_logprobs
            lps[i] = host[r][0], tuple((int(t), v) for t, v in zip(host[r][1 + top : 1 + top + n],
                                                                   host[r][1 : 1 + n], strict=True))
    if not lps:
        return {i: (chosen[i], None, ()) for i in sampled}
    return {i: (chosen[i], *lps.get(i, (None, ()))) for i in sampled}


def sample_decode(backend: Any, shape: Any, params: Sequence[SamplingParams], ends: Sequence[int] | np.ndarray,
                  logits: torch.Tensor) -> list[int]:
    """sample_rows for a decode group (`shape`, its logits [B, vocab]) every row of which samples, none banned and
    none asking logprobs (the steady step, atlas.backends.cuda.steady): each row's token, in row order. `ends`: each
    row's sampled position. The same calls as sample_rows: the sampler graph on the graph's rows (padding rows
    greedy at position 0), or the keyed sampler on the rows' logits."""
    n = len(params)
    if backend._replayed is not None and backend.graphs is not None:
        pad = shape.batch - n
        if pad:  # the graph's padding rows: greedy at position 0
            params, ends = (*params, *(GREEDY,) * pad), np.concatenate([ends, np.zeros(pad, dtype=np.int64)])
        tokens = backend.graphs.sample(shape, backend.row_packer.of(params, ends)).tolist()
        return tokens[:n] if pad else tokens
    batch = RowBatch.of(params, list(map(int, ends)), pin=backend.device.type == "cuda")
    return sample(logits[:n], batch.to(backend.device)).tolist()
