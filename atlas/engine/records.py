"""What the engine keeps about its outputs and events: where events go (a sink), the statistics it reports,
and the held-back output of a non-streaming request."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from atlas.state.events import Event


class EventSink(Protocol):
    def append(self, index: int, step: int, e: Event, digest: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@attrs.define
class Held:
    """A non-streaming request's output so far, handed out in one RequestOutput when it ends."""

    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top: list[tuple[tuple[int, float], ...]] = attrs.Factory(list)

    def add(self, token: int, logprobs: tuple[float, ...], top: tuple) -> None:
        self.tokens.append(token)
        self.logprobs.extend(logprobs)
        self.top.extend(top)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        del self.logprobs[n:]
        del self.top[n:]


class RecordingSink:
    """Keeps events in memory (replay verify, tests)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, Event, str]] = []

    def append(self, index: int, step: int, e: Event, digest: str) -> None:
        self.rows.append((index, step, e, digest))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@attrs.frozen
class EngineStats:
    step: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    invariant_checks: int
    trace_events_written: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    rollbacks_total: int = 0
    rollback_declines_total: int = 0
    # speculative decoding (atlas.sampling.acceptance.AcceptanceStats): per draft position, unconditional
    # rates (each row's own verdict, bias-free) and conditional ones (given every earlier draft accepted)
    spec_verify_steps: int = 0
    spec_drafts_proposed: int = 0
    spec_drafts_accepted: int = 0
    spec_tokens_per_verify: float = 0.0
    spec_acceptance_p1: float = 0.0
    spec_acceptance_unconditional: tuple[float, ...] = ()
    spec_acceptance_conditional: tuple[float, ...] = ()
    spec_latched_off_total: int = 0
    # the draft-count policy (atlas.engine.drafters.policy): the last step's choice, and steps by choice 0..num_drafts
    spec_draft_choice: int = 0
    spec_steps_by_drafts: tuple[int, ...] = ()
    # prefix caching and the drafter carry (atlas.engine.prefix_lane.PrefixStats); coverage = drafter rows /
    # prompt length when a new turn's prefill completes, warm (prefix hit) and cold turns
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_tokens_saved: int = 0
    prefix_tokens_replayed: int = 0
    carry_adopted_total: int = 0
    drafter_coverage_warm: float = 0.0
    drafter_coverage_cold: float = 0.0


def engine_stats(engine: Any) -> EngineStats:
    """The statistics of an atlas.engine.engine.Engine."""
    state, counts = engine.state, engine.book.counts
    pool = state.pool
    extra: dict[str, Any] = {}
    spec = engine.lanes.spec
    if spec is not None:
        acc = spec.stats
        unc = acc.p_unconditional()
        extra.update(spec_verify_steps=acc.verify_steps, spec_drafts_proposed=acc.drafts_proposed,
                     spec_drafts_accepted=acc.drafts_accepted, spec_tokens_per_verify=acc.tokens_per_verify,
                     spec_acceptance_p1=unc[0] if unc else 0.0, spec_acceptance_unconditional=tuple(unc),
                     spec_acceptance_conditional=tuple(acc.p_conditional()),
                     spec_latched_off_total=spec.latched_total, spec_draft_choice=spec.choice,
                     spec_steps_by_drafts=tuple(spec.choices[k] for k in range(spec.num_drafts + 1)))
    prefix = engine.lanes.prefix
    if prefix is not None:
        s = prefix.stats
        extra.update(prefix_cache_queries=s.queries, prefix_cache_hits=s.hits, prefix_tokens_saved=s.tokens_saved,
                     prefix_tokens_replayed=s.tokens_replayed, carry_adopted_total=s.carry_adopted,
                     drafter_coverage_warm=s.warm_coverage, drafter_coverage_cold=s.cold_coverage)
    return EngineStats(
        step=state.step, num_running=len(state.running), num_waiting=len(state.waiting), kv_blocks_total=pool.total,
        kv_blocks_used=pool.used, kv_usage=pool.used / pool.total, invariant_checks=engine.journal.checks,
        trace_events_written=engine.journal.index if engine.sink is not None else 0,
        prompt_tokens_total=counts.prompt_tokens, generation_tokens_total=counts.generated_tokens,
        preemptions_total=state.preemptions_total, rollbacks_total=counts.rollbacks,
        rollback_declines_total=counts.rollback_declines, **extra)
