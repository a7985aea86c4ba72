"""The CUDA backend's sampler host side (atlas.backends.cuda.picks.sample_rows) without a GPU: with the decode
group "replayed" (a stand-in for DecodeGraphs whose sampler runs the keyed sampler on the group's logits, as the
sampler graph does), every row's token, logprob and alternatives equal the eager path's, whatever mix of graph
rows, padding, banned rows (sampled outside the graph), greedy rows and logprob requests the step holds."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cuda import CudaBackend
from atlas.backends.cuda.batch import GroupShape
from atlas.backends.cuda.picks import sample_rows
from atlas.model import load_model
from atlas.plan import SeqWork
from atlas.sampling.keyed import sample
from atlas.sampling.params import SamplingParams


class SamplerGraph:
    """DecodeGraphs.sample's contract: one token per graph row (padding rows greedy) from the group's logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.calls = 0

    def sample(self, shape: GroupShape, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.calls += 1
        assert batch.packed.shape[0] == shape.batch == self.logits.shape[0]
        return sample(self.logits, batch.to("cpu"))


@pytest.fixture(scope="module")
def backend() -> CudaBackend:
    torch.set_num_threads(1)
    return CudaBackend(load_model("atlas-tiny"), num_kv_blocks=16, dtype=torch.float32, device="cpu",
                       max_batch_size=8, cuda_graphs=False)


PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, seed=11), SamplingParams(),
          SamplingParams(temperature=1.0, seed=12, logprobs=True, top_logprobs=2),
          SamplingParams(temperature=0.7, top_k=5, seed=13), SamplingParams(temperature=1.1, seed=14)]


@pytest.mark.parametrize("banned_row", [None, 3])
def test_graph_rows_give_the_eager_rows_tokens_and_logprobs(backend: CudaBackend, banned_row: int | None) -> None:
    g = torch.Generator().manual_seed(5)
    vocab = backend.spec.vocab_size
    work = [SeqWork(i, (7,), 20 + 3 * i, (i,), True, p, banned=(1, 2, 3) if i == banned_row else ())
            for i, p in enumerate(PARAMS)]
    shape = GroupShape(batch=8, width=1, key_blocks=4, qsa_select=False, ngram_heads=0, ple_layers=0)
    group = torch.randn(8, vocab, generator=g)  # rows 5..7 are the graph's padding
    logits = {i: group[i] for i in range(len(work))}
    backend._replayed = None
    eager = sample_rows(backend, work, logits)
    graph = SamplerGraph(group)
    backend.graphs, backend._replayed = graph, (shape, list(range(len(work))))  # type: ignore[assignment]
    try:
        for _ in range(2):  # the packer's kept rows serve the second call
            assert sample_rows(backend, work, logits) == eager
    finally:
        backend.graphs, backend._replayed = None, None
    assert graph.calls == 2 and set(eager) == set(range(len(work)))
    assert eager[2][1] is not None and len(eager[2][2]) == 2 and eager[0][1] is None


def test_a_plain_steps_fast_result_equals_the_general_paths() -> None:
    """execute's plain-step result (no verify, snapshot, drafter, refusal, prompt logprobs: the steady decode)
    equals what the general path builds, step for step, prefill and decode, greedy and seeded rows."""
    from atlas.plan import StepPlan

    tiny = load_model("atlas-tiny")
    fast, general = (CudaBackend(tiny, num_kv_blocks=16, dtype=torch.float32, device="cpu", max_batch_size=4,
                                 cuda_graphs=False) for _ in range(2))
    general.plain_fast = False
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=3, logprobs=True, top_logprobs=2), SamplingParams(temperature=1.2, seed=4)]
    tables = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    prompts = [list(b"hello there"), list(b"0123456789abcdefghij"), list(b"ab")]
    plans = [StepPlan(0, tuple(SeqWork(i, tuple(p), 0, tables[i], True, params[i]) for i, p in enumerate(prompts)))]
    got = [fast.execute(plans[0]), general.execute(plans[0])]
    assert got[0] == got[1]
    ends = [len(p) for p in prompts]
    for step in range(1, 4):
        tokens = [o.token for o in got[0].outcomes]
        plan = StepPlan(step, tuple(SeqWork(i, (tokens[i],), ends[i], tables[i], True, params[i]) for i in range(3)))
        got = [fast.execute(plan), general.execute(plan)]
        assert got[0] == got[1] and all(o.token is not None for o in got[0].outcomes)
        ends = [e + 1 for e in ends]
