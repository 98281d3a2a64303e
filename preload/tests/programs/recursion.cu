// Recursive device functions (stack not statically sized), a large local array, and the stack limit raised.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#ifndef BASE_DEPTH
#define BASE_DEPTH 8
#endif
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("result error %s line %d\n", cudaGetErrorName(e), __LINE__); return 0; } } while (0)
__device__ __noinline__ int walk(int depth, int seed, int *trace) {
  int frame[12];
  for (int i = 0; i < 12; i++) frame[i] = seed * (i + 1) + depth;
  if (depth == 0) return frame[seed & 11];
  int r = walk(depth - 1, frame[(seed + depth) % 12] & 0xffff, trace);
  trace[depth & 7] += r;
  return r ^ frame[depth % 12];
}
__global__ void k_recurse(int *out, int depth, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int trace[8] = {0};
  int r = walk(depth + (i & 3), i, trace);
  for (int j = 0; j < 8; j++) r += trace[j] * (j + 1);
  out[i] = r;
}
__global__ void k_big_local(float *out, int n, int k) {
  float buf[3000];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int j = 0; j < 3000; j++) buf[j] = (float)((i * 31 + j * 7) % 97);
  float s = 0;
  for (int j = 0; j < 3000; j++) s += buf[(j * k + i) % 3000] * 0.5f;
  out[i] = s;
}
static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull; const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; } return h; }
int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  if (iters > 20) iters = 20;
  const int n = 1 << 16;
  int *d; float *f; CHECK(cudaMalloc(&d, n * 4)); CHECK(cudaMalloc(&f, n * 4));
  static int h[1 << 16]; static float hf[1 << 16];
  size_t lim = 0; CHECK(cudaDeviceGetLimit(&lim, cudaLimitStackSize)); printf("result stack_limit %zu\n", lim);
  cudaFuncAttributes a; CHECK(cudaFuncGetAttributes(&a, k_recurse)); printf("result recurse_local %zu\n", a.localSizeBytes);
  // Within CUDA's default 1 KiB stack (nvcc -O2: depths up to 9 fit, H200).
  for (int it = 0; it < iters; it++) k_recurse<<<n / 256, 256>>>(d, BASE_DEPTH - 4, n);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost)); printf("result recurse_default %016llx\n", (unsigned long long)fnv(h, n * 4));
  for (int it = 0; it < iters; it++) k_big_local<<<n / 256, 256>>>(f, n, 7 + it);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(hf, f, n * 4, cudaMemcpyDeviceToHost)); printf("result big_local %016llx\n", (unsigned long long)fnv(hf, n * 4));
  // Deeper: the program raises the stack limit first, as CUDA asks.
  CHECK(cudaDeviceSetLimit(cudaLimitStackSize, 16384));
  for (int it = 0; it < iters; it++) k_recurse<<<n / 256, 256>>>(d, 15 * BASE_DEPTH, n);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost)); printf("result recurse_deep %016llx\n", (unsigned long long)fnv(h, n * 4));
  CHECK(cudaGetLastError());
  printf("result no error\n");
  return 0;
}
