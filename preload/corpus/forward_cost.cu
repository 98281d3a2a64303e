// What the preload adds to a driver call it only forwards: per-call CPU time of stream and event calls that libcuda
// runs either way, on streams APEX took over and on streams it did not. NCCL and PyTorch make such calls around
// every collective and every cross-stream dependency; on libcuda each costs a few hundred nanoseconds, so any
// bookkeeping the preload adds shows.
//
// Under the preload, run with APEX_PRELOAD_TAKEOVER=first (set for both processes of a pair; libcuda ignores it) so
// that the setup's launch on the legacy stream attaches and takes that stream over. Then:
//   record_unrelated_ns       cudaEventRecord(plain, s1)            s1 non-blocking, never launched on
//   wait_unrelated_ns         cudaStreamWaitEvent(s2, plain)        s2 non-blocking, never launched on
//   event_query_ns            cudaEventQuery(plain), complete       an event libcuda recorded
//   stream_query_ns           cudaStreamQuery(s1), idle
//   wait_record_taken_ns      cudaStreamWaitEvent(legacy, plain) + cudaEventRecord(other, legacy), per pair: the
//                             taken-over stream gets CUDA work, so the record is libcuda's too
//   launch_refused_ns         cuLaunchKernelEx on s1 of a kernel the preload leaves to libcuda (printf), 2 attributes
//   ctx_get_current_ns        cuCtxGetCurrent (not interposed: libcuda's own in both processes; the preload asks it
//                             to find the context of a call on a stream it did not take over)
// Each: the median over rounds of `iters` calls (a device synchronize between rounds, not timed), per call.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/fc preload/corpus/forward_cost.cu -lcuda
//   APEX_PRELOAD_TAKEOVER=first python3 preload/corpus/cost_pairs.py --lib libapex_preload.so -- /tmp/fc 200 31
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t check_err_ = (x); if (check_err_ != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(check_err_), __LINE__); exit(1); } } while (0)
#define CU(x) do { CUresult cu_err_ = (x); if (cu_err_ != CUDA_SUCCESS) { printf("driver error %d at %d\n", (int)cu_err_, __LINE__); exit(1); } } while (0)

__global__ void fill(int *p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = i * 3 + 1;
}

// Left to libcuda by the preload (device-side printf), as NCCL's kernels are; the printf is never reached.
__global__ void bump(int *p, int flag) {
  if (threadIdx.x == 0) p[0] += 1;
  if (flag == 12345) printf("never\n");
}

static double now_ns() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F> static double per_call(int iters, int rounds, int calls_per_iter, F f) {
  std::vector<double> v;
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    for (int i = 0; i < iters; i++) f();
    double t1 = now_ns();
    CHECK(cudaDeviceSynchronize());
    v.push_back((t1 - t0) / (iters * calls_per_iter));
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  int rounds = argc > 2 ? atoi(argv[2]) : 31;
  if (iters < 1 || rounds < 1) { printf("usage: %s [iters per round] [rounds]\n", argv[0]); return 2; }
  const int n = 4096;
  int *buf, *counter;
  CHECK(cudaMalloc(&buf, n * 4));
  CHECK(cudaMalloc(&counter, 4));
  CHECK(cudaMemset(counter, 0, 4));
  fill<<<n / 256, 256>>>(buf, n);  // the legacy stream: taken over under the preload (first)
  CHECK(cudaDeviceSynchronize());
  cudaStream_t s1, s2;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t plain, other;
  CHECK(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&other, cudaEventDisableTiming));
  CHECK(cudaEventRecord(plain, s1));
  CHECK(cudaDeviceSynchronize());

  cudaFunction_t bf;
  CHECK(cudaGetFuncBySymbol(&bf, (const void *)bump));
  int flag = 0;
  void *params[] = {&counter, &flag};
  CUlaunchAttribute attrs[2] = {};
  attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
  attrs[0].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  attrs[1].id = CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN;
  attrs[1].value.memSyncDomain = CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE;
  CUlaunchConfig c = {};
  c.gridDimX = 1; c.gridDimY = 1; c.gridDimZ = 1;
  c.blockDimX = 32; c.blockDimY = 1; c.blockDimZ = 1;
  c.hStream = (CUstream)s1; c.attrs = attrs; c.numAttrs = 2;
  long launches = 0;

  // A warm-up round of each, untimed (lazy set-up in libcuda and in the preload).
  for (int w = 0; w < 2; w++) {
    CHECK(cudaEventRecord(plain, s1));
    CHECK(cudaStreamWaitEvent(s2, plain, 0));
    CHECK(cudaStreamWaitEvent(0, plain, 0));
    CHECK(cudaEventRecord(other, 0));
    CU(cuLaunchKernelEx(&c, (CUfunction)bf, params, nullptr));
    launches++;
    CHECK(cudaDeviceSynchronize());
    (void)cudaEventQuery(plain);
    (void)cudaStreamQuery(s1);
  }

  double record = per_call(iters, rounds, 1, [&] { CHECK(cudaEventRecord(plain, s1)); });
  double wait = per_call(iters, rounds, 1, [&] { CHECK(cudaStreamWaitEvent(s2, plain, 0)); });
  double equery = per_call(iters, rounds, 1, [&] { CHECK(cudaEventQuery(plain)); });
  double squery = per_call(iters, rounds, 1, [&] { CHECK(cudaStreamQuery(s1)); });
  double taken = per_call(iters, rounds, 2, [&] {
    CHECK(cudaStreamWaitEvent(0, plain, 0));
    CHECK(cudaEventRecord(other, 0));
  });
  double refused = per_call(iters, rounds, 1, [&] {
    CU(cuLaunchKernelEx(&c, (CUfunction)bf, params, nullptr));
    launches++;
  });
  CUcontext cur;
  double getcur = per_call(iters, rounds, 1, [&] { CU(cuCtxGetCurrent(&cur)); });
  printf("metric record_unrelated_ns %.1f\n", record);
  printf("metric wait_unrelated_ns %.1f\n", wait);
  printf("metric event_query_ns %.1f\n", equery);
  printf("metric stream_query_ns %.1f\n", squery);
  printf("metric wait_record_taken_ns %.1f\n", taken);
  printf("metric launch_refused_ns %.1f\n", refused);
  printf("metric ctx_get_current_ns %.1f\n", getcur);

  // The work's outcome, compared between the two processes of a pair.
  std::vector<int> host(n);
  int count = 0;
  CHECK(cudaMemcpy(host.data(), buf, n * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&count, counter, 4, cudaMemcpyDeviceToHost));
  unsigned long long h = 1469598103934665603ull;
  for (int v : host) h = (h ^ (unsigned)v) * 1099511628211ull;
  printf("result fill %016llx counter %d of %ld\n", h, count, launches);
  return count == launches ? 0 : 1;
}
