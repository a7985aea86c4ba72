"""The write-ahead trace's cost per step: decode steps with no trace, with the commit inline (the engine thread
commits each step before the next), and with the commit on the writer thread while the next step computes (the
server's default, `EngineLoop(commit="thread")`: one commit outstanding at most).

    .venv/bin/python benchmarks/server_trace.py                         # atlas-tiny on the CPU backend
    .venv/bin/python benchmarks/server_trace.py --backend null          # the control plane alone
    python3 benchmarks/server_trace.py --backend cuda --batches 1,16,64 # GPU: qwen4exp-2p7b, random bf16 weights

Prints, per batch: median decode step ms for each mode (modes interleaved over --rounds rounds, the median of
the rounds' medians, so a loaded machine's drift hits them alike), the commit's own time per step (mean, p50,
p99, us, timed around TraceWriter.commit in the inline mode; the p99 is SQLite's WAL checkpoint, which fsyncs),
and each mode's overhead over no trace. On the GPU machine (the project travels as wheels):

    TESTS=0 BENCH=0 bash benchmarks/gpu_run.sh; PYTHONPATH=/tmp/site:$PWD python3 benchmarks/server_trace.py \
        --backend cuda --batches 1,16,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class Builder:
    def __init__(self, backend: str, model: str | None, device: str) -> None:
        self.backend = backend
        self.model = model
        self.device = device
        self.loaded: Any = None
        if backend.startswith("cuda"):
            import torch

            from atlas.backends.cuda.random_model import random_model
            from atlas.model.tiny import TINY_CONFIG

            config = TINY_CONFIG if model == "atlas-tiny" else json.loads(Path(model or CONFIG).read_text())
            dtype = torch.float32 if "fp32" in backend or device == "cpu" else torch.bfloat16
            self.loaded = random_model(config, device=device, dtype=dtype, seed=0)

    def engine(self, batch: int, max_seq_len: int, trace: Path | None) -> Engine:
        config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=batch, prefill_chunk_tokens=max(4096, batch))
        if self.loaded is not None:
            return build_engine(self.loaded.name, self.backend, config, trace=None if trace is None else str(trace),
                                loaded=self.loaded, backend_options={"device": self.device,
                                                                     "cuda_graphs": None if self.device == "cuda"
                                                                     else False})
        return build_engine(self.model or "atlas-tiny", self.backend,  # type: ignore[arg-type]
                                 config=config, trace=None if trace is None else str(trace))

    def vocab(self, engine: Engine) -> int:
        return min(int(engine.vocab_size or 256), 250)


def run_mode(builder: Builder, mode: str, batch: int, steps: int, prompt_len: int, warmup: int,
             tmp: Path) -> dict[str, Any]:
    trace = None if mode == "none" else tmp / f"{mode}-{batch}.db"
    engine = builder.engine(batch, prompt_len + steps + warmup + 8, trace)
    vocab = builder.vocab(engine)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % vocab for j in range(prompt_len)],
                           SamplingParams(max_tokens=steps + warmup + 4, ignore_eos=True))
    sink = engine.trace_sink
    slot = threading.Semaphore(1)
    commits: list[float] = []

    def one_step() -> None:
        engine.step()
        if mode == "inline":
            started = time.perf_counter()
            sink.commit()  # type: ignore[union-attr]
            commits.append(time.perf_counter() - started)
        elif mode == "thread":
            slot.acquire()
            sink.commit_async(lambda _error: slot.release())  # type: ignore[union-attr]

    while any(not s.cursor.decoding for s in engine.state.seqs.values()):  # prefill, untimed
        one_step()
    for _ in range(warmup):  # CUDA graph captures, caches
        one_step()
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        one_step()
        walls.append(time.perf_counter() - started)
    if sink is not None:
        sink.commit()  # type: ignore[union-attr]
    events = getattr(sink, "events_written", 0)
    engine.close()
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(walls), "events_per_step": events / max(1, steps)}
    if commits:
        us = [1e6 * c for c in commits[-steps:]]
        out.update(commit_us_mean=statistics.fmean(us), commit_us_p50=_pct(us, 50), commit_us_p99=_pct(us, 99))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cpu", help="null | cpu | cuda")
    parser.add_argument("--model", default=None,
                        help="cpu/null: checkpoint dir; cuda: a config.json (default qwen4exp-2p7b) or atlas-tiny")
    parser.add_argument("--device", default="cuda", help="cuda backends: the device (cpu: a smoke run)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=None, help="untimed decode steps (default: 8 cuda, 2 else)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three modes")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run (CI): null backend, batch 1/4")
    args = parser.parse_args()
    if args.smoke:
        args.backend, args.batches, args.steps, args.rounds = "null", "1,4", 10, 1
    import torch

    torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (8 if args.backend.startswith("cuda") else 2)
    builder = Builder(args.backend, args.model, args.device)
    print(f"backend {args.backend}, {args.steps} timed decode steps after {warmup} warm-up ones, prompts of "
          f"{args.prompt_len} tokens; commit = TraceWriter.commit (SQLite WAL, synchronous=NORMAL)")
    print(f"{'batch':>5} {'events/step':>11} {'none ms':>8} {'inline ms':>9} {'thread ms':>9} "
          f"{'commit us mean/p50/p99':>24} {'inline +%':>9} {'thread +%':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in (int(b) for b in args.batches.split(",")):
            rounds = [{mode: run_mode(builder, mode, batch, args.steps, args.prompt_len, warmup, Path(tmp))
                       for mode in ("none", "inline", "thread")} for _ in range(args.rounds)]
            r = {mode: {key: statistics.median(rd[mode][key] for rd in rounds) for key in rounds[0][mode]}
                 for mode in rounds[0]}
            base = r["none"]["step_ms"]
            c = r["inline"]
            print(f"{batch:>5} {c['events_per_step']:>11.1f} {base:>8.3f} {c['step_ms']:>9.3f} "
                  f"{r['thread']['step_ms']:>9.3f} "
                  f"{c['commit_us_mean']:>9.0f}/{c['commit_us_p50']:.0f}/{c['commit_us_p99']:.0f}".ljust(70)
                  + f" {100 * (c['step_ms'] / base - 1):>+8.1f}% {100 * (r['thread']['step_ms'] / base - 1):>+8.1f}%")


if __name__ == "__main__":
    main()
