"""`atlas serve` in vLLM's dialect: the flags a vLLM user brings, each mapped onto Atlas's own knobs or refused
in one line (exit 2) where Atlas cannot honour it. Nothing is accepted and then ignored.

- `atlas serve MODEL` (positional) beside `--model MODEL`; both, naming different models, is an error.
- `--max-model-len` is `--max-seq-len`, `--max-num-seqs` is `--max-batch-size`, `--enable-prefix-caching` is
  `--prefix-caching` (declared as aliases on the options themselves).
- `--dtype auto|bfloat16|float32` picks the backend mode that computes in it (cuda -> cuda-fp32 for float32);
  a dtype the backend has no mode for is refused.
- `--tensor-parallel-size 1` is the one device Atlas serves on; more is refused, naming the GPUs there are.
- `--gpu-memory-utilization` is refused: the KV cache is sized by the lengths and the batch, not by a fraction.
"""

from __future__ import annotations

from atlas.cli_checks import UsageError

DTYPE_ALIASES = {"auto": "auto", "bfloat16": "bfloat16", "float32": "float32", "float": "float32"}


def resolve_model(positional: str | None, option: str | None) -> str | None:
    """The model named positionally (vLLM's `serve MODEL`) or by `--model`; both is fine only when they agree."""
    if positional is not None and option is not None and positional != option:
        raise UsageError(f"the model is given twice and differently: {positional!r} (positional) and --model "
                         f"{option!r}; give one")
    return positional if positional is not None else option


def resolve_dtype(dtype: str, backend: str) -> str:
    """The backend that computes in `dtype` (the backend name is what the trace records, so a replay rebuilds
    the same arithmetic)."""
    wanted = DTYPE_ALIASES.get(dtype.lower())
    if wanted is None:
        raise UsageError(f"--dtype {dtype!r} is not supported; use auto, bfloat16 (the cuda backends) or float32 "
                         "(cpu, cuda-fp32)")
    if wanted == "auto":
        return backend
    if backend == "null":
        raise UsageError(f"--dtype {dtype}: the null backend computes no tensors, so it has no dtype; "
                         "leave --dtype auto")
    if backend == "cpu":
        if wanted == "float32":
            return backend
        raise UsageError(f"--dtype {dtype}: the cpu backend computes in float32 only; use --dtype float32 (or "
                         "auto), or --backend cuda for bfloat16")
    fp32 = "-fp32" in backend
    if wanted == "float32":
        return backend if fp32 else backend.replace("cuda", "cuda-fp32", 1)
    if fp32:
        raise UsageError(f"--dtype bfloat16 contradicts --backend {backend} (float32); use --backend "
                         f"{backend.replace('-fp32', '')} or --dtype float32")
    return backend


def check_tensor_parallel(size: int, backend: str) -> None:
    """vLLM's `--tensor-parallel-size`: 1 is what Atlas serves on. More is refused in one line: naming the GPUs
    this machine has when there are fewer, else saying that serving does not shard (atlas/backends/parallel
    runs tensor parallelism in its tests and benchmarks/tp_check.py only)."""
    if size == 1:
        return
    if size < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {size}")
    gpus = 0
    if backend.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
    if gpus < size:
        where = f"--backend {backend} uses none" if not backend.startswith("cuda") else f"this machine has {gpus}"
        raise UsageError(f"--tensor-parallel-size {size} needs {size} GPUs; {where}; use --tensor-parallel-size 1")
    raise UsageError(f"--tensor-parallel-size {size}: atlas serve runs the model on one GPU (the tensor-parallel "
                     "backend, atlas/backends/parallel, is not wired into serving); use --tensor-parallel-size 1")


def check_gpu_memory_utilization(fraction: float | None) -> None:
    if fraction is None:
        return
    raise UsageError(f"--gpu-memory-utilization {fraction:g} cannot be honoured: Atlas sizes its KV cache from "
                     "--max-model-len x --max-num-seqs (every sequence fits at full length), not from a fraction "
                     "of GPU memory; drop the flag and set those two")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 2**63:
        raise UsageError(f"--seed {seed} is outside [0, 2^63); pick a seed in that range")
