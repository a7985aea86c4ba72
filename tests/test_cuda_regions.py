"""The decode step and prefill chunks as regions (Tuning.regions, atlas.backends.cuda.regions) compute what the
layer stack computes: bit for bit in fp32 with the regions run eagerly (logits and every state pool and stamp
the step wrote), the CPU reference's tokens end to end, and every region traces into one graph (Dynamo,
fullgraph=True: no graph break, so Inductor on the GPU sees each region whole)."""

from __future__ import annotations

import collections
import functools
import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from atlas.backends.cuda import CudaBackend, regions
from atlas.backends.cuda.tuning import EAGER, Tuning
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Dynamo's recompile limit (the name moved between torch versions; atlas.backends.cuda.compiled raises it the same way)
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"



@pytest.fixture
def recompile_limit():  # type: ignore[no-untyped-def]
    """Dynamo's recompile limit at least 32 for one test (as atlas.backends.cuda.compiled sets it), through the
    config's own patch: monkeypatch.setattr on the config module undid it wrongly, and a later test in the same
    process (tests/test_kernels_conv_norms.py's compiled conv) then found no recompile_limit at all."""
    with torch._dynamo.config.patch(**{_LIMIT: max(getattr(torch._dynamo.config, _LIMIT), 32)}):
        yield


# 3 sequences: one past the QSA inert bound (the selected path), one short, one in between
PROMPTS = [list(b"The quick brown fox jumps over the lazy dog. " * 2)[:70], list(b"hello"), list(b"0123456789abcdefghij")]
# below atlas-tiny's QSA inert bound (19 keys) through the first decodes: dense groups, where the paged kernel applies
SHORT = [list(b"hello"), list(b"0123456789"), list(b"ab")]
TABLES = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
# the layer stack (the reference) and the regions run eagerly, every other part plain torch
LAYERS = EAGER
REGIONS = attrs.evolve(EAGER, regions=True)
# the routed experts' forms: plain torch, the Triton kernels
MOE = {"torch": {}, "triton": {"moe_kernels": True}}


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def _decode(tiny, tuning: Tuning, *, kernels: bool, steps: int = 2, prompts: list[list[int]] = PROMPTS,  # type: ignore[no-untyped-def]
            dtype: torch.dtype = torch.float32):
    """(logits of each decode step [3, vocab], the pools' state and stamps after them) on cuda-fp32 (or `dtype`)."""
    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=dtype, device=DEVICE,
                          max_batch_size=4, kernels=kernels, cuda_graphs=False, tuning=tuning)
    backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, TABLES[i], True) for i, p in enumerate(prompts))))
    out = []
    for step in range(steps):
        decode = [SeqWork(i, (40 + i + step,), len(p) + step, TABLES[i], True) for i, p in enumerate(prompts)]
        backend._prepare(decode)
        logits = backend._last_logits(decode)
        out.append(torch.stack([logits[i].float() for i in range(len(prompts))]))
        for w in decode:
            backend._advance(w)
    pools = backend.pools
    state = {**{f"state.{k}": v for k, v in pools.state.items()}, **{f"stamp.{k}": v for k, v in pools.stamp.items()},
             **{f"gdn.{k}": v for k, v in pools.gdn_state.items()}, **{f"keys.{k}": v for k, v in pools.keys.items()},
             **{f"index.{k}": v for k, v in pools.index_keys.items()}, "paged_pos": pools.paged_pos}
    return out, {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="the Triton GDN kernel runs on a GPU only"))], ids=["torch-gdn", "triton-gdn"])
@pytest.mark.parametrize("moe", list(MOE))
def test_regions_equal_the_layer_stack_bit_for_bit(tiny, kernels: bool, moe: str) -> None:  # type: ignore[no-untyped-def]
    """moe="triton": the routed kernels with the route ranked in the tail region and their pairs summed in the
    next region (moe_routed(summed=False), regions.settle) against the layer stack's counted-by-the-kernel route
    and its own sum."""
    want_logits, want_state = _decode(tiny, attrs.evolve(LAYERS, **MOE[moe]), kernels=kernels)
    got_logits, got_state = _decode(tiny, attrs.evolve(REGIONS, **MOE[moe]), kernels=kernels)
    for want, got in zip(want_logits, got_logits, strict=True):
        assert torch.equal(want, got)
    assert want_state.keys() == got_state.keys()
    for name, want in want_state.items():
        assert torch.equal(want, got_state[name]), name


@pytest.mark.parametrize("tuning,widths", [(REGIONS, [70, 5, 20, 1]), (LAYERS, [])], ids=["regions", "layers"])
def test_regions_are_taken_for_prefill_chunks_and_decode_groups(tiny, tuning: Tuning, widths: list[int]) -> None:  # type: ignore[no-untyped-def]
    calls = []
    real = regions.regions_stack

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[3].shape.width)
        return real(*args, **kwargs)

    regions.regions_stack = spy
    try:
        _decode(tiny, tuning, kernels=False, steps=1)
    finally:
        regions.regions_stack = real
    assert calls == widths  # each prefill chunk alone (the three prompts' lengths), then the decode group


def test_prefill_regions_equal_the_layer_stack_bit_for_bit(tiny) -> None:  # type: ignore[no-untyped-def]
    """Prefill chunks through the regions (run eagerly) write the layer stack's state and give its logits, and
    the decodes after them too."""
    want_logits, want_state = _decode(tiny, LAYERS, kernels=False)
    got_logits, got_state = _decode(tiny, REGIONS, kernels=False)
    for want, got in zip(want_logits, got_logits, strict=True):
        assert torch.equal(want, got)
    for name, want in want_state.items():
        assert torch.equal(want, got_state[name]), name


def _trace_regions(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], collections.Counter[str]]:
    """regions.compiled as Dynamo with fullgraph=True (it raises on any graph break) and backend "eager" (the traced
    graph run as is, so a result must equal the uncompiled regions'): (the functions traced, their compiles)."""
    torch._dynamo.reset()
    traced: list[str] = []
    compiles: collections.Counter[str] = collections.Counter()

    @functools.cache  # as the real `compiled`: one wrapper a function (a new one would recompile)
    def fullgraph(fn, mode):  # type: ignore[no-untyped-def]
        if mode == "none":
            return fn
        traced.append(fn.__name__)

        def backend(gm, inputs, name=fn.__name__):  # type: ignore[no-untyped-def]
            compiles[name] += 1
            return gm.forward

        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=None)

    monkeypatch.setattr(regions, "compiled", fullgraph)
    return traced, compiles


def test_every_region_traces_whole(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Dynamo with fullgraph=True raises on any graph break; backend "eager" runs the traced graph as is, so the
    result must also equal the uncompiled regions'."""
    traced, compiles = _trace_regions(monkeypatch)
    want, want_state = _decode(tiny, REGIONS, kernels=False, steps=2)
    got, got_state = _decode(tiny, attrs.evolve(REGIONS, compile=True), kernels=False, steps=2)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    # every state and stamp as the eager regions leave them: the compiled PLE regions (prefill and decode) write
    # their conv states in the region and stamp them with the GDN convs' at the end, the eager ones as they go
    assert want_state.keys() == got_state.keys()
    for name, w in want_state.items():
        assert torch.equal(w, got_state[name]), name
    assert {"gdn_head", "attn_head", "gdn_tail", "attn_tail", "final_mix", "ple_block", "prologue",
            "group_columns"} <= set(traced)
    # a compiled decode's (prefill chunks keep theirs eager); the group's columns for the decode steps only
    assert compiles["prologue"] == 1 and compiles["group_columns"] == 1, compiles
    # atlas-tiny's PLE layers are its first two: the first settles no ffn, the second does (two graphs), each for
    # the prefill chunks (token dimension symbolic) and for the decode
    assert compiles["ple_block"] == 4, compiles
    # the three prefill chunks (70, 5 and 20 tokens) share one graph a GDN region and variant (their token
    # dimension marked dynamic before the first call: no static graph for 70, no recompile; a region that
    # specialised the marked dimension would raise), and the decode has its own: gdn_head's two variants (the
    # first layer's and a PLE layer's, with no ffn to settle; and the rest) x (prefill, decode), gdn_tail's one x
    # (prefill, decode). Without the mark: a static graph for 70 tokens, then a symbolic one (6 and 3)
    assert compiles["gdn_head"] == 4 and compiles["gdn_tail"] == 2, compiles


def test_regions_give_the_reference_tokens_through_the_engine(tiny) -> None:  # type: ignore[no-untyped-def]
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    tokens = {}
    for backend, options in (("cpu", {}), ("cuda-fp32", {"device": DEVICE, "cuda_graphs": False,
                                                         "tuning": REGIONS})):
        engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(),
                              backend_options=options)
        tokens[backend] = [r.token_ids for r in generate(engine, PROMPTS, params)]
    assert tokens["cuda-fp32"] == tokens["cpu"]


@pytest.mark.parametrize("rows,experts,k", [(1, 16, 4), (64, 16, 4), (300, 8, 2), (7, 64, 8)])
def test_ranked_topk_is_a_stable_descending_topk(rows: int, experts: int, k: int) -> None:
    from atlas.backends.cuda.moe import ranked_topk

    gen = torch.Generator().manual_seed(rows * experts + k)
    probs = torch.softmax(torch.randn(rows, experts, generator=gen), dim=-1)
    probs[: rows // 2, 1::3] = probs[: rows // 2, :1]  # ties with expert 0 in half the rows: index order breaks them
    values, index = ranked_topk(probs, k)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    assert torch.equal(index, order.indices[:, :k])
    assert torch.equal(values, order.values[:, :k])
    if rows > 1:  # without ties torch.topk's own result
        plain = torch.softmax(torch.randn(rows, experts, generator=gen), dim=-1)
        got, want = ranked_topk(plain, k), torch.topk(plain, k)
        assert torch.equal(got[1], want.indices) and torch.equal(got[0], want.values)


@pytest.mark.parametrize("rows,experts,k", [(1, 16, 4), (64, 16, 4), (33, 8, 2)])
def test_counted_route_is_the_sorted_route(rows: int, experts: int, k: int) -> None:
    from atlas.backends.cuda.moe import counted_route

    gen = torch.Generator().manual_seed(rows + experts)
    top_i = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)])
    experts_sorted, order = torch.sort(top_i.flatten(), stable=True)
    offsets = torch.searchsorted(experts_sorted, torch.arange(experts + 1), out_int32=True)
    for ranked in (False, True):
        got_order, got_offsets = counted_route(top_i, experts, ranked=ranked)
        assert torch.equal(got_order, order) and torch.equal(got_offsets, offsets), ranked
        assert got_offsets.dtype == torch.int32 and got_order.dtype == order.dtype


@pytest.mark.parametrize("dilation", [1, 3])
def test_the_library_conv_equals_the_windowed_product(dilation: int) -> None:
    from atlas.backends.cuda.primitives import conv_step

    gen = torch.Generator().manual_seed(dilation)
    b, c, k, t = 2, 24, 4, 37
    state = (k - 1) * dilation
    prev, new = torch.randn(b, c, state, generator=gen), torch.randn(b, c, t, generator=gen)
    weight = torch.randn(c, 1, k, generator=gen)
    want, cols = conv_step(prev, new, weight, dilation, library=False)
    got, got_cols = conv_step(prev, new, weight, dilation, library=True)
    assert torch.equal(cols, got_cols)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    bf = [x.to(DEVICE, torch.bfloat16) for x in (prev, new, weight)]
    want, _ = conv_step(*bf, dilation, library=False)
    got, _ = conv_step(*bf, dilation, library=True)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="Inductor on the GPU: the compiled regions")
@pytest.mark.parametrize("variant", ["regions", "default"])
def test_compiled_regions_give_the_reference_tokens_on_the_gpu(tiny, variant: str) -> None:  # type: ignore[no-untyped-def]
    """fp32, CUDA graphs on: the regions through torch.compile alone, the default arrangement (the paged decode
    attention, the routed kernels, the prefill graphs, the batch-3 products through cuBLAS: GEMV_ROWS 1), greedy and
    seeded rows side by side, against the CPU reference."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20, seed=3)]
    tuning = {"regions": attrs.evolve(REGIONS, compile=True), "default": Tuning()}[variant]
    for prompts in (PROMPTS, SHORT):  # QSA-selected decode groups (sdpa), then dense ones (the paged kernel)
        tokens = {}
        for backend, options in (("cpu", {}), ("cuda-fp32", {"device": DEVICE, "cuda_graphs": True,
                                                             "tuning": tuning})):
            engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(),
                                  backend_options=options)
            tokens[backend] = [r.token_ids for r in generate(engine, prompts, params)]
            engine.close()
        assert tokens["cuda-fp32"] == tokens["cpu"]


@pytest.mark.parametrize("parts", ["regions", "default"])
def test_compiled_prefill_regions_give_the_reference_tokens(tiny, monkeypatch: pytest.MonkeyPatch, request,  # type: ignore[no-untyped-def]
                                                            parts: str) -> None:
    """32-token prefill chunks through the compiled regions (Inductor on a GPU; on the CPU the traced graphs run
    eagerly, what is tested there is Dynamo's tracing with the marked token dimension) give the CPU reference's
    tokens: the regions alone, and the default arrangement (the GDN heads' conv the Triton kernel on a GPU, the
    windowed product on the CPU; the routed kernels on the route the tail region counts). Without fullgraph=True
    this raised ConstraintViolationError (H200 and CPU)."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    if DEVICE != "cuda":  # the compiled module's own options (fullgraph, dynamic), the eager backend
        from atlas.backends.cuda import compiled as module

        real = torch.compile
        monkeypatch.setattr(module.torch, "compile", lambda fn, **kw: real(fn, **{**kw, "mode": None,
                                                                               "backend": "eager"}))
        module._compile.cache_clear()
        torch._dynamo.reset()
        request.addfinalizer(module._compile.cache_clear)  # no eager-backed function outlives the test
    tuning = attrs.evolve(REGIONS, compile=True) if parts == "regions" else Tuning(prefill_graphs=DEVICE == "cuda")
    tokens = {}
    for backend, options in (("cpu", {}), ("cuda-fp32", {"device": DEVICE, "cuda_graphs": DEVICE == "cuda",
                                                         "tuning": tuning})):
        engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(), backend_options=options)
        tokens[backend] = [r.token_ids for r in generate(engine, PROMPTS, params)]
        engine.close()
    assert tokens["cuda-fp32"] == tokens["cpu"]


def test_the_library_conv_is_for_prefill_chunks_of_a_non_invariant_backend(tiny) -> None:  # type: ignore[no-untyped-def]
    from atlas.backends.cuda.layers import GroupOps

    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.bfloat16, device=DEVICE,
                          max_batch_size=4, kernels=False, cuda_graphs=False)
    tuning = attrs.evolve(EAGER, library_conv=True)
    seen = {}
    for width in (1, 8):
        shape = backend._shape(1, width, width)
        grp = regions.Group.view(backend._padding(shape).to(DEVICE), shape, 16)
        for invariant in (False, True):
            ops = GroupOps(tiny.spec, backend.weights, backend.pools, grp, eager_moe=width > 1, gdn_kernel=None,
                            tuning=tuning, invariant=invariant)
            seen[width, invariant] = ops.library_conv
    assert seen == {(1, False): False, (1, True): False, (8, False): True, (8, True): False}


def test_row_verifies_through_the_regions_give_speculation_offs_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """fp32 verifies run row by row as decode-shaped groups, so they take the regions too: MTP speculation with
    the regions gives the layer stack's tokens without speculation."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    runs = {}
    for name, drafts, tuning in (("off", 0, LAYERS), ("regions", 3, REGIONS)):
        config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=drafts,
                              drafter="mtp")
        engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny, sink=RecordingSink(),
                              backend_options={"device": DEVICE, "cuda_graphs": False, "tuning": tuning})
        runs[name] = [r.token_ids for r in generate(engine, PROMPTS, params)]
        if drafts:
            assert engine.stats().spec_verify_steps > 0
    assert runs["regions"] == runs["off"]


def test_fused_weights_are_padded_to_aligned_rows_with_zeros(tiny) -> None:  # type: ignore[no-untyped-def]
    """The hyper sites' mix-down + inject and the MoE router + shared-expert input are padded to ALIGN_ROWS output
    rows (cuBLAS's sm90 kernels need 16-byte aligned output rows), the padding zero and dropped by split_out."""
    from atlas.backends.cuda.primitives import split_out
    from atlas.backends.cuda.weights import ALIGN_ROWS, prepare_weights

    spec, raw = tiny.spec, tiny.weights
    w = prepare_weights(spec, dict(raw))
    site = "layers.0.attn_hyper_connection."
    down = w[site + "fused_down.weight"]
    rows = spec.hc_lowrank + spec.hc_count
    assert down.shape[0] % ALIGN_ROWS == 0 and down.shape[0] >= rows
    assert torch.equal(down[:rows], torch.cat([raw[site + "input_mix_weight_down.weight"],
                                               raw[site + "block_inject_weight.weight"]]) / spec.hc_count)
    assert not down[rows:].any()
    moe = next(f"layers.{i}.mlp.fused_in.weight" for i in range(spec.num_layers) if spec.moe_layers[i])
    assert w[moe].shape[0] % ALIGN_ROWS == 0
    y = torch.arange(10.0)[None]
    assert [p.tolist() for p in split_out(y, [3, 4])] == [[[0.0, 1.0, 2.0]], [[3.0, 4.0, 5.0, 6.0]]]
    assert [p.shape[-1] for p in split_out(y, [3, 7])] == [3, 7]



@pytest.mark.parametrize("stack", ["layers", "regions"])
def test_the_paged_decode_attention_matches_the_torch_path(tiny, stack: str) -> None:  # type: ignore[no-untyped-def]
    """attention_kernels (a decode's split-K kernel over the pools in place) against the materialised scores, fp32,
    through the layer stack and the regions; the regions' paged step equals the layer stack's bit for bit."""
    base = REGIONS if stack == "regions" else LAYERS
    want, want_state = _decode(tiny, base, kernels=False, prompts=SHORT)
    got, got_state = _decode(tiny, attrs.evolve(base, attention_kernels=True), kernels=False, prompts=SHORT)
    for a, b in zip(want, got, strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-5
        assert not torch.equal(a, b) or DEVICE == "cuda"  # a different summation: the kernel really ran (CPU)
    for name, state in want_state.items():  # the keys and states the step wrote are the same
        if name.startswith(("keys.", "stamp.", "paged_pos", "index.")):
            assert torch.equal(state, got_state[name]), name
    if stack == "regions":
        layers, _ = _decode(tiny, attrs.evolve(LAYERS, attention_kernels=True), kernels=False, prompts=SHORT)
        assert all(torch.equal(a, b) for a, b in zip(layers, got, strict=True))


def test_paged_attention_is_for_dense_decode_groups_only(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from atlas.backends.cuda import attention

    calls = []
    real = attention.attn_paged

    def spy(q, k_pool, v_pool, grp, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((grp.shape.width, grp.shape.qsa_select))
        return real(q, k_pool, v_pool, grp, **kwargs)

    monkeypatch.setattr(attention, "attn_paged", spy)
    monkeypatch.setattr(regions, "attn_paged", spy)
    _decode(tiny, attrs.evolve(REGIONS, attention_kernels=True), kernels=False, steps=1)  # QSA-selected
    assert calls == []
    _decode(tiny, attrs.evolve(REGIONS, attention_kernels=True), kernels=False, steps=1, prompts=SHORT)
    assert calls and set(calls) == {(1, False)}


def test_linear_as_a_reduction_is_the_product() -> None:
    from atlas.backends.cuda import primitives
    from atlas.backends.cuda.primitives import linear

    gen = torch.Generator().manual_seed(5)
    for k in (40, 2 * primitives.SPLIT_K):  # the first K one reduction, the second cut into two chunks
        x, w = torch.randn(3, 1, k, generator=gen), torch.randn(24, k, generator=gen)
        for gemv in ("split",):
            assert torch.allclose(linear(x, w, gemv), x @ w.T, atol=1e-4, rtol=1e-5), (k, gemv)
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            got = linear(xb, wb, gemv)
            assert got.dtype == torch.bfloat16  # fp32 accumulation, rounded once as the GEMM rounds
            want = (xb.float() @ wb.float().T).to(torch.bfloat16).float()
            assert torch.allclose(got.float(), want, atol=1e-3, rtol=2**-7), (k, gemv)


def test_the_small_products_are_reductions_only_in_compiled_decode_regions_of_few_rows(
        tiny, monkeypatch: pytest.MonkeyPatch, recompile_limit) -> None:  # type: ignore[no-untyped-def]
    """The compiled decode regions (Dynamo, eager backend) of <= GEMV_ROWS rows take primitives.linear's split
    reduction (counted), prefill chunks and uncompiled regions never; the logits stay the uncompiled regions'
    product's within fp32 rounding. A 3-row group reduces only with GEMV_ROWS raised to 3 (it is 1)."""
    from atlas.backends.cuda import hyper, moe, primitives

    torch._dynamo.reset()
    seen: list[tuple[int, bool]] = []
    real = primitives.linear

    def spy(x, w, gemv=""):  # type: ignore[no-untyped-def]
        seen.append((x.reshape(-1, x.shape[-1]).shape[0], gemv == "split"))
        return real(x, w, gemv)

    for module in (hyper, moe):  # the hyper sites' and the router's products
        monkeypatch.setattr(module, "linear", spy)

    @functools.cache
    def eager_compile(fn, mode):  # type: ignore[no-untyped-def]
        return fn if mode == "none" else torch.compile(fn, backend="eager", fullgraph=True, dynamic=None)

    monkeypatch.setattr(regions, "compiled", eager_compile)
    want, _ = _decode(tiny, REGIONS, kernels=False, steps=1)
    assert seen and not any(reduce for _, reduce in seen)
    seen.clear()
    assert regions.GEMV_ROWS < 3
    _decode(tiny, attrs.evolve(REGIONS, compile=True), kernels=False, steps=1)
    assert seen and not any(reduce for _, reduce in seen)  # 3 rows > GEMV_ROWS: the product
    seen.clear()
    monkeypatch.setattr(regions, "GEMV_ROWS", 3)
    got, _ = _decode(tiny, attrs.evolve(REGIONS, compile=True), kernels=False, steps=1)
    assert torch.allclose(want[0], got[0], atol=1e-4, rtol=1e-4)
    # the decode group (3 rows <= GEMV_ROWS) reduces, every prefill chunk (70, 5, 20 tokens) takes the product
    assert {rows for rows, reduce in seen if reduce} == {3}
    assert {rows for rows, reduce in seen if not reduce} == {70, 5, 20}


def test_the_conv_is_fused_in_compiled_prefill_heads_and_library_elsewhere(
        tiny, monkeypatch: pytest.MonkeyPatch, recompile_limit) -> None:  # type: ignore[no-untyped-def]
    """library_conv with the regions compiled: a compiled prefill region's GDN conv takes the windowed product
    (Inductor fuses it; the Triton conv on a GPU), and so does the compiled PLE region's (regions.ple_block);
    uncompiled regions keep the library conv for both, the PLE layer then eager (ple.ple_layer)."""
    torch._dynamo.reset()
    seen: dict[str, set[bool]] = collections.defaultdict(set)
    real_in, real_ple, real_mix = regions.gdn_in, regions.ple_layer, regions.ple_mix

    def gdn_in(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["gdn"].add(bool(args[5]))
        return real_in(*args, **kwargs)

    def ple_layer(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["ple"].add(bool(args[-1]))
        return real_ple(*args, **kwargs)

    def ple_mix(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["ple_block"].add(bool(args[11]))
        return real_mix(*args, **kwargs)

    @functools.cache
    def eager_compile(fn, mode):  # type: ignore[no-untyped-def]
        return fn if mode == "none" else torch.compile(fn, backend="eager", fullgraph=True, dynamic=None)

    monkeypatch.setattr(regions, "gdn_in", gdn_in)
    monkeypatch.setattr(regions, "ple_layer", ple_layer)
    monkeypatch.setattr(regions, "ple_mix", ple_mix)
    monkeypatch.setattr(regions, "compiled", eager_compile)
    for compile_on, want in ((True, {"gdn": {False}, "ple_block": {False}}), (False, {"gdn": {True}, "ple": {True}})):
        seen.clear()
        _decode(tiny, attrs.evolve(REGIONS, compile=compile_on, library_conv=True), kernels=False, steps=0)
        assert dict(seen) == want, compile_on


def test_the_new_decode_regions_lower_through_inductor(tiny, recompile_limit) -> None:  # type: ignore[no-untyped-def]
    """Inductor itself (its C++ code on the CPU; Triton on a GPU, where the token test runs them) compiles the decode
    regions, the group's columns and the prologue with the n-gram ids' int64 arithmetic, to the eager
    values: what Dynamo's eager-backend trace (test_every_region_traces_whole) does not exercise, Inductor's lowering."""
    from atlas.backends.cuda import compiled as module
    from atlas.backends.cuda.batch import group_columns

    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=DEVICE,
                          max_batch_size=4, kernels=False, cuda_graphs=False,
                          tuning=attrs.evolve(REGIONS, compile=True))
    backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, TABLES[i], True) for i, p in enumerate(PROMPTS))))
    shape = backend._shape(3, 1, 80)
    rows = [backend._row(SeqWork(i, (40 + i,), len(p), TABLES[i], True)) for i, p in enumerate(PROMPTS)]
    from atlas.backends.cuda.batch import pack_rows

    packed = pack_rows(shape, rows, backend.pools.scratch_slots, backend.pools.scratch_block, 16).to(DEVICE)
    args = (packed, 1, shape.key_blocks, 16, False)
    torch._dynamo.reset()
    try:
        got = torch.compile(group_columns, fullgraph=True)(*args)
        for g, want in zip(got, group_columns(*args), strict=True):
            assert torch.equal(g, want)
        grp = regions.Group.view(packed, shape, 16)
        spec, embed = tiny.spec, backend.weights["embed_tokens.weight"]
        pargs = (spec, grp.tokens, grp.positions, embed, backend.pools.state["pctx"], grp.slots,
                 backend._ple_tables_dev)
        got = torch.compile(regions.prologue, fullgraph=True)(*pargs)
        want = regions.prologue(*pargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])  # the streams, the n-gram ids
        assert torch.allclose(got[1], want[1], atol=1e-6) and torch.allclose(got[2], want[2], atol=1e-6)  # cos, sin
        # the ids are the runner's own (layers.device_ngram_ids)
        from atlas.backends.cuda.ple import device_ngram_ids

        assert torch.equal(want[3], device_ngram_ids(backend.pools, grp, spec.ple, backend._ple_tables_dev))
    finally:
        module._compile.cache_clear()
        torch._dynamo.reset()
