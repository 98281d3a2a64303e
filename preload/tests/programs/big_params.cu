// Kernel parameters beyond 4 KiB (up to CUDA 12.1's 32764 bytes), and a module linked at run time from two
// relocatable NVRTC objects with cuLink*.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("result error %s line %d\n", cudaGetErrorName(e), __LINE__); return 0; } } while (0)
struct P5K { int v[1250]; };
struct P32K { int v[8000]; };
__global__ void k5(P5K p, int *out, int salt) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 1250) out[i] = out[i] * 3 + p.v[i] + salt; }
__global__ void k32(int *out, P32K p, int salt) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 8000) out[i] = out[i] * 5 + p.v[(i * 7) % 8000] - salt; }
static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull; const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; } return h; }
static const char *A = "extern __device__ float helper(float x);\n"
  "extern \"C\" __global__ void linked(float *y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = helper(y[i]) + 1.0f; }\n";
static const char *B = "__device__ float helper(float x) { return x * 0.5f + 0.25f; }\n";
static std::string ptx_of(const char *src, const char *name) {
  nvrtcProgram p; nvrtcCreateProgram(&p, src, name, 0, nullptr, nullptr);
  const char *opts[] = {"--gpu-architecture=compute_90", "-rdc=true"};
  if (nvrtcCompileProgram(p, 2, opts) != NVRTC_SUCCESS) return "";
  size_t n; nvrtcGetPTXSize(p, &n); std::string s(n, '\0'); nvrtcGetPTX(p, &s[0]); nvrtcDestroyProgram(&p); return s;
}
int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200; if (iters > 500) iters = 500;
  static P5K a; static P32K b;
  int *o5, *o32; CHECK(cudaMalloc(&o5, 1250 * 4)); CHECK(cudaMalloc(&o32, 8000 * 4));
  CHECK(cudaMemset(o5, 0, 1250 * 4)); CHECK(cudaMemset(o32, 0, 8000 * 4));
  cudaStream_t s; CHECK(cudaStreamCreate(&s));
  for (int it = 0; it < iters; it++) {
    for (int i = 0; i < 1250; i++) a.v[i] = i * 3 + it;
    for (int i = 0; i < 8000; i++) b.v[i] = i ^ it;
    k5<<<5, 256, 0, s>>>(a, o5, it);
    k32<<<32, 256, 0, s>>>(o32, b, it);
    if (it % 3 == 0) { void *args[] = {&o32, &b, &it}; CHECK(cudaLaunchKernel((void *)k32, dim3(32), dim3(256), args, 0, s)); }
  }
  static int h5[1250], h32[8000];
  CHECK(cudaMemcpy(h5, o5, sizeof h5, cudaMemcpyDeviceToHost)); CHECK(cudaMemcpy(h32, o32, sizeof h32, cudaMemcpyDeviceToHost));
  printf("result p5k %016llx\n", (unsigned long long)fnv(h5, sizeof h5));
  printf("result p32k %016llx\n", (unsigned long long)fnv(h32, sizeof h32));
  // Linked at run time.
  std::string pa = ptx_of(A, "a.cu"), pb = ptx_of(B, "b.cu");
  if (pa.empty() || pb.empty()) { printf("result nvrtc failed\n"); return 0; }
  CUlinkState ls; CUresult r = cuLinkCreate(0, nullptr, nullptr, &ls);
  if (r != CUDA_SUCCESS) { printf("result link unsupported %d\n", (int)r); printf("result no error\n"); return 0; }
  r = cuLinkAddData(ls, CU_JIT_INPUT_PTX, (void *)pa.c_str(), pa.size() + 1, "a.ptx", 0, nullptr, nullptr);
  if (r == CUDA_SUCCESS) r = cuLinkAddData(ls, CU_JIT_INPUT_PTX, (void *)pb.c_str(), pb.size() + 1, "b.ptx", 0, nullptr, nullptr);
  void *cubin = nullptr; size_t cubin_size = 0;
  if (r == CUDA_SUCCESS) r = cuLinkComplete(ls, &cubin, &cubin_size);
  if (r != CUDA_SUCCESS) { printf("result link failed %d\n", (int)r); return 0; }
  CUmodule m; CUfunction f;
  if (cuModuleLoadData(&m, cubin) != CUDA_SUCCESS || cuModuleGetFunction(&f, m, "linked") != CUDA_SUCCESS) { printf("result load failed\n"); return 0; }
  cuLinkDestroy(ls);
  const int n = 4096; float *y; CHECK(cudaMalloc(&y, n * 4)); CHECK(cudaMemset(y, 0, n * 4));
  int nn = n; void *args[] = {&y, &nn};
  for (int it = 0; it < iters; it++) if (cuLaunchKernel(f, n / 256, 1, 1, 256, 1, 1, 0, (CUstream)s, args, nullptr) != CUDA_SUCCESS) { printf("result launch failed\n"); return 0; }
  static float hy[4096]; CHECK(cudaMemcpy(hy, y, sizeof hy, cudaMemcpyDeviceToHost));
  printf("result linked %016llx\n", (unsigned long long)fnv(hy, sizeof hy));
  cuModuleUnload(m);
  CHECK(cudaGetLastError());
  printf("result no error\n");
  return 0;
}
