"""`CpuBackend`: the reference data plane. Executes step plans over explicit per-sequence state.

It loops over sequences (a batch is a list of chunks), so a sequence's results never depend on what else
is in the batch. It reports its own cursors; it never decides what runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from atlas.backends.base import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.backends.cpu.decoder import forward_chunk
from atlas.backends.cpu.mtp import mtp_forward
from atlas.backends.cpu.state import KvPool, SequenceState, StateSnapshot
from atlas.engine.sampling import logprobs_of, sample_token
from atlas.model.loader import LoadedModel


class ChunkLike(Protocol):
    seq_id: int
    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]


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

    # -- per-sequence state -------------------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def reset(self, seq_id: int) -> None:
        """Drop a sequence's data-plane state back to empty (its KV blocks are the caller's to reuse)."""
        self._seqs[seq_id] = SequenceState.empty(self.spec, self.dtype)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def cursors(self, seq_id: int) -> BackendCursors:
        s = self._seqs.get(seq_id)
        if s is None:
            return BackendCursors(kv_tokens=0, qsa_ingested=0, ssm_position=0, ple_position=0)
        return BackendCursors(
            kv_tokens=s.kv_tokens, qsa_ingested=s.qsa_ingested, ssm_position=s.ssm_position, ple_position=s.ple_position
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
            out.append(hidden)
        return out

    def _check_chunk(self, chunk: ChunkLike) -> None:
        if not chunk.tokens:
            raise ValueError(f"sequence {chunk.seq_id}: empty chunk at position {chunk.start}")
        vocab = self.spec.vocab_size
        bad = [t for t in chunk.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sequence {chunk.seq_id}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        held = self._seqs[chunk.seq_id].kv_tokens if chunk.seq_id in self._seqs else 0
        if chunk.start != 0 and chunk.start != held:
            raise ValueError(f"sequence {chunk.seq_id}: chunk starts at {chunk.start} but the backend holds {held} tokens")
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
        for seq_id in plan.release:
            self.release(seq_id)
        for seq_id in plan.reset:
            self.reset(seq_id)
        hidden = self.forward_hidden(plan.work)
        outcomes = []
        for work, h in zip(plan.work, hidden, strict=True):
            token = logprob = None
            top: tuple[tuple[int, float], ...] = ()
            if work.sample:
                row = self.logits_from_hidden(h[-1])
                token = sample_token(row, work.sampling, position=work.end)
                if work.sampling.logprobs:
                    logprob, top = logprobs_of(row, token, work.sampling.top_logprobs)
            outcomes.append(
                SeqOutcome(seq_id=work.seq_id, cursors=self.cursors(work.seq_id), token=token, logprob=logprob,
                           top_logprobs=top)
            )
        return StepResult(step=plan.step, outcomes=tuple(outcomes))
