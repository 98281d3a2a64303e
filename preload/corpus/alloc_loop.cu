// A CUDA C program that allocates and frees device memory in its loop (issue 30): each iteration cudaMallocs
// buffers of three sizes (4 KiB, 1 MiB, 16 MiB), runs kernels on the first 64 KiB of each (scratch space larger
// than what one step touches, so the loop's time is the allocations', not the kernels'), reads a few bytes back and
// cudaFrees them; two buffers of one size live at once, so a cache that handed one block out twice would give wrong
// results. Prints `result` lines (the
// same bits with and without the preload) and `metric NAME NS` lines for cost_pairs.py.
//   nvcc -O2 -arch=sm_90 -o alloc_loop preload/corpus/alloc_loop.cu
//   python3 preload/corpus/cost_pairs.py --lib target/release/libapex_preload.so -- ./alloc_loop 2000
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__global__ void fill(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)i * 2654435761u ^ seed;
}

__global__ void mix(uint32_t *out, const uint32_t *a, const uint32_t *b, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] * 3u + b[i];
}

static uint64_t fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  const size_t sizes[3] = {4 << 10, 1 << 20, 16 << 20};
  uint64_t h = 1469598103934665603ull;
  std::vector<double> alloc_ns, free_ns, iter_ns;
  size_t free0 = 0, total = 0;
  CHECK(cudaFree(0));
  CHECK(cudaMemGetInfo(&free0, &total));
  for (int it = -2; it < iters; it++) {  // two untimed iterations first
    auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 3; k++) {
      size_t n = sizes[k] / 4, used = n < 16384 ? n : 16384;
      uint32_t *a, *b;
      auto ta = std::chrono::steady_clock::now();
      CHECK(cudaMalloc(&a, sizes[k]));
      CHECK(cudaMalloc(&b, sizes[k]));
      auto tb = std::chrono::steady_clock::now();
      if (a == b) { printf("result error one block handed out twice\n"); return 1; }
      fill<<<64, 256>>>(a, used, (uint32_t)it * 7u + k);
      fill<<<64, 256>>>(b, used, (uint32_t)it * 13u + k + 1);
      mix<<<(unsigned)((used + 255) / 256), 256>>>(a, a, b, used);
      uint32_t peek[4];
      CHECK(cudaMemcpy(peek, a + (size_t)(it & 1023) % (used - 4), sizeof peek, cudaMemcpyDeviceToHost));
      h = fnv(peek, sizeof peek, h);
      auto tc = std::chrono::steady_clock::now();
      CHECK(cudaFree(a));
      CHECK(cudaFree(b));
      auto td = std::chrono::steady_clock::now();
      if (it >= 0) {
        alloc_ns.push_back(std::chrono::duration<double, std::nano>(tb - ta).count() / 2);
        free_ns.push_back(std::chrono::duration<double, std::nano>(td - tc).count() / 2);
      }
    }
    if (it >= 0) iter_ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  // cudaMemGetInfo follows what the program holds: one more 16 MiB buffer takes 16 MiB of what it says is free
  // (whether the block comes from libcuda or from the preload's cache, whose blocks count as free).
  size_t free1 = 0, free2 = 0;
  CHECK(cudaMemGetInfo(&free1, &total));
  void *extra;
  CHECK(cudaMalloc(&extra, 16 << 20));
  CHECK(cudaMemGetInfo(&free2, &total));
  CHECK(cudaFree(extra));
  long long step = (long long)free1 - (long long)free2 - (16ll << 20);
  printf("result peeks %016llx\n", (unsigned long long)h);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("result meminfo %s\n", (step < (4ll << 20) && step > -(4ll << 20)) ? "follows allocations" : "does not follow");
  printf("metric free_drift_mib %.1f\n", ((double)free0 - (double)free1) / (1 << 20));
  printf("metric cudaMalloc %.1f\n", median(alloc_ns));
  printf("metric cudaFree %.1f\n", median(free_ns));
  printf("metric iteration %.1f\n", median(iter_ns));
  printf("iterations %d\n", iters);
  return 0;
}
