"""The control plane's state machines: plain attrs classes, no tensors.

A transition validates every precondition first and refuses (TransitionRefused, saying why) before
changing anything. `Sequence.advance` and `Sequence.reset` move every cursor of a sequence together:
token count, KV, QSA keys, recurrent state, PLE context and drafter rows never drift apart.
"""

from __future__ import annotations

from enum import Enum, IntEnum

import attrs

from atlas.errors import TransitionRefused
from atlas.sampling.params import SamplingParams

_MASK = (1 << 64) - 1


class FinishReason(str, Enum):  # noqa: UP042 (str() stays "FinishReason.STOP"; .value is the wire form)
    STOP = "stop"  # EOS, a stop string or stop token, or a deliberate hard stop (with its detail)
    LENGTH = "length"  # max_tokens, or the capacity left, ran out
    ERROR = "error"  # the engine failed this request; never reported as stop or length
    CANCELLED = "cancelled"  # the client went away (not an OpenAI finish_reason; never sent to a client)




class Phase(IntEnum):
    WAITING = 0
    RUNNING = 1  # prefilling while more than one token is unfed, decoding when exactly one is
    FINISHED = 2


@attrs.define(slots=True)
class SequenceCursor:
    """The token stream and how much of it the data plane holds (`computed`, like vLLM's
    num_computed_tokens: prefill, chunking and recompute after preemption all move it)."""

    tokens: list[int]
    prompt_len: int
    computed: int = 0
    phase: Phase = Phase.WAITING
    # rolling hash of `tokens`, kept incrementally for the state digest
    token_hash: int = 0

    @property
    def seq_len(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """Running with more than the last sampled token left to feed (a prompt, or a recompute)."""
        return self.phase is Phase.RUNNING and len(self.tokens) - self.computed > 1

    @property
    def decoding(self) -> bool:
        """Running with exactly the last sampled token left to feed."""
        return self.phase is Phase.RUNNING and len(self.tokens) - self.computed == 1


@attrs.define(slots=True)
class QsaCursor:
    """Raw QSA index keys ingested (one per token fed; one cursor for all QSA layers: they move together)."""

    capacity: int
    ratio: int
    ingested: int = 0

    @property
    def pooled(self) -> int:
        return self.ingested // self.ratio


@attrs.define(slots=True)
class SsmRing:
    """Boundary snapshots of a sequence's recurrent state as (position, slot), oldest first.

    The data plane holds the state itself in `slots` per-sequence slots; the control plane knows which
    positions it can rewind to. Positions are strictly increasing and <= the sequence's computed tokens.
    `slots == 0` disables the ring: nothing is ever recorded and every rollback declines."""

    slots: int
    snapshots: list[tuple[int, int]] = attrs.Factory(list)

    def place(self) -> tuple[int, int]:
        """Where the next snapshot goes: (slot, evicted position or -1). The lowest free slot, else the
        oldest snapshot's slot (the newest boundaries are the useful ones: loops are recent)."""
        if self.slots == 0:
            raise TransitionRefused("SsmRing", "snapshot with the ring disabled (ring_slots 0)")
        if len(self.snapshots) < self.slots:
            used = {slot for _, slot in self.snapshots}
            return min(s for s in range(self.slots) if s not in used), -1
        position, slot = self.snapshots[0]
        return slot, position

    def record(self, position: int, slot: int, evicted: int) -> None:
        """Record a snapshot taken at `position` into `slot`, evicting the snapshot at `evicted` (-1: none)."""
        expected = self.place()
        if (slot, evicted) != expected:
            raise TransitionRefused("SsmRing", "a snapshot goes where place() puts it", slot=slot, evicted=evicted,
                                    expected=list(expected))
        if self.snapshots and position <= self.snapshots[-1][0]:
            raise TransitionRefused("SsmRing", "snapshot positions strictly increase", position=position,
                                    last=self.snapshots[-1][0])
        if evicted >= 0:
            self.snapshots.pop(0)
        self.snapshots.append((position, slot))

    def latest_before(self, position: int) -> tuple[int, int] | None:
        """The newest snapshot strictly before `position`, or None."""
        for snap in reversed(self.snapshots):
            if snap[0] < position:
                return snap
        return None

    def truncate_after(self, position: int) -> None:
        """Forget the snapshots past `position` (their timeline was rolled back)."""
        self.snapshots[:] = [s for s in self.snapshots if s[0] <= position]


@attrs.define(slots=True)
class DrafterCarry:
    """MTP drafter pair-key rows held for a sequence. Pair key k is (embed(t_{k+1}), hidden_k): with an MTP
    drafter (`mtp`) a sequence that fed `computed` tokens holds keys first_key .. computed - 2 (contiguous),
    all built from the target's hidden; keys of drafts and of the drafter's own hidden are transient and
    never held. first_key is 0 when the drafter saw the whole prompt, prompt_len - 1 when the drafter
    context is off, position - 1 after a prefix hit without a usable carry. A carry adopted on a prefix hit
    (`carried`) may hold keys past computed - 2 (up to the prompt's): the prefill skips them.
    `latched`: the speculative lane is off for the sequence (sticky)."""

    rows: int = 0
    last_pair_key: int = -1
    carried: bool = False
    mtp: bool = False
    latched: bool = False
    first_key: int = 0

    def follow(self, computed: int) -> None:
        if self.mtp:
            self.hold(self.first_key, max(self.last_pair_key, computed - 2))

    def hold(self, first_key: int, last_pair_key: int) -> None:
        """Keys first_key .. last_pair_key (none when last < first)."""
        self.first_key = first_key
        self.rows = max(0, last_pair_key - first_key + 1)
        self.last_pair_key = last_pair_key if self.rows else -1

    def rows_at(self, position: int) -> int:
        """Rows left after a rewind to `position` fed tokens (key k needs token k + 1)."""
        return max(0, min(self.last_pair_key, position - 2) - self.first_key + 1) if self.rows else 0

    def rewind(self, position: int) -> None:
        if self.rows:
            self.hold(self.first_key, min(self.last_pair_key, position - 2))


@attrs.define(slots=True)
class Sequence:
    """One request's lifecycle and all of its cursors."""

    seq_id: int
    request_id: str
    arrival_step: int
    params: SamplingParams
    max_new: int  # tokens it may generate (max_tokens, or what max_seq_len leaves)
    cursor: SequenceCursor
    qsa: QsaCursor
    ring: SsmRing
    drafter: DrafterCarry
    blocks: list[int] = attrs.Factory(list)
    on_device: bool = False  # the data plane holds state for it (released when it finishes)
    preemptions: int = 0
    fingerprint: int = 0  # this sequence's share of the state digest
    stream: bool = False  # its tokens reach the client as they are sampled (a rollback past them declines)
    rollbacks: int = 0  # content-loop rollbacks taken
    # position -> tokens the sampler may not pick there (the re-steer of a rollback)
    banned: dict[int, tuple[int, ...]] = attrs.Factory(dict)
    # prefix caching: chain hashes of the sequence's full blocks of computed tokens (prefix_cache.chain_hash)
    prefix_chain: list[int] = attrs.Factory(list)

    @classmethod
    def arrive(cls, seq_id: int, request_id: str, step: int, params: SamplingParams, max_new: int,
               prompt: list[int], token_hash: int, stream: bool, qsa_capacity: int, qsa_ratio: int, ring_slots: int,
               mtp: bool) -> Sequence:
        """A request's sequence as it arrives (RequestArrived's, one at a time or a run of them at once): waiting,
        every cursor at 0, `token_hash` the prompt's rolling hash."""
        cursor = SequenceCursor(tokens=prompt, prompt_len=len(prompt))
        cursor.token_hash = token_hash
        return cls(seq_id=seq_id, request_id=request_id, arrival_step=step, params=params, max_new=max_new,
                   cursor=cursor, qsa=QsaCursor(capacity=qsa_capacity, ratio=qsa_ratio), ring=SsmRing(slots=ring_slots),
                   drafter=DrafterCarry(mtp=mtp), stream=stream)

    def advance(self, fed: int, token: int, block_size: int) -> None:
        """Feed `fed` tokens (all cursors move together), then append `token` (-1: nothing sampled)."""
        self.check_advance(fed, token, block_size)
        self.commit_advance(fed, token)

    def check_advance(self, fed: int, token: int, block_size: int) -> None:
        c = self.cursor
        end = c.computed + fed
        if c.phase is not Phase.RUNNING:
            raise TransitionRefused("SequenceCursor", "advance of a sequence that is not running",
                                    seq_id=self.seq_id, phase=c.phase.name)
        if fed < 1 or end > len(c.tokens):
            raise TransitionRefused("SequenceCursor", "fed tokens beyond the known tokens",
                                    seq_id=self.seq_id, computed=c.computed, fed=fed, seq_len=len(c.tokens))
        if end > self.qsa.capacity:
            raise TransitionRefused("QsaCursor", "ingest past the index capacity",
                                    seq_id=self.seq_id, ingested=self.qsa.ingested, fed=fed,
                                    capacity=self.qsa.capacity)
        if end > len(self.blocks) * block_size:
            raise TransitionRefused("BlockPool", "KV written past the sequence's blocks",
                                    seq_id=self.seq_id, end=end, blocks=len(self.blocks))
        sampled = token >= 0
        if sampled != (end == len(c.tokens)):
            raise TransitionRefused("SequenceCursor", "a token is sampled exactly when every known token is fed",
                                    seq_id=self.seq_id, end=end, seq_len=len(c.tokens), token=token)
        if sampled and c.generated >= self.max_new:
            raise TransitionRefused("Request", "token past the request's budget",
                                    seq_id=self.seq_id, generated=c.generated, max_new=self.max_new)

    def commit_advance(self, fed: int, token: int) -> None:
        c = self.cursor
        end = c.computed + fed
        c.computed = end
        self.qsa.ingested = end
        self.drafter.follow(end)
        if token >= 0:
            c.tokens.append(token)
            c.token_hash = (c.token_hash * 0x100000001B3 + token + 1) & _MASK

    def check_verify(self, drafts: tuple[int, ...], accepted: int, token: int, block_size: int) -> None:
        """A verify fed the last sampled token and `drafts`; it keeps `accepted` drafts, then `token`."""
        c = self.cursor
        fields = dict(seq_id=self.seq_id, drafts=len(drafts), accepted=accepted, token=token)
        if not c.decoding:
            raise TransitionRefused("SequenceCursor", "a verify of a sequence that is not decoding",
                                    computed=c.computed, seq_len=len(c.tokens), **fields)
        if not 0 <= accepted <= len(drafts) or token < 0:
            raise TransitionRefused("Speculative", "0 <= accepted <= drafts and a token after them", **fields)
        end = c.computed + 1 + accepted
        if end > self.qsa.capacity or end > len(self.blocks) * block_size:
            raise TransitionRefused("BlockPool", "a verify's commit fits the sequence's blocks and index",
                                    end=end, blocks=len(self.blocks), capacity=self.qsa.capacity, **fields)
        if c.generated + accepted + 1 > self.max_new:
            raise TransitionRefused("Request", "tokens past the request's budget", generated=c.generated,
                                    max_new=self.max_new, **fields)

    def commit_verify(self, drafts: tuple[int, ...], accepted: int, token: int, block_size: int) -> list[int]:
        """Move every cursor by 1 + accepted and append the kept tokens; returns the blocks past the new
        tokens (allocated for rejected drafts), which the caller frees."""
        c = self.cursor
        for t in (*drafts[:accepted], token):
            c.tokens.append(t)
            c.token_hash = (c.token_hash * 0x100000001B3 + t + 1) & _MASK
        self.commit_advance(1 + accepted, -1)
        keep = -(-len(self.cursor.tokens) // block_size)
        freed = self.blocks[keep:]
        del self.blocks[keep:]
        return freed

    def rollback(self, boundary: int, slot: int, keep: int, ban_token: int, blocks_freed: int,
                 block_size: int) -> list[int]:
        """Rewind every cursor to the snapshot (boundary, slot) and keep tokens[:keep]: KV, QSA keys, recurrent
        and PLE state at `boundary`, tokens boundary..keep-1 to be fed again, `ban_token` banned at position
        `keep`. Returns the blocks to free (those wholly past the kept tokens). Validates everything first."""
        c = self.cursor
        fields = dict(seq_id=self.seq_id, boundary=boundary, slot=slot, keep=keep, seq_len=len(c.tokens))
        if c.phase is not Phase.RUNNING:
            raise TransitionRefused("SequenceCursor", "rollback of a sequence that is not running",
                                    phase=c.phase.name, **fields)
        if (boundary, slot) not in self.ring.snapshots:
            raise TransitionRefused("SsmRing", "rollback to a boundary the ring does not hold",
                                    snapshots=[list(s) for s in self.ring.snapshots], **fields)
        if not c.prompt_len <= boundary < keep < len(c.tokens) or boundary > c.computed:
            raise TransitionRefused("SequenceCursor", "prompt_len <= boundary < keep < seq_len, boundary <= computed",
                                    prompt_len=c.prompt_len, computed=c.computed, **fields)
        if ban_token != c.tokens[keep]:
            raise TransitionRefused("SequenceCursor", "the banned token is the one dropped at `keep`",
                                    ban_token=ban_token, dropped=c.tokens[keep], **fields)
        kept_blocks = -(-keep // block_size)
        if blocks_freed != len(self.blocks) - kept_blocks:
            raise TransitionRefused("BlockPool", "a rollback frees exactly the blocks past the kept tokens",
                                    blocks_freed=blocks_freed, blocks=len(self.blocks), kept=kept_blocks, **fields)
        freed = self.blocks[kept_blocks:]
        del self.blocks[kept_blocks:]
        del c.tokens[keep:]
        h = 0
        for t in c.tokens:
            h = (h * 0x100000001B3 + t + 1) & _MASK
        c.token_hash = h
        c.computed = boundary
        self.qsa.ingested = boundary
        self.ring.truncate_after(boundary)
        # drafter rows are positional like KV: the ones past the boundary go (pair key k needs token k + 1)
        self.drafter.rewind(boundary)
        self.drafter.carried = False
        del self.prefix_chain[boundary // block_size:]
        self.banned[keep] = (*self.banned.get(keep, ()), ban_token)
        self.rollbacks += 1
        return freed

    def admit(self, drafter_first_key: int) -> None:
        """Admission by a plan: running from computed 0 (its checks are StepPlanned's), the data plane holding it."""
        self.cursor.phase = Phase.RUNNING
        self.on_device = True
        self.drafter.first_key = drafter_first_key

    def start_from(self, position: int, blocks: list[int], chain: list[int]) -> None:
        """A prefix hit (its checks are PrefixHit's): running from `position` fed tokens held in `blocks`, every
        cursor at `position`, the cached chain of its full blocks `chain`."""
        self.blocks = blocks
        self.cursor.computed = position
        self.cursor.phase = Phase.RUNNING
        self.on_device = True
        self.qsa.ingested = position
        self.prefix_chain = chain

    def end(self) -> None:
        """The request finished or was cancelled (its blocks and queue place are ControlState.finish's)."""
        self.cursor.phase = Phase.FINISHED

    def reset(self) -> None:
        """Preemption: every cursor and the recurrent state back to zero (tokens are kept for recompute)."""
        if self.cursor.phase is not Phase.RUNNING:
            raise TransitionRefused("SequenceCursor", "reset of a sequence that is not running",
                                    seq_id=self.seq_id, phase=self.cursor.phase.name)
        self.cursor.computed = 0
        self.cursor.phase = Phase.WAITING
        self.qsa.ingested = 0
        self.ring.snapshots.clear()
        self.drafter.rows = 0
        self.drafter.last_pair_key = -1
        self.drafter.carried = False
        self.prefix_chain.clear()
        self.on_device = False
        self.preemptions += 1


@attrs.define(slots=True)
class BlockPool:
    """KV blocks: a free list (an insertion-ordered dict used as an ordered set) and reference counts."""

    total: int
    free: dict[int, None]
    refs: list[int]
    used: int = 0

    @classmethod
    def create(cls, total: int) -> BlockPool:
        # highest id first, so popping from the end hands out block 0, 1, 2, ... on a fresh pool
        return cls(total=total, free=dict.fromkeys(range(total - 1, -1, -1)), refs=[0] * total)

    def allocate(self, seq_id: int, blocks: tuple[int, ...] | list[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.total or b not in self.free:
                raise TransitionRefused("BlockPool", "allocation of a block that is not free",
                                        seq_id=seq_id, block=b, ref=self.refs[b] if 0 <= b < self.total else None)
        if len(set(blocks)) != len(blocks):
            raise TransitionRefused("BlockPool", "a block allocated twice in one step", seq_id=seq_id,
                                    blocks=list(blocks))
        for b in blocks:
            del self.free[b]
            self.refs[b] = 1
        self.used += len(blocks)

    def release(self, seq_id: int, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise TransitionRefused("BlockPool", "release of a block with no reference", seq_id=seq_id,
                                        block=b, ref=self.refs[b])
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
                self.used -= 1
