// Launches CUDA refuses and their error codes at the launch, and the work around them.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
__global__ void k_add(int *p, int v) { p[blockIdx.x * blockDim.x + threadIdx.x] += v; }
__global__ void k_shared(int *p) { extern __shared__ int s[]; s[threadIdx.x] = threadIdx.x; __syncthreads(); p[threadIdx.x] += s[(threadIdx.x + 1) % blockDim.x]; }
__global__ void __launch_bounds__(128) k_bounded(int *p) { p[threadIdx.x] += 1; }
static void show(const char *what, cudaError_t e) { printf("result %s %s\n", what, cudaGetErrorName(e)); }
int main() {
  int *p; cudaMalloc(&p, 1 << 20); cudaMemset(p, 0, 1 << 20);
  cudaStream_t st; cudaStreamCreate(&st);
  k_add<<<4, 256>>>(p, 1); show("ok_launch", cudaGetLastError());
  k_add<<<4, 1025>>>(p, 1); show("block_1025", cudaGetLastError());
  k_add<<<0, 256>>>(p, 1); show("grid_0", cudaGetLastError());
  k_add<<<dim3(1, 70000), 32>>>(p, 1); show("grid_y_70000", cudaGetLastError());
  k_shared<<<1, 256, 100 * 1024>>>(p); show("smem_100k_no_attr", cudaGetLastError());
  cudaFuncSetAttribute(k_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
  k_shared<<<1, 256, 100 * 1024>>>(p); show("smem_100k_attr", cudaGetLastError());
  k_shared<<<1, 256, 300 * 1024>>>(p); show("smem_300k", cudaGetLastError());
  k_bounded<<<1, 256>>>(p); show("over_launch_bounds", cudaGetLastError());
  k_add<<<4, 256, 0, st>>>(p, 2); show("stream_launch", cudaGetLastError());
  void *args[] = {&p, nullptr};
  int v = 3; args[1] = &v;
  show("launch_kernel_api", cudaLaunchKernel((void *)k_add, dim3(4), dim3(256), args, 0, st));
  show("launch_kernel_api_bad", cudaLaunchKernel((void *)k_add, dim3(4), dim3(2048), args, 0, st));
  show("sync", cudaDeviceSynchronize());
  static int h[1 << 18]; cudaMemcpy(h, p, 1 << 20, cudaMemcpyDeviceToHost);
  uint64_t s = 0; for (int i = 0; i < 1 << 18; i++) s = s * 31 + h[i]; printf("result sum %llu\n", (unsigned long long)s);
  cudaGetLastError();
  for (int i = 0; i < 50; i++) k_add<<<4, 256, 0, st>>>(p, i);
  show("after_sync", cudaStreamSynchronize(st));
  cudaMemcpy(h, p, 1 << 20, cudaMemcpyDeviceToHost);
  s = 0; for (int i = 0; i < 1 << 18; i++) s = s * 31 + h[i]; printf("result sum_after %llu\n", (unsigned long long)s);
  printf("result no error\n");
  return 0;
}
