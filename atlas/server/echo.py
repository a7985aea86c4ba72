"""The prompt's side of a completion, for evaluation harnesses: `echo` (the prompt before the completion, its
tokens' logprobs first in the legacy `logprobs` object) and vLLM's `prompt_logprobs` (per prompt position: the
actual token and the top-N alternatives). The logprobs come from the engine (RequestOutput.prompt_logprobs),
computed by the same exact forward that fed the prompt.

lm-evaluation-harness's `local-completions` scores a continuation as sum(token_logprobs[ctxlen:-1]) of an echoed
prompt of context + continuation with max_tokens 1, and `is_greedy` from each position's top_logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

PromptLogprobs = Sequence[tuple[float | None, Sequence[tuple[int, float]]]]


def echoed_logprobs(decode: Callable[[list[int]], str], prompt: Sequence[int], prompt_lp: PromptLogprobs | None,
                    completion: dict | None, want_top: int) -> dict:
    """The legacy `logprobs` object of prompt + completion: prompt entries first (position 0: None, as OpenAI
    and vLLM give it), offsets counted from the start of the prompt's text."""
    tokens = [decode([t]) for t in prompt]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    lps: list[float | None] = [None] * len(prompt)
    tops: list[dict[str, float] | None] = [None] * len(prompt)
    for i, (lp, alts) in enumerate(prompt_lp or ()):
        if i == 0 or lp is None:
            continue
        lps[i] = lp
        top = {decode([a]): alp for a, alp in list(alts)[:want_top]}
        top.setdefault(tokens[i], lp)  # the actual token is always among them, as OpenAI's echo gives it
        tops[i] = top
    completion = completion or {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
    comp_tops = completion.get("top_logprobs") or [{} for _ in completion["tokens"]]
    return {
        "tokens": tokens + list(completion["tokens"]),
        "token_logprobs": lps + list(completion["token_logprobs"]),
        "top_logprobs": tops + list(comp_tops),
        "text_offset": offsets + [at + o for o in completion["text_offset"]],
    }


def vllm_prompt_logprobs(decode: Callable[[list[int]], str], prompt: Sequence[int], prompt_lp: PromptLogprobs,
                         top_n: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for position 0, then {token id: {logprob, rank, decoded_token}} holding the
    actual token and the top-N alternatives (rank: 1 for the best; the actual token's rank only when it is
    among the alternatives)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, (lp, alts) in enumerate(prompt_lp):
        if i == 0 or lp is None:
            out.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for rank, (a, alp) in enumerate(list(alts)[:top_n], start=1):
            entry[str(a)] = {"logprob": alp, "rank": rank, "decoded_token": decode([a])}
        entry.setdefault(str(prompt[i]), {"logprob": lp, "rank": None, "decoded_token": decode([prompt[i]])})
        out.append(entry)
    return out
