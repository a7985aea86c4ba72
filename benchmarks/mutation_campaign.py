"""Mutation campaign: how many generated examples it takes to catch each broken variant of the engine.

    .venv/bin/python benchmarks/mutation_campaign.py [NAME ...] [--max-examples 200] [--smoke]
                                                     [--variants-only | --mutants-only]

Two parts. The failure library's variants (tests/fixtures/broken.py, library.py, campaign.py): generated
workloads through the engine under each variant until its invariant fires, then the failing trace minimised
(acceptance, issue 8: within 200 examples, at most 20 events). The seed-like mutants (tests/fixtures/mutants.py,
machine_hunt.py): the hypothesis state machine that must catch each one (tests/test_*machine*.py, comparing data
with tests/machine_checks.py) runs under it until an example fails; caught or missed per mutant (acceptance:
every one caught within 200 examples).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.broken import VARIANTS
from fixtures.campaign import hunt
from fixtures.machine_hunt import hunt_mutant
from fixtures.mutants import MUTANTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="variants and mutants to hunt (default: all)")
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="the first of each part only (CI: the machinery runs)")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--variants-only", action="store_true")
    part.add_argument("--mutants-only", action="store_true")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in VARIANTS and n not in MUTANTS]
    if unknown:
        parser.error(f"unknown name(s) {', '.join(unknown)}; variants: {', '.join(sorted(VARIANTS))}; "
                     f"mutants: {', '.join(MUTANTS)}")
    variants = [n for n in args.names if n in VARIANTS] if args.names else sorted(VARIANTS)
    mutants = [n for n in args.names if n in MUTANTS] if args.names else list(MUTANTS)
    if args.mutants_only:
        variants = []
    if args.variants_only:
        mutants = []
    if args.smoke:
        variants, mutants = variants[:1], mutants[:1]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    ok = True
    if variants:
        print(f"{'variant':46} {'invariant':15} {'examples':>8} {'shrunk':>7} {'minimised':>9} {'seconds':>8}")
        for name in variants:
            d = hunt(name, args.max_examples)
            ok &= d.examples is not None and d.minimized_events is not None and d.minimized_events <= 20
            print(f"{name:46} {d.machine:15} {d.examples or 'missed':>8} {d.hypothesis_events or '-':>7} "
                  f"{d.minimized_events or '-':>9} {d.seconds:8.1f}", flush=True)
        print("variants (<= 200 examples, <= 20 events):", "met" if ok else "NOT met", flush=True)
    if mutants:
        if variants:
            print()
        print(f"{'mutant':32} {'machine':28} {'result':>7} {'examples':>8} {'seconds':>8}  first failure")
        caught = 0
        for name in mutants:
            c = hunt_mutant(name, args.max_examples)
            hit = c.examples is not None and c.examples <= args.max_examples
            caught += hit
            print(f"{name:32} {c.machine:28} {'caught' if hit else 'MISSED':>7} {c.examples or '-':>8} "
                  f"{c.seconds:8.1f}  {c.error}", flush=True)
        ok &= caught == len(mutants)
        print(f"mutants caught by a machine within {args.max_examples} examples: {caught} of {len(mutants)}")
    print("acceptance:", "met" if ok else "NOT met")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
