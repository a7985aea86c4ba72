"""Turning a request's token stream into the text a client sees: stop strings cut, nothing taken back.

Text already sent in a stream can never be retracted, so the tail that could still become a stop string,
or that ends in an incomplete UTF-8 sequence (decoded as U+FFFD), is held back until it is settled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextAssembler:
    """Incremental detokenizer for one request. `push` returns the newly settled text."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.text = ""  # everything settled so far (what the client has been sent)
        self.hit_stop: str | None = None

    def push(self, new_token_ids: Sequence[int], *, final: bool = False) -> str:
        self.token_ids.extend(new_token_ids)
        if self.hit_stop is not None:
            return ""
        full = self._decode(self.token_ids)
        cut, hit = self._first_stop(full)
        if hit is not None:
            self.hit_stop = hit
            settled = full[:cut]
        elif final:
            settled = full
        else:
            settled = full[: len(full) - self._unsettled_tail(full)]
        if len(settled) <= len(self.text) or not settled.startswith(self.text):
            return ""  # nothing new, or the decoder revised earlier text: wait until it settles
        delta = settled[len(self.text) :]
        self.text = settled
        return delta

    def _first_stop(self, full: str) -> tuple[int, str | None]:
        # only text that could contain a new match is searched: the held-back tail and what follows it
        start = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        best, hit = len(full), None
        for s in self._stop:
            i = full.find(s, start)
            if 0 <= i < best:
                best, hit = i, s
        return best, hit

    def _unsettled_tail(self, full: str) -> int:
        tail = len(full) - len(full.rstrip(REPLACEMENT))
        for s in self._stop:  # the longest suffix of `full` that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    tail = max(tail, k)
                    break
        return tail


def token_text(decode: Callable[[list[int]], str], token_id: int) -> str:
    return decode([token_id])


def completion_logprobs(
    decode: Callable[[list[int]], str],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
    want_top: int,
    text_offset: int,
) -> dict:
    """The legacy completions `logprobs` object for a run of tokens."""
    tokens = [token_text(decode, t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    tops = None
    if want_top:
        tops = [{token_text(decode, t): lp for t, lp in alts} for alts in top] if top else [{} for _ in tokens]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    decode: Callable[[list[int]], str],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
) -> dict:
    """The chat `logprobs` object: one entry per token, each with its alternatives."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
        tok = token_text(decode, tid)
        alts = top[i] if i < len(top) else ()
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": (s := token_text(decode, a)), "logprob": alp, "bytes": list(s.encode("utf-8", "replace"))}
                    for a, alp in alts
                ],
            }
        )
    return {"content": content}
