"""The wide verify ([B, K] rows written pending, the per-slot state after each row kept for the commit) through the
regions (atlas.backends.cuda.regions) computes what the layer stack computes: bit for bit with the regions run
eagerly (every row's logits and hidden, every kept state and stamp, the pending KV and its stamps, and the state
each commit selects by index), fp32 and bf16; and speculation through the engine gives the same tokens."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from atlas.backends.cuda import CudaBackend, regions
from atlas.backends.cuda.tuning import EAGER, Tuning
from atlas.backends.cuda.verify import feed_verify
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one prompt past atlas-tiny's QSA inert bound (19 keys: the per-row selection), one short, one in between
PROMPTS = [list(b"The quick brown fox jumps over the lazy dog. " * 2)[:70], list(b"hello"), list(b"0123456789abcdefghij")]
# below the inert bound through the verify's rows: dense verify groups, where the paged kernel applies
SHORT = [list(b"hello"), list(b"0123456789"), list(b"ab")]
TABLES = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
LAYERS = EAGER
REGIONS = attrs.evolve(EAGER, regions=True)
# two verify groups: sequences 0 and 1 with 3 drafts ([2, 4]), sequence 2 with 1 ([1, 2]); the rows each commit keeps
DRAFTS = {0: (5, 6, 7), 1: (8, 9, 10), 2: (11,)}
KEPT_ROWS = {0: 2, 1: 4, 2: 1}


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def _pools(backend: CudaBackend) -> dict[str, torch.Tensor]:
    pools = backend.pools
    state = {**{f"state.{k}": v for k, v in pools.state.items()}, "stamps": pools.stamps,
             **{f"keys.{k}": v for k, v in pools.keys.items()}, **{f"values.{k}": v for k, v in pools.values.items()},
             **{f"index.{k}": v for k, v in pools.index_keys.items()}, "paged_pos": pools.paged_pos}
    return {k: v.clone() for k, v in state.items()}


def _verify(tiny, tuning: Tuning, dtype: torch.dtype, gdn: bool = False,  # type: ignore[no-untyped-def]
            prompts: list[list[int]] = PROMPTS) -> dict:
    """Prefill the prompts through the layer stack, then each verify group fed with `tuning` (logits, hidden, the
    kept states, the pools after it), then every verify committed at KEPT_ROWS (the pools after the commits). The
    prefill is the same in both: a bf16 prefill chunk through the regions rounds a few values otherwise than the
    layer stack's on a CPU (a product's rows arranged otherwise), which is the prefill's matter, not the verify's."""
    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=dtype, device=DEVICE, max_batch_size=4,
                          kernels=False, cuda_graphs=False, tuning=LAYERS, verify_width=4, verify_mode="wide")
    if gdn:  # the Triton GDN kernel (interpreted on a CPU): its per-token states (store_states, commit=False)
        from atlas.backends.cuda.gdn import triton_gdn

        backend.gdn_kernel = triton_gdn()
    first = backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, TABLES[i], True)
                                              for i, p in enumerate(prompts)))).outcomes
    backend.tuning = tuning
    work = [SeqWork(i, (first[i].token,), len(p), TABLES[i], True, drafts=DRAFTS[i]) for i, p in enumerate(prompts)]
    for w in work:
        backend._check_verify(w)
    out: dict = {}
    for name, members in (("wide", work[:2]), ("narrow", work[2:])):
        logits, hidden = feed_verify(backend, members, len(members[0].drafts) + 1)
        out[f"{name}.logits"], out[f"{name}.hidden"] = logits.clone(), hidden.clone()
        for state, (per_token, stamps, slots) in backend.pools.kept.items():
            out[f"{name}.kept.{state}"] = per_token.clone()
            out[f"{name}.kept_stamps.{state}"] = stamps.clone()
            out[f"{name}.kept_slots.{state}"] = slots.clone()
        out.update({f"{name}.fed.{k}": v for k, v in _pools(backend).items()})
        backend.store.commit_many([(w.seq_id, KEPT_ROWS[w.seq_id]) for w in members])
        out.update({f"{name}.committed.{k}": v for k, v in _pools(backend).items()})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wide_verifies_through_the_regions_equal_the_layer_stack_bit_for_bit(tiny, dtype: torch.dtype,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    widths = []
    real = regions.regions_stack

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        shape = args[3].shape
        if shape.keep:
            widths.append((shape.batch, shape.width))
        return real(*args, **kwargs)

    monkeypatch.setattr(regions, "regions_stack", spy)
    want = _verify(tiny, LAYERS, dtype)
    assert widths == []  # the layer stack takes no region
    got = _verify(tiny, REGIONS, dtype)
    assert widths == [(2, 4), (1, 2)]  # both verify groups through the regions
    assert want.keys() == got.keys()
    # a kept state per GDN conv, GDN recurrent, PLE conv and the n-gram context
    assert {k for k in got if k.startswith("wide.kept.")} == {f"wide.kept.{n}" for n in _names(tiny)}
    for name, w in want.items():
        assert w.dtype == got[name].dtype and torch.equal(w, got[name]), name


def _names(tiny) -> set[str]:  # type: ignore[no-untyped-def]
    spec = tiny.spec
    names = {f"conv{layer}" for layer in spec.gdn_layers} | {f"gdn{layer}" for layer in spec.gdn_layers}
    if spec.ple is not None:
        names |= {f"pconv{layer}" for layer in spec.ple.layers} | {"pctx"}
    return names


def test_a_wide_verify_with_the_triton_gdn_kernel_through_the_regions_is_the_layer_stacks(tiny) -> None:  # type: ignore[no-untyped-def]
    """The GDN recurrent kernel keeping a state per position (store_states, commit=False), interpreted on a CPU:
    the regions hand it the same inputs as the layer stack, so the same bits come back and the commits select them."""
    want = _verify(tiny, LAYERS, torch.float32, gdn=True)
    got = _verify(tiny, REGIONS, torch.float32, gdn=True)
    for name, w in want.items():
        assert torch.equal(w, got[name]), name


@pytest.mark.parametrize("backend", ["cuda-fp32", "cuda"])
def test_speculation_with_wide_verifies_through_the_regions_gives_the_layer_stacks_tokens(tiny, backend: str) -> None:  # type: ignore[no-untyped-def]
    """MTP speculation, every verify one [B, K] forward: through the regions the layer stack's tokens, and in fp32
    speculation off's."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    runs = {}
    for name, drafts, tuning in (("off", 0, LAYERS), ("layers", 3, LAYERS), ("regions", 3, REGIONS)):
        config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=drafts,
                              drafter="mtp")
        engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(),
                              backend_options={"device": DEVICE, "cuda_graphs": False, "tuning": tuning,
                                               "verify_mode": "wide"})
        runs[name] = [r.token_ids for r in generate(engine, PROMPTS, params)]
        if drafts:
            assert engine.stats().spec_verify_steps > 0
        engine.close()
    assert runs["regions"] == runs["layers"]
    if backend == "cuda-fp32":
        assert runs["regions"] == runs["off"]


def test_a_wide_verify_traces_whole_through_the_compiled_regions(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Compiled (Dynamo with fullgraph=True, which raises on any graph break, and the eager backend, which runs the
    traced graph as is): a wide verify's columns, prologue (its n-gram ids), heads, tails and PLE regions trace
    whole with its K rows a sequence, and give the uncompiled regions' bits, kept states and commits included."""
    from test_cuda_regions import _trace_regions

    want = _verify(tiny, REGIONS, torch.float32)
    traced, compiles = _trace_regions(monkeypatch)
    try:
        got = _verify(tiny, attrs.evolve(REGIONS, compile=True), torch.float32)
    finally:
        torch._dynamo.reset()
    for name, w in want.items():
        assert torch.equal(w, got[name]), name
    # the verify groups' own compiles (the prefill ran through the layer stack): its columns and prologue as a
    # decode's, and the PLE region keeping its conv columns
    assert {"group_columns", "prologue", "ple_block", "gdn_head", "gdn_tail", "attn_head", "attn_tail",
            "final_mix"} <= set(traced), traced
    assert compiles["group_columns"] >= 1 and compiles["prologue"] >= 1, compiles


def test_a_dense_wide_verify_takes_the_paged_kernel(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """attention_kernels: a wide verify below the QSA inert bound reads the paged KV in place through the split-K
    kernel (each row causal within the verify's rows), interpreted on a CPU: the materialised scores' logits to
    fp32 rounding, the same keys and states written, and the regions' bits the layer stack's."""
    from atlas.backends.cuda import attention

    calls = []
    real = attention.attn_paged

    def spy(q, k_pool, v_pool, grp):  # type: ignore[no-untyped-def]
        calls.append((grp.shape.width, grp.shape.keep, grp.shape.qsa_select))
        return real(q, k_pool, v_pool, grp)

    monkeypatch.setattr(attention, "attn_paged", spy)
    monkeypatch.setattr(regions, "attn_paged", spy)
    want = _verify(tiny, REGIONS, torch.float32, prompts=SHORT)
    assert calls == []
    got = _verify(tiny, attrs.evolve(REGIONS, attention_kernels=True), torch.float32, prompts=SHORT)
    assert set(calls) == {(4, True, False), (2, True, False)}
    for name in ("wide.logits", "narrow.logits"):
        assert float((want[name] - got[name]).norm() / want[name].norm()) < 1e-5, name
        assert not torch.equal(want[name], got[name]) or DEVICE == "cuda"  # a different summation: the kernel ran
    for name, w in want.items():  # the keys, stamps and kept states the verify wrote
        if ".fed.keys." in name or ".fed.paged_pos" in name or ".kept_stamps." in name:
            assert torch.equal(w, got[name]), name
    layers = _verify(tiny, attrs.evolve(LAYERS, attention_kernels=True), torch.float32, prompts=SHORT)
    for name, w in layers.items():
        assert torch.equal(w, got[name]), name
