"""The CUDA backend's batched math, run on the CPU in its fp32 parity mode (no GPU needed): the same
greedy tokens as the CPU reference backend on atlas-tiny, past the QSA inert bound, alone and batched;
its host-side n-gram ids equal the reference's; unsupported features are refused at start."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")


from atlas.backends.cpu.runner import Chunk
from atlas.backends.cuda import CudaBackend, random_model
from atlas.backends.cuda.batch import Group, GroupShape
from atlas.backends.cuda.ple import device_ngram_ids
from atlas.backends.cuda.runner import ngram_one
from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.errors import CapabilityError
from atlas.model import load_model
from atlas.model.ngram import ngram_ids, ngram_tables
from atlas.model.tiny import EOS, TINY_CONFIG
from atlas.registry import build_engine
from atlas.sampling.keyed import sample
from atlas.sampling.params import SamplingParams

PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog. " * 2),  # 90 tokens: past the inert bound (19)
    list(b"hello"),
    list(b"0123456789abcdefghij"),  # 20 tokens: the first sparse query at prefill
]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def tokens_of(tiny, backend: str, config: EngineConfig, prompts=PROMPTS, max_tokens: int = 24) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    if backend == "cpu":
        engine = build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=RecordingSink())
    else:
        engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(),
                              backend_options={"device": "cpu", "cuda_graphs": False})
    return [r.token_ids for r in generate(engine, prompts, params)]


def test_greedy_tokens_equal_the_cpu_backend_alone_and_batched(tiny) -> None:
    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    want = tokens_of(tiny, "cpu", config)
    # batched decodes take the fixed-shape MoE path (every expert on every row, batch 3 x top-2 < 8 experts
    # gathers the chosen ones instead): both must give the reference's tokens
    assert tokens_of(tiny, "cuda-fp32", config) == want
    alone = [tokens_of(tiny, "cuda-fp32", EngineConfig(max_seq_len=128, max_batch_size=1, prefill_chunk_tokens=32),
                       [p])[0] for p in PROMPTS]
    assert alone == want


def test_hidden_states_match_the_reference_chunked_past_the_inert_bound(tiny) -> None:
    from atlas.backends.cpu import CpuBackend

    cpu = CpuBackend(tiny, num_kv_blocks=32, block_size=16)
    dev = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device="cpu")
    prompt = PROMPTS[0]
    for chunk in (Chunk(1, prompt[:17], 0, range(8)), Chunk(1, prompt[17:60], 17, range(8)),
                  Chunk(1, prompt[60:61], 60, range(8))):
        want, got = cpu.forward_hidden([chunk])[0], dev.forward_hidden([chunk])[0]
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
    assert dev.cursors(1).as_tuple() == cpu.cursors(1).as_tuple()  # the summary positions (stamps: the store tests)


@pytest.mark.parametrize("width", [1, 5])
def test_group_ngram_ids_equal_the_reference(tiny, width: int) -> None:
    """The host's per-row ids (ngram_one, decode) and the device's for a whole group (layers.device_ngram_ids,
    from the slots' n-gram context continued by `width` tokens: a decode, or a prefill chunk) equal
    atlas.model.ngram.ngram_ids for the group's last `width` positions, EOS restarts included."""
    spec = tiny.spec
    ple = spec.ple
    assert ple is not None
    backend = CudaBackend(tiny, num_kv_blocks=16, dtype=torch.float32, device="cpu", cuda_graphs=False,
                          max_batch_size=8)
    g = torch.Generator().manual_seed(5)
    for trial in range(12):
        histories = torch.randint(0, spec.vocab_size, (8, ple.context_len + width), generator=g)
        for row in range(0, 8, 2 + trial % 2):  # EOS inside some contexts (or among the tokens) restarts the n-gram
            for _ in range(1 + trial % 3):
                histories[row, int(torch.randint(0, ple.context_len + width, (1,), generator=g))] = EOS
        slots = torch.randperm(8, generator=g)
        backend.pools.state["pctx"][slots] = histories[:, : ple.context_len]
        zero = torch.zeros(8, 1, dtype=torch.long)  # start, sentinel, a two-block table (positions 0..7)
        grp = Group.view(torch.cat([histories[:, ple.context_len :], zero, slots[:, None], zero, zero, zero], dim=1),
                         GroupShape(batch=8, width=width, key_blocks=2, qsa_select=False, ngram_heads=ple.num_heads,
                                    ple_layers=len(ple.layers), ngram_on_device=True), 4)
        device = device_ngram_ids(backend.pools, grp, ple, backend._ple_tables_dev)
        assert device.shape == (len(ple.layers), 8, width, ple.num_heads)
        for rank in range(len(ple.layers)):
            tables = ngram_tables(ple, spec.vocab_size, rank)
            for row in range(8):
                history = histories[row]
                want = ngram_ids(history, width, ple, tables)
                assert torch.equal(device[rank, row], want), (trial, rank, row)
                if width == 1:
                    got = ngram_one(history.tolist(), ple.ngram_size, ple.heads_per_ngram, ple.eos_token_id, tables)
                    assert got == want.flatten().tolist()


def test_every_feature_is_declared_and_a_configuration_beyond_it_is_refused_at_start(tiny) -> None:
    """Speculation, the ring, prefix caching and the MTP drafter are declared (tests/test_cuda_features.py runs
    them); what the backend cannot hold is refused at start with the knob named."""
    config = EngineConfig(num_drafts=3, ring_slots=2, enable_prefix_caching=True)
    engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny, backend_options={"device": "cpu"})
    c = engine.backend.capabilities
    assert (c.verify, c.per_row_qsa_verify, c.mtp_drafting, c.snapshot_ring, c.prefix_snapshots, c.fp32_parity,
            c.max_verify_width, c.prompt_logprobs) == (True, True, True, True, True, True, 4, True)
    assert engine.backend.pools.slot_bytes() == engine.capacities.ring_slot_bytes
    no_mtp = attrs.evolve(tiny, weights={k: t for k, t in tiny.weights.items() if not k.startswith("mtp.")})
    with pytest.raises(ValueError, match="no mtp"):
        build_engine("atlas-tiny", "cuda-fp32", config, loaded=no_mtp, backend_options={"device": "cpu"})
    narrow = CudaBackend(tiny, num_kv_blocks=64, dtype=torch.float32, device="cpu", verify_width=2)
    with pytest.raises(CapabilityError, match="holds 2 rows per verify"):
        narrow.capabilities.check(config, engine.capacities, "cuda-fp32")


def test_random_model_builds_from_a_config() -> None:
    model = random_model(TINY_CONFIG, device="cpu", dtype=torch.float32, seed=3)
    again = random_model(TINY_CONFIG, device="cpu", dtype=torch.float32, seed=3)
    assert model.fingerprint == again.fingerprint
    assert all(torch.equal(model.weights[k], again.weights[k]) for k in model.weights)
    assert torch.isfinite(model.weights["lm_head.weight"]).all() and model.weights["lm_head.weight"].std() > 0
    dev = CudaBackend(model, num_kv_blocks=8, block_size=16, dtype=torch.float32, device="cpu")
    logits = dev.forward([Chunk(0, (1, 2, 3), 0, (0,))])[0]
    assert logits.shape == (3, model.spec.vocab_size) and torch.isfinite(logits).all()


class EagerGraphs:
    """Stands in for DecodeGraphs on the CPU: the same padded, bucketed decode groups, run eagerly."""

    def __init__(self, backend: CudaBackend) -> None:
        self.backend = backend
        self.shapes: set = set()
        self.sampled_modes: set = set()

    def replay(self, shape, packed, padding):
        self.shapes.add(shape)
        self.logits = self.backend._decode_logits(packed, shape)
        return self.logits, self.logits.argmax(-1)

    def sample(self, shape, batch):
        """The sampler graph's work, eagerly: every padded row of the last replay's logits."""
        assert batch.packed.shape[0] == shape.batch == self.logits.shape[0]
        self.sampled_modes.add(batch.mode)
        return sample(self.logits, batch.to(self.logits.device))


def test_padded_decode_buckets_give_the_reference_tokens(tiny) -> None:
    """Decode rows padded to a power-of-two batch (scratch slots and KV block) and key blocks, as the CUDA
    graphs run them: the padding changes no real row's tokens."""
    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    want = tokens_of(tiny, "cpu", config)
    engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny, sink=RecordingSink(),
                          backend_options={"device": "cpu", "cuda_graphs": False})
    fake = engine.backend.graphs = EagerGraphs(engine.backend)  # type: ignore[attr-defined]
    got = [r.token_ids for r in generate(engine, PROMPTS, [SamplingParams(max_tokens=24, ignore_eos=True)] * 3)]
    assert got == want
    assert {s.batch for s in fake.shapes} >= {4} and all(s.key_blocks in (4, 8) for s in fake.shapes)
    assert any(s.qsa_select for s in fake.shapes) and any(not s.qsa_select for s in fake.shapes)


SAMPLED = [
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=11),
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=40, seed=3, logprobs=True,
                   top_logprobs=3),
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.1, min_p=0.05, seed=7, logprobs=True),
]


def sampled_run(engine) -> tuple[dict, dict]:
    """Tokens and logprobs per request of SAMPLED over PROMPTS (the engine's own outputs, step by step)."""
    tokens: dict = {}
    lps: dict = {}
    for i, (prompt, params) in enumerate(zip(PROMPTS, SAMPLED, strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            tops = out.new_top_logprobs or ((),) * len(out.new_logprobs)
            lps.setdefault(out.request_id, []).extend(zip(out.new_logprobs, tops, strict=True))
    return tokens, lps


def test_seeded_sampling_on_the_device_path_gives_the_cpu_backends_tokens(tiny) -> None:
    """Sampled rows go through the batched keyed sampler (eager, and the sampler-graph path over padded graph
    rows): the same tokens as the CPU reference's per-row sampler, and the same logprobs."""
    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    want, want_lp = sampled_run(build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=RecordingSink()))
    for graphs in (False, True):
        engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny, sink=RecordingSink(),
                              backend_options={"device": "cpu", "cuda_graphs": False})
        if graphs:
            fake = engine.backend.graphs = EagerGraphs(engine.backend)  # type: ignore[attr-defined]
        got, got_lp = sampled_run(engine)
        assert got == want, graphs
        assert [len(t) for t in got.values()] == [20, 20, 20]
        assert not want_lp["r0"] and not got_lp["r0"]  # r0 asked for none
        for rid in ("r1", "r2"):
            rows = want_lp[rid]
            assert len(got_lp[rid]) == len(rows) == 20 and len(rows[0][1]) == (3 if rid == "r1" else 0)
            for (lp, top), (lp2, top2) in zip(rows, got_lp[rid], strict=True):
                assert lp2 == pytest.approx(lp, abs=1e-4)
                assert [t for t, _ in top2] == [t for t, _ in top]
    assert "filtered" in fake.sampled_modes  # steps holding row 1 (top_p, top_k) sample on the sort path


def test_triton_gdn_kernels_in_the_batched_forward_match_the_torch_path(tiny) -> None:
    """The kernel wrapper's layouts (unrepeated key heads, log decay, state slots read from the packed group
    buffer) in a real batched forward: chunked prefill per sequence, then one decode group of 3 sequences.
    Interpreted on the CPU (TRITON_INTERPRET=1, as tests/test_kernels_*.py), compiled on a GPU."""
    from atlas.backends.cuda.gdn import triton_gdn
    from atlas.plan import SeqWork, StepPlan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel = triton_gdn()
    assert kernel is not None
    plain = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=device, max_batch_size=4,
                        kernels=False, cuda_graphs=False)
    fused = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=device, max_batch_size=4,
                        kernels=False, cuda_graphs=False)
    fused.gdn_kernel = kernel
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0][:40]]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    prefill = StepPlan(step=0, work=tuple(SeqWork(i, tuple(p), 0, tables[i], True) for i, p in enumerate(prompts)))
    decode = [SeqWork(i, (40 + i,), len(p), tables[i], True) for i, p in enumerate(prompts)]
    for backend in (plain, fused):
        backend.execute(prefill)
        backend._prepare(decode)
    want, got = plain._last_logits(decode), fused._last_logits(decode)
    for i in range(3):
        assert torch.allclose(got[i], want[i], rtol=0, atol=1e-4), (i, (got[i] - want[i]).abs().max())
    # the stamps the kernels wrote with the state (the chunk kernel's after it; the decode kernel's in it)
    assert int(plain.pools.stamps.max()) > 0 and torch.equal(fused.pools.stamps, plain.pools.stamps)


def test_triton_gdn_passes_the_prefill_knobs_for_bf16_and_keeps_the_parity_mode(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """bf16 activations take the chunk prefill kernel's bf16 work and registers prepare; fp32 ones (the parity mode)
    fp32 work and the scratch prepare."""
    import atlas_kernels.gdn_chunk_split as split

    from atlas.backends.cuda.gdn import triton_gdn

    seen = []

    def fake(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((q.dtype, kwargs["work"], kwargs["prepare"]))
        return torch.zeros(1)

    monkeypatch.setattr(split, "gdn_chunk_prefill_gated", fake)
    kernel = triton_gdn()
    assert kernel is not None
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(1, 3, 2, 4, dtype=dtype)
        kernel(q, q, q, q, q, q, q, q, q)
    assert seen == [(torch.bfloat16, "bf16", "registers"), (torch.float32, "fp32", "scratch")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_decode_is_bitwise_the_same_alone_and_in_a_batch(tiny, dtype: torch.dtype) -> None:
    """batch_invariant pads every decode group to one shape: a sequence's logits are bit-identical decoded
    alone or with 12 others (without it they differ in the last bits here: GEMMs of 1 and 13 rows round
    differently)."""
    from atlas.plan import SeqWork, StepPlan

    logits = []
    for batch in (1, 13):
        backend = CudaBackend(tiny, num_kv_blocks=64, block_size=16, dtype=dtype, device="cpu", max_batch_size=16,
                              batch_invariant=True, max_blocks_per_seq=4)
        tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(batch)]
        backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(range(40 + i, 60 + i)), 0, tables[i], True)
                                          for i in range(batch))))
        decode = [SeqWork(i, (50 + i,), 20, tables[i], True) for i in range(batch)]
        backend._prepare(decode)
        logits.append(backend._last_logits(decode)[0])
    assert torch.equal(logits[0], logits[1])


def test_a_wide_verify_through_the_triton_gdn_kernel_keeps_the_torch_paths_rows(tiny) -> None:
    """The one-forward verify with the GDN recurrent kernel (store_states, commit=False: the slot is not written,
    every row's state comes back for the commit) against the torch recurrence: the same verdicts, and after the
    commit the same state to fp32 rounding. Interpreted on the CPU, compiled on a GPU."""
    from atlas.backends.cuda.gdn import triton_gdn
    from atlas.plan import SeqWork, StepPlan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = []
    for kernel in (None, triton_gdn()):
        b = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=device, max_batch_size=2,
                        kernels=False, cuda_graphs=False, verify_width=4, verify_mode="wide")
        b.gdn_kernel = kernel
        backends.append(b)
    tables = [tuple(range(8)), tuple(range(8, 16))]
    outs = []
    for b in backends:
        first = b.execute(StepPlan(0, tuple(SeqWork(i, tuple(PROMPTS[i][:30]), 0, tables[i], True)
                                            for i in range(2)))).outcomes
        verify = tuple(SeqWork(i, (first[i].token,), len(PROMPTS[i][:30]), tables[i], True, drafts=(5, 6, 7))
                       for i in range(2))
        outs.append(b.execute(StepPlan(1, verify)).outcomes)
    for want, got in zip(*outs, strict=True):
        assert (got.accepted, got.token, got.cursors.as_tuple()) == (want.accepted, want.token, want.cursors.as_tuple())
    for name, t in backends[0].pools.state.items():
        assert torch.allclose(backends[1].pools.state[name][:2].float(), t[:2].float(), rtol=0, atol=1e-4), name
