"""`CudaBackend`: the data plane on an NVIDIA GPU, with the CPU reference backend's interface.

A step's work is split into groups (atlas.backends.cuda.batch): every one-token row (decodes) in one
group, replayed from a CUDA graph per batch bucket, and each longer prefill chunk in a group of its own,
eager. bf16 weights and activations with fp32 recurrent state by default; dtype=torch.float32 is the
parity mode (plain torch ops, no Triton kernels, no TF32), whose greedy tokens equal the CPU backend's.
batch_invariant=True pads every decode group to one shape, so a request's tokens do not depend on the batch.

Its Capabilities declare what it supports; the engine builder refuses any other configuration at start.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.backends.base import Capabilities, ChunkLike, check_chunk, run_orders
from atlas.backends.cuda.batch import Group, GroupShape, Row, pack_rows
from atlas.backends.cuda.faults import FaultGuard, probe_device
from atlas.backends.cuda.graphs import DecodeGraphs, bucket
from atlas.backends.cuda.layers import GdnKernel, forward_group, prepare_weights
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.tuning import Tuning
from atlas.config import Capacities
from atlas.errors import RestoreRefused, VerifyRefused
from atlas.model.loader import LoadedModel
from atlas.model.ngram import NgramTables, ngram_ids, ngram_tables
from atlas.plan import (
    BackendCursors,
    CarryOrder,
    PrefixRestore,
    PrefixStore,
    RingRestore,
    RingSnapshot,
    SeqOutcome,
    SeqWork,
    StepPlan,
    StepResult,
)
from atlas.sampling.keyed import RowBatch, logprobs, sample
from atlas.sampling.params import SamplingParams


@attrs.define
class _SeqState:
    slot: int
    position: int = 0  # tokens folded into every cursor (KV, QSA keys, GDN, PLE): they move together here
    ple_context: list[int] = attrs.field(factory=list)


# the backend name is what a trace records, so it names the whole mode and a replay rebuilds the same one:
# "cuda" (bf16, fp32 recurrent state), "-fp32" the parity mode, "-invariant" batch-invariant decode
MODES = ("cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant")


def parse_backend(name: str) -> tuple[torch.dtype, bool]:
    """(activation dtype, batch invariant) of a CUDA backend name."""
    if name not in MODES:
        raise ValueError(f"unknown CUDA backend {name!r} ({', '.join(MODES)})")
    return (torch.float32 if "-fp32" in name else torch.bfloat16), name.endswith("-invariant")


def triton_gdn() -> GdnKernel | None:
    """The Triton GDN kernels (decode: recurrent update; prefill: chunked), or None when atlas_kernels is not
    importable. On a CPU they run only under TRITON_INTERPRET=1 (tests)."""
    try:
        from atlas_kernels.gdn_chunk import gdn_chunk_prefill
        from atlas_kernels.gdn_recurrent import gdn_recurrent_gated
    except ImportError:
        return None

    def gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b_raw: torch.Tensor,
            a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, t = q.shape[:2]
        if t == 1:  # g and beta computed in the kernel: no separate elementwise launches per layer
            return gdn_recurrent_gated(q, k, v, a, b_raw, a_log, dt_bias, pool, slots)[0]
        g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
        beta = torch.sigmoid(b_raw).float()
        cu = torch.arange(b + 1, device=q.device, dtype=torch.int32) * t
        out = gdn_chunk_prefill(q.reshape(b * t, *q.shape[2:]), k.reshape(b * t, *k.shape[2:]),
                                v.reshape(b * t, *v.shape[2:]), g.reshape(b * t, -1), beta.reshape(b * t, -1),
                                cu, pool, slots)
        return out.view(b, t, *out.shape[1:])

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
        tuning: Tuning | None = None,
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
        self.weights = prepare_weights(spec, {
            k: t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)
            for k, t in model.weights.items() if not k.startswith("mtp.")})
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        # batch invariance: every decode group padded to the same rows and key blocks, so every GEMM, softmax and
        # kernel sees the same shapes whatever else is in the batch, and a row's bits depend on its own inputs
        # only (a request's tokens alone equal its tokens in any batch). Costs a full batch's work per step.
        self.batch_invariant = batch_invariant
        self.max_blocks_per_seq = max_blocks_per_seq or num_kv_blocks
        # which implementation each part of a step uses (atlas.backends.cuda.tuning); the benchmark times them
        self.tuning = tuning or Tuning()
        self.pools = DevicePools(spec, num_kv_blocks=num_kv_blocks, block_size=block_size, max_seqs=max_batch_size,
                                 scratch_slots=bucket(max_batch_size), dtype=self.dtype, device=self.device)
        use_kernels = self.dtype != torch.float32 if kernels is None else kernels
        self.gdn_kernel = triton_gdn() if use_kernels and self.device.type == "cuda" else None
        if kernels and self.gdn_kernel is None:
            raise ValueError("kernels=True needs a CUDA device and atlas_kernels (the kernels/ package) importable")
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._decode_logits, self.device) if use_graphs else None
        self._seqs: dict[int, _SeqState] = {}
        # the decode group replayed from a graph this step (its shape, its chunk indices): its rows are sampled
        # by the sampler graph on the graph's own logits
        self._replayed: tuple[GroupShape, list[int]] | None = None
        self._ple_tables = ([ngram_tables(spec.ple, spec.vocab_size, r) for r in range(len(spec.ple.layers))]
                            if spec.ple is not None else [])
        self.capabilities = Capabilities(batch_invariant=batch_invariant, fp32_parity=self.dtype == torch.float32)

    @property
    def prefill_moe(self) -> str:
        """MoE of prefill chunks (Tuning.prefill_moe), settable as before."""
        return self.tuning.prefill_moe

    @prefill_moe.setter
    def prefill_moe(self, mode: str) -> None:
        self.tuning = attrs.evolve(self.tuning, prefill_moe=mode)

    @classmethod
    def for_capacities(cls, model: LoadedModel, caps: Capacities, *, dtype: torch.dtype | None = None,
                       **kwargs: object) -> CudaBackend:
        """The backend sized by the engine's capacities."""
        return cls(model, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, dtype=dtype,
                   max_batch_size=caps.max_batch_size, max_blocks_per_seq=caps.kv_blocks_per_seq,
                   **kwargs)  # type: ignore[arg-type]

    @property
    def num_kv_blocks(self) -> int:
        return self.pools.num_kv_blocks

    # -- per-sequence state -------------------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def reset(self, seq_id: int) -> None:
        """Drop a sequence's data-plane state back to empty (its KV blocks are the caller's to reuse)."""
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqState(slot=self.pools.allocate())
        self.pools.clear(state.slot)
        state.position = 0
        state.ple_context = [self.spec.ple.eos_token_id] * self.spec.ple.context_len if self.spec.ple else []

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.pools.free(state.slot)

    def cursors(self, seq_id: int) -> BackendCursors:
        s = self._seqs.get(seq_id)
        p = 0 if s is None else s.position
        return BackendCursors(kv_tokens=p, qsa_ingested=p, ssm_position=p, ple_position=p)

    # the StateStore contract's orders this backend does not declare (Capabilities): never planned for it
    def snapshot(self, order: RingSnapshot) -> None:
        raise RestoreRefused(f"backend {self.name!r} keeps no snapshot ring")

    def restore(self, order: RingRestore) -> BackendCursors:
        raise RestoreRefused(f"backend {self.name!r} keeps no snapshot ring")

    def commit(self, seq_id: int, rows: int) -> BackendCursors:
        raise VerifyRefused(f"backend {self.name!r} verifies no drafts")

    def store_prefix(self, order: PrefixStore) -> None:
        raise RestoreRefused(f"backend {self.name!r} keeps no prefix snapshots")

    def load_prefix(self, order: PrefixRestore) -> None:
        raise RestoreRefused(f"backend {self.name!r} keeps no prefix snapshots")

    def carry(self, order: CarryOrder) -> None:
        if order.drop or order.store >= 0:
            raise RestoreRefused(f"backend {self.name!r} keeps no drafter carry")

    def state_digest(self, seq_id: int, *, drafter: bool = True) -> str:
        raise NotImplementedError("state digests of the CUDA backend")

    # -- groups ---------------------------------------------------------------------------------------

    def _shape(self, batch: int, width: int, end: int) -> GroupShape:
        ple = self.spec.ple
        qsa = self.spec.qsa
        return GroupShape(batch=batch, width=width, key_blocks=-(-end // self.block_size),
                          qsa_select=qsa is not None and end > qsa.inert_bound,
                          ngram_heads=ple.num_heads if ple else 0, ple_layers=len(ple.layers) if ple else 0)

    def _ngram_rows(self, state: _SeqState, tokens: Sequence[int]) -> list[list[int]]:
        """Per PLE layer, the n-gram ids of `tokens` continuing the sequence's context, flattened."""
        ple = self.spec.ple
        if ple is None:
            return []
        history = state.ple_context + list(tokens)
        if len(tokens) == 1:  # decode: plain integers, no tensor round trip (the host side of every step)
            return [_ngram_one(history, ple.ngram_size, ple.heads_per_ngram, ple.eos_token_id, t) for t in self._ple_tables]
        hist = torch.tensor(history, dtype=torch.long)
        return [ngram_ids(hist, len(tokens), ple, t).flatten().tolist() for t in self._ple_tables]

    def _row(self, chunk: ChunkLike) -> Row:
        state = self._seqs[chunk.seq_id]
        return (list(chunk.tokens), chunk.start, state.slot, list(chunk.block_table), self._ngram_rows(state, chunk.tokens))

    def _advance(self, chunk: ChunkLike) -> None:
        state = self._seqs[chunk.seq_id]
        state.position = chunk.start + len(chunk.tokens)
        if self.spec.ple is not None:
            state.ple_context = (state.ple_context + list(chunk.tokens))[-self.spec.ple.context_len :]

    def _run_group(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        grp = Group.view(packed, shape, self.block_size)
        # decode groups take graph-capturable paths; prefill groups run eagerly (tuning.prefill_moe may sync)
        return forward_group(self.spec, self.weights, self.pools, grp, eager_moe=shape.width > 1,
                             gdn_kernel=self.gdn_kernel, tuning=self.tuning,
                             invariant=self.batch_invariant)

    def _decode_logits(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        hidden = self._run_group(packed, shape)
        return hidden[:, -1] @ self.weights["lm_head.weight"].T

    def _padding(self, shape: GroupShape) -> torch.Tensor:
        return pack_rows(shape, [], self.pools.scratch_slots, self.pools.scratch_block)

    # -- compute ------------------------------------------------------------------------------------

    def _check_chunk(self, chunk: ChunkLike) -> None:
        held = self._seqs[chunk.seq_id].position if chunk.seq_id in self._seqs else 0
        check_chunk(chunk, self.spec.vocab_size, held)
        end = chunk.start + len(chunk.tokens)
        needed = -(-end // self.block_size)
        table = chunk.block_table[:needed]
        if len(table) < needed:
            raise ValueError(f"block table has {len(chunk.block_table)} blocks; positions up to {end} need {needed} "
                             f"of block_size {self.block_size}")
        if any(not 0 <= b < self.pools.num_kv_blocks for b in table):
            raise ValueError(f"block table {list(table)} names a block outside [0, {self.pools.num_kv_blocks})")

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

    def _last_logits(self, chunks: Sequence[ChunkLike]) -> dict[int, torch.Tensor]:
        """Feed the chunks; the logits of each one's last fed position, by chunk index ([vocab] each)."""
        out: dict[int, torch.Tensor] = {}
        self._replayed = None
        for idx in self._groups(chunks):
            members = [chunks[i] for i in idx]
            width = len(members[0].tokens)
            shape = self._shape(len(members), width, max(c.start + len(c.tokens) for c in members))
            if width == 1 and self.batch_invariant:
                shape = attrs.evolve(shape, batch=bucket(self.max_batch_size), key_blocks=self.max_blocks_per_seq)
            elif width == 1 and self.graphs is not None:
                shape = attrs.evolve(shape, batch=bucket(len(members)), key_blocks=bucket(shape.key_blocks, 4))
            rows = [self._row(c) for c in members]
            packed = pack_rows(shape, rows, self.pools.scratch_slots, self.pools.scratch_block)
            if width == 1 and self.graphs is not None:
                host = packed.pin_memory() if self.device.type == "cuda" else packed
                logits, _ = self.graphs.replay(shape, host, self._padding(shape))
                self._replayed = (shape, idx)
            else:
                logits = self._decode_logits(packed.to(self.device), shape)
            for c in members:
                self._advance(c)
            for j, i in enumerate(idx):
                out[i] = logits[j]
        return out

    def forward_hidden(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        """Run each chunk (eager, one group each); return its final hidden states [n, H] (the lm_head input)."""
        with self._faults():
            self._prepare(chunks)
            out = []
            for chunk in chunks:
                shape = self._shape(1, len(chunk.tokens), chunk.start + len(chunk.tokens))
                packed = pack_rows(shape, [self._row(chunk)], self.pools.scratch_slots, self.pools.scratch_block)
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
            run_orders(self, plan)
            work = plan.work
            self._prepare(work)
            logits = self._last_logits(work)
            return StepResult(step=plan.step, outcomes=self._sample(work, logits))

    def _sample(self, work: Sequence[SeqWork], logits: dict[int, torch.Tensor]) -> tuple[SeqOutcome, ...]:
        """The keyed sampler (atlas.sampling.keyed) on the device for every sampled row: decode rows replayed
        from a graph through the sampler graph, the rest (prefill ends, banned tokens, eager mode) in one
        batched call; one device->host copy of the tokens, and one of the logprobs when a row asks."""
        sampled = [i for i, w in enumerate(work) if w.sample]
        if not sampled:
            return tuple(SeqOutcome(seq_id=w.seq_id, cursors=self.cursors(w.seq_id)) for w in work)
        pin = self.device.type == "cuda"
        parts: list[torch.Tensor] = []
        order: list[int] = []
        in_graph: dict[int, int] = {}
        if self._replayed is not None and self.graphs is not None:
            shape, idx = self._replayed
            in_graph = {i: j for j, i in enumerate(idx) if work[i].sample and not work[i].banned}
        if in_graph:
            params, positions = [SamplingParams()] * shape.batch, [0] * shape.batch
            for i, j in in_graph.items():
                params[j], positions[j] = work[i].sampling, work[i].end
            parts.append(self.graphs.sample(shape, RowBatch.of(params, positions, pin=pin)))  # type: ignore[union-attr]
            order.extend(-1 for _ in range(shape.batch))  # every graph row comes back; padding is dropped
            for i, j in in_graph.items():
                order[j] = i
        rest = [i for i in sampled if i not in in_graph]
        if rest:
            rows = torch.stack([logits[i] for i in rest])
            banned = None
            if any(work[i].banned for i in rest):  # a rollback's re-steer: these tokens may not be sampled here
                width = max(len(work[i].banned) for i in rest)
                ids = torch.tensor([list(work[i].banned) + [-1] * (width - len(work[i].banned)) for i in rest],
                                   dtype=torch.int64)
                banned = (ids.pin_memory() if pin else ids).to(self.device, non_blocking=pin)
            batch = RowBatch.of([work[i].sampling for i in rest], [work[i].end for i in rest], pin=pin)
            parts.append(sample(rows, batch.to(self.device), banned=banned))
            order.extend(rest)
        chosen = {i: t for i, t in zip(order, torch.cat(parts).tolist(), strict=True) if i >= 0}  # one copy
        asked = [i for i in sampled if work[i].sampling.logprobs]
        lps: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}
        if asked:
            top = max(work[i].sampling.top_logprobs for i in asked)
            lp, values, ids = logprobs(torch.stack([logits[i] for i in asked]),
                                       torch.tensor([chosen[i] for i in asked], device=self.device), top)
            host = torch.cat([lp[:, None], values, ids.to(torch.float64)], dim=1).tolist()  # one copy
            for r, i in enumerate(asked):
                n = work[i].sampling.top_logprobs
                lps[i] = host[r][0], tuple((int(t), v) for t, v in zip(host[r][1 + top : 1 + top + n],
                                                                       host[r][1 : 1 + n], strict=True))
        outcomes = []
        for i, w in enumerate(work):
            logprob, top_lp = lps.get(i, (None, ()))
            outcomes.append(SeqOutcome(seq_id=w.seq_id, cursors=self.cursors(w.seq_id), token=chosen.get(i),
                                       logprob=logprob, top_logprobs=top_lp))
        return tuple(outcomes)

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
