// The driver calls of one small `dist.all_reduce` (PyTorch's ProcessGroupNCCL + NCCL 2.28, not captured, one stream
// per communicator, NCCL_LAUNCH_ORDER_IMPLICIT off) in one process on one GPU, without NCCL: what the preload forwards
// per collective. Per iteration, in the order they run:
//   PyTorch  cudaStreamIsCapturing(compute)                      cuStreamIsCapturing          (not wrapped)
//            cudaEventRecord(sync, compute)                      cuEventRecord                (syncStream)
//            cudaStreamWaitEvent(nccl, sync)                     cuStreamWaitEvent
//   NCCL     cudaGetDevice, cudaSetDevice x3                     (runtime; no driver call when unchanged)
//            cudaStreamGetCaptureInfo(nccl)                      cuStreamGetCaptureInfo       (not wrapped)
//            cudaEventRecord(scratch, device) +                  cuEventRecord,               (ncclLaunchPrepare:
//            cudaStreamWaitEvent(nccl, scratch)                  cuStreamWaitEvent             nccl waits on device)
//            cudaGetFuncBySymbol                                 (runtime, cached)
//            cuLaunchKernelEx(3 attributes, packed `extra`)      cuLaunchKernelEx             (refused by the preload)
//            cudaEventRecord(scratch, nccl) +                    cuEventRecord,               (ncclLaunchFinish:
//            cudaStreamWaitEvent(device, scratch)                cuStreamWaitEvent             device advances)
//   PyTorch  cudaEventRecord(end, nccl)                          cuEventRecord                (work end event)
//            cudaStreamWaitEvent(compute, end)                   cuStreamWaitEvent            (work.wait())
// plus, every 10 collectives, NCCL's callback poll (cudaThreadExchangeStreamCaptureMode x2, cudaEventQuery), every 64 a
// new scratch event (NCCL's KernelFinishCallback: cudaEventCreateWithFlags, later cudaEventDestroy), and PyTorch's
// watchdog thread querying the last end event every 100 ms. The compute stream is the legacy default stream, which
// the preload took over at the setup's launch (as PyTorch's tensor creation); NCCL's streams are non-blocking. By
// default the collective kernel calls printf on a branch never taken: the preload refuses it for a reason with text
// (`device_runtime`), so it runs on libcuda and NCCL's streams are never taken over (as with NCCL builds whose
// kernels the preload refuses). With `apex` as the third argument the kernel has no printf: under the preload (with
// `first`) it runs on APEX and NCCL's stream is taken over, as NCCL 2.28's kernels are.
//
// stdout: `metric collective_ns` (median over rounds of `iters` back-to-back collectives then a device synchronize,
// per collective), `metric collective_sync_ns` (median of one collective then a synchronize), `result` lines.
//   nvcc -O2 -arch=sm_90 -o /tmp/np preload/corpus/nccl_pattern.cu -lcuda
//   python3 preload/corpus/cost_pairs.py --lib target/release/libapex_preload.so --pairs 7 -- /tmp/np 100 40
//   APEX_PRELOAD_TAKEOVER=first python3 preload/corpus/cost_pairs.py --lib ... -- /tmp/np 100 40 apex
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t check_err_ = (x); if (check_err_ != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(check_err_), __LINE__); exit(1); } } while (0)
#define CU(x) do { CUresult cu_err_ = (x); if (cu_err_ != CUDA_SUCCESS) { printf("driver error %d at %d\n", (int)cu_err_, __LINE__); exit(1); } } while (0)

constexpr int N = 1024;  // floats per message: 4 KiB

// NCCL's kernel stand-in: one block per channel adds the input into the output. The printf is never reached (flag is
// 0); it only makes the preload leave the kernel to libcuda, as it leaves NCCL's.
__global__ void collective(float *out, const float *in, int n, int flag) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] += in[i];
  if (flag == 12345) printf("never\n");
}
// The same without printf: a kernel the preload takes over.
__global__ void collective_plain(float *out, const float *in, int n, int flag) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] += in[i];
}
// PyTorch's tensor creation on the compute stream (taken over by the preload).
__global__ void fill(float *p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] = (float)(i % 7);
}

// The kernel's parameters as NCCL passes them: one packed buffer at the parameter table's offsets.
struct Args { float *out; const float *in; int n; int flag; };

static double now_ns() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Pattern {
  cudaStream_t compute = 0;  // the legacy default stream, as PyTorch's current stream
  cudaStream_t nccl, device;
  cudaEvent_t sync, scratch, end[8], callback = nullptr;
  CUfunction fn;
  const void *kernel = nullptr;
  Args args;
  size_t args_size = sizeof(Args);
  long calls = 0;
  int dev = 0;
  std::atomic<cudaEvent_t> last_end{nullptr};

  void launch() {
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &args, CU_LAUNCH_PARAM_BUFFER_SIZE, &args_size, CU_LAUNCH_PARAM_END};
    CUlaunchAttribute attrs[3] = {};
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[0].value.clusterDim.x = 1; attrs[0].value.clusterDim.y = 1; attrs[0].value.clusterDim.z = 1;
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attrs[1].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
    attrs[2].id = CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN;
    attrs[2].value.memSyncDomain = CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE;
    CUlaunchConfig c = {};
    c.gridDimX = 2; c.gridDimY = 1; c.gridDimZ = 1;
    c.blockDimX = 512; c.blockDimY = 1; c.blockDimZ = 1;
    c.hStream = (CUstream)nccl; c.attrs = attrs; c.numAttrs = 3;
    CU(cuLaunchKernelEx(&c, fn, nullptr, extra));
  }

  // One all_reduce as PyTorch and NCCL issue it.
  void one() {
    cudaStreamCaptureStatus st;
    CHECK(cudaStreamIsCapturing(compute, &st));
    CHECK(cudaEventRecord(sync, compute));
    CHECK(cudaStreamWaitEvent(nccl, sync, 0));
    int d; CHECK(cudaGetDevice(&d)); CHECK(cudaSetDevice(dev));
    unsigned long long id; cudaGraph_t g;
#if CUDART_VERSION >= 13000
    CHECK(cudaStreamGetCaptureInfo(nccl, &st, &id, &g, nullptr, nullptr, nullptr));
#else
    CHECK(cudaStreamGetCaptureInfo_v2(nccl, &st, &id, &g, nullptr, nullptr));
#endif
    CHECK(cudaSetDevice(dev));
    CHECK(cudaEventRecord(scratch, device));
    CHECK(cudaStreamWaitEvent(nccl, scratch, 0));
    cudaFunction_t f; CHECK(cudaGetFuncBySymbol(&f, kernel));
    CHECK(cudaSetDevice(dev));
    launch();
    cudaEvent_t finished = scratch;
    CHECK(cudaEventRecord(finished, nccl));
    if (calls % 64 == 63) {
      // NCCL's KernelFinishCallback keeps the recorded scratch event and makes a new one.
      if (callback) CHECK(cudaEventDestroy(callback));
      callback = finished;
      CHECK(cudaEventCreateWithFlags(&scratch, cudaEventDisableTiming));
    }
    CHECK(cudaStreamWaitEvent(device, finished, 0));
    cudaEvent_t e = end[calls % 8];
    CHECK(cudaEventRecord(e, nccl));
    last_end.store(e);
    CHECK(cudaStreamWaitEvent(compute, e, 0));
    if (calls % 10 == 9) {
      // NCCL's callback poll at group end (GROUP_MAX_RECLAIM_STEPS).
      cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
      CHECK(cudaThreadExchangeStreamCaptureMode(&m));
      if (callback) { cudaError_t q = cudaEventQuery(callback); if (q != cudaSuccess && q != cudaErrorNotReady) CHECK(q); }
      CHECK(cudaThreadExchangeStreamCaptureMode(&m));
    }
    calls++;
  }
};

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 100;
  int rounds = argc > 2 ? atoi(argv[2]) : 40;
  bool on_apex = argc > 3 && strcmp(argv[3], "apex") == 0;
  if (iters < 1 || rounds < 1 || (argc > 3 && !on_apex)) {
    printf("usage: %s [iters per round] [rounds] [apex]\n", argv[0]);
    return 2;
  }
  Pattern p;
  CHECK(cudaSetDevice(0));
  CHECK(cudaStreamCreateWithFlags(&p.nccl, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&p.device, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&p.sync, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&p.scratch, cudaEventDisableTiming));
  for (auto &e : p.end) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  float *in, *out;
  CHECK(cudaMalloc(&in, N * 4)); CHECK(cudaMalloc(&out, N * 4));
  fill<<<(N + 255) / 256, 256>>>(in, N);  // the compute stream's tensor (through APEX under the preload)
  CHECK(cudaMemsetAsync(out, 0, N * 4, p.compute));
  cudaFunction_t f;
  CHECK(cudaGetFuncBySymbol(&f, on_apex ? (const void *)collective_plain : (const void *)collective));
  p.fn = (CUfunction)f;
  p.kernel = on_apex ? (const void *)collective_plain : (const void *)collective;
  p.args = Args{out, in, N, 0};
  CHECK(cudaDeviceSynchronize());

  // PyTorch's watchdog: queries the last collective's end event every 100 ms.
  std::atomic<bool> stop{false};
  std::thread watchdog([&] {
    CHECK(cudaSetDevice(0));
    while (!stop.load()) {
      cudaEvent_t e = p.last_end.load();
      if (e) { cudaError_t q = cudaEventQuery(e); if (q != cudaSuccess && q != cudaErrorNotReady) CHECK(q); }
      for (int i = 0; i < 100 && !stop.load(); i++) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });

  for (int i = 0; i < 50; i++) p.one();  // warm-up (untimed), as allreduce.py's
  CHECK(cudaDeviceSynchronize());
  std::vector<double> per_call, alone;
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    for (int i = 0; i < iters; i++) p.one();
    CHECK(cudaDeviceSynchronize());
    per_call.push_back((now_ns() - t0) / iters);
  }
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    p.one();
    CHECK(cudaDeviceSynchronize());
    alone.push_back(now_ns() - t0);
  }
  stop.store(true);
  watchdog.join();
  std::sort(per_call.begin(), per_call.end());
  std::sort(alone.begin(), alone.end());
  printf("metric collective_ns %.0f\n", per_call[per_call.size() / 2]);
  printf("metric collective_sync_ns %.0f\n", alone[alone.size() / 2]);
  // Every collective added `in` to `out` once: out[i] = calls * (i % 7), exact in float32 below 2^24.
  std::vector<float> h(N);
  CHECK(cudaMemcpy(h.data(), out, N * 4, cudaMemcpyDeviceToHost));
  unsigned long long hash = 1469598103934665603ull;
  bool exact = true;
  for (int i = 0; i < N; i++) {
    if (h[i] != (float)p.calls * (float)(i % 7)) exact = false;
    unsigned u; memcpy(&u, &h[i], 4);
    for (int b = 0; b < 4; b++) { hash ^= (u >> (8 * b)) & 0xff; hash *= 1099511628211ull; }
  }
  printf("result collectives %ld\n", p.calls);
  printf("result out %016llx %s\n", hash, exact ? "exact" : "WRONG");
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  return exact ? 0 : 1;
}
