#!/usr/bin/env bash
# Which cost does APEX_PRELOAD=off still add to the CUDA calls of nccl_pattern.cu? Runs in about 30-60 s on a GPU
# machine (nvcc, gcc, python3; no perf needed):
#
#   bash preload/corpus/off_bisect.sh [LIB [LIB2]] [-- CORE]
#     LIB   the preload to judge (default .gpu/libapex_preload.so)
#     LIB2  another build to compare with (e.g. the offfix branch's target/release/libapex_preload.so)
#
# Steps, each printing one verdict:
#   1. the library: checksum, and whether APEX_PRELOAD=off writes a summary at exit (added with a54cf52 "Issue 28":
#      a build without it predates the off-mode hand-out, and every wrapper then runs the engine per call);
#   2. what the CUDA runtime gets from cuGetProcAddress for the per-collective entry points (legacy flag 0 and
#      per-thread flag 2), in which library each pointer lives: plain, LIB off, LIB on; and whether libcuda's own
#      cuGetProcAddress answers with an interposed symbol (a shim that only exports cuEventRecord), which would make
#      every exported wrapper reach the program whatever the preload hands out;
#   3. per-call cost of the runtime calls one collective makes (off_calls.cu): cudaGetFuncBySymbol (the runtime calls
#      cuKernelGetFunction each time), cudaEventRecord + cudaStreamWaitEvent, cudaStreamGetCaptureInfo, and a direct
#      cuLaunchKernelEx, plain vs off;
#   4. /tmp/np (nccl_pattern.cu) per collective, interleaved plain / LIB off / LIB2 off, pinned to one core.
set -u
cd "$(dirname "$0")/../.."
LIB=${1:-.gpu/libapex_preload.so}
LIB2=${2:-}
CORE=${CORE:-3}
LIB=$(readlink -f "$LIB")
[ -n "$LIB2" ] && LIB2=$(readlink -f "$LIB2")
W=$(mktemp -d /tmp/off-bisect.XXXX)
pin() { if command -v taskset > /dev/null; then taskset -c "$CORE" "$@"; else "$@"; fi; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null | head -1

# ---- build what the steps run (nvcc in parallel) ----
[ -x /tmp/np ] || nvcc -O2 -arch=sm_90 -o /tmp/np preload/corpus/nccl_pattern.cu -lcuda > "$W/np.log" 2>&1 &
cat > "$W/off_calls.cu" << 'EOF'
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
__global__ void k(int *p) { if (p) *p = 1; }
static double ns() { return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
template <class F> double per_call(F f, int n) {
  std::vector<double> r;
  for (int round = 0; round < 7; round++) {
    double t0 = ns(); for (int i = 0; i < n; i++) f(); r.push_back((ns() - t0) / n);
    cudaDeviceSynchronize();  // between rounds, untimed: launches never wait for a full queue
  }
  std::sort(r.begin(), r.end()); return r[r.size() / 2];
}
int main() {
  cudaSetDevice(0);
  cudaStream_t s, t; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking);
  cudaEvent_t e; cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaFunction_t f; cudaGetFuncBySymbol(&f, (const void *)k);
  k<<<1, 1, 0, s>>>(nullptr); cudaDeviceSynchronize();
  printf("call cudaGetFuncBySymbol %.1f\n", per_call([&] { cudaGetFuncBySymbol(&f, (const void *)k); }, 20000));
  printf("call cudaEventRecord+cudaStreamWaitEvent %.1f\n", per_call([&] { cudaEventRecord(e, s); cudaStreamWaitEvent(t, e, 0); }, 20000));
  cudaDeviceSynchronize();
  printf("call cudaStreamGetCaptureInfo %.1f\n", per_call([&] { cudaStreamCaptureStatus st; unsigned long long id;
#if CUDART_VERSION >= 13000
    cudaStreamGetCaptureInfo(s, &st, &id, nullptr, nullptr, nullptr, nullptr);
#else
    cudaStreamGetCaptureInfo_v2(s, &st, &id, nullptr, nullptr, nullptr);
#endif
  }, 20000));
  printf("call cudaGetDevice %.1f\n", per_call([&] { int d; cudaGetDevice(&d); }, 20000));
  int *p = nullptr; void *params[] = {&p};
  CUlaunchConfig c = {}; c.gridDimX = c.gridDimY = c.gridDimZ = 1; c.blockDimX = c.blockDimY = c.blockDimZ = 1; c.hStream = (CUstream)s;
  double l = per_call([&] { cuLaunchKernelEx(&c, (CUfunction)f, params, nullptr); }, 500);
  cudaDeviceSynchronize();
  printf("call cuLaunchKernelEx(direct) %.1f\n", l);
  printf("result %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
EOF
nvcc -O2 -arch=sm_90 -o "$W/off_calls" "$W/off_calls.cu" -lcuda > "$W/calls.log" 2>&1 &
cat > "$W/gpa_who.c" << 'EOF'
// As the CUDA runtime finds the driver: dlopen libcuda, dlsym cuGetProcAddress_v2, ask for each entry point with
// flag 0 and flag 2 (per-thread default stream); prints the library each answer lives in.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef int (*gpa_t)(const char *, void **, int, uint64_t, int *);
static const char *where(void *p) {
  Dl_info i; static char b[256];
  if (!p || !dladdr(p, &i) || !i.dli_fname) return "?";
  const char *f = strrchr(i.dli_fname, '/'); snprintf(b, sizeof b, "%s:%s", f ? f + 1 : i.dli_fname, i.dli_sname ? i.dli_sname : "?");
  return b;
}
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
  printf("gpa %s\n", where((void *)gpa));
  const char *names[] = {"cuEventRecord", "cuStreamWaitEvent", "cuStreamGetCaptureInfo", "cuStreamIsCapturing",
                         "cuKernelGetFunction", "cuLibraryGetKernel", "cuLibraryLoadData", "cuLaunchKernel",
                         "cuLaunchKernelEx", "cuEventQuery", "cuEventCreate", "cuCtxGetCurrent", 0};
  for (int i = 0; names[i]; i++)
    for (uint64_t fl = 0; fl <= 2; fl += 2) {
      void *p = 0; int st = 0;
      int r = gpa(names[i], &p, 13000, fl, &st);
      printf("entry %-24s flag %d -> %s%s\n", names[i], (int)fl, r ? "error " : "", where(p));
    }
  return 0;
}
EOF
gcc -O2 -o "$W/gpa_who" "$W/gpa_who.c" -ldl
cat > "$W/shim.c" << 'EOF'
int cuEventRecord(void *e, void *s) { (void)e; (void)s; return 999; }
EOF
gcc -O2 -shared -fPIC -o "$W/libshim.so" "$W/shim.c"
wait

echo "== 1. the library"
for L in "$LIB" ${LIB2:+"$LIB2"}; do
  rm -f "$W/stats.json"
  APEX_PRELOAD=off APEX_PRELOAD_STATS="$W/stats.json" LD_PRELOAD="$L" /tmp/np 10 3 > /dev/null 2>&1
  if [ -s "$W/stats.json" ]; then verdict="writes an off-mode summary (a54cf52 or later)"; else verdict="NO off-mode summary: built before a54cf52 (stale; every wrapper handed out and run through the engine)"; fi
  echo "$(md5sum "$L" | cut -c1-12) $(stat -c '%y' "$L" | cut -c1-19) $L: $verdict"
done

echo "== 2. what the runtime gets from cuGetProcAddress (library:symbol)"
"$W/gpa_who" > "$W/who_plain.txt"
APEX_PRELOAD=off LD_PRELOAD="$LIB" "$W/gpa_who" > "$W/who_off.txt"
LD_PRELOAD="$LIB" "$W/gpa_who" > "$W/who_on.txt"
[ -n "$LIB2" ] && APEX_PRELOAD=off LD_PRELOAD="$LIB2" "$W/gpa_who" > "$W/who_off2.txt"
paste -d'|' "$W/who_plain.txt" <(cut -d'>' -f2 "$W/who_off.txt") <(cut -d'>' -f2 "$W/who_on.txt") ${LIB2:+<(cut -d'>' -f2 "$W/who_off2.txt")} |
  awk -F'|' '{ printf "%-62s| off:%-44s| on:%-44s%s\n", $1, $2, $3, ($4 == "" ? "" : "| LIB2 off:" $4) }'
LD_PRELOAD="$W/libshim.so" "$W/gpa_who" | grep "cuEventRecord .*flag 0" |
  sed 's/^/libcuda with a shim exporting cuEventRecord: /'
echo "(libshim.so there: libcuda's cuGetProcAddress resolves through its GOT, so every wrapper the preload exports reaches the program)"

echo "== 3. per-call cost (ns, median of 7 rounds): plain | LIB off${LIB2:+ | LIB2 off}"
pin "$W/off_calls" > "$W/calls_plain.txt" 2>&1
APEX_PRELOAD=off LD_PRELOAD="$LIB" pin "$W/off_calls" > "$W/calls_off.txt" 2>&1
[ -n "$LIB2" ] && APEX_PRELOAD=off LD_PRELOAD="$LIB2" pin "$W/off_calls" > "$W/calls_off2.txt" 2>&1
paste "$W/calls_plain.txt" <(awk '{print $NF}' "$W/calls_off.txt") ${LIB2:+<(awk '{print $NF}' "$W/calls_off2.txt")} | column -t

echo "== 4. /tmp/np 100 20, ns per collective, 3 interleaved rounds: plain | LIB off${LIB2:+ | LIB2 off} | LIB on"
for r in 1 2 3; do
  a=$(pin /tmp/np 100 20 | awk '/collective_ns/{print $3}')
  b=$(APEX_PRELOAD=off LD_PRELOAD="$LIB" pin /tmp/np 100 20 | awk '/collective_ns/{print $3}')
  c=""; [ -n "$LIB2" ] && c=$(APEX_PRELOAD=off LD_PRELOAD="$LIB2" pin /tmp/np 100 20 | awk '/collective_ns/{print $3}')
  d=$(LD_PRELOAD="$LIB" pin /tmp/np 100 20 | awk '/collective_ns/{print $3}')
  echo "round $r: $a | $b${LIB2:+ | $c} | $d"
done
echo "(work files in $W)"
