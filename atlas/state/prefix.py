"""Control-plane transitions of the prefix cache and the drafter carry (registered on ControlState).

Each validates everything first and refuses (TransitionRefused) before changing anything. What the data
plane must do for them is queued on the state (`ControlState.orders`) and handed to the next StepPlan, which
clears it: stores before the releases of that plan, restores after them, before any work.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator

from atlas.errors import TransitionRefused
from atlas.hashing import ROOT, block_key
from atlas.plan import PrefixRestore, PrefixStore
from atlas.state.control import ControlState, transition
from atlas.state.events import CarryAdopted, CarryReleased, CarryStored, PrefixCacheHit, PrefixSnapshotted
from atlas.state.machines import Phase, Sequence
from atlas.state.prefix_index import CarriedEntry, plan_adoption


def free_order(free: dict[int, None], cached: dict[int, int]) -> Iterator[int]:
    """The order free blocks are handed out in: uncached ones newest-freed first (the pool's own order),
    then cached ones least recently freed first (LRU: handing one out evicts it)."""
    if not cached:
        yield from reversed(free)
        return
    for b in reversed(free):
        if b not in cached:
            yield b
    for b in free:
        if b in cached:
            yield b


def expected_first_key(state: ControlState, seq: Sequence, position: int) -> int:
    """The drafter's first key on a prefix hit without a carry: hidden_{position - 1} comes with the
    snapshot, so keys from position - 1 on (from prompt_len - 1 when the drafter context is off)."""
    if state.caps.drafter_context:
        return position - 1
    return max(position - 1, seq.cursor.prompt_len - 1)


def _need_prefix(state: ControlState, what: str) -> None:
    if state.prefix is None:
        raise TransitionRefused("PrefixCache", f"{what} with prefix caching off")
    if state.inflight is not None:
        raise TransitionRefused("Engine", f"{what} while a step is in flight", inflight=state.inflight.step)


@transition(PrefixCacheHit)
def prefix_hit(state: ControlState, e: PrefixCacheHit) -> tuple[int, ...]:
    _need_prefix(state, "prefix hit")
    cache = state.prefix
    assert cache is not None
    seq = state.seq(e.seq_id)
    c = seq.cursor
    bs = state.caps.block_size
    fields = dict(seq_id=e.seq_id, key=e.key, position=e.position)
    if c.phase is not Phase.WAITING:
        raise TransitionRefused("PrefixCache", "a prefix hit starts a waiting sequence", phase=c.phase.name, **fields)
    if len(state.running) >= state.caps.max_batch_size:
        raise TransitionRefused("Scheduler", "a prefix hit takes a batch slot", running=len(state.running), **fields)
    hit = cache.lookup(c.tokens)  # the tokens re-checked: the event must be the lookup's answer
    if hit is None or (hit.key, hit.position, hit.matched, hit.blocks) != (e.key, e.position, e.matched, e.blocks):
        raise TransitionRefused("PrefixCache", "a prefix hit is the longest usable prefix of the tokens",
                                lookup=None if hit is None else [hit.key, hit.position, hit.matched], **fields)
    if e.replay != hit.replay:
        raise TransitionRefused("PrefixCache", "replay == matched - position", replay=e.replay, **fields)
    tail = e.position % bs != 0
    if tail != (e.tail_block >= 0) or (tail and (e.tail_block not in state.pool.free or e.tail_block in e.blocks)):
        raise TransitionRefused("BlockPool", "a free tail block exactly when the snapshot ends inside a block",
                                tail_block=e.tail_block, **fields)
    d = seq.drafter
    adopt = None
    if d.mtp:
        if e.drafter_last_key >= e.drafter_first_key:  # rows kept from the carry
            adopt = plan_adoption(state.carry, c.tokens, e.position) if state.carry is not None else None
            if adopt is None or (adopt.first_key, adopt.last_pair_key) != (e.drafter_first_key, e.drafter_last_key):
                raise TransitionRefused("DrafterCarry", "adopted rows are the carry's usable prefix",
                                        first_key=e.drafter_first_key, last_key=e.drafter_last_key, **fields)
        elif e.drafter_first_key != expected_first_key(state, seq, e.position):
            raise TransitionRefused("DrafterCarry", "without a carry the drafter starts at the snapshot",
                                    first_key=e.drafter_first_key, **fields)
    # every check passed
    for b in e.blocks:
        if state.pool.refs[b] == 0:
            del state.pool.free[b]
            state.pool.used += 1
        state.pool.refs[b] += 1
    blocks = list(e.blocks)
    if tail:
        state.pool.allocate(e.seq_id, (e.tail_block,))
        cache.evict_block(e.tail_block)
        blocks.append(e.tail_block)
    seq.start_from(e.position, blocks, list(hit.chain))
    if d.mtp:
        d.hold(e.drafter_first_key, e.drafter_last_key)
        d.carried = adopt is not None
    if adopt is not None:
        state.carry = None  # the rows move to the sequence
    cache.touch(e.key)
    state.waiting.remove(e.seq_id)
    insort(state.running, e.seq_id)
    state.orders.restores.append(PrefixRestore(e.seq_id, e.key, e.position, tuple(blocks), e.drafter_first_key,
                                               e.drafter_last_key, adopt is not None))
    return (e.seq_id,)


@transition(PrefixSnapshotted)
def prefix_snapshotted(state: ControlState, e: PrefixSnapshotted) -> tuple[int, ...]:
    _need_prefix(state, "prefix snapshot")
    cache = state.prefix
    assert cache is not None
    seq = state.seq(e.seq_id)
    c = seq.cursor
    if c.phase is not Phase.RUNNING or not seq.on_device or e.position != c.computed or e.position < 1:
        raise TransitionRefused("PrefixCache", "a prefix snapshot holds a running sequence's computed tokens",
                                seq_id=e.seq_id, position=e.position, computed=c.computed, phase=c.phase.name)
    if len(seq.prefix_chain) < e.position // state.caps.block_size:
        raise TransitionRefused("PrefixCache", "a prefix snapshot continues the sequence's cached chain",
                                seq_id=e.seq_id, position=e.position, chain=len(seq.prefix_chain))
    snap = cache.snapshot_for(c.tokens, e.position, seq.prefix_chain)
    if snap.key != e.key or cache.placement(e.key) != e.evicted:
        raise TransitionRefused("PrefixCache", "a prefix snapshot goes where placement() puts it",
                                seq_id=e.seq_id, key=e.key, expected=snap.key, evicted=e.evicted)
    cache.store(snap, e.evicted)
    state.orders.stores.append(PrefixStore(e.seq_id, e.position, e.key, e.evicted))
    return (e.seq_id,)


def register_blocks(state: ControlState, seq: Sequence) -> None:
    """After a step: the sequence's blocks that are now full of computed (committed) tokens join the cache."""
    cache = state.prefix
    if cache is None:
        return
    bs = state.caps.block_size
    chain = seq.prefix_chain
    tokens = seq.cursor.tokens
    for i in range(len(chain), seq.cursor.computed // bs):
        span = tokens[i * bs:(i + 1) * bs]
        h = block_key(chain[-1] if chain else ROOT, span)
        chain.append(h)
        cache.register_block(seq.blocks[i], h, span)


def forget_blocks(state: ControlState, blocks: list[int], boundary: int) -> None:
    """A rollback to `boundary`: the sequence's blocks (in order) from the one holding `boundary` on leave
    the cache (tokens past `keep` change; none of them is shared: a hit never reaches past a prompt)."""
    if state.prefix is None:
        return
    for b in blocks[boundary // state.caps.block_size:]:
        state.prefix.evict_block(b)


@transition(CarryStored)
def carry_stored(state: ControlState, e: CarryStored) -> tuple[int, ...]:
    if not state.caps.drafter_context:
        raise TransitionRefused("DrafterCarry", "a carry without the drafter prefill is unreachable",
                                seq_id=e.seq_id)
    _need_prefix(state, "carry store")
    seq = state.seq(e.seq_id)
    d = seq.drafter
    if not d.mtp or not seq.on_device or d.rows == 0 or (e.first_key, e.last_pair_key) != (d.first_key,
                                                                                           d.last_pair_key):
        raise TransitionRefused("DrafterCarry", "a carry stores a held sequence's drafter rows", seq_id=e.seq_id,
                                first_key=e.first_key, last_pair_key=e.last_pair_key, rows=d.rows,
                                held=[d.first_key, d.last_pair_key])
    state.carry = CarriedEntry(e.seq_id, tuple(seq.cursor.tokens[:d.last_pair_key + 2]), d.first_key,
                               d.last_pair_key)
    state.orders.carry_store = e.seq_id
    return (e.seq_id,)


@transition(CarryAdopted)
def carry_adopted(state: ControlState, e: CarryAdopted) -> tuple[int, ...]:
    seq = state.seq(e.seq_id)  # the hit moved the rows; this records what they were
    if not seq.drafter.carried or seq.drafter.rows != e.rows_kept:
        raise TransitionRefused("DrafterCarry", "an adoption names the rows its prefix hit kept", seq_id=e.seq_id,
                                rows_kept=e.rows_kept, rows=seq.drafter.rows, carried=seq.drafter.carried)
    return (e.seq_id,)


@transition(CarryReleased)
def carry_released(state: ControlState, e: CarryReleased) -> tuple[int, ...]:
    if state.carry is None:
        raise TransitionRefused("DrafterCarry", "release of a carry that is not held", reason=e.reason)
    if state.orders.carry_store == state.carry.seq_id:
        state.orders.carry_store = -1  # stored and released between two plans: never kept
    state.orders.carry_drop = True  # whatever the data plane holds from before goes too
    state.carry = None
    return ()
