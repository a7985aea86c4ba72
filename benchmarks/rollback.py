"""The SSM snapshot ring: its memory per sequence, and what a rollback costs on the CPU backend.

    .venv/bin/python benchmarks/rollback.py [--slots 4] [--interval 64] [--reps 50] [--smoke]

Memory comes from derive_capacities (Capacities.ring_slot_bytes: GDN conv + recurrent state of every GDN
layer, PLE n-gram context + short-conv state; KV, QSA keys and drafter rows are positional, so a snapshot
holds only their cursors), for atlas-tiny and the benchmark config benchmarks/configs/qwen4exp-2p7b.json
in bf16 (recurrent state fp32).

Cost, on atlas-tiny through the real CpuBackend: taking a snapshot (a deep copy of that state), restoring one
(copy back + cursor rewind), and the re-feed of the tokens between the boundary and the rollback target
(the exact path feeds them one at a time). A rollback on average re-feeds interval / 2 tokens. For the 2.7B
config the copy cost is measured on synthetic tensors of its state's shapes (no weights are needed to copy).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.runner import Chunk
from atlas.backends.cpu.state import StateSnapshot
from atlas.config import EngineConfig, derive_capacities
from atlas.model import load_model
from atlas.model.spec import ModelSpec
from atlas.plan import RingRestore, RingSnapshot, SeqWork, StepPlan

BENCH_CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"  # in the repo: a clone has it


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs."""
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def synthetic_snapshot(spec: ModelSpec, dtype: torch.dtype) -> StateSnapshot:
    """Zero tensors with the shapes (and dtypes) one snapshot of `spec` holds."""
    conv = {layer: torch.zeros(spec.gdn_conv_dim, spec.gdn_conv_kernel, dtype=dtype) for layer in spec.gdn_layers}
    rec = {layer: torch.zeros(spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim, dtype=torch.float32)
           for layer in spec.gdn_layers}
    ple_ctx, ple_conv = None, {}
    if spec.ple is not None:
        ple_ctx = torch.zeros(spec.ple.context_len, dtype=torch.long)
        ple_conv = {layer: torch.zeros(max(1, spec.hc_count) * spec.hidden_size, spec.ple.conv_state_len, dtype=dtype)
                    for layer in spec.ple.layers}
    return StateSnapshot(0, conv, rec, ple_ctx, ple_conv)


def snapshot_bytes(snap: StateSnapshot) -> int:
    tensors = [*snap.gdn_conv.values(), *snap.gdn_recurrent.values(), *snap.ple_conv.values()]
    if snap.ple_context is not None:
        tensors.append(snap.ple_context)
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None, help="default: OMP_NUM_THREADS, else 1 (atlas/threads.py)")
    ap.add_argument("--smoke", action="store_true", help="3 repetitions: seconds, for CI")
    args = ap.parse_args()
    if args.smoke:
        args.reps = 3
    from atlas.threads import apply_threads

    apply_threads(args.threads)
    config = EngineConfig(max_seq_len=1024, max_batch_size=1, prefill_chunk_tokens=1024, ring_slots=args.slots,
                          snapshot_interval=args.interval)

    tiny = load_model("atlas-tiny")
    bench_spec = ModelSpec.from_config(json.loads(BENCH_CONFIG.read_text()))
    print(f"ring: {args.slots} slots, a snapshot every {args.interval} tokens past the prompt")
    print(f"{'model':<34} {'bytes/slot':>12} {'bytes/seq':>14} {'MiB/seq':>9}")
    for name, spec, width in (("atlas-tiny (fp32)", tiny.spec, 4), ("atlas-tiny (bf16)", tiny.spec, 2),
                              ("qwen4exp-2p7b (bf16)", bench_spec, 2)):
        caps = derive_capacities(config, spec, activation_bytes=width)
        per_seq = caps.ring_slots * caps.ring_slot_bytes
        print(f"{name:<34} {caps.ring_slot_bytes:>12,} {per_seq:>14,} {per_seq / 2**20:>9.2f}")
    synthetic = synthetic_snapshot(bench_spec, torch.bfloat16)
    # the derived figure is exactly the tensors a snapshot holds
    assert snapshot_bytes(synthetic) == derive_capacities(config, bench_spec, activation_bytes=2).ring_slot_bytes

    # atlas-tiny on the CPU backend: 200 tokens fed, a boundary every `interval`
    table = tuple(range(64))
    backend = CpuBackend(tiny, num_kv_blocks=64, block_size=16, ring_slots=args.slots)
    tokens = [(i * 31 + 7) % 256 for i in range(200)]
    backend.execute(StepPlan(0, (SeqWork(0, tuple(tokens[:136]), 0, table, sample=False),),
                             snapshots=(RingSnapshot(0, 136, 0),)))
    backend.execute(StepPlan(1, (SeqWork(0, tuple(tokens[136:]), 136, table, sample=False),)))
    take = timed(lambda: backend.store.copy_state(0), args.reps)
    restore = timed(lambda: backend.store.restore(RingRestore(0, 0, 136)), args.reps)
    refeed_tokens = max(1, args.interval // 2)
    follow = tokens[136 : 136 + refeed_tokens]

    def refeed() -> None:
        backend.store.restore(RingRestore(0, 0, 136))
        backend.forward_hidden([Chunk(0, follow, 136, table)])

    rollback = timed(refeed, max(3, args.reps // 10))
    copy_2p7b = timed(lambda: copy.deepcopy(synthetic), max(3, args.reps // 5))
    print()
    print(f"{'CPU cost (median)':<62} {'ms':>9}")
    print(f"{'atlas-tiny: take a snapshot':<62} {take * 1e3:>9.3f}")
    print(f"{'atlas-tiny: restore a snapshot':<62} {restore * 1e3:>9.3f}")
    print(f"{f'atlas-tiny: restore + re-feed {refeed_tokens} tokens (a typical rollback)':<62} {rollback * 1e3:>9.3f}")
    print(f"{'qwen4exp-2p7b: copy one snapshot (take or restore)':<62} {copy_2p7b * 1e3:>9.3f}")


if __name__ == "__main__":
    main()
