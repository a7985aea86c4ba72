"""Hypothesis-generated multi-turn chat sessions on the CPU backend and atlas-tiny, prefix caching on and off,
speculation off and MTP-drafted: each turn's prompt is the previous prompt + the previous answer (its last
tokens sometimes dropped or altered, like a chat template re-tokenising the boundary) + new user text;
unrelated sessions interleave, some turns run concurrently, the KV pool is small enough to evict cached blocks
and preempt. Every turn must produce exactly the tokens a cold run produces (greedy), every invariant holds
after every event (full audit), and no block leaks at the end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import CarryAdopted, PrefixCacheHit
from atlas.state.invariants import audit

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
ANSWER = 6
MAX_SEQ = 96


def config(prefix: bool, drafts: int) -> EngineConfig:
    # 28 blocks of 4: two concurrent turns of up to 96 tokens do not both fit, so cached blocks are evicted
    # and a sequence can be preempted
    return EngineConfig(max_seq_len=MAX_SEQ, max_batch_size=2, prefill_chunk_tokens=24, block_size=4,
                        num_kv_blocks=28, enable_prefix_caching=prefix, prefix_snapshots=6, num_drafts=drafts,
                        drafter="mtp")


_COLD: dict[tuple[int, ...], list[int]] = {}
_REFERENCE = build_engine("atlas-tiny", "cpu", config(False, 0), loaded=TINY)


def cold_tokens(prompt: list[int]) -> list[int]:
    """What a cold run produces for `prompt` (one engine, prefix caching off: every request is cold)."""
    key = tuple(prompt)
    if key not in _COLD:
        _REFERENCE.add_request(f"cold{len(_COLD)}", prompt, SamplingParams(temperature=0.0, max_tokens=ANSWER))
        out: list[int] = []
        while _REFERENCE.has_unfinished():
            for o in _REFERENCE.step():
                out.extend(o.new_token_ids)
        _COLD[key] = out
    return _COLD[key]


turn = st.tuples(
    st.integers(0, 2),  # which session
    st.integers(0, 3),  # answer tokens dropped at the boundary (re-tokenised)
    st.booleans(),  # the last kept answer token altered
    st.lists(st.integers(3, 250), min_size=1, max_size=8),  # new user text
    st.booleans(),  # runs concurrently with the next turn
)


def run_script(engine: Engine, script: list, openers: list[list[int]]) -> None:
    sessions: list[list[int]] = [list(o) for o in openers]
    i = 0
    n = 0
    while i < len(script):
        batch = [script[i]]
        if script[i][4] and i + 1 < len(script) and script[i + 1][0] != script[i][0]:
            batch.append(script[i + 1])
        i += len(batch)
        live: dict[str, tuple[int, list[int]]] = {}
        for session, _drop, _alter, _user, _ in batch:
            prompt = sessions[session]
            rid = f"t{n}"
            n += 1
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=ANSWER))
            live[rid] = (session, prompt)
        got: dict[str, list[int]] = {rid: [] for rid in live}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].extend(o.new_token_ids)
        for (rid, (session, prompt)), (_s, drop, alter, user, _) in zip(live.items(), batch, strict=True):
            assert got[rid] == cold_tokens(prompt), (rid, len(prompt))
            answer = got[rid][: len(got[rid]) - drop]
            if alter and answer:
                answer[-1] = (answer[-1] + 7) % 250 + 3
            nxt = prompt + answer + user
            sessions[session] = nxt if len(nxt) + ANSWER <= MAX_SEQ else list(openers[session][:5]) + user


def check_no_leaks(engine: Engine) -> None:
    pool = engine.state.pool
    audit(engine.state, -1)
    assert not engine.state.seqs and pool.used == 0 and len(pool.free) == pool.total
    assert all(r == 0 for r in pool.refs)


openers = st.lists(st.lists(st.integers(3, 250), min_size=6, max_size=30), min_size=3, max_size=3)


@pytest.mark.parametrize("prefix", [True, False])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=st.lists(turn, min_size=3, max_size=7), starts=openers)
def test_sessions_equal_cold_runs(prefix: bool, script: list, starts: list[list[int]]) -> None:
    engine = build_engine("atlas-tiny", "cpu", config(prefix, 0), loaded=TINY, full_audit=True)
    run_script(engine, script, starts)
    check_no_leaks(engine)
    stats = engine.stats()
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    if not prefix:
        assert stats.prefix_cache_queries == 0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=st.lists(turn, min_size=3, max_size=6), starts=openers)
def test_sessions_with_mtp_drafts_equal_cold_runs(script: list, starts: list[list[int]]) -> None:
    engine = build_engine("atlas-tiny", "cpu", config(True, 2), loaded=TINY, sink=RecordingSink(),
                                full_audit=True)
    run_script(engine, script, starts)
    check_no_leaks(engine)


def test_one_session_hits_and_adopts_every_warm_turn() -> None:
    """The plain multi-turn case, as an example that always runs: every warm turn hits, adopts the carry,
    and resumes past the previous prompt."""
    engine = build_engine("atlas-tiny", "cpu", config(True, 2), loaded=TINY, sink=RecordingSink(),
                                full_audit=True)
    script = [(0, 0, False, [40, 41, 42], False), (0, 2, True, [43, 44], False), (0, 1, False, [45], False)]
    run_script(engine, script, [list(range(10, 40)), [5] * 6, [6] * 6])
    check_no_leaks(engine)
    events = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
    hits = [e for e in events if isinstance(e, PrefixCacheHit)]
    adopted = [e for e in events if isinstance(e, CarryAdopted)]
    assert len(hits) == 2 and len(adopted) == 2
    assert all(h.position >= 30 for h in hits)
    assert engine.stats().drafter_coverage_warm >= 0.95
