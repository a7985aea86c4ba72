"""A step's decisions and its plan, both pure functions of the control-plane state.

    for e in schedule(state, lanes): journal.apply(e)   # prefix hits, latches, preemptions, the carry, StepPlanned
    plan = plan_step(state, lanes)                       # the StepPlan of the step now in flight

`schedule` is a generator: each decision reads the state as the events before it left it (a prefix hit takes
blocks and a batch slot the next hit must see), and never mutates it; the caller applies every event. The
plan is then read off the state alone: the StepPlanned in flight, the orders the events between the last
step and this one queued (rollback restores, prefix stores and restores, the carry), and each sequence's
block table, drafts and bans. No part of it is patched in afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from atlas.engine.drafters.lane import SpeculativeLane
from atlas.engine.prefix_lane import PrefixLane
from atlas.engine.rollback import plan_snapshots
from atlas.engine.scheduler import Schedule, batch
from atlas.plan import RowOffset, SeqWork, StepPlan
from atlas.state.control import ControlState
from atlas.state.events import Event, SequencePreempted, StepPlanned
from atlas.state.machines import Sequence

row_at = RowOffset.at


@attrs.define
class Lanes:
    """The optional parts of a step: speculative decoding and prefix caching (None when off)."""

    spec: SpeculativeLane | None = None
    prefix: PrefixLane | None = None
    eos: tuple[int, ...] = ()  # the tokenizer's EOS ids: banned, with the stop ids, while a request is in min_tokens


def min_tokens_ban(seq: Sequence, eos: tuple[int, ...]) -> tuple[int, ...]:
    """The stop tokens a sequence may not sample next: all of them while it is within min_tokens, none after."""
    p = seq.params
    if not p.min_tokens or seq.cursor.generated >= p.min_tokens:
        return ()
    return tuple(sorted({*p.stop_token_ids, *(() if p.ignore_eos else eos)}))


def planned_drafts(drafts: dict[int, tuple[int, ...]], decided: Schedule) -> tuple[tuple[int, ...], ...]:
    """The drafts each planned sequence verifies, as the scheduler cut them (aligned with decided.seqs)."""
    if not decided.drafts:
        return ()
    return tuple(drafts[seq_id][:k] if k else () for seq_id, k in zip(decided.seqs, decided.drafts, strict=True))


def schedule(state: ControlState, lanes: Lanes) -> Iterator[Event]:
    """The step's events, in order; nothing when there is nothing to do."""
    if lanes.prefix is not None:  # waiting sequences that hit the cache start running from it
        yield from lanes.prefix.admit(state)
    drafts: dict[int, tuple[int, ...]] = {}
    if lanes.spec is not None:
        yield from lanes.spec.latches(state)
        drafts = lanes.spec.drafts(state)
    decided = batch(state, {seq_id: len(d) for seq_id, d in drafts.items()} if drafts else None)
    o = state.orders
    if decided.idle and not (state.pending_release or o.stores or o.restores or o.rollbacks or o.carry_drop
                             or o.carry_store >= 0):
        return
    step = state.step
    for seq_id in decided.preempt:
        yield SequencePreempted(seq_id, len(state.seqs[seq_id].blocks), "kv blocks exhausted")
    if lanes.prefix is not None:
        yield from lanes.prefix.admitted(state, decided.admitted)
    yield StepPlanned(step, decided.admitted, decided.seqs, decided.fed, decided.alloc, tuple(state.pending_release),
                      decided.preempt, planned_drafts(drafts, decided),
                      tuple(r.seq_id for r in state.orders.rollbacks) if state.orders.rollbacks else ())


def plan_step(state: ControlState, lanes: Lanes, reuse: bool = False) -> StepPlan:
    """The data plane's work for the step in flight (after its StepPlanned was applied). `reuse`: the caller owns
    the plan and lends it for this step only (atlas.plan: who owns a plan), so a decode's SeqWork may be the last
    decode's objects moved in place (BatchColumns.decode_work); the Engine passes it unless its backend declares
    `retains_plans`. Off (the default), every SeqWork is new and none is moved later."""
    planned = state.inflight
    assert planned is not None, "plan_step needs a step in flight"
    seqs = state.seqs
    spec = lanes.spec
    cols = state.batch
    decoded = None
    # a decode of the cached batch (speculation off, or a step at which the lane drafts and proposes nothing): its rows
    if cols is not None and planned.seqs == cols.ids and (spec is None or spec.plain(planned.drafts)):
        decoded = cols.decode_work(SeqWork, reuse)
    if decoded is not None:
        work: list[SeqWork] | tuple[SeqWork, ...] = decoded
    else:
        work = _work(state, planned, lanes)
    # the ring off (ring_slots 0, every sequence's): no sequence snapshots (plan_snapshots' first test, for the batch)
    snapshots = plan_snapshots(seqs, planned.seqs, planned.fed, state.caps.snapshot_interval) if (
        state.caps.ring_slots) else ()
    o = state.inflight_orders
    return StepPlan(planned.step, tuple(work), planned.release, planned.reset,
                    snapshots=snapshots,
                    restores=tuple(o.rollbacks), prefix_stores=tuple(o.stores), prefix_restores=tuple(o.restores),
                    carry=o.carry)


def _work(state: ControlState, planned: StepPlanned, lanes: Lanes) -> list[SeqWork]:
    """plan_step's SeqWork per planned sequence, from the objects."""
    seqs = state.seqs
    drafts = planned.drafts or ((),) * len(planned.seqs)
    spec = lanes.spec
    eos = lanes.eos
    work = []
    append = work.append
    for seq_id, n, verify in zip(planned.seqs, planned.fed, drafts, strict=True):
        seq = seqs[seq_id]
        c = seq.cursor
        start = c.computed
        end = start + n
        toks = c.tokens
        sample = end == len(toks)
        p = seq.params
        propose = spec.proposes(seq) if spec is not None and sample else 0
        if sample and (seq.banned or p.min_tokens):  # else nothing is banned (the common case, no set built)
            banned = tuple(sorted({*seq.banned.get(end, ()), *min_tokens_ban(seq, eos)}))
        else:
            banned = ()
        # positional: SeqWork(seq_id, tokens, start, block_table, sample, sampling, banned, drafts,
        # drafter_first_key, propose, prompt_logprobs); a decode's one token without a slice; the start typed
        # (atlas_kernels.rows.RowOffset: the backends turn it into addresses); prompt logprobs for prompt positions only
        w = SeqWork(seq_id, (toks[start],) if n == 1 else tuple(toks[start:end]), row_at(start), tuple(seq.blocks),
                    sample, p, banned, verify, seq.drafter.first_key, propose,
                    p.prompt_logprobs if start < c.prompt_len else None)
        if sample and p.reads_history:  # the penalties' tokens (never speculated: the lane drafts none for it)
            w.history, w.prompt_len = tuple(toks[:end]), c.prompt_len
        append(w)
    return work
