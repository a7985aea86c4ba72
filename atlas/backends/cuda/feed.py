"""How the CUDA backend feeds chunks through the model: the groups a step's chunks form (every one-token row in one
decode group, each longer chunk alone), their shapes and packed rows, the checks made before any sequence moves, and
each group's forward (the compiled regions or the layer stack, replayed from a CUDA graph where one is captured) to
the logits of its last positions. `GroupFeed` is a base of `CudaBackend` (atlas.backends.cuda.runner), which sets
the attributes it reads and gives `reset`, `_faults` and `_seqs`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import attrs
import torch

from atlas.backends.base import ChunkLike, check_chunk
from atlas.backends.cuda import regions
from atlas.backends.cuda.batch import Group, GroupShape, Row, pack_rows
from atlas.backends.cuda.gdn import GdnKernel
from atlas.backends.cuda.graphs import DecodeGraphs, Recurring, bucket
from atlas.backends.cuda.layers import forward_group
from atlas.backends.cuda.ple import device_ngram_ids, ple_context_update
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.seq_state import SeqState
from atlas.backends.cuda.tuning import Tuning
from atlas.model.spec import ModelSpec


class GroupRows(Mapping):
    """Chunk index -> its row of a group's batched tensor ([vocab] logits, a hidden), indexed when asked: a
    batch-64 decode step used to slice 128 views a step (64 logits, 64 hiddens) that the sampler graph and a
    drafter-less step never read."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[torch.Tensor, int]] = {}

    def put(self, tensor: torch.Tensor, idx: Sequence[int]) -> None:
        at = self._at
        for j, i in enumerate(idx):
            at[i] = (tensor, j)

    def __getitem__(self, i: int) -> torch.Tensor:
        tensor, j = self._at[i]
        return tensor[j]

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, i: object) -> bool:
        return i in self._at


class GroupFeed:
    """The chunks-to-logits half of CudaBackend: groups, their shapes, their forwards."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    pools: DevicePools
    tuning: Tuning
    device: torch.device
    block_size: int
    max_batch_size: int
    max_blocks_per_seq: int
    batch_invariant: bool
    gdn_kernel: GdnKernel | None
    graphs: DecodeGraphs | None
    prefill_graphs: DecodeGraphs | None
    _seqs: dict[int, SeqState]
    _recurring: Recurring
    _decode_shapes: dict
    _replayed: tuple[GroupShape, list[int]] | None
    _hidden_out: dict[GroupShape, torch.Tensor]
    _kept_out: dict[GroupShape, dict]
    _ple_tables_dev: list[tuple[torch.Tensor, ...]]

    def _shape(self, batch: int, width: int, end: int) -> GroupShape:
        ple = self.spec.ple
        qsa = self.spec.qsa
        return GroupShape(batch=batch, width=width, key_blocks=-(-end // self.block_size),
                          qsa_select=qsa is not None and end > qsa.inert_bound,
                          ngram_heads=ple.num_heads if ple else 0, ple_layers=len(ple.layers) if ple else 0,
                          ngram_on_device=ple is not None)

    def _row(self, chunk: ChunkLike) -> Row:
        """The chunk's packed row, without n-gram ids: every group the runner packs computes them on the device
        (GroupShape.ngram_on_device; only the row-by-row verify packs the host's, from _ngram_rows)."""
        state = self._seqs[chunk.seq_id]
        return (chunk.tokens, chunk.start, state.slot, chunk.block_table, [])

    def _advance(self, chunk: ChunkLike) -> None:
        state = self._seqs[chunk.seq_id]
        state.position = chunk.start + len(chunk.tokens)
        state.table = tuple(chunk.block_table)
        if self.spec.ple is not None:
            state.ple_context = (state.ple_context + list(chunk.tokens))[-self.spec.ple.context_len :]

    def _group(self, packed: torch.Tensor, shape: GroupShape) -> Group:
        """The device views of a packed group; a decode group's n-gram ids computed from the slots' context (by the
        compiled prologue for compiled decode regions); a compiled decode's columns derived in one compiled region."""
        grp = Group.view(packed, shape, self.block_size, regions.columns_of(self.spec, shape, self.tuning))
        if shape.ngram_on_device:
            assert self.spec.ple is not None
            if not regions.computes_ngram_ids(self.spec, shape, self.tuning):  # else the compiled prologue does
                grp = attrs.evolve(grp, ngram_ids=device_ngram_ids(self.pools, grp, self.spec.ple,
                                                                   self._ple_tables_dev))
        return grp

    def _run_group(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        grp = self._group(packed, shape)
        # decode groups take graph-capturable paths; prefill groups run eagerly (their MoE may sync: prefill_moe)
        eager = shape.width > 1 and not shape.pending
        if regions.applies(self.spec, grp, self.tuning):
            hidden = regions.regions_stack(self.spec, self.weights, self.pools, grp, ngram_tables=self._ple_tables_dev,
                                           gdn_kernel=self.gdn_kernel,
                                           tuning=self.tuning, invariant=self.batch_invariant)
        else:
            hidden = forward_group(self.spec, self.weights, self.pools, grp, eager_moe=eager,
                                   gdn_kernel=self.gdn_kernel, tuning=self.tuning, invariant=self.batch_invariant)
        if self.pools.ple_context_len:  # the device's n-gram context (and its stamp), in the same graph
            ple_context_update(self.pools, grp)
        return hidden

    def _decode_logits(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        hidden = self._run_group(packed, shape)
        last = hidden[:, -1]
        # the last row's hidden, kept for the drafter (under a graph: the captured run's static tensor)
        self._hidden_out[shape] = last
        return last @ self.weights["lm_head.weight"].T

    def _prefill_logits(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        """A prefill chunk's last-row logits [1, vocab], its every row's hidden kept (the eager path's ops)."""
        hidden = self._run_group(packed, shape)
        self._hidden_out[shape] = hidden
        return hidden[:, -1] @ self.weights["lm_head.weight"].T

    def _verify_logits(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        """A wide verify group: every row's logits [B, K, vocab] (its hidden kept for the drafter's commit)."""
        hidden = self._run_group(packed, shape)
        self._hidden_out[shape] = hidden
        # the per-token state tensors the commit selects from: under a graph, the captured run's static tensors
        # (a replay runs no Python, so verify.py puts these back into pools.kept after each replay)
        self._kept_out[shape] = dict(self.pools.kept)
        return hidden @ self.weights["lm_head.weight"].T

    def _padding(self, shape: GroupShape) -> torch.Tensor:
        return pack_rows(shape, [], self.pools.scratch_slots, self.pools.scratch_block, self.block_size)

    def _check_chunk(self, chunk: ChunkLike) -> None:
        state = self._seqs.get(chunk.seq_id)
        check_chunk(chunk, self.spec.vocab_size, state.position if state is not None else 0)
        end = chunk.start + len(chunk.tokens)
        needed = -(-end // self.block_size)
        whole = chunk.block_table
        if state is not None and state.checked[0] is whole and needed <= state.checked[1]:
            return  # this table object was checked whole at an earlier step, and covers these positions
        if len(whole) < needed:
            raise ValueError(f"block table has {len(whole)} blocks; positions up to {end} need {needed} "
                             f"of block_size {self.block_size}")
        # every block of it, not only the first `needed`: the group reads its key blocks' slots past them, the
        # sentinel the block at `end`, the stamp read the whole table (a block outside the pool there failed mid-step)
        if whole and (min(whole) < 0 or max(whole) >= self.pools.num_kv_blocks):
            raise ValueError(f"block table {list(whole)} names a block outside [0, {self.pools.num_kv_blocks})")
        if state is not None and isinstance(whole, tuple):  # a tuple cannot change under us
            state.checked = (whole, len(whole))

    def _prepare(self, chunks: Sequence[ChunkLike]) -> None:
        seq_ids = [c.seq_id for c in chunks]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a step feeds each sequence at most once, got sequence ids {seq_ids}")
        for chunk in chunks:  # refuse a bad batch before any sequence moves
            self._check_chunk(chunk)
        fresh = [c.seq_id for c in chunks if c.start == 0 or c.seq_id not in self._seqs]
        free = self.pools.free_count + sum(1 for s in fresh if s in self._seqs)
        if len({*fresh}) > free:
            raise ValueError(f"{len(fresh)} new sequences but only {free} state slots are free (max_batch_size "
                             f"{self.max_batch_size})")
        for seq_id in fresh:
            self.reset(seq_id)

    def _groups(self, chunks: Sequence[ChunkLike]) -> list[list[int]]:
        """Indices of `chunks` per group: all one-token rows together, each longer chunk alone."""
        decodes = [i for i, c in enumerate(chunks) if len(c.tokens) == 1]
        groups = [[i] for i, c in enumerate(chunks) if len(c.tokens) > 1]
        return ([decodes] if decodes else []) + groups

    def _last_logits(self, chunks: Sequence[ChunkLike], full: set[int] | None = None) -> GroupRows:
        """Feed the chunks; the logits of each one's last fed position, by chunk index ([vocab] each). For the
        chunks in `full` (prompt logprobs), every fed position's logits go to self.full_logits [n, vocab]. Each
        chunk's final hidden states (every position of a prefill chunk, the last of a decode) go to
        self.fed_hidden, for the drafter."""
        out = GroupRows()
        self._replayed = None
        self.full_logits: dict[int, torch.Tensor] = {}
        self.fed_hidden = GroupRows()
        full = full or set()
        head = self.weights["lm_head.weight"]
        for idx in self._groups(chunks):
            members = [chunks[i] for i in idx]
            width = len(members[0].tokens)
            end = max(c.start + len(c.tokens) for c in members)
            if width == 1:
                shape = self._decode_shape(len(members), end)
            else:
                shape = self._shape(len(members), width, end)
                if self.tuning.prefill_graphs:  # eager or replayed, a chunk computes one shape
                    shape = attrs.evolve(shape, key_blocks=bucket(shape.key_blocks, 4))
            rows = [self._row(c) for c in members]
            packed = pack_rows(shape, rows, self.pools.scratch_slots, self.pools.scratch_block, self.block_size)
            if width == 1:
                logits = self._decode_group(shape, packed, idx)
                hidden = self._hidden_out[shape][:, None]
            elif self.prefill_graphs is not None and self._recurring.take(shape):
                host = packed.pin_memory() if self.device.type == "cuda" else packed
                logits, _ = self.prefill_graphs.replay(shape, host, self._padding)
                # copied out now: another chunk of this shape in the step replays the same static outputs
                logits, hidden = logits.clone(), self._hidden_out[shape].clone()
            else:
                hidden = self._run_group(packed.to(self.device), shape)
                logits = hidden[:, -1] @ head.T
            for c in members:
                self._advance(c)
            out.put(logits, idx)
            self.fed_hidden.put(hidden, idx)
            for j, i in enumerate(idx):
                if i in full:
                    self.full_logits[i] = logits[j][None] if width == 1 else hidden[j] @ head.T
        return out

    def _decode_shape(self, batch: int, end: int) -> GroupShape:
        """The shape of a decode group of `batch` rows whose furthest fed position is end - 1: padded to the graph
        buckets (or, batch invariant, to the one shape of every step). Memoised: a steady decode asks every step."""
        qsa = self.spec.qsa
        key = (batch, -(-end // self.block_size), qsa is not None and end > qsa.inert_bound, self.graphs is not None,
               self.batch_invariant)
        shape = self._decode_shapes.get(key)
        if shape is None:
            shape = self._shape(batch, 1, end)
            if self.batch_invariant:
                shape = attrs.evolve(shape, batch=bucket(self.max_batch_size), key_blocks=self.max_blocks_per_seq)
            elif self.graphs is not None:
                shape = attrs.evolve(shape, batch=bucket(batch), key_blocks=bucket(shape.key_blocks, 4))
            if len(self._decode_shapes) >= 1024:
                self._decode_shapes.clear()
            # one object per distinct shape (several keys bucket to one): the steady step keeps its packed buffer
            # while the shape is the same object, and the graphs' dicts find it by identity
            shape = self._decode_shapes[key] = self._decode_shapes.setdefault(shape, shape)
        return shape

    def _decode_group(self, shape: GroupShape, packed: torch.Tensor, idx: list[int], *, ready: bool = False
                      ) -> torch.Tensor:
        """A decode group's forward on its packed host buffer (`ready`: already in pinned memory on a CUDA device):
        its logits [B, vocab] (its last hidden in self._hidden_out[shape]), replayed from its graph when there are
        graphs (the sampler then samples the graph's own logits: self._replayed)."""
        if self.graphs is not None:
            host = packed if ready or self.device.type != "cuda" else packed.pin_memory()
            logits, _ = self.graphs.replay(shape, host, self._padding)
            self._replayed = (shape, idx)
        else:
            logits = self._decode_logits(packed.to(self.device), shape)
        return logits

    def forward_hidden(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        """Run each chunk (eager, one group each); return its final hidden states [n, H] (the lm_head input)."""
        with self._faults():
            self._prepare(chunks)
            self._ngram_fill(chunks)
            out = []
            for chunk in chunks:
                shape = self._shape(1, len(chunk.tokens), chunk.start + len(chunk.tokens))
                packed = pack_rows(shape, [self._row(chunk)], self.pools.scratch_slots, self.pools.scratch_block,
                                   self.block_size)
                out.append(self._run_group(packed.to(self.device), shape)[0])
                self._advance(chunk)
            return out

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weights["lm_head.weight"].T

    def forward(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        """Run each chunk; return its logits [n, vocab] for every fed position."""
        return [self.logits_from_hidden(h) for h in self.forward_hidden(chunks)]
