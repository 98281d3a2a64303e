// A kernel that fails a device assert in some threads, after kernels that pass theirs: the program must see what
// CUDA shows (the messages on stderr, cudaErrorAssert at the next synchronize, and every call after it failing the
// same way). argv[1]: "pass" runs only passing asserts; "fail" synchronizes the stream first after the failing
// kernel, "fail-memcpy" copies to the host first, "fail-event" waits on a timed event first.
#include <cassert>
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

__global__ void check_bounds(const int *idx, int n, int limit, int *out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    int j = idx[i];
    assert(j >= 0 && j < limit && "index out of bounds");
    out[i] = j * 2;
  }
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "fail";
  bool fail = strcmp(mode, "pass") != 0;
  const int n = 1024, limit = 100;
  int h[n]; for (int i = 0; i < n; i++) h[i] = i % limit;
  if (fail) { h[300] = 100; h[301] = -1; h[777] = 1000; }
  int *idx, *out; cudaMalloc(&idx, n * 4); cudaMalloc(&out, n * 4);
  cudaMemcpy(idx, h, n * 4, cudaMemcpyHostToDevice);
  cudaStream_t st; cudaStreamCreate(&st);
  int good[n]; for (int i = 0; i < n; i++) good[i] = i % limit;
  int *gidx; cudaMalloc(&gidx, n * 4); cudaMemcpy(gidx, good, n * 4, cudaMemcpyHostToDevice);
  for (int k = 0; k < 20; k++) check_bounds<<<n / 128, 128, 0, st>>>(gidx, n, limit, out);
  cudaError_t e = cudaStreamSynchronize(st);
  printf("result passing %s\n", cudaGetErrorName(e));
  cudaEvent_t timed; cudaEventCreate(&timed);
  check_bounds<<<n / 128, 128, 0, st>>>(idx, n, limit, out);
  if (!strcmp(mode, "fail-memcpy")) {
    int first[4]; e = cudaMemcpy(first, out, sizeof first, cudaMemcpyDeviceToHost);
    printf("result first_memcpy %s\n", cudaGetErrorName(e));
  } else if (!strcmp(mode, "fail-event")) {
    cudaEventRecord(timed, st); e = cudaEventSynchronize(timed);
    printf("result first_event %s\n", cudaGetErrorName(e));
  }
  e = cudaStreamSynchronize(st);
  printf("result sync %s\n", cudaGetErrorName(e));
  e = cudaStreamQuery(st);
  printf("result query %s\n", cudaGetErrorName(e));
  void *p = nullptr; e = cudaMalloc(&p, 64);
  printf("result malloc %s\n", cudaGetErrorName(e));
  e = cudaDeviceSynchronize();
  printf("result device %s\n", cudaGetErrorName(e));
  check_bounds<<<1, 1, 0, st>>>(gidx, 1, limit, out);
  printf("result launch_after %s\n", cudaGetErrorName(cudaGetLastError()));
  printf("launches 22\n");
  return 0;
}
