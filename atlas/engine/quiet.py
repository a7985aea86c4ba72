"""settle's quiet rows and their lag (atlas.engine.requests.RequestBook's base): the decode steps of the batch
columns whose rows are held back without logprobs or stop strings, taken without settle's per-row loop.

A quiet row yields no event and no output and moves only its own stop checker and held tokens, so it is taken
first (`_settle_quiet`) and settle's loop takes the rest in order; while no quiet row can end, a step's tokens are
kept (the lag) and written to the rows at once (`_flush_lag`) before anything else in the book reads them.
"""

from __future__ import annotations

from operator import attrgetter, sub
from typing import Any

from atlas.engine.records import Held
from atlas.engine.stopping import StopChecker, Tokenizer
from atlas.state.batch_columns import BatchColumns

_PROMPT_LOGPROBS = attrgetter("prompt_logprobs")
_COUNT = attrgetter("count")


class QuietRows:
    lag = True  # settle's lag on (_settle_quiet); off: every quiet row written every step (tests compare the two)

    # the book's (RequestBook), read and moved here
    tokenizer: Tokenizer | None
    held: dict[int, Held]
    stops: dict[int, StopChecker]
    counts: Any  # RequestCounts: generated_tokens

    def __init__(self) -> None:
        # the batch columns settle's quiet rows were built for, and those rows (_settle_quiet)
        self._quiet: _Quiet | None = None
        # settle's lag (_settle_quiet): the tokens (BatchColumns.last, one list a step, never mutated) of the decode
        # steps whose quiet rows are not yet written to their checkers and held tokens (_flush_lag writes them), and
        # min(max_new - count) over the quiet rows' checkers as they stand (None: to be computed again)
        self._lag: list[list[int]] = []
        self._room: int | None = None

    def _settle_quiet(self, cols: BatchColumns) -> list[int] | None:
        """settle's loop for the rows of a decode step over the engine's batch columns (atlas.state.batch_columns:
        outcome found every row sampled one token, in the rows' order, none refused) whose request is held back
        without logprobs or stop strings and whose token neither is a stop token nor reaches the budget: exactly what
        the loop and StopChecker.on_token do for such a row (the count, the token held, and waiting for its text),
        without the call and the reads of each. Such a row yields no event and no output and moves only its own
        checker and held tokens, so taking it first leaves every other row's events and outputs in their order.
        Returns the rows the loop still has to take, in order (None: all of them). No watchdog (the caller's
        `quiet`), none refused, no prompt logprobs reported (looked at here).

        The lag: when every quiet row passes (no quiet row's budget reached: len(lag) + 1 < min(max_new - count) over
        their checkers; no token of the step in the union of their stop ids), the step's tokens are kept
        (`_lag`) instead of written to 64 checkers and held lists; `_flush_lag` writes every lagged step at once
        (the count moved by the steps, the tokens appended in order: what the loop below would have done at each)
        before anything else in this book reads or moves them: any other path of settle, a finish, a cancel, an
        error, a rollback, or other rows (the batch changed). The tests are the loop's own per row, for every row
        at once: the budget by the smallest room, the stop ids by their union (a token in the union but not in its
        row's own ids only sends the step to the loop)."""
        walked = cols.cursor_target
        if (walked is None or walked[0] is not cols.aligned) and any(map(_PROMPT_LOGPROBS,
                                                                         cols.aligned.outcomes)):  # type: ignore[union-attr]
            return None  # (outcome's walk of these outcomes found none)
        q = self._quiet
        if q is None or q.ids is not cols.ids:  # per batch: built again when its rows change
            if self._lag:
                self._flush_lag()  # the lagged steps are the old rows'
            q = self._quiet = _Quiet(cols.ids, self._quiet_checkers(cols))
        tokens = cols.last
        assert tokens is not None
        if not q.at:
            return q.rest
        room = self._room
        if room is None:
            room = self._room = min(map(sub, q.max_new, map(_COUNT, q.stops)))
        lag = self._lag
        if self.lag and len(lag) + 1 < room and (not q.stop_ids or q.stop_ids.isdisjoint(tokens)):
            lag.append(tokens)  # a new list every step (BatchColumns.advance, without): never mutated after
            self.counts.generated_tokens += len(q.at)
            return q.rest
        if lag:
            self._flush_lag()
        self._room = None  # the loop moves the counts
        rest = []
        done = 0
        for r, (row, token) in enumerate(zip(q.rows, tokens, strict=True)):
            if row is not None:
                stop, later, hold = row
                count = stop.count + 1
                if count < stop.max_new and token not in stop.stop_ids:  # else it may end here: on_token
                    stop.count = count
                    later.append(token)  # on_token: no stop strings, so the text waits (StopChecker.later)
                    hold.append(token)
                    done += 1
                    continue
            rest.append(r)
        self.counts.generated_tokens += done
        return rest

    def _flush_lag(self) -> None:
        """The lagged steps' tokens written to the quiet rows they were kept for (`_settle_quiet`), in step order:
        each row's count moved by the number of steps, its tokens appended to its checker's `later` and its held
        tokens, as the loop would have done step by step."""
        lag = self._lag
        q = self._quiet
        assert q is not None
        k = len(lag)
        by_row = list(zip(*lag, strict=True))  # row r's tokens of every lagged step, in order
        for r, (stop, later, hold) in zip(q.at, q.stops_rows, strict=True):
            toks = by_row[r]
            stop.count += k
            later.extend(toks)
            hold.extend(toks)
        self._lag = []
        self._room = None

    def _quiet_checkers(self, cols: BatchColumns) -> list[tuple[StopChecker, list[int], list[int]] | None]:
        """(stop checker, its `later` list, the held tokens' list) of every row; None for a row whose request
        streams, asks for logprobs or stop strings, or whose checker has not seen this tokenizer yet."""
        tokenizer = self.tokenizer
        out: list[tuple[StopChecker, list[int], list[int]] | None] = []
        for seq_id, p in zip(cols.ids, cols.params, strict=True):
            h = self.held.get(seq_id)
            stop = self.stops.get(seq_id)
            # settle reads the logprobs flag from the plan's params, on_token the stop strings from its own
            if (tokenizer is None or h is None or stop is None or p.logprobs or stop.params.stop
                    or stop.tokenizer is not tokenizer):
                out.append(None)
            else:
                out.append((stop, stop.later, h.tokens))
        return out


class _Quiet:
    """settle's quiet rows of one batch (RequestBook._settle_quiet): per row (checker, later, held) or None, the
    quiet rows' indices, checkers, (checker, later, held) rows and budgets, the others' indices, the union of the
    quiet rows' stop ids, and the quiet rows' sequence ids."""

    __slots__ = ("ids", "rows", "at", "stops", "stops_rows", "max_new", "rest", "stop_ids", "lagged")

    def __init__(self, ids: tuple[int, ...], rows: list[tuple[StopChecker, list[int], list[int]] | None]) -> None:
        self.ids = ids
        self.rows = rows
        self.at = [r for r, row in enumerate(rows) if row is not None]
        self.stops_rows = [row for row in rows if row is not None]
        self.stops = [row[0] for row in self.stops_rows]
        self.max_new = [stop.max_new for stop in self.stops]
        self.rest = [r for r, row in enumerate(rows) if row is None]
        self.lagged = {ids[r] for r in self.at}  # the sequences whose checkers a lag holds back
        self.stop_ids = frozenset().union(*(stop.stop_ids for stop in self.stops))
