#!/usr/bin/env bash
# Rebuilds the committed cubins from apex_test_kernels.cu, apex_builtin.cu, gpt2.cu and apex_pdl.cu and records what cuobjdump says of them.
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
# The GPT-2-small decoder of examples/gpt2.rs (issue 11's launch-bound workload).
nvcc -cubin -O3 -arch=sm_90 -o "$out/gpt2.sm_90.cubin" "$here/gpt2.cu"
# Programmatic dependent launch (griddepcontrol) for tests/gpu_pdl.rs and examples/pdl_latency.rs.
nvcc -cubin -O3 -arch=sm_90 -o "$out/apex_pdl.sm_90.cubin" "$here/apex_pdl.cu"
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
# APEX's device runtime for printf/assert: relocatable (its code is appended to modules that call vprintf or
# __assertfail). At most 32 registers so it raises few kernels' register counts; it must not use constant banks
# other than bank 0's driver words (it runs with the calling kernel's banks), which the check below enforces.
nvcc -cubin -rdc=true -O3 -arch=sm_90 -Xptxas -maxrregcount=32 -o "$out/apex_printf.sm_90.cubin" "$here/apex_printf.cu"
if cuobjdump -sass "$out/apex_printf.sm_90.cubin" | grep -E 'c\[0x[1-9a-f]\]'; then
  echo "apex_printf uses a constant bank other than 0: it cannot run inside other modules" >&2; exit 1
fi
cuobjdump -elf "$out/apex_printf.sm_90.cubin" > "$out/apex_printf.sm_90.elf.txt"
