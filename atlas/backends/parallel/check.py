"""TP=1 vs TP=tp agreement on one model, run on every rank (launch.spawn or torchrun): the job the tests and
benchmarks/tp_check.py share.

Rank 0 holds the reference (the plain CudaBackend on the whole model, no collectives) and the TpBackend on its
shard; the other ranks run worker_loop. Three parts per expert mode:
1. logits: one prefill chunk (every position's logits) and `decode_steps` single-token feeds of the reference's
   greedy token (last-position logits), through `forward`;
2. greedy tokens through `execute` with StepPlans (the path the engine drives): `batch` sequences, one prefill
   chunk each, then `decode_steps` batched decode steps, each plan broadcast to the workers;
3. decode ms/step of both backends over those steps, and with `time_collectives` the seconds spent in the
   all-reduces / all-gathers (synchronised around each: the step is slower while they are timed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch

from atlas.backends.cuda.runner import CudaBackend
from atlas.backends.parallel.backend import TpBackend, worker_loop
from atlas.backends.parallel.comm import Comm
from atlas.backends.parallel.layers import VocabParallelHead
from atlas.backends.parallel.shard import ExpertMode, TpLayout
from atlas.model.loaded import LoadedModel
from atlas.plan import SeqWork, StepPlan


@attrs.frozen
class Agreement:
    experts: str
    prefill_max_abs: float  # max |TP - ref| over every prefill position's logits
    decode_max_abs: tuple[float, ...]  # per decode step, last-position logits
    logit_scale: float  # max |ref logit| seen (the differences' scale)
    argmax_equal: bool  # the forward part's argmax agrees at every position
    tokens_ref: tuple[tuple[int, ...], ...]  # execute part: sampled tokens per sequence
    tokens_tp: tuple[tuple[int, ...], ...]
    ms_per_step_ref: float
    ms_per_step_tp: float
    collective_ms_per_step: float  # 0 unless time_collectives
    collectives_per_step: float


@attrs.frozen
class _Chunk:
    seq_id: int
    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]


def _nbytes(t: torch.Tensor | VocabParallelHead) -> int:
    t = t.shard if isinstance(t, VocabParallelHead) else t
    return t.numel() * t.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreement(rank: int, comm: Comm, device: torch.device, *, model: Callable[[], LoadedModel],
              modes: Sequence[ExpertMode] = ("tp", "ep"), prompt: Sequence[int] = tuple(b"hello world " * 4),
              decode_steps: int = 8, batch: int = 3, dtype: torch.dtype = torch.float32,
              time_collectives: bool = False, block_size: int = 16) -> list[Agreement]:
    """The job of every rank; rank 0 returns one Agreement per expert mode (other ranks return [])."""
    loaded = model()
    blocks_per_seq = -(-(len(prompt) + decode_steps + 1) // block_size)
    kwargs = dict(num_kv_blocks=blocks_per_seq * batch, block_size=block_size, dtype=dtype, device=device,
                  max_batch_size=batch, cuda_graphs=False)
    out = []
    for mode in modes:
        layout = TpLayout(comm.tp, rank, mode)
        tp = TpBackend.from_full(loaded, layout, comm, **kwargs)
        if rank != 0:
            worker_loop(tp)
            continue
        ref = CudaBackend(loaded, **kwargs)
        table = tuple(range(blocks_per_seq))
        # 1. logits
        first = _Chunk(0, tuple(prompt), 0, table)
        want, got = ref.forward([first])[0], tp.forward([first])[0]
        prefill = (got - want).abs().max().item()
        scale = want.abs().max().item()
        argmax_equal = bool(torch.equal(want.argmax(-1), got.argmax(-1)))
        decode = []
        token, pos = int(want[-1].argmax()), len(prompt)
        for _ in range(decode_steps):
            step = _Chunk(0, (token,), pos, table)
            want, got = ref.forward([step])[0], tp.forward([step])[0]
            decode.append((got - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
            argmax_equal &= bool(torch.equal(want.argmax(-1), got.argmax(-1)))
            token, pos = int(want[-1].argmax()), pos + 1
        ref.release(0)
        tp.release(0)
        # 2./3. tokens through execute, timed
        runs = []
        for backend in (ref, tp):
            comm.seconds, comm.calls = 0.0, 0
            comm.timed = time_collectives and backend is tp
            runs.append(_generate(backend, prompt, batch, decode_steps, blocks_per_seq, device))
            comm.timed = False
        tp.close()
        (tok_ref, ms_ref), (tok_tp, ms_tp) = runs
        steps = max(decode_steps - 1, 1)
        out.append(Agreement(mode, prefill, tuple(decode), scale, argmax_equal, tok_ref, tok_tp, ms_ref, ms_tp,
                             1e3 * comm.seconds / steps if time_collectives else 0.0, comm.calls / steps))
    return out


def _generate(backend: CudaBackend, prompt: Sequence[int], batch: int, steps: int, blocks: int,
              device: torch.device) -> tuple[tuple[tuple[int, ...], ...], float]:
    """Greedy tokens of `batch` sequences (prompt rotated per sequence) via StepPlans, and decode ms/step (the
    steps after the first decode, which warms up)."""
    prompts = [tuple(prompt[i:]) + tuple(prompt[:i]) for i in range(batch)]
    tables = [tuple(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    work = tuple(SeqWork(seq_id=i, tokens=p, start=0, block_table=tables[i], sample=True)
                 for i, p in enumerate(prompts))
    result = backend.execute(StepPlan(step=0, work=work))
    tokens = [[o.token] for o in result.outcomes]
    start = 0.0
    for s in range(steps):
        if s == 1:
            _sync(device)
            start = time.perf_counter()
            if isinstance(backend, TpBackend):
                backend.comm.seconds, backend.comm.calls = 0.0, 0
        work = tuple(SeqWork(seq_id=i, tokens=(tokens[i][-1],), start=len(prompts[i]) + s, block_table=tables[i],
                             sample=True) for i in range(batch))
        result = backend.execute(StepPlan(step=s + 1, work=work))
        for i, o in enumerate(result.outcomes):
            tokens[i].append(o.token)
    _sync(device)
    ms = 1e3 * (time.perf_counter() - start) / max(steps - 1, 1)
    backend.execute(StepPlan(step=steps + 1, work=(), release=tuple(range(batch))))
    return tuple(tuple(t) for t in tokens), ms


@attrs.frozen
class DecodeSpeed:
    experts: str
    batch: int
    ms_per_step: float
    collective_ms_per_step: float  # synchronised around each collective (a second, timed pass)
    collectives_per_step: float
    weight_bytes_per_rank: int
    command_ms_per_step: float  # broadcasting the StepPlan (inside ms_per_step)


def decode_speed(rank: int, comm: Comm, device: torch.device, *, build: Callable[[TpLayout], TpBackend],
                 modes: Sequence[ExpertMode], batches: Sequence[int], prompt_len: int = 32, steps: int = 8,
                 ) -> list[DecodeSpeed]:
    """Decode ms/step of a TpBackend per expert mode and batch (no reference: the model need not fit one device),
    then the same steps again with every collective timed. `build(layout)` makes the rank's backend, sized for
    max(batches) sequences of prompt_len + steps + 1 tokens."""
    out = []
    prompt = tuple(range(1, prompt_len + 1))
    for mode in modes:
        tp = build(TpLayout(comm.tp, rank, mode))
        blocks = -(-(prompt_len + steps + 1) // tp.block_size)
        if rank != 0:
            worker_loop(tp)
        else:
            for batch in batches:
                comm.command_seconds = 0.0
                _, ms = _generate(tp, prompt, batch, steps, blocks, device)
                command_ms = 1e3 * comm.command_seconds / (steps + 2)  # every plan of the run, prefill and release too
                comm.timed = True
                _generate(tp, prompt, batch, steps, blocks, device)
                comm.timed = False
                n = max(steps - 1, 1)
                size = sum(_nbytes(t) for t in tp.weights.values())
                out.append(DecodeSpeed(mode, batch, ms, 1e3 * comm.seconds / n, comm.calls / n, size, command_ms))
            tp.close()
        del tp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
