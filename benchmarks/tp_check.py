"""Tensor parallelism: TP=1 vs TP=N agreement, decode ms/step and collective time (issue 19).

    python benchmarks/tp_check.py --smoke                          # 2 CPU ranks over gloo, atlas-tiny fp32
    python benchmarks/tp_check.py --backend nccl                   # 2 GPUs: agreement on atlas-tiny fp32, then speed
    python benchmarks/tp_check.py --backend nccl --config benchmarks/configs/qwen3next-80b-a3b.json \
        --batches 1,16,64,256                                      # 2 GPUs: the 80B shape, random bf16 shards
    python benchmarks/tp_check.py --backend gloo --device cuda     # 2 ranks sharing one GPU (NCCL refuses that)
    torchrun --nproc-per-node 2 benchmarks/tp_check.py --backend nccl   # the same job, launched by torchrun

Agreement: rank 0 runs the single-process CUDA backend (the reference) beside its TpBackend; it prints the largest
|logit| difference over a prefill chunk and every decode step, and whether greedy tokens (StepPlans, 3 sequences
batched) are equal, for routed experts split by width ("tp") and by expert ("ep"). Speed: decode ms/step per batch,
and the time inside all-reduces / all-gathers from a second pass that synchronises around each (so that pass is
slower; its collective time is an upper bound that includes waiting for the slower rank).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

from atlas.backends.parallel.backend import TpBackend
from atlas.backends.parallel.check import Agreement, DecodeSpeed, agreement, decode_speed
from atlas.backends.parallel.launch import run_from_env, spawn
from atlas.backends.parallel.random_shard import random_shard
from atlas.backends.parallel.shard import TpLayout
from atlas.model import load_model

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5  # fp32: only the summation order differs (tests/test_tensor_parallel.py says why this bound)


def _tiny() -> object:
    return load_model("atlas-tiny")


def _build(layout: TpLayout, comm: object, device: torch.device, *, config: str | None, dtype: torch.dtype,
           blocks: int, batch: int) -> TpBackend:
    if config is None:
        model = load_model("atlas-tiny")
        return TpBackend.from_full(model, layout, comm, num_kv_blocks=blocks, dtype=dtype, device=device,  # type: ignore[arg-type]
                                   max_batch_size=batch)
    model, shard = random_shard(config, layout, device=device, dtype=dtype)
    return TpBackend(model.spec, shard, model, layout, comm, num_kv_blocks=blocks, dtype=dtype, device=device,  # type: ignore[arg-type]
                     max_batch_size=batch)


def job(rank: int, comm: object, device: torch.device, *, args: argparse.Namespace) -> dict:
    out: dict = {"agreement": [], "speed": []}
    if args.config is None:  # agreement needs the whole model on rank 0: atlas-tiny
        out["agreement"] = agreement(rank, comm, device, model=_tiny, modes=args.modes,  # type: ignore[arg-type]
                                     decode_steps=args.steps, batch=3, time_collectives=False)
    if args.speed:
        dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
        batch = max(args.batches)
        blocks = batch * -(-(args.prompt_len + args.steps + 1) // 16)
        build = functools.partial(_build, comm=comm, device=device, config=args.config, dtype=dtype, blocks=blocks,
                                  batch=batch)
        out["speed"] = decode_speed(rank, comm, device, build=build, modes=args.speed_modes,  # type: ignore[arg-type]
                                    batches=args.batches, prompt_len=args.prompt_len, steps=args.steps)
    return out


def report(result: dict, args: argparse.Namespace) -> int:
    bad = 0
    for a in result["agreement"]:
        assert isinstance(a, Agreement)
        worst = max(a.prefill_max_abs, *a.decode_max_abs)
        equal = a.tokens_tp == a.tokens_ref
        bad += worst > TOL or not equal or not a.argmax_equal
        print(f"TP=1 vs TP={args.tp} (experts {a.experts}): max |dlogit| prefill {a.prefill_max_abs:.2e}, decode "
              f"{max(a.decode_max_abs):.2e} over {len(a.decode_max_abs)} steps (|logit| <= {a.logit_scale:.2f}, "
              f"tolerance {TOL:.0e}); greedy tokens equal: {equal} ({sum(map(len, a.tokens_ref))} tokens); "
              f"decode ms/step TP=1 {a.ms_per_step_ref:.2f}, TP={args.tp} {a.ms_per_step_tp:.2f}")
    for s in result["speed"]:
        assert isinstance(s, DecodeSpeed)
        print(f"decode TP={args.tp} experts {s.experts} batch {s.batch}: {s.ms_per_step:.2f} ms/step; collectives "
              f"{s.collective_ms_per_step:.2f} ms/step ({s.collectives_per_step:.0f} per step, timed pass); plan broadcast "
              f"{s.command_ms_per_step:.3f} ms/step; weights "
              f"{s.weight_bytes_per_rank / 2**20:,.1f} MiB per rank")
    if not result["agreement"]:
        print("verdict: speed only (no TP=1 reference for a --config model)")
    else:
        print("verdict:", "agreement holds" if not bad else f"{bad} mode(s) disagree")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda for nccl, cpu for gloo")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--config", default=None, help="a config.json: speed only, random shards (default atlas-tiny)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="speed part (default bf16 on a GPU)")
    p.add_argument("--experts", default="tp,ep", help="routed experts: tp (split by width), ep (by expert)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=16)
    # speed part: 1-token prompts, so the first step is already one batched decode group (a longer prompt is a
    # prefill group per sequence: at batch 256 on the 80B shape, 256 eager MoE prefills before the first decode)
    p.add_argument("--prompt-len", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="2 CPU ranks over gloo, atlas-tiny, 4 decode steps")
    args = p.parse_args(argv)
    args.modes = tuple(args.experts.split(","))
    if bad := [m for m in args.modes if m not in ("tp", "ep")]:
        p.error(f"--experts {','.join(bad)}: expected tp and/or ep")
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        p.error(f"--batches {args.batches!r}: expected comma-separated integers")
    if args.smoke:
        args.backend, args.device, args.tp, args.config, args.steps, args.batches = "gloo", "cpu", 2, None, 4, (2,)
    on_gpu = (args.device or ("cuda" if args.backend == "nccl" else "cpu")) == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("tp_check: --backend nccl / --device cuda needs a CUDA GPU (use --smoke or --backend gloo)",
              file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.speed = args.smoke or on_gpu or args.config is not None
    args.speed_modes = args.modes[:1] if args.smoke else args.modes  # smoke: the speed path runs, once
    run = functools.partial(job, args=args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        args.tp = int(os.environ["WORLD_SIZE"])
        result = run_from_env(run, backend=args.backend, device=args.device)
        return report(result, args) if result is not None else 0
    return report(spawn(args.tp, run, backend=args.backend, device=args.device), args)


if __name__ == "__main__":
    raise SystemExit(main())
