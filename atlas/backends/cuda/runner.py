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
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from atlas.backends.base import (
    Capabilities,
    ChunkLike,
    check_verify,
    run_orders,
    state_audit_default,
)
from atlas.backends.cuda import costs as verify_cost_model
from atlas.backends.cuda import picks
from atlas.backends.cuda.batch import GroupShape
from atlas.backends.cuda.faults import FaultGuard, probe_device
from atlas.backends.cuda.feed import GroupFeed
from atlas.backends.cuda.gdn import triton_gdn
from atlas.backends.cuda.graphs import CommitGraphs, DecodeGraphs, Recurring, bucket
from atlas.backends.cuda.moe import moe_mode_of
from atlas.backends.cuda.ngram import device_ngram_cache
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.seq_state import SeqState
from atlas.backends.cuda.steady import SteadyDecode
from atlas.backends.cuda.store import CudaStateStore
from atlas.backends.cuda.tuning import EAGER, Tuning
from atlas.backends.cuda.verify import VerifyRun, run_verifies
from atlas.backends.cuda.weights import prepare_weights
from atlas.config import Capacities, check_ple_capacities
from atlas.model.loader import LoadedModel
from atlas.model.ngram import NgramTables, ngram_ids, ngram_tables
from atlas.plan import BackendCursors, PromptLogprob, SeqOutcome, SeqWork, StepPlan, StepResult
from atlas.sampling.keyed import RowPacker

# the backend name is what a trace records, so it names the whole mode and a replay rebuilds the same one:
# "cuda" (bf16, fp32 recurrent state), "-fp32" the parity mode, "-invariant" batch-invariant decode
MODES = ("cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant")


def parse_backend(name: str) -> tuple[torch.dtype, bool]:
    """(activation dtype, batch invariant) of a CUDA backend name."""
    if name not in MODES:
        raise ValueError(f"unknown CUDA backend {name!r} ({', '.join(MODES)})")
    return (torch.float32 if "-fp32" in name else torch.bfloat16), name.endswith("-invariant")


class CudaBackend(GroupFeed):
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
        self.commit_graphs = CommitGraphs(self.pools, self.device) if use_graphs else None  # their commits
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
        # the same tables on the device, for a decode group's ids computed there (ple.device_ngram_ids)
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
        """MoE of prefill chunks (moe.moe_mode_of): "grouped" syncs with the host every layer."""
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

    def verify_costs(self, num_drafts: int) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """The draft-count policy's cost model (atlas.backends.cuda.costs: measured on an H100) on a GPU; none on a
        CPU device (nothing was measured there: every verify then takes num_drafts)."""
        if self.device.type != "cuda":
            return ()
        return verify_cost_model.verify_costs(num_drafts, compiled=self.tuning.regions and self.tuning.compile)

    def close(self) -> None:
        """Give the device memory back now (Engine.close): the graphs hold bound methods of this backend (a
        reference cycle), so without this its pools, fused weights and graph pools wait for the cyclic garbage
        collector; a process that builds engines one after another (the benchmarks) runs out of the H200's
        139 GiB at the fourteenth without it."""
        self.graphs = self.verify_graphs = self.prefill_graphs = self.commit_graphs = None
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

    def _ngram_rows(self, state: SeqState, tokens: Sequence[int]) -> list[list[int]]:
        """Per PLE layer, the n-gram ids of `tokens` continuing the sequence's context, flattened: the table rows,
        or with the row cache their slots (this step's fill assigned them)."""
        rows = self._ngram_row_ids(state, tokens)
        if self.ngram_cache is None:
            return rows
        return [self.ngram_cache.slot_ids(p, layer) for p, layer in enumerate(rows)]

    def _ngram_fill(self, fed: Sequence[ChunkLike | SeqWork]) -> None:
        """With the row cache: every n-gram row the step's chunks or work (tokens, then a verify's drafts) feed
        resident before its forward. Without one nothing is built: the general path calls this every step."""
        if self.ngram_cache is None or not fed:
            return
        rows = [(*w.tokens, *getattr(w, "drafts", ())) for w in fed]
        per_seq = [self._ngram_row_ids(self._seqs[w.seq_id], tokens) for w, tokens in zip(fed, rows, strict=True)]
        layers = [np.fromiter((r for seq in per_seq for r in seq[p]), dtype=np.int64)
                  for p in range(len(self._ple_tables))]
        self.ngram_cache.fill(layers, sum(map(len, rows)))

    def _ngram_row_ids(self, state: SeqState, tokens: Sequence[int]) -> list[list[int]]:
        """Per PLE layer, the table rows of `tokens`' n-gram ids continuing the sequence's context, flattened."""
        ple = self.spec.ple
        if ple is None:
            return []
        history = state.ple_context + list(tokens)
        if len(tokens) == 1:  # decode: plain integers, no tensor round trip (the host side of every step)
            return [ngram_one(history, ple.ngram_size, ple.heads_per_ngram, ple.eos_token_id, t) for t in self._ple_tables]
        hist = torch.tensor(history, dtype=torch.long)
        return [ngram_ids(hist, len(tokens), ple, t).flatten().tolist() for t in self._ple_tables]

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
            self._ngram_fill(plain + verifies)
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
            self._ngram_fill([w])
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


def ngram_one(history: list[int], ngram_size: int, heads_per_ngram: int, eos: int, tables: NgramTables) -> list[int]:
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
