"""Start `tp` ranks on one host (torch.multiprocessing spawn, a file rendezvous) and run a job on each.

`spawn(tp, job, backend)` runs `job(rank, comm, device)` on every rank after `init_process_group` and returns rank
0's result (what the job returned there, through a file: rank 0 is the only one that owns results). gloo ranks
run on the CPU with one thread each; nccl ranks on cuda:rank (NCCL refuses two ranks on one GPU, so one GPU
runs its ranks with gloo over CUDA tensors instead: backend "gloo" with device "cuda").
torchrun launches the same job: `run_rank` reads RANK / WORLD_SIZE from the environment when they are set.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atlas.backends.parallel.comm import Comm

Job = Callable[[int, Comm, torch.device], Any]


def rank_device(backend: str, rank: int, device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("device 'cuda' asked for but torch.cuda.device_count() is 0 (use --backend gloo)")
        return torch.device("cuda", rank % count)
    return torch.device(device)


def run_rank(rank: int, tp: int, backend: str, init: str, out: str, job: Job, device: str | None) -> None:
    """One rank: join the group, run the job, rank 0 writes its result to `out`."""
    torch.set_num_threads(1)  # the CI machine has 2 shared cores: one per rank
    dev = rank_device(backend, rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp, **kwargs)
    try:
        result = job(rank, Comm.from_world(), dev)
        dist.barrier()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(tp: int, job: Job, *, backend: str = "gloo", device: str | None = None) -> Any:
    """Run `job` on `tp` spawned ranks of this host; rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="atlas-tp-") as tmp:
        init = f"file://{tmp}/rendezvous"
        out = os.path.join(tmp, "result.pickle")
        mp.spawn(run_rank, args=(tp, backend, init, out, job, device), nprocs=tp, join=True)
        return pickle.loads(Path(out).read_bytes())


def run_from_env(job: Job, *, backend: str, device: str | None = None) -> Any:
    """Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set): this process's rank; rank 0's result, None elsewhere."""
    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dev = rank_device(backend, int(os.environ.get("LOCAL_RANK", rank)), device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=tp, **kwargs)
    try:
        result = job(rank, Comm.from_world(), dev)
        dist.barrier()
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()
