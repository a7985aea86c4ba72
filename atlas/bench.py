"""`atlas bench gpu`: the CUDA backend on the benchmark model, against its floors and transformers.

Measures, on one GPU, with random bf16 weights built on the device from a config.json (no checkpoint):
- the ceilings: device copy bandwidth (bytes read + written) and the bf16 matmul rate (8192^3);
- prefill tokens/s of one 2048-token prompt through the engine, against FLOPs / matmul rate;
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


def _engine(model: Any, *, batch: int, max_seq_len: int, chunk: int) -> tuple[Any, TimedBackend]:
    from atlas.config import EngineConfig
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine

    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=batch, prefill_chunk_tokens=max(chunk, batch))
    engine = build_engine(model.name, "cuda", config, sink=RecordingSink(), loaded=model)
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


def bench_prefill(model: Any, tokens: int = 2048, repeat: int = 3, moe: str = "grouped") -> dict[str, Any]:
    engine, timed = _engine(model, batch=1, max_seq_len=tokens + 16, chunk=tokens)
    timed.inner.prefill_moe = moe
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


def bench_decode(model: Any, batch: int, prompt_len: int = 140, steps: int = 40) -> dict[str, float]:
    engine, timed = _engine(model, batch=batch, max_seq_len=prompt_len + steps + 16, chunk=4096)
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


def profile_steps(model: Any, out: Path | None) -> dict[str, Any]:
    """An eager 2048-token prefill and an eager batch-1 decode step under the profiler: device time by
    kernel (largest first), how many kernels ran, and the step's wall time, so a missed goal says where
    its time goes (launch-bound: many small kernels; or a few slow ones)."""
    from atlas.backends.cuda.runner import CudaBackend
    from atlas.plan import SeqWork, StepPlan

    device = next(iter(model.weights.values())).device
    backend = CudaBackend(model, num_kv_blocks=160, block_size=16, max_batch_size=1, cuda_graphs=False,
                          device=device, dtype=model.dtype)
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
            (out / f"profile_{name}.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
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
        with_transformers: bool = True) -> dict:
    from atlas.backends.cuda.random_model import random_model

    if not torch.cuda.is_available():
        raise SystemExit("atlas bench gpu needs an NVIDIA GPU")
    config = json.loads(Path(config_path).read_text())
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "config": str(config_path)}

    def save() -> None:
        if out is not None:
            (out / "bench.json").write_text(json.dumps(report, indent=2))

    report["ceilings"] = ceilings()
    save()
    model = random_model(config, device="cuda", dtype=torch.bfloat16, seed=0)
    report["parameters"] = sum(t.numel() for t in model.weights.values())
    bw, rate = report["ceilings"]["copy_gb_s"] * 1e9, report["ceilings"]["bf16_tflop_s"] * 1e12
    flops = prefill_flops(model, 2048)
    variants = [bench_prefill(model, moe=moe) for moe in ("grouped", "dense")]
    for v in variants:
        v.update(flops=flops, floor_ms=flops / rate * 1e3, achieved_of_matmul_rate=flops / (v["ms"] / 1e3) / rate)
    report["prefill"] = min(variants, key=lambda v: v["ms"])
    report["prefill_variants"] = variants
    save()
    for batch in batches:
        d = bench_decode(model, batch)
        d["weight_bytes"] = weight_bytes(model, batch)
        d["floor_ms"] = d["weight_bytes"] / bw * 1e3
        d["floor_with_state_ms"] = (d["weight_bytes"] + state_bytes(model, batch, 180)) / bw * 1e3
        d["over_floor"] = d["ms_per_step"] / d["floor_ms"]
        report[f"decode_b{batch}"] = d
        save()
    report["profile"] = profile_steps(model, out)
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
    c = report["ceilings"]
    p = report["prefill"]
    lines = [f"device {report['device']}: copy {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['bf16_tflop_s']:.0f} TFLOP/s",
             f"prefill 2048: {p['ms']:.1f} ms, {p['tokens_per_s']:.0f} tok/s (MoE {p['moe']}); floor "
             f"{p['floor_ms']:.1f} ms; {100 * p['achieved_of_matmul_rate']:.1f}% of the matmul rate; variants: "
             + ", ".join(f"{v['moe']} {v['ms']:.1f} ms" for v in report.get("prefill_variants", [])),
             "| batch | ms/step | tok/s | floor ms (weights) | x floor | floor ms (+state) | control plane |",
             "|---|---|---|---|---|---|---|"]
    for key in sorted((k for k in report if k.startswith("decode_b")), key=lambda k: int(k[8:])):
        d = report[key]
        lines.append(f"| {d['batch']} | {d['ms_per_step']:.2f} | {d['tokens_per_s']:.0f} | {d['floor_ms']:.3f} | "
                     f"{d['over_floor']:.1f} | {d['floor_with_state_ms']:.3f} | {100 * d['control_plane_share']:.1f}% |")
    t = report.get("transformers", {})
    if "prefill" in t:
        lines.append(f"transformers {t['transformers']}: prefill 2048 {t['prefill']['tokens_per_s']:.0f} tok/s; "
                     + "; ".join(f"decode b{k[8:]} {v['ms_per_step']:.1f} ms/step ({v['tokens_per_s']:.0f} tok/s)"
                                 for k, v in t.items() if k.startswith("decode_b")))
    elif t:
        lines.append(f"transformers: {t}")
    for name, prof in report.get("profile", {}).items():
        lines.append(f"profile {name} (eager): wall {prof['wall_ms']:.1f} ms, {prof['kernels']} kernels, device "
                     f"{prof['device_ms']:.1f} ms; top: " + ", ".join(f"{k[:32]} {ms:.2f}" for k, ms in prof["top"][:5]))
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    print(table(run(out=target)))
