"""Every feature on the CUDA backend, run on the CPU through its fp32 parity mode (the same batched code on CPU
tensors; no GPU needed): speculation (MTP K=4, n-gram drafts) gives the tokens of speculation off on prompts
crossing the QSA inert bound (19 on atlas-tiny); rollback (ring + watchdog on a looping scripted backend) gives
the CPU reference's tokens; multi-turn prefix caching (hits and the drafter carry) gives cold runs' tokens; a
trace with speculation, rollbacks and prefix hits replays event for event; the position stamps catch a dropped
state write at the step that dropped it."""

from __future__ import annotations

import os

import attrs
import pytest
import torch
from test_prefix_sessions import check_no_leaks, cold_tokens, run_script
from test_rollback_engine import PROMPT, LoopingBackend
from test_rollback_engine import config as loop_config

from atlas.backends.cpu import CpuBackend
from atlas.backends.cuda import CudaBackend
from atlas.config import EngineConfig, derive_capacities
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan
from atlas.registry import build_engine, open_trace
from atlas.replay.reader import read_run
from atlas.replay.verify import compare, redrive
from atlas.sampling.params import SamplingParams
from atlas.state.events import CarryAdopted, InvariantViolated, PrefixCacheHit, RolledBack

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
# the CPU path in CI; tests/test_cuda_gpu.py reruns this file with the device set to the GPU (eager: the graphs
# are tested there)
CPU_PATH = {"device": os.environ.get("ATLAS_CUDA_FEATURES_DEVICE", "cpu"), "cuda_graphs": False}
PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog. " * 2),  # 90 tokens: past the inert bound
    list(b"hello"),  # crosses the bound while decoding (and verifying)
    list(b"0123456789abcdefghi"),  # 19 tokens: exactly the bound
]


def cuda_engine(config: EngineConfig, **kwargs) -> Engine:
    return build_engine("atlas-tiny", "cuda-fp32", config, loaded=TINY, sink=RecordingSink(), full_audit=True,
                        backend_options=CPU_PATH, **kwargs)


def greedy(engine: Engine, prompts=PROMPTS, n: int = 24) -> list[tuple[int, ...]]:
    return [r.token_ids for r in generate(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True)] * len(prompts))]


BASE = EngineConfig(max_seq_len=160, max_batch_size=3, prefill_chunk_tokens=32)
OFF = greedy(cuda_engine(BASE))


@pytest.mark.parametrize("drafts", [dict(num_drafts=4, drafter="mtp"), dict(num_drafts=3, drafter="ngram")])
def test_speculation_gives_the_tokens_of_speculation_off(drafts: dict) -> None:
    engine = cuda_engine(attrs.evolve(BASE, **drafts))
    assert greedy(engine) == OFF
    stats = engine.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_drafts_accepted > 0
    if drafts["drafter"] == "mtp":  # atlas-tiny's random MTP head is sometimes right, mostly wrong
        assert stats.spec_drafts_accepted < stats.spec_drafts_proposed
    assert engine.backend.store.reads.calls > 0  # type: ignore[attr-defined]


def test_speculation_gives_the_cpu_backends_tokens_and_is_the_same_wide() -> None:
    """The CPU reference with the same MTP drafter gives the same tokens; so does the one-forward ("wide") verify
    the bf16 mode runs (its GEMMs over K rows round differently from a decode's, so only tokens are compared)."""
    config = attrs.evolve(BASE, num_drafts=4, drafter="mtp")
    cpu = build_engine("atlas-tiny", "cpu", config, loaded=TINY)
    assert greedy(cpu) == OFF
    wide = build_engine("atlas-tiny", "cuda-fp32", config, loaded=TINY, full_audit=True,
                        backend_options={**CPU_PATH, "verify_mode": "wide"})
    assert wide.backend.verify_mode == "wide"  # type: ignore[attr-defined]
    assert greedy(wide) == OFF
    assert wide.stats().spec_drafts_accepted > 0


def test_seeded_sampled_mtp_speculation_gives_the_cpu_backends_tokens() -> None:
    """Sampled drafting keeps the drafter's q for rejection sampling; every draw is keyed by (seed, position)."""
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.2, seed=6, top_k=40, ignore_eos=True)]
    config = attrs.evolve(BASE, max_batch_size=2, num_drafts=2, drafter="mtp", verify_costs=())  # both at full width
    want = [r.token_ids for r in generate(build_engine("atlas-tiny", "cpu", config, loaded=TINY), PROMPTS[:2], params)]
    engine = cuda_engine(config)
    assert [r.token_ids for r in generate(engine, PROMPTS[:2], params)] == want
    assert engine.stats().spec_verify_steps > 0


def _looping(backend, cfg: EngineConfig, caps, sink=None) -> Engine:
    return Engine(LoopingBackend(backend, len(PROMPT)), tokenizer=TINY.tokenizer, config=cfg, capacities=caps,
                  spec=TINY.spec, sink=sink or RecordingSink(), full_audit=True)


def loop_run(engine: Engine) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPT, params)
    got: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [tuple(got["a"]), tuple(got["b"])]


def test_a_watchdog_rollback_gives_the_cpu_references_tokens() -> None:
    cfg = loop_config()
    caps = derive_capacities(cfg, TINY.spec, activation_bytes=4)
    want = _looping(CpuBackend(TINY, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size,
                               ring_slots=caps.ring_slots), cfg, caps)
    expected = loop_run(want)
    engine = _looping(CudaBackend.for_capacities(TINY, caps, dtype=torch.float32, name="cuda-fp32", **CPU_PATH),
                      cfg, caps)
    assert loop_run(engine) == expected
    rolled = [e for _, _, e, _ in engine.sink.rows if isinstance(e, RolledBack)]  # type: ignore[union-attr]
    assert len(rolled) == 2 and all(e.boundary >= len(PROMPT) for e in rolled)
    assert engine.stats().rollbacks_total == 2


def _prefix_config(prefix: bool, drafts: int) -> EngineConfig:
    return EngineConfig(max_seq_len=96, max_batch_size=2, prefill_chunk_tokens=24, block_size=4, num_kv_blocks=28,
                        enable_prefix_caching=prefix, prefix_snapshots=6, num_drafts=drafts, drafter="mtp")


SESSION = [(0, 0, False, [40, 41, 42], False), (0, 2, True, [43, 44], True), (1, 1, False, [45], False),
           (0, 1, False, [46, 47], False), (1, 0, False, [48], False)]
OPENERS = [list(range(10, 40)), [5] * 6 + list(range(60, 80)), [6] * 6]


@pytest.mark.parametrize("drafts", [0, 2])
def test_multi_turn_prefix_caching_gives_cold_runs_tokens(drafts: int) -> None:
    """Every turn equals a cold run (run_script asserts it turn by turn), prefix caching on and off; with MTP
    drafts the warm turns adopt the drafter carry."""
    for prefix in (True, False):
        engine = cuda_engine(_prefix_config(prefix, drafts))
        run_script(engine, SESSION, OPENERS)
        check_no_leaks(engine)
        rows = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
        hits = [e for e in rows if isinstance(e, PrefixCacheHit)]
        if prefix:
            assert len(hits) >= 2 and all(h.position >= 24 for h in hits)
            if drafts:
                assert any(isinstance(e, CarryAdopted) for e in rows)
        else:
            assert not hits
    assert cold_tokens(OPENERS[0])  # the cold reference (the CPU backend) ran


# atlas-tiny with its lm_head zeroed: every logit ties, so greedy decoding (and the MTP head, which shares it)
# emits token 0 forever: a real loop on real state for the watchdog, which bans 0 at the boundary (the re-steer
# emits 1) until its attempts run out
LOOPY = attrs.evolve(TINY, weights={**TINY.weights, "lm_head.weight": torch.zeros_like(TINY.weights["lm_head.weight"])},
                     fingerprint="atlas-tiny-loopy")


def test_a_trace_with_speculation_rollbacks_and_prefix_hits_replays_event_for_event(tmp_path) -> None:
    """One run: two looping requests rolled back by the watchdog (MTP drafts throughout), then a warm turn that
    hits the prefix cache and adopts the carry; redriven on a fresh engine of the same mode it gives the same
    events and digests."""
    cfg = attrs.evolve(loop_config(), num_drafts=2, drafter="mtp", enable_prefix_caching=True, block_size=4,
                       prefix_snapshots=4)
    caps = derive_capacities(cfg, LOOPY.spec, activation_bytes=4)
    trace = str(tmp_path / "cuda.sqlite")

    def engine(sink) -> Engine:
        backend = CudaBackend.for_capacities(LOOPY, caps, dtype=torch.float32, name="cuda-fp32", **CPU_PATH)
        return Engine(backend, tokenizer=TINY.tokenizer, config=cfg, capacities=caps, spec=TINY.spec, sink=sink,
                      full_audit=True)

    first = engine(open_trace(trace, model="atlas-tiny-loopy", fingerprint=LOOPY.fingerprint, backend="cuda-fp32",
                              config=cfg, caps=caps))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for rid in ("a", "b"):
        first.add_request(rid, PROMPT, params)
    while first.has_unfinished():
        first.step()
    first.add_request("warm", PROMPT + [0] * 12 + [7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    while first.has_unfinished():
        first.step()
    first.close()
    _, recorded = read_run(trace)
    kinds = {e.kind for e in recorded}
    assert {"rolled_back", "prefix_cache_hit", "boundary_snapshotted"} <= kinds and "invariant_violated" not in kinds
    assert any(e.kind == "step_executed" and any(n > 0 for n in e.payload["accepted"]) for e in recorded)
    again = engine(RecordingSink())
    assert redrive(again, recorded) == "ended"
    assert compare(recorded, again.sink.rows) is None  # type: ignore[union-attr]


def test_a_dropped_gdn_state_write_is_caught_at_that_step() -> None:
    """Issue 13's CUDA row: one decode's GDN-state write dropped (state and stamp: the data plane never saw the
    token). The stamps are read from the data, so the engine's cursor check names it at that very step."""
    engine = cuda_engine(BASE)
    pools = engine.backend.pools  # type: ignore[attr-defined]
    put, calls = pools.put, {"n": 0}

    def dropping(name, slots, positions, final, per_token, keep, ends=None):
        if name == "gdn1" and positions.shape[1] == 1:
            calls["n"] += 1
            if calls["n"] == 5:
                return  # the fifth decode's update of layer 1: neither the state nor its stamp moves
        put(name, slots, positions, final, per_token, keep, ends)

    pools.put = dropping
    with pytest.raises(InvariantViolation, match="position stamp"):
        greedy(engine, PROMPTS[:1], 12)
    (violation,) = [e for _, _, e, _ in engine.sink.rows if isinstance(e, InvariantViolated)]  # type: ignore[union-attr]
    f = violation.fields  # named: layer 1's GDN stamp stayed one token behind
    assert (f["layer"], f["state"], f["data_plane"], f["control_plane"]) == (1, "gdn", 90 + 4, 90 + 5), f


class EagerVerifyGraphs:
    """Stands in for the wide verify's DecodeGraphs on the CPU: the same padded, bucketed [B, K] groups (scratch
    rows, scratch slots), run eagerly."""

    def __init__(self, backend) -> None:
        self.backend, self.shapes = backend, set()

    def replay(self, shape, packed, padding):
        self.shapes.add(shape)
        logits = self.backend._verify_logits(packed.to(self.backend.device), shape)  # as a graph's static input
        self.backend.pools.kept.clear()  # a replay runs no Python: the runner must restore what the commit reads
        return logits, logits.argmax(-1)


def test_padded_wide_verify_buckets_give_speculation_offs_tokens() -> None:
    """Wide verifies padded to a power-of-two batch and key blocks, as their CUDA graphs replay them: the padding
    rows (writing only scratch slots and the scratch block) change no real row's tokens or state."""
    engine = build_engine("atlas-tiny", "cuda-fp32", attrs.evolve(BASE, num_drafts=3, drafter="mtp"), loaded=TINY,
                          full_audit=True, backend_options={**CPU_PATH, "verify_mode": "wide"})
    fake = engine.backend.verify_graphs = EagerVerifyGraphs(engine.backend)  # type: ignore[attr-defined]
    assert greedy(engine) == OFF
    assert {s.batch for s in fake.shapes} >= {4} and all(s.pending and s.keep and 2 <= s.width <= 4 for s in fake.shapes)
    assert any(s.qsa_select for s in fake.shapes)


def test_prompt_logprobs_equal_the_cpu_references() -> None:
    """Every prompt token's logprob under the position before it, chunked (the previous chunk's last row scores a
    chunk's first token), with the top alternatives: the CPU reference's to fp32 rounding."""
    config = EngineConfig(max_seq_len=128, max_batch_size=2, prefill_chunk_tokens=16)

    def scored(engine: Engine) -> list:
        params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
        engine.add_request("r0", PROMPTS[0][:40], params)
        engine.add_request("r1", PROMPTS[1], params)
        got: dict = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.prompt_logprobs is not None:
                    got[o.request_id] = o.prompt_logprobs
        return [got["r0"], got["r1"]]

    want = scored(build_engine("atlas-tiny", "cpu", config, loaded=TINY))
    got = scored(cuda_engine(config))
    assert [len(g) for g in got] == [40, 5]
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0] == (None, ())
        for (lp, alts), (lp2, alts2) in zip(g[1:], w[1:], strict=True):
            assert lp == pytest.approx(lp2, abs=1e-4)
            assert [t for t, _ in alts] == [t for t, _ in alts2]


def test_a_dropped_qsa_key_write_is_caught_at_that_step() -> None:
    """Issue 13's other CUDA row: one decode's QSA raw-key writes (keys and their position stamps) go nowhere.
    The layer's "qsa" stamp stays behind, and the step that dropped them is the one the cursor check names."""
    engine = cuda_engine(BASE)
    backend = engine.backend
    pools = backend.pools  # type: ignore[attr-defined]
    layer = next(iter(pools.index_keys))
    execute, steps = backend.execute, {"n": 0}

    def dropping(plan):
        steps["n"] += 1
        if steps["n"] != 6:
            return execute(plan)
        keys, pos = pools.index_keys[layer], pools.index_pos[layer]
        pools.index_keys[layer], pools.index_pos[layer] = keys.clone(), pos.clone()  # this step writes elsewhere
        try:
            return execute(plan)
        finally:
            pools.index_keys[layer], pools.index_pos[layer] = keys, pos

    backend.execute = dropping
    with pytest.raises(InvariantViolation, match="position stamp"):
        greedy(engine, PROMPTS[:1], 12)
    (violation,) = [e for _, _, e, _ in engine.sink.rows if isinstance(e, InvariantViolated)]  # type: ignore[union-attr]
    f = violation.fields
    assert f["step"] == 5  # the sixth step (steps count from 0)
    assert (f["layer"], f["state"]) == (layer, "qsa") and f["data_plane"] == f["control_plane"] - 1, f


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_a_wide_verify_that_accepts_n_is_n_plus_1_decodes_to_rounding(accepted: int) -> None:
    """The contract's verify test (tests/test_state_store.py) on the one-forward verify: the same verdicts, the
    same cursors and stamps, and every state byte within 1e-5 of n + 1 single decodes (its K-row GEMMs round
    differently from a decode's 1-row ones, so not bitwise)."""
    import test_state_store as conformance

    caps = derive_capacities(conformance.CONFIG, TINY.spec, activation_bytes=4)

    def make(mode: str) -> CudaBackend:
        return CudaBackend.for_capacities(TINY, caps, dtype=torch.float32, name="cuda-fp32", verify_mode=mode,
                                          **CPU_PATH)

    prompt, table = conformance.PROMPT, conformance.table(0)
    ref = conformance.greedy(make("rows"), 0, prompt, 5)
    drafts = tuple(ref[1 : 1 + accepted]) + tuple((t + 1) % 256 for t in ref[1 + accepted : 4])
    wide = make("wide")
    conformance.feed(wide, 0, prompt, 0)
    (o,) = wide.execute(StepPlan(1, (SeqWork(0, (ref[0],), len(prompt), table, True, drafts=drafts),))).outcomes
    assert o.accepted == accepted and o.token == ref[accepted + 1]
    plain = make("rows")
    conformance.greedy(plain, 0, prompt, accepted + 2)
    assert wide.cursors(0) == plain.cursors(0)
    a, b = wide.store.seqs[0].slot, plain.store.seqs[0].slot
    for name, t in wide.pools.state.items():
        assert torch.allclose(t[a].double(), plain.pools.state[name][b].double(), rtol=0, atol=1e-5), name
    n = o.cursors.kv_tokens
    for layer, k in wide.pools.keys.items():
        rows = k.view(-1, *k.shape[2:])[: n]
        assert torch.allclose(rows, plain.pools.keys[layer].view(-1, *k.shape[2:])[: n], rtol=0, atol=1e-5)
    for layer, k in wide.drafter.k.items():
        r = o.cursors.drafter_rows
        assert torch.allclose(k[a, :r], plain.drafter.k[layer][b, :r], rtol=0, atol=1e-5)
