"""Batch invariance under real load: how many of N completions of one prompt are identical while 0..M other
random prompts share the engine with it (issue 15, deliverable 4; goal 1,000 of 1,000 for cuda-invariant).

    python benchmarks/invariance.py [--backend cuda-invariant] [--trials 1000] [--max-others 63] [--seeded]
    python benchmarks/invariance.py --smoke     # atlas-tiny, the CUDA backend's fp32 math on the CPU, 6 trials

    python benchmarks/invariance.py --stream [--trials 1000]   # one engine, a stream of arrivals (see below)
    python benchmarks/invariance.py --stream --variant default   # the benchmark's fastest knobs

Each trial builds a batch of the target prompt plus a random number of random other prompts (random lengths, so
the scheduler's prefill chunks and the decode batch differ from trial to trial), generates greedily (or with
seeded sampling, temperature 0.8, one seed for the target) and records the target's tokens. Reports the count
equal to the most common completion, the number of distinct completions and the first diverging position.

--stream: one engine serves an open stream instead: each step, with some probability, a copy of the target and/or
random others (random lengths) arrive, up to --trials targets in all, so every target copy runs beside a different,
changing load (others arriving, prefilling in chunks beside it and finishing mid-way, other target copies at other
positions): 1,000 trials in one run of ~1,000 batch-64 steps instead of 1,000 runs. Prefix caching is off (every
copy computes its prompt itself).
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
    parser.add_argument("--stream", action="store_true", help="one engine, targets and others arriving over time")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variant", default=None,
                        help="a Tuning variant (atlas.backends.cuda.tuning.VARIANTS, e.g. default); default: "
                        "the backend's own tuning")
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
    if args.variant is not None:
        from atlas.backends.cuda.tuning import TUNINGS as VARIANTS

        if args.variant not in VARIANTS:
            parser.error(f"--variant {args.variant!r}: one of {', '.join(VARIANTS)}")
        options["tuning"] = VARIANTS[args.variant]
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
    if args.stream:
        outputs = stream(engine, rng, target, params, other, args.trials, args.max_others, args.prompt_len, vocab)
    for trial in range(0 if args.stream else args.trials):
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
    report = {"backend": args.backend, "trials": args.trials, "stream": args.stream, "identical": count, "distinct": len(set(outputs)),
              "first_divergence": diverge[:10], "seeded": args.seeded, "seconds": time.perf_counter() - start}
    print(f"{args.backend}{' seeded' if args.seeded else ''}: {count} of {args.trials} completions identical "
          f"({report['distinct']} distinct; first divergent positions {diverge[:10]}), goal {args.trials} of "
          f"{args.trials}")
    if args.json:
        args.json.write_text(json.dumps(report))
    return 0


def stream(engine, rng: random.Random, target: list[int], params, other, trials: int, max_others: int,
           prompt_len: int, vocab: int) -> list[tuple[int, ...]]:
    """The target's completions, `trials` copies of it arriving among random others over one engine's life."""
    from atlas.errors import QueueFull

    tokens: dict[str, list[int]] = {}
    done: dict[str, bool] = {}
    pending: list[tuple[str, list[int], object]] = []
    sent = steps = made = 0
    while sent < trials or pending or len(done) < len(tokens):
        if sent < trials and rng.random() < 0.5:  # a target copy about every other step
            pending.append((f"target-{sent}", target, params))
            sent += 1
        for _ in range(rng.choice((0, 0, 1, 2))):  # the others: 0-2 a step, random lengths
            if sent < trials:
                pending.append((f"other-{made}", [rng.randrange(2, vocab)
                                                  for _ in range(rng.randrange(1, prompt_len + 1))], other))
                made += 1
        while pending and sum(1 for r in tokens if not done.get(r)) < max_others + 1:
            rid, prompt, sampling = pending[0]
            try:
                engine.add_request(rid, prompt, sampling)
            except QueueFull:
                break
            tokens[rid] = []
            pending.pop(0)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = True
        steps += 1
        if steps % 200 == 0:
            finished = [r for r in done if r.startswith("target-")]
            print(f"  step {steps}: {len(finished)} of {trials} targets done, "
                  f"{len({tuple(tokens[r]) for r in finished})} distinct so far", flush=True)
    return [tuple(tokens[f"target-{i}"]) for i in range(trials)]


if __name__ == "__main__":
    sys.exit(main())
