"""Generated workloads on the null backend: every invariant after every event, no block leaked at the end,
and every request's tokens independent of batch, chunk budget and preemption."""

from __future__ import annotations

import attrs
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from atlas.backends.null import ByteTokenizer, NullBackend
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.outputs import FinishReason
from atlas.engine.records import RecordingSink
from atlas.sampling.params import SamplingParams
from atlas.state.invariants import audit


@attrs.frozen
class Req:
    arrival: int
    prompt: tuple[int, ...]
    params: SamplingParams
    cancel_at: int | None = None


def make_engine(config: EngineConfig, eos_rate: int = 0, **kwargs) -> Engine:
    return Engine(NullBackend(eos_rate=eos_rate), tokenizer=ByteTokenizer(), config=config, sink=RecordingSink(),
                  **kwargs)


def run(engine: Engine, reqs: list[Req], max_iterations: int = 5000) -> dict[str, dict]:
    """Drive arrivals and cancellations at their steps; collect each request's tokens and ending."""
    results: dict[str, dict] = {}
    for it in range(max_iterations):
        for i, r in enumerate(reqs):
            if r.arrival == it:
                engine.add_request(f"r{i}", r.prompt, r.params)
                results[f"r{i}"] = {"tokens": [], "text": "", "reason": None, "outputs_after_finish": 0}
            if r.cancel_at == it:
                engine.cancel(f"r{i}")
        for o in engine.step():
            res = results[o.request_id]
            if res["reason"] is not None:
                res["outputs_after_finish"] += 1
            res["tokens"].extend(o.new_token_ids)
            res["text"] += o.new_text
            if o.finished:
                res["reason"] = o.finish_reason
                res["detail"] = o.finish_detail
                res["completion_tokens"] = o.completion_tokens
        if it > max(r.arrival for r in reqs) and not engine.has_unfinished():
            return results
    raise AssertionError("workload did not finish")


def alone(req: Req, max_seq_len: int, eos_rate: int = 0) -> list[int]:
    """The tokens `req` produces by itself, with room to spare and a generous chunk budget."""
    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=1, prefill_chunk_tokens=max_seq_len)
    engine = make_engine(config, eos_rate=eos_rate)
    return run(engine, [attrs.evolve(req, arrival=0, cancel_at=None)])["r0"]["tokens"]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineConfig, list[Req]]:
    max_seq_len = draw(st.integers(8, 48))
    block_size = draw(st.sampled_from([2, 4, 8]))
    batch = draw(st.integers(1, 5))
    floor = -(-max_seq_len // block_size)
    config = EngineConfig(
        max_seq_len=max_seq_len,
        max_batch_size=batch,
        prefill_chunk_tokens=draw(st.integers(batch, 24)),
        block_size=block_size,
        num_kv_blocks=draw(st.integers(floor, floor * 3)),  # small enough to force preemption
        max_waiting=64,
    )
    reqs = []
    for _ in range(draw(st.integers(1, 7))):
        prompt_len = draw(st.integers(1, max_seq_len - 1))
        max_tokens = draw(st.one_of(st.none(), st.integers(1, max_seq_len - prompt_len)))
        params = SamplingParams(max_tokens=max_tokens, temperature=draw(st.sampled_from([0.0, 0.8])),
                                seed=draw(st.integers(0, 3)), stop_token_ids=draw(st.sampled_from([(), (7,)])),
                                stop=draw(st.sampled_from([(), ("a",), ("\x10", "zz")])))
        arrival = draw(st.integers(0, 12))
        cancel_at = draw(st.one_of(st.none(), st.integers(arrival, arrival + 20)))
        prompt = tuple(draw(st.lists(st.integers(0, 255), min_size=prompt_len, max_size=prompt_len)))
        reqs.append(Req(arrival, prompt, params, cancel_at))
    return config, reqs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_generated_workloads_keep_every_invariant_and_leak_nothing(workload: tuple[EngineConfig, list[Req]]) -> None:
    config, reqs = workload
    engine = make_engine(config, eos_rate=40, full_audit=True)  # audit every machine after every event
    results = run(engine, reqs)

    event(f"preempted: {engine.stats().preemptions_total > 0}")
    event(f"cancelled: {any(res['reason'] is FinishReason.CANCELLED for res in results.values())}")
    event(f"stop string: {any((res.get('detail') or '').startswith('stop string') for res in results.values())}")
    audit(engine.state, -1)
    assert engine.state.pool.used == 0 and len(engine.state.pool.free) == config.num_kv_blocks
    assert engine.backend.live_sequences() == []  # every data-plane sequence released
    assert not engine.state.seqs and not engine.state.waiting and not engine.state.running
    for i, r in enumerate(reqs):
        res = results[f"r{i}"]
        assert res["reason"] is not None and res["outputs_after_finish"] == 0
        if res["reason"] is FinishReason.CANCELLED:
            continue
        tokens = res["tokens"]
        assert res["completion_tokens"] == len(tokens)
        budget = r.params.max_tokens or config.max_seq_len - len(r.prompt)
        if res["reason"] is FinishReason.LENGTH:
            assert len(tokens) == budget and all(t not in (256, *r.params.stop_token_ids) for t in tokens)
        elif res["detail"].startswith("stop string"):
            # the streamed text is the decoded tokens cut right before the first stop string
            full, cut = ByteTokenizer().decode(tokens), len(res["text"])
            assert full[:cut] == res["text"] and any(full.startswith(stop, cut) for stop in r.params.stop)
            assert not any(stop in res["text"] for stop in r.params.stop)
        else:
            assert res["reason"] is FinishReason.STOP and tokens[-1] in (256, *r.params.stop_token_ids)
        # batch-, chunk- and preemption-invariance
        assert tokens == alone(r, config.max_seq_len, eos_rate=40)


def test_a_tight_pool_preempts_and_the_tokens_do_not_change() -> None:
    config = EngineConfig(max_seq_len=40, max_batch_size=4, prefill_chunk_tokens=8, block_size=4, num_kv_blocks=12)
    reqs = [Req(0, tuple(range(10 + i, 30 + i)), SamplingParams(max_tokens=18, temperature=0.8 * (i % 2), seed=i,
                                                           ignore_eos=True))
            for i in range(4)]
    engine = make_engine(config, full_audit=True)
    results = run(engine, reqs)
    kinds = [e.kind for _, _, e, _ in engine.sink.rows]
    assert engine.stats().preemptions_total > 0 and "sequence_preempted" in kinds
    for i, r in enumerate(reqs):
        assert results[f"r{i}"]["reason"] is FinishReason.LENGTH
        assert results[f"r{i}"]["tokens"] == alone(r, 40)


def test_chunk_budgets_and_batching_do_not_change_tokens() -> None:
    reqs = [Req(i, tuple(range(i, 25 + 3 * i)), SamplingParams(max_tokens=12, temperature=t, seed=5))
            for i, t in enumerate([0.0, 0.7, 0.0, 1.0, 0.0])]
    outcomes = []
    for chunk in (5, 8, 64):
        engine = make_engine(EngineConfig(max_seq_len=64, max_batch_size=5, prefill_chunk_tokens=chunk))
        results = run(engine, reqs)
        outcomes.append([results[f"r{i}"]["tokens"] for i in range(len(reqs))])
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert outcomes[0] == [alone(r, 64) for r in reqs]


def test_every_step_stays_within_the_token_budget_and_prompts_are_fed_exactly() -> None:
    config = EngineConfig(max_seq_len=64, max_batch_size=3, prefill_chunk_tokens=7)
    engine = make_engine(config)
    reqs = [Req(0, tuple(range(1, 30)), SamplingParams(max_tokens=5)), Req(1, tuple(range(2, 20)),
            SamplingParams(max_tokens=9)), Req(2, (3,) * 41, SamplingParams(max_tokens=3))]
    run(engine, reqs)
    fed_per_seq: dict[int, list[int]] = {}
    for _, _, e, _ in engine.sink.rows:
        if e.kind == "step_planned":
            assert sum(e.fed) <= 7 and len(e.seqs) <= 3
            for seq_id, n in zip(e.seqs, e.fed, strict=True):
                fed_per_seq.setdefault(seq_id, []).append(n)
    for seq_id, r in enumerate(reqs):
        n_prompt = len(r.prompt)
        fed = fed_per_seq[seq_id]
        prefix = 0
        for i, n in enumerate(fed):  # the prompt is fed in chunks, then one token per decode
            prefix += n
            if prefix == n_prompt:
                assert all(x == 1 for x in fed[i + 1:])
                break
        assert prefix == n_prompt
