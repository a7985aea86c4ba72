#!/usr/bin/env bash
# The one GPU command that trains atlas-mini (issue 16): install the carried wheels, train, write $OUT.
#   run: bash tools/train_gpu.sh            (carry: .whl; about 6.5 minutes on one H200; timeout_s 600)
# The GPU image has torch 2.11 + CUDA 13, Triton 3.6, tokenizers 0.23.2, safetensors 0.8.0, huggingface_hub
# 1.33.0, numpy, pyyaml, tqdm, packaging, typer, regex, but transformers 5.17.0. Atlas pins 5.24.0; its
# Requires-Dist (huggingface-hub>=1.31,<3; tokenizers>=0.23.1,<0.24; safetensors>=0.8.0; regex>=2025.10.22, which
# 5.17.0 requires too; numpy, packaging, pyyaml, tqdm, typer) is all on the image, so .whl carries ONE wheel:
#   transformers==5.24.0     (transformers-5.24.0-py3-none-any.whl)
# Nothing of Atlas is imported (tools/ only), so none of the project's own dependencies need carrying.
# Outputs, all in $OUT (8 files, the largest model.safetensors ~11 MiB): config.json, model.safetensors,
# tokenizer.json, tokenizer_config.json, README.md (model card), metrics.json, heldout_sample.json, train.log.
# MINUTES (default 5) is the training wall-clock budget, TOTAL_MINUTES (8.5) caps the whole run; EXTRA_ARGS go
# to tools/train_mini.py.
set -o pipefail
OUT=${OUT:-/tmp/atlas-mini}
mkdir -p "$OUT"
if [ "${SKIP_INSTALL:-0}" = 1 ]; then  # the caller installed the wheels (and set PYTHONPATH) already
  :
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'tokenizers', tokenizers.__version__, 'cuda', torch.cuda.is_available())" || exit 1
# the run stops itself by wall clock; the timeout only guards a hang, inside the device call's 600 s
# --total-minutes: if setup (corpus, tokenizer, encoding) runs slow, training gives way so the run still ends in time
timeout "${TRAIN_TIMEOUT:-570}" python3 tools/train_mini.py --device cuda --minutes "${MINUTES:-5}" \
  --total-minutes "${TOTAL_MINUTES:-8.5}" --out "$OUT" ${EXTRA_ARGS:-}
status=$?
echo "train_mini exit $status"
ls -la "$OUT"
exit $status
