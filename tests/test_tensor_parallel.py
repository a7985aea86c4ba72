"""Tensor / expert parallelism (atlas.backends.parallel) on CPUs: 2 spawned ranks over gloo, one thread each.

On atlas-tiny in fp32 (GDN, QSA attention past the inert bound, PLE, hyper-connections, MoE on every layer), TP=2
must equal the single-process CUDA backend (run on the CPU in its fp32 parity mode):
- logits within 1e-5 absolute at every prefill position and every decode step. Why 1e-5: TP=2 sums each
  row-parallel product as two halves plus an all-reduce, TP=1 in one GEMM, so only the fp32 summation order
  differs (a few ulps per layer); the logits are O(1) (max |logit| ~2.6 here), fp32's ulp at 2.6 is 2.4e-7, and
  the largest difference measured is 1.2e-6 (5 ulps) over 4 layers; 1e-5 leaves ~8x margin, and a wrong shard
  (a head, segment or expert misplaced) moves logits by O(0.1);
- the same greedy tokens, through StepPlans (execute) and through the whole engine on rank 0;
for both the routed experts split by width ("tp") and split by expert ("ep"); and, through the engine on rank 0,
n-gram speculation (verify + exact commit) and prefix caching give the single-process tokens, batch-invariant
mode gives a request the same bits alone and batched, and a command refused on every rank leaves them in step.
One spawn serves every multi-process test (30-35 s on 2 loaded cores: process start, model builds, a few
hundred steps of ~10 collectives each).
"""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

from atlas.backends.cpu.runner import Chunk
from atlas.backends.cuda import CudaBackend
from atlas.backends.parallel import Comm, TpBackend, TpLayout, local_spec, shard_weights
from atlas.backends.parallel.check import agreement
from atlas.backends.parallel.launch import spawn
from atlas.backends.parallel.load import load_shard
from atlas.backends.parallel.shard import Split, part_ranges, rule, slice_tensor
from atlas.config import EngineConfig, derive_capacities
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.model.tiny import save
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

TOL = 1e-5
MODES = ("tp", "ep")
PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog. " * 2),  # 90 tokens: 3 prefill chunks, past the inert bound
    list(b"hello"),
    list(b"0123456789abcdefghij"),
]
CONFIG = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
MAX_TOKENS = 16
# n-gram speculation: verify rows judged on every rank from the gathered logits, committed on every rank's shard
SPEC_TOKENS = 24  # atlas-tiny's greedy text repeats enough by then for n-gram drafts to be accepted
SPEC_CONFIG = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=3, drafter="ngram")


def _engine_tokens(rank: int, comm: Comm, device: torch.device, mode: str, config: EngineConfig = CONFIG,
                   max_tokens: int = MAX_TOKENS) -> tuple[list[tuple[int, ...]], dict] | None:
    """Rank 0: the engine over a TpBackend, greedy tokens of PROMPTS (and the engine's stats); the other ranks
    serve its commands."""
    model = load_model("atlas-tiny")
    caps = derive_capacities(config, model.spec, activation_bytes=4)
    backend = TpBackend.for_capacities(model, caps, layout=TpLayout(comm.tp, rank, mode), comm=comm,  # type: ignore[arg-type]
                                       dtype=torch.float32, device=device, cuda_graphs=False)
    if rank != 0:
        from atlas.backends.parallel import worker_loop

        worker_loop(backend)
        return None
    engine = Engine(backend, tokenizer=model.tokenizer, config=config, capacities=caps, spec=model.spec,
                    model_name=model.name, sink=RecordingSink(), fingerprint=model.fingerprint)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(PROMPTS)
    out = [r.token_ids for r in generate(engine, PROMPTS, params)]
    stats = engine.stats()
    backend.close()
    return out, {"verify_steps": stats.spec_verify_steps, "accepted": stats.spec_drafts_accepted}


def _refusal(rank: int, comm: Comm, device: torch.device) -> tuple[str, float] | None:
    """Rank 0 feeds a token outside the vocabulary (refused on every rank before any collective), then a good
    chunk: the ranks are still in step. (the error text, the good chunk's max |TP - ref| logit difference)"""
    model = load_model("atlas-tiny")
    kwargs = dict(num_kv_blocks=4, dtype=torch.float32, device=device, cuda_graphs=False)
    backend = TpBackend.from_full(model, TpLayout(comm.tp, rank), comm, **kwargs)  # type: ignore[arg-type]
    if rank != 0:
        from atlas.backends.parallel import worker_loop

        worker_loop(backend)
        assert backend.last_error is not None and "outside the vocabulary" in backend.last_error
        return None
    try:
        backend.forward([Chunk(1, [1, 999], 0, range(4))])
        error = ""
    except ValueError as exc:
        error = str(exc)
    good = Chunk(1, PROMPTS[1], 0, range(4))
    diff = (backend.forward([good])[0] - CudaBackend(model, **kwargs).forward([good])[0]).abs().max().item()
    backend.close()
    return error, diff


def _invariance(rank: int, comm: Comm, device: torch.device) -> tuple[list, list] | None:
    """batch_invariant=True under TP=2: sequence 0's (token, logprob, top-5) per step, alone and beside two others
    (without the mode, the same comparison differs in the logprobs' last bits: measured)."""
    from atlas.plan import SeqWork, StepPlan

    model = load_model("atlas-tiny")
    backend = TpBackend.from_full(model, TpLayout(comm.tp, rank), comm, num_kv_blocks=12, dtype=torch.float32,  # type: ignore[arg-type]
                                  device=device, max_batch_size=3, batch_invariant=True, max_blocks_per_seq=4)
    if rank != 0:
        from atlas.backends.parallel import worker_loop

        worker_loop(backend)
        return None
    params = SamplingParams(logprobs=True, top_logprobs=5)
    runs = []
    for batch in (1, 3):
        prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[0][:30]][:batch]
        seen, last = [], [None] * batch
        for step in range(6):
            work = tuple(SeqWork(seq_id=i, tokens=tuple(p) if step == 0 else (last[i],),
                                 start=0 if step == 0 else len(p) + step - 1, block_table=tuple(range(4 * i, 4 * i + 4)),
                                 sample=True, sampling=params) for i, p in enumerate(prompts))
            out = backend.execute(StepPlan(step=step, work=work)).outcomes
            last = [o.token for o in out]
            seen.append((out[0].token, out[0].logprob, out[0].top_logprobs))
        backend.execute(StepPlan(step=99, work=(), release=tuple(range(batch))))
        runs.append(seen)
    backend.close()
    return runs[0], runs[1]


PREFIX_CONFIG = EngineConfig(max_seq_len=160, max_batch_size=3, prefill_chunk_tokens=32, enable_prefix_caching=True)


def _turns(engine: Engine) -> list[tuple[int, ...]]:
    """Two turns of one conversation: the second prompt is the first, its answer and a follow-up."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)]
    first = generate(engine, [PROMPTS[0]], params)[0].token_ids
    second = generate(engine, [PROMPTS[0] + list(first) + list(b" and then")], params)[0].token_ids
    return [first, second]


def _prefix(rank: int, comm: Comm, device: torch.device) -> tuple[list, int] | None:
    """Rank 0: two turns with prefix caching on TP=2 (the second turn starts from a prefix snapshot: every rank
    restores its own shard of the state); (the turns' tokens, prefix cache hits)."""
    model = load_model("atlas-tiny")
    caps = derive_capacities(PREFIX_CONFIG, model.spec, activation_bytes=4)
    backend = TpBackend.for_capacities(model, caps, layout=TpLayout(comm.tp, rank), comm=comm,  # type: ignore[arg-type]
                                       dtype=torch.float32, device=device, cuda_graphs=False)
    if rank != 0:
        from atlas.backends.parallel import worker_loop

        worker_loop(backend)
        return None
    engine = Engine(backend, tokenizer=model.tokenizer, config=PREFIX_CONFIG, capacities=caps, spec=model.spec,
                    model_name=model.name, sink=RecordingSink(), fingerprint=model.fingerprint)
    turns = _turns(engine)
    hits = engine.stats().prefix_cache_hits
    backend.close()
    return turns, hits


def _job(rank: int, comm: Comm, device: torch.device) -> dict:
    checks = agreement(rank, comm, device, model=functools.partial(load_model, "atlas-tiny"), modes=MODES,
                       decode_steps=MAX_TOKENS, batch=3)
    engine = {mode: _engine_tokens(rank, comm, device, mode) for mode in MODES}
    engine["spec"] = _engine_tokens(rank, comm, device, "tp", SPEC_CONFIG, SPEC_TOKENS)
    return {"agreement": {a.experts: a for a in checks}, "engine": engine, "refusal": _refusal(rank, comm, device),
            "invariance": _invariance(rank, comm, device), "prefix": _prefix(rank, comm, device)}


@pytest.fixture(scope="module")
def tp2() -> dict:
    return spawn(2, _job, backend="gloo")


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


# -- shards, in one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_rank_shards_put_back_together_are_the_full_weights(tiny, mode) -> None:
    spec = tiny.spec
    shards = [shard_weights(spec, tiny.weights, TpLayout(2, r, mode)) for r in range(2)]
    split_count = 0
    for name, full in tiny.weights.items():
        if name.startswith("mtp."):
            assert all(name not in s for s in shards)
            continue
        split = rule(spec, TpLayout(2, 0, mode), name)
        if split is None:
            assert all(torch.equal(s[name], full) for s in shards), name
            continue
        split_count += 1
        pieces = [[] for _ in (split.segments or (0,))]
        for r, s in enumerate(shards):  # each rank's part of every segment, in order
            widths = [hi - lo for lo, hi in part_ranges(split, full.shape[split.dim], TpLayout(2, r, mode))]
            for seg, part in enumerate(s[name].split(widths, dim=split.dim)):
                pieces[seg].append(part)
        whole = torch.cat([torch.cat(p, dim=split.dim) for p in pieces], dim=split.dim)
        assert torch.equal(whole, full), name
        assert shards[0][name].shape[split.dim] * 2 == full.shape[split.dim], name
    # q/k/v/o of 1 attention layer, 8 GDN tensors x 3 layers, 5 MoE tensors x 4 layers, embed + lm_head
    assert split_count == 4 + 8 * 3 + 5 * 4 + 2


def test_vocab_padding_gives_the_last_rank_zero_rows() -> None:
    t = torch.arange(14, dtype=torch.float32).view(7, 2)
    last = slice_tensor(t, Split(0, pad_to=8), TpLayout(2, 1))
    assert torch.equal(last[:3], t[4:]) and torch.equal(last[3], torch.zeros(2))
    assert torch.equal(slice_tensor(t, Split(0, pad_to=8), TpLayout(2, 0)), t[:4])


def test_a_degree_the_heads_do_not_divide_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide num_attention_heads=4"):
        local_spec(tiny.spec, TpLayout(3, 0))


def test_tp1_is_the_cuda_backend_bit_for_bit(tiny) -> None:
    kwargs = dict(num_kv_blocks=8, dtype=torch.float32, device="cpu", cuda_graphs=False)
    ref = CudaBackend(tiny, **kwargs)
    tp = TpBackend.from_full(tiny, TpLayout(1, 0), Comm(1, 0), **kwargs)
    for chunk in (Chunk(1, PROMPTS[0][:40], 0, range(8)), Chunk(1, PROMPTS[0][40:41], 40, range(8))):
        assert torch.equal(tp.forward([chunk])[0], ref.forward([chunk])[0])


@pytest.mark.parametrize("mode", MODES)
def test_sharded_safetensors_reads_equal_the_in_memory_shards(tiny, tmp_path, mode) -> None:
    root = save(tmp_path / "tiny")
    full = load_model(root)
    for rank in range(2):
        layout = TpLayout(2, rank, mode)
        spec, shard = load_shard(root, layout)
        want = shard_weights(spec, full.weights, layout)
        assert shard.keys() == want.keys()
        assert all(torch.equal(shard[k], want[k]) for k in want), [k for k in want if not torch.equal(shard[k], want[k])]


@pytest.mark.parametrize("mode", MODES)
def test_sharded_reads_unpack_qwen3_next_layouts(hf_checkpoints, mode) -> None:
    # transformers' qwen3_next checkpoint: packed in_proj_qkvz / in_proj_ba, per-expert tensors, a dense layer
    root, _ = hf_checkpoints("qwen3_next_moe")
    full = load_model(root)
    for rank in range(2):
        layout = TpLayout(2, rank, mode)
        spec, shard = load_shard(root, layout)
        want = shard_weights(spec, full.weights, layout)
        assert shard.keys() == want.keys()
        assert all(torch.equal(shard[k], want[k]) for k in want), [k for k in want if not torch.equal(shard[k], want[k])]


# -- 2 ranks over gloo -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_tp2_logits_equal_tp1_within_tolerance(tp2, mode) -> None:
    a = tp2["agreement"][mode]
    assert a.prefill_max_abs <= TOL, a
    assert len(a.decode_max_abs) == MAX_TOKENS and max(a.decode_max_abs) <= TOL, a.decode_max_abs
    assert a.argmax_equal
    assert a.prefill_max_abs > 0 or max(a.decode_max_abs) > 0  # the ranks' sums really ran: not bit-equal


@pytest.mark.parametrize("mode", MODES)
def test_tp2_greedy_tokens_equal_tp1_through_step_plans(tp2, mode) -> None:
    a = tp2["agreement"][mode]
    assert len(a.tokens_ref) == 3 and all(len(t) == MAX_TOKENS + 1 for t in a.tokens_ref)
    assert a.tokens_tp == a.tokens_ref


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_on_rank_0_gives_the_single_process_tokens(tp2, tiny, mode) -> None:
    ref = build_engine("atlas-tiny", "cuda-fp32", CONFIG, loaded=tiny, sink=RecordingSink(),
                       backend_options={"device": "cpu", "cuda_graphs": False})
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(PROMPTS)
    want = [r.token_ids for r in generate(ref, PROMPTS, params)]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert tp2["engine"][mode][0] == want


def test_ngram_speculation_under_tp_gives_the_tokens_of_speculation_off(tp2, tiny) -> None:
    ref = build_engine("atlas-tiny", "cuda-fp32", CONFIG, loaded=tiny, sink=RecordingSink(),
                       backend_options={"device": "cpu", "cuda_graphs": False})
    params = [SamplingParams(max_tokens=SPEC_TOKENS, ignore_eos=True)] * len(PROMPTS)
    want = [r.token_ids for r in generate(ref, PROMPTS, params)]
    tokens, stats = tp2["engine"]["spec"]
    assert stats["verify_steps"] > 0 and stats["accepted"] > 0, stats  # drafts were verified and some kept
    assert tokens == want


def test_random_shards_agree_on_replicated_tensors_and_have_rank_shapes() -> None:
    from atlas.backends.parallel.random_shard import random_shard
    from atlas.backends.parallel.shard import local_shape
    from atlas.model.tiny import TINY_CONFIG
    from atlas.model.weights import expected_shapes

    (model, a), (_, b) = (random_shard(TINY_CONFIG, TpLayout(2, r, "ep"), device="cpu", dtype=torch.float32)
                          for r in range(2))
    spec = model.spec
    for name, full in expected_shapes(spec).items():
        assert a[name].shape == b[name].shape == local_shape(spec, TpLayout(2, 0, "ep"), name, full), name
        same = torch.equal(a[name], b[name])
        assert same == (rule(spec, TpLayout(2, 0, "ep"), name) is None), name  # every rank draws the router alike


def test_a_refused_command_leaves_the_ranks_in_step(tp2) -> None:
    error, diff = tp2["refusal"]
    assert "token ids [999] outside the vocabulary" in error
    assert diff <= TOL


def test_batch_invariant_mode_under_tp_gives_a_request_the_same_bits_alone_and_batched(tp2) -> None:
    alone, batched = tp2["invariance"]
    assert len(alone) == 6 and all(lp is not None for _, lp, _ in alone)
    assert batched == alone  # tokens, logprobs and top-5 logprobs, float for float


def test_prefix_caching_under_tp_gives_the_cold_runs_tokens(tp2, tiny) -> None:
    cold = build_engine("atlas-tiny", "cuda-fp32", attrs.evolve(PREFIX_CONFIG, enable_prefix_caching=False),
                        loaded=tiny, sink=RecordingSink(), backend_options={"device": "cpu", "cuda_graphs": False})
    turns, hits = tp2["prefix"]
    assert hits >= 1  # the second turn started from the first turn's prefix snapshot
    assert turns == _turns(cold)
