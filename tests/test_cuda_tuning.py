"""The CUDA backend's arrangements compute the same step: the default (every part on) is what a backend takes
without a tuning where the kernels run, the reference (EAGER) where they do not; each part, switched on alone over
the reference in the fp32 parity mode on the CPU (Triton kernels interpreted), gives the CPU reference backend's
greedy tokens, and in bf16 its logits stay within rounding of the reference's."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on a CPU (before atlas_kernels loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from atlas.backends.cuda import CudaBackend
from atlas.backends.cuda.tuning import EAGER, TUNINGS, Tuning
from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog. " * 2),  # 90 tokens: past the inert bound (19)
    list(b"hello"),
    list(b"0123456789abcdefghij"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the default's parts but torch.compile (the regions run eagerly: on a CPU Inductor would compile for minutes) and the
# prefill graphs (nothing is captured on a CPU)
UNCOMPILED = Tuning(compile=False, prefill_graphs=False)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def run_tokens(tiny, backend: str, tuning: Tuning | None = None) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    config = EngineConfig(max_seq_len=128, max_batch_size=3, prefill_chunk_tokens=32)
    options = {} if backend == "cpu" else {"device": DEVICE, "cuda_graphs": False, "tuning": tuning}
    engine = build_engine("atlas-tiny", backend, config, loaded=tiny, sink=RecordingSink(), backend_options=options)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    return [r.token_ids for r in generate(engine, PROMPTS, params)]


@pytest.fixture(scope="module")
def reference(tiny) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    return run_tokens(tiny, "cpu")


def test_the_default_is_every_part_on_and_the_reference_every_part_off() -> None:
    parts = [f.name for f in attrs.fields(Tuning)]
    assert all(getattr(Tuning(), p) for p in parts)
    assert not any(getattr(EAGER, p) for p in parts)
    assert TUNINGS == {"default": Tuning(), "eager": EAGER}  # what `--tuning` offers: at most 3


def test_a_backend_takes_the_default_where_the_kernels_run_and_the_reference_elsewhere(tiny) -> None:  # type: ignore[no-untyped-def]
    for dtype in (torch.float32, torch.bfloat16):  # no Triton GDN kernel on a CPU device, nor in fp32 on a GPU
        backend = CudaBackend(tiny, num_kv_blocks=8, block_size=16, dtype=dtype, device="cpu", max_batch_size=2,
                              cuda_graphs=False)
        assert backend.tuning == EAGER and backend.prefill_moe == "grouped"
    named = CudaBackend(tiny, num_kv_blocks=8, block_size=16, device="cpu", max_batch_size=2, cuda_graphs=False,
                        tuning=Tuning())
    assert named.tuning == Tuning() and named.prefill_moe == "triton"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bf16_backend_on_a_gpu_takes_the_default(tiny) -> None:  # type: ignore[no-untyped-def]
    backend = CudaBackend(tiny, num_kv_blocks=8, block_size=16, device="cuda", max_batch_size=2)
    assert backend.tuning == Tuning() and backend.prefill_graphs is not None
    fp32 = CudaBackend(tiny, num_kv_blocks=8, block_size=16, dtype=torch.float32, device="cuda", max_batch_size=2)
    assert fp32.tuning == EAGER


# each part alone over the reference, then every part but the compile together
PARTS = {"regions": attrs.evolve(EAGER, regions=True), "moe_kernels": attrs.evolve(EAGER, moe_kernels=True),
         "attention_kernels": attrs.evolve(EAGER, attention_kernels=True), "uncompiled": UNCOMPILED}


@pytest.mark.parametrize("part", list(PARTS))
def test_each_part_gives_the_reference_tokens(tiny, reference, part: str) -> None:  # type: ignore[no-untyped-def]
    assert run_tokens(tiny, "cuda-fp32", PARTS[part]) == reference


@pytest.mark.parametrize("tuning", [attrs.evolve(EAGER, moe_kernels=True), attrs.evolve(EAGER, attention_kernels=True),
                                    attrs.evolve(EAGER, library_conv=True), UNCOMPILED],
                         ids=["moe_kernels", "attention_kernels", "library_conv", "uncompiled"])
def test_bf16_part_logits_stay_within_rounding_of_the_reference(tiny, tuning: Tuning) -> None:  # type: ignore[no-untyped-def]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0][:40]]
    logits = []
    for t in (EAGER, tuning):
        backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.bfloat16, device=DEVICE,
                              max_batch_size=4, kernels=False, cuda_graphs=False, tuning=t)
        backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(p), 0, tables[i], True) for i, p in enumerate(prompts))))
        decode = [SeqWork(i, (40 + i,), len(p), tables[i], True) for i, p in enumerate(prompts)]
        backend._prepare(decode)
        logits.append(torch.stack([v.float() for v in backend._last_logits(decode).values()]))
    base, got = logits
    assert float((got - base).norm() / base.norm()) < 3e-2


def test_prefill_graphs_without_the_moe_kernels_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_graphs.*moe_kernels off.*syncs with the host"):
        Tuning(moe_kernels=False)  # the default's prefill graphs cannot capture a host sync


def test_recurring_prefill_shapes_are_captured_on_their_second_feed_up_to_the_cap() -> None:
    from atlas.backends.cuda.batch import GroupShape
    from atlas.backends.cuda.graphs import Recurring

    shapes = [GroupShape(1, width, 8, True, 0, 0) for width in (64, 128, 256)]
    policy = Recurring(cap=2)
    assert [policy.take(shapes[0]) for _ in range(3)] == [False, True, True]
    assert [policy.take(shapes[1]) for _ in range(2)] == [False, True]
    assert [policy.take(shapes[2]) for _ in range(3)] == [False, False, False]  # two held: the rest stay eager
    assert policy.take(shapes[0]) and policy.graphed == set(shapes[:2])


def test_prefill_graph_shapes_give_the_reference_tokens(tiny, reference) -> None:  # type: ignore[no-untyped-def]
    """Under prefill_graphs every prefill chunk's key blocks are rounded up (the graphs' shapes; on a CPU nothing is
    captured): the extra keys are masked, so the tokens are the reference's (fp32, chunks of 32 past the QSA bound)."""
    seen = []
    real = CudaBackend._run_group

    def spy(self, packed, shape):  # type: ignore[no-untyped-def]
        seen.append(shape)
        return real(self, packed, shape)

    CudaBackend._run_group = spy  # type: ignore[method-assign]
    try:
        assert run_tokens(tiny, "cuda-fp32", attrs.evolve(EAGER, moe_kernels=True, prefill_graphs=True)) == reference
    finally:
        CudaBackend._run_group = real  # type: ignore[method-assign]
    prefill = {s.key_blocks for s in seen if s.width > 1}
    assert prefill == {4, 8}  # 2 / 3 / 5 / 6 blocks of 16 keys rounded up


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark's default compiles them; the compile "
                    "would cost the lead's test minutes")
def test_compiled_regions_give_the_eager_logits(tiny) -> None:  # type: ignore[no-untyped-def]
    """Tuning.compile: the regions through torch.compile (Inductor's C++ backend here, minutes of compiling on the
    shared CPU; Triton on a GPU) give the eager regions' logits."""
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(2)]
    logits = []
    regions = attrs.evolve(EAGER, regions=True)
    for tuning in (regions, attrs.evolve(regions, compile=True)):
        backend = CudaBackend(tiny, num_kv_blocks=32, block_size=16, dtype=torch.float32, device=DEVICE,
                              max_batch_size=4, kernels=False, cuda_graphs=False, tuning=tuning)
        backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(range(30 + i, 50 + i)), 0, tables[i], True)
                                          for i in range(2))))
        decode = [SeqWork(i, (7 + i,), 20, tables[i], True) for i in range(2)]
        backend._prepare(decode)
        logits.append(torch.stack(list(backend._last_logits(decode).values())))
    assert torch.allclose(logits[1], logits[0], rtol=0, atol=1e-5), (logits[1] - logits[0]).abs().max()


def test_a_trace_records_the_tuning_and_a_replay_rebuilds_it(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from atlas.engine.records import RecordingSink as Sink
    from atlas.registry import engine_for_run
    from atlas.replay.reader import TraceReader

    tuning = attrs.evolve(EAGER, regions=True, library_conv=True)
    config = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=32)
    path = tmp_path / "tuned.db"
    engine = build_engine("atlas-tiny", "cuda-fp32", config, str(path), loaded=tiny,
                          backend_options={"device": DEVICE, "cuda_graphs": False, "tuning": tuning})
    generate(engine, [PROMPTS[1]], [SamplingParams(max_tokens=3, ignore_eos=True)])
    engine.close()
    run = TraceReader(path).run()
    assert run.config["backend_tuning"]["regions"] is True
    again = engine_for_run(run, Sink(), loaded=tiny, backend_options={"device": DEVICE, "cuda_graphs": False})
    assert again.backend.tuning == tuning  # type: ignore[attr-defined]
