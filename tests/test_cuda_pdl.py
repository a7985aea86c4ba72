"""Programmatic dependent launch for our decode kernels (atlas_kernels.pdl, Tuning.decode_pdl).

The decision: on only when requested, on a CUDA device of compute capability >= 9, never under the interpreter.
Each entry point with PDL forced on (the PDL=True kernels, their griddepcontrol instructions no-ops in the
interpreter) gives bit for bit what it gives without. The backend passes the knob to the kernels of decode groups
only, and a decode step with it on gives the same logits, state and tokens as with it off. That the compiled
PDL=True kernels hold the instructions, the wait first, is tests/test_kernels_compile.py's; that they run on an
H200 is tests/test_cuda_regions.py's GPU token test (regions-pdl-kernels)."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import atlas_kernels.gdn_recurrent as gdn_recurrent
import atlas_kernels.moe_grouped as moe_grouped
import atlas_kernels.paged_attention as paged_attention
import atlas_kernels.pdl as pdl
from atlas_kernels.conv import causal_conv1d_update
from atlas_kernels.qsa import qsa_block_scores, qsa_pool_keys

# SHORT: below atlas-tiny's QSA inert bound through the decodes (dense groups: the paged kernel applies); no length 3,
# the decode group's row count, so a routed call's rows tell a decode group from a prefill chunk
from test_cuda_regions import SHORT, TABLES

from atlas.backends.cuda import CudaBackend
from atlas.backends.cuda.runner import triton_gdn
from atlas.backends.cuda.tuning import VARIANTS, Tuning
from atlas.bench_variants import DECODE_KNOBS, PREFILL_KNOBS
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pdl_is_off_unless_requested_on_a_cuda_device_of_capability_9_outside_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    capability = [(9, 0)]
    monkeypatch.setattr(pdl, "_capability", lambda index: capability[0])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(True, "cuda:0")  # the interpreter: no inline PTX
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.enabled(True, "cuda:0") and pdl.enabled(True, torch.device("cuda", 1))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pdl.enabled(True, "cuda:0")
    assert not pdl.enabled(False, "cuda:0")  # not requested
    assert not pdl.enabled(True, "cpu") and not pdl.enabled(True, torch.empty(1).device)  # CPU tensors
    capability[0] = (8, 0)  # Ampere: no griddepcontrol
    assert not pdl.enabled(True, "cuda:0")
    capability[0] = (10, 0)
    assert pdl.enabled(True, "cuda:0")
    assert pdl.launch(True) == {"launch_pdl": True} and pdl.launch(False) == {}


def _record(monkeypatch: pytest.MonkeyPatch, force: bool) -> tuple[list[bool], list[bool]]:
    """(each launch's PDL decision, each launch's launch_pdl) recorded; force: PDL on wherever requested (the
    interpreter included: the PDL=True kernels run, griddepcontrol a no-op there), else the real decision."""
    decisions: list[bool] = []
    launches: list[bool] = []
    real_enabled, real_launch = pdl.enabled, pdl.launch

    def enabled(requested: bool, device: torch.device) -> bool:
        decisions.append(requested if force else real_enabled(requested, device))
        return decisions[-1]

    def launch(on: bool) -> dict[str, bool]:
        launches.append(on)
        return real_launch(on)

    monkeypatch.setattr(pdl, "enabled", enabled)
    monkeypatch.setattr(pdl, "launch", launch)
    return decisions, launches


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _conv(on: bool) -> tuple[torch.Tensor, ...]:
    gen = _gen()
    x, pool = torch.randn(2, 3, 40, generator=gen).to(DEVICE), torch.randn(4, 40, 4, generator=gen).to(DEVICE)
    weight, bias = torch.randn(40, 4, generator=gen).to(DEVICE), torch.randn(40, generator=gen).to(DEVICE)
    out = causal_conv1d_update(x, pool, torch.tensor([2, 0], device=DEVICE), weight, bias, block_c=16, pdl=on)
    return out, pool


def _gdn(on: bool) -> tuple[torch.Tensor, ...]:
    gen = _gen()
    n, t, hk, hv, d = 2, 1, 2, 4, 16
    q, k = torch.randn(n, t, hk, d, generator=gen).to(DEVICE), torch.randn(n, t, hk, d, generator=gen).to(DEVICE)
    v = torch.randn(n, t, hv, d, generator=gen).to(DEVICE)
    g, beta = -torch.rand(n, t, hv, generator=gen).to(DEVICE), torch.rand(n, t, hv, generator=gen).to(DEVICE)
    pool, slots = torch.randn(3, hv, d, d, generator=gen).to(DEVICE), torch.tensor([2, 0], device=DEVICE)
    out, _ = gdn_recurrent.gdn_recurrent(q, k, v, g, beta, pool, slots, pdl=on)
    gated_pool, stamps = pool.clone(), torch.zeros(3, dtype=torch.int32, device=DEVICE)
    a, b = torch.randn(n, t, hv, generator=gen).to(DEVICE), torch.randn(n, t, hv, generator=gen).to(DEVICE)
    gated, _ = gdn_recurrent.gdn_recurrent_gated(q, k, v, a, b, torch.randn(hv, generator=gen).to(DEVICE),
                                                 torch.randn(hv, generator=gen).to(DEVICE), gated_pool, slots,
                                                 stamp=(stamps, torch.tensor([7, 9], dtype=torch.int32, device=DEVICE)), pdl=on)
    verify, states = gdn_recurrent.gdn_recurrent(q.expand(n, 3, hk, d), k.expand(n, 3, hk, d), v.expand(n, 3, hv, d),
                                                 g.expand(n, 3, hv), beta.expand(n, 3, hv), pool.clone(), slots,
                                                 store_states=True, commit=False, pdl=on)
    assert states is not None
    return out, pool, gated, gated_pool, stamps, verify, states


def _attention(on: bool) -> tuple[torch.Tensor, ...]:
    gen = _gen()
    k_pool, v_pool = torch.randn(8, 16, 2, 16, generator=gen).to(DEVICE), torch.randn(8, 16, 2, 16, generator=gen).to(DEVICE)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([30, 50], dtype=torch.int32, device=DEVICE)
    dense = paged_attention.paged_attention(torch.randn(2, 1, 4, 16, generator=gen).to(DEVICE), k_pool, v_pool, tables, lens,
                                            0.25, 64, partition=32, block_n=16, pdl=on)
    selected = torch.tensor([[[0, 3, 9, 17, 29, -1]], [[1, 2, 40, 48, 49, -1]]], dtype=torch.int32, device=DEVICE)
    sparse = paged_attention.paged_attention(torch.randn(2, 1, 4, 16, generator=gen).to(DEVICE), k_pool, v_pool, tables, lens,
                                             0.25, 6, selected, torch.tensor([[5], [5]], dtype=torch.int32, device=DEVICE),
                                             partition=32, block_n=16, pdl=on)
    return dense, sparse


def _qsa(on: bool) -> tuple[torch.Tensor, ...]:
    gen = _gen()
    raw, pooled = torch.randn(8, 16, 16, generator=gen).to(DEVICE), torch.zeros(8, 4, 16, device=DEVICE)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=DEVICE)
    qsa_pool_keys(raw, pooled, tables, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), torch.tensor([3, 6], dtype=torch.int32, device=DEVICE),
                  torch.randn(16, generator=gen).to(DEVICE), torch.rand(4, generator=gen).to(DEVICE), 4, 1e-6, 5, pdl=on)
    scores = qsa_block_scores(torch.randn(2, 1, 3, 16, generator=gen).to(DEVICE), pooled, tables,
                              torch.tensor([13, 27], dtype=torch.int32, device=DEVICE), 4, 8, block_b=16, pdl=on)
    return pooled, scores


def _moe(on: bool) -> tuple[torch.Tensor, ...]:
    gen = _gen()
    rows, hidden, experts, k, inter = 3, 32, 4, 2, 16
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    top_i = torch.tensor([[0, 2], [2, 3], [0, 1]], device=DEVICE)
    top_w = torch.rand(rows, k, generator=gen).to(DEVICE)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE)
    down = torch.randn(experts, hidden, inter, generator=gen).to(DEVICE)
    return (moe_grouped.moe_grouped(x, top_i, top_w, gate_up, down, pdl=on),
            moe_grouped.moe_grouped(x, top_i, top_w, gate_up, down, summed=False, pdl=on))


# entry point -> (its calls' outputs and mutated pools, (the calls, the kernel launches) they make)
CASES = {"conv": (_conv, (1, 1)), "gdn": (_gdn, (3, 3)), "attention": (_attention, (2, 4)), "qsa": (_qsa, (2, 2)),
         "moe": (_moe, (2, 4))}


@pytest.mark.parametrize("case", list(CASES))
def test_requesting_pdl_where_it_cannot_run_changes_nothing(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """pdl=True through the real decision: off here (interpreted, or CPU tensors), so the launches are the plain
    ones and the results bit for bit pdl=False's."""
    fn, count = CASES[case]
    want = fn(False)
    decisions, launches = _record(monkeypatch, force=False)
    got = fn(True)
    if DEVICE == "cpu" or pdl.interpreted():
        assert (decisions, launches) == ([False] * count[0], [False] * count[1])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@pytest.mark.parametrize("case", list(CASES))
def test_each_entry_point_with_pdl_forced_on_is_bit_identical_to_pdl_off(case: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The PDL=True kernels (pdl_start's wait and launch_dependents first: no-ops interpreted, the real instructions
    and launch_pdl on an sm_90 GPU) against PDL=False."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("griddepcontrol needs sm_90")
    fn, count = CASES[case]
    decisions, launches = _record(monkeypatch, force=True)
    want = fn(False)
    assert (decisions, launches) == ([False] * count[0], [False] * count[1])
    decisions.clear()
    launches.clear()
    got = fn(True)
    # every kernel of the entry point launched with launch_pdl
    assert (decisions, launches) == ([True] * count[0], [True] * count[1])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def _spy(monkeypatch: pytest.MonkeyPatch, module, name: str, calls: list, kind: str, rows) -> None:  # type: ignore[no-untyped-def]
    real = getattr(module, name)

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((kind, rows(args), kwargs.get("pdl", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def _steps(tiny, tuning: Tuning, monkeypatch: pytest.MonkeyPatch, steps: int = 2):  # type: ignore[no-untyped-def]
    """(each decode step's logits [3, vocab], the pools' state after them, each call of our kernels' entry points as
    (kind, rows, pdl)) on cuda-fp32 with the Triton GDN kernel, the paged decode attention and the routed kernels
    (decode groups and prefill chunks)."""
    calls: list[tuple[str, int, bool]] = []
    _spy(monkeypatch, gdn_recurrent, "gdn_recurrent_gated", calls, "gdn", lambda a: a[0].shape[0] * a[0].shape[1])
    _spy(monkeypatch, paged_attention, "paged_attention", calls, "attention", lambda a: a[0].shape[0] * a[0].shape[1])
    _spy(monkeypatch, moe_grouped, "moe_grouped", calls, "moe", lambda a: a[0].shape[0])
    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=DEVICE,
                          max_batch_size=4, kernels=False, cuda_graphs=False, tuning=tuning)
    backend.gdn_kernel = triton_gdn()  # after the spy: it binds gdn_recurrent_gated when made
    backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, TABLES[i], True) for i, p in enumerate(SHORT))))
    logits = []
    for step in range(steps):
        decode = [SeqWork(i, (40 + i + step,), len(p) + step, TABLES[i], True) for i, p in enumerate(SHORT)]
        backend._prepare(decode)
        rows = backend._last_logits(decode)
        logits.append(torch.stack([rows[i] for i in range(len(SHORT))]))
        for w in decode:
            backend._advance(w)
    pools = backend.pools
    state = {**{f"gdn.{k}": v.clone() for k, v in pools.gdn_state.items()},
             **{f"state.{k}": v.clone() for k, v in pools.state.items()},
             **{f"stamp.{k}": v.clone() for k, v in pools.stamp.items()},
             **{f"keys.{k}": v.clone() for k, v in pools.keys.items()}}
    return logits, state, calls


@pytest.mark.parametrize("stack", ["layers", "regions"])
def test_decode_pdl_reaches_the_decode_groups_kernels_only_and_changes_no_token(tiny, stack: str,  # type: ignore[no-untyped-def]
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_pdl "on" against "off": the same logits (so the same tokens) and state, bit for bit, with the PDL=True
    kernels running (forced on in the interpreter); pdl=True reaches the GDN update, the paged attention and the
    routed experts of the decode groups, and never a prefill chunk's routed experts."""
    base = Tuning(moe="triton", prefill_moe="triton", decode_attention="paged", decode_stack=stack)
    want_logits, want_state, off_calls = _steps(tiny, base, monkeypatch)
    monkeypatch.undo()
    if pdl.interpreted():
        monkeypatch.setattr(pdl, "enabled", lambda requested, device: requested)
    got_logits, got_state, on_calls = _steps(tiny, attrs.evolve(base, decode_pdl="on"), monkeypatch)
    for want, got in zip(want_logits, got_logits, strict=True):
        assert torch.equal(want, got)
    assert want_state.keys() == got_state.keys()
    for name, want in want_state.items():
        assert torch.equal(want, got_state[name]), name
    decode_rows = len(SHORT)
    for calls, knob in ((off_calls, False), (on_calls, True)):
        assert {kind for kind, rows, _ in calls if rows == decode_rows} == {"gdn", "attention", "moe"}
        assert any(kind == "moe" and rows != decode_rows for kind, rows, _ in calls)  # a prefill chunk's experts
        for kind, rows, got_pdl in calls:
            assert got_pdl == (knob and rows == decode_rows), (kind, rows, got_pdl)


def test_the_knob_is_a_decode_knob_and_regions_pdl_kernels_adds_it_to_regions_pdl() -> None:
    assert Tuning().decode_pdl == "off"
    with pytest.raises(ValueError, match="decode_pdl must be one of off, on"):
        Tuning(decode_pdl="yes")
    assert "decode_pdl" in DECODE_KNOBS and "decode_pdl" not in PREFILL_KNOBS
    names = list(VARIANTS)
    assert names.index("regions-pdl-kernels") == names.index("regions-pdl") + 1
    assert attrs.evolve(VARIANTS["regions-pdl"], decode_pdl="on") == VARIANTS["regions-pdl-kernels"]
