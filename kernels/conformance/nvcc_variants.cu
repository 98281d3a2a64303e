// Kernels compiled by tests/gpu_conformance.rs at test time with several nvcc option sets (-O3, -G, -lineinfo,
// --use_fast_math, -rdc + device link, sm_90a); each result is compared between APEX's two backends byte for byte.
#include <stdint.h>

__device__ float scale_of(int i);  // defined below: a real call under -rdc

extern "C" {

__global__ void math_mix(const float *x, float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = sinf(x[i]) * expf(-x[i] * x[i]) + sqrtf(fabsf(x[i])) / (1.0f + x[i] * x[i]) + scale_of(i);
}

// Block reduction in shared memory, then one atomic per block.
__global__ void block_sum(const int *x, unsigned long long *total, int n) {
    __shared__ int s[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = i < n ? x[i] : 0;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(total, (unsigned long long)(long long)s[0]);
}

// Warp shuffles and a local array indexed at run time (local memory, more so under -G).
__global__ void warp_local(const int *x, int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? x[i] : 0;
    int local[16];
    for (int k = 0; k < 16; k++) local[k] = v * (k + 1);
    int acc = local[(v & 15)];
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (i < n) out[i] = acc + local[(i * 7) & 15];
}

}

__device__ float scale_of(int i) { return (float)(i % 7) * 0.25f; }
