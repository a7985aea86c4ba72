"""Stop conditions and incremental detokenization, per request.

The order of checks after each sampled token: a stop token (EOS unless ignore_eos, or a stop_token_id)
-> `stop`; a stop string in the text -> `stop`, with the text cut before it (after it, with
include_stop_str_in_output); the budget (max_tokens, or what max_seq_len leaves) -> `length`. Within the
first `min_tokens` tokens only the budget ends a request. Text is decoded with or without special tokens
(skip_special_tokens) and streamed in deltas that never contain an incomplete UTF-8 character or a prefix of
a stop string that could still complete; stop strings are matched on that same text.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import attrs

from atlas.engine.outputs import FinishReason
from atlas.sampling.params import SamplingParams


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


_SKIP_FLAG: dict[type, bool] = {}


def _takes_skip_flag(tokenizer: Any) -> bool:
    kind = type(tokenizer)
    if kind not in _SKIP_FLAG:
        try:
            _SKIP_FLAG[kind] = "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters
        except (TypeError, ValueError):
            _SKIP_FLAG[kind] = False
    return _SKIP_FLAG[kind]


def decode(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """tokenizer.decode, with special tokens kept when asked and the tokenizer knows of any (a tokenizer whose
    decode takes no flag has none to show)."""
    if not skip_special_tokens and _takes_skip_flag(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[call-arg]
    return tokenizer.decode(ids)


@attrs.define(slots=True)
class StopChecker:
    """One request's stopping state: its text so far and how much of it has been emitted."""

    params: SamplingParams
    max_new: int
    max_new_from_capacity: bool  # no max_tokens given: the budget is what max_seq_len left
    stop_ids: frozenset[int]
    unread: list[int] = attrs.Factory(list)  # tokens not yet turned into text (an incomplete character)
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    count: int = 0  # tokens sampled so far
    cut: bool = False  # the text was cut at a stop string
    tokenizer: Tokenizer | None = None
    # tokens sampled but not yet through _append_text: a request without stop strings reads its text only when it
    # is handed out (take_text), so its tokens wait here and go through the very same per-token procedure then, in
    # the same order: the text is identical, built when read instead of every step (tests/test_stop_text.py)
    later: list[int] = attrs.Factory(list)
    # decode([t]) memo shared by the requests of one tokenizer and skip_special_tokens value (RequestBook.pieces):
    # decode is a pure function of the ids, so a memoised piece is the piece. None: decode every time
    pieces: dict[int, str] | None = attrs.field(default=None, eq=False, repr=False)  # a cache, not state

    @classmethod
    def create(cls, params: SamplingParams, max_new: int, eos_token_ids: tuple[int, ...],
               pieces: dict[int, str] | None = None) -> StopChecker:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        return cls(params=params, max_new=max_new, max_new_from_capacity=params.max_tokens is None,
                   stop_ids=frozenset(stop_ids), pieces=pieces)

    def _append_text(self, token: int, tokenizer: Tokenizer) -> None:
        # One decode per token: the tokens not yet turned into text plus the new one. Exact for byte-level
        # tokenizers (Atlas's byte tokenizer, Qwen's byte-level BPE), whose tokens decode independently of
        # context; a trailing U+FFFD is an incomplete character, held back until its last byte arrives.
        unread = self.unread
        pieces = self.pieces
        if not unread and pieces is not None:  # decode([token]): the memo's (one dict lookup after the first)
            piece = pieces.get(token)
            if piece is None:
                piece = pieces[token] = self._decode([token], tokenizer)
            if not piece.endswith("\ufffd"):
                self.text += piece
                return
            unread.append(token)
            return
        unread.append(token)
        piece = self._decode(unread, tokenizer)
        if not piece.endswith("\ufffd"):
            self.text += piece
            unread.clear()

    def _decode(self, ids: list[int], tokenizer: Tokenizer) -> str:
        skip = self.params.skip_special_tokens  # decode() with the flag's common value inline
        return tokenizer.decode(ids) if skip else decode(tokenizer, ids, skip)

    def _catch_up(self) -> None:
        """Put the waiting tokens through _append_text, in order (what on_token would have done at each)."""
        later = self.later
        if later and self.tokenizer is not None:
            tokenizer = self.tokenizer
            for token in later:
                self._append_text(token, tokenizer)
        later.clear()

    def on_token(self, token: int, tokenizer: Tokenizer | None) -> tuple[FinishReason, str] | None:
        """Record a sampled token; the finish reason and detail if it ends the request."""
        self.count = count = self.count + 1
        p = self.params
        may_stop = count > p.min_tokens  # min_tokens: only the budget ends it before
        stop_ids = self.stop_ids
        if may_stop and token in stop_ids:
            is_eos = not p.ignore_eos and token not in p.stop_token_ids
            return FinishReason.STOP, "eos" if is_eos else f"stop token {token}"
        if tokenizer is not None:
            self.tokenizer = tokenizer
            if not p.stop:  # nothing reads the text before take_text: the token waits (see `later`)
                if token not in stop_ids:  # a stop token inside min_tokens adds no text (it never does)
                    self.later.append(token)
                if count >= self.max_new:
                    return self._length()
                return None
            before = len(self.text)
            if token not in stop_ids:
                self._append_text(token, tokenizer)
            for stop in p.stop if may_stop else ():
                # only the new text, and the stop string's length before it, can hold a new occurrence
                at = self.text.find(stop, max(0, before - len(stop) + 1))
                if at >= 0:
                    self.text = self.text[:at + len(stop) if p.include_stop_str_in_output else at]
                    self.cut = True
                    return FinishReason.STOP, f"stop string {stop!r}"
        if count >= self.max_new:
            return self._length()
        return None

    def _length(self) -> tuple[FinishReason, str]:
        if self.max_new_from_capacity:
            return FinishReason.LENGTH, f"capacity: max_seq_len left room for {self.max_new} tokens"
        return FinishReason.LENGTH, f"max_tokens {self.max_new}"

    def banned_now(self) -> tuple[int, ...]:
        """The stop tokens the sampler may not pick for the next token: all of them while it is within
        min_tokens (so EOS never even appears there), none after."""
        if self.count >= self.params.min_tokens:
            return ()
        return tuple(sorted(self.stop_ids))

    def take_text(self, finished: bool) -> str:
        """The text not yet handed out; while running, hold back what could still start a stop string."""
        if self.later:
            self._catch_up()
        if finished and self.unread and not self.cut and self.tokenizer is not None:
            # the request ended on an incomplete character: hand out what decoding makes of it
            self.text += decode(self.tokenizer, self.unread, self.params.skip_special_tokens)
            self.unread.clear()
        end = len(self.text)
        if not finished and self.params.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.params.stop) - 1))
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
