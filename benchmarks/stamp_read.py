"""The host-side cost of the per-step stamp read (issue 13), on the CUDA backend's CPU path.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stamp_read.py [--batches 1,16,64] [--steps 24] [--device cuda]

Not a test: it prints figures. The model has the benchmark config's layer structure (benchmarks/configs/
qwen4exp-2p7b.json: 24 layers, 18 GDN + 6 QSA attention, 2 PLE layers, so 51 stamps a sequence) with every width
shrunk so that CPU decode steps are quick; the engine decodes `--steps` tokens after a 140-156-token prompt per
sequence (benchmarks/cuda_features.py runs 140 on the GPU). Every step's read runs both the fast read
(atlas.backends.cuda.stamp_read) and the reference it replaced (`CudaStateStore.read_cursors_reference`) on the
same state, checked equal, each timed: ms per call, and for the fast read its summary ops (on the GPU one graph
replay) apart from the rest (the host's own work: table deltas, the copy, building the cursors). CPU tensors, cuda-fp32,
no graphs: what is measured is the host's work (list building, op dispatch, the summary's Python), the part
a GPU cannot hide; the GPU figure is benchmarks/cuda_features.py's "stamp read" column.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

CLOCK = time.perf_counter  # --clock thread: this thread's CPU time (a loaded box moves the wall clock by 2x)
CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"
SHRINK = {  # the structure (layers, kinds, stamps) stays; the widths go
    "hidden_size": 64, "head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512,
    "ple_embed_dim": 32, "indexer_head_dim": 16, "indexer_n_heads": 2, "hc_lowrank": 16, "intermediate_size": 64,
    "ngram_vocab_size_base": 1000, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
}


def model(device: str = "cpu") -> Any:
    from atlas.backends.cuda.random_model import random_model

    config = {**json.loads(CONFIG.read_text()), **SHRINK}
    return random_model(config, device=device, dtype=torch.float32, seed=0)


def run(loaded: Any, batch: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    """One engine run; every step's read_cursors runs both reads on the same state (alternating which goes first,
    so a loaded machine's noise falls on both alike), checks they agree and times each."""
    from atlas.config import EngineConfig
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=160 + steps + 16, max_batch_size=batch, prefill_chunk_tokens=max(4096, batch))
    engine = build_engine(loaded.name, "cuda-fp32", config, loaded=loaded, sink=RecordingSink(),
                          backend_options={"device": device, "cuda_graphs": device == "cuda"})
    store = engine.backend.store
    fast, reference, inner = store.read_cursors, store.read_cursors_reference, store.reader._summary
    spent = {"fast": 0.0, "reference": 0.0, "summary": 0.0, "check": 0.0, "calls": 0, "seqs": 0}

    def summary(*args: Any, **kwargs: Any) -> torch.Tensor:  # the device part (on the GPU: one graph replay)
        t0 = CLOCK()
        out = inner(*args, **kwargs)
        spent["summary"] += CLOCK() - t0
        return out

    def both(seq_ids: Any) -> Any:
        got: dict[str, Any] = {}
        for name in (("fast", "reference") if spent["calls"] % 2 else ("reference", "fast")):
            t0 = CLOCK()
            got[name] = (fast if name == "fast" else reference)(seq_ids)
            spent[name] += CLOCK() - t0
        if got["fast"] != got["reference"]:
            raise SystemExit(f"the fast read disagrees with the reference at batch {batch}")
        spent["calls"] += 1
        spent["seqs"] += len(seq_ids)
        return got["fast"]

    import atlas.engine.engine as engine_module

    check = engine_module.cursor_violation

    def timed_check(*args: Any) -> Any:  # the engine's per-step comparison of every stamp with the control plane
        t0 = CLOCK()
        out = check(*args)
        spent["check"] += CLOCK() - t0
        return out

    early = store.prefetch

    def prefetch(seq_ids: Any) -> None:  # a plain step's read launched behind the forward: the fast read's too
        t0 = CLOCK()
        early(seq_ids)
        spent["fast"] += CLOCK() - t0

    store.reader._summary = summary
    store.read_cursors = both
    store.prefetch = prefetch
    engine_module.cursor_violation = timed_check  # type: ignore[assignment]
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):  # lengths 140 .. 156: the sequences sit at different positions
        prompt = torch.randint(0, loaded.spec.vocab_size, (140 + i % 17,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    engine.step()  # the prefill step (its read uploads every table)
    for key in spent:
        spent[key] = 0
    device0 = getattr(store.reader, "device_seconds", 0.0)  # (absent before the split was counted)
    while engine.has_unfinished():
        engine.step()
    engine.close()
    engine_module.cursor_violation = check  # type: ignore[assignment]
    calls = max(1, int(spent["calls"]))
    return {"batch": batch, "calls": calls, "stamps_per_seq": len(store.reader.kinds),
            "reference_ms_per_call": spent["reference"] * 1e3 / calls, "fast_ms_per_call": spent["fast"] * 1e3 / calls,
            "fast_host_ms_per_call": (spent["fast"] - spent["summary"]) * 1e3 / calls,
            "fast_summary_ms_per_call": spent["summary"] * 1e3 / calls, "check_ms_per_call": spent["check"] * 1e3 / calls,
            "fast_device_ms_per_call": (getattr(store.reader, "device_seconds", 0.0) - device0) * 1e3 / calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--device", default="cpu", help="cuda: the real graph read on a GPU (summary ops = 0 there; "
                        "'launch+copy+sync' is the replay, the copy and the wait, the rest the host's Python)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall clock (default) or this thread's CPU time (a loaded machine; the launch+copy+sync "
                        "column is the reader's own wall-clock counter either way)")
    parser.add_argument("--smoke", action="store_true", help="batch 2, 4 steps: the mechanics only (CI)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.smoke:
        args.batches, args.steps = "2", 4
    torch.set_num_threads(1)
    loaded = model(args.device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows.append(run(loaded, batch, args.steps, args.device))
        print(json.dumps(rows[-1]), flush=True)
    # launch+copy+sync: the reader's own wall-clock counter (on the CPU path the eager summary ops are inside it;
    # on a GPU the graph replay, the copy and the wait); the rest (host): fast minus summary ops, on --clock
    print("| batch | reference ms/call | fast ms/call | fast: summary ops | fast: launch+copy+sync (wall) | "
          "fast: the rest (host) | cursor_violation ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['reference_ms_per_call']:.3f} | {r['fast_ms_per_call']:.3f} | "
              f"{r['fast_summary_ms_per_call']:.3f} | {r['fast_device_ms_per_call']:.3f} | "
              f"{r['fast_host_ms_per_call']:.3f} | {r['check_ms_per_call']:.3f} |")


if __name__ == "__main__":
    main()
