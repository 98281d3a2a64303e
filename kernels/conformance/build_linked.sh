#!/usr/bin/env bash
# Builds linked_locals.sm_90.cubin: linked_a.cu and linked_b.cu compiled as relocatable objects and linked by nvlink
# into one executable cubin: two sets of compiler constants under the same names (`__unnamed_1`, `$str`) and two
# `static` counters, which nvlink renames apart.
# Needs nvcc/nvlink/cuobjdump (CUDA 13); run on the GPU machine:  bash kernels/conformance/build_linked.sh [outdir]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
tmp=$(mktemp -d)
for x in a b; do
  nvcc -cubin -rdc=true -O3 -arch=sm_90 -o "$tmp/linked_$x.cubin" "$here/linked_$x.cu"
done
nvlink -arch=sm_90 -o "$out/linked_locals.sm_90.cubin" "$tmp/linked_a.cubin" "$tmp/linked_b.cubin"
{
  echo "# cuobjdump $(nvcc --version | tail -1)"
  cuobjdump -elf "$out/linked_locals.sm_90.cubin"
} > "$out/linked_locals.sm_90.elf.txt"
rm -rf "$tmp"
