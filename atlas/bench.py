"""`atlas bench gpu`: the CUDA backend on the benchmark model, against its floors and transformers.

Measures, on one GPU, with random bf16 weights built on the device from a config.json (no checkpoint):
- the ceilings: device copy bandwidth (bytes read + written) and the bf16 matmul rate (8192^3);
- the default arrangement (`Tuning()`), or the named ones asked for (`--variants default,eager`:
  atlas.backends.cuda.tuning.TUNINGS) side by side, a failing one reported and skipped
  (atlas.bench_variants):
- prefill tokens/s of one 2048-token prompt through the engine, against FLOPs / matmul rate (and 8,192 and
  32,752 tokens on the fastest variant);
- decode ms/step and tokens/s at batch 1, 16 and 64 through the engine (CUDA graphs), against the bytes of
  weights a step must read / copy bandwidth, and the control plane's share of the step (engine time outside
  Backend.execute);
- profiles of a 2048-token prefill, a batch-1 decode step and a batch-1 verify of 3 rows (kernel count, device
  time by kernel);
- transformers (Qwen4ExpForCausalLM, same config, random bf16 weights, sdpa, its GDN layers through
  flash-linear-attention's kernels where fla is installed): prefill 2048 and decode at batch 1 and 16
  (difference of two greedy generate() lengths).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from atlas.bench_measure import (  # noqa: F401  (re-exported: the measurements the report is built from)
    TimedBackend,
    bench_decode,
    bench_decode_pair,
    bench_prefill,
    ceilings,
    median_ms,
    prefill_flops,
    profile_steps,
    run_steps,
    state_bytes,
    weight_bytes,
)
from atlas.calibrate import host_speed

# the long prefills (the model's max_position_embeddings is 32,768: the prompt leaves room for the engine's margin)
LONG_PREFILL = (8192, 32752)
# decode rows beside greedy: seeded sampling (goal within 5% of greedy) and `cuda-invariant` (within 2%)
MODES = ("seeded", "invariant")
# each variant's decode row: the median of this many engines' rounds (one decode code read b64 6.23 and
# 7.01 ms, control plane 2.5% and 5.9%, in two runs of one round each)
DECODE_ROUNDS = 3
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen4exp-2p7b.json"


def bench_transformers(config: dict, *, prefill_tokens: int = 2048, batches: tuple[int, ...] = (1, 16),
                       device: str = "cuda") -> dict:
    import transformers as tf

    cfg = tf.Qwen4ExpTextConfig(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = tf.Qwen4ExpForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(previous)
    result: dict[str, Any] = {"transformers": tf.__version__, "fla": _fla_version()}

    def gen(ids: torch.Tensor, new: int) -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    ids = torch.randint(0, cfg.vocab_size, (1, prefill_tokens), device=device)
    prefill_ms = median_ms(lambda: gen(ids, 1), repeat=2)
    result["prefill"] = {"tokens": prefill_tokens, "ms": prefill_ms, "tokens_per_s": prefill_tokens / prefill_ms * 1e3}
    for batch in batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, 140), device=device)
        short = median_ms(lambda ids=ids: gen(ids, 2), repeat=2)
        long = median_ms(lambda ids=ids: gen(ids, 10), repeat=2)
        step = (long - short) / 8
        result[f"decode_b{batch}"] = {"ms_per_step": step, "tokens_per_s": batch / step * 1e3}
    return result


def _fla_version() -> str | None:
    """flash-linear-attention's version where it is importable (transformers then runs the GDN layers through its
    chunk and recurrent kernels), else None (transformers' torch fallback)."""
    try:
        import fla  # type: ignore[import-not-found]
    except Exception:
        return None
    return str(getattr(fla, "__version__", "unknown"))


def variant_tunings() -> dict[str, Any]:
    """The arrangements `--variants` may name (atlas.backends.cuda.tuning.TUNINGS)."""
    from atlas.backends.cuda.tuning import TUNINGS

    return dict(TUNINGS)


def run(config_path: Path = DEFAULT_CONFIG, *, out: Path | None = None, batches: tuple[int, ...] = (1, 16, 64),
        with_transformers: bool = True, variants: list[str] | None = None,
        long_prefill: tuple[int, ...] = LONG_PREFILL, modes: tuple[str, ...] = MODES,
        decode_rounds: int = DECODE_ROUNDS) -> dict:
    """Ceilings, then the default arrangement (or the `variants` named, side by side: atlas.bench_variants, a failing
    one reported and skipped), the long prefills on the fastest variant, then transformers."""
    from atlas.backends.cuda.random_model import random_model
    from atlas.bench_variants import best, guarded, measure_variants, profile_variants, variant_line

    if not torch.cuda.is_available():
        raise SystemExit("atlas bench gpu needs an NVIDIA GPU")
    VARIANTS = variant_tunings()
    names = variants or ["default"]
    # "name@2": the variant measured again under that label, later in the run (an order control: engines built one
    # after another in one process have differed by 1 ms of a 28 ms prefill on the H200)
    unknown = [n for n in names if n.split("@")[0] not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    config = json.loads(Path(config_path).read_text())
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "config": str(config_path), "batches": list(batches), "decode_rounds": decode_rounds}

    def save() -> None:
        if out is not None:
            (out / "bench.json").write_text(json.dumps(report, indent=2, default=str))

    report["ceilings"] = ceilings()
    report["host_speed_us"] = host_speed()  # this host's Python speed: a control-plane figure's yardstick
    save()
    model = random_model(config, device="cuda", dtype=torch.bfloat16, seed=0)
    report["parameters"] = sum(t.numel() for t in model.weights.values())
    m_model = model
    bw, rate = report["ceilings"]["copy_gb_s"] * 1e9, report["ceilings"]["bf16_tflop_s"] * 1e12

    def progress(name: str, row: dict) -> None:  # one line a variant as it lands: a timeout keeps the finished ones
        report.setdefault("variants", {})[name] = row
        print(variant_line(name, row), flush=True)
        save()

    report["variants"] = measure_variants(model, {n: VARIANTS[n.split("@")[0]] for n in names}, batches=batches,
                                          prefill_tokens=2048, bw=bw, rate=rate, out=out, on_variant=progress,
                                          profile=False, decode_rounds=decode_rounds)
    winner = best(report["variants"], "prefill", "ms")
    if winner is not None:
        report["prefill"] = {**winner[1], "variant": winner[0]}
    for batch in batches:
        w = best(report["variants"], f"decode_b{batch}", "ms_per_step")
        if w is not None:
            report[f"decode_b{batch}"] = {**w[1], "variant": w[0]}
    save()
    # the issue-15 rows beside greedy, on each batch's fastest variant: seeded sampling (keyed draws on the device)
    # (greedy and seeded alternated in one engine) and the batch-invariant mode (its own backend: against greedy runs
    # of the same variant timed right before and after it); two timings of one arrangement in one process moved by
    # up to 10% on the H200, so a ratio against the greedy row timed minutes earlier measures drift as much as mode
    for batch in batches if modes else ():
        fastest = report.get(f"decode_b{batch}")
        if fastest is None:
            continue
        tuning = VARIANTS[fastest["variant"].split("@")[0]]
        if "seeded" in modes:  # greedy and seeded alternated through one engine
            pair = guarded(lambda b=batch, t=tuning: bench_decode_pair(m_model, b, tuning=t))
            d = pair if "error" in pair else {**pair["seeded"], "variant": fastest["variant"],
                                              "greedy_ms": pair["greedy"]["ms_per_step"],
                                              "vs_greedy": pair["vs_greedy"], "one_engine": True}
            report[f"seeded_b{batch}"] = d
            print(f"decode seeded b{batch} ({fastest['variant']}): " + (d["error"] if "error" in d else
                  f"{d['ms_per_step']:.2f} ms/step, x{d['vs_greedy']:.2f} greedy ({d['greedy_ms']:.2f} ms, "
                  f"alternated in one engine, 3 rounds)"), flush=True)
            save()
        others = [m for m in modes if m != "seeded"]
        greedy = [guarded(lambda b=batch, t=tuning: bench_decode(m_model, b, tuning=t))] if others else []
        for mode in others:
            backend = "cuda-invariant" if mode == "invariant" else "cuda"
            d = guarded(lambda b=batch, t=tuning, be=backend, m=mode: bench_decode(
                m_model, b, tuning=t, backend=be, seeded=m == "seeded"))
            greedy.append(guarded(lambda b=batch, t=tuning: bench_decode(m_model, b, tuning=t)))
            around = [g["ms_per_step"] for g in greedy[-2:] if "error" not in g]
            if "error" not in d and around:
                ms = sum(around) / len(around)
                d.update(variant=fastest["variant"], greedy_ms=ms, greedy_around_ms=around,
                         vs_greedy=d["ms_per_step"] / ms)
            elif "error" not in d:
                d = {"error": f"no greedy run beside it: {greedy[-1].get('error')}"}
            report[f"{mode}_b{batch}"] = d
            print(f"decode {mode} b{batch} ({fastest['variant']}): " + (d["error"] if "error" in d else
                  f"{d['ms_per_step']:.2f} ms/step, x{d['vs_greedy']:.2f} greedy (greedy before / after "
                  f"{' / '.join(f'{a:.2f}' for a in d['greedy_around_ms'])} ms)"), flush=True)
            save()
    # the eager reference's materialised scores cannot hold 32,752 tokens: its long prefills are not run
    fast = {n: r for n, r in report["variants"].items() if r["tuning"]["attention_kernels"]}
    long_variant = best(fast, "prefill", "ms")
    if long_variant is not None:
        tuning = VARIANTS[long_variant[0].split("@")[0]]
        for tokens in long_prefill:
            p = guarded(lambda tokens=tokens, m=model, t=tuning: bench_prefill(m, tokens, repeat=2, tuning=t))
            if "error" not in p:
                flops = prefill_flops(model, tokens)
                p.update(variant=long_variant[0], flops=flops, floor_ms=flops / rate * 1e3,
                         achieved_of_matmul_rate=flops / (p["ms"] / 1e3) / rate)
            report[f"prefill_{tokens}"] = p
            print(f"prefill {tokens} ({long_variant[0]}): " + (p["error"] if "error" in p else
                  f"{p['ms']:.1f} ms, {100 * p['achieved_of_matmul_rate']:.1f}% of the matmul rate"), flush=True)
            save()
    if with_transformers:
        try:
            report["transformers"] = bench_transformers(config)
        except Exception as exc:  # the comparison must not cost the run's own numbers
            report["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    # the profiles last: a torch.profiler session slowed every decode timed after it in the same process by
    # 10-25% (H200: seeded x1.26-1.29 greedy measured after the profile, x1.04 in a process without one)
    profile_variants(model, report["variants"], out)
    for name, row in report["variants"].items():  # the rows again, now with their kernel counts
        print(variant_line(name, row), flush=True)
    save()
    del model
    torch.cuda.empty_cache()
    return report


def table(report: dict) -> str:
    from atlas.bench_variants import variants_table

    c = report["ceilings"]
    batches = tuple(report.get("batches", (1, 16, 64)))
    lines = [f"device {report['device']}: copy {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['bf16_tflop_s']:.0f} TFLOP/s"]
    p = report.get("prefill")
    if p:
        lines.append(f"prefill 2048 best: {p['variant']} {p['ms']:.1f} ms, {p['tokens_per_s']:.0f} tok/s; floor "
                     f"{p['floor_ms']:.1f} ms; {100 * p['achieved_of_matmul_rate']:.1f}% of the matmul rate (goal 45%)")
    for key in sorted((k for k in report if k.startswith("prefill_")), key=lambda k: int(k[8:])):
        q = report[key]
        lines.append(f"prefill {key[8:]}: " + (f"ERROR {q['error']}" if "error" in q else
                     f"{q['variant']} {q['ms']:.1f} ms, {q['tokens_per_s']:.0f} tok/s, floor {q['floor_ms']:.1f} ms, "
                     f"{100 * q['achieved_of_matmul_rate']:.1f}% of the matmul rate"))
    floors = [report[f"decode_b{b}"] for b in batches if f"decode_b{b}" in report]
    lines.append("decode floors (weights / +state, ms): " + ", ".join(
        f"b{d['batch']} {d['floor_ms']:.3f} / {d['floor_with_state_ms']:.3f}" for d in floors)
        + "; goals b1 <= 1.3x, b16 <= 1.8x the weights' floor, b64 <= 1.3x the floor with state")
    lines.append("decode best: " + ", ".join(
        f"b{d['batch']} {d['variant']} {d['ms_per_step']:.2f} ms ({d['tokens_per_s']:.0f} tok/s, "
        + (f"rounds {' / '.join(f'{r:.2f}' for r in d['rounds_ms'])}, " if len(d.get("rounds_ms", ())) > 1 else "")
        + f"control plane {100 * d['control_plane_share']:.1f}%"
        + (f" = {1e3 * d['control_plane_ms']:.0f} us a step" if "control_plane_ms" in d else "") + ")"
        for d in floors) + "; goal: control plane <= 2% at b64"
        + (f"; host speed {report['host_speed_us']:.1f} us a calibration round (the 2-core dev box: ~9)"
           if "host_speed_us" in report else ""))
    lines += variants_table(report.get("variants", {}), batches)
    for mode, goal in (("seeded", 1.05), ("invariant", 1.02)):
        rows = {b: report[f"{mode}_b{b}"] for b in batches if f"{mode}_b{b}" in report}
        if rows:
            lines.append(f"decode {mode} (goal <= x{goal:.2f} greedy): " + ", ".join(
                f"b{b} ERROR {r['error']}" if "error" in r else f"b{b} {r['ms_per_step']:.2f} ms x{r['vs_greedy']:.2f}"
                for b, r in rows.items()))
    t = report.get("transformers", {})
    if "prefill" in t:
        lines.append(f"transformers {t['transformers']} (flash-linear-attention {t.get('fla') or 'not installed'}): "
                     f"prefill 2048 {t['prefill']['tokens_per_s']:.0f} tok/s; "
                     + "; ".join(f"decode b{k[8:]} {v['ms_per_step']:.1f} ms/step ({v['tokens_per_s']:.0f} tok/s)"
                                 for k, v in t.items() if k.startswith("decode_b")))
    elif t:
        lines.append(f"transformers: {t}")
    for name, row in report.get("variants", {}).items():
        for step, prof in row.get("profile", {}).items():
            if isinstance(prof, dict) and "top" in prof and "same_as" not in row.get("decode_b1", {}):
                lines.append(f"profile {name} {step} (eager): wall {prof['wall_ms']:.1f} ms, {prof['kernels']} "
                             f"kernels, device {prof['device_ms']:.1f} ms; top: "
                             + ", ".join(f"{k[:32]} {ms:.2f}" for k, ms in prof["top"][:5]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="atlas bench gpu: the CUDA backend's default arrangement against its "
                                     "floors and transformers")
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--variants", help="comma-separated arrangements side by side (default: default; "
                        f"choose from {', '.join(variant_tunings())}); name@2 measures one again")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--long-prefill", default=",".join(map(str, LONG_PREFILL)), help="'' skips them")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--decode-rounds", type=int, default=DECODE_ROUNDS,
                        help="engines each variant's decode row is the median of (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="decode rows beside greedy on each batch's fastest variant ('' skips them)")
    args = parser.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m and m not in MODES]
    if bad:
        parser.error(f"--modes {','.join(bad)}: choose from {', '.join(MODES)}")
    if args.decode_rounds < 1:
        parser.error(f"--decode-rounds {args.decode_rounds}: at least 1")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    report = run(out=args.out, batches=tuple(int(b) for b in args.batches.split(",")),
                 with_transformers=not args.no_transformers,
                 variants=args.variants.split(",") if args.variants else None,
                 long_prefill=tuple(int(t) for t in args.long_prefill.split(",") if t),
                 modes=tuple(m for m in args.modes.split(",") if m), decode_rounds=args.decode_rounds)
    print(table(report))


if __name__ == "__main__":
    main()
