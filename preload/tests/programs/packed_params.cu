// Kernel arguments passed as one packed buffer (`CU_LAUNCH_PARAM_BUFFER_POINTER`), as NCCL passes its own: a buffer
// as long as the parameters, one shorter (NCCL's is the bytes its arguments use of a 4 KiB parameter), one longer.
// Each kernel copies the parameter bytes it sees to memory, printed as runs ("aa*16 00*240"), so a run under the
// preload must print exactly what libcuda's run prints, including the bytes a short buffer does not give.
#include <cstdio>
#include <cstring>
#include <string>
#include <cuda.h>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

struct Blob { unsigned char b[256]; };
struct Blob4K { unsigned char b[4088]; };

__global__ void dump_a(unsigned char *out, Blob blob) { out[threadIdx.x] = blob.b[threadIdx.x]; }
__global__ void dump_b(unsigned char *out, Blob blob) { out[threadIdx.x] = blob.b[threadIdx.x]; }
__global__ void dump_4k(unsigned char *out, Blob4K blob) {
  for (int i = threadIdx.x; i < 4088; i += blockDim.x) out[i] = blob.b[i];
}

static std::string runs(const unsigned char *p, int n) {
  std::string s;
  for (int i = 0; i < n;) {
    int j = i;
    while (j < n && p[j] == p[i]) j++;
    char part[32];
    snprintf(part, sizeof part, "%s%02x*%d", s.empty() ? "" : " ", p[i], j - i);
    s += part;
    i = j;
  }
  return s;
}

// Launches `f` with `len` bytes of `buffer` packed; returns the driver's answer.
static CUresult launch(CUfunction f, unsigned block, unsigned char *buffer, size_t len) {
  size_t size = len;
  void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buffer, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  return cuLaunchKernel(f, 1, 1, 1, block, 1, 1, 0, 0, nullptr, extra);
}

int main() {
  CHECK(cudaFree(0));
  CUfunction fa, fb, f4k;
  CHECK(cudaGetFuncBySymbol(&fa, (const void *)dump_a));
  CHECK(cudaGetFuncBySymbol(&fb, (const void *)dump_b));
  CHECK(cudaGetFuncBySymbol(&f4k, (const void *)dump_4k));
  unsigned char *d;
  CHECK(cudaMalloc(&d, 4096));
  static unsigned char buffer[8 + 4096 + 64], host[4096];
  auto fill = [&](unsigned char byte) {
    memset(buffer, byte, sizeof buffer);
    memcpy(buffer, &d, sizeof d);
  };
  // Prints the first `compared` of the `n` bytes the kernel saw as a result, the rest as a note: past a function's
  // first launch, the bytes a short buffer does not give are whatever libcuda's parameter memory held (an earlier
  // launch's, at times), which no program can rely on.
  auto show = [&](const char *name, CUresult r, int n, int compared) -> int {
    if (r != CUDA_SUCCESS) { printf("result %s launch %d\n", name, (int)r); return 0; }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(host, d, n, cudaMemcpyDeviceToHost));
    printf("result %s %s\n", name, runs(host, compared).c_str());
    if (compared < n) printf("note %s rest %s\n", name, runs(host + compared, n - compared).c_str());
    CHECK(cudaMemset(d, 0x77, 4096));
    return 0;
  };
  CHECK(cudaMemset(d, 0x77, 4096));
  // A short buffer at the function's first launch.
  fill(0x11);
  if (show("short_first", launch(fa, 256, buffer, 8 + 16), 256, 256)) return 1;
  // As long as the parameters, then short: the bytes given are compared, the rest noted.
  fill(0xaa);
  if (show("full", launch(fb, 256, buffer, 8 + 256), 256, 256)) return 1;
  fill(0x22);
  if (show("short_after_full", launch(fb, 256, buffer, 8 + 16), 256, 16)) return 1;
  fill(0x33);
  if (show("short_unaligned", launch(fb, 256, buffer, 8 + 5), 256, 5)) return 1;
  // Longer than the parameters.
  fill(0x44);
  if (show("long", launch(fb, 256, buffer, 8 + 256 + 16), 256, 256)) return 1;
  // NCCL's shape: a 4 KiB parameter, a few hundred bytes given, many launches.
  // The bytes a short buffer does not give are zero at a function's first launches; later, libcuda's hold what
  // an earlier launch left (noted, not compared: no program can rely on them).
  std::string stale;
  unsigned long long given = 0;
  for (int i = 0; i < 100; i++) {
    fill((unsigned char)(0x80 + i % 16));
    size_t len = 8 + 64 + 16 * (i % 8);
    CUresult r = launch(f4k, 256, buffer, len);
    if (r != CUDA_SUCCESS) { printf("result nccl_shape launch %d at %d\n", (int)r, i); break; }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(host, d, 4088, cudaMemcpyDeviceToHost));
    if (i == 99) printf("result nccl_shape_last %s\n", runs(host, (int)len - 8).c_str());
    for (int k = 0; k < (int)len - 8; k++) given = given * 31 + host[k];
    for (int k = (int)len - 8; k < 4088; k++)
      if (host[k]) { stale += " " + std::to_string(i); break; }
  }
  printf("result nccl_shape_given %llu\n", given);
  printf("note nccl_shape launches whose rest was not zero:%s\n", stale.c_str());
  return 0;
}
