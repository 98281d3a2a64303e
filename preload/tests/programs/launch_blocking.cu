// Run with CUDA_LAUNCH_BLOCKING=1 (what a program is run with to find the launch that fails): libcuda makes every
// launch synchronous, so the error of a faulting kernel shows at its own launch, before any synchronize. Prints what
// each step returned (`result` lines), which must read the same with and without the preload.
#include <cstdio>

__global__ void fill(int* p, int n, int v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v + i;
}

__global__ void wild(int* p) {
    // An address nothing is mapped at.
    int* bad = reinterpret_cast<int*>(0x7f0000000000ull + threadIdx.x * 4096);
    *bad = *p;
}

int main() {
    int* d;
    cudaError_t e = cudaMalloc(&d, 1024 * sizeof(int));
    printf("result malloc %s\n", cudaGetErrorName(e));
    int sum = 0;
    for (int k = 0; k < 50; k++) {
        fill<<<4, 256>>>(d, 1024, k);
    }
    int h[1024];
    e = cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
    for (int i = 0; i < 1024; i++) sum += h[i];
    printf("result fill %s %d\n", cudaGetErrorName(e), sum);
    wild<<<1, 32>>>(d);
    // Synchronous launches report the fault here; asynchronous ones at the synchronize below.
    printf("result after the faulting launch %s\n", cudaGetErrorName(cudaPeekAtLastError()));
    printf("result synchronize %s\n", cudaGetErrorName(cudaDeviceSynchronize()));
    return 0;
}
