"""Where a speculative run's greedy tokens first leave speculation off's, and how close a call that token was.

One prompt per batch row (random tokens, the benchmark config's random bf16 weights on the GPU, or atlas-tiny on
the CUDA backend's CPU path with --smoke); speculation off records every token's top-2 logprobs; each K then runs
with the oracle drafter (benchmarks/cuda_features.py: speculation off's tokens, right with probability 1.0) and
reports, per request, the first position where its tokens differ and speculation off's top-1 - top-2 logprob
margin there. A margin of a few 1e-3 nats is a bf16 near-tie (a wide verify's GEMM shapes round differently from
a decode's); a large margin at a divergence is a wrong result.

    python benchmarks/spec_divergence.py --backends cuda,cuda-fp32 --batch 1 --widths 2,4
    .venv/bin/python benchmarks/spec_divergence.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_features as cf  # the same setup and oracle as the features benchmark


def run(setup: cf.Setup, config: Any, prompts: dict[str, list[int]], new: int, drafter: Any = None
        ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    from atlas.sampling.params import SamplingParams

    engine = setup.engine(config, drafter=drafter) if drafter is not None else setup.engine(config)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=new, ignore_eos=True, logprobs=True,
                                                       top_logprobs=2))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    margins: dict[str, list[float]] = {r: [] for r in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            for top in out.new_top_logprobs:
                margins[out.request_id].append(top[0][1] - top[1][1] if len(top) > 1 else float("inf"))
    engine.close()
    return tokens, margins


def main() -> None:
    from atlas.config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--backends", default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--widths", default="2,4")
    p.add_argument("--prompt-len", type=int, default=140)
    p.add_argument("--new", type=int, default=40)
    args = p.parse_args()
    for backend in args.backends.split(","):
        setup = cf.Setup(args.smoke, cf.CONFIG)
        if not args.smoke:
            setup.backend = backend
        vocab = setup.model.spec.vocab_size
        g = torch.Generator().manual_seed(args.batch)
        prompts = {f"r{i}": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
                   for i in range(args.batch)}
        base = dict(max_seq_len=args.prompt_len + args.new + 16, max_batch_size=args.batch,
                    prefill_chunk_tokens=max(4096, args.batch))
        reference, margins = run(setup, EngineConfig(**base), prompts, args.new)
        for k in (int(w) for w in args.widths.split(",")):
            tokens, _ = run(setup, EngineConfig(**base, num_drafts=k - 1, drafter="scripted"), prompts, args.new,
                            cf.oracle(reference, 1.0, vocab))
            firsts = {}
            for rid in prompts:
                diff = [i for i, (a, b) in enumerate(zip(tokens[rid], reference[rid], strict=False)) if a != b]
                firsts[rid] = diff[0] if diff else None
            diverged = {r: i for r, i in firsts.items() if i is not None}
            print(json.dumps({"backend": setup.backend, "batch": args.batch, "K": k, "identical": len(prompts) -
                              len(diverged), "of": len(prompts),
                              "first_divergence": {r: {"position": i, "off_margin": round(margins[r][i], 5)}
                                                   for r, i in list(diverged.items())[:8]}}), flush=True)


if __name__ == "__main__":
    main()
