"""n > 1: the choices of one response, each its own engine request, streamed as one SSE stream.

Each choice's events come from the single-choice stream (atlas.server.generate), its `index` set; this module
interleaves them in arrival order, drops each one's `[DONE]`, and ends the whole with one usage chunk (when asked)
and one `[DONE]`. Usage follows OpenAI and vLLM: each prompt's tokens counted once, every choice's completion
tokens summed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

DONE = b"data: [DONE]\n\n"


def summed_usage(parts: Sequence[tuple[int, int, bool]]) -> dict[str, int]:
    """Usage of choices given as (prompt_tokens, completion_tokens, first choice of its prompt)."""
    prompt = sum(p for p, _, first in parts if first)
    completion = sum(c for _, c, _ in parts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def merged(streams: Sequence[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Every event of `streams` as it comes, without their `[DONE]`s. Leaving early (the client went away)
    cancels the streams' pending reads, so each stream's own clean-up runs."""
    nexts: dict[asyncio.Future[Any], AsyncIterator[bytes]] = {
        asyncio.ensure_future(s.__anext__()): s for s in streams}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: list(nexts).index(f)):  # a stable order among the ready
                stream = nexts.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                if event != DONE:
                    yield event
                nexts[asyncio.ensure_future(stream.__anext__())] = stream
    finally:
        for future in nexts:
            future.cancel()
        if nexts:
            await asyncio.gather(*nexts, return_exceptions=True)
