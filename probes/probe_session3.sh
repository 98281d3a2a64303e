#!/usr/bin/env bash
# One-off probe for issue 10 (run on the GPU machine): compiles the conformance kernels every way nvcc can, dumps
# what cuobjdump/nvdisasm say, records libcuda's cluster QMD under apex-trace, and packs it all into $OUT.
set -uo pipefail
o=${OUT:-/tmp/out}/p; mkdir -p "$o"; c=kernels/conformance
exec > >(tee "$o/log.txt") 2>&1
nvcc --version | tail -2
ls /usr/local/cuda/lib64 2>/dev/null | grep -i -E "jit|ptx|nvrtc" ; ldconfig -p | grep -i -E "jitlink|nvrtc|ptxcomp|libcuda"
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
for f in printf_kernels module_data cluster templates; do
  nvcc -cubin -O3 -arch=sm_90 -o $o/$f.sm_90.cubin $c/$f.cu || echo "FAIL $f"
  nvcc -ptx -arch=sm_90 -o $o/$f.ptx $c/$f.cu
  cuobjdump -elf $o/$f.sm_90.cubin > $o/$f.elf.txt
  cuobjdump -sass $o/$f.sm_90.cubin > $o/$f.sass.txt
done
nvcc -cubin -O3 -arch=sm_90a -o $o/cluster.sm_90a.cubin $c/cluster.cu
nvcc -cubin -rdc=true -O3 -arch=sm_90 -o $o/apex_printf.sm_90.cubin kernels/apex_printf.cu && \
  cuobjdump -elf $o/apex_printf.sm_90.cubin > $o/apex_printf.elf.txt; cuobjdump -sass $o/apex_printf.sm_90.cubin > $o/apex_printf.sass.txt
nvdisasm -c -hex $o/apex_printf.sm_90.cubin > $o/apex_printf.nvdisasm.txt 2>&1
nvdisasm -c $o/printf_kernels.sm_90.cubin > $o/printf_kernels.nvdisasm.txt 2>&1
nvcc -cubin -rdc=true -O3 -arch=sm_80 -o $o/apex_printf.sm_80.cubin kernels/apex_printf.cu
nvcc -cubin -rdc=true -O3 -arch=sm_100 -o $o/apex_printf.sm_100.cubin kernels/apex_printf.cu
nvcc -cubin -O3 -arch=sm_90 -G -o $o/printf_kernels.G.sm_90.cubin $c/printf_kernels.cu
nvcc -cubin -O3 -arch=sm_90 -lineinfo -o $o/module_data.lineinfo.sm_90.cubin $c/module_data.cu
# fatbins in each compression mode nvcc 13 has
g="-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90"
for m in none default size speed balance; do nvcc -fatbin -O3 $g --compress-mode=$m -o $o/md.$m.fatbin $c/module_data.cu || echo "FAIL mode $m"; done
nvcc -fatbin -O3 $g -Xfatbin -compress-all -o $o/md.compress_all.fatbin $c/module_data.cu
nvcc -fatbin -O3 -gencode arch=compute_90,code=compute_90 -o $o/md.ptxonly.fatbin $c/module_data.cu
nvcc -fatbin -O3 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_100,code=sm_100 -o $o/md.nosm90.fatbin $c/module_data.cu
for f in $o/*.fatbin; do echo "== $f"; cuobjdump -lelf -lptx $f; done
# host binaries with embedded fatbins
nvcc -O2 -arch=sm_90 -o $o/embed_exe $c/embed_host.cu
nvcc -O2 -arch=sm_90 -Xfatbin -compress-all -o $o/embed_exe_compressed $c/embed_host.cu
nvcc -O2 -arch=sm_90 -shared -Xcompiler -fPIC -DEMBED_LIB -o $o/libembed.so $c/embed_host.cu
nvcc -O2 -arch=sm_90 -rdc=true -o $o/embed_exe_rdc $c/embed_host.cu
for f in embed_exe embed_exe_compressed libembed.so embed_exe_rdc; do echo "== $f"; readelf -S -W $o/$f | grep -i nv; cuobjdump -lelf -lptx $o/$f; done
# rdc + nvlink
nvcc -dc -arch=sm_90 -o $o/md.o $c/module_data.cu && nvcc -dlink -arch=sm_90 -cubin -o $o/md.dlink.cubin $o/md.o; ls -l $o/md.dlink.cubin
nvlink -arch=sm_90 -cubin -o $o/md.nvlink.cubin $o/md.o 2>&1 | tail -2; ls -l $o/md.nvlink.cubin
# NVRTC PTX
python3 - "$o" <<'PY'
import ctypes, sys, glob
o = sys.argv[1]
cands = glob.glob('/usr/local/cuda/lib64/libnvrtc.so*') + ['libnvrtc.so', 'libnvrtc.so.13']
lib = None
for c in cands:
    try: lib = ctypes.CDLL(c); print('nvrtc', c); break
    except OSError: pass
src = open('kernels/conformance/module_data.cu').read().replace('#include <stdint.h>', '').encode()
prog = ctypes.c_void_p()
print('create', lib.nvrtcCreateProgram(ctypes.byref(prog), src, b'md.cu', 0, None, None))
opts = (ctypes.c_char_p * 1)(b'--gpu-architecture=compute_90')
print('compile', lib.nvrtcCompileProgram(prog, 1, opts))
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log); print(log.value.decode()[:2000])
n = ctypes.c_size_t(); lib.nvrtcGetPTXSize(prog, ctypes.byref(n)); buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetPTX(prog, buf)
open(o + '/module_data.nvrtc.ptx', 'wb').write(buf.raw.rstrip(b'\0'))
PY
# libcuda's cluster QMDs
nvcc -arch=sm_90 -rdc=true -o $o/cluster_launch probes/cluster_launch.cu $c/cluster.cu && \
  APEX_TRACE_FILE=$o/cluster_trace.jsonl LD_PRELOAD=$PWD/target/release/libapex_trace.so $o/cluster_launch
ls -la $o
cd ${OUT:-/tmp/out} && tar czf probe.tgz p && rm -rf p && ls -la
