"""Aligned prefill chunks (Capacities.prefill_align, atlas.engine.scheduler): a prompt's chunk boundaries do
not depend on what else shares the step's token budget (issue 15.4), so its prefill kernels see the same shapes
alone and under load."""

from __future__ import annotations

import pytest
import torch

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.records import RecordingSink
from atlas.engine.scheduler import batch
from atlas.errors import CapacityError
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState
from atlas.state.events import RequestArrived, StepPlanned

TARGET = [(13 * i + 5) % 250 for i in range(700)]


def _others(n: int, length: int, salt: int) -> list[list[int]]:
    return [[(7 * i + 31 * j + salt) % 250 for i in range(length + 37 * j)] for j in range(n)]


def run(config: EngineConfig, backend: str, before: list[list[int]], during: list[list[int]], lead_steps: int,
        max_tokens: int = 6) -> tuple[list[int], list[int], list[int]]:
    """`before` arrive first and run `lead_steps` steps, then the target arrives with `during` behind it
    (FCFS: they share its steps' budget). (the target's chunk lengths, its tokens, every step's fed total)."""
    torch.set_num_threads(1)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend, config, sink=sink)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(before):
        engine.add_request(f"b{i}", prompt, params)
    for _ in range(lead_steps):
        engine.step()
    engine.add_request("target", TARGET, params)
    for i, prompt in enumerate(during):
        engine.add_request(f"d{i}", prompt, params)
    tokens: list[int] = []
    while engine.stats().num_running or engine.stats().num_waiting:
        for out in engine.step():
            if out.request_id == "target":
                tokens += out.new_token_ids
    engine.close()
    events = [e for _, _, e, _ in sink.rows]
    seq = next(e.seq_id for e in events if isinstance(e, RequestArrived) and e.request_id == "target")
    plans = [e for e in events if isinstance(e, StepPlanned)]
    chunks = [fed for p in plans for s, fed in zip(p.seqs, p.fed, strict=True) if s == seq]
    prompt_chunks = []
    done = 0
    for fed in chunks:  # the prompt's chunks, then the decodes (one token each)
        if done >= len(TARGET):
            break
        prompt_chunks.append(fed)
        done += fed
    return prompt_chunks, tokens, [sum(p.fed) + sum(len(d) for d in p.drafts) for p in plans]


def boundaries(chunks: list[int]) -> list[int]:
    out, at = [], 0
    for n in chunks:
        at += n
        out.append(at)
    return out


LOADS = [  # (before, during, lead steps): alone, then heavier and differently timed loads
    ([], [], 0),
    (_others(3, 150, 1), [], 2),
    (_others(2, 400, 2), _others(3, 300, 3), 1),
    (_others(6, 90, 4), _others(1, 600, 5), 0),
]


@pytest.mark.parametrize("backend", ["null", "cpu"])
def test_the_targets_chunks_are_the_same_under_every_load(backend: str) -> None:
    config = EngineConfig(max_seq_len=1024, max_batch_size=8, prefill_chunk_tokens=256, prefill_align=128)
    loads = LOADS if backend == "null" else LOADS[:2]  # the CPU model: the lightest load (LOADS[2] took 40 s)
    runs = [run(config, backend, *load) for load in loads]
    alone = runs[0]
    assert boundaries(alone[0]) == [128, 256, 384, 512, 640, 700]
    for chunks, tokens, fed in runs[1:]:
        assert chunks == alone[0]
        assert tokens == alone[1]  # on the CPU backend the completion too
        assert max(fed) <= 256
    # the loads did cost the target steps: some chunk waited for a step with room (else the test shows nothing)
    assert any(len(r[2]) > len(alone[2]) for r in runs[1:])


def test_without_alignment_the_chunks_follow_the_load() -> None:
    """The failure this prevents: with alignment off the same target is chunked by what the others left."""
    config = EngineConfig(max_seq_len=1024, max_batch_size=8, prefill_chunk_tokens=256, prefill_align=0)
    chunks = {tuple(run(config, "null", *load)[0]) for load in LOADS}
    assert len(chunks) > 1


def test_branch_and_snapshot_points_still_cut_an_aligned_chunk() -> None:
    config = EngineConfig(max_seq_len=1024, max_batch_size=4, prefill_chunk_tokens=512, prefill_align=256,
                          enable_prefix_caching=True)
    state = ControlState.create(derive_capacities(config))
    state.apply(RequestArrived("r", 0, TARGET, SamplingParams(max_tokens=2, snapshot_points=(300,)).to_json(), 2))
    decided = batch(state)
    assert decided.seqs == (0,) and decided.fed == (256,)  # the aligned boundary comes first
    state2 = ControlState.create(derive_capacities(config))
    state2.apply(RequestArrived("r", 0, TARGET, SamplingParams(max_tokens=2, snapshot_points=(100,)).to_json(), 2))
    assert batch(state2).fed == (100,)  # the snapshot point inside the first aligned chunk cuts it


def test_a_chunk_that_does_not_fit_waits_and_so_does_everyone_behind_it() -> None:
    config = EngineConfig(max_seq_len=1024, max_batch_size=4, prefill_chunk_tokens=512, prefill_align=256)
    state = ControlState.create(derive_capacities(config))
    params = SamplingParams(max_tokens=2).to_json()
    state.apply(RequestArrived("a", 0, list(range(200)) + list(range(100)), params, 2))  # 300 tokens: 256 + 44
    state.apply(RequestArrived("b", 1, list(range(260)), params, 2))  # its first chunk: 256, left 512 - 256 = 256
    state.apply(RequestArrived("c", 2, list(range(10)), params, 2))
    decided = batch(state)
    assert decided.seqs == (0, 1) and decided.fed == (256, 256)  # c: no budget left
    state = ControlState.create(derive_capacities(config))
    state.apply(RequestArrived("a", 0, list(range(300)), params, 2))
    state.apply(RequestArrived("b", 1, list(range(10)), params, 2))  # fits in 256 but is not the head of the line
    state.apply(RequestArrived("c", 2, list(range(280)), params, 2))
    decided = batch(state)
    assert decided.seqs == (0, 1) and decided.fed == (256, 10)  # c's 256 does not fit in the 246 left: it waits


def test_the_alignment_is_derived_checked_and_can_be_turned_off() -> None:
    def derived(config: EngineConfig) -> int:  # what a batch-invariant backend gets when nothing is set
        return derive_capacities(config, batch_invariant=True).prefill_align

    assert derived(EngineConfig()) == 1984  # 2048 - 63 decodes, in blocks of 16
    assert derive_capacities(EngineConfig()).prefill_align == 0  # elsewhere off unless asked for
    # one sequence at a time: nothing shares its steps, the chunks are the budget's (the prefill benchmark's)
    assert derived(EngineConfig(max_batch_size=1, prefill_chunk_tokens=32752)) == 32752
    # each of the 3 others may verify 1 + 4 tokens
    assert derived(EngineConfig(max_batch_size=4, prefill_chunk_tokens=512, num_drafts=4)) == 496
    assert derived(EngineConfig(max_batch_size=64, prefill_chunk_tokens=64)) == 0
    assert derive_capacities(EngineConfig(prefill_align=0), batch_invariant=True).prefill_align == 0
    assert derive_capacities(EngineConfig(prefill_align=0)).prefill_align == 0
    assert derive_capacities(EngineConfig(prefill_align=100)).prefill_align == 100
    with pytest.raises(CapacityError, match="prefill_align 2000 is above its ceiling 1985"):
        derive_capacities(EngineConfig(prefill_align=2000))
    with pytest.raises(CapacityError, match="prefill_align must be >= 0, got -1"):
        EngineConfig(prefill_align=-1)
