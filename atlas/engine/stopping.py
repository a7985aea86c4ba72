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

    @classmethod
    def create(cls, params: SamplingParams, max_new: int, eos_token_ids: tuple[int, ...]) -> StopChecker:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        return cls(params=params, max_new=max_new, max_new_from_capacity=params.max_tokens is None,
                   stop_ids=frozenset(stop_ids))

    def _append_text(self, token: int, tokenizer: Tokenizer) -> None:
        # One decode per token: the tokens not yet turned into text plus the new one. Exact for byte-level
        # tokenizers (Atlas's byte tokenizer, Qwen's byte-level BPE), whose tokens decode independently of
        # context; a trailing U+FFFD is an incomplete character, held back until its last byte arrives.
        self.unread.append(token)
        piece = decode(tokenizer, self.unread, self.params.skip_special_tokens)
        if not piece.endswith("\ufffd"):
            self.text += piece
            self.unread.clear()

    def on_token(self, token: int, tokenizer: Tokenizer | None) -> tuple[FinishReason, str] | None:
        """Record a sampled token; the finish reason and detail if it ends the request."""
        self.count += 1
        may_stop = self.count > self.params.min_tokens  # min_tokens: only the budget ends it before
        if may_stop and token in self.stop_ids:
            is_eos = not self.params.ignore_eos and token not in self.params.stop_token_ids
            return FinishReason.STOP, "eos" if is_eos else f"stop token {token}"
        if tokenizer is not None:
            self.tokenizer = tokenizer
            before = len(self.text)
            if token not in self.stop_ids:  # a stop token inside min_tokens adds no text (it never does)
                self._append_text(token, tokenizer)
            for stop in self.params.stop if may_stop else ():
                # only the new text, and the stop string's length before it, can hold a new occurrence
                at = self.text.find(stop, max(0, before - len(stop) + 1))
                if at >= 0:
                    self.text = self.text[:at + len(stop) if self.params.include_stop_str_in_output else at]
                    self.cut = True
                    return FinishReason.STOP, f"stop string {stop!r}"
        if self.count >= self.max_new:
            if self.max_new_from_capacity:
                return FinishReason.LENGTH, f"capacity: max_seq_len left room for {self.max_new} tokens"
            return FinishReason.LENGTH, f"max_tokens {self.max_new}"
        return None

    def banned_now(self) -> tuple[int, ...]:
        """The stop tokens the sampler may not pick for the next token: all of them while it is within
        min_tokens (so EOS never even appears there), none after."""
        if self.count >= self.params.min_tokens:
            return ()
        return tuple(sorted(self.stop_ids))

    def take_text(self, finished: bool) -> str:
        """The text not yet handed out; while running, hold back what could still start a stop string."""
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
