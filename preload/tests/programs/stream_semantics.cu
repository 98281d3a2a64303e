// What CUDA promises about order between streams, the host and the copy engines, checked on work the preload sends
// through APEX: the legacy default stream's implicit waits (blocking streams and the per-thread default stream),
// host functions and stream callbacks between kernels, stream memory operations (write and wait on a value) across
// streams, events recorded on the legacy stream, timed events, an explicit graph and a captured one launched between
// kernels, pageable copies (their source free at return, their destination filled at return), pitched 2D and 3D
// copies and memsets, a cooperative kernel's grid barrier, and host threads each with a stream of their own.
//
// Every producer kernel waits a while before it writes, so a consumer ordered wrongly reads the previous value; every
// check folds what its consumers read into a hash that depends on order. The program prints one `result` line per
// check: the same bits with and without the preload, or ordering went wrong. Built as it is, or with nvcc's
// `--default-stream per-thread` (stream 0 is then each thread's own default stream; the legacy one is named).
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("cuda error %s at line %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define CHECK_CU(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char *s = "?"; cuGetErrorName(r, &s); \
  printf("cuda driver error %s at line %d\n", s, __LINE__); exit(1); } } while (0)

__device__ void spin(long long ns) {
  long long start; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) { long long now; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); if (now - start > ns) break; }
}
// A producer: writes `v` after `ns` nanoseconds.
__global__ void late_write(unsigned *p, unsigned v, long long ns) { spin(ns); *(volatile unsigned *)p = v; }
__global__ void late_write_host(volatile unsigned *p, unsigned v, long long ns) {
  spin(ns); __threadfence_system(); *p = v; __threadfence_system();
}
// A consumer: derives a value from what it reads.
__global__ void derive(unsigned *dst, const unsigned *src, unsigned mul, unsigned add) {
  *dst = *(volatile const unsigned *)src * mul + add;
}
// Folds a value into an order-dependent hash.
__global__ void fold(unsigned long long *acc, const unsigned *src, unsigned salt) {
  *acc = (*acc ^ (unsigned long long)(*(volatile const unsigned *)src + salt)) * 1099511628211ull;
}
// Folds `n` words (one thread, in order).
__global__ void fold_words(unsigned long long *acc, const unsigned *src, int n, unsigned salt) {
  unsigned long long h = *acc;
  for (int i = 0; i < n; i++) h = (h ^ (unsigned long long)(src[i] + salt)) * 1099511628211ull;
  *acc = h;
}
// Adds (row * 31 + column) * step to every element of a pitched 2D array.
__global__ void touch_pitched(unsigned char *base, size_t pitch, int width_words, int height, unsigned step) {
  int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
  if (x < width_words && y < height) ((unsigned *)(base + y * pitch))[x] += (unsigned)(y * 31 + x) * step;
}
// Sums `data` across the whole grid behind the grid barrier: block 0 reads every block's partial after the sync.
__global__ void grid_sum(const unsigned *data, unsigned *partial, unsigned *out, int n) {
  cg::grid_group grid = cg::this_grid();
  __shared__ unsigned s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  for (int i = grid.thread_rank(); i < n; i += grid.size()) atomicAdd(&s, data[i] * (unsigned)(i + 1));
  __syncthreads();
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned t = 0;
    for (unsigned b = 0; b < gridDim.x; b++) t = t * 33u + ((volatile unsigned *)partial)[b];
    *out = t;
  }
}
__global__ void fill(unsigned *p, unsigned v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] = v * 2654435761u + (unsigned)i;
}

static uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

// The legacy default stream: stream 0, unless stream 0 is the per-thread one.
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
#define LEGACY cudaStreamLegacy
#else
#define LEGACY 0
#endif

static long launches = 0, captured = 0;
static const long long SPIN = 8000;  // 8 us: far longer than a launch takes to reach the GPU

// State the host function and the stream callback share with the loop.
struct HostSide {
  volatile unsigned *mapped;   // [0]: written by a kernel; [1]: written by the host function for the next kernel
  uint64_t seen = 1469598103934665603ull;
  uint64_t callbacks = 1469598103934665603ull;
};
static void CUDART_CB host_fn(void *p) {
  HostSide *h = (HostSide *)p;
  unsigned v = h->mapped[0];
  h->seen = fnv(&v, 4, h->seen);
  h->mapped[1] = v * 7u + 3u;
}
static void CUDART_CB stream_callback(cudaStream_t, cudaError_t status, void *p) {
  HostSide *h = (HostSide *)p;
  unsigned v = h->mapped[2] ^ (unsigned)status;
  h->callbacks = fnv(&v, 4, h->callbacks);
}

// A host thread's stream (its per-thread default stream, or one it creates): a chain of producers and consumers,
// folded; returns the hash it read back.
static void thread_chain(int t, int steps, bool own_default, uint64_t *out) {
  cudaStream_t s = cudaStreamPerThread;
  if (!own_default) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *buf; unsigned long long *acc;
  CHECK(cudaMallocAsync((void **)&buf, 64, s)); CHECK(cudaMallocAsync((void **)&acc, 8, s));
  CHECK(cudaMemsetAsync(acc, 0, 8, s));
  for (int i = 0; i < steps; i++) {
    late_write<<<1, 1, 0, s>>>(buf, (unsigned)(i * 13 + t), SPIN / 2);
    derive<<<1, 1, 0, s>>>(buf + 1, buf, 5u + t, 1u);
    fold<<<1, 1, 0, s>>>(acc, buf + 1, (unsigned)i);
  }
  unsigned long long h = 0;
  CHECK(cudaMemcpyAsync(&h, acc, 8, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaFreeAsync(buf, s)); CHECK(cudaFreeAsync(acc, s)); CHECK(cudaStreamSynchronize(s));
  if (!own_default) CHECK(cudaStreamDestroy(s));
  *out = h;
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  if (iters > 2000) iters = 2000;  // the checks are about order, not volume
  CHECK_CU(cuInit(0));
  int dev = 0, sms = 0, coop = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));

  // Streams: A and B blocking (B at the greatest priority), C non-blocking.
  int least = 0, greatest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t A, B, C;
  CHECK(cudaStreamCreate(&A));
  CHECK(cudaStreamCreateWithPriority(&B, cudaStreamDefault, greatest));
  CHECK(cudaStreamCreateWithFlags(&C, cudaStreamNonBlocking));
  cudaEvent_t on_legacy, c_done, t0, t1;
  CHECK(cudaEventCreateWithFlags(&on_legacy, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&c_done, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&t0, cudaEventBlockingSync));
  CHECK(cudaEventCreateWithFlags(&t1, cudaEventBlockingSync));

  unsigned *buf, *flag; unsigned long long *acc;
  const int ACCS = 12;
  CHECK(cudaMalloc(&buf, 64 * 4)); CHECK(cudaMemset(buf, 0, 64 * 4));
  CHECK(cudaMalloc(&flag, 4)); CHECK(cudaMemset(flag, 0, 4));
  CHECK(cudaMalloc(&acc, ACCS * 8)); CHECK(cudaMemset(acc, 0, ACCS * 8));

  HostSide host;
  unsigned *mapped; CHECK(cudaHostAlloc(&mapped, 64, cudaHostAllocMapped)); memset(mapped, 0, 64);
  unsigned *mapped_dev; CHECK(cudaHostGetDevicePointer(&mapped_dev, mapped, 0));
  host.mapped = mapped;

  // Pageable host buffers for the copies whose source or destination the host reuses at once.
  std::vector<unsigned> pageable_src(16), pageable_dst(4);
  unsigned *staged; CHECK(cudaMalloc(&staged, 16 * 4));
  uint64_t pageable_reads = 1469598103934665603ull;

  // Pitched 2D arrays, a dense copy and a 3D pair.
  const int W = 48, H = 20;  // words × rows
  size_t pitch = 0; unsigned char *pitched; CHECK(cudaMallocPitch((void **)&pitched, &pitch, W * 4, H));
  unsigned *dense; CHECK(cudaMalloc(&dense, W * H * 4));
  cudaExtent extent = make_cudaExtent(16 * 4, 8, 4);
  cudaPitchedPtr vol_a, vol_b; CHECK(cudaMalloc3D(&vol_a, extent)); CHECK(cudaMalloc3D(&vol_b, extent));
  CHECK(cudaMemset3D(vol_a, 0, extent)); CHECK(cudaMemset3D(vol_b, 0, extent));
  std::vector<unsigned> vol_host(16 * 8 * 4);

  // The cooperative kernel's buffers.
  const int CN = 4096;
  unsigned *cdata, *partial, *csum;
  CHECK(cudaMalloc(&cdata, CN * 4)); CHECK(cudaMalloc(&partial, sms * 4)); CHECK(cudaMalloc(&csum, 4));

  // An explicit graph: derive g1 from g0, copy g1 to g2, derive g3 from g2.
  unsigned *g; CHECK(cudaMalloc(&g, 16)); CHECK(cudaMemset(g, 0, 16));
  cudaGraph_t graph; CHECK(cudaGraphCreate(&graph, 0));
  cudaGraphNode_t n1, n2, n3;
  {
    unsigned *g0 = g, *g1 = g + 1, *g2 = g + 2, *g3 = g + 3; unsigned m1 = 17, a1 = 19, m3 = 23, a3 = 29;
    void *args1[] = {&g1, &g0, &m1, &a1};
    cudaKernelNodeParams k1 = {}; k1.func = (void *)derive; k1.gridDim = dim3(1); k1.blockDim = dim3(1);
    k1.kernelParams = args1;
    CHECK(cudaGraphAddKernelNode(&n1, graph, nullptr, 0, &k1));
    CHECK(cudaGraphAddMemcpyNode1D(&n2, graph, &n1, 1, g2, g1, 4, cudaMemcpyDeviceToDevice));
    void *args3[] = {&g3, &g2, &m3, &a3};
    cudaKernelNodeParams k3 = k1; k3.kernelParams = args3;
    CHECK(cudaGraphAddKernelNode(&n3, graph, &n2, 1, &k3));
  }
  cudaGraphExec_t exec; CHECK(cudaGraphInstantiate(&exec, graph, 0));

  float timed_min = 1e30f, timed_max = 0.f; int timed = 0;
  CHECK(cudaDeviceSynchronize());

  for (int i = 0; i < iters; i++) {
    unsigned u = (unsigned)i;
    // 1. The legacy default stream waits for blocking stream A, and blocking stream B for it.
    late_write<<<1, 1, 0, A>>>(buf + 0, u + 1, SPIN); launches++;
    derive<<<1, 1, 0, LEGACY>>>(buf + 1, buf + 0, 3, 1); launches++;
    derive<<<1, 1, 0, B>>>(buf + 2, buf + 1, 5, 7); launches++;
    fold<<<1, 1, 0, B>>>(acc + 0, buf + 2, u); launches++;

    // 2. The per-thread default stream and the legacy one wait for each other.
    late_write<<<1, 1, 0, cudaStreamPerThread>>>(buf + 3, u * 3 + 2, SPIN); launches++;
    derive<<<1, 1, 0, cudaStreamLegacy>>>(buf + 4, buf + 3, 9, 4); launches++;
    fold<<<1, 1, 0, cudaStreamPerThread>>>(acc + 1, buf + 4, u); launches++;

    // 3. A host function between kernels: it sees the kernel before it, the kernel after it sees its write.
    late_write_host<<<1, 1, 0, A>>>(mapped_dev + 0, u * 5 + 1, SPIN); launches++;
    CHECK(cudaLaunchHostFunc(A, host_fn, &host));
    derive<<<1, 1, 0, A>>>(buf + 5, mapped_dev + 1, 1, 0); launches++;
    fold<<<1, 1, 0, A>>>(acc + 2, buf + 5, u); launches++;
    if (i % 8 == 0) {  // a stream callback (the older API) on B after a kernel that writes the host
      late_write_host<<<1, 1, 0, B>>>(mapped_dev + 2, u * 11 + 5, SPIN); launches++;
      CHECK(cudaStreamAddCallback(B, stream_callback, &host, 0));
    }

    // 4. Stream memory operations: C waits for a value A writes after its producer.
    late_write<<<1, 1, 0, A>>>(buf + 6, u * 7 + 3, SPIN); launches++;
    CHECK_CU(cuStreamWriteValue32((CUstream)A, (CUdeviceptr)flag, u + 1, 0));
    CHECK_CU(cuStreamWaitValue32((CUstream)C, (CUdeviceptr)flag, u + 1, CU_STREAM_WAIT_VALUE_GEQ));
    derive<<<1, 1, 0, C>>>(buf + 7, buf + 6, 11, 13); launches++;
    fold<<<1, 1, 0, C>>>(acc + 3, buf + 7, u); launches++;
    CHECK(cudaEventRecord(c_done, C)); CHECK(cudaStreamWaitEvent(A, c_done, 0));  // A's next producer after C's read

    // 5. An event recorded on the default stream (stream 0: the legacy one, or this thread's) orders non-blocking C.
    late_write<<<1, 1>>>(buf + 8, u * 13 + 7, SPIN); launches++;
    CHECK(cudaEventRecord(on_legacy, 0)); CHECK(cudaStreamWaitEvent(C, on_legacy, 0));
    derive<<<1, 1, 0, C>>>(buf + 9, buf + 8, 15, 2); launches++;
    fold<<<1, 1, 0, C>>>(acc + 4, buf + 9, u); launches++;

    // 6. An explicit graph between kernels on A.
    late_write<<<1, 1, 0, A>>>(g + 0, u * 17 + 9, SPIN); launches++;
    CHECK(cudaGraphLaunch(exec, A));
    fold<<<1, 1, 0, A>>>(acc + 5, g + 3, u); launches++;

    // 7. Pageable copies: the source may be reused at return; the destination is filled at return.
    for (int k = 0; k < 16; k++) pageable_src[k] = u * 19 + k;
    CHECK(cudaMemcpyAsync(staged, pageable_src.data(), 16 * 4, cudaMemcpyHostToDevice, A));
    for (int k = 0; k < 16; k++) pageable_src[k] = 0xdeadbeef;
    fold_words<<<1, 1, 0, A>>>(acc + 6, staged, 16, u); launches++;
    late_write<<<1, 1, 0, A>>>(buf + 10, u * 23 + 11, SPIN); launches++;
    CHECK(cudaMemcpyAsync(pageable_dst.data(), buf + 10, 4, cudaMemcpyDeviceToHost, A));
    pageable_reads = fnv(pageable_dst.data(), 4, pageable_reads);  // no synchronize: the copy is done

    // 8. Pitched memsets and copies between kernels on B.
    if (i % 4 == 0) {
      CHECK(cudaMemset2DAsync(pitched, pitch, i & 0xff, W * 4, H, B));
      touch_pitched<<<dim3((W + 15) / 16, (H + 15) / 16), dim3(16, 16), 0, B>>>(pitched, pitch, W, H, u + 1);
      launches++;
      CHECK(cudaMemcpy2DAsync(dense, W * 4, pitched, pitch, W * 4, H, cudaMemcpyDeviceToDevice, B));
      fold_words<<<1, 1, 0, B>>>(acc + 7, dense, W * H, u); launches++;
    }
    if (i % 50 == 0) {
      int words = (int)(vol_a.pitch / 4 * 8 * 4);
      fill<<<(words + 255) / 256, 256, 0, B>>>((unsigned *)vol_a.ptr, u, words); launches++;
      cudaMemcpy3DParms p = {};
      p.srcPtr = vol_a; p.dstPtr = vol_b; p.extent = extent; p.kind = cudaMemcpyDeviceToDevice;
      CHECK(cudaMemcpy3DAsync(&p, B));
      cudaMemcpy3DParms q = {};
      q.srcPtr = vol_b; q.dstPtr = make_cudaPitchedPtr(vol_host.data(), 16 * 4, 16, 8); q.extent = extent;
      q.kind = cudaMemcpyDeviceToHost;
      CHECK(cudaMemcpy3DAsync(&q, B));
      CHECK(cudaStreamSynchronize(B));
      pageable_reads = fnv(vol_host.data(), vol_host.size() * 4, pageable_reads);
    }

    // 9. A cooperative kernel's grid barrier, after a producer on A.
    if (coop && i % 10 == 0) {
      fill<<<CN / 256, 256, 0, A>>>(cdata, u, CN); launches++;
      int n = CN;
      void *args[] = {&cdata, &partial, &csum, &n};
      CHECK(cudaLaunchCooperativeKernel((void *)grid_sum, dim3(sms), dim3(128), args, 0, A)); launches++;
      fold<<<1, 1, 0, A>>>(acc + 8, csum, u); launches++;
    }

    // 10. Timed events around a kernel of known length.
    if (i % 100 == 0) {
      CHECK(cudaEventRecord(t0, A));
      late_write<<<1, 1, 0, A>>>(buf + 11, u, 50000); launches++;
      CHECK(cudaEventRecord(t1, A));
      CHECK(cudaEventSynchronize(t1));
      float ms = 0.f; CHECK(cudaEventElapsedTime(&ms, t0, t1));
      timed_min = ms < timed_min ? ms : timed_min; timed_max = ms > timed_max ? ms : timed_max; timed++;
    }

    // 11. A graph captured from B (its kernels reach the graph, not the GPU, at capture), launched between kernels.
    if (i % 100 == 25) {
      late_write<<<1, 1, 0, B>>>(buf + 12, u * 29 + 1, SPIN); launches++;
      cudaGraph_t cgraph; cudaGraphExec_t cexec;
      CHECK(cudaStreamBeginCapture(B, cudaStreamCaptureModeThreadLocal));
      derive<<<1, 1, 0, B>>>(buf + 13, buf + 12, 31, 3); launches++; captured++;
      fold<<<1, 1, 0, B>>>(acc + 10, buf + 13, u); launches++; captured++;
      CHECK(cudaStreamEndCapture(B, &cgraph));
      CHECK(cudaGraphInstantiate(&cexec, cgraph, 0));
      CHECK(cudaGraphLaunch(cexec, B));
      fold<<<1, 1, 0, B>>>(acc + 10, buf + 13, u + 1); launches++;
      CHECK(cudaStreamSynchronize(B));
      CHECK(cudaGraphExecDestroy(cexec)); CHECK(cudaGraphDestroy(cgraph));
    }
  }

  // 12. Host threads at once, two on their per-thread default streams, two on streams they create.
  const int THREADS = 4, steps = iters / 10 + 1;
  uint64_t thread_hash[THREADS] = {};
  std::vector<std::thread> threads;
  for (int t = 0; t < THREADS; t++) threads.emplace_back(thread_chain, t, steps, t < 2, &thread_hash[t]);
  for (auto &t : threads) t.join();
  launches += (long)THREADS * steps * 3;

  CHECK(cudaDeviceSynchronize());
  unsigned long long h_acc[ACCS];
  CHECK(cudaMemcpy(h_acc, acc, sizeof h_acc, cudaMemcpyDeviceToHost));
  const char *names[] = {"legacy_blocking", "per_thread_legacy", "host_function", "stream_memops", "legacy_event",
                         "explicit_graph", "pageable_h2d", "pitched_2d", "cooperative", "timed", "captured_graph"};
  for (int k = 0; k < 11; k++) {
    if (k == 9) continue;  // no accumulator for the timed events
    printf("result %s %016llx\n", names[k], h_acc[k]);
  }
  printf("result host_function_saw %016llx\n", (unsigned long long)host.seen);
  printf("result stream_callbacks %016llx\n", (unsigned long long)host.callbacks);
  printf("result pageable_d2h_and_3d %016llx\n", (unsigned long long)pageable_reads);
  for (int t = 0; t < THREADS; t++) printf("result thread%d %016llx\n", t, (unsigned long long)thread_hash[t]);
  // The kernel of the timed events spins 50 us: every interval at least that, none absurd.
  printf("result timed_events %s\n", timed > 0 && timed_min >= 0.045f && timed_max < 50.f ? "ok" : "WRONG");
  printf("timed_events %d min %.4f ms max %.4f ms\n", timed, timed_min, timed_max);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("launches %ld\n", launches);
  printf("captured %ld\n", captured);
  return 0;
}
