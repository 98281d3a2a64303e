// A driver-API program as the CUDA samples write them: kernels compiled at run time by NVRTC (a cubin, and PTX the
// driver compiles at load), loaded as modules and as a context-independent library, launched with `kernelParams` and
// with a packed `extra` buffer, a `__device__` variable set through `cuModuleGetGlobal`, a kernel given 100 KiB of
// dynamic shared memory through `cuFuncSetAttribute`; in the primary context alone first, then beside a second
// context on the same GPU made with `cuCtxCreate`, switched with `cuCtxPushCurrent`/`cuCtxPopCurrent`, and destroyed
// while the first goes on.
// Every result folds into hashes the program prints as `result` lines: the same bits with and without the preload.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda.h>
#include <nvrtc.h>

#define CU(x) do { CUresult cu_r_ = (x); if (cu_r_ != CUDA_SUCCESS) { const char *cu_s_ = "?"; \
  cuGetErrorName(cu_r_, &cu_s_); printf("cuda driver error %s at line %d\n", cu_s_, __LINE__); exit(1); } } while (0)
#define RTC(x) do { nvrtcResult rtc_r_ = (x); if (rtc_r_ != NVRTC_SUCCESS) { \
  printf("nvrtc error %s at line %d\n", nvrtcGetErrorString(rtc_r_), __LINE__); exit(1); } } while (0)

static const char *SOURCE = R"(
__device__ int bias;
struct Packed { int a; double b; char c; };
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + 0.5f * y[i];
}
extern "C" __global__ void add_bias(int *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = out[i] * 3 + bias + i;
}
template <typename T> __global__ void scale(T *p, T s, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = p[i] * s + (T)1;
}
extern "C" __global__ void big_shared(unsigned *out, int words) {
  extern __shared__ unsigned sh[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) sh[i] = (unsigned)i * 2654435761u + blockIdx.x;
  __syncthreads();
  unsigned h = 0;
  for (int i = threadIdx.x; i < words; i += blockDim.x) h ^= sh[words - 1 - i] + (unsigned)i;
  atomicXor(out + blockIdx.x, h);
}
extern "C" __global__ void packed(double *out, Packed p, long long k) {
  int i = threadIdx.x;
  out[i] = out[i] * 0.5 + p.a + p.b * i + p.c + (double)(k % 1000);
}
)";

static uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

struct Compiled { std::vector<char> cubin, ptx; std::string scale_name; };

static Compiled compile() {
  Compiled c;
  for (int pass = 0; pass < 2; pass++) {
    nvrtcProgram prog;
    RTC(nvrtcCreateProgram(&prog, SOURCE, "driver_api_kernels.cu", 0, nullptr, nullptr));
    RTC(nvrtcAddNameExpression(prog, "scale<float>"));
    const char *opts[] = {pass == 0 ? "-arch=sm_90" : "-arch=compute_90", "-std=c++17"};
    nvrtcResult r = nvrtcCompileProgram(prog, 2, opts);
    if (r != NVRTC_SUCCESS) {
      size_t n; nvrtcGetProgramLogSize(prog, &n); std::vector<char> log(n); nvrtcGetProgramLog(prog, log.data());
      printf("nvrtc: %s\n", log.data()); exit(1);
    }
    const char *lowered; RTC(nvrtcGetLoweredName(prog, "scale<float>", &lowered));
    c.scale_name = lowered;
    size_t n;
    if (pass == 0) { RTC(nvrtcGetCUBINSize(prog, &n)); c.cubin.resize(n); RTC(nvrtcGetCUBIN(prog, c.cubin.data())); }
    else { RTC(nvrtcGetPTXSize(prog, &n)); c.ptx.resize(n); RTC(nvrtcGetPTX(prog, c.ptx.data())); }
    RTC(nvrtcDestroyProgram(&prog));
  }
  return c;
}

// One context's module instance, buffers and stream.
struct Side {
  CUcontext ctx; CUmodule mod; CUstream stream;
  CUfunction saxpy, add_bias, scale, big_shared, packed, lib_saxpy;
  CUdeviceptr x, y, out, sums, d;
  uint64_t hash = 1469598103934665603ull;
  long launches = 0;
};

static const int N = 4096, SHARED_WORDS = 100 * 1024 / 4;

static void setup(Side &s, const Compiled &c, bool from_ptx, int bias, CUlibrary lib) {
  if (from_ptx) {
    // PTX: the driver compiles it at load, with options given as CUDA samples give them.
    char log[4096] = {0};
    CUjit_option o[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_OPTIMIZATION_LEVEL};
    void *v[] = {log, (void *)(uintptr_t)sizeof log, (void *)(uintptr_t)4};
    CUresult r = cuModuleLoadDataEx(&s.mod, c.ptx.data(), 3, o, v);
    if (r != CUDA_SUCCESS) { printf("PTX load failed: %s\n", log); CU(r); }
  } else {
    CU(cuModuleLoadData(&s.mod, c.cubin.data()));
  }
  CU(cuModuleGetFunction(&s.saxpy, s.mod, "saxpy"));
  CU(cuModuleGetFunction(&s.add_bias, s.mod, "add_bias"));
  CU(cuModuleGetFunction(&s.scale, s.mod, c.scale_name.c_str()));
  CU(cuModuleGetFunction(&s.big_shared, s.mod, "big_shared"));
  CU(cuModuleGetFunction(&s.packed, s.mod, "packed"));
  CU(cuFuncSetAttribute(s.big_shared, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SHARED_WORDS * 4));
  // The library's kernel, as this context's function.
  CUkernel k; CU(cuLibraryGetKernel(&k, lib, "saxpy")); CU(cuKernelGetFunction(&s.lib_saxpy, k));
  // The module's variable, set by the host.
  CUdeviceptr bias_at; size_t bias_size;
  CU(cuModuleGetGlobal(&bias_at, &bias_size, s.mod, "bias"));
  if (bias_size != sizeof(int)) { printf("bias is %zu bytes\n", bias_size); exit(1); }
  CU(cuMemcpyHtoD(bias_at, &bias, sizeof bias));
  CU(cuStreamCreate(&s.stream, CU_STREAM_NON_BLOCKING));
  CU(cuMemAlloc(&s.x, N * 4)); CU(cuMemAlloc(&s.y, N * 4)); CU(cuMemAlloc(&s.out, N * 4));
  CU(cuMemAlloc(&s.sums, 64 * 4)); CU(cuMemAlloc(&s.d, 64 * 8));
  std::vector<float> hx(N);
  for (int i = 0; i < N; i++) hx[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
  CU(cuMemcpyHtoD(s.x, hx.data(), N * 4));
  CU(cuMemsetD32(s.y, 0, N)); CU(cuMemsetD32(s.out, 1, N)); CU(cuMemsetD32(s.sums, 0, 64));
  CU(cuMemsetD32(s.d, 0, 64 * 2));
}

static long launches = 0;

static void step(Side &s, int i) {
  long before = launches;
  int n = N;
  float a = 0.25f + (i % 5) * 0.125f;
  void *p1[] = {&a, &s.x, &s.y, &n};
  CU(cuLaunchKernel(i % 2 ? s.saxpy : s.lib_saxpy, N / 128, 1, 1, 128, 1, 1, 0, s.stream, p1, nullptr)); launches++;
  void *p2[] = {&s.out, &n};
  CU(cuLaunchKernel(s.add_bias, N / 256, 1, 1, 256, 1, 1, 0, s.stream, p2, nullptr)); launches++;
  float f = 0.5f;
  void *p3[] = {&s.y, &f, &n};
  CU(cuLaunchKernel(s.scale, N / 64, 1, 1, 64, 1, 1, 0, s.stream, p3, nullptr)); launches++;
  if (i % 8 == 0) {
    int words = SHARED_WORDS;
    void *p4[] = {&s.sums, &words};
    CU(cuLaunchKernel(s.big_shared, 64, 1, 1, 256, 1, 1, SHARED_WORDS * 4, s.stream, p4, nullptr)); launches++;
  }
  // The packed kernel's arguments in one buffer at their parameter offsets: out at 0, Packed (24 bytes) at 8,
  // k at 32.
  struct { CUdeviceptr out; struct { int a; double b; char c; } p; long long k; } args = {
    s.d, {i % 17, 0.125 * (i % 9), (char)(i % 7)}, (long long)i * 1000003};
  size_t size = sizeof args;
  void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &args, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  CU(cuLaunchKernel(s.packed, 1, 1, 1, 64, 1, 1, 0, s.stream, nullptr, extra)); launches++;
  if (i % 100 == 99) {
    float peek[8]; int ipeek[8];
    CU(cuMemcpyDtoHAsync(peek, s.y + 4 * (i % 512), sizeof peek, s.stream));
    CU(cuMemcpyDtoHAsync(ipeek, s.out + 4 * (i % 512), sizeof ipeek, s.stream));
    CU(cuStreamSynchronize(s.stream));
    s.hash = fnv(peek, sizeof peek, s.hash); s.hash = fnv(ipeek, sizeof ipeek, s.hash);
  }
  s.launches += launches - before;
}

static uint64_t finish(Side &s) {
  CU(cuStreamSynchronize(s.stream));
  std::vector<unsigned> buf(N * 2);
  uint64_t h = s.hash;
  CU(cuMemcpyDtoH(buf.data(), s.y, N * 4)); h = fnv(buf.data(), N * 4, h);
  CU(cuMemcpyDtoH(buf.data(), s.out, N * 4)); h = fnv(buf.data(), N * 4, h);
  CU(cuMemcpyDtoH(buf.data(), s.sums, 64 * 4)); h = fnv(buf.data(), 64 * 4, h);
  CU(cuMemcpyDtoH(buf.data(), s.d, 64 * 8)); h = fnv(buf.data(), 64 * 8, h);
  return h;
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  CU(cuInit(0));
  CUdevice dev; CU(cuDeviceGet(&dev, 0));
  Compiled c = compile();
  Side a, b;
  CU(cuDevicePrimaryCtxRetain(&a.ctx, dev));
  CU(cuCtxSetCurrent(a.ctx));
  // The library is context-independent: its kernels are had in each context as that context's functions.
  CUlibrary lib;
  CU(cuLibraryLoadData(&lib, c.cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  setup(a, c, false, 7, lib);
  // The primary context alone first.
  for (int i = 0; i < iters / 4; i++) step(a, i);
  // A second context on the same GPU, made current by a push, its module loaded from PTX.
#if CUDA_VERSION >= 13000
  CU(cuCtxCreate(&b.ctx, nullptr, 0, dev));
#else
  CU(cuCtxCreate(&b.ctx, 0, dev));
#endif
  setup(b, c, true, -11, lib);
  CUcontext popped; CU(cuCtxPopCurrent(&popped));
  if (popped != b.ctx) { printf("popped the wrong context\n"); return 1; }
  CUcontext cur; CU(cuCtxGetCurrent(&cur));
  if (cur != a.ctx) { printf("the primary context is not current after the pop\n"); return 1; }
  for (int i = iters / 4; i < iters; i++) {
    step(a, i);
    if (i % 3 != 2) {
      CU(cuCtxPushCurrent(b.ctx));
      step(b, i);
      CU(cuCtxPopCurrent(&popped));
    }
  }
  uint64_t hb;
  CU(cuCtxPushCurrent(b.ctx));
  hb = finish(b);
  CU(cuCtxPopCurrent(&popped));
  // The second context ends while the first goes on.
  CU(cuCtxDestroy(b.ctx));
  for (int i = 0; i < iters / 4; i++) step(a, iters + i);
  uint64_t ha = finish(a);
  printf("result primary %016llx\n", (unsigned long long)ha);
  printf("result created %016llx\n", (unsigned long long)hb);
  CU(cuModuleUnload(a.mod));
  CU(cuLibraryUnload(lib));
  const char *err = "no error";
  CUresult last = cuCtxSynchronize();
  if (last != CUDA_SUCCESS) cuGetErrorName(last, &err);
  printf("result error %s\n", err);
  printf("launches %ld\n", launches);
  printf("launches_primary %ld\n", a.launches);
  printf("launches_created %ld\n", b.launches);
  CU(cuDevicePrimaryCtxRelease(dev));
  return 0;
}
