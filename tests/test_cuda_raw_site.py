"""The raw-stream mix-down of prefill hyper sites (Tuning.raw_site, layers.raw_mix_down): the mix-down as
a batched product over the raw streams against the down weight folded with the norm weight, weighted by each stream's
rstd, computes hyper_block's normed form (fp32: to fp32 rounding; bf16: within bf16's rounding of an fp64 reference,
as the normed form is), row by row; the folded weights are the down weights' columns times the norm weights; and prefill
chunks through the regions (run eagerly, and traced whole by Dynamo) take it at every site and give the normed form's
logits and the CPU reference's tokens."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_cuda_regions import PROMPTS, TABLES, _trace_regions

from atlas.backends.cuda import CudaBackend, layers
from atlas.backends.cuda.layers import hyper_block, raw_down_weight, raw_mix_down, raw_site_weights
from atlas.backends.cuda.tuning import EAGER, UNMEASURED, Tuning
from atlas.model import load_model
from atlas.plan import SeqWork

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HC, HIDDEN, LOWRANK, EPS = 4, 64, 40, 1e-6
# fp32: the raw form differs from the normed one only in where rstd multiplies (after the product instead of before),
# measured ~1e-7 relative here; bf16: the error against an fp64 evaluation of the site, bounded as the fused site
# kernels' is (tests/test_kernels_hyper.py: 1.5e-2, a few bf16 ulps of 2^-8) and at most twice the normed form's own
# bf16 error on the same inputs (measured on the CPU: 3.7e-3 to 4.9e-3 raw, 3.9e-3 to 5.8e-3 normed; raw / normed
# 0.81 to 1.11)
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1.5e-2
RAW = {**{k: v for k, v in attrs.asdict(EAGER).items() if k != "raw_site"}, "regions": True}


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def site_case(lead: tuple[int, ...], combine: bool, seed: int) -> list[torch.Tensor]:
    """(streams [*lead, hc*H], norm_w, down_w, up_w) in fp64; down_w with prepare_weights' shape: the inject rows and
    zero alignment rows after the mix-down's (combine), or the mix-down's alone (the final mixer)."""
    gen = torch.Generator().manual_seed(seed)
    width = HC * HIDDEN
    streams = torch.randn(*lead, width, generator=gen, dtype=torch.float64) * 3
    norm_w = 1 + 0.1 * torch.randn(width, generator=gen, dtype=torch.float64)
    down_w = torch.randn(LOWRANK + (HC if combine else 0), width, generator=gen, dtype=torch.float64) / width**0.5
    if combine:
        down_w = torch.cat([down_w, down_w.new_zeros(layers.ALIGN_ROWS - (LOWRANK + HC) % layers.ALIGN_ROWS, width)])
    up_w = torch.randn(width, LOWRANK, generator=gen, dtype=torch.float64) / LOWRANK**0.5
    return [streams, norm_w, down_w, up_w]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return float((got.double() - want.double()).norm() / want.double().norm())


def site(tensors: list[torch.Tensor], combine: bool, raw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    streams, norm_w, down_w, up_w = tensors
    raw_w = raw_down_weight(down_w, norm_w, HC, HIDDEN) if raw else None
    return hyper_block(streams, norm_w, down_w, up_w, HC, HIDDEN, LOWRANK, EPS, combine, raw_w=raw_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("combine", [True, False], ids=["site", "final-mixer"])
@pytest.mark.parametrize("lead", [(1,), (9,), (1, 7)], ids=["1-row", "9-rows", "chunk-1x7"])
def test_the_raw_site_computes_the_normed_site(dtype: torch.dtype, combine: bool, lead: tuple[int, ...]) -> None:
    case = site_case(lead, combine, seed=sum(lead) + combine)
    want = site(case, combine, raw=False)  # fp64: the reference both forms are held to
    tensors = [t.to(DEVICE, dtype) for t in case]
    normed = site(tensors, combine, raw=False)
    got = site(tensors, combine, raw=True)
    assert got[0].dtype == dtype and got[0].shape == (*lead, HIDDEN)
    pairs = [(got[0], normed[0], want[0])]
    if combine:
        assert got[1] is not None and normed[1] is not None and want[1] is not None
        assert got[1].shape == (*lead, HC)
        pairs.append((got[1], normed[1], want[1]))
    else:
        assert got[1] is None
    for raw_out, normed_out, ref in pairs:
        if dtype == torch.float32:
            assert rel(raw_out, normed_out) < FP32_TOLERANCE
            assert rel(raw_out, ref) < FP32_TOLERANCE
        else:
            err = rel(raw_out, ref)
            assert err < BF16_TOLERANCE
            assert err < 2 * rel(normed_out, ref)


def test_the_raw_mix_down_is_the_normed_product_and_hands_back_the_normed_streams() -> None:
    """raw_mix_down's two results on their own (fp64: exact up to summation order): the product equals
    rms_norm + linear's, every output row (the inject and alignment rows too), and the normed streams rms_norm's."""
    streams, norm_w, down_w, _ = site_case((2, 5), True, seed=3)
    raw_w = raw_down_weight(down_w, norm_w, HC, HIDDEN)
    product, normed = raw_mix_down(streams, norm_w, raw_w, HC, HIDDEN, EPS)
    want_normed = layers.rms_norm(streams, norm_w, EPS, group=HIDDEN)
    assert product.shape == (2, 5, down_w.shape[0]) and normed.shape == streams.shape
    assert torch.allclose(normed, want_normed, rtol=1e-12, atol=0)
    assert torch.allclose(product, want_normed @ down_w.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_raw_site_row_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """rstd, the weighted sum and the normed streams are per row: a row among different neighbours (the same batch,
    so the same product shapes) is bit-identical; and alone against among others wherever the normed form's GEMM is
    (bf16 on this CPU: both; fp32 there: neither, its 1-row and 9-row GEMMs round differently)."""
    case = [t.to(DEVICE, dtype) for t in site_case((9,), True, seed=21)]
    other = case[0].clone()
    other[torch.arange(9) != 4] = torch.randn(8, HC * HIDDEN, generator=torch.Generator().manual_seed(5)).to(other)
    among = site(case, True, raw=True)
    neighbours = site([other, *case[1:]], True, raw=True)
    assert torch.equal(among[0][4], neighbours[0][4]) and torch.equal(among[1][4], neighbours[1][4])
    assert not torch.equal(among[0][3], neighbours[0][3])
    alone = site([case[0][4:5], *case[1:]], True, raw=True)
    normed_among, normed_alone = site(case, True, raw=False), site([case[0][4:5], *case[1:]], True, raw=False)
    if torch.equal(normed_alone[0][0], normed_among[0][4]):
        assert torch.equal(alone[0][0], among[0][4]) and torch.equal(alone[1][0], among[1][4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_folded_weight_is_the_down_weights_columns_times_the_norm_weight(dtype: torch.dtype) -> None:
    _, norm_w, down_w, _ = (t.to(dtype) for t in site_case((1,), True, seed=8))
    folded = raw_down_weight(down_w, norm_w, HC, HIDDEN)
    assert folded.shape == (HC, HIDDEN, down_w.shape[0]) and folded.dtype == dtype and folded.is_contiguous()
    for s in range(HC):
        cols = slice(s * HIDDEN, (s + 1) * HIDDEN)
        want = (down_w[:, cols].float() * norm_w[cols].float()).to(dtype)  # fp32 product, rounded once
        assert torch.equal(folded[s], want.T), s
    assert not folded[:, :, LOWRANK + HC:].any()  # the alignment rows stay zero


def test_the_backend_folds_every_site_once_under_the_knob_only(tiny) -> None:  # type: ignore[no-untyped-def]
    """Each site's folded weight is the one of its own down and norm weights (the final mixer's without inject rows),
    made only when raw_site takes effect (with the regions): the memory is unchanged otherwise."""
    spec = tiny.spec
    made = {}
    for name, tuning in (("default", Tuning(**RAW)), ("layers", Tuning(**{**RAW, "regions": False}, raw_site=True)),
                         ("raw", Tuning(**RAW, raw_site=True))):
        backend = CudaBackend(tiny, num_kv_blocks=8, block_size=16, dtype=torch.bfloat16, device=DEVICE,
                              max_batch_size=2, kernels=False, cuda_graphs=False, tuning=tuning)
        made[name] = {k: v for k, v in backend.weights.items() if k.endswith("_raw.weight")}
        weights = backend.weights
    assert made["default"] == {} and made["layers"] == {}
    sites = [f"layers.{i}.{kind}_hyper_connection." for i in range(spec.num_layers) for kind in ("attn", "mlp")]
    want_names = {pre + "fused_down_raw.weight" for pre in sites}
    want_names.add("hyper_connection_mixer.input_mix_weight_down_raw.weight")
    assert set(made["raw"]) == want_names
    for pre in sites:
        want = raw_down_weight(weights[pre + "fused_down.weight"], weights[pre + "hc_norm.weight"], spec.hc_count,
                               spec.hidden_size)
        assert torch.equal(made["raw"][pre + "fused_down_raw.weight"], want), pre
    mixer = "hyper_connection_mixer."
    final = made["raw"][mixer + "input_mix_weight_down_raw.weight"]
    assert final.shape == (spec.hc_count, spec.hidden_size, spec.hc_lowrank)
    assert torch.equal(final, raw_down_weight(weights[mixer + "input_mix_weight_down.weight"],
                                              weights[mixer + "hc_norm.weight"], spec.hc_count, spec.hidden_size))
    assert raw_site_weights(spec, weights).keys() == want_names


def _run(tiny, tuning: Tuning, dtype: torch.dtype = torch.float32, steps: int = 2):  # type: ignore[no-untyped-def]
    """(the prefill chunks' last logits [3, vocab], then each decode step's [3, vocab]; the pools' state after them),
    the three prompts prefilled as one chunk each."""
    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=dtype, device=DEVICE, max_batch_size=4,
                          kernels=False, cuda_graphs=False, tuning=tuning)
    out = []
    work = [SeqWork(i, tuple(p), 0, TABLES[i], True) for i, p in enumerate(PROMPTS)]
    for step in range(steps + 1):
        backend._prepare(work)
        logits = backend._last_logits(work)
        out.append(torch.stack([logits[i].float() for i in range(len(PROMPTS))]))
        for w in work:
            backend._advance(w)
        work = [SeqWork(i, (40 + i + step,), len(p) + step, TABLES[i], True) for i, p in enumerate(PROMPTS)]
    pools = backend.pools
    state = {**{f"state.{k}": v for k, v in pools.state.items()}, **{f"gdn.{k}": v for k, v in pools.gdn_state.items()},
             **{f"keys.{k}": v for k, v in pools.keys.items()}}
    return out, {k: v.float().clone() for k, v in state.items()}


def test_prefill_regions_take_the_raw_site_at_every_site_with_its_own_weight(tiny, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every hyper site of a prefill chunk through the regions (two a layer, then the final mixer) takes the raw
    form with that site's folded weight, in the layers' order; the decode steps after them take none."""
    calls: list[tuple[int, int]] = []  # (the chunk's rows, the folded weight's address)
    real = layers.raw_mix_down

    def spy(streams, norm_w, raw_w, *args):  # type: ignore[no-untyped-def]
        calls.append((streams.shape[-2], raw_w.data_ptr()))
        return real(streams, norm_w, raw_w, *args)

    monkeypatch.setattr(layers, "raw_mix_down", spy)
    backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=DEVICE,
                          max_batch_size=4, kernels=False, cuda_graphs=False, tuning=Tuning(**RAW, raw_site=True))
    spec, w = tiny.spec, backend.weights
    order = [w[f"layers.{i}.{kind}_hyper_connection.fused_down_raw.weight"].data_ptr()
             for i in range(spec.num_layers) for kind in ("attn", "mlp")]
    order.append(w["hyper_connection_mixer.input_mix_weight_down_raw.weight"].data_ptr())
    work = [SeqWork(i, tuple(p), 0, TABLES[i], True) for i, p in enumerate(PROMPTS)]
    backend._prepare(work)
    backend._last_logits(work)
    assert calls == [(len(p), ptr) for p in PROMPTS for ptr in order]
    for item in work:
        backend._advance(item)
    calls.clear()
    decode = [SeqWork(i, (40 + i,), len(p), TABLES[i], True) for i, p in enumerate(PROMPTS)]
    backend._prepare(decode)
    backend._last_logits(decode)
    assert calls == []


def test_the_raw_site_prefill_gives_the_normed_forms_logits_and_state_in_fp32(tiny) -> None:  # type: ignore[no-untyped-def]
    """fp32, the regions run eagerly: the prefill chunks' logits, the decodes' after them and every state the steps
    wrote equal the normed form's to fp32 rounding (measured on the CPU: logits within 7.2e-7 of values up to 2.2,
    the state within 2.7e-6), with the same greedy tokens."""
    want, want_state = _run(tiny, Tuning(**RAW))
    got, got_state = _run(tiny, Tuning(**RAW, raw_site=True))
    for w, g in zip(want, got, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert not all(torch.equal(w, g) for w, g in zip(want, got, strict=True))  # the raw form did run
    for name, w in want_state.items():
        assert torch.allclose(got_state[name], w, rtol=1e-5, atol=1e-5), name


def test_the_raw_site_prefill_stays_within_bf16_rounding_of_the_normed_form(tiny) -> None:  # type: ignore[no-untyped-def]
    """bf16, as tests/test_cuda_tuning.py bounds its variants against the baseline (3e-2 relative on the logits)."""
    want, _ = _run(tiny, Tuning(**RAW), dtype=torch.bfloat16, steps=1)
    got, _ = _run(tiny, Tuning(**RAW, raw_site=True), dtype=torch.bfloat16, steps=1)
    for w, g in zip(want, got, strict=True):
        assert float((g - w).norm() / w.norm()) < 3e-2


def test_the_raw_site_gives_the_reference_tokens_through_the_engine(tiny) -> None:  # type: ignore[no-untyped-def]
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    tokens = {}
    for backend, options in (("cpu", {}), ("cuda-fp32", {"device": DEVICE, "cuda_graphs": False,
                                                         "tuning": Tuning(**RAW, raw_site=True)})):
        engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(),
                              backend_options=options)
        tokens[backend] = [r.token_ids for r in generate(engine, PROMPTS, params)]
        engine.close()
    assert tokens["cuda-fp32"] == tokens["cpu"]


def test_the_raw_site_traces_whole_in_the_compiled_prefill_regions(tiny, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Dynamo with fullgraph=True (a graph break raises) over the prefill regions with the raw sites, the token
    dimension marked dynamic: the three chunk lengths share one graph a region kind and variant, and the traced graphs
    run as they are (backend "eager") give the eager regions' logits bit for bit."""
    _, compiles = _trace_regions(monkeypatch)
    want, _ = _run(tiny, Tuning(**RAW, raw_site=True), steps=0)
    got, _ = _run(tiny, Tuning(**{**RAW, "compile": True}, raw_site=True), steps=0)
    assert torch.equal(got[0], want[0])
    # gdn_head's two variants (the PLE layers' with no ffn to settle, and the rest), gdn_tail's one, the final mixer's
    assert compiles["gdn_head"] == 2 and compiles["gdn_tail"] == 1 and compiles["final_mix"] == 1, compiles


def test_the_knob_defaults_to_the_normed_form_and_its_variant_changes_only_it() -> None:
    from atlas.bench_variants import DECODE_KNOBS, PREFILL_KNOBS

    assert not Tuning().raw_site
    assert UNMEASURED["raw-site"] == attrs.evolve(Tuning(), raw_site=True)
    assert "raw_site" in PREFILL_KNOBS and "raw_site" not in DECODE_KNOBS  # its decode figures are shared
