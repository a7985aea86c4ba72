"""`CudaBackend`: the data plane on an NVIDIA GPU, with the CPU reference backend's interface.

A step's work is split into groups (atlas.backends.cuda.batch): every one-token row (decodes) in one
group, replayed from a CUDA graph per batch bucket, and each longer prefill chunk in a group of its own,
eager. bf16 weights and activations with fp32 recurrent state by default; dtype=torch.float32 is the
parity mode (plain torch ops, no Triton kernels, no TF32), whose greedy tokens equal the CPU backend's.
batch_invariant=True pads every decode group to one shape, so a request's tokens do not depend on the batch.

Its Capabilities declare what it supports; the engine builder refuses any other configuration at start.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np
import torch

from atlas.backends.base import (
    Capabilities,
    ChunkLike,
    check_chunk,
    check_verify,
    run_orders,
    state_audit_default,
)
from atlas.backends.cuda import picks, regions
from atlas.backends.cuda.batch import Group, GroupShape, Row, pack_rows
from atlas.backends.cuda.faults import FaultGuard, probe_device
from atlas.backends.cuda.graphs import DecodeGraphs, Recurring, bucket
from atlas.backends.cuda.layers import (
    GdnKernel,
    device_ngram_ids,
    forward_group,
    moe_mode_of,
    ple_context_update,
    prepare_weights,
)
from atlas.backends.cuda.ngram import device_ngram_cache
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.steady import SteadyDecode
from atlas.backends.cuda.store import CudaStateStore, SeqState
from atlas.backends.cuda.tuning import EAGER, Tuning
from atlas.backends.cuda.verify import VerifyRun, run_verifies
from atlas.config import Capacities, check_ple_capacities
from atlas.model.loader import LoadedModel
from atlas.model.ngram import NgramTables, ngram_ids, ngram_tables
from atlas.plan import BackendCursors, PromptLogprob, SeqOutcome, SeqWork, StepPlan, StepResult
from atlas.sampling.keyed import RowPacker

# the backend name is what a trace records, so it names the whole mode and a replay rebuilds the same one:
# "cuda" (bf16, fp32 recurrent state), "-fp32" the parity mode, "-invariant" batch-invariant decode
MODES = ("cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant")


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


def parse_backend(name: str) -> tuple[torch.dtype, bool]:
    """(activation dtype, batch invariant) of a CUDA backend name."""
    if name not in MODES:
        raise ValueError(f"unknown CUDA backend {name!r} ({', '.join(MODES)})")
    return (torch.float32 if "-fp32" in name else torch.bfloat16), name.endswith("-invariant")


def triton_gdn() -> GdnKernel | None:
    """The Triton GDN kernels (decode: recurrent update; prefill: chunked, its intermediates and scan products in
    bf16 for bf16 inputs, fp32 for fp32 ones), or None when atlas_kernels is not importable. On a CPU they run only
    under TRITON_INTERPRET=1 (tests)."""
    try:
        from atlas_kernels.gdn_chunk_split import gdn_chunk_prefill_gated
        from atlas_kernels.gdn_recurrent import gdn_recurrent_gated
    except ImportError:
        return None

    def gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b_raw: torch.Tensor,
            a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, *, keep: bool = False,
            stamp: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, per-token states [B, T, ...] when `keep`: a wide verify, whose live state is left as it was).
        stamp: (the state's stamps [slots], each row's new stamp [B]), written with the state unless `keep`."""
        if keep:  # a verify: every row's state kept for the commit, the slot not written
            return gdn_recurrent_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, store_states=True,
                                       commit=False)
        if q.shape[1] == 1:  # g, beta and the stamp in the kernel: no separate launches for them per layer
            return gdn_recurrent_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, stamp=stamp)[0], None
        # the split chunk kernel (chunk-local products in a parallel kernel, then the state scan), the gates, the
        # sequences' bounds and the stamp in its kernels, q / k / v / a / b read in place. bf16 inputs: bf16 work and
        # the registers prepare (H200, a 2,048-token layer's call: 322.5 us with fp32 work and the scratch prepare,
        # 221.8 with bf16 work, 146.5 with the registers prepare; fla-core 0.6.0's chunk_gated_delta_rule 626 us);
        # fp32 inputs (the parity mode) fp32 work and the scratch prepare (the registers prepare spills there)
        low = v.dtype == torch.bfloat16
        return gdn_chunk_prefill_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots, stamp=stamp,
                                       work="bf16" if low else "fp32", prepare="registers" if low else "scratch"), None

    return gdn


class CudaBackend:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_kv_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        device: str | torch.device = "cuda",
        kernels: bool | None = None,
        cuda_graphs: bool | None = None,
        batch_invariant: bool = False,
        max_blocks_per_seq: int | None = None,
        name: str = "cuda",
        ring_slots: int = 0,
        verify_width: int = 1,
        mtp_drafter: bool = False,
        snapshot_bytes: int = 0,
        verify_mode: str | None = None,
        tuning: Tuning | None = None,
        state_audit: bool | None = None,
        ngram_cache_slots: int = 0,
        ple_scratch_rows: int = 0,
        ngram_budget: int | str | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.spec = spec = model.spec
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the CUDA backend needs an NVIDIA GPU and torch.cuda.is_available() is False here "
                               "(use --backend cpu)")
        self.dtype = dtype or torch.bfloat16
        if spec.qsa is not None and block_size % spec.qsa.ratio:
            raise ValueError(f"block_size {block_size} must be a multiple of the QSA ratio {spec.qsa.ratio}: pooled "
                             "index blocks must not straddle KV blocks")
        if self.device.type == "cuda" and self.dtype == torch.float32:
            # parity mode: full fp32 products (TF32 would round operands to 10-bit mantissas)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        # n-gram tables not held whole (left in the checkpoint, or over the budget) read through the row cache:
        # its slots stand in for them in the weights (atlas.backends.cuda.ngram)
        self.ngram_cache = device_ngram_cache(model, dtype=self.dtype, device=self.device, slots=ngram_cache_slots,
                                              scratch_rows=ple_scratch_rows, budget=ngram_budget)
        cached = self.ngram_cache.tables() if self.ngram_cache is not None else {}
        self.weights = prepare_weights(spec, {
            k: t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)
            for k, t in model.weights.items() if not k.startswith("mtp.") and k not in cached})
        self.weights.update(cached)
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        # batch invariance: every decode group padded to the same rows and key blocks, so every GEMM, softmax and
        # kernel sees the same shapes whatever else is in the batch, and a row's bits depend on its own inputs
        # only (a request's tokens alone equal its tokens in any batch). Costs a full batch's work per step.
        self.batch_invariant = batch_invariant
        self.max_blocks_per_seq = max_blocks_per_seq or num_kv_blocks
        use_kernels = self.dtype != torch.float32 if kernels is None else kernels
        self.gdn_kernel = triton_gdn() if use_kernels and self.device.type == "cuda" else None
        if kernels and self.gdn_kernel is None:
            raise ValueError("kernels=True needs a CUDA device and atlas_kernels (the kernels/ package) importable")
        # which implementation each part of a step uses (atlas.backends.cuda.tuning): the fastest arrangement, or
        # the plain-torch reference where the Triton kernels do not run (the fp32 parity mode, a CPU device)
        self.tuning = tuning or (Tuning() if self.gdn_kernel is not None else EAGER)
        # a verify of K rows: "rows" feeds them as K one-token groups (a decode's shapes, so a verify that accepts
        # n is bitwise n + 1 decodes: the fp32 parity mode's contract); "wide" as one [B, K] group keeping each
        # row's state (one forward: bf16, where a 1-row and a K-row GEMM round differently anyway)
        self.verify_mode = verify_mode or ("rows" if self.dtype == torch.float32 else "wide")
        if self.verify_mode not in ("rows", "wide"):
            raise ValueError(f"verify_mode {self.verify_mode!r}: 'rows' or 'wide'")
        self.pools = DevicePools(spec, num_kv_blocks=num_kv_blocks, block_size=block_size, max_seqs=max_batch_size,
                                 scratch_slots=bucket(max_batch_size), dtype=self.dtype, device=self.device,
                                 verify_width=verify_width, ring_slots=ring_slots,
                                 inter=self.verify_mode == "rows")
        has_mtp = any(k.startswith("mtp.") for k in model.weights)
        if mtp_drafter and not has_mtp:
            raise ValueError(f"mtp_drafter=True but model {model.name!r} has no mtp.* weights (use the n-gram drafter)")
        self.drafter = None
        if mtp_drafter:
            from atlas.backends.cuda.drafter import CudaMtpDrafter

            # capacity: a sequence's keys, and the transient rows of the drafts proposed past them
            self.drafter = CudaMtpDrafter(spec, model.weights, self.pools, shared=self.weights, dtype=self.dtype,
                                          device=self.device,
                                          capacity=self.max_blocks_per_seq * block_size + verify_width + 1,
                                          exact=self.verify_mode == "rows")
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.store = CudaStateStore(spec, self.pools, slot_bytes=snapshot_bytes, drafter=self.drafter,
                                    table_blocks=self.max_blocks_per_seq, graphs=use_graphs,
                                    audit=state_audit_default() if state_audit is None else state_audit)
        self.graphs = DecodeGraphs(self._decode_logits, self.device) if use_graphs else None
        # wide verifies ([B, K] groups) replayed from graphs of their own: every row's logits come back
        self.verify_graphs = DecodeGraphs(self._verify_logits, self.device) if use_graphs else None
        # prefill chunks of a recurring shape replayed from graphs of their own (Tuning.prefill_graphs)
        self.prefill_graphs = None
        if use_graphs and self.tuning.prefill_graphs:
            self.prefill_graphs = DecodeGraphs(self._prefill_logits, self.device)
        self._recurring = Recurring()
        # a plain step's outcomes built without the general path's per-row dicts (execute; off only in a test)
        self.plain_fast = True
        # the steady decode step run on columns (atlas.backends.cuda.steady; None: every step the general way, as a
        # subclass that samples otherwise, the tensor-parallel backend, does)
        self.steady = (SteadyDecode(self) if type(self)._sample is CudaBackend._sample and self.ngram_cache is None
                       else None)  # (the cache's fill needs each step's rows on the host: the general path)
        self._decode_shapes: dict = {}  # _decode_shape's memo: (batch, blocks, ...) -> shape, and shape -> itself
        # the decode graph's sampler rows, kept between steps (atlas.sampling.keyed.RowPacker)
        self.row_packer = RowPacker(pin=self.device.type == "cuda")
        self._seqs = self.store.seqs
        # the decode group replayed from a graph this step (its shape, its chunk indices): its rows are sampled
        # by the sampler graph on the graph's own logits
        self._replayed: tuple[GroupShape, list[int]] | None = None
        self._hidden_out: dict[GroupShape, torch.Tensor] = {}
        self._kept_out: dict[GroupShape, dict] = {}
        self._ple_tables = ([ngram_tables(spec.ple, spec.vocab_size, r) for r in range(len(spec.ple.layers))]
                            if spec.ple is not None else [])
        # the same tables on the device, for a decode group's ids computed there (layers.device_ngram_ids)
        self._ple_tables_dev = [tuple(torch.tensor(v, dtype=torch.long, device=self.device) for v in
                                      (t.multipliers, t.head_vocab_sizes, t.head_offsets)) for t in self._ple_tables]
        if self.ngram_cache is not None:  # ids read through each layer's remap, from a row to its slot
            self._ple_tables_dev = [(*t, remap) for t, remap in zip(self._ple_tables_dev, self.ngram_cache.remaps(),
                                                                    strict=True)]
        # verify rows get their own QSA selection (qsa_selection masks per row by the row's own position), so a
        # verify across the inert bound is exact
        self.capabilities = Capabilities(
            verify=True, per_row_qsa_verify=True, mtp_drafting=self.drafter is not None, snapshot_ring=ring_slots > 0,
            prefix_snapshots=True, batch_invariant=batch_invariant, fp32_parity=self.dtype == torch.float32,
            max_verify_width=verify_width, prompt_logprobs=True)

    @property
    def prefill_moe(self) -> str:
        """MoE of prefill chunks (layers.moe_mode_of): "grouped" syncs with the host every layer."""
        return moe_mode_of(self.tuning, prefill=True)

    @classmethod
    def for_capacities(cls, model: LoadedModel, caps: Capacities, *, dtype: torch.dtype | None = None,
                       **kwargs: object) -> CudaBackend:
        """The backend sized by the engine's capacities: KV blocks, slots, ring, verify width, the drafter."""
        check_ple_capacities(caps)
        return cls(model, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, dtype=dtype,
                   max_batch_size=caps.max_batch_size, max_blocks_per_seq=caps.kv_blocks_per_seq,
                   ring_slots=caps.ring_slots, verify_width=caps.verify_width, mtp_drafter=caps.drafter_rows > 0,
                   snapshot_bytes=caps.ring_slot_bytes, ngram_cache_slots=caps.ngram_cache_slots,
                   ple_scratch_rows=caps.ple_scratch_rows, **kwargs)  # type: ignore[arg-type]

    @property
    def num_kv_blocks(self) -> int:
        return self.pools.num_kv_blocks

    def close(self) -> None:
        """Give the device memory back now (Engine.close): the graphs hold bound methods of this backend (a
        reference cycle), so without this its pools, fused weights and graph pools wait for the cyclic garbage
        collector; a process that builds engines one after another (the benchmarks) ran out of the H200's
        139 GiB at the fourteenth (GPU run 2 of session 3)."""
        self.graphs = self.verify_graphs = self.prefill_graphs = None
        self.store.reader.close()
        if self.device.type == "cuda":  # the CPU path (tests) has no graphs and memory to spare: no collection
            gc.collect()
            torch.cuda.empty_cache()

    # -- per-sequence state -------------------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def reset(self, seq_id: int) -> None:
        """Drop a sequence's data-plane state back to empty (its KV blocks are the caller's to reuse)."""
        self.store.reset(seq_id)

    def release(self, seq_id: int) -> None:
        self.store.release(seq_id)

    def cursors(self, seq_id: int) -> BackendCursors:
        return self.store.cursors(seq_id)

    # -- groups ---------------------------------------------------------------------------------------

    def _shape(self, batch: int, width: int, end: int) -> GroupShape:
        ple = self.spec.ple
        qsa = self.spec.qsa
        return GroupShape(batch=batch, width=width, key_blocks=-(-end // self.block_size),
                          qsa_select=qsa is not None and end > qsa.inert_bound,
                          ngram_heads=ple.num_heads if ple else 0, ple_layers=len(ple.layers) if ple else 0,
                          ngram_on_device=ple is not None)

    def _ngram_rows(self, state: SeqState, tokens: Sequence[int]) -> list[list[int]]:
        """Per PLE layer, the n-gram ids of `tokens` continuing the sequence's context, flattened: the table rows,
        or with the row cache their slots (this step's fill assigned them)."""
        rows = self._ngram_row_ids(state, tokens)
        if self.ngram_cache is None:
            return rows
        return [self.ngram_cache.slot_ids(p, layer) for p, layer in enumerate(rows)]

    def _ngram_fill(self, fed: Sequence[tuple[SeqState, Sequence[int]]]) -> None:
        """With the row cache: every n-gram row the step's (state, tokens) feed resident before its forward."""
        if self.ngram_cache is None or not fed:
            return
        per_seq = [self._ngram_row_ids(state, tokens) for state, tokens in fed]
        layers = [np.fromiter((r for seq in per_seq for r in seq[p]), dtype=np.int64)
                  for p in range(len(self._ple_tables))]
        self.ngram_cache.fill(layers, sum(len(tokens) for _, tokens in fed))

    def _ngram_row_ids(self, state: SeqState, tokens: Sequence[int]) -> list[list[int]]:
        """Per PLE layer, the table rows of `tokens`' n-gram ids continuing the sequence's context, flattened."""
        ple = self.spec.ple
        if ple is None:
            return []
        history = state.ple_context + list(tokens)
        if len(tokens) == 1:  # decode: plain integers, no tensor round trip (the host side of every step)
            return [_ngram_one(history, ple.ngram_size, ple.heads_per_ngram, ple.eos_token_id, t) for t in self._ple_tables]
        hist = torch.tensor(history, dtype=torch.long)
        return [ngram_ids(hist, len(tokens), ple, t).flatten().tolist() for t in self._ple_tables]

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

    # -- compute ------------------------------------------------------------------------------------

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
            self._ngram_fill([(self._seqs[c.seq_id], c.tokens) for c in chunks])
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

    def execute(self, plan: StepPlan) -> StepResult:
        with self._faults():
            if self.steady is not None:  # the steady decode step, on columns; None (nothing moved): any other plan
                result = self.steady.step(plan)
                if result is not None:
                    return result
            store = self.store
            done = run_orders(store, plan)
            ends = {w.seq_id: w.end for w in plan.work}
            for snap in plan.snapshots:  # refuse a bad order before any sequence moves
                store.check_snapshot(snap)
                if ends.get(snap.seq_id) != snap.position:
                    raise ValueError(f"sequence {snap.seq_id}: snapshot at {snap.position} is not where its work ends "
                                     f"({ends.get(snap.seq_id)})")
            work = [w for w in plan.work if w.seq_id not in done.refused]
            plain = [w for w in work if not w.drafts]
            verifies = [w for w in work if w.drafts]
            for w in verifies:
                self._check_verify(w)
            self._prepare(plain)
            self._ngram_fill([(self._seqs[w.seq_id], tuple(w.tokens) + tuple(w.drafts)) for w in plain + verifies])
            scored = {i for i, w in enumerate(plain) if w.prompt_logprobs is not None}
            logits = self._last_logits(plain, scored)
            in_work = set(ends)
            read = [w.seq_id for w in plan.work] + [s for s in done.restored if s not in in_work]
            if not verifies and not plan.snapshots and self.drafter is None:
                # nothing after the sampler writes state: the stamp read starts now, behind the forward on the
                # stream, so its launch overlaps the forward and the sampler's token copy waits for its copy too
                store.prefetch(read)
            picked = self._sample(plain, logits)
            if (self.plain_fast and not verifies and not plan.snapshots and self.drafter is None and not done.refused
                    and not scored):
                # a plain step (the steady decode): each outcome built at once, no per-row results dict
                return self._plain_result(plan, picked, read)
            results: dict[int, dict] = {}
            for i, w in enumerate(plain):
                token, logprob, top = picked.get(i, (None, None, ()))
                results[w.seq_id] = dict(token=token, logprob=logprob, top_logprobs=top,
                                         prompt_logprobs=self._prompt_logprobs(w, self.full_logits[i])
                                         if i in scored else ())
            if self.drafter is not None:
                hidden = {w.seq_id: self.fed_hidden[i] for i, w in enumerate(plain)}
                self.drafter.feed([(w.seq_id, w.start, w.tokens, w.drafter_first_key) for w in plain], hidden)
            for seq_id, run in run_verifies(self, verifies).items():
                results[seq_id] = self._verified(run)
            for snap in plan.snapshots:
                store.snapshot(snap)
            if self.drafter is not None:
                asks = [(w, results[w.seq_id]["token"]) for w in work
                        if w.propose and results[w.seq_id].get("token") is not None
                        and results[w.seq_id].get("refused") is None]
                for seq_id, drafts in self.drafter.propose(asks).items():
                    results[seq_id]["drafts"] = drafts
            cursors = store.read_cursors(read)
            outcomes = []
            for w in plan.work:
                if w.seq_id in done.refused:
                    outcomes.append(SeqOutcome(w.seq_id, cursors[w.seq_id], accepted=-1,
                                               refused=done.refused[w.seq_id]))
                else:
                    outcomes.append(SeqOutcome(w.seq_id, cursors[w.seq_id], **results[w.seq_id]))
            return StepResult(plan.step, tuple(outcomes),
                              touched=tuple((s, cursors[s]) for s in done.restored if s not in in_work),
                              refused=tuple((s, why) for s, why in done.refused.items() if s not in in_work))

    def _plain_result(self, plan: StepPlan, picked: dict, read: list[int]) -> StepResult:
        """execute's result for a step of plain chunks only (no verify, snapshot, drafter, refusal or prompt
        logprobs): what the general path builds, without its per-row dicts."""
        cursors = self.store.read_cursors(read)
        none: tuple = (None, None, ())
        outcomes = []
        for i, w in enumerate(plan.work):
            token, logprob, top = picked.get(i, none)
            outcomes.append(SeqOutcome(w.seq_id, cursors[w.seq_id], token, logprob, top))
        # read: the work's sequences, then the restored ones without work (execute built it so)
        return StepResult(plan.step, tuple(outcomes), touched=tuple((s, cursors[s]) for s in read[len(plan.work):]))

    def _verified(self, run: VerifyRun) -> dict:
        if run.refused is not None:
            return dict(verdicts=run.verdicts, accepted=-1, refused=run.refused)
        n = run.accepted
        v = run.verdicts[n]
        return dict(token=v.token, logprob=v.logprob, top_logprobs=v.top_logprobs, verdicts=run.verdicts, accepted=n)

    def _check_verify(self, work: SeqWork) -> None:
        check_verify(work, self.pools.verify_width, self.store.held(work.seq_id), work.seq_id in self._seqs)
        self._check_chunk(attrs.evolve(work, tokens=work.tokens + work.drafts, drafts=()))

    def verify(self, w: SeqWork) -> tuple:
        """Feed one verify's K rows and judge them; the per-row states wait in the pools for `store.commit`."""
        with self._faults():
            self._check_verify(w)
            self._ngram_fill([(self._seqs[w.seq_id], tuple(w.tokens) + tuple(w.drafts))])
            run = run_verifies(self, [w], commit=False)[w.seq_id]
            return run.verdicts

    def _prompt_logprobs(self, w: SeqWork, rows: torch.Tensor) -> tuple[PromptLogprob, ...]:
        return picks.prompt_logprobs(self, w, rows)

    def _sample(self, work: Sequence[SeqWork], logits: dict[int, torch.Tensor]
                ) -> dict[int, tuple[int, float | None, tuple[tuple[int, float], ...]]]:
        return picks.sample_rows(self, work, logits)

    def _faults(self) -> FaultGuard:
        """Around a step's device work: after any error, a probe decides whether the context is dead (fatal)."""
        return FaultGuard(self.probe)

    def probe(self) -> str | None:
        """None when the device still runs a kernel (atlas.backends.cuda.faults.probe_device)."""
        return probe_device(self.device)


def _ngram_one(history: list[int], ngram_size: int, heads_per_ngram: int, eos: int, tables: NgramTables) -> list[int]:
    """atlas.model.ngram.ngram_ids for the last token of `history` (context + 1 token), on plain ints."""
    p = len(history) - 1
    mult, sizes, offsets = tables.multipliers, tables.head_vocab_sizes, tables.head_offsets
    ids: list[int] = []
    mixed = history[p] * mult[0]
    for order in range(2, ngram_size + 1):
        src = p - (order - 1)
        # the token `order - 1` back, unless an EOS lies between (the n-gram restarts after EOS)
        shifted = eos if src < 0 or eos in history[src:p] else history[src]
        mixed ^= shifted * mult[order - 1]
        lo = (order - 2) * heads_per_ngram
        ids.extend(mixed % sizes[h] + offsets[h] for h in range(lo, lo + heads_per_ngram))
    return ids
