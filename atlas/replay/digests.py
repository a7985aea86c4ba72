"""The state digests of events applied one at a time, compared in batches (replay check).

`ControlState.digest()` is four splitmix64 rounds in Python integers and a hex format: ~29,000 instructions a call,
10 M of a 250 M-instruction check of benchmarks/replay_check.py's trace (350 events outside the runs). Here each
event's inputs to it are taken as five integers when it is applied (the state moves on after), and the digests of a
batch of events are the same rounds over uint64 columns, compared with the recorded ones at once. `first_mismatch`
says which event's digest differs first, with the digest `digest()` would have given, so replay check reports it
exactly as when it compared after every event: it asks before reporting anything else (a later refusal, violation
or error is reported only when no earlier digest differs).

Only for a state without the prefix cache (its digest has a fifth round over the cache's fields): check_rows
compares those one at a time.
"""

from __future__ import annotations

import numpy as np

from atlas.hashing import MASK64, mix64
from atlas.state.columns import digest_rounds
from atlas.state.control import ControlState

# a batch is compared once it holds this many events (and whenever replay check is about to report or return)
BATCH = 4096


class LazyDigests:
    __slots__ = ("inputs", "recorded", "indices")

    def __init__(self) -> None:
        self.inputs: list[tuple[int, int, int, int, int]] = []
        self.recorded: list[str] = []
        self.indices: list[int] = []

    def add(self, state: ControlState, recorded: str, index: int) -> tuple[int, str, str] | None:
        """The state's digest inputs after the event `index` (ControlState.digest's four rounds' operands and the
        sequences' share); a full batch is compared at once (its first mismatch, as first_mismatch gives it)."""
        pool = state.pool
        self.inputs.append((state.step ^ (pool.used << 20) ^ (state.next_seq_id << 40),
                            (len(state.waiting) << 32) ^ len(state.running) ^ (state.finished_count << 16),
                            (len(state.pending_release) << 8) ^ len(state.pending_faults) ^ (state.dead << 62),
                            state.inflight_hash ^ state.outcomes_hash, state.seq_digest))
        self.recorded.append(recorded)
        self.indices.append(index)
        if len(self.inputs) >= BATCH:
            return self.first_mismatch()
        return None

    def first_mismatch(self) -> tuple[int, str, str] | None:
        """(event index, its digest, the recorded one) of the first event whose digest differs, or None; the batch
        is emptied either way."""
        inputs, recorded, indices = self.inputs, self.recorded, self.indices
        self.inputs, self.recorded, self.indices = [], [], []
        if not inputs:
            return None
        try:
            x = np.array(inputs, dtype=np.uint64)
        except OverflowError:  # a field past 64 bits (mix64 masks it): the rounds in Python integers
            ours = [_digest(*row) for row in inputs]
        else:
            g = digest_rounds(x[:, 0].copy(), x[:, 1], x[:, 2], x[:, 3])
            g ^= x[:, 4]
            text = g.astype(">u8").tobytes().hex()
            if all(len(r) == 16 for r in recorded) and text == "".join(recorded):
                return None
            ours = [text[16 * i:16 * i + 16] for i in range(len(inputs))]
        for i, (a, b) in enumerate(zip(ours, recorded, strict=True)):
            if a != b:
                return indices[i], a, b
        return None


def _digest(a: int, b: int, c: int, d: int, seqs: int) -> str:
    g = mix64(a)
    g = mix64(g ^ b)
    g = mix64(g ^ c)
    g = mix64(g ^ d)
    return f"{(g ^ seqs) & MASK64:016x}"
