"""atlas-mini's training step (tools/train_mini.py) on this machine, and what it implies for an H200.

    .venv/bin/python benchmarks/train_step.py                          # mini preset, batch 4 x 512, patched
    .venv/bin/python benchmarks/train_step.py --no-patches --batch 1   # transformers' own paths, for contrast

Not a test: it prints figures. One profiled step gives the counts an accelerator estimate needs: kernel-launching
ops (every aten op except views), matmul FLOPs, and the bytes the ops read (inputs, x2 for their outputs). The
H200 estimate is a bound built from those counts, not a measurement: see --launch-us, --bandwidth, --matmul-rate.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

# ops that only re-describe a tensor: no kernel on a GPU
_VIEWS = {"view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute", "expand", "slice",
          "select", "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
          "detach", "alias", "unflatten", "flatten", "narrow", "view_as", "expand_as", "lift_fresh", "empty",
          "empty_like", "empty_strided", "contiguous", "to", "_to_copy_noop", "result_type", "is_nonzero",
          "size", "stride", "numel", "dim", "resolve_conj", "resolve_neg", "_has_compatible_shallow_copy_type",
          "set_", "clone_noop", "diagonal", "movedim", "swapaxes", "real", "imag"}
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1,
                "unsigned char": 1, "signed char": 1}


def _counts(prof) -> tuple[int, float, float]:
    """(kernel-launching op count, matmul FLOPs, bytes read x 2) over the profiled region, leaf ops only."""
    ops = flops = nbytes = 0.0
    for e in prof.events():
        name = e.name.removeprefix("aten::")
        flops += (e.flops or 0) if e.name.startswith("aten::") else 0  # only mm / bmm / addmm carry flops
        if not e.name.startswith("aten::") or name in _VIEWS or e.cpu_children:
            continue
        ops += 1
        for shape, dtype in zip(e.input_shapes or [], e.input_dtypes or [], strict=False):
            if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
                n = 1
                for d in shape:
                    n *= d
                nbytes += 2 * n * _DTYPE_BYTES.get(dtype, 4)
    return int(ops), flops, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mini", choices=["mini", "tiny"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--no-patches", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gpu-batch", type=int, default=64, help="the batch the H200 estimate is for")
    p.add_argument("--launch-us", type=float, default=12.0, help="host time per eager op on the GPU machine")
    p.add_argument("--bandwidth", type=float, default=2.0e12, help="bytes/s the small ops reach (of 4.1e12)")
    p.add_argument("--matmul-rate", type=float, default=1.0e14, help="FLOP/s for these small bf16 matmuls")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, batch 4 x 64, one timed step")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.batch, args.seq_len, args.steps = "tiny", 4, 64, 1
    torch.set_num_threads(args.threads)

    import indexer_loss
    import train_patches
    from mini_config import model_config
    from mini_mtp import build_models
    from train_mini import step_losses

    patched = [] if args.no_patches else [*train_patches.apply(), indexer_loss.apply()]
    torch.manual_seed(0)
    config = model_config(args.preset)
    model, head = build_models(config, torch.device("cpu"))

    def step(batch: int) -> None:
        x = torch.randint(4, config["vocab_size"], (batch, args.seq_len), generator=torch.Generator().manual_seed(1))
        loss, aux, m_loss, i_loss = step_losses(model, model.model, head, x, 0.5)
        (loss + 0.01 * aux + m_loss + i_loss).backward()
        model.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)

    def counted(batch: int) -> tuple[int, float, float]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
            step(batch)
        return _counts(prof)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(args.batch)
    peak_gb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(args.batch)
    step_s = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq_len
    ops, flops, nbytes = counted(args.batch)
    print(f"train step, {args.preset} preset, batch {args.batch} x {args.seq_len}, {args.threads} thread(s), "
          f"patches: {len(patched)}/4")
    print(f"  CPU: {step_s * 1000:.0f} ms/step, {tokens / step_s:,.0f} tokens/s; the first step grew peak memory by "
          f"{peak_gb:.1f} GiB")
    print(f"  per step: {ops:,} kernel-launching ops, {flops / 1e9:.1f} GFLOP in matmuls, "
          f"{nbytes / 1e9:.2f} GB read+written")
    # every count is linear in the batch (transformers' own indexer loops per sequence and query, so its op
    # count grows with it): fit count = fixed + per_sequence * batch through this batch and half of it (batch 1
    # is not on the line: autograd accumulates a few gradients differently there)
    if args.batch < 4:
        raise SystemExit("--batch must be >= 4 (the estimate fits counts through batch and batch / 2)")
    half = args.batch // 2
    ops1, flops1, bytes1 = counted(half)

    def at(value: float, value1: float) -> float:
        per = (value - value1) / (args.batch - half)
        return value + per * (args.gpu_batch - args.batch)

    gpu_ops = at(ops, ops1)
    launch = gpu_ops * args.launch_us * 1e-6
    memory = at(nbytes, bytes1) / args.bandwidth
    compute = at(flops, flops1) / args.matmul_rate
    est = max(launch, memory + compute)
    gpu_tokens = args.gpu_batch * args.seq_len
    print(f"  H200 estimate at batch {args.gpu_batch}: {gpu_ops:,.0f} ops -> launches {launch * 1000:.0f} ms; "
          f"memory {memory * 1000:.0f} ms + matmuls {compute * 1000:.0f} ms -> ~{est * 1000:.0f} ms/step, "
          f"~{gpu_tokens / est:,.0f} tokens/s ({gpu_tokens / est * 300 / 1e6:.0f} M tokens in 5 min)")


if __name__ == "__main__":
    main()
