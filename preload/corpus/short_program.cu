// A short CUDA program, as a command-line tool or a test is: it starts, makes a few streams, launches a few hundred
// kernels on them, copies the result back, prints a hash and exits. Its whole-process time is what the preload's
// one-time set-up (attaching to the context, a queue per stream taken over) adds to; run it with and without
// apex-preload in alternating processes pinned to one core and compare the wall times (`/usr/bin/time -f %e`, or
// the `wall_us` line it prints: from before the first CUDA call to after the last).
//   nvcc -O2 -arch=sm_90 -o short_program preload/corpus/short_program.cu
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__global__ void step(float *y, const float *x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i] * 0.5f;
}

int main(int argc, char **argv) {
  int streams = argc > 1 ? atoi(argv[1]) : 3;
  int launches = argc > 2 ? atoi(argv[2]) : 300;
  if (streams < 1 || streams > 16 || launches < 1) { printf("usage: short_program [streams 1-16] [launches]\n"); return 2; }
  auto t0 = std::chrono::steady_clock::now();
  const int n = 1 << 16;
  std::vector<float *> x(streams), y(streams);
  std::vector<cudaStream_t> s(streams);
  std::vector<float> host(n);
  for (int i = 0; i < n; i++) host[i] = (float)(i % 97) * 0.25f;
  for (int k = 0; k < streams; k++) {
    CHECK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    CHECK(cudaMalloc(&x[k], n * sizeof(float)));
    CHECK(cudaMalloc(&y[k], n * sizeof(float)));
    CHECK(cudaMemcpyAsync(x[k], host.data(), n * sizeof(float), cudaMemcpyHostToDevice, s[k]));
    CHECK(cudaMemsetAsync(y[k], 0, n * sizeof(float), s[k]));
  }
  for (int i = 0; i < launches; i++) {
    int k = i % streams;
    step<<<(n + 255) / 256, 256, 0, s[k]>>>(y[k], x[k], 1.0f + (float)i / 1024.0f, n);
  }
  CHECK(cudaGetLastError());
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every stream's result
  for (int k = 0; k < streams; k++) {
    CHECK(cudaMemcpyAsync(host.data(), y[k], n * sizeof(float), cudaMemcpyDeviceToHost, s[k]));
    CHECK(cudaStreamSynchronize(s[k]));
    const unsigned char *b = (const unsigned char *)host.data();
    for (size_t j = 0; j < n * sizeof(float); j++) { h ^= b[j]; h *= 1099511628211ull; }
  }
  for (int k = 0; k < streams; k++) {
    CHECK(cudaFree(x[k]));
    CHECK(cudaFree(y[k]));
    CHECK(cudaStreamDestroy(s[k]));
  }
  auto t1 = std::chrono::steady_clock::now();
  printf("result short_program %016llx\n", (unsigned long long)h);
  printf("wall_us %.0f\n", std::chrono::duration<double, std::micro>(t1 - t0).count());
  return 0;
}
