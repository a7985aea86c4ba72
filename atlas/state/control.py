"""ControlState: every state machine of the engine, changed only by `apply(event)`.

`apply` returns the sequence ids the event touched, so invariants are checked where state moved (cheap at
batch 256), and the digest is kept incrementally: each sequence carries a 64-bit fingerprint of its fields,
the digest is the XOR of them with the global fields. Digests are stable across runs and processes (pure
integer mixing, no Python `hash` of strings), so a replay compares them directly.
"""

from __future__ import annotations

import zlib
from bisect import insort

import attrs

from atlas.config import Capacities
from atlas.engine.outputs import FinishReason
from atlas.engine.prefix_cache import CarriedEntry, PrefixCache
from atlas.engine.sampling import SamplingParams
from atlas.state.events import (
    BoundarySnapshotted,
    CarryAdopted,
    CarryReleased,
    CarryStored,
    EngineFaulted,
    Event,
    FaultInjected,
    InvariantViolated,
    PrefixCacheHit,
    PrefixSnapshotted,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    RollbackDeclined,
    RolledBack,
    SequencePreempted,
    SpeculationLatchedOff,
    StepExecuted,
    StepPlanned,
)
from atlas.state.machines import (
    BlockPool,
    DrafterCarry,
    Phase,
    QsaCursor,
    Sequence,
    SequenceCursor,
    SsmRing,
    TransitionRefused,
)
from atlas.state.prefix import (
    PrefixOrders,
    carry_adopted,
    carry_released,
    carry_stored,
    forget_blocks,
    prefix_hit,
    prefix_snapshotted,
    register_blocks,
)

_MASK = (1 << 64) - 1


def _mix(h: int) -> int:
    """splitmix64 finaliser: spreads every input bit over the whole word."""
    h &= _MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def sequence_fingerprint(seq: Sequence) -> int:
    """64 bits over every field the sequence's machines hold. Two mixing rounds: this runs once per
    sequence per step, and it is most of the digest's cost at batch 256."""
    c = seq.cursor
    h = _mix(c.token_hash ^ (seq.seq_id * 0x9E3779B97F4A7C15))
    h += (len(c.tokens) * 0xC2B2AE3D27D4EB4F + c.computed * 0x165667B19E3779F9 + c.phase * 0xD6E8FEB86659FD93
          + len(seq.blocks) * 0xFF51AFD7ED558CCD + seq.qsa.ingested * 0xC4CEB9FE1A85EC53
          + seq.drafter.rows * 0x27D4EB2F165667C5 + len(seq.ring.snapshots) * 0x94D049BB133111EB
          + seq.preemptions * 0xBF58476D1CE4E5B9 + seq.drafter.latched * 0x2545F4914F6CDD1D)
    if seq.ring.snapshots or seq.rollbacks:  # rare fields: one more round only when they are in use
        last, slot = seq.ring.snapshots[-1] if seq.ring.snapshots else (-1, -1)
        h = _mix(h ^ (last * 0x9E3779B97F4A7C15 + slot * 0xC2B2AE3D27D4EB4F + seq.rollbacks * 0x165667B19E3779F9))
    return _mix(h)


@attrs.define(slots=True)
class ControlState:
    caps: Capacities
    pool: BlockPool
    step: int = 0
    next_seq_id: int = 0
    seqs: dict[int, Sequence] = attrs.Factory(dict)  # live (not finished) sequences
    by_request: dict[str, int] = attrs.Factory(dict)
    waiting: list[int] = attrs.Factory(list)  # seq ids, ordered by arrival
    running: list[int] = attrs.Factory(list)  # seq ids, ordered by arrival
    pending_release: list[int] = attrs.Factory(list)  # finished with data-plane state still held
    pending_faults: list[tuple[str, str | None]] = attrs.Factory(list)
    inflight: StepPlanned | None = None  # planned, not yet executed
    # the in-flight plan's share of the digest; tuples of ints hash the same in every process
    # (PYTHONHASHSEED only salts str and bytes)
    inflight_hash: int = 0
    dead: bool = False
    finished_count: int = 0
    outcomes_hash: int = 0  # folds in every finished request's reason and detail, in order
    seq_digest: int = 0  # XOR of the live sequences' fingerprints
    # prefix caching (atlas.state.prefix): the index (None when off), the drafter carry, the data-plane
    # orders its events queued for the next plan
    prefix: PrefixCache | None = None
    carry: CarriedEntry | None = None
    prefix_orders: PrefixOrders = attrs.Factory(PrefixOrders)
    # sequences an engine error ended (a failed step, a refused verify commit, a fatal fault): their
    # RequestFinished must say `error`, never `stop` or `length`
    failing: set[int] = attrs.Factory(set)

    @classmethod
    def create(cls, caps: Capacities) -> ControlState:
        prefix = PrefixCache(caps.block_size, caps.prefix_snapshots) if caps.prefix_caching else None
        return cls(caps=caps, pool=BlockPool.create(caps.num_kv_blocks), prefix=prefix)

    # ------------------------------------------------------------------------------------------ digest

    def digest(self) -> str:
        g = _mix(self.step ^ (self.pool.used << 20) ^ (self.next_seq_id << 40))
        g = _mix(g ^ (len(self.waiting) << 32) ^ len(self.running) ^ (self.finished_count << 16))
        g = _mix(g ^ (len(self.pending_release) << 8) ^ len(self.pending_faults) ^ (self.dead << 62))
        g = _mix(g ^ self.inflight_hash ^ self.outcomes_hash)
        if self.prefix is not None:
            carried = -1 if self.carry is None else self.carry.last_pair_key
            g = _mix(g ^ len(self.prefix.blocks) ^ (len(self.prefix.snapshots) << 24) ^ (carried << 40))
        return f"{g ^ self.seq_digest:016x}"

    def _refresh(self, seq: Sequence) -> None:
        fp = sequence_fingerprint(seq)
        self.seq_digest ^= seq.fingerprint ^ fp
        seq.fingerprint = fp

    # ------------------------------------------------------------------------------------------- apply

    def apply(self, e: Event) -> tuple[int, ...]:
        """Apply one event; returns the ids of the sequences it touched. Refuses before mutating."""
        handler = _HANDLERS.get(type(e))
        if handler is None:
            raise TransitionRefused("ControlState", f"no transition for event kind {e.kind!r}")
        return handler(self, e)

    def seq(self, seq_id: int) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise TransitionRefused("Request", "event for a sequence that is not live (finished or unknown)",
                                    seq_id=seq_id)
        return seq

    def _arrived(self, e: RequestArrived) -> tuple[int, ...]:
        if e.seq_id != self.next_seq_id:
            raise TransitionRefused("Request", "sequence ids are given in arrival order",
                                    seq_id=e.seq_id, expected=self.next_seq_id)
        if e.request_id in self.by_request:
            raise TransitionRefused("Request", "request id already live", request_id=e.request_id)
        if not e.prompt or len(e.prompt) + e.max_new > self.caps.max_seq_len or e.max_new < 1:
            raise TransitionRefused("Request", "prompt + budget outside capacity", prompt=len(e.prompt),
                                    max_new=e.max_new, max_seq_len=self.caps.max_seq_len)
        seq = Sequence(
            seq_id=e.seq_id,
            request_id=e.request_id,
            arrival_step=self.step,
            params=SamplingParams.from_json(e.params),
            max_new=e.max_new,
            cursor=SequenceCursor(tokens=list(e.prompt), prompt_len=len(e.prompt)),
            qsa=QsaCursor(capacity=self.caps.qsa_index_capacity, ratio=self.caps.qsa_ratio),
            ring=SsmRing(slots=self.caps.ring_slots),
            drafter=DrafterCarry(mtp=self.caps.drafter_rows > 0),
            stream=e.stream,
        )
        h = 0
        for t in e.prompt:
            h = (h * 0x100000001B3 + t + 1) & _MASK
        seq.cursor.token_hash = h
        self.next_seq_id += 1
        self.seqs[e.seq_id] = seq
        self.by_request[e.request_id] = e.seq_id
        self.waiting.append(e.seq_id)  # the newest arrival: the end keeps the list ordered
        self._refresh(seq)
        return (e.seq_id,)

    def _finish(self, seq: Sequence, reason: str, detail: str) -> None:
        # crc32: a stable hash of the text (Python's str hash is salted per process)
        self.outcomes_hash = _mix(self.outcomes_hash ^ (seq.seq_id << 40) ^ zlib.crc32(f"{reason}:{detail}".encode()))
        if seq.blocks:
            self.pool.release(seq.seq_id, seq.blocks)
        if seq.cursor.phase is Phase.WAITING:
            self.waiting.remove(seq.seq_id)
        else:
            self.running.remove(seq.seq_id)
        if seq.on_device:
            self.pending_release.append(seq.seq_id)
        self.seq_digest ^= seq.fingerprint
        self.failing.discard(seq.seq_id)
        seq.cursor.phase = Phase.FINISHED
        del self.seqs[seq.seq_id]
        del self.by_request[seq.request_id]
        self.finished_count += 1

    def _cancelled(self, e: RequestCancelled) -> tuple[int, ...]:
        seq = self.seq(e.seq_id)
        if seq.request_id != e.request_id:
            raise TransitionRefused("Request", "cancel names another request", seq_id=e.seq_id,
                                    request_id=e.request_id, live=seq.request_id)
        self._finish(seq, "cancelled", "")
        return (e.seq_id,)

    def _finished(self, e: RequestFinished) -> tuple[int, ...]:
        seq = self.seq(e.seq_id)
        FinishReason(e.reason)  # refuses an unknown reason
        if self.inflight is not None and e.seq_id in self.inflight.seqs:
            raise TransitionRefused("Request", "finish of a sequence whose step is in flight", seq_id=e.seq_id)
        if e.seq_id in self.failing and e.reason != FinishReason.ERROR.value:
            raise TransitionRefused("Request", "an engine error is reported as `error`, never `stop` or `length`",
                                    seq_id=e.seq_id, reason=e.reason, detail=e.detail)
        self._finish(seq, e.reason, e.detail)
        return (e.seq_id,)

    def _fault_injected(self, e: FaultInjected) -> tuple[int, ...]:
        if e.fault not in ("step_error", "fatal"):
            raise TransitionRefused("Engine", "unknown fault kind", fault=e.fault)
        self.pending_faults.append((e.fault, e.request_id))
        return ()

    def _preempted(self, e: SequencePreempted) -> tuple[int, ...]:
        seq = self.seq(e.seq_id)
        if e.blocks_freed != len(seq.blocks):
            raise TransitionRefused("BlockPool", "preemption frees every block of the sequence",
                                    seq_id=e.seq_id, blocks_freed=e.blocks_freed, blocks=len(seq.blocks))
        seq.reset()  # validates the phase before anything moves
        self.pool.release(seq.seq_id, seq.blocks)
        seq.blocks.clear()
        self.running.remove(seq.seq_id)
        insort(self.waiting, seq.seq_id)
        self._refresh(seq)
        return (e.seq_id,)

    def _planned(self, e: StepPlanned) -> tuple[int, ...]:
        if e.step != self.step:
            raise TransitionRefused("Engine", "steps are planned in order", step=e.step, expected=self.step)
        if self.inflight is not None:
            raise TransitionRefused("Engine", "a step is already in flight", inflight=self.inflight.step)
        if len(e.seqs) != len(e.fed):
            raise TransitionRefused("Engine", "one fed count per planned sequence", seqs=len(e.seqs), fed=len(e.fed))
        for seq_id in e.admitted:
            if self.seq(seq_id).cursor.phase is not Phase.WAITING:
                raise TransitionRefused("Request", "admission of a sequence that is not waiting", seq_id=seq_id)
        if list(e.release) != self.pending_release:
            raise TransitionRefused("Engine", "the plan releases exactly the finished sequences",
                                    release=list(e.release), pending=list(self.pending_release))
        if e.drafts and len(e.drafts) != len(e.seqs):
            raise TransitionRefused("Engine", "drafts aligned with the planned sequences", drafts=len(e.drafts),
                                    seqs=len(e.seqs))
        fed_total = sum(e.fed) + sum(len(d) for d in e.drafts)
        if fed_total > self.caps.max_batch_tokens:  # the size every per-step buffer is derived from
            raise TransitionRefused("Scheduler", "a step feeds at most max_batch_tokens (drafts included)",
                                    fed=fed_total, max_batch_tokens=self.caps.max_batch_tokens)
        admitted = set(e.admitted)
        new_blocks = {row[0]: len(row) - 1 for row in e.alloc}
        bs = self.caps.block_size
        for i, (seq_id, n) in enumerate(zip(e.seqs, e.fed, strict=True)):
            seq = self.seq(seq_id)
            c = seq.cursor
            drafts = e.drafts[i] if e.drafts else ()
            if c.phase is not Phase.RUNNING and seq_id not in admitted:
                raise TransitionRefused("Scheduler", "work for a sequence that is neither running nor admitted",
                                        seq_id=seq_id, phase=c.phase.name)
            if n < 1 or c.computed + n > len(c.tokens):
                raise TransitionRefused("SequenceCursor", "fed tokens beyond the known tokens", seq_id=seq_id,
                                        computed=c.computed, fed=n, seq_len=len(c.tokens))
            if drafts:
                self._check_drafts(seq, n, drafts)
            end = c.computed + n + len(drafts)  # a verify writes KV for its draft positions too
            if end > (len(seq.blocks) + new_blocks.get(seq_id, 0)) * bs:
                raise TransitionRefused("BlockPool", "KV written past the sequence's blocks", seq_id=seq_id,
                                        end=end, blocks=len(seq.blocks) + new_blocks.get(seq_id, 0))
        claimed: set[int] = set()
        for row in e.alloc:
            self.seq(row[0])
            for b in row[1:]:
                if b in claimed or not 0 <= b < self.pool.total or b not in self.pool.free:
                    raise TransitionRefused("BlockPool", "allocation of a block that is not free",
                                            seq_id=row[0], block=b)
                claimed.add(b)
        for seq_id in e.admitted:
            seq = self.seqs[seq_id]
            seq.cursor.phase = Phase.RUNNING
            seq.on_device = True
            # the drafter sees the prompt unless its context is off (then its keys start at the first decode)
            seq.drafter.first_key = 0 if self.caps.drafter_context else seq.cursor.prompt_len - 1
            self.waiting.remove(seq_id)
            insort(self.running, seq_id)
        for row in e.alloc:
            self.pool.allocate(row[0], row[1:])
            if self.prefix is not None:  # a cached block handed out again is evicted
                for b in row[1:]:
                    self.prefix.evict_block(b)
            self.seqs[row[0]].blocks.extend(row[1:])
        self.pending_release.clear()
        self.prefix_orders.clear()
        self.inflight = e
        self.inflight_hash = hash((e.seqs, e.fed, e.alloc, e.release, e.reset) + ((e.drafts,) if e.drafts else ())
                                  ) & _MASK
        self.step = e.step + 1
        touched = tuple(e.admitted) + tuple(row[0] for row in e.alloc)
        for seq_id in touched:
            self._refresh(self.seqs[seq_id])
        return touched

    def _executed(self, e: StepExecuted) -> tuple[int, ...]:
        plan = self.inflight
        if plan is None or plan.step != e.step:
            raise TransitionRefused("Engine", "execution of a step that was not planned", step=e.step,
                                    inflight=None if plan is None else plan.step)
        if len(e.tokens) != len(plan.seqs):
            raise TransitionRefused("Engine", "one token slot per planned sequence", tokens=len(e.tokens),
                                    seqs=len(plan.seqs))
        if (e.accepted or e.verdicts or plan.drafts) and not len(e.accepted) == len(e.verdicts) == len(plan.seqs):
            raise TransitionRefused("Speculative", "accepted counts and verdicts aligned with the planned sequences",
                                    accepted=len(e.accepted), verdicts=len(e.verdicts), seqs=len(plan.seqs))
        bs = self.caps.block_size
        seqs = self.seqs
        work = []
        refused: list[int] = []
        for i, (seq_id, fed, token) in enumerate(zip(plan.seqs, plan.fed, e.tokens, strict=True)):
            seq = seqs.get(seq_id)
            if seq is None:
                raise TransitionRefused("Request", "token for a sequence that is not live", seq_id=seq_id)
            drafts = plan.drafts[i] if plan.drafts else ()
            accepted = e.accepted[i] if e.accepted else 0
            if drafts and accepted == -1 and token == -1:
                refused.append(seq_id)
                continue  # its commit was refused: nothing moves, the request fails next
            if drafts:
                seq.check_verify(drafts, accepted, token, bs)
            else:
                if accepted:
                    raise TransitionRefused("Speculative", "accepted drafts without a verify", seq_id=seq_id,
                                            accepted=accepted)
                seq.check_advance(fed, token, bs)
            work.append((seq, fed, token, drafts, accepted))
        self.failing.update(refused)
        for seq, fed, token, drafts, accepted in work:  # every check passed: commit them all
            if drafts:
                self.pool.release(seq.seq_id, seq.commit_verify(drafts, accepted, token, bs))
            else:
                seq.commit_advance(fed, token)
            register_blocks(self, seq)
            self._refresh(seq)
        self.inflight = None
        self.inflight_hash = 0
        return plan.seqs

    def _check_drafts(self, seq: Sequence, fed: int, drafts: tuple[int, ...]) -> None:
        c = seq.cursor
        if fed != 1 or not c.decoding:
            raise TransitionRefused("Speculative", "drafts only for a decoding sequence feeding its last token",
                                    seq_id=seq.seq_id, fed=fed, computed=c.computed, seq_len=len(c.tokens))
        if seq.drafter.latched:
            raise TransitionRefused("Speculative", "drafts for a sequence whose lane is latched off",
                                    seq_id=seq.seq_id)
        if len(drafts) > self.caps.verify_width - 1 or c.generated + len(drafts) + 1 > seq.max_new:
            raise TransitionRefused("Speculative", "drafts within the verify width and the request's budget",
                                    seq_id=seq.seq_id, drafts=len(drafts), verify_width=self.caps.verify_width,
                                    generated=c.generated, max_new=seq.max_new)

    def _latched(self, e: SpeculationLatchedOff) -> tuple[int, ...]:
        seq = self._running_between_steps(e.seq_id, "speculation latch")
        if seq.drafter.latched:
            raise TransitionRefused("Speculative", "the lane latches off once", seq_id=e.seq_id)
        if e.position != seq.cursor.computed:
            raise TransitionRefused("Speculative", "latched at the sequence's computed tokens", seq_id=e.seq_id,
                                    position=e.position, computed=seq.cursor.computed)
        seq.drafter.latched = True
        self._refresh(seq)
        return (e.seq_id,)

    def _running_between_steps(self, seq_id: int, what: str) -> Sequence:
        seq = self.seq(seq_id)
        if self.inflight is not None:
            raise TransitionRefused("Engine", f"{what} while a step is in flight", seq_id=seq_id,
                                    inflight=self.inflight.step)
        if seq.cursor.phase is not Phase.RUNNING or not seq.on_device:
            raise TransitionRefused("SequenceCursor", f"{what} of a sequence the data plane does not hold",
                                    seq_id=seq_id, phase=seq.cursor.phase.name)
        return seq

    def _snapshotted(self, e: BoundarySnapshotted) -> tuple[int, ...]:
        seq = self._running_between_steps(e.seq_id, "snapshot")
        if e.position != seq.cursor.computed:
            raise TransitionRefused("SsmRing", "a snapshot holds the sequence's computed tokens", seq_id=e.seq_id,
                                    position=e.position, computed=seq.cursor.computed)
        seq.ring.record(e.position, e.slot, e.evicted)
        self._refresh(seq)
        return (e.seq_id,)

    def _rolled_back(self, e: RolledBack) -> tuple[int, ...]:
        seq = self._running_between_steps(e.seq_id, "rollback")
        if e.attempt != seq.rollbacks + 1:
            raise TransitionRefused("Request", "rollback attempts count up from 1", seq_id=e.seq_id,
                                    attempt=e.attempt, taken=seq.rollbacks)
        # the data plane's restored cursors must be the boundary's, before anything here moves
        rows = seq.drafter.rows_at(e.boundary)
        expected = {"kv_tokens": e.boundary, "qsa_ingested": e.boundary, "ssm_position": e.boundary,
                    "ple_position": e.boundary, "drafter_rows": rows}
        if e.cursors != expected:
            raise TransitionRefused("BackendCursors", "the restored cursors are the boundary's", seq_id=e.seq_id,
                                    cursors=e.cursors, expected=expected)
        freed = seq.rollback(e.boundary, e.slot, e.keep, e.ban_token, e.blocks_freed, self.caps.block_size)
        forget_blocks(self, seq.blocks + freed, e.boundary)
        self.pool.release(seq.seq_id, freed)
        self._refresh(seq)
        return (e.seq_id,)

    def _declined(self, e: RollbackDeclined) -> tuple[int, ...]:
        self.seq(e.seq_id)  # a decline moves nothing; the request's finish follows as its own event
        return (e.seq_id,)

    def _faulted(self, e: EngineFaulted) -> tuple[int, ...]:
        if e.injected:
            kind = "fatal" if e.fatal else "step_error"
            self.pending_faults = [f for f in self.pending_faults if f[0] != kind]
        # a failed step executed nothing: its sequences end with error next (RequestFinished)
        if not e.injected and self.inflight is not None:
            self.failing.update(self.inflight.seqs)
        if e.fatal:
            self.failing.update(self.seqs)
        self.inflight = None
        self.inflight_hash = 0
        if e.fatal:
            self.dead = True
        return ()

    def _violated(self, e: InvariantViolated) -> tuple[int, ...]:
        self.dead = True
        return ()


_HANDLERS = {
    RequestArrived: ControlState._arrived,
    RequestCancelled: ControlState._cancelled,
    RequestFinished: ControlState._finished,
    FaultInjected: ControlState._fault_injected,
    SequencePreempted: ControlState._preempted,
    StepPlanned: ControlState._planned,
    StepExecuted: ControlState._executed,
    EngineFaulted: ControlState._faulted,
    BoundarySnapshotted: ControlState._snapshotted,
    RolledBack: ControlState._rolled_back,
    RollbackDeclined: ControlState._declined,
    SpeculationLatchedOff: ControlState._latched,
    InvariantViolated: ControlState._violated,
    PrefixCacheHit: prefix_hit,
    PrefixSnapshotted: prefix_snapshotted,
    CarryStored: carry_stored,
    CarryAdopted: carry_adopted,
    CarryReleased: carry_released,
}
