#!/usr/bin/env bash
# Issue 12 attach probes (docs/attach-cuda.md): builds and runs find_client, cuda_memory and attach_channel on
# the GPU machine, from the repository root. Logs go to $OUT/attach (or /tmp/attach-out). Needs gcc, the CUDA
# headers (/usr/local/cuda/include or $CUDA_HOME/include) and libcuda. Changes no GPU setting.
#   bash probes/attach/run.sh [ping-pong iterations, default 2000]
set -uo pipefail
o=${OUT:-/tmp/attach-out}/attach; mkdir -p "$o"
exec > >(tee "$o/log.txt") 2>&1
H=open-gpu-headers/open-gpu-kernel-modules
CUDA_INC=${CUDA_HOME:-/usr/local/cuda}/include
INC="-I probes/attach -I $H/src/common/sdk/nvidia/inc -I $H/src/nvidia/arch/nvalloc/unix/include \
 -I $H/kernel-open/nvidia-uvm -I $H/kernel-open/common/inc -I $CUDA_INC"
cat /proc/driver/nvidia/version 2>/dev/null | head -1
grep -i -E "RegistryDwords|EnableStreamMemOPs" /proc/driver/nvidia/params 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader 2>/dev/null
for p in find_client cuda_memory attach_channel; do
  gcc -O2 -std=gnu11 -Wall $INC -o "$o/$p" "probes/attach/$p.c" -lcuda || { echo "BUILD FAILED: $p"; continue; }
done
(dmesg 2>/dev/null | grep -i xid | tail -3) > "$o/xid_before.txt"
for p in find_client cuda_memory "attach_channel ${1:-2000}"; do
  echo "===== $p"
  timeout 180 "$o/"$p; echo "===== exit $?"
done
(dmesg 2>/dev/null | grep -i xid | tail -5) > "$o/xid_after.txt"
echo "Xid lines after (compare with xid_before.txt):"; cat "$o/xid_after.txt"
