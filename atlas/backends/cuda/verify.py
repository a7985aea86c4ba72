"""The K-wide verify of every decoding sequence, batched, and its exact commit, on the CUDA backend.

The verifies of a step are grouped by width K (one [B, K] group per width). Their KV and QSA rows are written
pending (stamped -(position + 2): not counted) and the per-slot state after each row is kept in the pools'
`inter` (index 0: before the verify), so nothing the sequence holds moves until the commit:
- "wide" (bf16): one forward of [B, K] tokens, through the regions (a hyper-connection model's, compiled as its
  decode groups are: atlas.backends.cuda.regions) or the layer stack; the causal conv keeps its window after each
  column, the GDN recurrence (torch loop, or the Triton kernel with store_states and commit=False) its state after
  each token, the PLE conv and n-gram context likewise; QSA selection runs per row (each row's own visible blocks).
- "rows" (fp32 parity): K one-token groups, the shapes of a decode, each copied into inter[t + 1] after it runs,
  then the live state put back from inter[0]: a verify that accepts n is bitwise n + 1 decodes.
The verdicts come from the shared batched functions (atlas.sampling.verdicts.verify) on the device; accept,
tokens (and logprobs when asked) come back in one device->host copy for the whole group. The commit selects each
slot's kept row on the device (pools.inter_load) and turns the kept rows' KV / QSA stamps positive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from atlas.backends.cuda.batch import GroupShape, Row, pack_rows, to_device
from atlas.backends.cuda.graphs import bucket
from atlas.errors import VerifyRefused
from atlas.plan import RowVerdict, SeqWork
from atlas.sampling.acceptance import accepted_prefix
from atlas.sampling.keyed import RowBatch, logprobs
from atlas.sampling.verdicts import verify


@attrs.frozen
class VerifyRun:
    verdicts: tuple[RowVerdict, ...]
    accepted: int = -1
    refused: str | None = None


def run_verifies(backend: Any, verifies: Sequence[SeqWork], *, commit: bool = True) -> dict[int, VerifyRun]:
    """Feed, judge and (with `commit`) commit every verify of the step; `backend` is a CudaBackend."""
    by_width: dict[int, list[SeqWork]] = {}
    for w in verifies:
        by_width.setdefault(len(w.tokens) + len(w.drafts), []).append(w)
    out: dict[int, VerifyRun] = {}
    for width, members in sorted(by_width.items()):
        logits, hidden, replayed = _feed(backend, members, width)
        for b, w in enumerate(members):  # the target's hidden per row: the drafter's pair keys on commit
            backend.store.record_verify(w.seq_id, hidden[b])
        runs = _judge(backend, members, logits)
        if commit:
            select = None  # a replayed verify's commit replays its commit graph
            if replayed is not None and backend.commit_graphs is not None:
                select = functools.partial(backend.commit_graphs.load, replayed)
            _commit(backend, members, runs, select)
        out.update(runs)
    return out


def wide_shape(backend: Any, batch: int, width: int, end: int) -> GroupShape:
    """The shape of a wide verify group of `batch` sequences of `width` rows, its furthest row at end - 1: pending
    and keep; with verify graphs padded to their buckets (the batch and the key blocks each to a power of two, the
    key blocks at least 4: one graph per batch bucket, width, key-block bucket and QSA), or batch invariant to the
    one shape of every step (the largest batch bucket, every key block)."""
    shape = attrs.evolve(backend._shape(batch, width, end), pending=True, keep=True)
    if backend.batch_invariant:
        return attrs.evolve(shape, batch=bucket(backend.max_batch_size), key_blocks=backend.max_blocks_per_seq)
    if backend.verify_graphs is not None:
        return attrs.evolve(shape, batch=bucket(batch), key_blocks=bucket(shape.key_blocks, 4))
    return shape


def _verify_rows(backend: Any, members: list[SeqWork]) -> list[Row]:
    """Each verify's packed row (its tokens then its drafts), the sequence's verify marked pending."""
    rows = []
    for w in members:
        s = backend.store.seqs[w.seq_id]
        tokens = tuple(w.tokens) + tuple(w.drafts)
        s.table, s.pending = tuple(w.block_table), (w.start, tokens)
        # a wide verify's n-gram ids come from the device (the slots' context and the rows' tokens, like any group);
        # the row-by-row verify packs the host's, each row's own
        ngram = [] if backend.verify_mode == "wide" else backend._ngram_rows(s, tokens)
        rows.append((list(tokens), w.start, s.slot, list(w.block_table), ngram))
    return rows


def wide_group(backend: Any, members: list[SeqWork], width: int) -> tuple[GroupShape, torch.Tensor]:
    """A wide verify group's shape (wide_shape) and packed host buffer, each sequence's verify marked pending."""
    pools = backend.pools
    shape = wide_shape(backend, len(members), width, max(w.start + width for w in members))
    rows = _verify_rows(backend, members)
    return shape, pack_rows(shape, rows, pools.scratch_slots, pools.scratch_block, backend.block_size)


def feed_verify(backend: Any, members: list[SeqWork], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the rows, leaving every sequence's live state as it was: (logits [B, K, V], hidden [B, K, H])."""
    logits, hidden, _ = _feed(backend, members, width)
    return logits, hidden


def _feed(backend: Any, members: list[SeqWork], width: int
          ) -> tuple[torch.Tensor, torch.Tensor, GroupShape | None]:
    """feed_verify's (logits, hidden), and the shape of the verify graph replayed (None: no graph)."""
    pools, dev = backend.pools, backend.device
    n = len(members)
    head = backend.weights["lm_head.weight"]
    pools.kept.clear()
    if backend.verify_mode == "wide":
        shape, packed = wide_group(backend, members, width)
        if backend.verify_graphs is not None:  # replayed: a graph per (batch bucket, width, key blocks, QSA)
            host = packed.pin_memory() if dev.type == "cuda" else packed
            logits, _ = backend.verify_graphs.replay(shape, host, backend._padding)
            pools.kept = dict(backend._kept_out[shape])  # the graph's static per-token tensors, this replay's rows
            return logits[:n], backend._hidden_out[shape][:n].clone(), shape
        hidden = backend._run_group(packed.to(dev), shape)[:n]
        return hidden @ head.T, hidden, None
    rows = _verify_rows(backend, members)
    slots = torch.tensor([r[2] for r in rows], device=dev)
    pools.inter_save(slots, 0)
    logits, hiddens = [], []
    heads = backend.spec.ple.num_heads if backend.spec.ple is not None else 0
    for t in range(width):
        sub = [([tokens[t]], start + t, slot, table, [layer[t * heads : (t + 1) * heads] for layer in ngram])
               for tokens, start, slot, table, ngram in rows]
        # the host's ids (each row's own, from the context the verify's earlier rows continued)
        shape = attrs.evolve(backend._shape(n, 1, max(w.start + t + 1 for w in members)), pending=True,
                             ngram_on_device=False)
        if backend.batch_invariant:
            shape = attrs.evolve(shape, batch=bucket(backend.max_batch_size), key_blocks=backend.max_blocks_per_seq)
        elif backend.graphs is not None:
            shape = attrs.evolve(shape, batch=bucket(n), key_blocks=bucket(shape.key_blocks, 4))
        packed = pack_rows(shape, sub, pools.scratch_slots, pools.scratch_block, backend.block_size)
        if backend.graphs is not None:  # a decode's shape: replayed from its graph
            host = packed.pin_memory() if dev.type == "cuda" else packed
            row_logits, _ = backend.graphs.replay(shape, host, backend._padding)
        else:
            row_logits = backend._decode_logits(packed.to(dev), shape)
        logits.append(row_logits[:n].clone())
        hiddens.append(backend._hidden_out[shape][:n].clone())
        pools.inter_save(slots, t + 1)
    pools.inter_load(slots, torch.zeros_like(slots))  # the live state as before the verify
    return torch.stack(logits, dim=1), torch.stack(hiddens, dim=1), None


def _judge(backend: Any, members: list[SeqWork], logits: torch.Tensor) -> dict[int, VerifyRun]:
    """Verdicts on the device for the group, one copy back, then the accepted prefix per sequence (validated)."""
    dev = backend.device
    n, k, vocab = logits.shape
    drafts = to_device([list(w.drafts) for w in members], dev).reshape(n, k - 1)
    num = torch.full((n,), k - 1, dtype=torch.int64, device=dev)
    rows = RowBatch.of([w.sampling for w in members], [w.start for w in members], pin=dev.type == "cuda").to(dev)
    q = has_q = None
    if backend.drafter is not None:
        q, has_q = backend.drafter.proposals(members, k - 1, vocab)
    v = verify(logits, drafts, num, rows, proposals=q, has_q=has_q)
    parts = [v.accept.flatten().to(torch.float64), v.tokens.flatten().to(torch.float64)]
    asked = any(w.sampling.logprobs for w in members)
    top = max(w.sampling.top_logprobs for w in members) if asked else 0
    if asked:
        lp, values, ids = logprobs(logits.reshape(n * k, vocab), v.tokens.flatten(), top)
        parts.append(torch.cat([lp[:, None], values, ids.to(torch.float64)], dim=1).flatten())
    host = torch.cat(parts).tolist()  # the one device->host copy of the group's verdicts
    accept, tokens = host[: n * k], host[n * k : 2 * n * k]
    scores = host[2 * n * k :]
    out: dict[int, VerifyRun] = {}
    for b, w in enumerate(members):
        verdicts = []
        for i in range(k):
            r = b * k + i
            if w.sampling.logprobs:
                row = scores[r * (1 + 2 * top) : (r + 1) * (1 + 2 * top)]
                m = w.sampling.top_logprobs
                alts = tuple((int(t), val) for t, val in zip(row[1 + top : 1 + top + m], row[1 : 1 + m], strict=True))
                verdicts.append(RowVerdict(bool(accept[r]), int(tokens[r]), row[0], alts))
            else:
                verdicts.append(RowVerdict(bool(accept[r]), int(tokens[r])))
        try:
            out[w.seq_id] = VerifyRun(tuple(verdicts), accepted_prefix(verdicts, w.drafts, backend.spec.vocab_size))
        except VerifyRefused as exc:
            out[w.seq_id] = VerifyRun(tuple(verdicts), refused=str(exc))
    return out


def _commit(backend: Any, members: list[SeqWork], runs: dict[int, VerifyRun],
            select: Callable[[list[int], list[int]], None] | None = None) -> None:
    store = backend.store
    commits: list[tuple[int, int]] = []
    for w in members:
        run = runs[w.seq_id]
        if run.refused is None:
            try:
                store.check_commit(w.seq_id, run.accepted + 1)
            except VerifyRefused as exc:
                runs[w.seq_id] = attrs.evolve(run, accepted=-1, refused=str(exc))
        if runs[w.seq_id].refused is not None:
            store.drop_pending(w.seq_id)
            continue
        commits.append((w.seq_id, run.accepted + 1))
    store.commit_many(commits, select)
