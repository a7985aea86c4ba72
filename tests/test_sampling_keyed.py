"""The keyed sampler (atlas.sampling.keyed): the hash's known answers, the distribution it draws (total
variation against an independent reference of every filter), greedy ties, and that a row's token depends on
nothing but the row: not the batch, its order, padding, the sampler path or the logits' float width."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter

import pytest
import torch

from atlas.sampling import hashing, keyed
from atlas.sampling.keyed import (
    ACCEPT_SALT,
    SAMPLE_SALT,
    RowBatch,
    Rows,
    distribution,
    kept,
    logprobs,
    penalised,
    rows_of,
    sample,
    sample_token,
)
from atlas.sampling.params import SamplingParams

DRAWS = 5000
# 5000 draws over <= 8 tokens: E[TV] of an exact sampler <= 0.5 * sqrt(2 * 8 / (pi * 5000)) ~ 0.016 (sd per
# token ~ 0.007); 0.04 is 2.5x that, and a sampler off by one token's worth of mass fails it
TV_BOUND = 0.04


def tv(counts: Counter[int], p: list[float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - p[t]) for t in range(len(p)))


def reference_target(logits: list[float], params: SamplingParams, seen: set[int] = frozenset(),
                     banned: set[int] = frozenset()) -> list[float]:
    """The filtered distribution by the definitions, in plain Python (independent of the tensor code)."""
    x = [(v / params.repetition_penalty if v > 0 else v * params.repetition_penalty) if t in seen else v
         for t, v in enumerate(logits)]
    x = [float("-inf") if t in banned else v for t, v in enumerate(x)]
    if params.greedy:
        best = max(range(len(x)), key=lambda t: (x[t], -t))
        return [float(t == best) for t in range(len(x))]
    z = [v / params.temperature for v in x]
    zmax = max(z)
    keep = {t for t in range(len(z)) if z[t] > float("-inf")}
    if params.min_p > 0:  # p_t >= min_p * p_max
        keep = {t for t in keep if math.exp(z[t] - zmax) >= params.min_p}
    if params.top_k:
        kth = sorted((z[t] for t in keep), reverse=True)[min(params.top_k, len(keep)) - 1]
        keep = {t for t in keep if z[t] >= kth}  # ties with the k-th are kept
    if params.top_p < 1.0:
        mass = {t: math.exp(z[t] - zmax) for t in keep}
        total, before, chosen = sum(mass.values()), 0.0, set()
        for t in sorted(keep, key=lambda t: -z[t]):
            if before >= params.top_p * total and z[t] < min(z[c] for c in chosen):
                break
            chosen.add(t)
            before += mass[t]
        keep = chosen
    w = [math.exp(z[t] - zmax) if t in keep else 0.0 for t in range(len(z))]
    return [v / sum(w) for v in w]


def draws(logits: torch.Tensor, params: SamplingParams, *, seen=None, banned=None, by_position: bool = False
          ) -> Counter[int]:
    """DRAWS samples of one row in one batched call: a different seed per row (or one seed, many positions)."""
    rows = [SamplingParams(**{**params.to_json(), "seed": 0 if by_position else s}) for s in range(DRAWS)]
    positions = [40 + s if by_position else 40 for s in range(DRAWS)]
    batch = logits[None].expand(DRAWS, -1)
    expand = lambda t: None if t is None else t[None].expand(DRAWS, *t.shape)  # noqa: E731
    out = sample(batch, rows_of(rows, positions), seen=expand(seen), banned=expand(banned))
    return Counter(out.tolist())


def small_logits(seed: int, vocab: int = 8) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


# -- the hash ---------------------------------------------------------------------------------------------


def test_hash_known_answers() -> None:
    """Fixed inputs -> fixed words: a change to the hash (and so to every sampled token) is caught here."""
    assert [hashing.mix32_int(x) for x in (0, 1, 2, 0xFFFF_FFFF, 0x1234_5678)] == [
        0, 2261973619, 229111015, 2578835075, 384267965]
    cases = {
        (0, 0, SAMPLE_SALT, 0): 1471625374,
        (0, 0, SAMPLE_SALT, 1): 1801822732,
        (1, 0, SAMPLE_SALT, 0): 1297286550,
        (0, 1, SAMPLE_SALT, 0): 613473577,
        (12345, 678, ACCEPT_SALT, 4095): 3232932488,
        (-1, 2**40, SAMPLE_SALT, 65535): 873768950,
        (2**64 + 7, 3, SAMPLE_SALT, 9): 1436065469,
    }
    for (seed, position, salt, token), word in cases.items():
        assert hashing.word_int(seed, position, salt, token) == word
        ka, kb = hashing.row_keys(torch.tensor([hashing.seed64(seed)]), torch.tensor([position]), salt)
        assert int(hashing.token_words(ka, kb, token + 1)[0, token]) == word


def test_the_limb_products_equal_full_64_bit_products() -> None:
    """The tensor mixer (32x16-bit partial products) against plain big-int products, on random and edge words."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 2**32, (20000,), generator=g, dtype=torch.int64),
                   torch.tensor([0, 1, 0xFFFF, 0x10000, 0xFFFF_FFFF, 0x8000_0000])])
    assert hashing.mix32(x).tolist() == [hashing.mix32_int(v) for v in x.tolist()]
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]
    positions = [0, 1, 2**31, 2**32 + 5, 2**40, 7]
    ka, kb = hashing.row_keys(torch.tensor(seeds), torch.tensor(positions), 99)
    assert list(zip(ka.tolist(), kb.tolist(), strict=True)) == [
        hashing.key_ints(s, p, 99) for s, p in zip(seeds, positions, strict=True)]


def test_the_noise_is_standard_gumbel() -> None:
    ka, kb = hashing.row_keys(torch.tensor([5, 6]), torch.tensor([10, 10]), SAMPLE_SALT)
    words = hashing.token_words(ka, kb, 65536)
    assert words.min() >= 0 and words.max() < 2**32 and len(set(words[0].tolist())) == 65536  # a bijection
    g = hashing.gumbel(words)
    # mean: Euler's gamma; variance pi^2 / 6 (sd of the mean over 65,536 draws ~ 0.005)
    assert g.mean(dim=1).sub(0.5772).abs().max() < 0.03
    assert g.var(dim=1).sub(math.pi**2 / 6).abs().max() < 0.06
    assert (g[0] - g[1]).abs().min() > 0  # the two rows' noise differ everywhere


# -- the distribution --------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.8),
])
@pytest.mark.parametrize("by_position", [False, True])
def test_draws_follow_the_filtered_target(params: SamplingParams, by_position: bool) -> None:
    logits = small_logits(1)
    seen = {1, 4, 6} if params.repetition_penalty != 1.0 else set()
    mask = torch.zeros(8, dtype=torch.bool)
    mask[list(seen)] = True
    want = reference_target(logits.tolist(), params, seen=seen)
    assert tv(draws(logits, params, seen=mask if seen else None, by_position=by_position), want) < TV_BOUND
    # and the tensor code's own target agrees with the reference
    got = distribution(logits[None], rows_of([params], [0]), seen=mask[None] if seen else None)[0]
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_banned_tokens_are_never_drawn_and_the_rest_keep_their_odds() -> None:
    logits = small_logits(2)
    banned = torch.tensor([2, 5, -1])  # ids padded with -1
    params = SamplingParams(temperature=1.0)
    counts = draws(logits, params, banned=banned)
    assert counts[2] == counts[5] == 0
    assert tv(counts, reference_target(logits.tolist(), params, banned={2, 5})) < TV_BOUND


def test_consecutive_positions_are_independent() -> None:
    """Pairs (token at p, token at p + 1) of one seed over 20,000 positions follow the product of the marginals
    (16 cells: E[TV] ~ 0.011)."""
    logits = torch.tensor([0.0, 0.5, 1.0, -0.3])
    n = 20000
    params = [SamplingParams(temperature=1.0, seed=17)] * (n + 1)
    tokens = sample(logits[None].expand(n + 1, -1), rows_of(params, list(range(n + 1)))).tolist()
    pairs = Counter(zip(tokens[:-1], tokens[1:], strict=True))
    p = reference_target(logits.tolist(), params[0])
    joint = [p[a] * p[b] for a in range(4) for b in range(4)]
    assert 0.5 * sum(abs(pairs.get((a, b), 0) / n - joint[4 * a + b]) for a in range(4) for b in range(4)) < 0.03


def test_top_p_keeps_the_smallest_prefix_reaching_it_and_ties_stay() -> None:
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    for top_p, kept_tokens in ((0.5, [0]), (0.85, [0, 1]), (0.95, [0, 1, 2]), (1.0, [0, 1, 2])):
        p = distribution(logits[None], rows_of([SamplingParams(temperature=1.0, top_p=top_p)], [0]))[0]
        assert (p > 0).nonzero().flatten().tolist() == kept_tokens, top_p
    tied = torch.tensor([2.0, 1.0, 1.0, 0.0])
    for params in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.75)):
        p = distribution(tied[None], rows_of([params], [0]))[0]
        assert (p > 0).tolist() == [True, True, True, False], params  # token 2 ties with the last kept
    # min_p: p >= min_p * p_max, here 0.3 * 0.5 = 0.15
    p = distribution(torch.tensor([0.5, 0.2, 0.1, 0.2]).log()[None],
                     rows_of([SamplingParams(temperature=1.0, min_p=0.3)], [0]))[0]
    assert (p > 0).tolist() == [True, True, False, True]


def test_top_p_of_one_keeps_vanishing_tokens() -> None:
    """top_p = 1 is off outright: a token far below the rest (its mass lost in the sum's rounding) is kept."""
    logits = torch.tensor([0.0, 0.0, -40.0])
    p = distribution(logits[None], rows_of([SamplingParams(temperature=1.0, top_k=3)], [0]))[0]
    assert p[2] > 0


def test_repetition_penalty_has_vllm_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    rows = rows_of([SamplingParams(temperature=1.0, repetition_penalty=2.0)], [0])
    x = penalised(logits, rows, seen=torch.tensor([[0, 1, 3, -1]]))
    assert x.tolist() == [[1.0, -2.0, 0.5, 0.0]]  # positive divided, negative multiplied, unseen untouched


# -- greedy --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_ties_go_to_the_lowest_index(dtype: torch.dtype) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 4.0, 4.0]], dtype=dtype)
    mixed = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.5, top_p=0.5)]
    assert sample(logits, rows_of([SamplingParams()] * 3, [0, 1, 2])).tolist() == [1, 0, 2]
    assert sample(logits, rows_of(mixed, [0, 1, 2]))[:2].tolist() == [1, 0]  # on the sampler's other paths
    assert sample_token(logits[2].float(), SamplingParams(), 9) == 2


# -- a row's token depends on the row alone -----------------------------------------------------------------

PARAMS = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.8, top_p=0.95, seed=2),
    SamplingParams(),
    SamplingParams(temperature=1.2, top_k=30, seed=3),
    SamplingParams(temperature=0.6, min_p=0.1, seed=-4),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=5, min_p=0.02, seed=2**70 + 5),
]


def random_rows(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 2).to(torch.bfloat16).float()  # exact in every float width
    params = [PARAMS[i % len(PARAMS)] for i in torch.randint(0, 1000, (n,), generator=g).tolist()]
    positions = torch.randint(0, 10_000, (n,), generator=g).tolist()
    return logits, params, positions


def test_a_rows_token_does_not_depend_on_the_batch_its_order_or_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, params, positions = random_rows(48, 3000, 0)
    batched = sample(logits, rows_of(params, positions)).tolist()
    monkeypatch.setattr(keyed, "_CPU_ELEMENTS", 5 * 3000)  # the CPU's passes of a few rows: 5 at a time
    assert sample(logits, rows_of(params, positions)).tolist() == batched
    monkeypatch.undo()
    alone = [sample(logits[i : i + 1], rows_of([params[i]], [positions[i]])).item() for i in range(48)]
    assert batched == alone
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = sample(logits[perm], rows_of([params[i] for i in perm], [positions[i] for i in perm])).tolist()
    assert shuffled == [batched[i] for i in perm]
    other, other_params, other_positions = random_rows(16, 3000, 2)  # random company, greedy padding rows
    padded = torch.cat([other, logits, torch.zeros(8, 3000)])
    rows = rows_of(other_params + params + [SamplingParams()] * 8, other_positions + positions + [0] * 8)
    assert sample(padded, rows)[16:64].tolist() == batched
    # the path flags: a temperature-only row in a batch that sorts (filtered) draws what it draws unsorted
    plain = [i for i, p in enumerate(params) if not p.greedy and not p.top_k and p.top_p == 1.0]
    assert plain
    unsorted = rows_of([params[i] for i in plain], [positions[i] for i in plain])
    assert not unsorted.filtered
    assert sample(logits[plain], unsorted).tolist() == [batched[i] for i in plain]


def test_kept_sets_are_bitwise_the_same_alone_and_batched() -> None:
    logits, params, positions = random_rows(24, 2000, 3)
    rows = rows_of(params, positions)
    key = penalised(logits, rows)
    together = kept(key, rows)
    for i in range(24):
        one = rows_of([params[i]], [positions[i]])
        assert torch.equal(kept(penalised(logits[i : i + 1], one), one)[0], together[i])
    assert torch.equal(kept(key.double(), rows), together)  # sorting float64 or float32 keys: the same set


def test_the_same_logits_in_any_float_width_give_the_same_tokens() -> None:
    """The stand-in for CPU vs CUDA equality on the CPU: the integer words are identical by construction, and
    every float step is exact given the logits' values, so float32, float64 and bfloat16 copies of the same
    values (and a different batch shape) give the same token."""
    logits, params, positions = random_rows(64, 4096, 4)
    rows = rows_of(params, positions)
    want = sample(logits, rows).tolist()
    assert sample(logits.double(), rows).tolist() == want
    assert sample(logits.to(torch.bfloat16), rows).tolist() == want
    halves = [sample(logits[i : i + 32].double(), rows_of(params[i : i + 32], positions[i : i + 32]))
              for i in (0, 32)]
    assert torch.cat(halves).tolist() == want


def test_seeds_are_taken_mod_2_64_and_keyed_by_position() -> None:
    logits = small_logits(3, 64)[None].expand(3, -1)
    same = [SamplingParams(temperature=1.0, seed=s) for s in (-1, 2**64 - 1, 2**128 - 1)]
    assert len(set(sample(logits, rows_of(same, [7, 7, 7])).tolist())) == 1
    many = sample(small_logits(3, 64)[None].expand(200, -1),
                  rows_of([SamplingParams(temperature=1.0, seed=9)] * 200, list(range(200))))
    assert len(set(many.tolist())) > 20
    assert sample_token(small_logits(3, 64), SamplingParams(temperature=1.0, seed=9), 5) == int(many[5])


def test_packed_rows_round_trip_bit_for_bit() -> None:
    params = [SamplingParams(temperature=0.1 + 1e-9, top_p=0.3, top_k=7, min_p=0.25, repetition_penalty=1.3,
                             seed=-123), SamplingParams()]
    batch = RowBatch.of(params, [5, 2**40])
    assert batch.packed.shape == (2, 7) and batch.mode == "filtered"
    rows = Rows.unpack(batch.packed, batch.sampled, batch.filtered)
    assert rows.temperature.tolist() == [0.1 + 1e-9, 0.0] and rows.top_p.tolist() == [0.3, 1.0]
    assert rows.log_min_p.tolist() == [math.log(0.25), float("-inf")] and rows.penalty.tolist() == [1.3, 1.0]
    assert rows.top_k.tolist() == [7, 0] and rows.seed.tolist() == [-123, 0] and rows.position.tolist() == [5, 2**40]
    assert RowBatch.of([SamplingParams()], [0]).mode == "greedy"
    assert RowBatch.of([SamplingParams(temperature=1.0, min_p=0.5)], [0]).mode == "sampled"


def test_the_row_packer_packs_what_row_batch_packs_step_after_step() -> None:
    """The decode group's packer keeps the last rows by parameter identity and rewrites the positions: each call
    equals RowBatch.of, after a row's parameters change (another object), the batch size changes or a row turns
    greedy, and an earlier call's parameters are never served for another set."""
    from atlas.sampling.keyed import RowPacker

    greedy = SamplingParams()
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(4)]
    packer = RowPacker()
    steps = [([*seeded], [10, 11, 12, 13]), ([*seeded], [11, 12, 13, 14]),
             ([seeded[0], greedy, seeded[2], seeded[3]], [12, 0, 14, 15]),  # a row finished: padding
             ([seeded[0], SamplingParams(temperature=0.5, seed=7), seeded[2], seeded[3]], [13, 3, 15, 16]),
             ([greedy, greedy], [0, 0]), ([*seeded[:2]], [20, 21])]
    for params, positions in steps:
        got, want = packer.of(params, positions), RowBatch.of(params, positions)
        assert torch.equal(got.packed, want.packed), (params, positions)
        assert (got.sampled, got.filtered) == (want.sampled, want.filtered)


def test_logprobs_are_the_raw_distributions() -> None:
    logits, _, _ = random_rows(4, 100, 5)
    tokens = torch.tensor([3, 1, 4, 1])
    lp, values, ids = logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(lp, ref[torch.arange(4), tokens], atol=1e-12, rtol=0)
    assert torch.equal(ids, ref.topk(5).indices) and torch.allclose(values, ref.topk(5).values, atol=1e-12, rtol=0)


# -- parameters ----------------------------------------------------------------------------------------------


def test_new_parameters_are_validated_and_old_payloads_load() -> None:
    for bad in ({"min_p": -0.1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"min_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    old = SamplingParams(temperature=0.5, seed=3).to_json()
    assert not {"min_p", "repetition_penalty", "min_tokens"} & set(old)  # defaults stay out of the trace
    loaded = SamplingParams.from_json(old)
    assert (loaded.min_p, loaded.repetition_penalty, loaded.min_tokens) == (0.0, 1.0, 0)
    new = SamplingParams(min_p=0.1, repetition_penalty=1.2, min_tokens=4)
    assert SamplingParams.from_json(new.to_json()) == new and new.to_json()["min_tokens"] == 4


def test_the_params_import_without_torch() -> None:
    code = ("import sys; import atlas.sampling, atlas.sampling.params, atlas.sampling.acceptance; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# -- on a GPU (skipped without one) --------------------------------------------------------------------------



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_draws_the_cpus_tokens_without_a_host_sync() -> None:
    logits, params, positions = random_rows(256, 65536, 6)
    want = sample(logits, rows_of(params, positions)).tolist()
    rows = rows_of(params, positions, "cuda")
    dev = logits.to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation inside the sampler raises
    try:
        got = sample(dev, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.tolist() == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_sampler_captures_in_a_cuda_graph_and_follows_its_rows() -> None:
    logits, params, positions = random_rows(64, 32768, 7)
    dev = logits.to("cuda")
    static = RowBatch.of(params, positions).packed.to("cuda")
    flags = RowBatch.of(params, positions)
    body = lambda: sample(dev, Rows.unpack(static, flags.sampled, flags.filtered))  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    for shift in (0, 1, 2):  # new positions each replay, as decode steps
        moved = [p + shift for p in positions]
        static.copy_(RowBatch.of(params, moved).packed)
        graph.replay()
        assert out.tolist() == sample(logits, rows_of(params, moved)).tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2)])
def test_cuda_draws_follow_the_filtered_target(params: SamplingParams) -> None:
    logits = small_logits(1)
    rows = [SamplingParams(**{**params.to_json(), "seed": s}) for s in range(DRAWS)]
    out = sample(logits[None].expand(DRAWS, -1).cuda(), rows_of(rows, [40] * DRAWS, "cuda"))
    assert tv(Counter(out.tolist()), reference_target(logits.tolist(), params)) < TV_BOUND
