"""Issue 17, finding 9: prefix caching hits what chat traffic shares. Twenty chats with the same 360-token system
prompt and different questions (4 chats and 200 tokens here): a hit needs a recurrent snapshot at the branch point, and snapshots were taken
only at chunk ends and turn ends, so a shared system prompt never had one (0 hits). Now a prefill chunk ends at
each branch point (atlas.engine.scheduler._to_branch): the request's snapshot_points (the server marks the chat's
message boundaries) and, for a cold admission, the end of the full blocks it shares with a cached chain."""

from __future__ import annotations

import httpx
import pytest
import torch

from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.server.serve import serve_in_thread

SYSTEM = [(7 * i + 3) % 250 for i in range(200)]  # 200 tokens: 12 full blocks of 16 and 8 more
SHARED = len(SYSTEM) // 16 * 16  # the full blocks a cold admission shares with the cached chain (192 tokens)
# 4 chats (the figure was measured on 20): each test serves them all, cold or cached, and the counts
# below are relative to len(CHATS) and the prompt's full blocks, so 4 chats of a 200-token prompt keep every
# case (first chat, the one that makes the branch snapshot, two hits after it; a prompt not a multiple of the
# block). The CPU backend feeds each token alone, so the work is linear in the chats: the module was ~70 s of the
# suite with 20 x 360, 186 worker-seconds at 8 x 200 on a loaded box (the cold run 97 s of it), half that at 4
QUESTIONS = [[(11 * q + 5 * j + 1) % 250 for j in range(20)] for q in range(4)]
CHATS = [SYSTEM + q for q in QUESTIONS]


def _config(caching: bool) -> EngineConfig:
    return EngineConfig(max_seq_len=512, max_batch_size=4, prefill_chunk_tokens=512, enable_prefix_caching=caching)


def _serve_in_turn(points: tuple[int, ...], caching: bool = True):
    """The chats one after another on one engine (each arrives once the previous answered, as users do)."""
    torch.set_num_threads(1)
    engine = build_engine("atlas-tiny", "cpu", _config(caching))
    params = SamplingParams(max_tokens=4, snapshot_points=points)
    tokens = [generate(engine, [chat], params, request_prefix=f"c{i}")[0].token_ids for i, chat in enumerate(CHATS)]
    return tokens, engine.stats()


@pytest.fixture(scope="module")
def cold() -> list[tuple[int, ...]]:
    return _serve_in_turn((), caching=False)[0]


def test_with_the_servers_boundary_every_chat_after_the_first_reuses_the_system_prompt(cold) -> None:
    tokens, st = _serve_in_turn((len(SYSTEM),))
    assert tokens == cold  # exactly what caching off gives
    assert st.prefix_cache_hits == len(CHATS) - 1, st
    assert st.prefix_tokens_saved >= (len(CHATS) - 1) * len(SYSTEM), st


def test_without_a_boundary_the_branch_point_is_found_from_the_shared_blocks(cold) -> None:
    """No hint (a plain completions request): chat 2 shares 12 full blocks with chat 1's cached chain, so its
    first chunk ends there and leaves a snapshot; chats 3.. hit it (192 tokens each)."""
    tokens, st = _serve_in_turn(())
    assert tokens == cold
    assert st.prefix_cache_hits == len(CHATS) - 2, st
    assert st.prefix_tokens_saved >= (len(CHATS) - 2) * SHARED, st


def test_the_server_marks_the_end_of_the_system_prompt() -> None:
    """Through the chat API: the system message's end is a snapshot point, so the second chat already hits."""
    torch.set_num_threads(1)
    engine = build_engine("atlas-tiny", "cpu", _config(True))
    system = "You are a careful assistant who answers in one short sentence. " * 5
    with serve_in_thread(engine) as served:
        for question in ("What is two plus two?", "Name a colour.", "Which is larger, 3 or 5?"):
            r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
                "model": "atlas-tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text
    st = engine.stats()
    assert st.prefix_cache_hits == 2, st
    assert st.prefix_tokens_saved >= 2 * len(system.encode()), st  # the byte tokenizer: one token a byte
