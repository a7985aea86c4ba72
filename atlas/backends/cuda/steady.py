"""The steady decode step on columns: `CudaBackend.execute`'s host work for its commonest plan, without a pass of
Python calls per row.

A steady step is a plan with no orders (no release, reset, restore, prefix store or load, snapshot; a carry order
moves nothing without a drafter) whose work is one sampled token per sequence, each a plain decode (no drafts, ban
or prompt logprobs), each at the position the backend holds for it (not 0: a fresh sequence), on a backend without
a drafter. `SteadyDecode.step` recognises one from columns of the work (one attribute fetch a row, C-level
comparisons against what it kept from the last step it ran: the same sequences, the same SeqState objects, the
same block tables) and runs it: the packed group buffer of the last step with only its tokens, starts and
sentinels rewritten (numpy columns, or cell by cell for a few rows), the forward as the general path runs it, the
n-gram context mirror advanced in place, the sampler on the rows as columns (picks.sample_decode), the stamp read
of the states in hand (CudaStateStore.prefetch_held / read_held), the outcomes built in one map. Anything else, and any check that fails, is
handed back (None) before anything moves, and the general path (`execute`) runs the plan: a bad input is refused
there, by the general path's own checks, with their error. So this module refuses nothing itself; what it must
get right is that it never accepts what the general path would refuse, and that a step it runs leaves exactly
what the general path leaves (tests/test_cuda_steady.py runs both side by side, step by step).

What is kept between steps (the "batch"): its sequence ids, their SeqState objects (compared by identity: a
released and re-created sequence is another batch), their block tables, each table's limit (the positions it
covers when every block of it is inside the pool, else 0: such a row always goes the general way), each table's
blocks as a matrix (for the sentinels), and the packed buffer of the last group shape (with the slots, tables and
padding rows reference-packed by batch.pack_rows whenever the batch or the shape changes). Nothing in it
is a position or a token: those are read from the plan and the SeqStates every step.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from atlas.backends.cuda.batch import GroupShape, pack_rows, sentinel_slot
from atlas.backends.cuda.picks import sample_decode
from atlas.plan import SeqOutcome, StepPlan, StepResult

# one fetch a row: what the step feeds, and the flags that make a row a plain sampled decode
_ROW = operator.attrgetter("seq_id", "tokens", "start", "block_table", "sampling")
_FLAGS = operator.attrgetter("sample", "banned", "drafts", "prompt_logprobs")
_PLAIN = (True, (), (), None)  # sample, no ban, no drafts, no prompt logprobs
_POSITION = operator.attrgetter("position")
_LOGPROBS = operator.attrgetter("logprobs")
_ADJUSTED = operator.attrgetter("adjusted")


class FirstRows(Mapping):
    """Chunk i -> row i of a group's last hidden [B, H] as [1, H], for the first n: `CudaBackend.fed_hidden` of a
    group holding every chunk in order (what GroupRows holds then, without its per-row entries). `hidden`: the
    backend's last hiddens by shape (looked up when asked: the next step replaces the whole mapping)."""

    def __init__(self, hidden: dict[GroupShape, torch.Tensor], shape: GroupShape, n: int) -> None:
        self.hidden, self.shape, self.n = hidden, shape, n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise KeyError(i)
        return self.hidden[self.shape][i][None]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class SteadyDecode:
    def __init__(self, backend: Any) -> None:  # a CudaBackend (Any: this module does not import the runner)
        self.backend = backend
        self.ids: tuple[int, ...] = ()
        self.states: list[Any] = []
        self.tables: tuple[tuple[int, ...], ...] = ()
        self.limits: list[int] = []  # a row runs here while its start is below this (its table covers start + 1)
        self.blocks = np.zeros((0, 1), dtype=np.int64)  # [n, widest + 1]: block * block_size, scratch's past the end
        self.rows = np.zeros(0, dtype=np.int64)
        self.params: tuple[Any, ...] | None = None  # the sampling params last checked for logprobs
        self.shape: GroupShape | None = None  # the shape `packed` is packed for
        self.packed: torch.Tensor | None = None
        self.buf = np.zeros((0, 0), dtype=np.int64)  # packed's numpy view
        self.idx: list[int] = []
        self.steps = 0  # steps run here (the tests check the fast path ran)
        # rows from which the kept buffer is rewritten by numpy columns (below, cell by cell: numpy's per-call cost
        # is more than a few rows' loop; measured crossover ~8 rows)
        self.columns_from = 8

    def step(self, plan: StepPlan) -> StepResult | None:
        """Run `plan` if it is a steady decode step and return its result; None, having moved nothing, if not."""
        b = self.backend
        # (a carry order is the drafter's rows: without a drafter CudaStateStore.carry moves nothing)
        if (plan.release or plan.reset or plan.snapshots or plan.restores or plan.prefix_stores
                or plan.prefix_restores or b.drafter is not None):
            return None
        work = plan.work
        n = len(work)
        if not n or list(map(_FLAGS, work)).count(_PLAIN) != n:
            return None
        ids, tokens, starts, tables, params = zip(*map(_ROW, work), strict=True)
        try:
            toks = [t for (t,) in tokens]  # one token a row
        except (TypeError, ValueError):
            return None
        if min(toks) < 0 or max(toks) >= b.spec.vocab_size:
            return None
        states = list(map(b._seqs.get, ids))
        if ids != self.ids or not all(map(operator.is_, states, self.states)) or tables != self.tables:
            if not self._batch(ids, states, tables):
                return None
        # each row at the position held (0 would be a fresh sequence: the general path resets it), its table covering
        # the fed position with every block inside the pool
        if min(starts) <= 0 or starts != tuple(map(_POSITION, states)) or not all(map(operator.lt, starts, self.limits)):
            return None
        if params != self.params:  # a row asking logprobs goes the general way (identity first: C speed), and so
            # does one with a logit_bias or penalty (sample_rows' eager rows build its inputs)
            if any(map(_LOGPROBS, params)) or any(map(_ADJUSTED, params)):
                return None
            self.params = params

        # -- checked: from here on the step runs (as execute's general path would, in its order) ---------------
        store = b.store
        self.steps += 1
        shape = b._decode_shape(n, max(starts) + 1)
        if shape is not self.shape:  # a new shape (more key blocks, a new batch): packed afresh by the reference packer
            self._pack(shape, tokens, starts, tables, states)
            ends: Any = [s + 1 for s in starts]
        elif n < self.columns_from:  # a few rows: the kept buffer's cells written one by one (numpy calls cost more)
            buf, bs, scratch = self.buf, b.block_size, b.pools.scratch_block
            for i, (t, s, table) in enumerate(zip(toks, starts, tables, strict=True)):
                buf[i, 0], buf[i, 1], buf[i, 3] = t, s, sentinel_slot(table, s + 1, bs, scratch)
            ends = [s + 1 for s in starts]
        else:  # the kept buffer: tokens, starts and sentinels rewritten as columns; slots, tables, padding as they were
            buf = self.buf
            first = np.fromiter(starts, np.int64, n)
            ends = first + 1
            buf[:n, 0] = toks
            buf[:n, 1] = first
            block, offset = np.divmod(ends, b.block_size)
            buf[:n, 3] = self.blocks[self.rows, block] + offset
        b._replayed = None  # set by a replay (the sampler then samples the graph's logits)
        logits = b._decode_group(shape, self.packed, self.idx, ready=True)  # (pinned on a CUDA device: _pack)
        b.full_logits, b.fed_hidden = {}, FirstRows(b._hidden_out, shape, n)
        keep = b.spec.ple.context_len if b.spec.ple is not None else 0
        for s, t, table in zip(states, toks, tables, strict=True):  # _advance, the n-gram context in place (a SeqState's own list)
            s.position += 1
            s.table = table
            if keep:
                ctx = s.ple_context
                ctx.append(t)
                del ctx[:-keep]
        store.prefetch_held(ids, states)
        picked = sample_decode(b, shape, params, ends, logits)
        outcomes = tuple(map(SeqOutcome, ids, store.read_held(ids, ids, states), picked))
        return StepResult(plan.step, outcomes)

    def _batch(self, ids: tuple[int, ...], states: list[Any], tables: tuple[tuple[int, ...], ...]) -> bool:
        """Keep a new batch (sequences, states, tables): False, keeping nothing, if a sequence is fed twice or is
        not held (the general path refuses the one and starts the other)."""
        if not all(states) or len(set(ids)) != len(ids):
            return False
        b = self.backend
        bs, blocks = b.block_size, b.pools.num_kv_blocks
        limits = []
        for table in tables:  # every block inside the pool, once per table object (a tuple cannot change)
            ok = type(table) is tuple and table and min(table) >= 0 and max(table) < blocks
            limits.append(len(table) * bs if ok else 0)
        widest = max(map(len, tables))
        scratch = b.pools.scratch_block * bs
        mat = np.full((len(ids), widest + 1), scratch, dtype=np.int64)
        for i, table in enumerate(tables):
            mat[i, : len(table)] = np.array(table, dtype=np.int64) * bs
        self.ids, self.states, self.tables, self.limits = ids, states, tables, limits
        self.blocks, self.rows, self.idx = mat, np.arange(len(ids)), list(range(len(ids)))
        self.shape = self.packed = None  # packed anew for the new rows
        return True

    def _pack(self, shape: GroupShape, tokens: tuple, starts: tuple, tables: tuple, states: list[Any]) -> None:
        b = self.backend
        rows = [(t, s, st.slot, table, []) for t, s, st, table in zip(tokens, starts, states, tables, strict=True)]
        packed = pack_rows(shape, rows, b.pools.scratch_slots, b.pools.scratch_block, b.block_size)
        if b.device.type == "cuda":  # pinned: the replay's copy is asynchronous (the step waits for it: the tokens)
            packed = packed.pin_memory()
        self.shape, self.packed, self.buf = shape, packed, packed.numpy()

