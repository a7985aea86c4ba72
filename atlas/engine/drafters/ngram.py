"""Prompt-lookup drafting: find the latest earlier occurrence of the context's last n tokens (longest n
first) and propose the tokens that followed it. Free to run, and strong on repetitive text (code edits,
quoting, templated output)."""

from __future__ import annotations

from collections.abc import Sequence

from atlas.engine.drafters.base import DraftRequest


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 4, min_ngram: int = 1,
                  window: int = 4096) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier match of the longest suffix (max_ngram down to
    min_ngram) within the last `window` tokens; () when nothing matches."""
    n_tokens = len(tokens)
    lo = max(0, n_tokens - window)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = list(tokens[n_tokens - n :])
        # latest match first: recent context predicts best; a match must end before the tail itself
        for start in range(n_tokens - n - 1, lo - 1, -1):
            if list(tokens[start : start + n]) == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return tuple(int(t) for t in follow)
    return ()


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, window: int = 1024) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, request: DraftRequest) -> tuple[int, ...]:
        return prompt_lookup(request.tokens, request.k, self.max_ngram, self.min_ngram, self.window)
