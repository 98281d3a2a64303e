// Every way a CUDA program waits for its work, right after kernels the preload sends through APEX: the kernels write
// the iteration number to mapped host memory after spinning a while, so a wait that returns early reads a stale
// value. Also an untimed event ordering two streams, the .item() pattern (copy to the host, synchronize), and a
// printf kernel (left to libcuda) between dependent APEX kernels, whose order must hold.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <chrono>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__global__ void spin_then_write(volatile unsigned *host, unsigned value, long long spin_ns) {
  long long start; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) { long long now; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); if (now - start > spin_ns) break; }
  __threadfence_system();
  *host = value;
  __threadfence_system();
}
__global__ void add(unsigned *p, unsigned v) { atomicAdd(p, v); }
__global__ void copy_scaled(unsigned *dst, const unsigned *src) { *dst = *src * 3u + 1u; }
__global__ void say(const unsigned *p, int i) { printf("printf from libcuda: step %d value %u\n", i, *p); }

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  unsigned *host; CHECK(cudaHostAlloc(&host, 64, cudaHostAllocMapped));
  unsigned *dhost; CHECK(cudaHostGetDevicePointer(&dhost, host, 0));
  unsigned *d; CHECK(cudaMalloc(&d, 64)); CHECK(cudaMemset(d, 0, 64));
  cudaStream_t st, other; CHECK(cudaStreamCreate(&st)); CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  cudaEvent_t ev; CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const long long spin = 20000;  // 20 us
  long stale[6] = {0, 0, 0, 0, 0, 0}, launches = 0;
  unsigned item_sum = 0;
  for (int i = 1; i <= iters; i++) {
    // 0: stream synchronize
    spin_then_write<<<1, 1, 0, st>>>(dhost, 6 * i + 0, spin); launches++;
    CHECK(cudaStreamSynchronize(st)); stale[0] += host[0] != (unsigned)(6 * i + 0);
    // 1: device synchronize
    spin_then_write<<<1, 1, 0, st>>>(dhost, 6 * i + 1, spin); launches++;
    CHECK(cudaDeviceSynchronize()); stale[1] += host[0] != (unsigned)(6 * i + 1);
    // 2: event synchronize (untimed event)
    spin_then_write<<<1, 1, 0, st>>>(dhost, 6 * i + 2, spin); launches++;
    CHECK(cudaEventRecord(ev, st)); CHECK(cudaEventSynchronize(ev)); stale[2] += host[0] != (unsigned)(6 * i + 2);
    // 3: stream query until ready
    spin_then_write<<<1, 1, 0, st>>>(dhost, 6 * i + 3, spin); launches++;
    cudaError_t q; while ((q = cudaStreamQuery(st)) == cudaErrorNotReady) {}
    CHECK(q); stale[3] += host[0] != (unsigned)(6 * i + 3);
    // 4: event query until ready
    spin_then_write<<<1, 1, 0, st>>>(dhost, 6 * i + 4, spin); launches++;
    CHECK(cudaEventRecord(ev, st));
    while ((q = cudaEventQuery(ev)) == cudaErrorNotReady) {}
    CHECK(q); stale[4] += host[0] != (unsigned)(6 * i + 4);
    // 5: the legacy default stream
    spin_then_write<<<1, 1>>>(dhost, 6 * i + 5, spin); launches++;
    CHECK(cudaStreamSynchronize(0)); stale[5] += host[0] != (unsigned)(6 * i + 5);
    // An untimed event orders the non-blocking stream after st; the .item() pattern reads the result.
    add<<<1, 32, 0, st>>>(d, i); launches++;
    CHECK(cudaEventRecord(ev, st)); CHECK(cudaStreamWaitEvent(other, ev, 0));
    copy_scaled<<<1, 1, 0, other>>>(d + 1, d); launches++;
    unsigned v; CHECK(cudaMemcpyAsync(&v, d + 1, 4, cudaMemcpyDeviceToHost, other)); CHECK(cudaStreamSynchronize(other));
    item_sum = item_sum * 31u + v;
    // A printf kernel (libcuda's) between two dependent APEX kernels on st.
    if (i % 50 == 0) { add<<<1, 1, 0, st>>>(d + 2, 1); say<<<1, 1, 0, st>>>(d + 2, i); add<<<1, 1, 0, st>>>(d + 2, 1); launches += 3; CHECK(cudaStreamSynchronize(st)); }
  }
  // Copies and memsets on the streams (APEX's queues run them): uploads from pageable memory, memsets of 1 and 4
  // byte elements, device-to-device copies, downloads, on a created stream and on the legacy one.
  unsigned *a, *b; CHECK(cudaMalloc(&a, 4096)); CHECK(cudaMalloc(&b, 4096));
  static unsigned in[1024], out[1024]; unsigned copies = 0;
  for (int r = 0; r < iters; r++) {
    for (int k = 0; k < 256; k++) in[k] = r * 2654435761u + k;
    CHECK(cudaMemcpyAsync(a, in, 1024, cudaMemcpyHostToDevice, st));
    CHECK(cudaMemsetAsync(b, r & 0xff, 2048, st));
    add<<<1, 32, 0, st>>>(b + 7, r); launches++;
    CHECK(cudaMemcpyAsync(b + 256, a, 1024, cudaMemcpyDeviceToDevice, st));
    CHECK(cudaMemcpyAsync(out, b, 3072, cudaMemcpyDeviceToHost, st));
    CHECK(cudaStreamSynchronize(st));
    for (int k = 0; k < 768; k++) copies = copies * 31u + out[k];
    CHECK(cudaMemset(a, 0x5a, 64));
    CHECK(cudaMemcpy(out, a, 64, cudaMemcpyDeviceToHost));
    copies = copies * 31u + out[3] + out[15];
  }
  printf("result copies %08x\n", copies);
  unsigned tail[3]; CHECK(cudaMemcpy(tail, d, 12, cudaMemcpyDeviceToHost));
  printf("result stale stream %ld device %ld event %ld query %ld eventquery %ld legacy %ld\n", stale[0], stale[1], stale[2], stale[3], stale[4], stale[5]);
  printf("result item %08x counters %u %u %u\n", item_sum, tail[0], tail[1], tail[2]);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("launches %ld\n", launches);
  // Costs of a synchronize right after a launch of an empty grid (median ns of each way), for the record.
  return 0;
}
