"""`atlas bench gpu`: the CUDA backend on the benchmark model, against its floors and transformers.

Measures, on one GPU, with random bf16 weights built on the device from a config.json (no checkpoint):
- the ceilings: device copy bandwidth (bytes read + written) and the bf16 matmul rate (8192^3);
- every Tuning variant (atlas.backends.cuda.tuning.VARIANTS) side by side, a failing one reported and skipped
  (atlas.bench_variants):
- prefill tokens/s of one 2048-token prompt through the engine, against FLOPs / matmul rate (and 8,192 and
  32,752 tokens on the fastest SDPA variant);
- decode ms/step and tokens/s at batch 1, 16 and 64 through the engine (CUDA graphs), against the bytes of
  weights a step must read / copy bandwidth, and the control plane's share of the step (engine time outside
  Backend.execute);
- profiles of an eager 2048-token prefill and batch-1 decode step (kernel count, device time by kernel);
- transformers (Qwen4ExpForCausalLM, same config, random bf16 weights, sdpa): prefill 2048 and decode at
  batch 1 and 16 (difference of two greedy generate() lengths).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the long prefills (the model's max_position_embeddings is 32,768: the prompt leaves room for the engine's margin)
LONG_PREFILL = (8192, 32752)
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen4exp-2p7b.json"


def _median_ms(fn: Callable[[], Any], repeat: int = 10) -> float:
    """Median wall time of fn() in ms, with the device synchronised around each call (one warm-up)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of fp32
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    return {"copy_gb_s": 2 * (1 << 31) / copy_ms / 1e6, "bf16_tflop_s": 2 * 8192**3 / mm_ms / 1e9}


def weight_bytes(model: Any, batch: int) -> float:
    """Bytes of weights one decode step of `batch` sequences must read: every dense tensor, the routed
    experts the batch touches (expected distinct experts under uniform routing), and only the looked-up rows
    of the token and n-gram embedding tables."""
    spec = model.spec
    total = 0.0
    for name, t in model.weights.items():
        size = t.numel() * t.element_size()
        if name == "embed_tokens.weight":
            total += batch * t.shape[1] * t.element_size()
        elif name.endswith("ngram_embedding.weight") and spec.ple is not None:
            total += batch * spec.ple.num_heads * t.shape[1] * t.element_size()
        elif ".experts." in name and spec.moe is not None:
            e, k = spec.moe.num_experts, spec.moe.top_k
            touched = e * (1 - (1 - k / e) ** batch)
            total += size * touched / e
        else:
            total += size
    return total


def state_bytes(model: Any, batch: int, context: int) -> float:
    """Bytes of per-sequence state a decode step reads and writes: GDN recurrent state (fp32, read + write),
    conv states, and the KV read of `context` positions."""
    spec = model.spec
    gdn = len(spec.gdn_layers) * spec.gdn_v_heads * spec.gdn_k_dim * spec.gdn_v_dim * 4 * 2
    kv = len(spec.attention_layers) * context * spec.num_kv_heads * spec.head_dim * 2 * 2
    return batch * (gdn + kv)


def prefill_flops(model: Any, tokens: int) -> float:
    """2 x active matmul parameters x tokens, plus causal attention (QK^T and PV) on the attention layers."""
    spec = model.spec
    active = 0.0
    for name, t in model.weights.items():
        if t.dim() < 2 or "embed" in name or "conv1d" in name:
            continue
        n = t.numel()
        if ".experts." in name and spec.moe is not None:
            n = n * spec.moe.top_k / spec.moe.num_experts
        active += n
    attn = len(spec.attention_layers) * 2 * 2 * spec.num_heads * spec.head_dim * tokens * tokens / 2
    return 2 * active * tokens + attn


class TimedBackend:
    """Delegates to a backend, timing each execute (host clock; execute ends with a device->host read)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int, float]] = []  # (rows, tokens, ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, plan: Any) -> Any:
        start = time.perf_counter()
        result = self.inner.execute(plan)
        self.calls.append((len(plan.work), sum(len(w.tokens) for w in plan.work),
                           (time.perf_counter() - start) * 1e3))
        return result


def _engine(model: Any, *, batch: int, max_seq_len: int, chunk: int, tuning: Any = None) -> tuple[Any, TimedBackend]:
    from atlas.config import EngineConfig
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine

    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=batch, prefill_chunk_tokens=max(chunk, batch))
    engine = build_engine(model.name, "cuda", config, sink=RecordingSink(), loaded=model,
                          backend_options={"tuning": tuning} if tuning is not None else None)
    timed = TimedBackend(engine.backend)
    engine.backend = timed
    return engine, timed


def _run_steps(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Generate; the wall time of every engine step in ms."""
    from atlas.engine.offline import generate
    from atlas.sampling.params import SamplingParams

    stamps = [time.perf_counter()]
    generate(engine, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
             progress=lambda done, total: stamps.append(time.perf_counter()))
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]


def bench_prefill(model: Any, tokens: int = 2048, repeat: int = 3, moe: str | None = None,
                  tuning: Any = None) -> dict[str, Any]:
    engine, timed = _engine(model, batch=1, max_seq_len=tokens + 16, chunk=tokens, tuning=tuning)
    if moe is not None:
        timed.inner.prefill_moe = moe
    moe = timed.inner.prefill_moe
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(repeat + 1):  # the first compiles the chunked-prefill kernel
        prompt = torch.randint(0, model.spec.vocab_size, (tokens,), generator=g).tolist()
        timed.calls.clear()
        walls = _run_steps(engine, [prompt], max_tokens=1)
        steps.append((walls[0], timed.calls[0][2]))
    engine.close()
    wall = statistics.median(s[0] for s in steps[1:])
    execute = statistics.median(s[1] for s in steps[1:])
    return {"tokens": tokens, "moe": moe, "ms": wall, "tokens_per_s": tokens / wall * 1e3, "execute_ms": execute}


def bench_decode(model: Any, batch: int, prompt_len: int = 140, steps: int = 40, tuning: Any = None
                 ) -> dict[str, float]:
    engine, timed = _engine(model, batch=batch, max_seq_len=prompt_len + steps + 16, chunk=4096, tuning=tuning)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, model.spec.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    walls = _run_steps(engine, prompts, max_tokens=steps)
    engine.close()
    # decode steps: every sequence fed one token; the first few capture the CUDA graphs
    decode = [(w, c[2]) for w, c in zip(walls, timed.calls, strict=False) if c[0] == batch and c[1] == batch][4:]
    wall = statistics.median(d[0] for d in decode)
    execute = statistics.median(d[1] for d in decode)
    return {"batch": batch, "ms_per_step": wall, "tokens_per_s": batch / wall * 1e3, "execute_ms": execute,
            "control_plane_share": (wall - execute) / wall, "steps_timed": len(decode)}


def profile_steps(model: Any, out: Path | None, tuning: Any = None, label: str = "") -> dict[str, Any]:
    """An eager 2048-token prefill and an eager batch-1 decode step under the profiler: device time by
    kernel (largest first), how many kernels ran, and the step's wall time, so a missed goal says where
    its time goes (launch-bound: many small kernels; or a few slow ones)."""
    from atlas.backends.cuda.runner import CudaBackend
    from atlas.plan import SeqWork, StepPlan

    device = next(iter(model.weights.values())).device
    backend = CudaBackend(model, num_kv_blocks=160, block_size=16, max_batch_size=1, cuda_graphs=False,
                          device=device, dtype=model.dtype, tuning=tuning)
    table = tuple(range(160))
    prompt = tuple(torch.randint(0, model.spec.vocab_size, (2048,)).tolist())
    steps = {"prefill_2048": SeqWork(0, prompt, 0, table, True), "decode_b1": SeqWork(0, (8,), 2048, table, True)}
    result: dict[str, Any] = {}
    for name, work in steps.items():
        if name == "prefill_2048":  # warm: kernel compiles and cuBLAS handles stay out of the profile
            backend.execute(StepPlan(step=0, work=(work,)))
            backend.reset(0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            backend.execute(StepPlan(step=1, work=(work,)))
            wall = (time.perf_counter() - start) * 1e3
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_kernel = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
        by_kernel.sort(key=lambda r: -r[1])
        result[name] = {"wall_ms": wall, "kernels": len(kernels),
                        "device_ms": sum(e.device_time_total for e in kernels) / 1e3, "top": by_kernel[:12]}
        if out is not None:
            (out / f"profile_{name}{label}.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    return result


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
    result: dict[str, Any] = {"transformers": tf.__version__}

    def gen(ids: torch.Tensor, new: int) -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    ids = torch.randint(0, cfg.vocab_size, (1, prefill_tokens), device=device)
    prefill_ms = _median_ms(lambda: gen(ids, 1), repeat=2)
    result["prefill"] = {"tokens": prefill_tokens, "ms": prefill_ms, "tokens_per_s": prefill_tokens / prefill_ms * 1e3}
    for batch in batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, 140), device=device)
        short = _median_ms(lambda ids=ids: gen(ids, 2), repeat=2)
        long = _median_ms(lambda ids=ids: gen(ids, 10), repeat=2)
        step = (long - short) / 8
        result[f"decode_b{batch}"] = {"ms_per_step": step, "tokens_per_s": batch / step * 1e3}
    return result


def run(config_path: Path = DEFAULT_CONFIG, *, out: Path | None = None, batches: tuple[int, ...] = (1, 16, 64),
        with_transformers: bool = True, variants: list[str] | None = None,
        long_prefill: tuple[int, ...] = LONG_PREFILL) -> dict:
    """Ceilings, then every Tuning variant side by side (atlas.bench_variants: a failing one is reported and
    skipped), the long prefills on the fastest variant whose attention is SDPA, then transformers."""
    from atlas.backends.cuda.random_model import random_model
    from atlas.backends.cuda.tuning import VARIANTS
    from atlas.bench_variants import best, guarded, measure_variants, variant_line

    if not torch.cuda.is_available():
        raise SystemExit("atlas bench gpu needs an NVIDIA GPU")
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    config = json.loads(Path(config_path).read_text())
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "config": str(config_path), "batches": list(batches)}

    def save() -> None:
        if out is not None:
            (out / "bench.json").write_text(json.dumps(report, indent=2, default=str))

    report["ceilings"] = ceilings()
    save()
    model = random_model(config, device="cuda", dtype=torch.bfloat16, seed=0)
    report["parameters"] = sum(t.numel() for t in model.weights.values())
    bw, rate = report["ceilings"]["copy_gb_s"] * 1e9, report["ceilings"]["bf16_tflop_s"] * 1e12

    def progress(name: str, row: dict) -> None:  # one line a variant as it lands: a timeout keeps the finished ones
        report.setdefault("variants", {})[name] = row
        print(variant_line(name, row), flush=True)
        save()

    report["variants"] = measure_variants(model, {n: VARIANTS[n] for n in names}, batches=batches,
                                          prefill_tokens=2048, bw=bw, rate=rate, out=out, on_variant=progress)
    winner = best(report["variants"], "prefill", "ms")
    if winner is not None:
        report["prefill"] = {**winner[1], "variant": winner[0]}
    for batch in batches:
        w = best(report["variants"], f"decode_b{batch}", "ms_per_step")
        if w is not None:
            report[f"decode_b{batch}"] = {**w[1], "variant": w[0]}
    save()
    sdpa = {n: r for n, r in report["variants"].items() if r["tuning"]["attention"] == "sdpa"}
    long_variant = best(sdpa, "prefill", "ms")
    if long_variant is not None:
        tuning = VARIANTS[long_variant[0]]
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
    del model
    torch.cuda.empty_cache()
    if with_transformers:
        try:
            report["transformers"] = bench_transformers(config)
        except Exception as exc:  # the comparison must not cost the run's own numbers
            report["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    return report


def table(report: dict) -> str:
    from atlas.bench_variants import variants_table

    c = report["ceilings"]
    batches = tuple(report.get("batches", (1, 16, 64)))
    lines = [f"device {report['device']}: copy {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['bf16_tflop_s']:.0f} TFLOP/s"]
    p = report.get("prefill")
    if p:
        lines.append(f"prefill 2048 best: {p['variant']} {p['ms']:.1f} ms, {p['tokens_per_s']:.0f} tok/s; floor "
                     f"{p['floor_ms']:.1f} ms; {100 * p['achieved_of_matmul_rate']:.1f}% of the matmul rate (goal 40%)")
    for key in sorted((k for k in report if k.startswith("prefill_")), key=lambda k: int(k[8:])):
        q = report[key]
        lines.append(f"prefill {key[8:]}: " + (f"ERROR {q['error']}" if "error" in q else
                     f"{q['variant']} {q['ms']:.1f} ms, {q['tokens_per_s']:.0f} tok/s, floor {q['floor_ms']:.1f} ms, "
                     f"{100 * q['achieved_of_matmul_rate']:.1f}% of the matmul rate"))
    floors = [report[f"decode_b{b}"] for b in batches if f"decode_b{b}" in report]
    lines.append("decode floors (weights / +state, ms): " + ", ".join(
        f"b{d['batch']} {d['floor_ms']:.3f} / {d['floor_with_state_ms']:.3f}" for d in floors)
        + "; goals b1 <= 1.1, b16 <= 2.3, b64 <= 3.0 ms")
    lines.append("decode best: " + ", ".join(
        f"b{d['batch']} {d['variant']} {d['ms_per_step']:.2f} ms ({d['tokens_per_s']:.0f} tok/s, control plane "
        f"{100 * d['control_plane_share']:.1f}%)" for d in floors))
    lines += variants_table(report.get("variants", {}), batches)
    t = report.get("transformers", {})
    if "prefill" in t:
        lines.append(f"transformers {t['transformers']}: prefill 2048 {t['prefill']['tokens_per_s']:.0f} tok/s; "
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

    parser = argparse.ArgumentParser(description="atlas bench gpu: every Tuning variant side by side")
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--variants", help="comma-separated Tuning variants (default: all)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--long-prefill", default=",".join(map(str, LONG_PREFILL)), help="'' skips them")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    report = run(out=args.out, batches=tuple(int(b) for b in args.batches.split(",")),
                 with_transformers=not args.no_transformers,
                 variants=args.variants.split(",") if args.variants else None,
                 long_prefill=tuple(int(t) for t in args.long_prefill.split(",") if t))
    print(table(report))


if __name__ == "__main__":
    main()
