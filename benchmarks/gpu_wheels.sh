#!/usr/bin/env bash
# The wheels benchmarks/gpu_run.sh carries to the GPU machine (`.whl/`, git-ignored): the pure-Python packages Atlas
# imports that the device image lacks (docs of the device tool: its image has torch 2.11, triton 3.6, attrs, rich,
# numpy, safetensors, tokenizers, hypothesis, pytest, transformers 5.17, einops, but not these), built here, where pip
# reaches the registry, for the image's Python 3.12 on x86-64 Linux:
#   bash benchmarks/gpu_wheels.sh            # then: run(command="bash benchmarks/gpu_run.sh", carry=[".whl"])
# structlog and SQLAlchemy (every atlas import path), transformers 5.24.0 (the bench's comparison, the parity tests),
# fla-core 0.6.0 (benchmarks/kernels.py's flash-linear-attention rows). One version of each (two stop the install).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP=${PIP:-python3 -m pip}
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms="$platforms --platform $p"
done
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086  # the platform flags are words
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
  "structlog==26.1.0" "SQLAlchemy==2.1.9" "transformers==5.24.0" "fla-core==0.6.0"
ls -1 .whl
du -sh .whl  # the device tool carries at most 64 MiB of the work tree a call
