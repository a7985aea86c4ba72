"""`atlas bench gpu`'s side-by-side variants (atlas.bench_variants) without a GPU: the measurements replaced by
fakes, one of them failing, so the orchestration (error capture, reuse of figures where knobs agree, the table)
is what is tested."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

import atlas.bench as bench
import atlas.bench_measure as measure
from atlas.backends.cuda.tuning import EAGER, Tuning
from atlas.bench_variants import measure_variants, variants_table


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []

    def prefill(model: Any, tokens: int, tuning: Tuning, **_: Any) -> dict:
        calls.append(("prefill", tuning))
        if tuning.attention_kernels:
            raise RuntimeError("no kernel for this shape")
        return {"tokens": tokens, "ms": 50.0 if tuning.moe_kernels else 90.0, "tokens_per_s": 1.0}

    def decode(model: Any, batch: int, tuning: Tuning, **_: Any) -> dict:
        calls.append(("decode", tuning))
        return {"batch": batch, "ms_per_step": 2.0 if tuning.moe_kernels else 6.0, "tokens_per_s": 1.0,
                "control_plane_share": 0.01}

    monkeypatch.setattr(measure, "bench_prefill", prefill)
    monkeypatch.setattr(measure, "bench_decode", decode)
    monkeypatch.setattr(measure, "profile_steps", lambda *a, **k: {"decode_b1": {"kernels": 9}})
    monkeypatch.setattr(measure, "prefill_flops", lambda model, tokens: 1e12)
    monkeypatch.setattr(measure, "weight_bytes", lambda model, batch: 3e9)
    monkeypatch.setattr(measure, "state_bytes", lambda model, batch, context: 1e8)
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    return calls


def test_a_failing_variant_is_reported_and_the_rest_measured(fakes: list) -> None:
    variants = {"baseline": EAGER, "dense": attrs.evolve(EAGER, library_conv=True),
                "sdpa": attrs.evolve(EAGER, attention_kernels=True), "triton": attrs.evolve(EAGER, moe_kernels=True)}
    seen: list[str] = []
    results = measure_variants(None, variants, batches=(1, 16), prefill_tokens=2048, bw=4e12, rate=7e14, out=None,
                               on_variant=lambda name, row: seen.append(name))
    assert seen == list(variants)
    assert "no kernel for this shape" in results["sdpa"]["prefill"]["error"]
    assert results["triton"]["prefill"]["ms"] == 50.0 and results["triton"]["decode_b1"]["ms_per_step"] == 2.0
    # "dense" (a prefill-only knob) decodes like the baseline: its decode figures are the baseline's, not measured again
    assert results["dense"]["decode_b16"]["same_as"] == "baseline"
    assert sum(1 for kind, _ in fakes if kind == "decode") == 3 * 2  # baseline, sdpa and triton, two batches each
    text = "\n".join(variants_table(results, (1, 16)))
    assert "| sdpa | ERROR |" in text and "ERROR sdpa prefill: RuntimeError: no kernel for this shape" in text
    assert "| triton | 50.0 |" in text


def test_every_prefill_knob_keeps_a_variant_from_reusing_prefill_figures(fakes: list) -> None:
    default = Tuning()
    variants = {"default": default, "eager-conv": attrs.evolve(default, library_conv=False),
                "no-prefill-graphs": attrs.evolve(default, prefill_graphs=False)}
    results = measure_variants(None, variants, batches=(1,), prefill_tokens=2048, bw=4e12, rate=7e14, out=None,
                               on_variant=lambda name, row: None, profile=False)
    # eager-conv differs in a prefill-only knob: its prefill measured, its decode shared
    assert "same_as" not in results["eager-conv"]["prefill"]
    assert results["eager-conv"]["decode_b1"]["same_as"] == "default"
    # no-prefill-graphs: prefill graphs only (a prefill knob)
    assert "same_as" not in results["no-prefill-graphs"]["prefill"]
    assert results["no-prefill-graphs"]["decode_b1"]["same_as"] == "default"
    assert [kind for kind, _ in fakes] == ["prefill", "decode", "prefill", "prefill"]


def test_profiles_can_wait_until_every_timing_is_done(fakes: list) -> None:
    from atlas.bench_variants import profile_variants

    variants = {"baseline": EAGER, "dense": attrs.evolve(EAGER, library_conv=True),
                "triton": attrs.evolve(EAGER, moe_kernels=True)}
    results = measure_variants(None, variants, batches=(1,), prefill_tokens=2048, bw=4e12, rate=7e14, out=None,
                               on_variant=lambda name, row: None, profile=False)
    assert not any(row.get("profile") for row in results.values())
    profile_variants(None, results, None)
    # one profile per decode arrangement; "dense" decodes as the baseline and shares its profile
    assert [row["profile"]["decode_b1"] for row in results.values()] == [{"kernels": 9}] * 3
    assert sum(1 for row in results.values() if "seconds" in row["profile"]) == 3  # "dense" has the baseline's
    assert "| triton | " in "\n".join(variants_table(results, (1,))) and "| 9/- |" in variants_table(results, (1,))[2]


def test_the_summary_table_names_the_winners_and_the_errors(fakes: list) -> None:
    from atlas.bench_variants import best

    variants = {"baseline": EAGER, "sdpa": attrs.evolve(EAGER, attention_kernels=True),
                "triton": attrs.evolve(EAGER, moe_kernels=True)}
    results = measure_variants(None, variants, batches=(1,), prefill_tokens=2048, bw=4e12, rate=7e14, out=None,
                               on_variant=lambda name, row: None)
    report: dict = {"device": "fake", "ceilings": {"copy_gb_s": 4000.0, "bf16_tflop_s": 700.0}, "batches": [1],
                    "variants": results, "prefill_32752": {"error": "OutOfMemoryError: 64 GiB"}}
    name, fig = best(results, "decode_b1", "ms_per_step")  # type: ignore[misc]
    report["decode_b1"] = {**fig, "variant": name}
    name, fig = best(results, "prefill", "ms")  # type: ignore[misc]
    report["prefill"] = {**fig, "variant": name}
    text = bench.table(report)
    assert "decode best: b1 triton 2.00 ms" in text
    assert "prefill 32752: ERROR OutOfMemoryError" in text
    assert "prefill 2048 best: triton 50.0 ms" in text
    assert "host speed" not in text  # a report from before the yardstick
    report["host_speed_us"] = 27.25
    assert "goal: control plane <= 2% at b64; host speed 27.2 us a calibration round" in bench.table(report)


def test_the_host_speed_yardstick_times_its_workload_by_the_clock_given() -> None:
    """atlas.calibrate.host_speed: the best round of its fixed workload, in microseconds of the clock it is given (a
    clock that moves 1 s a call: every round reads 1 s over its 200 iterations, 5,000 us)."""
    from atlas.calibrate import host_speed

    ticks = iter(range(10**6))
    assert host_speed(lambda: float(next(ticks)), rounds=3) == pytest.approx(1e6 / 200)
    assert 0 < host_speed(rounds=1) < 1e5  # real time: microseconds a round


def test_the_seeded_and_invariant_rows_print_against_greedy() -> None:
    report: dict = {"device": "fake", "ceilings": {"copy_gb_s": 4000.0, "bf16_tflop_s": 700.0}, "batches": [1, 16],
                    "seeded_b1": {"ms_per_step": 7.5, "vs_greedy": 1.07}, "seeded_b16": {"error": "OOM"},
                    "invariant_b1": {"ms_per_step": 8.0, "vs_greedy": 1.14}}
    text = bench.table(report)
    assert "decode seeded (goal <= x1.05 greedy): b1 7.50 ms x1.07, b16 ERROR OOM" in text
    assert "decode invariant (goal <= x1.02 greedy): b1 8.00 ms x1.14" in text


def test_seeded_decode_gives_every_request_its_own_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []

    def generate(engine: Any, prompts: list, params: list, progress: Any) -> None:
        seen.extend(params)
        progress(1, 1)

    monkeypatch.setattr("atlas.engine.offline.generate", generate)
    measure.run_steps(None, [[1], [2], [3]], max_tokens=4, seeded=True)
    assert [p.seed for p in seen] == [1000, 1001, 1002]
    assert all(p.temperature == 0.8 and p.top_p == 0.95 and p.ignore_eos for p in seen)
    seen.clear()
    measure.run_steps(None, [[1], [2]], max_tokens=4)
    assert all(p.temperature == 0.0 for p in seen)


def test_seeded_and_greedy_alternate_in_one_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_decode_pair: rounds of greedy then seeded through the one engine it builds, each mode's median over
    its own decode steps (prefill and capture steps left out), the ratio from those."""
    from types import SimpleNamespace

    timed = SimpleNamespace(calls=[])
    runs: list[bool] = []
    engines: list[object] = []

    def engine(*_a: Any, **_k: Any):  # one engine for the whole pair
        e = SimpleNamespace(close=lambda: None)
        engines.append(e)
        return e, timed

    def run_steps(engine: Any, prompts: list, max_tokens: int, seeded: bool = False) -> list[float]:
        runs.append(seeded)
        timed.calls.extend([(2, 20, 1.0)] + [(2, 2, 1.0)] * 10)  # a prefill, then ten decode steps
        return [99.0] + [5.0 if seeded else 4.0] * 10
    monkeypatch.setattr(measure, "timed_engine", engine)
    monkeypatch.setattr(measure, "run_steps", run_steps)
    model = SimpleNamespace(spec=SimpleNamespace(vocab_size=50))
    out = measure.bench_decode_pair(model, 2, prompt_len=4, steps=10, rounds=3)
    assert runs == [False, True] * 3 and len(engines) == 1
    assert out["greedy"]["ms_per_step"] == 4.0 and out["seeded"]["ms_per_step"] == 5.0
    assert out["seeded"]["steps_timed"] == 3 * 6 and out["vs_greedy"] == 1.25  # 4 decode steps skipped a round


@pytest.mark.parametrize(("tuning", "warm"), [(EAGER, 1), (Tuning(), 2)])
def test_the_prefill_median_leaves_out_the_compile_and_the_capture(monkeypatch: pytest.MonkeyPatch, tuning: Tuning,
                                                                    warm: int) -> None:
    """Under prefill_graphs a chunk shape's second feed is its capture (H200: 490 ms against 157 ms
    replays at 8,192 tokens): bench_prefill's median is of the runs after it, not a mean of capture and replay."""
    walls = iter([900.0, 490.0, 157.0, 150.0, 160.0, 158.0])

    class Timed:
        inner = attrs.make_class("Inner", {"prefill_moe": attrs.field(default="triton")})()
        calls: list = []

    class Engine:
        def close(self) -> None:
            pass

    model = attrs.make_class("Model", {"spec": attrs.field(default=attrs.make_class(
        "Spec", {"vocab_size": attrs.field(default=100)})())})()

    def run_steps(engine: Any, prompts: list, max_tokens: int) -> list[float]:
        wall = next(walls)
        Timed.calls.append((1, len(prompts[0]), wall - 1.0))
        return [wall]

    monkeypatch.setattr(measure, "timed_engine", lambda *a, **k: (Engine(), Timed()))
    monkeypatch.setattr(measure, "run_steps", run_steps)
    result = measure.bench_prefill(model, tokens=16, repeat=2, tuning=tuning)  # the long prefills' repeat
    assert result["warm"] == warm and result["runs"] == [900.0, 490.0, 157.0, 150.0][: 2 + warm]
    # eager: the second run is a plain one; under the knob the capture is left out with the compile
    assert result["ms"] == (323.5 if warm == 1 else 153.5)


def test_the_control_plane_is_taken_step_by_step_and_the_row_is_the_median_of_its_rounds() -> None:
    """decode_figures: every step's wall minus its own execute. Here the control plane is 0.1 ms in five of seven
    steps while execute swings by 2 ms from step to step; the difference of the two medians (the H200's figure,
    kept as control_plane_share_unpaired) reads it 4x too large, the paired one as it is."""
    first = [(5.0, 4.9), (5.1, 5.0), (5.3, 4.3), (5.4, 4.4)]  # two steps of 1 ms outside execute
    second = [(7.0, 6.9), (7.1, 7.0), (7.2, 7.1)]
    fig = measure.decode_figures(4, [first, second, [(6.0, 5.9)]])
    assert fig["rounds_ms"] == pytest.approx([5.2, 7.1, 6.0]) and fig["ms_per_step"] == 6.0  # the median round
    assert fig["steps_timed"] == 8 and fig["tokens_per_s"] == pytest.approx(4 / 6.0e-3)
    assert fig["control_plane_ms"] == pytest.approx(0.1)
    assert fig["control_plane_share"] == pytest.approx(0.1 / 6.0)
    # medians of all 8 steps: wall (5.4 + 6.0) / 2, execute (5.0 + 5.9) / 2 (of 4.3 4.4 4.9 5.0 5.9 6.9 7.0 7.1)
    unpaired = (5.7 - 5.45) / 5.7
    assert fig["control_plane_share_unpaired"] == pytest.approx(unpaired)
    assert unpaired > 2.5 * fig["control_plane_share"]
    with pytest.raises(ValueError, match="decode b4: no decode step was timed"):
        measure.decode_figures(4, [[], []])


def test_each_decode_round_builds_its_own_engine_and_skips_its_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    engines: list[object] = []
    per_round = iter([4.0, 6.0, 5.0])

    def engine(*_a: Any, **_k: Any):  # a fresh engine (and timer) a round
        e = SimpleNamespace(close=lambda: None, timed=SimpleNamespace(calls=[]))
        engines.append(e)
        return e, e.timed

    def run_steps(engine: Any, prompts: list, max_tokens: int, seeded: bool = False) -> list[float]:
        ms = next(per_round)
        engine.timed.calls.extend([(3, 30, 9.0)] + [(3, 3, ms - 0.2)] * 4 + [(3, 3, ms - 0.1)] * 6)
        return [10.0] + [50.0] * 4 + [ms] * 6  # a prefill, four captures, six timed steps
    monkeypatch.setattr(measure, "timed_engine", engine)
    monkeypatch.setattr(measure, "run_steps", run_steps)
    fig = measure.bench_decode(SimpleNamespace(spec=SimpleNamespace(vocab_size=50)), 3, steps=10, rounds=3)
    assert len(engines) == 3 and fig["rounds_ms"] == [4.0, 6.0, 5.0] and fig["ms_per_step"] == 5.0
    assert fig["steps_timed"] == 18 and fig["control_plane_ms"] == pytest.approx(0.1)


def test_the_decode_rounds_reach_every_variants_rows_and_the_summary(fakes: list, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    rounds: list[int] = []

    def decode(model: Any, batch: int, tuning: Tuning, rounds: int = 1, **_: Any) -> dict:
        rounds_seen.append(rounds)
        return {"batch": batch, "ms_per_step": 6.1, "tokens_per_s": 1.0, "control_plane_share": 0.02,
                "control_plane_ms": 0.122, "rounds_ms": [6.0, 6.1, 6.9][:rounds]}

    rounds_seen = rounds
    monkeypatch.setattr(measure, "bench_decode", decode)
    results = measure_variants(None, {"baseline": EAGER, "triton": attrs.evolve(EAGER, moe_kernels=True)}, batches=(1, 64),
                               prefill_tokens=2048, bw=4e12, rate=7e14, out=None, on_variant=lambda n, r: None,
                               decode_rounds=3)
    assert rounds == [3, 3, 3, 3]
    report: dict = {"device": "fake", "ceilings": {"copy_gb_s": 4000.0, "bf16_tflop_s": 700.0}, "batches": [64],
                    "variants": results, "decode_b64": {**results["triton"]["decode_b64"], "variant": "triton"}}
    assert ("decode best: b64 triton 6.10 ms (1 tok/s, rounds 6.00 / 6.10 / 6.90, control plane 2.0% = 122 us a step)"
            in bench.table(report))
    with pytest.raises(SystemExit):
        bench.main(["--decode-rounds", "0"])
