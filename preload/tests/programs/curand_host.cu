// cuRAND's host API: every generator kind, on the default stream and a stream of the program's.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#include <curand.h>
#define CR(x) do { curandStatus_t s = (x); if (s != CURAND_STATUS_SUCCESS) { printf("result curand_error %d line %d\n", (int)s, __LINE__); return 0; } } while (0)
static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull; const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; } return h; }
int main() {
  const size_t n = 1 << 20;
  float *f; double *dd; unsigned *u; cudaMalloc(&f, n * 4); cudaMalloc(&dd, n * 8); cudaMalloc(&u, n * 4);
  static float hf[1 << 20]; static double hd[1 << 20]; static unsigned hu[1 << 20];
  cudaStream_t st; cudaStreamCreate(&st);
  struct { curandRngType_t t; const char *name; } kinds[] = {
    {CURAND_RNG_PSEUDO_XORWOW, "xorwow"}, {CURAND_RNG_PSEUDO_MRG32K3A, "mrg32k3a"}, {CURAND_RNG_PSEUDO_MTGP32, "mtgp32"},
    {CURAND_RNG_PSEUDO_MT19937, "mt19937"}, {CURAND_RNG_PSEUDO_PHILOX4_32_10, "philox"}, {CURAND_RNG_QUASI_SOBOL32, "sobol32"},
    {CURAND_RNG_QUASI_SCRAMBLED_SOBOL32, "ssobol32"}};
  for (auto k : kinds) {
    for (int use_stream = 0; use_stream < 2; use_stream++) {
      curandGenerator_t g; CR(curandCreateGenerator(&g, k.t));
      if (use_stream) CR(curandSetStream(g, st));
      if (k.t != CURAND_RNG_QUASI_SOBOL32 && k.t != CURAND_RNG_QUASI_SCRAMBLED_SOBOL32) CR(curandSetPseudoRandomGeneratorSeed(g, 1234 + use_stream));
      else CR(curandSetQuasiRandomGeneratorDimensions(g, 4));
      CR(curandGenerateUniform(g, f, n)); cudaMemcpy(hf, f, n * 4, cudaMemcpyDeviceToHost);
      printf("result %s_%d_uniform %016llx\n", k.name, use_stream, (unsigned long long)fnv(hf, n * 4));
      CR(curandGenerateNormal(g, f, n, 0.5f, 2.0f)); cudaMemcpy(hf, f, n * 4, cudaMemcpyDeviceToHost);
      printf("result %s_%d_normal %016llx\n", k.name, use_stream, (unsigned long long)fnv(hf, n * 4));
      CR(curandGenerateLogNormalDouble(g, dd, n, 0.1, 0.3)); cudaMemcpy(hd, dd, n * 8, cudaMemcpyDeviceToHost);
      printf("result %s_%d_lognormal %016llx\n", k.name, use_stream, (unsigned long long)fnv(hd, n * 8));
      CR(curandGeneratePoisson(g, u, n, 3.5)); cudaMemcpy(hu, u, n * 4, cudaMemcpyDeviceToHost);
      printf("result %s_%d_poisson %016llx\n", k.name, use_stream, (unsigned long long)fnv(hu, n * 4));
      CR(curandGenerate(g, u, n)); cudaMemcpy(hu, u, n * 4, cudaMemcpyDeviceToHost);
      printf("result %s_%d_bits %016llx\n", k.name, use_stream, (unsigned long long)fnv(hu, n * 4));
      CR(curandDestroyGenerator(g));
    }
  }
  printf("result no error\n");
  return 0;
}
