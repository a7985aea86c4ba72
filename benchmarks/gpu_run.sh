#!/usr/bin/env bash
# One device call (the GPU machine has torch/triton but not the project): install the carried wheels
# (.whl, git-ignored), run the CUDA tests, then `atlas bench gpu`. Logs and JSON under $OUT.
#   run: bash benchmarks/gpu_run.sh            (carry: .whl; build it here first: bash benchmarks/gpu_wheels.sh)
# TESTS=0 skips the tests; BENCH=0 skips the benchmark; BENCH_ARGS are passed to atlas.bench (e.g.
# "--no-transformers --variants default,eager --long-prefill 8192"); EXTRA: more commands;
# FEATURES=0 skips benchmarks/cuda_features.py (issue 14: speculation K=1/2/4 x oracle acceptance, prefix TTFT,
# snapshot costs); MINI=1: atlas-mini's CPU figures (benchmarks/mini_figures.py) on this machine's spare cores;
# TRAIN=1: retrain atlas-mini beside the rest (tools/train_gpu.sh, the card's step count pinned: issue 16's
# reproduction check), its card, metrics and log back as $OUT/train_{README.md,metrics.json,train.log}.
set -o pipefail
OUT=${OUT:-/tmp/atlas-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
ln -sfn "$PWD/kernels" /tmp/site/atlas_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ATLAS_TEST_OUT=$OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
if [ "${MINI:-0}" = 1 ]; then  # atlas-mini's CPU figures (issue 16), one process per part on this machine's cores
  for part in mtp2 mtp4 ngram2 ngram4; do
    OMP_NUM_THREADS=1 timeout "${MINI_TIMEOUT:-500}" python3 benchmarks/mini_figures.py --parts $part ${MINI_ARGS:-} \
      > "/tmp/mini_$part.log" 2>&1 &
  done
  for shard in 0 1 2 3 4 5 6 7; do
    OMP_NUM_THREADS=1 timeout "${MINI_TIMEOUT:-500}" python3 benchmarks/mini_figures.py --parts watchdog \
      --watchdog-shard $shard/8 ${MINI_ARGS:-} > "/tmp/mini_watchdog$shard.log" 2>&1 &
  done
fi
if [ "${TRAIN:-0}" = 1 ]; then  # the GPU is shared with what follows: the step count, not the clock, is pinned
  steps=$(python3 -c "import json; print(json.load(open('models/atlas-mini/metrics.json'))['training']['steps'])")
  SKIP_INSTALL=1 OUT=/tmp/atlas-mini-rerun TOTAL_MINUTES=${TRAIN_TOTAL_MINUTES:-9.3} \
    EXTRA_ARGS="--steps $steps ${TRAIN_ARGS:-}" bash tools/train_gpu.sh > /tmp/train_rerun.log 2>&1 &
  train_pid=$!
fi
if [ "${TESTS:-1}" = 1 ]; then
  # each file compiles its shapes (minutes a file on an H100: 4 of test_cuda_gpu.py's tests took 170 s): pick files
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --durations=8 ${TEST_FILES:-tests/test_cuda_verify_regions.py tests/test_cuda_gpu.py tests/test_plan_ownership.py tests/test_cuda_regions.py} \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed|Error|alone-vs-batch|FAILED|assert" "$OUT/tests.log" | tail -25
fi
if [ -n "${EXTRA:-}" ]; then  # more GPU commands of this call (e.g. a benchmark of one issue), output under $OUT
  bash -c "$EXTRA"; echo "extra exit $?"
fi
if [ "${BENCH:-1}" = 1 ]; then
  # the default arrangement (docs/PERFORMANCE.md): ceilings, decode b1/b16/b64 against the floors from this card's
  # copy bandwidth, prefill 2,048 / 8,192 / 32,752 against its matmul rate, kernel counts, transformers (with
  # flash-linear-attention from the wheels); BENCH_ARGS="--variants default,eager" puts arrangements side by side
  timeout "${BENCH_TIMEOUT:-480}" python3 -m atlas.bench "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; grep -v "capacities derived" "$OUT/bench.log" | tail -60
fi
if [ "${FEATURES:-1}" = 1 ]; then
  timeout "${FEATURES_TIMEOUT:-420}" python3 benchmarks/cuda_features.py --out "$OUT" ${FEATURES_ARGS:-} > "$OUT/features.log" 2>&1
  echo "features exit $?"; grep -v "capacities derived\|drafter context" "$OUT/features.log" | tail -30
fi
if [ "${MINI:-0}" = 1 ]; then
  wait
  for part in mtp2 mtp4 ngram2 ngram4 watchdog0 watchdog1 watchdog2 watchdog3 watchdog4 watchdog5 watchdog6 watchdog7; do grep -v "capacities derived\|MTP drafter" "/tmp/mini_$part.log"; done \
    > "$OUT/mini.log"
  echo "atlas-mini figures:"; cat "$OUT/mini.log"
fi
if [ "${TRAIN:-0}" = 1 ]; then
  wait "$train_pid"; echo "train exit $?"
  for f in README.md metrics.json train.log; do cp "/tmp/atlas-mini-rerun/$f" "$OUT/train_$f" 2>/dev/null; done
  tail -5 /tmp/train_rerun.log; grep -E "held out:|test sample:" /tmp/train_rerun.log
fi
