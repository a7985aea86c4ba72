"""Batch invariance under real load: how many of N completions of one prompt are identical while 0..M other
random prompts share the engine with it (issue 15, deliverable 4; goal 1,000 of 1,000 for cuda-invariant).

    python benchmarks/invariance.py [--backend cuda-invariant] [--trials 1000] [--max-others 63] [--seeded]
    python benchmarks/invariance.py --smoke     # atlas-tiny, the CUDA backend's fp32 math on the CPU, 6 trials

Each trial builds a batch of the target prompt plus a random number of random other prompts (random lengths, so
the scheduler's prefill chunks and the decode batch differ from trial to trial), generates greedily (or with
seeded sampling, temperature 0.8, one seed for the target) and records the target's tokens. Reports the count
equal to the most common completion, the number of distinct completions and the first diverging position.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda-invariant")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--max-others", type=int, default=63)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeded", action="store_true", help="temperature 0.8 with a fixed seed, not greedy")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    options: dict = {}
    if args.smoke:
        from atlas.model import load_model

        args.backend, args.trials, args.max_others, args.prompt_len, args.tokens = "cuda-fp32-invariant", 6, 3, 40, 8
        model, name = load_model("atlas-tiny"), "atlas-tiny"
        options = {"device": "cpu", "cuda_graphs": False}
    else:
        from atlas.backends.cuda.random_model import random_model

        model = random_model(json.loads(CONFIG.read_text()), device="cuda", dtype=torch.bfloat16, seed=0)
        name = model.name
    vocab = model.spec.vocab_size
    config = EngineConfig(max_seq_len=args.prompt_len + args.tokens + 16, max_batch_size=args.max_others + 1)
    engine = build_engine(name, args.backend, config, loaded=model, sink=RecordingSink(), backend_options=options)
    rng = random.Random(0)
    target = [rng.randrange(2, vocab) for _ in range(args.prompt_len)]
    params = (SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8, seed=1234) if args.seeded
              else SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    other = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    outputs: list[tuple[int, ...]] = []
    start = time.perf_counter()
    for trial in range(args.trials):
        others = [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, args.prompt_len + 1))]
                  for _ in range(rng.randrange(0, args.max_others + 1))]
        prompts = others[: len(others) // 2] + [target] + others[len(others) // 2 :]  # the target mid-batch
        half = len(others) // 2
        results = generate(engine, prompts, [other] * half + [params] + [other] * (len(others) - half))
        outputs.append(tuple(results[len(others) // 2].token_ids))
        if (trial + 1) % max(1, args.trials // 10) == 0:
            print(f"  {trial + 1} trials, {len(set(outputs))} distinct so far", flush=True)
    engine.close()
    common, count = collections.Counter(outputs).most_common(1)[0]
    diverge = sorted({next((i for i, (a, b) in enumerate(zip(o, common, strict=True)) if a != b), len(o))
                      for o in outputs if o != common})
    report = {"backend": args.backend, "trials": args.trials, "identical": count, "distinct": len(set(outputs)),
              "first_divergence": diverge[:10], "seeded": args.seeded, "seconds": time.perf_counter() - start}
    print(f"{args.backend}{' seeded' if args.seeded else ''}: {count} of {args.trials} completions identical "
          f"({report['distinct']} distinct; first divergent positions {diverge[:10]}), goal {args.trials} of "
          f"{args.trials}")
    if args.json:
        args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
