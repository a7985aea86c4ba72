"""Logprobs in OpenAI's two shapes (legacy completions, chat). The text itself comes from the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence


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
    # a backend that reports no logprobs leaves None in their place, so every list has one entry per token
    token_logprobs = [logprobs[i] if i < len(logprobs) else None for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


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
