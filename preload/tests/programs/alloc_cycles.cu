// Allocation cycles for the leak test of the preload's allocation cache (gpu_preload.rs,
// nothing_leaks_across_a_million_allocation_cycles): CYCLES cudaMalloc/cudaFree cycles, then CYCLES
// cudaMallocAsync/cudaFreeAsync cycles, of mixed sizes (a few one-off sizes among them) on four streams (a blocking
// one, a non-blocking one, the legacy default stream and the per-thread default stream), some blocks freed on another
// stream than their own after an event, kernels writing and checking a pattern in some blocks (a block handed to two
// owners at once would fail a check). Before the cycles (after a warm-up that does everything the cycles do once) and
// after them, the program synchronizes, trims the default pool to nothing (cudaMemPoolTrimTo: the preload gives back
// what its cache holds first) and measures the free device memory (cudaMemGetInfo), the process's mappings
// (/proc/self/maps lines) and open file descriptors; it prints the differences as `metric` lines, the check failures
// as a `result` line, and the answers to a second free of each kind (`second_free`, `second_free_async` lines).
//   nvcc -O2 -arch=sm_90 -o alloc_cycles preload/tests/programs/alloc_cycles.cu
//   ./alloc_cycles 1000000
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

// Words a kernel writes and checks at the start of a block.
#define WORDS 64

__global__ void write_pattern(uint32_t *p, uint32_t v) {
  p[threadIdx.x] = v ^ (threadIdx.x * 2654435761u);
}

__global__ void check_pattern(const uint32_t *p, uint32_t v, unsigned *failures) {
  if (p[threadIdx.x] != (v ^ (threadIdx.x * 2654435761u))) atomicAdd(failures, 1u);
}

// Lines of /proc/self/maps, read without the C library's buffers (which could map memory themselves).
static long maps_lines() {
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return -1;
  char buf[4096];
  long lines = 0;
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0)
    for (ssize_t i = 0; i < n; i++) lines += buf[i] == '\n';
  close(fd);
  return lines;
}

// Open file descriptors (the directory's own included, on both sides of a difference).
static long open_fds() {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  long n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

struct Snapshot { size_t free_bytes; long maps, fds; };

// Synchronizes, trims the default pool to nothing and measures.
static cudaError_t settle(cudaMemPool_t pool, Snapshot *s) {
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemPoolTrimTo(pool, 0);
  size_t total = 0;
  if (e == cudaSuccess) e = cudaMemGetInfo(&s->free_bytes, &total);
  s->maps = maps_lines();
  s->fds = open_fds();
  return e;
}

static const size_t SIZES[6] = {256, 1000, 4096, 65536, 1 << 20, (3 << 20) + 512};
static cudaStream_t streams[4];
static cudaEvent_t ev;
static unsigned *failures;

// Where one-off sizes start (the warm-up's apart from the cycles').
static size_t oneoff = 5u << 20;

// A size for cycle i: the six in turn, and every 8192nd cycle one never asked for before (kept by no cache).
static size_t size_of(long i) {
  if (i % 8192 == 4095) return oneoff + (size_t)(i / 8192 + 1) * 4096;
  return SIZES[i % 6];
}

static int sync_cycles(long from, long to) {
  for (long i = from; i < to; i++) {
    uint32_t *p;
    CHECK(cudaMalloc(&p, size_of(i)));
    if (i % 64 == 0) {
      cudaStream_t s = streams[(i / 64) % 4];
      write_pattern<<<1, WORDS, 0, s>>>(p, (uint32_t)i);
      check_pattern<<<1, WORDS, 0, s>>>(p, (uint32_t)i, failures);
    }
    CHECK(cudaFree(p));
  }
  return 0;
}

static int async_cycles(long from, long to) {
  for (long i = from; i < to; i++) {
    cudaStream_t s = streams[i % 4], other = streams[(i + 1) % 4];
    uint32_t *p;
    CHECK(cudaMallocAsync(&p, size_of(i), s));
    bool used = i % 32 == 0 || i % 16 == 8;
    if (used) write_pattern<<<1, WORDS, 0, s>>>(p, (uint32_t)i);
    if (i % 16 == 8) {
      // Checked and freed on another stream after an event: the block's next owner on s waits for that.
      CHECK(cudaEventRecord(ev, s));
      CHECK(cudaStreamWaitEvent(other, ev, 0));
      check_pattern<<<1, WORDS, 0, other>>>(p, (uint32_t)i, failures);
      CHECK(cudaFreeAsync(p, other));
    } else {
      if (used) check_pattern<<<1, WORDS, 0, s>>>(p, (uint32_t)i, failures);
      CHECK(cudaFreeAsync(p, s));
    }
    if (i % 65536 == 65535) CHECK(cudaDeviceSynchronize());
  }
  return 0;
}

static double ns_per(std::chrono::steady_clock::time_point t0, long n) {
  return n > 0 ? std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n : 0;
}

int main(int argc, char **argv) {
  long cycles = argc > 1 ? atol(argv[1]) : 1000000;
  CHECK(cudaFree(0));
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  CHECK(cudaStreamCreate(&streams[0]));
  CHECK(cudaStreamCreateWithFlags(&streams[1], cudaStreamNonBlocking));
  streams[2] = 0;                    // the legacy default stream
  streams[3] = cudaStreamPerThread;  // this thread's default stream
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CHECK(cudaMalloc(&failures, sizeof(unsigned)));
  CHECK(cudaMemset(failures, 0, sizeof(unsigned)));
  // Everything the cycles do, once (streams taken over, queues and their staging made, events kept, a one-off size),
  // so that the baseline holds it; the warm-up's one-off sizes are its own.
  const long warm = 4096 + 64;
  oneoff = 7u << 20;
  if (sync_cycles(0, warm) || async_cycles(0, warm)) return 1;
  oneoff = 5u << 20;
  unsigned seen = 0;
  CHECK(cudaMemcpy(&seen, failures, sizeof seen, cudaMemcpyDeviceToHost));
  Snapshot before, after;
  CHECK(settle(pool, &before));
  auto t0 = std::chrono::steady_clock::now();
  if (sync_cycles(0, cycles)) return 1;
  double sync_ns = ns_per(t0, cycles);
  t0 = std::chrono::steady_clock::now();
  if (async_cycles(0, cycles)) return 1;
  double async_ns = ns_per(t0, cycles);
  CHECK(cudaMemcpy(&seen, failures, sizeof seen, cudaMemcpyDeviceToHost));
  CHECK(settle(pool, &after));
  printf("result check_failures %u\n", seen);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  // A second free of a block, while a cache would hold it (its size a loop's): refused as libcuda refuses it.
  void *p = nullptr;
  for (int k = 0; k < 3; k++) {
    CHECK(cudaMalloc(&p, 4096));
    CHECK(cudaFree(p));
  }
  printf("second_free %s\n", cudaGetErrorName(cudaFree(p)));
  cudaGetLastError();
  for (int k = 0; k < 3; k++) {
    CHECK(cudaMallocAsync(&p, 4096, streams[0]));
    CHECK(cudaFreeAsync(p, streams[0]));
  }
  printf("second_free_async %s\n", cudaGetErrorName(cudaFreeAsync(p, streams[0])));
  cudaGetLastError();
  CHECK(cudaDeviceSynchronize());
  printf("result error_after %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("metric free_drift_bytes %lld\n", (long long)before.free_bytes - (long long)after.free_bytes);
  printf("metric maps_drift %ld\n", after.maps - before.maps);
  printf("metric fds_drift %ld\n", after.fds - before.fds);
  printf("metric sync_cycle_ns %.1f\n", sync_ns);
  printf("metric async_cycle_ns %.1f\n", async_ns);
  printf("cycles %ld\n", cycles);
  return 0;
}
