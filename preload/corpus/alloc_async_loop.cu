// A CUDA C program that allocates with cudaMallocAsync and frees with cudaFreeAsync in its loop (issue 30): each
// iteration, on one stream, allocates two buffers of each of three sizes (4 KiB, 1 MiB, 16 MiB), runs small kernels on
// the first 64 KiB of each, copies 16 bytes of the result back and frees them in stream order; a fourth buffer is
// filled on that stream and read on a second one (ordered by an event) and freed there, so its block comes back to the
// first stream only once the second one's work is done. Then both streams are synchronized and the bytes read back
// hashed. Two buffers of one size live at once, so a cache that handed one block out twice, or handed a block to a
// stream before its last use was complete, would give wrong results. Prints `result` lines (the same bits with and
// without the preload) and `metric NAME NS` lines for cost_pairs.py.
//   nvcc -O2 -arch=sm_90 -o alloc_async_loop preload/corpus/alloc_async_loop.cu
//   python3 preload/corpus/cost_pairs.py --lib target/release/libapex_preload.so -- ./alloc_async_loop 2000
//   python3 preload/corpus/cost_pairs.py --lib target/release/libapex_preload.so -- ./alloc_async_loop 2000 keep
// `keep` raises the default pool's release threshold to UINT64_MAX (as tuned programs do), so that plain CUDA keeps the
// pool's memory across the synchronizations instead of giving it back to the OS at each one (CUDA's default).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// Reads a buffer another stream filled (after an event) into a persistent accumulator.
__global__ void gather(uint32_t *acc, const uint32_t *c, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) acc[i] = acc[i] * 5u + c[i];
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

static double ns(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  bool keep = argc > 2 && strcmp(argv[2], "keep") == 0;
  const size_t sizes[3] = {4 << 10, 1 << 20, 16 << 20};
  const size_t cross = 64 << 10, cross_n = cross / 4;
  CHECK(cudaFree(0));
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  if (keep) {
    uint64_t all = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &all));
  }
  cudaStream_t s, t;
  CHECK(cudaStreamCreate(&s));
  CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  cudaEvent_t filled;
  CHECK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));
  uint32_t *acc, *peek;
  CHECK(cudaMalloc(&acc, cross));
  CHECK(cudaMemset(acc, 0, cross));
  CHECK(cudaMallocHost(&peek, 3 * 4 * sizeof(uint32_t)));
  uint64_t h = 1469598103934665603ull;
  std::vector<double> alloc_ns, free_ns, iter_ns;
  for (int it = -2; it < iters; it++) {  // two untimed iterations first
    auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 3; k++) {
      size_t n = sizes[k] / 4, used = n < 16384 ? n : 16384;
      uint32_t *a, *b;
      auto ta = std::chrono::steady_clock::now();
      CHECK(cudaMallocAsync(&a, sizes[k], s));
      CHECK(cudaMallocAsync(&b, sizes[k], s));
      auto tb = std::chrono::steady_clock::now();
      if (a == b) { printf("result error one block handed out twice\n"); return 1; }
      fill<<<64, 256, 0, s>>>(a, used, (uint32_t)it * 7u + k);
      fill<<<64, 256, 0, s>>>(b, used, (uint32_t)it * 13u + k + 1);
      mix<<<(unsigned)((used + 255) / 256), 256, 0, s>>>(a, a, b, used);
      CHECK(cudaMemcpyAsync(peek + 4 * k, a + (size_t)(it & 1023) % (used - 4), 4 * sizeof(uint32_t),
                            cudaMemcpyDeviceToHost, s));
      auto tc = std::chrono::steady_clock::now();
      CHECK(cudaFreeAsync(a, s));
      CHECK(cudaFreeAsync(b, s));
      auto td = std::chrono::steady_clock::now();
      if (it >= 0) {
        alloc_ns.push_back(ns(ta, tb) / 2);
        free_ns.push_back(ns(tc, td) / 2);
      }
    }
    // Filled on s, read on t, freed on t: the next iteration's allocation on s may have the block only once t's
    // read is complete.
    uint32_t *c;
    CHECK(cudaMallocAsync(&c, cross, s));
    fill<<<16, 256, 0, s>>>(c, cross_n, (uint32_t)it * 31u);
    CHECK(cudaEventRecord(filled, s));
    CHECK(cudaStreamWaitEvent(t, filled, 0));
    gather<<<(unsigned)((cross_n + 255) / 256), 256, 0, t>>>(acc, c, cross_n);
    CHECK(cudaFreeAsync(c, t));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamSynchronize(t));
    h = fnv(peek, 3 * 4 * sizeof(uint32_t), h);
    if (it >= 0) iter_ns.push_back(ns(t0, std::chrono::steady_clock::now()));
  }
  static uint32_t hacc[16384];
  CHECK(cudaMemcpy(hacc, acc, cross, cudaMemcpyDeviceToHost));
  CHECK(cudaDeviceSynchronize());
  // Every allocation was freed and its work is complete: the pool has nothing in use (the preload gives back what it
  // holds before the pool is asked).
  uint64_t used = 1;
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  printf("result peeks %016llx\n", (unsigned long long)h);
  printf("result acc %016llx\n", (unsigned long long)fnv(hacc, sizeof hacc, 1469598103934665603ull));
  printf("result pool_used_after %llu\n", (unsigned long long)used);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("metric cudaMallocAsync %.1f\n", median(alloc_ns));
  printf("metric cudaFreeAsync %.1f\n", median(free_ns));
  printf("metric iteration %.1f\n", median(iter_ns));
  printf("iterations %d\n", iters);
  CHECK(cudaFreeHost(peek));
  CHECK(cudaFree(acc));
  return 0;
}
