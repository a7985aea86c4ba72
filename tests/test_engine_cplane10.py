"""The fourth session-14 pass's shortcuts (docs/CONTROL-PLANE.md, "Fourth pass (session 14)"): each must leave the engine
exactly where its slow form leaves it. settle's lag (RequestBook._settle_quiet / _flush_lag) keeps a decode step's
tokens instead of writing every quiet row's checker and held tokens: runs with it on and off give the same outputs
every step, the same events and digests, and, once flushed, the same checkers and held tokens."""

from __future__ import annotations

import attrs

from atlas.config import EngineConfig
from atlas.engine.records import RecordingSink
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

REQUESTS = 30


def _params(i: int) -> SamplingParams:
    kind = i % 6
    if kind == 1 and i < 12:  # stop ids: a token in the quiet rows' union sends the step to the loop
        return SamplingParams(max_tokens=50, temperature=0.9, seed=i, stop_token_ids=[70, 111], ignore_eos=True)
    if kind == 2:  # budgets ending one by one, mid-batch
        return SamplingParams(max_tokens=30 + 2 * i, temperature=0.7, seed=i, ignore_eos=True)
    if kind == 3:  # not quiet (logprobs): the rows the quiet path leaves
        return SamplingParams(max_tokens=40, temperature=0.6, seed=i, logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=44 + i % 7, temperature=0.8, seed=i, min_tokens=2 if kind == 4 else 0,
                          ignore_eos=kind != 5)


def _book_state(engine) -> dict:  # type: ignore[no-untyped-def]
    book = engine.book
    if book._lag:
        book._flush_lag()
    stops = {s: (c.count, list(c.later), c.text, list(c.unread), c.emitted, c.cut) for s, c in book.stops.items()}
    held = {s: (list(h.tokens), list(h.logprobs), list(h.top)) for s, h in book.held.items()}
    return {"stops": stops, "held": held, "counts": attrs.asdict(book.counts)}


def _run(lag: bool, *, cancel_at: int = 11, compare_every: int = 9) -> tuple[list, list, list, int]:
    config = EngineConfig(max_seq_len=128, max_batch_size=24, prefill_chunk_tokens=200, block_size=8)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.book.lag = lag
    for i in range(REQUESTS - 6):
        engine.add_request(f"r{i}", [(i * 5 + k) % 190 + 2 for k in range(4 + (i * 3) % 17)], _params(i),
                           stream=i % 7 == 6)
    outputs, books = [], []
    longest = 0
    step = 0
    while engine.has_unfinished():
        if step == 14:  # arrivals while the batch decodes: the batch's rows change
            for i in range(REQUESTS - 6, REQUESTS):
                engine.add_request(f"r{i}", [i + 3] * (3 + i % 4), _params(i))
        if step == cancel_at and "r4" in engine.state.by_request:
            engine.cancel("r4")  # a cancel between steps flushes the lag first
        outputs.append(engine.step())
        longest = max(longest, len(engine.book._lag))
        if step % compare_every == compare_every - 1:
            books.append(_book_state(engine))
        step += 1
    books.append(_book_state(engine))
    engine.close()
    return outputs, [(i, s, e, d) for i, s, e, d in sink.rows], books, longest


def test_lag_gives_the_same_outputs_events_and_book() -> None:
    out_on, rows_on, books_on, longest = _run(True)
    out_off, rows_off, books_off, none = _run(False)
    assert none == 0
    assert longest >= 5  # steps were lagged (the comparison above is of something)
    assert out_on == out_off
    assert rows_on == rows_off
    assert books_on == books_off


def test_lag_flushed_every_step_is_the_loop() -> None:
    """Flushed after every step (at most one lagged step), and never compared mid-run: the same as off."""
    out_on, rows_on, books_on, _ = _run(True, compare_every=1)
    out_off, rows_off, books_off, _ = _run(False, compare_every=1)
    assert (out_on, rows_on, books_on) == (out_off, rows_off, books_off)
