"""The wide verify ([B, K] rows written pending, the per-slot state after each row kept for the commit) through the
regions (atlas.backends.cuda.regions) computes what the layer stack computes: bit for bit with the regions run
eagerly (every row's logits and hidden, every kept state and stamp, the pending KV and its stamps, and the state
each commit selects by index), fp32 and bf16; and speculation through the engine gives the same tokens."""

from __future__ import annotations

import functools
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


def test_wide_verify_shapes_take_the_graphs_buckets(tiny) -> None:  # type: ignore[no-untyped-def]
    """A wide verify's shape (verify.wide_shape) is what its CUDA graph is keyed by: the batch and the key blocks
    each padded to a power of two (key blocks at least 4) where there are verify graphs, the width and the QSA
    selection as they are; batch invariant, the one shape of every step; without graphs, the group's own."""
    from atlas.backends.cuda.verify import wide_shape

    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=DEVICE, max_batch_size=6,
                          kernels=False, cuda_graphs=False, verify_width=4, verify_mode="wide", max_blocks_per_seq=8)
    plain = wide_shape(backend, 3, 3, 40)
    assert (plain.batch, plain.width, plain.key_blocks, plain.pending, plain.keep) == (3, 3, 3, True, True)
    assert plain.qsa_select and not wide_shape(backend, 3, 3, 19).qsa_select  # past atlas-tiny's inert bound (19)
    backend.verify_graphs = object()  # graphs (only their presence is read)
    bucketed = {(n, end): wide_shape(backend, n, 3, end) for n in (1, 2, 3, 4, 5) for end in (10, 40, 64, 65, 100)}
    assert {(s.batch, s.key_blocks) for s in bucketed.values()} == {(b, kb) for b in (1, 2, 4, 8) for kb in (4, 8)}
    assert bucketed[3, 40] == bucketed[4, 64]  # one graph serves both
    assert bucketed[3, 40].width == 3 and bucketed[3, 40].qsa_select and not bucketed[3, 10].qsa_select
    assert wide_shape(backend, 3, 2, 40) != bucketed[3, 40]  # a graph a width
    assert all(s.columns == 3 + 3 + s.key_blocks for s in bucketed.values())  # n-gram ids on the device
    backend.batch_invariant = True
    assert {(s.batch, s.key_blocks) for s in (wide_shape(backend, n, 3, 40) for n in (1, 3, 6))} == {(8, 8)}


def test_commit_graph_inputs_pad_with_scratch_slots_keeping_their_first_row() -> None:
    from atlas.backends.cuda.graphs import commit_inputs

    assert commit_inputs(4, [2, 0], [3, 1], (8, 9, 10, 11)).tolist() == [[2, 0, 8, 9], [3, 1, 1, 1]]
    assert commit_inputs(2, [1, 3], [2, 2], (8, 9)).tolist() == [[1, 3], [2, 2]]
    with pytest.raises(ValueError, match="3 commits"):
        commit_inputs(2, [0, 1, 2], [1, 1, 1], (8, 9))


class EagerCommitGraphs:
    """Stands in for the verify's CommitGraphs on a CPU: the same padded [2, batch] input (scratch slots keeping their
    first row), selected eagerly from the kept tensors the replay stand-in put back."""

    def __init__(self, backend: CudaBackend) -> None:
        self.backend, self.shapes = backend, []

    def load(self, shape, slots, rows):  # type: ignore[no-untyped-def]
        from atlas.backends.cuda.graphs import commit_inputs

        pools = self.backend.pools
        self.shapes.append(shape)
        host = commit_inputs(shape.batch, slots, rows, pools.scratch_slots).to(self.backend.device)
        pools.inter_load(host[0], host[1])


class EagerVerifyGraphs:
    """Stands in for the wide verify's DecodeGraphs on a CPU: the same padded, bucketed [B, K] groups (scratch rows,
    scratch slots) run eagerly, and pools.kept cleared after each as a replay (which runs no Python) leaves it."""

    def __init__(self, backend: CudaBackend) -> None:
        self.backend, self.shapes = backend, set()

    def replay(self, shape, packed, padding):  # type: ignore[no-untyped-def]
        self.shapes.add(shape)
        logits = self.backend._verify_logits(packed.to(self.backend.device), shape)
        self.backend.pools.kept.clear()
        return logits, logits.argmax(-1)


def test_padded_wide_verifies_through_the_regions_give_speculation_offs_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """The verify graphs' padded groups (scratch rows writing scratch slots and the scratch block) through the
    regions, and their commits' padded inputs: speculation off's tokens in fp32 (each commit's state checked against
    its verified row's digest: full audit), the commit selecting each row's kept state from the graph's tensors."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    runs = {}
    for name, drafts in (("off", 0), ("padded", 3)):
        config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=drafts,
                              drafter="mtp")
        engine = build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny, sink=RecordingSink(), full_audit=True,
                              backend_options={"device": DEVICE, "cuda_graphs": False, "tuning": REGIONS,
                                               "verify_mode": "wide"})
        if drafts:
            fake = engine.backend.verify_graphs = EagerVerifyGraphs(engine.backend)  # type: ignore[attr-defined]
            commits = engine.backend.commit_graphs = EagerCommitGraphs(engine.backend)  # type: ignore[attr-defined]
        runs[name] = [r.token_ids for r in generate(engine, PROMPTS, params)]
        engine.close()
    assert runs["padded"] == runs["off"]
    assert fake.shapes and all(s.keep and s.batch in (1, 2, 4) and s.key_blocks >= 4 for s in fake.shapes)
    assert any(s.batch > 1 for s in fake.shapes)
    assert commits.shapes and set(commits.shapes) <= fake.shapes  # every commit through its verify shape's "graph"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("tuning", ["default", "eager"])
def test_a_replayed_verify_graph_equals_its_eager_run_bit_for_bit(tiny, tuning: str) -> None:  # type: ignore[no-untyped-def]
    """bf16 with graphs: a wide verify group's CUDA graph (captured over the compiled regions by default, the layer
    stack with the eager tuning) replays the eager run of the same padded shape bit for bit: every real row's
    logits, hidden and kept states; and its commits select the same state."""
    from atlas.backends.cuda.tuning import TUNINGS
    from atlas.backends.cuda.verify import wide_group

    backend = CudaBackend(tiny, num_kv_blocks=64, block_size=16, max_batch_size=4, verify_width=4,
                          tuning=TUNINGS[tuning])
    assert backend.verify_mode == "wide" and backend.verify_graphs is not None
    first = backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, TABLES[i], True)
                                              for i, p in enumerate(PROMPTS)))).outcomes
    work = [SeqWork(i, (first[i].token,), len(p), TABLES[i], True, drafts=DRAFTS[0]) for i, p in enumerate(PROMPTS)]
    for w in work:
        backend._check_verify(w)
    n = len(work)
    shape, packed = wide_group(backend, work, 4)
    assert shape.batch == 4 and shape.keep
    want_logits = backend._verify_logits(packed.to(backend.device), shape)[:n].clone()
    want_hidden = backend._hidden_out[shape][:n].clone()
    want_kept = {k: per_token[:, :n].clone() for k, (per_token, _, _) in backend.pools.kept.items()}
    for _ in range(2):  # the capture, then a replay
        logits, hidden = feed_verify(backend, work, 4)
        assert len(backend.verify_graphs) == 1
        assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)
        assert want_kept.keys() == backend.pools.kept.keys()
        for k, (per_token, _, _) in backend.pools.kept.items():
            assert torch.equal(per_token[:, :n], want_kept[k]), k
    # the commit through its graph (captured on scratch slots, then replayed on the real ones): each slot's second row
    backend.store.commit_many([(w.seq_id, 2) for w in work], functools.partial(backend.commit_graphs.load, shape))
    assert len(backend.commit_graphs) == 1
    slots = torch.tensor([backend.store.seqs[w.seq_id].slot for w in work], device=backend.device)
    for k, per_token in want_kept.items():
        assert torch.equal(backend.pools.state[k][slots], per_token[1].to(backend.pools.state[k].dtype)), k
        want_stamps = torch.tensor([w.start + 2 for w in work], dtype=torch.int32, device=backend.device)
        assert torch.equal(backend.pools.stamp[k][slots], want_stamps), k
    backend.close()


def test_host_values_reach_the_device_as_they_are() -> None:
    from atlas.backends.cuda.batch import to_device

    got = to_device([[1, 2], [3, 4]], torch.device(DEVICE), torch.int32)
    assert got.dtype == torch.int32 and got.device.type == DEVICE and got.tolist() == [[1, 2], [3, 4]]
    assert to_device([5, 6], torch.device(DEVICE)).dtype == torch.long


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_host_values_are_queued_behind_the_devices_work() -> None:
    """to_device's copy (the verify's verdicts and commit, the drafter's steps) does not wait for the stream: the host
    passes it while a long kernel still runs (a pageable copy would wait for the kernel first)."""
    from atlas.backends.cuda.batch import to_device

    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the stream
    got = to_device(list(range(1000)), dev)
    done = torch.cuda.Event()
    done.record()
    assert not done.query()  # the host is here while the device still spins
    assert got.sum().item() == sum(range(1000))
