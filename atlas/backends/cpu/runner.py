"""`CpuBackend`: the reference data plane. Executes step plans over explicit per-sequence state.

It loops over sequences (a batch is a list of chunks), so a sequence's results never depend on what else
is in the batch. It reports its own cursors; it never decides what runs. Per-sequence state is its
`CpuStateStore` (atlas.backends.cpu.store), the StateStore contract's reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from atlas_kernels.rows import RowOffset

from atlas.backends.base import (
    Capabilities,
    ChunkLike,
    check_chunk,
    check_dense_verify,
    check_verify,
    run_orders,
    state_audit_default,
)
from atlas.backends.cpu.costs import STEP_COSTS
from atlas.backends.cpu.decoder import forward_chunk
from atlas.backends.cpu.drafter import MtpDrafter
from atlas.backends.cpu.mtp import mtp_forward
from atlas.backends.cpu.state import KvPool
from atlas.backends.cpu.store import CpuStateStore
from atlas.backends.cpu.verify import run_verify
from atlas.backends.cpu.weights import join_weights
from atlas.config import Capacities, check_ple_capacities
from atlas.errors import VerifyRefused
from atlas.model.loader import LoadedModel
from atlas.model.ngram_cache import cached_tables
from atlas.plan import BackendCursors, PromptLogprob, RowVerdict, SeqOutcome, SeqWork, StepPlan, StepResult
from atlas.sampling.acceptance import accepted_prefix
from atlas.sampling.keyed import logprobs_of, sample_token
from atlas.sampling.verdicts import verify_rows


@attrs.frozen
class Chunk:
    """Feed `tokens` of sequence `seq_id` at positions [start, start + len(tokens)) through `block_table`."""

    seq_id: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    start: RowOffset = attrs.field(converter=RowOffset)
    block_table: tuple[int, ...] = attrs.field(converter=tuple)


class CpuBackend:
    name = "cpu"

    def __init__(
        self,
        model: LoadedModel,
        *,
        num_kv_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        exact: bool = True,
        ring_slots: int = 0,
        verify_width: int = 1,
        mtp_drafter: bool = False,
        per_row_qsa_verify: bool = True,
        snapshot_bytes: int = 0,
        state_audit: bool | None = None,
        ngram_cache_slots: int = 0,
        ple_scratch_rows: int = 0,
        ngram_budget: int | str | None = None,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.dtype = dtype or model.dtype
        self.weights = model.weights
        if self.dtype != model.dtype:
            self.weights = {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in model.weights.items()}
        self.weights = join_weights(self.spec, self.weights)  # products sharing an input as one (bitwise alike)
        # n-gram tables over the budget (or left in the checkpoint by the loader) read through row caches
        self.ngram_caches = cached_tables(model, self.dtype, ngram_cache_slots, ple_scratch_rows, ngram_budget)
        if self.ngram_caches:
            self.weights = {**self.weights, **self.ngram_caches}
        self.block_size = block_size
        # exact: feed every token on its own, so its bits depend only on the token and its prefix. A GEMM's
        # reduction order, and whether a vectorised transcendental lands in the SIMD body or the scalar
        # tail, both depend on how many rows an op sees (measured: every row of a 1-row vs n-row fp32
        # product differed in the last bit). Token by token, a chunk of 500, a decode and a K-wide verify
        # give identical bits, which is what lets commit and rollback be checked bitwise. exact=False
        # runs whole chunks (faster, agrees to ~1e-6).
        self.exact = exact
        self.kv = KvPool(self.spec, num_kv_blocks, block_size, self.dtype)
        has_mtp = any(k.startswith("mtp.") for k in self.weights)
        self.drafter = MtpDrafter(self.spec, self.weights, self.dtype, exact) if mtp_drafter and has_mtp else None
        if mtp_drafter and not has_mtp:
            raise ValueError(f"mtp_drafter=True but model {model.name!r} has no mtp.* weights (use the n-gram drafter)")
        self.store = CpuStateStore(self.spec, self.kv, self.dtype, ring_slots=ring_slots, verify_width=verify_width,
                                   drafter=self.drafter, slot_bytes=snapshot_bytes,
                                   audit=state_audit_default() if state_audit is None else state_audit)
        # Verify rows run one at a time with their own QSA selection, so crossing the inert bound is exact here.
        # per_row_qsa_verify=False (a backend option: build_engine(..., backend_options=...), the cpu-row-blind
        # scenario) serves as a backend whose verify cannot select per row: it refuses a verify whose rows pass
        # the inert bound (check_dense_verify), and the engine's lane must latch speculation off before one does.
        self._dense_verify_bound = (None if per_row_qsa_verify or self.spec.qsa is None
                                    else self.spec.qsa.inert_bound)
        self.capabilities = Capabilities(
            verify=True, per_row_qsa_verify=per_row_qsa_verify, mtp_drafting=self.drafter is not None,
            snapshot_ring=ring_slots > 0, prefix_snapshots=True, batch_invariant=True, fp32_parity=True,
            max_verify_width=verify_width, prompt_logprobs=True)

    @classmethod
    def for_capacities(cls, model: LoadedModel, caps: Capacities, *, dtype: torch.dtype | None = None,
                       **kwargs: object) -> CpuBackend:
        """The backend sized by the engine's capacities: KV blocks, ring slots, verify width, the drafter, the PLE
        scratch and n-gram row cache (their floors checked here)."""
        check_ple_capacities(caps)
        return cls(model, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, dtype=dtype,
                   ring_slots=caps.ring_slots, verify_width=caps.verify_width, mtp_drafter=caps.drafter_rows > 0,
                   snapshot_bytes=caps.ring_slot_bytes, ngram_cache_slots=caps.ngram_cache_slots,
                   ple_scratch_rows=caps.ple_scratch_rows, **kwargs)  # type: ignore[arg-type]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    # -- per-sequence state (the store) --------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.store.seqs

    def reset(self, seq_id: int) -> None:
        self.store.reset(seq_id)

    def release(self, seq_id: int) -> None:
        self.store.release(seq_id)

    def cursors(self, seq_id: int) -> BackendCursors:
        return self.store.cursors(seq_id)

    # -- compute ------------------------------------------------------------------------------------

    def forward_hidden(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        """Run each chunk; return the final hidden states (the lm_head input) [n, H] per chunk.

        A chunk at start 0 begins its sequence afresh; any other start must equal the sequence's cursor.
        """
        seq_ids = [c.seq_id for c in chunks]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a step feeds each sequence at most once, got sequence ids {seq_ids}")
        for chunk in chunks:  # refuse a bad batch before any sequence moves
            self._check_chunk(chunk)
        store = self.store
        out = []
        for chunk in chunks:
            if chunk.start == 0:
                store.reset(chunk.seq_id)
                if chunk.seq_id in store.drafts:
                    store.drafts[chunk.seq_id].first_key = getattr(chunk, "drafter_first_key", 0)
            table = tuple(chunk.block_table)
            store.tables[chunk.seq_id] = table
            tokens = torch.tensor(chunk.tokens, dtype=torch.long)
            state = store.seqs[chunk.seq_id]
            if self.exact:
                rows = []
                for i in range(len(tokens)):
                    row, state = forward_chunk(self.spec, self.weights, self.kv, state, tokens[i : i + 1],
                                               chunk.start + i, table)
                    rows.append(row)
                hidden = torch.cat(rows)
            else:
                hidden, state = forward_chunk(self.spec, self.weights, self.kv, state, tokens, chunk.start, table)
            store.seqs[chunk.seq_id] = state
            store.pending.pop(chunk.seq_id, None)
            if chunk.seq_id in store.drafts:
                self.drafter.append(store.drafts[chunk.seq_id], chunk.start, chunk.tokens, hidden)  # type: ignore[union-attr]
            out.append(hidden)
        return out

    def _check_chunk(self, chunk: ChunkLike) -> None:
        check_chunk(chunk, self.spec.vocab_size, self.store.held(chunk.seq_id))
        self.kv.slots(tuple(chunk.block_table), chunk.start, chunk.start + len(chunk.tokens))  # raises if short

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.weights["lm_head.weight"]
        if self.exact and hidden.dim() == 2:  # one row at a time, for the same reason as forward_hidden
            return torch.cat([row @ head.T for row in hidden.split(1)])
        return hidden @ head.T

    def forward(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        """Run each chunk; return its logits [n, vocab] for every fed position."""
        return [self.logits_from_hidden(h) for h in self.forward_hidden(chunks)]

    def mtp_forward(
        self, hidden: torch.Tensor, next_tokens: Sequence[int], first_key: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference MTP drafter over pair keys first_key.. (see atlas.backends.cpu.mtp): (logits, hidden)."""
        return mtp_forward(self.spec, self.weights, hidden, torch.tensor(list(next_tokens), dtype=torch.long), first_key)

    def verify_costs(self, num_drafts: int) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """The cost model the draft-count policy starts from: STEP_COSTS (deterministic, so two runs of one
        config choose alike), cut to num_drafts."""
        return ((1, STEP_COSTS[:num_drafts]),)

    def execute(self, plan: StepPlan) -> StepResult:
        done = run_orders(self.store, plan)
        ends = {w.seq_id: w.end for w in plan.work}
        for s in plan.snapshots:  # refuse a bad order before any sequence moves
            self.store.ring.check_store(s.seq_id, s.slot)
            if ends.get(s.seq_id) != s.position:
                raise ValueError(f"sequence {s.seq_id}: snapshot at {s.position} is not where its work ends "
                                 f"({ends.get(s.seq_id)})")
        work = [w for w in plan.work if w.seq_id not in done.refused]
        plain = [w for w in work if not w.drafts]
        verifies = [w for w in work if w.drafts]
        for w in verifies:  # refuse a bad batch before any sequence moves
            self._check_verify(w)
        hidden = dict(zip((w.seq_id for w in plain), self.forward_hidden(plain), strict=True))
        outcomes = []
        for w in plan.work:
            if w.seq_id in done.refused:
                outcomes.append(SeqOutcome(w.seq_id, self.cursors(w.seq_id), accepted=-1,
                                           refused=done.refused[w.seq_id]))
            elif w.drafts:
                outcomes.append(self._verify(w))
            else:
                outcomes.append(self._sampled(w, hidden[w.seq_id]))
        for s in plan.snapshots:
            self.store.snapshot(s)
        in_work = set(ends)
        return StepResult(plan.step, tuple(outcomes),
                          touched=tuple((s, c) for s, c in done.restored.items() if s not in in_work),
                          refused=tuple((s, why) for s, why in done.refused.items() if s not in in_work))

    def _sampled(self, w: SeqWork, hidden: torch.Tensor) -> SeqOutcome:
        scored = self._prompt_logprobs(w, hidden) if w.prompt_logprobs is not None else ()
        token = logprob = None
        top: tuple[tuple[int, float], ...] = ()
        drafts: tuple[int, ...] = ()
        if w.sample:
            row = self.logits_from_hidden(hidden[-1])
            pick = row
            if w.banned:  # a rollback's re-steer: these tokens may not be sampled here
                pick = row.clone()
                pick[list(w.banned)] = float("-inf")
            # the history feeds the repetition, frequency and presence penalties (SeqWork.history)
            token = sample_token(pick, w.sampling, position=w.end, history=w.history, prompt_len=w.prompt_len)
            if w.sampling.logprobs:
                logprob, top = logprobs_of(row, token, w.sampling.top_logprobs)
            drafts = self._propose(w, token)
        return SeqOutcome(w.seq_id, self.cursors(w.seq_id), token=token, logprob=logprob, top_logprobs=top,
                          drafts=drafts, prompt_logprobs=scored)

    def _prompt_logprobs(self, w: SeqWork, hidden: torch.Tensor) -> tuple[PromptLogprob, ...]:
        """Each fed prompt token's logprob under the logits of the position before it (this chunk's rows, or the
        previous chunk's last row), from the hidden states this same exact forward computed."""
        rows = self.logits_from_hidden(hidden)
        tails = self.store.prompt_tail
        out: list[PromptLogprob] = []
        for i, token in enumerate(w.tokens):
            position = w.start + i
            if position == 0:
                out.append((0, None, ()))
                continue
            before = rows[i - 1] if i else tails.pop(w.seq_id, None)
            if before is None:
                raise ValueError(f"sequence {w.seq_id}: prompt logprobs at {position} need the logits of position "
                                 f"{position - 1}, which no chunk of this request computed")
            lp, alts = logprobs_of(before, token, w.prompt_logprobs or 0)
            out.append((position, lp, alts))
        if not w.sample:  # the prompt goes on: its next token is scored by this chunk's last row
            tails[w.seq_id] = rows[-1]
        return tuple(out)

    def _propose(self, w: SeqWork, token: int) -> tuple[int, ...]:
        d = self.store.drafts.get(w.seq_id)
        if not w.propose or d is None or self.drafter is None:
            return ()
        return self.drafter.propose(d, token, w.propose, w.sampling)

    # -- speculative decoding -----------------------------------------------------------------------

    def _check_verify(self, work: SeqWork) -> None:
        check_verify(work, self.store.verify_width, self.store.held(work.seq_id), work.seq_id in self.store.seqs)
        check_dense_verify(work, self._dense_verify_bound)
        self._check_chunk(Chunk(work.seq_id, work.tokens + work.drafts, work.start, work.block_table))

    def _verify(self, w: SeqWork) -> SeqOutcome:
        """Feed the K rows, judge them with the shared verdict functions, commit the accepted prefix, draft."""
        store = self.store
        verdicts = self.verify(w)
        try:
            n = accepted_prefix(verdicts, w.drafts, self.spec.vocab_size)
            if w.propose and self.drafter is not None and w.seq_id in store.drafts:
                store.draft_after(w.seq_id, verdicts[n].token)
            cursors = store.commit(w.seq_id, n + 1)
        except VerifyRefused as exc:
            store.pending.pop(w.seq_id, None)
            return SeqOutcome(w.seq_id, self.cursors(w.seq_id), verdicts=verdicts, accepted=-1, refused=str(exc))
        token = verdicts[n].token
        return SeqOutcome(w.seq_id, cursors, token=token, logprob=verdicts[n].logprob,
                          top_logprobs=verdicts[n].top_logprobs, verdicts=verdicts, accepted=n,
                          drafts=self._propose(w, token))

    def verify(self, w: SeqWork) -> tuple[RowVerdict, ...]:
        """Feed a verify's K rows and judge them; the per-row states wait in the store for `commit`."""
        store = self.store
        tokens = w.tokens + w.drafts
        pending = run_verify(self.spec, self.weights, self.kv, store.seqs[w.seq_id], tokens, w.start,
                             tuple(w.block_table))
        store.record_verify(w.seq_id, pending)
        store.tables[w.seq_id] = tuple(w.block_table)
        logits = self.logits_from_hidden(pending.hidden)
        proposals = None
        d = store.drafts.get(w.seq_id)
        if d is not None and d.proposal is not None and d.proposal.position == w.start:
            # the drafter's own q for the drafts it proposed: rejection sampling against q keeps p exact
            if d.proposal.drafts[: len(w.drafts)] == w.drafts:
                proposals = d.proposal.q[: len(w.drafts)]
        return verify_rows(logits, w.drafts, w.sampling, w.start, proposals)
