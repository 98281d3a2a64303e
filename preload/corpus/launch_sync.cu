// The CPU cost of a launch and of waiting right after one, as a CUDA program sees them: each figure is the median
// of many timed calls, from the call to its return. Run it with and without apex-preload in alternating processes
// pinned to one core (preload/corpus/pairs.py); compare the medians line by line.
//   nvcc -O2 -arch=sm_90 -o launch_sync preload/corpus/launch_sync.cu -lcuda
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__global__ void empty() {}
__global__ void axpy(float *y, const float *x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }

static double now_ns() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static void spin(double ns) { double t = now_ns(); while (now_ns() - t < ns) {} }
// The program's own work after a launch: plain stores, as an interpreter makes. A launch's last stores to the GPU
// (write-combined lines, a store fence, the uncached doorbell) leave the core after the call returns; stores queued
// behind them wait until they have, so "from call to return" alone can leave part of a launch's cost to whatever the
// program does next. `driver_launch_then_work_ns` is a launch followed by 256 stores, less the stores alone.
static volatile unsigned long work_sink[256];
__attribute__((noinline)) static void work() { for (int i = 0; i < 256; i++) work_sink[i] = i; }

// Median of `n` timings of `body`, each after `before` (untimed).
template <typename B, typename F> static double median(int n, B before, F body) {
  std::vector<double> t(n);
  for (int i = 0; i < n; i++) { before(i); double a = now_ns(); body(i); t[i] = now_ns() - a; }
  std::sort(t.begin(), t.end());
  return t[n / 2];
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 5000;
  cudaStream_t st; CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t ev; CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  float *x, *y; CHECK(cudaMalloc(&x, 4096 * 4)); CHECK(cudaMalloc(&y, 4096 * 4));
  CHECK(cudaMemset(x, 0, 4096 * 4)); CHECK(cudaMemset(y, 0, 4096 * 4));
  cudaFunction_t f; CHECK(cudaGetFuncBySymbol(&f, (const void *)empty));
  CUfunction cf = (CUfunction)f;
  float *hv; CHECK(cudaMallocHost(&hv, 64));
  // Warm every path up (module loading, the preload's attach and queue) untimed.
  for (int i = 0; i < 100; i++) {
    empty<<<1, 1, 0, st>>>(); axpy<<<16, 256, 0, st>>>(y, x, 0.5f, 4096);
    cuLaunchKernel(cf, 1, 1, 1, 1, 1, 1, 0, (CUstream)st, nullptr, nullptr);
    CHECK(cudaMemcpyAsync(hv, y, 4, cudaMemcpyDeviceToHost, st));
    CHECK(cudaEventRecord(ev, st)); CHECK(cudaEventSynchronize(ev)); CHECK(cudaStreamSynchronize(st));
  }
  CHECK(cudaDeviceSynchronize());
  auto idle = [&](int) { CHECK(cudaStreamSynchronize(st)); spin(2000); };
  auto none = [&](int) {};
  auto every = [&](int i) { if (i % 128 == 0) CHECK(cudaStreamSynchronize(st)); };
  printf("metric driver_launch_isolated_ns %.0f\n", median(n, idle, [&](int) {
    cuLaunchKernel(cf, 1, 1, 1, 1, 1, 1, 0, (CUstream)st, nullptr, nullptr); }));
  double work_alone = median(n, idle, [&](int) { work(); });
  printf("metric driver_launch_then_work_ns %.0f\n", median(n, idle, [&](int) {
    cuLaunchKernel(cf, 1, 1, 1, 1, 1, 1, 0, (CUstream)st, nullptr, nullptr); work(); }) - work_alone);
  printf("metric driver_launch_b2b_ns %.0f\n", median(n, every, [&](int) {
    cuLaunchKernel(cf, 1, 1, 1, 1, 1, 1, 0, (CUstream)st, nullptr, nullptr); }));
  printf("metric runtime_launch_isolated_ns %.0f\n", median(n, idle, [&](int i) {
    axpy<<<16, 256, 0, st>>>(y, x, 0.5f + i, 4096); }));
  printf("metric runtime_launch_b2b_ns %.0f\n", median(n, every, [&](int i) {
    axpy<<<16, 256, 0, st>>>(y, x, 0.5f + i, 4096); }));
  CHECK(cudaStreamSynchronize(st));
  printf("metric streamsync_idle_ns %.0f\n", median(n, none, [&](int) { CHECK(cudaStreamSynchronize(st)); }));
  printf("metric launch_streamsync_ns %.0f\n", median(n, idle, [&](int) {
    empty<<<1, 1, 0, st>>>(); CHECK(cudaStreamSynchronize(st)); }));
  printf("metric launch_devicesync_ns %.0f\n", median(n, idle, [&](int) {
    empty<<<1, 1, 0, st>>>(); CHECK(cudaDeviceSynchronize()); }));
  printf("metric launch_eventsync_ns %.0f\n", median(n, idle, [&](int) {
    empty<<<1, 1, 0, st>>>(); CHECK(cudaEventRecord(ev, st)); CHECK(cudaEventSynchronize(ev)); }));
  printf("metric launch_query_ns %.0f\n", median(n, idle, [&](int) {
    empty<<<1, 1, 0, st>>>(); while (cudaStreamQuery(st) == cudaErrorNotReady) {} }));
  printf("metric launch_item_ns %.0f\n", median(n, idle, [&](int) {
    axpy<<<16, 256, 0, st>>>(y, x, 0.5f, 4096);
    CHECK(cudaMemcpyAsync(hv, y, 4, cudaMemcpyDeviceToHost, st)); CHECK(cudaStreamSynchronize(st)); }));
  // Copies and memsets on the stream, one at a time (as `clone()`, `copy_()` and `zero_()` of a small tensor make
  // them), and a memset followed by the program's own work (as `driver_launch_then_work_ns`).
  printf("metric memset_isolated_ns %.0f\n", median(n, idle, [&](int) {
    CHECK(cudaMemsetAsync(y, 0, 4096 * 4, st)); }));
  printf("metric memset_then_work_ns %.0f\n", median(n, idle, [&](int) {
    CHECK(cudaMemsetAsync(y, 0, 4096 * 4, st)); work(); }) - work_alone);
  printf("metric memcpy_d2d_isolated_ns %.0f\n", median(n, idle, [&](int) {
    CHECK(cudaMemcpyAsync(y, x, 4096 * 4, cudaMemcpyDeviceToDevice, st)); }));
  printf("metric memcpy_h2d_pinned_isolated_ns %.0f\n", median(n, idle, [&](int) {
    CHECK(cudaMemcpyAsync(x, hv, 16, cudaMemcpyHostToDevice, st)); }));
  // torch.tensor([token], device="cuda") then a kernel and a wait: a small upload from pageable memory.
  float up[2] = {1.0f, 2.0f};
  printf("metric upload_launch_sync_ns %.0f\n", median(n, idle, [&](int i) {
    up[0] = (float)i; CHECK(cudaMemcpyAsync(x, up, sizeof up, cudaMemcpyHostToDevice, st));
    axpy<<<16, 256, 0, st>>>(y, x, 0.5f, 4096); CHECK(cudaStreamSynchronize(st)); }));
  CHECK(cudaDeviceSynchronize());
  float h[4]; CHECK(cudaMemcpy(h, x, 16, cudaMemcpyDeviceToHost));
  printf("result x %a %a\n", h[0], h[1]);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
