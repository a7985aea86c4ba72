"""Count the device operations of one CUDA-backend step on the CPU: the kernel count a GPU step would launch.

    python benchmarks/dispatch_count.py [--batch 1] [--prefill 0] [--drafts 0] [--variant NAME ...] [--json PATH]

Runs the CUDA backend (atlas.backends.cuda) on CPU tensors, bf16, on a shrunk copy of the benchmark config
(benchmarks/configs/qwen4exp-2p7b.json with the same 24 layers, layer types, heads, experts, top-k,
hyper-connection streams and PLE layers, but narrow hidden/expert/vocabulary sizes: the code path and so
the op count are those of the full model; only the arithmetic is smaller). Every aten op that launches a
kernel on a GPU is counted (views and metadata ops are not); every Triton kernel launch counts as one (the
kernels run interpreted, TRITON_INTERPRET=1); host syncs (`.item()`, `.tolist()` of device data) are counted
apart. The GDN recurrent/chunk kernels stand in for the torch loop the CPU path would run, as on a GPU. --drafts N
counts a verify step instead of a decode (each sequence's token and N scripted drafts, one wide [B, N + 1] verify
group, its verdicts and its commit).

Variants are the backend's named arrangements (atlas.backends.cuda.tuning.TUNINGS), so the count of each variant the
GPU benchmark times is known before a GPU runs it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"

# ops that never launch a kernel: views, metadata, allocation without a fill
_FREE = {"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "t", "transpose", "permute", "expand",
         "slice", "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "split",
         "split_with_sizes", "chunk", "unflatten", "flatten", "reshape", "view_as", "narrow", "diagonal",
         "lift_fresh", "_reshape_alias", "unfold", "movedim", "sym_size", "sym_stride", "sym_numel", "dim",
         "is_contiguous", "size", "stride", "numel", "result_type", "_has_compatible_shallow_copy_type",
         "set_", "resize_", "is_pinned", "new_empty", "new_empty_strided", "promote_types"}
_SYNC = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "bincount", "masked_select"}


def shrunk_config(path: Path = CONFIG, layers: int | None = None) -> dict:
    """The benchmark config with the same structure and narrow sizes (op counts are size-independent);
    `layers`: only the first few layers (the smoke run: 3 GDN + 1 attention, one PLE layer)."""
    cfg = json.loads(path.read_text())
    if layers is not None:
        cfg.update(layer_types=cfg["layer_types"][:layers], num_hidden_layers=layers,
                   ple_layer_ids=[i for i in cfg["ple_layer_ids"] if i < layers])
    cfg.update(hidden_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=2048,
               ple_embed_dim=128, hc_lowrank=32, ngram_vocab_size_base=512, linear_key_head_dim=32,
               linear_value_head_dim=32, head_dim=32, indexer_head_dim=32)
    return cfg


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.muted = 0
        self.active = False  # inside the counted step (the warm-up step before it is not counted)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNC:
            self.syncs[name] += 1
        if not self.muted and name not in _FREE and not getattr(func, "is_view", False):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _FusedRmsNorm(TorchFunctionMode):
    """F.rms_norm is one kernel on CUDA (torch's fused rms_norm) but a composite of ~6 ops on the CPU:
    count it as one."""

    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.rms_norm and not self.counter.muted:
            self.counter.ops["rms_norm"] += 1
            self.counter.muted += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter.muted -= 1
        return func(*args, **(kwargs or {}))


def _count_triton(counter: collections.Counter[str], ops: Counter) -> Callable[[], None]:
    """Count every interpreted Triton launch as one GPU kernel, and none of the interpreter's own tensor ops
    (it copies every argument to the host and back: a dozen copy_ a launch that a GPU never runs)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter[f"triton:{self.fn.__name__}"] += 1
        ops.muted += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            ops.muted -= 1

    InterpretedFunction.run = counted  # type: ignore[method-assign]

    def restore() -> None:
        InterpretedFunction.run = run  # type: ignore[method-assign]

    return restore


def _regions_as_calls(counter: Counter, calls: collections.Counter[str]) -> Callable[[], None]:
    """Each compiled region (atlas.backends.cuda.regions.compiled) run eagerly, its ops muted and the call counted as
    one `region:<name>`: what a step launches outside its compiled regions, and how many region calls (Inductor
    turns each into a few kernels on a GPU; their count needs the GPU's profile). Nothing compiles on the CPU."""
    import functools

    from atlas.backends.cuda import regions

    real = regions.compiled

    @functools.cache
    def as_call(fn: Callable, mode: str) -> Callable:
        if mode == "none":
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            if counter.active and not counter.muted:
                calls[f"region:{fn.__name__}"] += 1
            counter.muted += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.muted -= 1

        return call

    regions.compiled = as_call

    def restore() -> None:
        regions.compiled = real

    return restore


def count_step(variant: str = "eager", batch: int = 1, prefill: int = 0, context: int = 140,
               layers: int | None = None, regions_as_calls: bool = False, drafts: int = 0) -> dict[str, Any]:
    """Ops of one bf16 decode step of `batch` sequences at `context` tokens (or one prefill of `prefill`, or with
    `drafts` a verify step of that many drafts a sequence). regions_as_calls: each compiled region counted as one
    call (_regions_as_calls), the ops outside them as ops."""
    torch.manual_seed(0)
    counter = Counter()
    region_calls: collections.Counter[str] = collections.Counter()
    undo = _regions_as_calls(counter, region_calls) if regions_as_calls else (lambda: None)
    try:
        return _count(variant, batch, prefill, context, layers, counter, region_calls, drafts)
    finally:
        undo()


def _count(variant: str, batch: int, prefill: int, context: int, layers: int | None, counter: Counter,
           region_calls: collections.Counter[str], drafts: int = 0) -> dict[str, Any]:
    from atlas.backends.cuda import CudaBackend, random_model
    from atlas.backends.cuda.gdn import triton_gdn
    from atlas.backends.cuda.tuning import TUNINGS as VARIANTS
    from atlas.plan import SeqWork, StepPlan

    model = random_model(shrunk_config(layers=layers), device="cpu", dtype=torch.bfloat16, seed=0)
    blocks = 4 + (max(prefill, context) + 16) // 16
    backend = CudaBackend(model, num_kv_blocks=blocks * batch, block_size=16, dtype=torch.bfloat16, device="cpu",
                          max_batch_size=batch, cuda_graphs=False, tuning=VARIANTS[variant],
                          verify_width=drafts + 1, state_audit=False)  # (the test suite's audit digests verifies)
    backend.gdn_kernel = triton_gdn()  # the Triton kernels, as on a GPU (interpreted here)
    tables = [tuple(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    g = torch.Generator().manual_seed(1)
    warm = context if not prefill else 16
    backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(torch.randint(0, 2000, (warm,), generator=g).tolist()), 0,
                                              tables[i], True) for i in range(batch))))
    if prefill:
        work = (SeqWork(0, tuple(torch.randint(0, 2000, (prefill,), generator=g).tolist()), warm, tables[0], True),)
    else:
        work = tuple(SeqWork(i, (7 + i,), warm, tables[i], True, drafts=tuple(range(11, 11 + drafts)))
                     for i in range(batch))
    triton_counts: collections.Counter[str] = collections.Counter()
    restore = _count_triton(triton_counts, counter)
    try:
        with counter, _FusedRmsNorm(counter):
            counter.active = True
            backend.execute(StepPlan(1, work))
    finally:
        counter.active = False
        restore()
    ops = counter.ops + triton_counts + region_calls
    return {"variant": variant, "batch": batch, "prefill": prefill, "drafts": drafts, "ops": sum(ops.values()),
            "region_calls": sum(region_calls.values()),
            "triton": sum(triton_counts.values()), "gemms": sum(ops[n] for n in ("mm", "addmm", "bmm", "baddbmm")),
            "syncs": dict(counter.syncs), "by_op": dict(ops.most_common())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=0, help="count one prefill chunk of this many tokens")
    parser.add_argument("--drafts", type=int, default=0, help="count a verify step of this many drafts a sequence")
    parser.add_argument("--variant", action="append", help="Tuning variant (repeatable; default: all)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="4 layers, baseline only, 20 tokens of context")
    parser.add_argument("--regions-as-calls", action="store_true",
                        help="each compiled region one call (nothing compiled): the launches outside the regions")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from atlas.backends.cuda.tuning import TUNINGS as VARIANTS

    rows = []
    variants = args.variant or (["eager"] if args.smoke else list(VARIANTS))
    for variant in variants:
        try:
            row = count_step(variant, args.batch, args.prefill, context=20 if args.smoke else 140,
                             layers=4 if args.smoke else None, regions_as_calls=args.regions_as_calls,
                             drafts=args.drafts)
        except Exception as error:  # one broken variant must not hide the others' counts
            row = {"variant": variant, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        if "error" in row:
            print(f"{variant:<24} ERROR {row['error']}", flush=True)
            continue
        top = ", ".join(f"{k} {v}" for k, v in list(row["by_op"].items())[: args.top])
        print(f"{variant:<24} batch {row['batch']:>3} prefill {row['prefill']:>5} drafts {row['drafts']}: "
              f"{row['ops']:>5} ops "
              f"({row['gemms']} GEMMs, {row['triton']} Triton"
              + (f", {row['region_calls']} region calls" if args.regions_as_calls else "")
              + f"), host syncs {row['syncs'] or 0}; {top}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
