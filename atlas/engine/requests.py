"""The requests' side of a step: stop conditions, the content-loop watchdog, finishes and the outputs.

`RequestBook.settle` runs after a step's StepExecuted: per sequence that produced tokens, in plan order, each
token goes through its StopChecker (EOS, stop ids, stop strings, the budget); a sequence that did not end is
shown to the watchdog, whose loop becomes a rollback (RolledBack: the restore is an order of the next plan) or,
when that cannot be made exact, a decline and a `stop`. It is a generator of events that reads the state as
the events before it left it; the engine applies each. RequestOutputs are collected as it goes. The decode
rows that can neither end nor emit are taken first, without the loop (atlas.engine.quiet, RequestBook's base).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import attrs

from atlas.config import EngineConfig
from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.engine.planner import Lanes
from atlas.engine.quiet import QuietRows
from atlas.engine.records import Held as _Held
from atlas.engine.rollback import RollbackPlan, plan_rollback
from atlas.engine.stopping import StopChecker, Tokenizer
from atlas.engine.watchdog import WatchdogConfig, detect_loop
from atlas.plan import SeqOutcome, StepPlan
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState
from atlas.state.events import Event, RequestFinished, RollbackDeclined, RolledBack
from atlas.state.machines import Sequence

_ASK = object()  # settle's `rest` not given: settle asks quiet_rows itself
Sampled = tuple[int, float | None, tuple[tuple[int, float], ...]]
# how the tokens ended the request (or None), the tokens it keeps, their logprobs, their top alternatives
Taken = tuple[tuple[FinishReason, str] | None, list[int], list[float], list[tuple[tuple[int, float], ...]]]


@attrs.define
class RequestCounts:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rollbacks: int = 0
    rollback_declines: int = 0


class RequestBook(QuietRows):
    """The requests' stop checkers, held-back outputs and counts; settle (its quiet rows: atlas.engine.quiet)."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, *, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer if detokenize else None
        self.eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
        self.config = config
        self.watchdog = WatchdogConfig(config.watchdog_max_period, config.watchdog_min_repeats,
                                       config.watchdog_min_span, config.watchdog_window) if config.loop_watchdog else None
        self.stops: dict[int, StopChecker] = {}
        # non-streaming requests: tokens held back until the request ends, so a rollback never retracts text
        self.held: dict[int, _Held] = {}
        self.pending: list[RequestOutput] = []  # outputs made between steps (cancels), handed out by the next
        self.counts = RequestCounts()
        # prompt logprobs by sequence (position -> (logprob, top)) until the request's first output carries them
        self.prompt_lp: dict[int, dict[int, tuple[float | None, tuple[tuple[int, float], ...]]]] = {}
        # decode([t]) of this book's tokenizer, by skip_special_tokens (StopChecker.pieces): decode is pure, so every
        # request shares one memo; at most one entry per vocabulary id
        self.pieces: dict[bool, dict[int, str]] = {True: {}, False: {}}
        super().__init__()  # settle's quiet rows and their lag (atlas.engine.quiet)

    def _checker(self, params: SamplingParams, max_new: int) -> StopChecker:
        pieces = self.pieces[params.skip_special_tokens] if self.tokenizer is not None else None
        return StopChecker.create(params, max_new, self.eos, pieces)

    def admit(self, seq_id: int, params: SamplingParams, max_new: int, prompt_len: int, stream: bool) -> None:
        if not stream:
            self.held[seq_id] = _Held()
        self.stops[seq_id] = self._checker(params, max_new)
        self.counts.prompt_tokens += prompt_len

    def forget(self, seq_id: int) -> None:
        if self._lag and seq_id in self._quiet.lagged:  # type: ignore[union-attr]
            self._flush_lag()
        self.stops.pop(seq_id, None)
        self.held.pop(seq_id, None)
        self.prompt_lp.pop(seq_id, None)

    def _take_prompt_logprobs(self, seq_id: int, prompt_len: int
                              ) -> tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...] | None:
        got = self.prompt_lp.pop(seq_id, None)
        if got is None:
            return None
        return tuple(got.get(pos, (None, ())) for pos in range(prompt_len))

    def take_pending(self) -> list[RequestOutput]:
        out, self.pending = self.pending, []
        return out

    # -------------------------------------------------------------------------------------------- finishes

    def finish_error(self, state: ControlState, seq_id: int, detail: str, out: list[RequestOutput]) -> Iterator[Event]:
        if self._lag and seq_id in self._quiet.lagged:  # type: ignore[union-attr]
            self._flush_lag()
        seq = state.seqs[seq_id]
        request_id, prompt_len, generated = seq.request_id, seq.cursor.prompt_len, seq.cursor.generated
        yield RequestFinished(seq_id, FinishReason.ERROR.value, detail)
        self.forget(seq_id)
        out.append(RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, finish_detail=detail,
                                 prompt_tokens=prompt_len, completion_tokens=generated))

    def quiet_rows(self, state: ControlState, ordered: tuple[SeqOutcome, ...], refused: dict[int, str]
                   ) -> list[int] | None:
        """settle's quiet path, taken first: for a decode of the batch columns, the rows settle still has to take
        (`_settle_quiet`; [] when none: settle then has nothing to do), else None (settle takes every row). The
        engine asks before making settle's generator (none is needed for a step every row of which was quiet)."""
        cols = state.batch
        if (self.watchdog is None and not refused and cols is not None and cols.aligned is not None
                and cols.aligned.outcomes is ordered and cols.last is not None):  # a decode of the batch columns
            return self._settle_quiet(cols)
        return None

    def settle(self, state: ControlState, plan: StepPlan, ordered: tuple[SeqOutcome, ...], refused: dict[int, str],
               lanes: Lanes, out: list[RequestOutput], rest: list[int] | None | object = _ASK) -> Iterator[Event]:
        """`rest`: what quiet_rows returned for this step, when the caller asked it already (else settle asks)."""
        seqs = state.seqs
        quiet = self.watchdog is None  # a held-back request that did not end then has nothing to emit
        held = self.held
        tokenizer = self.tokenizer
        counts = self.counts
        stops = self.stops
        pairs = zip(plan.work, ordered, strict=True)
        if rest is _ASK:
            rest = self.quiet_rows(state, ordered, refused)
        if rest is not None:  # the rows the quiet path left (none of them lagged)
            if not rest:
                return
            work = plan.work
            pairs = ((work[i], ordered[i]) for i in rest)  # type: ignore[assignment, union-attr]
        elif self._lag:  # every row through the loop below: the quiet rows' checkers and held tokens current first
            self._flush_lag()
        for w, o in pairs:
            if o.prompt_logprobs:
                self.prompt_lp.setdefault(w.seq_id, {}).update((pos, (lp, top)) for pos, lp, top in o.prompt_logprobs)
            if w.seq_id in refused:
                yield from self.finish_error(state, w.seq_id, refused[w.seq_id], out)
                continue
            if w.drafts:
                n = o.accepted
                sampled: list[Sampled] = [(v.token, v.logprob, v.top_logprobs) for v in o.verdicts[:n + 1]]
                if not sampled:
                    continue
                seq = seqs[w.seq_id]
                taken = self._take(seq, sampled)
            elif o.token is None:
                continue
            else:  # one token: _take written out for it, the per-sequence path of every decode step
                seq_id = w.seq_id
                token = o.token
                p = w.sampling  # the sequence's params (plan_step's SeqWork carries them)
                counts.generated_tokens += 1
                ended = stops[seq_id].on_token(token, tokenizer)
                h = held.get(seq_id)
                if not p.logprobs:  # the common request: no logprobs to keep (_Held.add without them)
                    if h is not None:
                        h.tokens.append(token)
                        if quiet and ended is None:
                            continue  # held back and not ended: no event, no output (and no generator made)
                    taken = (ended, [token], [], [])
                else:
                    lp = (o.logprob,) if o.logprob is not None else ()
                    tp = (o.top_logprobs,) if p.top_logprobs else ()
                    if h is not None:
                        h.add(token, lp, tp)
                        if quiet and ended is None:
                            continue
                    taken = (ended, [token], list(lp), list(tp))
                seq = seqs[seq_id]
            yield from self._settle_seq(state, seq, taken, plan.step, lanes, out)
        if not refused:
            return
        in_work = {w.seq_id for w in plan.work}
        for seq_id, why in refused.items():  # an order refused for a sequence with no work in the plan
            if seq_id not in in_work and seq_id in state.seqs:
                yield from self.finish_error(state, seq_id, why, out)

    def _take(self, seq: Sequence, sampled: list[Sampled]) -> Taken:
        """Each sampled token through the stop checker (and into the held-back output): (how it ended or None,
        the tokens the request keeps, their logprobs, their top alternatives)."""
        if self._lag:
            self._flush_lag()
        stop = self.stops[seq.seq_id]
        p = seq.params
        held = self.held.get(seq.seq_id)
        tokenizer = self.tokenizer
        new_tokens: list[int] = []
        logprobs: list[float] = []
        top: list[tuple[tuple[int, float], ...]] = []
        ended = None
        for token, token_logprob, token_top in sampled:
            self.counts.generated_tokens += 1
            ended = stop.on_token(token, tokenizer)
            lp = (token_logprob,) if p.logprobs and token_logprob is not None else ()
            tp = (token_top,) if p.logprobs and p.top_logprobs else ()
            new_tokens.append(token)
            logprobs.extend(lp)
            top.extend(tp)
            if held is not None:
                held.add(token, lp, tp)
            if ended is not None:  # a verify's tokens past a stop are the engine's, never the request's
                break
        return ended, new_tokens, logprobs, top

    def _settle_seq(self, state: ControlState, seq: Sequence, taken: Taken, step: int, lanes: Lanes,
                    out: list[RequestOutput]) -> Iterator[Event]:
        """After a sequence's tokens went through its stop checker: the watchdog, the finish, the output."""
        ended, new_tokens, logprobs, top = taken
        if self._lag and seq.seq_id in self._quiet.lagged:  # type: ignore[union-attr]
            self._flush_lag()  # (a row the quiet path left, a streaming one, reads only its own checker)
        stop = self.stops[seq.seq_id]
        held = self.held.get(seq.seq_id)
        if ended is None and self.watchdog is not None:
            watched = yield from self._watch(state, seq, step)
            if watched == "rolled_back":  # the tokens are gone with the loop; a held request goes on
                return
            ended = watched
        request_id, prompt_len = seq.request_id, seq.cursor.prompt_len
        scored = self._take_prompt_logprobs(seq.seq_id, prompt_len) if held is None or ended is not None else None
        if ended is not None:
            if lanes.prefix is not None:
                yield from lanes.prefix.on_finish(state, seq, ended[0], step)
            yield RequestFinished(seq.seq_id, ended[0].value, ended[1])
            self.forget(seq.seq_id)
        if held is None or ended is not None:
            token_ids, lps, tps = tuple(new_tokens), tuple(logprobs), tuple(top)
            if held is not None:  # the whole completion, in one output
                token_ids, lps, tps = tuple(held.tokens), tuple(held.logprobs), tuple(held.top)
            out.append(RequestOutput(
                request_id, new_token_ids=token_ids, new_logprobs=lps, new_top_logprobs=tps,
                finished=ended is not None, finish_reason=None if ended is None else ended[0],
                finish_detail=None if ended is None else ended[1], prompt_tokens=prompt_len,
                completion_tokens=stop.count,
                new_text=stop.take_text(ended is not None) if self.tokenizer is not None else "",
                prompt_logprobs=scored,
            ))

    # ----------------------------------------------------------------------------------------- rollback

    def _watch(self, state: ControlState, seq: Sequence, step: int
               ) -> Iterator[Event]:  # returns (FinishReason, detail) | "rolled_back" | None
        assert self.watchdog is not None
        c = seq.cursor
        verdict = detect_loop(c.tokens[c.prompt_len:], self.watchdog)
        if verdict is None:
            return None
        return (yield from self.roll_back(state, seq, c.prompt_len + verdict.opens_at, verdict.period, step))

    def roll_back(self, state: ControlState, seq: Sequence, keep: int, period: int, step: int
                  ) -> Iterator[Event]:  # returns "rolled_back" or the finish (`stop` with the decline's reason)
        """Rewind `seq` so that it keeps tokens[:keep] and resamples position `keep` with the token there banned,
        or decline. A target outside (prompt_len, seq_len) raises ValueError having changed nothing."""
        if self._lag:
            self._flush_lag()
        decision = plan_rollback(seq, keep, max_rollbacks=self.config.max_rollbacks,
                                 block_size=state.caps.block_size)
        if isinstance(decision, RollbackPlan):
            yield RolledBack(step, seq.seq_id, decision.boundary, decision.slot, keep, decision.ban_token,
                             decision.blocks_freed, period, seq.rollbacks + 1)
            self.counts.rollbacks += 1
            self._rewind_outputs(seq)
            return "rolled_back"
        reason = decision.reason.value
        yield RollbackDeclined(step, seq.seq_id, reason, keep, period)
        self.counts.rollback_declines += 1
        return FinishReason.STOP, f"content loop (period {period}): rollback declined: {reason}"

    def _rewind_outputs(self, seq: Sequence) -> None:
        """After a rollback: the stop checker and the held-back output as if the dropped tokens never came."""
        if self._lag:
            self._flush_lag()
        c = seq.cursor
        stop = self._checker(seq.params, seq.max_new)
        for t in c.tokens[c.prompt_len:]:
            stop.on_token(t, self.tokenizer)
        self.stops[seq.seq_id] = stop
        held = self.held.get(seq.seq_id)
        if held is not None:
            held.truncate(c.generated)


Watched = tuple[FinishReason, str] | Literal["rolled_back"] | None
