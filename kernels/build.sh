#!/usr/bin/env bash
# Rebuilds the committed cubins from apex_test_kernels.cu and apex_builtin.cu and records what cuobjdump says of them.
# Needs nvcc/cuobjdump (CUDA 13); run on the GPU machine:  bash kernels/build.sh [outdir]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
src=$here/apex_test_kernels.cu
for sm in 80 90 100; do
  nvcc -cubin -O3 -arch=sm_$sm -o "$out/apex_test_kernels.sm_$sm.cubin" "$src"
done
nvcc -cubin -O3 -arch=sm_90 -o "$out/apex_builtin.sm_90.cubin" "$here/apex_builtin.cu"
nvcc -fatbin -O3 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
     -gencode arch=compute_90,code=compute_90 -o "$out/apex_test_kernels.fatbin" "$src"
nvcc -ptx -arch=sm_90 -o "$out/apex_test_kernels.ptx" "$src"
{
  echo "# cuobjdump $(nvcc --version | tail -1)"
  cuobjdump -elf "$out/apex_test_kernels.sm_90.cubin"
} > "$out/apex_test_kernels.sm_90.elf.txt"
cuobjdump -res-usage "$out/apex_test_kernels.sm_90.cubin" > "$out/apex_test_kernels.sm_90.res-usage.txt"
cuobjdump -sass "$out/apex_test_kernels.sm_90.cubin" > "$out/apex_test_kernels.sm_90.sass.txt"
ls -l "$out"
