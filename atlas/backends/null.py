"""NullBackend: the Backend protocol without tensors, for the control-plane tests and benchmark.

The next token is a deterministic function of every token the sequence has been fed (a rolling hash) and,
when sampling is not greedy, of (seed, position): exactly the dependencies a real model + keyed sampler
has, so batch-, chunk- and preemption-invariance can be tested without a model. Its cursors are honest:
it counts what it was actually fed, so a control-plane bug shows up as a cursor desync.
"""

from __future__ import annotations

import attrs

from atlas.backends.base import BackendCursors, SeqOutcome, StepPlan, StepResult

_MASK = (1 << 64) - 1
BYTE_VOCAB = 256


class ByteTokenizer:
    """Bytes are tokens 0..255; 256 is EOS. The null backend's tokenizer (and a fallback for tests)."""

    eos_token_id = BYTE_VOCAB
    eos_token_ids: tuple[int, ...] = (BYTE_VOCAB,)
    vocab_size = BYTE_VOCAB + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        try:
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:  # EOS (256) or an id outside the bytes: drop it
            return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def _mix(h: int) -> int:
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


@attrs.define
class _SeqData:
    fed: int = 0
    rolling: int = 0


class NullBackend:
    name = "null"

    def __init__(self, vocab_size: int = ByteTokenizer.vocab_size, eos_token_id: int | None = BYTE_VOCAB,
                 eos_rate: int = 0) -> None:
        """`eos_rate` = n makes EOS the next token about once in n picks (0: whatever the hash gives)."""
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_rate = eos_rate
        self._seqs: dict[int, _SeqData] = {}
        self._ring: dict[int, dict[int, _SeqData]] = {}  # seq_id -> ring slot -> boundary snapshot

    def _pick(self, data: _SeqData, seed: int | None, position: int) -> int:
        h = _mix(data.rolling ^ 0x9E3779B97F4A7C15)
        if seed is not None:  # sampled: the keyed draw depends on (seed, position) as well
            h = _mix(h ^ (seed * 0xD6E8FEB86659FD93 + position) & _MASK)
        if self.eos_rate and self.eos_token_id is not None and h % self.eos_rate == 0:
            return self.eos_token_id
        token = (h >> 11) % self.vocab_size
        if self.eos_rate and token == self.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.release:
            self._seqs.pop(seq_id, None)
            self._ring.pop(seq_id, None)
        for seq_id in plan.reset:
            self._seqs.pop(seq_id, None)
            self._ring.pop(seq_id, None)
        outcomes = []
        for w in plan.work:
            data = self._seqs.get(w.seq_id)
            if data is None:
                data = self._seqs[w.seq_id] = _SeqData()
            if w.start == data.fed:  # a misplaced chunk is not folded in: the cursor check will catch it
                h = data.rolling
                for t in w.tokens:
                    h = (h * 0x100000001B3 + t + 1) & _MASK
                data.rolling = h
                data.fed += len(w.tokens)
            token = None
            if w.sample:
                seed = None if w.sampling.greedy else w.sampling.seed
                token = self._pick(data, seed, data.fed)
                while token in w.banned:  # a rollback's re-steer: the next id that is not banned
                    token = (token + 1) % self.vocab_size
            n = data.fed
            outcomes.append(SeqOutcome(w.seq_id, BackendCursors(n, n, n, n, 0), token))
        for seq_id, position, slot in plan.snapshots:
            data = self._seqs[seq_id]
            if data.fed == position:  # a misplaced snapshot is not stored: the restore will refuse it
                self._ring.setdefault(seq_id, {})[slot] = _SeqData(data.fed, data.rolling)
        return StepResult(plan.step, tuple(outcomes))

    def restore_boundary(self, seq_id: int, slot: int, position: int) -> BackendCursors:
        snap = self._ring.get(seq_id, {}).get(slot)
        if seq_id not in self._seqs or snap is None or snap.fed != position or position > self._seqs[seq_id].fed:
            raise ValueError(f"sequence {seq_id}: no snapshot at {position} in ring slot {slot}")
        self._seqs[seq_id] = _SeqData(snap.fed, snap.rolling)
        ring = self._ring[seq_id]
        for s in [s for s, held in ring.items() if held.fed > position]:
            del ring[s]
        return self.cursors(seq_id)

    def cursors(self, seq_id: int) -> BackendCursors:
        data = self._seqs.get(seq_id, _SeqData())
        n = data.fed
        return BackendCursors(n, n, n, n, 0)

    def live_sequences(self) -> list[int]:
        return sorted(self._seqs)
