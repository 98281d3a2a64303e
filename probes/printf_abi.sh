#!/usr/bin/env bash
# Probe (GPU machine, nvcc 13): how ptxas compiles APEX's printf runtime under each ABI directive, and what a
# caller keeps live across vprintf.
set -uo pipefail
o=${OUT:-/tmp/out}/a; mkdir -p $o
exec > >(tee "$o/log.txt") 2>&1
nvcc -rdc=true -ptx -arch=sm_90 -o $o/apex_printf.ptx kernels/apex_printf.cu
grep -n "\.func" $o/apex_printf.ptx
for v in none p0 p0c0 p16 p32 p0c0r32; do
  case $v in
    none) d="";; p0) d=".abi_preserve 0";; p0c0|p0c0r32) d=".abi_preserve 0 .abi_preserve_control 0";; p16) d=".abi_preserve 16";; p32) d=".abi_preserve 32";;
  esac
  python3 - "$o/apex_printf.ptx" "$o/v_$v.ptx" "$d" <<'PY'
import sys, re
s = open(sys.argv[1]).read(); d = sys.argv[3]
# directive goes after the parameter list of each .func definition, before its body
out = re.sub(r'(\.visible \.func[^{]*?\))(\s*\{)', lambda m: m.group(1) + (' ' + d if d else '') + m.group(2), s)
open(sys.argv[2], 'w').write(out)
PY
  extra=""; [ $v = p0c0r32 ] && extra="-maxrregcount=32"
  ptxas -arch=sm_90 -c -O3 $extra -o $o/v_$v.cubin $o/v_$v.ptx && echo "== $v ok" || echo "== $v FAIL"
  cuobjdump -sass $o/v_$v.cubin > $o/v_$v.sass.txt 2>&1
  cuobjdump -elf $o/v_$v.cubin | grep -A3 "REGCOUNT\|FRAME_SIZE\|STACK" | grep Value
  wc -l $o/v_$v.sass.txt
done
nvcc -cubin -O3 -arch=sm_90 -o $o/pressure.cubin kernels/conformance/printf_pressure.cu && cuobjdump -sass $o/pressure.cubin > $o/pressure.sass.txt
cuobjdump -elf $o/pressure.cubin | grep -A3 "REGCOUNT\|FRAME\|STACK" | grep Value
ptxas --help | grep -i -A3 "abi\|preserve" | head -40
cd ${OUT:-/tmp/out} && tar czf abi.tgz a && rm -rf a
