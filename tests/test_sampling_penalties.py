"""frequency_penalty, presence_penalty, logit_bias and the repetition penalty (atlas.sampling.adjust + the one keyed
sampler): the token they choose as computed by hand on small logits, the same token from the CPU backend's call
(sample_token) and from the CUDA backend's batched call (picks.sample_rows, run here on CPU tensors), the
temperature floor, the choice seeds of n > 1, and the CPU backend's engine honouring them end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import attrs
import pytest
import torch

from atlas.backends.cuda.picks import sample_rows
from atlas.plan import SeqWork
from atlas.sampling.adjust import Adjust
from atlas.sampling.keyed import RowBatch, penalised, rows_of, sample, sample_token
from atlas.sampling.params import TEMPERATURE_FLOOR, SamplingParams, choice_seed

# token 0 leads token 1 by 0.1; the prompt is [3], the output so far [0, 0, 2]
LOGITS = torch.tensor([2.0, 1.9, 1.5, 0.0, -1.0])
PROMPT, OUTPUT = (3,), (0, 0, 2)
HISTORY = PROMPT + OUTPUT


def by_hand(p: SamplingParams, logits: list[float], prompt: tuple[int, ...], output: tuple[int, ...]) -> list[float]:
    """OpenAI's and vLLM's formulas, written out: bias, repetition on prompt + output, then frequency/presence on the
    output's counts."""
    bias = dict(p.logit_bias)
    out = []
    for t, x in enumerate(logits):
        x += bias.get(t, 0.0)
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(t)
        out.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return out


CASES = [  # (params, the greedy token worked out by hand)
    (SamplingParams(), 0),
    (SamplingParams(frequency_penalty=0.04), 0),  # 2.0 - 2 * 0.04 = 1.92 > 1.9
    (SamplingParams(frequency_penalty=0.06), 1),  # 2.0 - 2 * 0.06 = 1.88 < 1.9
    (SamplingParams(presence_penalty=0.05), 0),  # 2.0 - 0.05 = 1.95 > 1.9: once, whatever the count
    (SamplingParams(presence_penalty=0.2), 1),  # 1.8 < 1.9
    (SamplingParams(logit_bias={0: -1.0}), 1),  # 1.0 < 1.9
    (SamplingParams(frequency_penalty=-0.6, logit_bias={0: -1.0}), 0),  # 1.0 + 2 * 0.6 = 2.2 > 1.5 + 0.6 > 1.9
    (SamplingParams(logit_bias={4: 3.5}), 4),  # -1.0 + 3.5 = 2.5
    (SamplingParams(logit_bias={0: -100.0}), 1),
    (SamplingParams(repetition_penalty=1.2), 1),  # token 0 seen: 2.0 / 1.2 = 1.67 < 1.9 (token 1 never seen)
    (SamplingParams(repetition_penalty=1.2, logit_bias={3: 2.0}), 1),  # 3 is in the prompt: 2.0 / 1.2 = 1.67
    (SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, logit_bias={3: 1.95}), 3),  # prompt: no penalty
]


@pytest.mark.parametrize(("params", "token"), CASES)
def test_penalties_choose_the_token_computed_by_hand(params: SamplingParams, token: int) -> None:
    expected = by_hand(params, LOGITS.tolist(), PROMPT, OUTPUT)
    assert max(range(5), key=expected.__getitem__) == token
    # the CPU backend's call
    assert sample_token(LOGITS, params, position=len(HISTORY), history=HISTORY, prompt_len=len(PROMPT)) == token
    adjust = Adjust.of([params], [HISTORY], [len(PROMPT)], 5, "cpu")
    rows = rows_of([params], [len(HISTORY)])
    key = penalised(LOGITS[None], rows, adjust=adjust)[0].to(torch.float64)
    assert torch.allclose(key, torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def _cuda_path(logits: torch.Tensor, params: list[SamplingParams], histories: list[tuple[int, ...]],
               prompt_lens: list[int], device: str = "cpu") -> list[int]:
    """The CUDA backend's sampling of prefill ends / eager rows (picks.sample_rows), on `device` tensors."""
    backend = SimpleNamespace(device=torch.device(device), _replayed=None, graphs=None)
    work = [SeqWork(i, (h[-1],), len(h) - 1, (0,), True, p, history=h if p.reads_history else (), prompt_len=n)
            for i, (p, h, n) in enumerate(zip(params, histories, prompt_lens, strict=True))]
    picked = sample_rows(backend, work, {i: logits[i].to(device) for i in range(len(params))})
    return [picked[i][0] for i in range(len(params))]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_cpu_and_cuda_backends_calls_agree_row_by_row(temperature: float) -> None:
    """Same logits, same params, same history -> the same token from the CPU backend's per-row call and the CUDA
    backend's batched call, each row in a batch of differently adjusted rows."""
    g = torch.Generator().manual_seed(7)
    vocab = 50
    params = [SamplingParams(temperature=temperature, seed=s, repetition_penalty=r, frequency_penalty=f,
                             presence_penalty=q, logit_bias=b)
              for s, r, f, q, b in [(1, 1.5, 0.0, 0.0, ()), (2, 1.0, 1.5, 0.0, ()), (3, 1.0, 0.0, -1.0, ()),
                                    (4, 1.3, 0.7, 0.4, ((5, 3.0), (9, -2.0))), (5, 1.0, 0.0, 0.0, ((1, 50.0),)),
                                    (6, 1.0, 0.0, 0.0, ())]]
    changed = 0
    for _trial in range(20):
        logits = torch.randn(len(params), vocab, generator=g) * 3
        histories = [tuple(torch.randint(0, vocab, (12,), generator=g).tolist()) for _ in params]
        prompt_lens = [4] * len(params)
        cpu = [sample_token(logits[i], p, position=12, history=h, prompt_len=4)
               for i, (p, h) in enumerate(zip(params, histories, strict=True))]
        assert _cuda_path(logits, params, histories, prompt_lens) == cpu
        plain = [sample_token(logits[i], SamplingParams(temperature=temperature, seed=p.seed), position=12)
                 for i, p in enumerate(params)]
        changed += sum(a != b for a, b in zip(cpu, plain, strict=True))
    assert changed > 20  # the adjustments do change tokens (else agreeing would prove nothing)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_adjusted_sampler_on_a_gpu_gives_the_cpu_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.9, seed=i, repetition_penalty=1.4, frequency_penalty=0.8,
                             presence_penalty=0.3, logit_bias={i: 2.0}) for i in range(8)]
    logits = torch.randn(8, 1000, generator=g)
    histories = [tuple(torch.randint(0, 1000, (40,), generator=g).tolist()) for _ in params]
    cpu = _cuda_path(logits, params, histories, [10] * 8)
    assert _cuda_path(logits, params, histories, [10] * 8, device="cuda") == cpu


def test_a_temperature_below_the_floor_is_greedy() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g)
    for t in (1e-300, 5e-324, 1e-10, TEMPERATURE_FLOOR / 2):
        params = [SamplingParams(temperature=t, seed=s) for s in range(64)]
        batch = RowBatch.of(params, list(range(64)))
        assert not batch.sampled and batch.to("cpu").temperature.eq(0).all()
        assert sample(logits, batch.to("cpu")).tolist() == logits.argmax(dim=-1).tolist()
    # at the floor it samples: over 64 rows of near-flat logits some row leaves the argmax
    flat = torch.randn(64, 300, generator=g) * 1e-6
    params = [SamplingParams(temperature=TEMPERATURE_FLOOR, seed=s) for s in range(64)]
    assert sample(flat, rows_of(params, list(range(64)))).tolist() != flat.argmax(dim=-1).tolist()


def test_choice_seeds_are_distinct_deterministic_and_keep_the_first() -> None:
    for seed in (0, 1, 2**64 - 1, 12345):
        seeds = [choice_seed(seed, j) for j in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64 and all(0 <= s < 2**64 for s in seeds)
        assert seeds == [choice_seed(seed, j) for j in range(64)]


def test_the_new_fields_are_validated_and_recorded_only_when_set() -> None:
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -2.01}, {"logit_bias": {3: 101.0}},
                {"logit_bias": {-1: 1.0}}, {"frequency_penalty": math.nan}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not {"frequency_penalty", "presence_penalty", "logit_bias"} & set(SamplingParams().to_json())
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0, logit_bias={9: 1.5, 2: -3.0})
    assert p.logit_bias == ((2, -3.0), (9, 1.5)) and p.adjusted and p.reads_history
    assert SamplingParams.from_json(p.to_json()) == p
    assert SamplingParams(logit_bias={1: 2.0}).adjusted and not SamplingParams(logit_bias={1: 2.0}).reads_history


def test_the_cpu_backend_engine_applies_them() -> None:
    """End to end on the CPU backend: a bias that makes token 7 win every step greedily, then a frequency penalty
    (which grows with each 7) and a repetition penalty (7 is in the prompt) that take it back."""
    from atlas.registry import build_engine

    engine = build_engine("atlas-tiny", "cpu")

    def run(name: str, **kw: object) -> list[int]:
        engine.add_request(name, [5, 6, 7, 5, 6], SamplingParams(max_tokens=12, **kw))
        tokens: list[int] = []
        while True:
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finished:
                    return tokens

    plain = run("plain")
    biased = run("biased", logit_bias={7: 8.0})
    assert 7 not in plain and biased == [7] * 12
    freq = run("freq", logit_bias={7: 8.0}, frequency_penalty=2.0)
    assert freq[0] == 7 and 0 < freq.count(7) < 12  # the penalty grows with the count until 7 loses
    assert run("biased3", logit_bias={7: 3.0}) == [7] * 12
    pres = run("pres", logit_bias={7: 3.0}, presence_penalty=2.0)
    assert pres[0] == 7 and pres != [7] * 12  # generated once, 7 pays 2.0 from then on
    rep = run("rep", logit_bias={7: 3.0}, repetition_penalty=5.0)
    assert rep[0] != 7  # 7 is in the prompt: its logit is divided by 5 from the first token
    assert run("again", logit_bias={7: 8.0}, frequency_penalty=2.0) == freq  # keyed: the same on every run


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_a_penalised_request_is_not_speculated(drafter: str) -> None:
    """A verify row's penalties would depend on the drafts before it: such a request decodes plainly, so with
    speculation on it gets exactly its tokens with speculation off (an n-gram drafter proposes the biased 7s)."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.registry import build_engine

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7]]
    params = [SamplingParams(max_tokens=16, logit_bias={7: 8.0}, frequency_penalty=1.0),
              SamplingParams(max_tokens=16, temperature=0.8, seed=4, logit_bias={7: 4.0}, repetition_penalty=1.6,
                             presence_penalty=0.5)]
    off = generate(build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=64)), prompts, params)
    spec = EngineConfig(max_seq_len=64, num_drafts=3, drafter=drafter)
    on = generate(build_engine("atlas-tiny", "cpu", spec), prompts, params)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert 7 in off[0].token_ids and off[0].token_ids != [7] * 16


def test_the_cuda_backend_on_cpu_tensors_gives_the_cpu_backends_tokens() -> None:
    """The engine end to end on both backends (CUDA's code on CPU tensors, fp32): a batch mixing penalised,
    biased and plain rows, greedy and seeded, gives the same tokens (a batch holding such rows leaves CUDA's steady
    step and decode graph for the eager sampler, which gets the history the plan carries)."""
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.model import load_model
    from atlas.registry import build_engine

    torch.set_num_threads(1)
    tiny = load_model("atlas-tiny")
    config = EngineConfig(max_seq_len=128, max_batch_size=4, prefill_chunk_tokens=32)
    prompts = [[5, 6, 7, 5, 6], list(b"hello there"), [7, 7, 7], list(b"abc")]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={7: 6.0}, frequency_penalty=1.5),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=3, repetition_penalty=1.2,
                             frequency_penalty=-1.5, presence_penalty=-0.5),
              SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={7: 3.0}, repetition_penalty=3.0),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, seed=9)]
    cpu = generate(build_engine("atlas-tiny", "cpu", config, loaded=tiny), prompts, params)
    cuda = generate(build_engine("atlas-tiny", "cuda-fp32", config, loaded=tiny,
                                 backend_options={"device": "cpu", "cuda_graphs": False}), prompts, params)
    assert [r.token_ids for r in cuda] == [r.token_ids for r in cpu]
    unpenalised = [attrs.evolve(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
                   for p in params]
    plain = generate(build_engine("atlas-tiny", "cpu", config, loaded=tiny), prompts, unpenalised)
    assert [a.token_ids != b.token_ids for a, b in zip(cpu, plain, strict=True)] == [True, True, True, False]
