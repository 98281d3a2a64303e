// `__constant__` memory as CUDA C programs use it: coefficients rewritten between launches with cudaMemcpyToSymbol
// (synchronous) and cudaMemcpyToSymbolAsync on the kernels' stream, read back with cudaMemcpyFromSymbol, read by
// kernels uniformly (one address per warp), indexed per thread, as a struct, and through the generic address
// cudaGetSymbolAddress gives; beside a `__device__` counter written both ways. Every kernel depends on the values
// written just before it, so a launch that reads a stale bank changes the bits.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("cuda error %s at line %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

struct Config { double scale; int shift; int pad; };
__constant__ float coef[64];
__constant__ int taps[4];
__constant__ Config cfg;
__device__ unsigned long long counter;

// Uniform reads: every thread reads the same coefficients.
__global__ void uniform(float *y, const float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 0.5f * y[i] + coef[0] * x[i] + coef[1] + (float)cfg.scale * taps[0];
}
// Indexed reads: each thread its own coefficient.
__global__ void indexed(float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = y[i] * coef[(i + cfg.shift) & 63] + (float)taps[i & 3];
}
// Through the generic address of the bank (a pointer like any other).
__global__ void through_pointer(float *y, const float *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += c[(i * 7) & 63];
  if (i == 0) atomicAdd(&counter, (unsigned long long)(c[3] * 1000.0f));
}

static uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  const int n = 1 << 14;
  float *x, *y; CHECK(cudaMalloc(&x, n * 4)); CHECK(cudaMalloc(&y, n * 4));
  static float hx[1 << 14], hy[1 << 14];
  for (int i = 0; i < n; i++) hx[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
  CHECK(cudaMemcpy(x, hx, n * 4, cudaMemcpyHostToDevice)); CHECK(cudaMemset(y, 0, n * 4));
  cudaStream_t st; CHECK(cudaStreamCreate(&st));
  float *coef_at; CHECK(cudaGetSymbolAddress((void **)&coef_at, coef));
  unsigned long long zero = 0; CHECK(cudaMemcpyToSymbol(counter, &zero, 8));
  uint64_t readback = 1469598103934665603ull;
  long launches = 0;
  float c[64]; int t[4];
  for (int it = 0; it < iters; it++) {
    for (int k = 0; k < 64; k++) c[k] = 0.25f + 0.001f * ((it * 13 + k * 7) % 97);
    for (int k = 0; k < 4; k++) t[k] = (it + k) % 5 - 2;
    Config g = {0.5 + 0.01 * (it % 11), it % 64, 0};
    if (it % 2) {
      CHECK(cudaMemcpyToSymbol(coef, c, sizeof c));
      CHECK(cudaMemcpyToSymbol(taps, t, sizeof t));
      CHECK(cudaMemcpyToSymbol(cfg, &g, sizeof g));
    } else {
      // On the kernels' stream: ordered with them, the host buffers reused only after the synchronize below.
      CHECK(cudaMemcpyToSymbolAsync(coef, c, sizeof c, 0, cudaMemcpyHostToDevice, st));
      CHECK(cudaMemcpyToSymbolAsync(taps, t, sizeof t, 0, cudaMemcpyHostToDevice, st));
      CHECK(cudaMemcpyToSymbolAsync(cfg, &g, sizeof g, 0, cudaMemcpyHostToDevice, st));
    }
    uniform<<<n / 256, 256, 0, st>>>(y, x, n); launches++;
    indexed<<<n / 128, 128, 0, st>>>(y, n); launches++;
    through_pointer<<<n / 256, 256, 0, st>>>(y, coef_at, n); launches++;
    // Rewritten mid-stream, between two launches that read it.
    float one = 1.0f + 0.125f * (it % 3);
    CHECK(cudaMemcpyToSymbolAsync(coef, &one, 4, 0, cudaMemcpyHostToDevice, st));
    uniform<<<n / 256, 256, 0, st>>>(y, x, n); launches++;
    CHECK(cudaStreamSynchronize(st));
    if (it % 50 == 0) {
      float back[64]; Config gb;
      CHECK(cudaMemcpyFromSymbol(back, coef, sizeof back));
      CHECK(cudaMemcpyFromSymbol(&gb, cfg, sizeof gb));
      readback = fnv(back, sizeof back, readback);
      readback = fnv(&gb, sizeof gb, readback);
    }
  }
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(hy, y, n * 4, cudaMemcpyDeviceToHost));
  unsigned long long count = 0; CHECK(cudaMemcpyFromSymbol(&count, counter, 8));
  printf("result y %016llx\n", (unsigned long long)fnv(hy, sizeof hy));
  printf("result y[0..3] %a %a %a %a\n", hy[0], hy[1], hy[2], hy[3]);
  printf("result readback %016llx\n", (unsigned long long)readback);
  printf("result counter %llu\n", count);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("launches %ld\n", launches);
  return 0;
}
