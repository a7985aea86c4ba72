"""The CPU backend's verify cost model, measured: a speculative step's time over a plain decode step's, per draft
count, for the draft-count policy (atlas.engine.drafters.policy). The backend runs sequences one after another,
so the ratio is the same at every batch: one row, measured at batch 1. Fixed, not timed at start-up: timings on
a shared machine moved the policy's choices run to run, and the choices must be a function of the run's inputs.
"""

from __future__ import annotations

# a whole engine step (verify, drafting, commit, the engine's own work) over a plain decode step, for 1..8 drafts,
# on atlas-mini: TPOT with k drafts x tokens per verify / TPOT off, every step verifying k drafts, the mean of two
# runs of (on the shared 2-core dev box, other work beside it; the two runs' k = 2 entries were 1.72 and 1.97)
#   OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mini_tpot.py --backend cpu --batches 1 \
#       --drafts 1,2,3,4,5,6,7,8 --static --repeats 5   (and --repeats 7)
# The CPU backend's default cost model: fixed, so the policy's choices are a function of the run's inputs alone
STEP_COSTS = (1.50, 1.84, 2.13, 2.34, 2.52, 2.74, 3.03, 3.37)
