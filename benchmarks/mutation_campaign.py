"""Mutation campaign: how many generated workloads (hypothesis examples) it takes to catch each broken variant
of the engine, and how small its failing trace minimises.

    .venv/bin/python benchmarks/mutation_campaign.py [VARIANT ...] [--max-examples 200] [--smoke]

Acceptance (issue 8): every variant detected within 200 examples and minimised to at most 20 events.
The variants, scenarios and generator live in tests/fixtures (broken.py, library.py, campaign.py).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=sorted(VARIANTS))
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="the first variant only (CI: the machinery runs)")
    args = parser.parse_args()
    if args.smoke:
        args.variants = args.variants[:1]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(sorted(VARIANTS))}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    ok = True
    print(f"{'variant':46} {'invariant':15} {'examples':>8} {'shrunk':>7} {'minimised':>9} {'seconds':>8}")
    for name in args.variants:
        d = hunt(name, args.max_examples)
        ok &= d.examples is not None and d.minimized_events is not None and d.minimized_events <= 20
        print(f"{name:46} {d.machine:15} {d.examples or 'missed':>8} {d.hypothesis_events or '-':>7} "
              f"{d.minimized_events or '-':>9} {d.seconds:8.1f}")
    print("acceptance (<= 200 examples, <= 20 events):", "met" if ok else "NOT met")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
