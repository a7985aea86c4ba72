"""CPU prefill and decode throughput: Atlas's reference backend (exact and whole-chunk modes) vs transformers.

    .venv/bin/python benchmarks/cpu_model.py                  # atlas-tiny (written to a temp dir)
    .venv/bin/python benchmarks/cpu_model.py --model DIR --prompt-len 512 --decode-tokens 64
    .venv/bin/python benchmarks/cpu_model.py --smoke          # seconds: tiny sizes, one repeat (CI)

Not a test: it prints figures. Both sides run fp32, batch 1, greedy decode of the same tokens. Threads follow
atlas/threads.py (OMP_NUM_THREADS, else the measured default of each path) unless --threads says.
Decode is timed on its own (after a prefill that is not counted), best of --repeats.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_decode(repeats: int, prefill, decode) -> float:
    """Best time of `decode()` alone, each time after an untimed `prefill()` that resets the sequence."""
    best = float("inf")
    for _ in range(repeats):
        state = prefill()
        t0 = time.perf_counter()
        decode(state)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_atlas(model_dir: Path, prompt: list[int], decode: list[int], repeats: int, *, exact: bool
                ) -> tuple[float, float]:
    from atlas.backends.cpu import Chunk, CpuBackend
    from atlas.model import load_model

    model = load_model(model_dir)
    blocks = -(-(len(prompt) + len(decode)) // 16)
    backend = CpuBackend(model, num_kv_blocks=blocks, block_size=16, exact=exact)
    table = range(blocks)

    def prefill() -> None:
        backend.forward([Chunk(0, prompt, 0, table)])

    def run_decode(_state: None) -> None:
        for i, t in enumerate(decode):
            backend.forward([Chunk(0, [t], len(prompt) + i, table)])

    t_prefill = _best_of(repeats, prefill)
    t_decode = _best_decode(repeats, prefill, run_decode)
    return len(prompt) / t_prefill, len(decode) / t_decode


def bench_transformers(model_dir: Path, prompt: list[int], decode: list[int], repeats: int) -> tuple[float, float]:
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    @torch.no_grad()
    def prefill():
        return model(input_ids=ids, use_cache=True)

    @torch.no_grad()
    def run_decode(out) -> None:
        cache = getattr(out, "cache", None) or out.past_key_values
        for t in decode:
            out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)

    t_prefill = _best_of(repeats, prefill)
    t_decode = _best_decode(repeats, prefill, run_decode)
    return len(prompt) / t_prefill, len(decode) / t_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="atlas-tiny", help="checkpoint dir, or atlas-tiny")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: OMP_NUM_THREADS, else the measured default of each path)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="prompt 16, decode 4, one repeat: seconds, for CI")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_len, args.decode_tokens, args.repeats = 16, 4, 1
    from atlas.threads import apply_threads, resolve_threads

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "atlas-tiny":
            from atlas.model.tiny import save

            model_dir = save(Path(tmp) / "atlas-tiny")
        else:
            model_dir = Path(args.model)
        g = torch.Generator().manual_seed(0)
        from atlas.model.spec import load_spec

        vocab = min(load_spec(model_dir).vocab_size, 256)
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
        decode = torch.randint(0, vocab, (args.decode_tokens,), generator=g).tolist()

        threads = {exact: resolve_threads(args.threads, exact=exact) for exact in (True, False)}
        print(f"model {args.model}, prompt {args.prompt_len} tokens, decode {args.decode_tokens} tokens, "
              f"threads {threads[True]} exact / {threads[False]} whole-chunk and transformers, fp32, batch 1, "
              f"best of {args.repeats}", flush=True)
        print(f"{'':14s}{'prefill tok/s':>15s}{'decode tok/s':>15s}", flush=True)
        # exact (the default): token by token, bitwise chunk-invariant; whole chunks: one pass per chunk
        runs = [
            ("atlas exact", True, lambda *a: bench_atlas(*a, exact=True)),
            ("atlas chunks", False, lambda *a: bench_atlas(*a, exact=False)),
            ("transformers", False, bench_transformers),
        ]
        if args.no_transformers:
            runs.pop()
        for n, (name, exact, fn) in enumerate(runs, start=1):
            print(f"[{n}/{len(runs)}] measuring {name} ...", file=sys.stderr, flush=True)
            apply_threads(args.threads, exact=exact)
            prefill, dec = fn(model_dir, prompt, decode, args.repeats)
            print(f"{name:14s}{prefill:15.1f}{dec:15.1f}", flush=True)


if __name__ == "__main__":
    main()
