"""`CpuBackend`: the reference data plane. Executes step plans over explicit per-sequence state.

It loops over sequences (a batch is a list of chunks), so a sequence's results never depend on what else
is in the batch. It reports its own cursors; it never decides what runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import attrs
import torch

from atlas.backends.base import (
    BackendCursors,
    ChunkLike,
    SeqOutcome,
    SeqWork,
    StepPlan,
    StepResult,
    check_chunk,
)
from atlas.backends.cpu.decoder import forward_chunk
from atlas.backends.cpu.drafter import DrafterState, MtpDrafter
from atlas.backends.cpu.mtp import mtp_forward
from atlas.backends.cpu.prefix_store import PrefixEntry, PrefixStore
from atlas.backends.cpu.ring import RestoreRefused, SnapshotRing
from atlas.backends.cpu.state import KvPool, SequenceState, StateSnapshot
from atlas.backends.cpu.verify import PendingVerify, check_commit, run_verify
from atlas.engine.sampling import SamplingParams, logprobs_of, sample_token
from atlas.engine.speculative import RowVerdict, VerifyRefused, verify_rows
from atlas.model.loader import LoadedModel


@attrs.frozen
class Chunk:
    """Feed `tokens` of sequence `seq_id` at positions [start, start + len(tokens)) through `block_table`."""

    seq_id: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    start: int
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
        verify_crosses_qsa_bound: bool = True,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.dtype = dtype or model.dtype
        self.weights = model.weights
        if self.dtype != model.dtype:
            self.weights = {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in model.weights.items()}
        self.block_size = block_size
        # exact: feed every token on its own, so its bits depend only on the token and its prefix. A GEMM's
        # reduction order, and whether a vectorised transcendental lands in the SIMD body or the scalar
        # tail, both depend on how many rows an op sees (measured: every row of a 1-row vs n-row fp32
        # product differed in the last bit). Token by token, a chunk of 500, a decode and a K-wide verify
        # give identical bits, which is what lets commit and rollback be checked bitwise. exact=False
        # runs whole chunks (faster, agrees to ~1e-6).
        self.exact = exact
        self.kv = KvPool(self.spec, num_kv_blocks, block_size, self.dtype)
        self._seqs: dict[int, SequenceState] = {}
        self.ring = SnapshotRing(ring_slots)  # boundary snapshots for rollback (atlas.backends.cpu.ring)
        # speculative decoding: per-token intermediates for verifies up to `verify_width` rows (Capacities),
        # the MTP drafter's rows, and the capability flag the engine's QSA latch reads. Verify rows run one
        # at a time with their own QSA selection, so crossing the inert bound is exact here; the flag is a
        # constructor argument only so tests can exercise the latch.
        self.verify_width = verify_width
        self.verify_crosses_qsa_bound = verify_crosses_qsa_bound
        self.drafter = MtpDrafter(self.spec, self.weights, self.dtype, exact) if mtp_drafter else None
        self._drafts: dict[int, DrafterState] = {}
        self._pending: dict[int, PendingVerify] = {}
        # prefix caching: snapshots by prefix key and the drafter carry (atlas.backends.cpu.prefix_store), and
        # each sequence's last block table (a snapshot copies the KV rows of the block it ends in)
        self.prefix = PrefixStore()
        self._tables: dict[int, tuple[int, ...]] = {}
        # prompt logprobs: the last fed row's logits of a sequence whose prompt continues in the next chunk
        # (they score that chunk's first token)
        self._prompt_tail: dict[int, torch.Tensor] = {}
        self._prompt_scored: set[int] = set()  # sequences whose prompt is scored (its last chunk sampled)

    # -- per-sequence state -------------------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def reset(self, seq_id: int) -> None:
        """Drop a sequence's data-plane state back to empty (its KV blocks are the caller's to reuse)."""
        self._seqs[seq_id] = SequenceState.empty(self.spec, self.dtype)
        self.ring.release(seq_id)
        self._pending.pop(seq_id, None)
        self._prompt_tail.pop(seq_id, None)
        self._prompt_scored.discard(seq_id)
        if self.drafter is not None:
            self._drafts[seq_id] = self.drafter.empty()

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.ring.release(seq_id)
        self._pending.pop(seq_id, None)
        self._drafts.pop(seq_id, None)
        self._tables.pop(seq_id, None)
        self._prompt_tail.pop(seq_id, None)
        self._prompt_scored.discard(seq_id)

    # -- prefix caching -----------------------------------------------------------------------------

    def store_prefix(self, seq_id: int, position: int, key: int, evicted: int) -> None:
        """Store the sequence's state at `position` (its current one) as prefix snapshot `key`."""
        s = self._seqs.get(seq_id)
        if s is None or s.kv_tokens != position or seq_id in self._pending:
            raise RestoreRefused(f"sequence {seq_id}: a prefix snapshot at {position} needs the sequence at exactly "
                                 f"that position, committed (holds {None if s is None else s.kv_tokens})")
        bs = self.block_size
        tail_keys: dict[int, torch.Tensor] = {}
        tail_values: dict[int, torch.Tensor] = {}
        if position % bs:
            slots = self.kv.slots(self._tables[seq_id], position - position % bs, position)
            for layer in self.kv.keys:
                k, v = self.kv.read(layer, slots)
                tail_keys[layer], tail_values[layer] = k.clone(), v.clone()
        d = self._drafts.get(seq_id)
        hidden = d.target_hidden[position - 1] if d is not None else None
        entry = PrefixEntry(self.snapshot(seq_id), {layer: keys[:position].clone() for layer, keys in s.qsa_keys.items()},
                            tail_keys, tail_values, hidden)
        self.prefix.store(key, entry, evicted)

    def restore_prefix(self, seq_id: int, key: int, position: int, block_table: tuple[int, ...], drafter_first_key: int,
                       drafter_last_key: int, adopt: bool) -> None:
        """Start the sequence at `position` from prefix snapshot `key`: the shared blocks of `block_table` hold
        the KV of the full blocks already; the snapshot's tail rows go into the block `position` ends in."""
        entry = self.prefix.get(key, position)
        if adopt and (self.prefix.carry is None or self.drafter is None):
            raise RestoreRefused(f"sequence {seq_id}: adoption of a drafter carry this backend does not hold")
        snap = entry.state
        self._seqs[seq_id] = SequenceState(
            kv_tokens=position, ssm_position=position, ple_position=position,
            qsa_keys={layer: keys.clone() for layer, keys in entry.qsa_keys.items()},
            gdn_conv=copy.deepcopy(snap.gdn_conv), gdn_recurrent=copy.deepcopy(snap.gdn_recurrent),
            ple_context=None if snap.ple_context is None else snap.ple_context.clone(),
            ple_conv=copy.deepcopy(snap.ple_conv),
        )
        if entry.tail_keys:
            slots = self.kv.slots(block_table, position - position % self.block_size, position)
            for layer in self.kv.keys:
                self.kv.write(layer, slots, entry.tail_keys[layer], entry.tail_values[layer])
        self._tables[seq_id] = block_table
        self.ring.release(seq_id)
        self._pending.pop(seq_id, None)
        if self.drafter is not None:
            if adopt:
                self._drafts[seq_id] = self.drafter.adopt(self.prefix.carry, drafter_last_key, position,  # type: ignore[arg-type]
                                                          entry.last_hidden)
                self.prefix.carry = None
            else:
                self._drafts[seq_id] = self.drafter.resumed(drafter_first_key, position, entry.last_hidden)

    def _apply_prefix_orders(self, plan: StepPlan) -> None:
        """Stores (before anything moves), the carry, the releases, then the restores."""
        for seq_id, position, key, evicted in plan.prefix_stores:
            self.store_prefix(seq_id, position, key, evicted)
        if plan.carry_drop:
            self.prefix.carry = None
        if plan.carry_store >= 0:
            self.prefix.carry = self._drafts.get(plan.carry_store)
        for seq_id in plan.release:
            self.release(seq_id)
        for seq_id, key, position, table, first_key, last_key, adopt in plan.prefix_restores:
            self.restore_prefix(seq_id, key, position, tuple(table), first_key, last_key, adopt)

    def cursors(self, seq_id: int) -> BackendCursors:
        s = self._seqs.get(seq_id)
        if s is None:
            return BackendCursors(kv_tokens=0, qsa_ingested=0, ssm_position=0, ple_position=0)
        d = self._drafts.get(seq_id)
        return BackendCursors(
            kv_tokens=s.kv_tokens, qsa_ingested=s.qsa_ingested, ssm_position=s.ssm_position, ple_position=s.ple_position,
            drafter_rows=0 if d is None else d.rows,
        )

    def snapshot(self, seq_id: int) -> StateSnapshot:
        """Deep copy of the sequence's non-KV state at its current position."""
        s = self._seqs[seq_id]
        return StateSnapshot(
            position=s.kv_tokens,
            gdn_conv=copy.deepcopy(s.gdn_conv),
            gdn_recurrent=copy.deepcopy(s.gdn_recurrent),
            ple_context=None if s.ple_context is None else s.ple_context.clone(),
            ple_conv=copy.deepcopy(s.ple_conv),
        )

    def restore(self, seq_id: int, snap: StateSnapshot) -> None:
        """Rewind the sequence to `snap.position`: every cursor moves together, or nothing changes."""
        s = self._seqs[seq_id]
        if snap.position > s.kv_tokens:
            raise ValueError(f"cannot restore to position {snap.position}: sequence {seq_id} holds {s.kv_tokens}")
        self._seqs[seq_id] = SequenceState(
            kv_tokens=snap.position,
            ssm_position=snap.position,
            ple_position=snap.position,
            qsa_keys={layer: keys[: snap.position].clone() for layer, keys in s.qsa_keys.items()},
            gdn_conv=copy.deepcopy(snap.gdn_conv),
            gdn_recurrent=copy.deepcopy(snap.gdn_recurrent),
            ple_context=None if snap.ple_context is None else snap.ple_context.clone(),
            ple_conv=copy.deepcopy(snap.ple_conv),
        )
        self._pending.pop(seq_id, None)
        if seq_id in self._drafts:  # drafter rows rewind with every other cursor
            self.drafter.rewind(self._drafts[seq_id], snap.position)  # type: ignore[union-attr]

    def restore_boundary(self, seq_id: int, slot: int, position: int) -> BackendCursors:
        """Rollback: rewind the sequence to the snapshot at `position` in ring `slot` and forget the snapshots
        past it. Every precondition is checked before anything moves (RestoreRefused)."""
        if seq_id not in self._seqs:
            raise RestoreRefused(f"sequence {seq_id} is not held by this backend")
        snap = self.ring.get(seq_id, slot, position)
        if position > self._seqs[seq_id].kv_tokens:
            raise RestoreRefused(f"sequence {seq_id}: snapshot at {position} is past the {self._seqs[seq_id].kv_tokens} "
                                 "tokens held")
        self.restore(seq_id, snap)
        self.ring.truncate_after(seq_id, position)
        return self.cursors(seq_id)

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
        out = []
        for chunk in chunks:
            if chunk.start == 0:
                self.reset(chunk.seq_id)
                if chunk.seq_id in self._drafts:
                    self._drafts[chunk.seq_id].first_key = getattr(chunk, "drafter_first_key", 0)
            self._tables[chunk.seq_id] = tuple(chunk.block_table)
            tokens = torch.tensor(chunk.tokens, dtype=torch.long)
            table = tuple(chunk.block_table)
            state = self._seqs[chunk.seq_id]
            if self.exact:
                rows = []
                for i in range(len(tokens)):
                    row, state = forward_chunk(
                        self.spec, self.weights, self.kv, state, tokens[i : i + 1], chunk.start + i, table
                    )
                    rows.append(row)
                hidden = torch.cat(rows)
            else:
                hidden, state = forward_chunk(self.spec, self.weights, self.kv, state, tokens, chunk.start, table)
            self._seqs[chunk.seq_id] = state
            self._pending.pop(chunk.seq_id, None)
            if chunk.seq_id in self._drafts:
                self.drafter.append(self._drafts[chunk.seq_id], chunk.start, chunk.tokens, hidden)  # type: ignore[union-attr]
            out.append(hidden)
        return out

    def _check_chunk(self, chunk: ChunkLike) -> None:
        held = self._seqs[chunk.seq_id].kv_tokens if chunk.seq_id in self._seqs else 0
        check_chunk(chunk, self.spec.vocab_size, held)
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

    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_prefix_orders(plan)
        for seq_id in plan.reset:
            self.reset(seq_id)
        ends = {w.seq_id: w.end for w in plan.work}
        for seq_id, position, slot in plan.snapshots:  # refuse a bad order before any sequence moves
            self.ring.check_store(seq_id, slot)
            if ends.get(seq_id) != position:
                raise ValueError(f"sequence {seq_id}: snapshot at {position} is not where its work ends "
                                 f"({ends.get(seq_id)})")
        plain = [w for w in plan.work if not w.drafts]
        verifies = [w for w in plan.work if w.drafts]
        for work in verifies:  # refuse a bad batch before any sequence moves
            self._check_verify(work)
        hidden = dict(zip((w.seq_id for w in plain), self.forward_hidden(plain), strict=True))
        verdicts = {w.seq_id: self._verify(w) for w in verifies}
        outcomes = []
        for work in plan.work:
            if work.drafts:
                outcomes.append(SeqOutcome(seq_id=work.seq_id, cursors=self.cursors(work.seq_id),
                                           verdicts=verdicts[work.seq_id]))
                continue
            token = logprob = None
            top: tuple[tuple[int, float], ...] = ()
            if work.sample:
                row = self.logits_from_hidden(hidden[work.seq_id][-1])
                pick = row
                if work.banned:  # a rollback's re-steer: these tokens may not be sampled here
                    pick = row.clone()
                    pick[list(work.banned)] = float("-inf")
                token = sample_token(pick, work.sampling, position=work.end)
                if work.sampling.logprobs:
                    logprob, top = logprobs_of(row, token, work.sampling.top_logprobs)
            prompt_lp = ()
            if work.sampling.prompt_logprobs is not None and work.seq_id not in self._prompt_scored:
                prompt_lp = self._prompt_logprobs(work, hidden[work.seq_id])
            outcomes.append(
                SeqOutcome(seq_id=work.seq_id, cursors=self.cursors(work.seq_id), token=token, logprob=logprob,
                           top_logprobs=top, prompt_logprobs=prompt_lp)
            )
        for seq_id, _position, slot in plan.snapshots:
            self.ring.store(seq_id, slot, self.snapshot(seq_id))
        return StepResult(step=plan.step, outcomes=tuple(outcomes))

    def _prompt_logprobs(self, work: SeqWork, hidden: torch.Tensor
                         ) -> tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...]:
        """Each fed prompt token's logprob under the logits of the position before it (this chunk's rows, or
        the previous chunk's last row), from the hidden states the prefill just computed."""
        rows = self.logits_from_hidden(hidden)
        n = work.sampling.prompt_logprobs or 0
        out = []
        for i, token in enumerate(work.tokens):
            position = work.start + i
            if position == 0:
                out.append((0, None, ()))
                continue
            before = rows[i - 1] if i else self._prompt_tail.pop(work.seq_id, None)
            if before is None:
                raise ValueError(f"sequence {work.seq_id}: prompt logprobs at {position} need the logits of "
                                 f"position {position - 1}, which no chunk of this request computed")
            lp, alts = logprobs_of(before, token, n)
            out.append((position, lp, alts))
        if work.sample:  # the prompt's last chunk: what follows is generated, not scored
            self._prompt_scored.add(work.seq_id)
        else:  # the prompt goes on: its next token is scored by this chunk's last row
            self._prompt_tail[work.seq_id] = rows[-1]
        return tuple(out)

    # -- speculative decoding -----------------------------------------------------------------------

    def _check_verify(self, work: SeqWork) -> None:
        k = len(work.tokens) + len(work.drafts)
        if len(work.tokens) != 1 or not work.sample:
            raise ValueError(f"sequence {work.seq_id}: a verify feeds exactly the last sampled token and its drafts")
        if k > self.verify_width:
            raise ValueError(f"sequence {work.seq_id}: verify of width {k} exceeds the {self.verify_width} per-token "
                             f"intermediates this backend holds (Capacities.verify_width)")
        if work.seq_id not in self._seqs or self._seqs[work.seq_id].kv_tokens != work.start:
            raise ValueError(f"sequence {work.seq_id}: verify at {work.start} but the backend holds "
                             f"{self._seqs[work.seq_id].kv_tokens if work.seq_id in self._seqs else 0} tokens")
        self._check_chunk(Chunk(work.seq_id, work.tokens + work.drafts, work.start, work.block_table))

    def _verify(self, work: SeqWork) -> tuple[RowVerdict, ...]:
        tokens = work.tokens + work.drafts
        pending = run_verify(self.spec, self.weights, self.kv, self._seqs[work.seq_id], tokens, work.start,
                             tuple(work.block_table))
        self._pending[work.seq_id] = pending
        self._tables[work.seq_id] = tuple(work.block_table)
        logits = self.logits_from_hidden(pending.hidden)
        proposals = None
        d = self._drafts.get(work.seq_id)
        if d is not None and d.proposal is not None and d.proposal.position == work.start:
            # the drafter's own q for the drafts it proposed: rejection sampling against q keeps p exact
            if d.proposal.drafts[: len(work.drafts)] == work.drafts:
                proposals = d.proposal.q[: len(work.drafts)]
        return verify_rows(logits, work.drafts, work.sampling, work.start, proposals)

    def commit_verify(self, seq_id: int, rows: int) -> BackendCursors:
        """Keep the first `rows` rows of the pending verify (see atlas.backends.cpu.verify): validated against
        every layer first; a refused commit raises VerifyRefused and changes nothing."""
        pending = self._pending.get(seq_id)
        if pending is None or seq_id not in self._seqs:
            raise VerifyRefused(f"sequence {seq_id} has no pending verify to commit")
        check_commit(self.spec, self._seqs[seq_id], pending, rows, self.verify_width)
        del self._pending[seq_id]
        self._seqs[seq_id] = pending.states[rows - 1]
        if seq_id in self._drafts:
            self.drafter.append(self._drafts[seq_id], pending.start, pending.tokens[:rows],  # type: ignore[union-attr]
                                pending.hidden[:rows])
        return self.cursors(seq_id)

    def propose_drafts(self, seq_id: int, next_token: int, k: int, params: SamplingParams) -> tuple[int, ...]:
        if self.drafter is None or seq_id not in self._drafts:
            raise ValueError(f"sequence {seq_id}: this backend runs no MTP drafter (mtp_drafter=False)")
        return self.drafter.propose(self._drafts[seq_id], next_token, k, params)
