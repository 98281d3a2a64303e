#!/usr/bin/env bash
# Rebuilds apex-preload's PTX from its CUDA C (needs nvcc from CUDA 13; run on the GPU machine):
#   bash preload/kernels/build.sh [outdir]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
# compute_75, the oldest target CUDA 13 builds: libcuda compiles the PTX for the GPU at hand.
nvcc -ptx -arch=compute_75 -o "$out/assert_replay.ptx" "$here/assert_replay.cu"
