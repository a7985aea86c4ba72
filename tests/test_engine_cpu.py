"""The engine on the CPU reference backend and the built-in tiny model: a request's tokens do not depend
on batch composition, chunk budget or preemption (greedy and seeded sampling); a CPU run replays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.replay.verify import verify
from atlas.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog. " * 2),
    list(b"hello"),
    list(b"0123456789abcdefghijklmnopqrstuvwxyz, once more with feeling"),
]
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=3, ignore_eos=True),
]


def run(tiny, config: EngineConfig, prompts=PROMPTS, params=PARAMS) -> tuple[list[tuple[int, ...]], Engine]:
    engine = build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=RecordingSink(), full_audit=True)
    results = generate(engine, prompts, params)
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    return [r.token_ids for r in results], engine


def test_tokens_are_the_same_alone_batched_chunked_and_preempted(tiny) -> None:
    alone = [run(tiny, EngineConfig(max_seq_len=128, max_batch_size=1, prefill_chunk_tokens=128), [p], [s])[0][0]
             for p, s in zip(PROMPTS, PARAMS, strict=True)]
    batched, _ = run(tiny, EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=128))
    chunked, _ = run(tiny, EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=7))
    # a pool of 8 blocks of 16 cannot hold all three: sequences are preempted and recomputed
    tight, engine = run(tiny, EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=16,
                                           num_kv_blocks=8))
    assert engine.stats().preemptions_total > 0
    assert batched == alone
    assert chunked == alone
    assert tight == alone


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(3, 40), order=st.permutations([0, 1, 2]))
def test_any_chunk_budget_and_arrival_order_gives_the_same_tokens(tiny, chunk: int, order: list[int]) -> None:
    reference = _reference(tiny)
    tokens, _ = run(tiny, EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=chunk),
                    [PROMPTS[i] for i in order], [PARAMS[i] for i in order])
    assert tokens == [reference[i] for i in order]


_REFERENCE: list[tuple[int, ...]] = []


def _reference(tiny) -> list[tuple[int, ...]]:
    if not _REFERENCE:
        _REFERENCE.extend(run(tiny, EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=128))[0])
    return _REFERENCE


def test_a_cpu_run_replays_event_for_event(tmp_path: Path) -> None:
    path = tmp_path / "cpu.db"
    engine = build_engine("atlas-tiny", backend="cpu", trace=str(path),
                               config=EngineConfig(max_seq_len=96, max_batch_size=2, prefill_chunk_tokens=8))
    generate(engine, PROMPTS[1:], PARAMS[1:])
    engine.close()
    report = verify(path)
    assert report.identical and report.fingerprint_matches and report.events_replayed > 20


def test_llm_generate_returns_tokens_text_and_finish_reason_per_prompt(tmp_path: Path) -> None:
    import atlas

    llm = atlas.LLM("atlas-tiny")
    prompts = ["hello", "The quick brown fox"]
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True),
                         config=EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=16))
    assert [len(g.token_ids) for g in plain] == [8, 8]
    assert all(g.finish_reason is FinishReason.LENGTH and g.finish_detail == "max_tokens 8" for g in plain)
    assert [g.prompt_token_ids for g in plain] == [tuple(llm.tokenizer.encode(p)) for p in prompts]
    for g in plain:
        assert g.text == llm.tokenizer.decode(list(g.token_ids))
    # a stop string taken from the greedy output itself: it ends there, the text cut before it
    text = plain[0].text
    stop = text[3:5]
    assert stop and text.find(stop) == 3
    stopped = llm.generate("hello", SamplingParams(max_tokens=8, ignore_eos=True, stop=(stop,)),
                           trace=str(tmp_path / "llm.db"))[0]
    assert stopped.finish_reason is FinishReason.STOP and stopped.text == text[:3]
    assert stopped.token_ids == plain[0].token_ids[: len(stopped.token_ids)]
    assert verify(tmp_path / "llm.db").identical
