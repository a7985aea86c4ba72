"""Where a decode step's host time goes on the GPU (issue 15: the b64 step is ~10.3 ms of which ~6.8 ms is kernels).

    python3 benchmarks/host_profile.py [--variant default] [--batches 1,64] [--steps 24] [--out DIR]

Not a test: it prints figures. Builds the benchmark model (benchmarks/configs/qwen4exp-2p7b.json, random bf16 weights)
on the GPU, decodes greedily through the engine, and after the warm-up steps (graph captures, compiles) runs
`--steps` decode steps under cProfile. Printed per batch: ms per step (wall), the backend's execute and the engine
outside it (the control plane), the time spent waiting on the device (cudaStreamSynchronize / .tolist / .item
under `execute`: the part the host cannot hide unless it overlaps), and the top functions by own time and by
cumulative time, so a host-bound share is named function by function. The whole pstats tables go to
DIR/host_profile_b{n}.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "benchmarks" / "configs" / "qwen4exp-2p7b.json"

# names of calls that wait on the device (the host blocks until the queued kernels are done)
WAITS = ("synchronize", "tolist", "item", "cpu", "numpy")


def run(model: Any, variant: str, batch: int, steps: int, warm: int, out: Path | None,
        smoke: bool = False, seeded: bool = False) -> dict[str, Any]:
    from atlas.backends.cuda.tuning import TUNINGS as VARIANTS
    from atlas.bench_measure import TimedBackend
    from atlas.config import EngineConfig
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=140 + warm + steps + 32, max_batch_size=batch, prefill_chunk_tokens=4096)
    options = {"device": "cpu", "cuda_graphs": False} if smoke else {"tuning": VARIANTS[variant]}
    engine = build_engine(model.name, "cuda-fp32" if smoke else "cuda", config, sink=RecordingSink(), loaded=model,
                          backend_options=options)
    timed = engine.backend = TimedBackend(engine.backend)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, model.spec.vocab_size, (140,), generator=g).tolist()
        sampling = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if seeded else {}  # atlas.bench_measure.SEEDED
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=warm + steps + 8, ignore_eos=True, **sampling))
    for _ in range(1 + warm):  # the prefill, then the captures and compiles
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timed.calls.clear()
    walls = []
    prof = cProfile.Profile()
    for _ in range(steps):
        start = time.perf_counter()
        prof.enable()
        engine.step()
        prof.disable()
        walls.append((time.perf_counter() - start) * 1e3)
    # the same steps again without the profiler: the profiler's own overhead inflates the host side
    plain, executes = [], []
    for _ in range(min(steps, 6)):
        timed.calls.clear()
        start = time.perf_counter()
        engine.step()
        plain.append((time.perf_counter() - start) * 1e3)
        executes.append(timed.calls[-1][2] if timed.calls else float("nan"))
    engine.close()
    stats = pstats.Stats(prof)
    waits = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.stats.items()  # type: ignore[attr-defined]
                if any(w in name for w in WAITS) and ("built-in" in file or file == "~"))
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    # one level down from the backend's step and the stamp read's launch (prefetch shows 1.9 ms a
    # profiled b64 step of cumulative time its listed children did not account for)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_callees(r"\((execute|prefetch|_last_logits)\)")
    if out is not None:
        (out / f"host_profile_{variant}_b{batch}{'_seeded' if seeded else ''}.txt").write_text(text.getvalue())
    own = io.StringIO()
    pstats.Stats(prof, stream=own).sort_stats("tottime").print_stats(22)
    row = {"variant": variant, "batch": batch, "seeded": seeded, "ms_per_step": statistics.median(plain),
           "execute_ms": statistics.median(executes),
           "profiled_ms_per_step": statistics.median(walls),
           "device_wait_ms_per_step_profiled": waits * 1e3 / steps}
    row["control_plane_ms"] = row["ms_per_step"] - row["execute_ms"]
    print(json.dumps(row), flush=True)
    print(own.getvalue().split("Ordered by")[-1], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="default")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warm", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seeded", action="store_true", help="temperature 0.8, top_p 0.95, a seed per request")
    parser.add_argument("--smoke", action="store_true", help="the mechanics on the CPU: a shrunk model, eager")
    args = parser.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from stamp_read import model as shrunk

        torch.set_num_threads(1)
        model = shrunk("cpu")
        args.variant, args.steps, args.warm, args.batches = "eager", 3, 1, "2"
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/host_profile.py needs an NVIDIA GPU")
    else:
        from atlas.backends.cuda.random_model import random_model

        model = random_model(json.loads(CONFIG.read_text()), device="cuda", dtype=torch.bfloat16, seed=0)
    for variant in args.variant.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            run(model, variant, batch, args.steps, args.warm, args.out, args.smoke, args.seeded)


if __name__ == "__main__":
    main()
