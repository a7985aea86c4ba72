"""NullBackend: the Backend protocol without tensors, for the control-plane tests and benchmark.

The next token is a deterministic function of every token the sequence has been fed (a rolling hash) and,
when sampling is not greedy, of (seed, position): exactly the dependencies a real model + keyed sampler
has, so batch-, chunk- and preemption-invariance can be tested without a model. Its cursors are honest:
it counts what it was actually fed, so a control-plane bug shows up as a cursor desync.
"""

from __future__ import annotations

import attrs

from atlas.backends.base import Capabilities, run_orders
from atlas.errors import RestoreRefused, VerifyRefused
from atlas.plan import (
    BackendCursors,
    CarryOrder,
    PrefixRestore,
    PrefixStore,
    RingRestore,
    RingSnapshot,
    SeqOutcome,
    StepPlan,
    StepResult,
)

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
class SeqData:
    fed: int = 0  # tokens folded in: its KV, recurrent and PLE cursors
    rolling: int = 0
    keys: int = 0  # its QSA keys (moved with `fed` by every honest operation; separate so a desync can show)


class NullBackend:
    name = "null"
    capabilities = Capabilities(snapshot_ring=True, batch_invariant=True)

    def __init__(self, vocab_size: int = ByteTokenizer.vocab_size, eos_token_id: int | None = BYTE_VOCAB,
                 eos_rate: int = 0) -> None:
        """`eos_rate` = n makes EOS the next token about once in n picks (0: whatever the hash gives)."""
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_rate = eos_rate
        self._seqs: dict[int, SeqData] = {}
        self._ring: dict[int, dict[int, SeqData]] = {}  # seq_id -> ring slot -> boundary snapshot

    def _pick(self, data: SeqData, seed: int | None, position: int) -> int:
        h = _mix(data.rolling ^ 0x9E3779B97F4A7C15)
        if seed is not None:  # sampled: the keyed draw depends on (seed, position) as well
            h = _mix(h ^ (seed * 0xD6E8FEB86659FD93 + position) & _MASK)
        if self.eos_rate and self.eos_token_id is not None and h % self.eos_rate == 0:
            return self.eos_token_id
        token = (h >> 11) % self.vocab_size
        if self.eos_rate and token == self.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    # -- the StateStore contract, as far as a backend without tensors has state --------------------

    def reset(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._ring.pop(seq_id, None)

    def release(self, seq_id: int) -> None:
        self.reset(seq_id)

    def snapshot(self, order: RingSnapshot) -> None:
        data = self._seqs[order.seq_id]
        if data.fed == order.position:  # a misplaced snapshot is not stored: the restore will refuse it
            self._ring.setdefault(order.seq_id, {})[order.slot] = SeqData(data.fed, data.rolling, data.keys)

    def restore(self, order: RingRestore) -> BackendCursors:
        seq_id, slot, position = order.seq_id, order.slot, order.position
        snap = self._ring.get(seq_id, {}).get(slot)
        if seq_id not in self._seqs or snap is None or snap.fed != position or position > self._seqs[seq_id].fed:
            raise RestoreRefused(f"sequence {seq_id}: no snapshot at {position} in ring slot {slot}")
        self._seqs[seq_id] = SeqData(snap.fed, snap.rolling, snap.keys)
        ring = self._ring[seq_id]
        for s in [s for s, held in ring.items() if held.fed > position]:
            del ring[s]
        return self.cursors(seq_id)

    def commit(self, seq_id: int, rows: int) -> BackendCursors:
        raise VerifyRefused("the null backend verifies no drafts")

    def store_prefix(self, order: PrefixStore) -> None:
        raise RestoreRefused("the null backend keeps no prefix snapshots")

    def load_prefix(self, order: PrefixRestore) -> None:
        raise RestoreRefused("the null backend keeps no prefix snapshots")

    def carry(self, order: CarryOrder) -> None:
        if order.drop or order.store >= 0:
            raise RestoreRefused("the null backend keeps no drafter carry")

    def state_digest(self, seq_id: int, *, drafter: bool = True) -> str:
        data = self._seqs.get(seq_id)
        return "absent" if data is None else f"{data.fed}:{data.rolling:016x}"

    def execute(self, plan: StepPlan) -> StepResult:
        done = run_orders(self, plan)
        outcomes = []
        for w in plan.work:
            if w.seq_id in done.refused:
                outcomes.append(SeqOutcome(w.seq_id, self.cursors(w.seq_id), accepted=-1, refused=done.refused[w.seq_id]))
                continue
            data = self._seqs.get(w.seq_id)
            if data is None:
                data = self._seqs[w.seq_id] = SeqData()
            if w.start == data.fed:  # a misplaced chunk is not folded in: the cursor check will catch it
                h = data.rolling
                for t in w.tokens:
                    h = (h * 0x100000001B3 + t + 1) & _MASK
                data.rolling = h
                data.fed += len(w.tokens)
                data.keys += len(w.tokens)
            token = None
            if w.sample:
                seed = None if w.sampling.greedy else w.sampling.seed
                token = self._pick(data, seed, data.fed)
                while token in w.banned:  # a rollback's re-steer: the next id that is not banned
                    token = (token + 1) % self.vocab_size
            outcomes.append(SeqOutcome(w.seq_id, self.cursors(w.seq_id), token))
        for s in plan.snapshots:
            self.snapshot(s)
        in_work = {w.seq_id for w in plan.work}
        return StepResult(plan.step, tuple(outcomes),
                          touched=tuple((s, c) for s, c in done.restored.items() if s not in in_work),
                          refused=tuple((s, why) for s, why in done.refused.items() if s not in in_work))

    def cursors(self, seq_id: int) -> BackendCursors:
        data = self._seqs.get(seq_id, SeqData())
        n = data.fed
        return BackendCursors(n, data.keys, n, n, 0)

    def live_sequences(self) -> list[int]:
        return sorted(self._seqs)
