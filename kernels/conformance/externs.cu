// One module whose kernels call different externals (tests/sim_module_link.rs, tests/gpu_printf.rs): device-side
// malloc/free, which the direct path does not provide (that kernel is refused, naming the symbol), printf, which
// it does, and nothing at all. The module's other kernels must run on the direct path.
// Build: nvcc -cubin -arch=sm_90 -O3 -o externs.sm_90.cubin externs.cu
#include <cstdio>

extern "C" {

__global__ void uses_malloc(int *out, int n) {
    int *p = (int *)malloc(n * sizeof(int));
    if (p == nullptr) { out[0] = -1; return; }
    for (int i = 0; i < n; i++) p[i] = i * i;
    int s = 0;
    for (int i = 0; i < n; i++) s += p[i];
    free(p);
    out[threadIdx.x] = s;
}

__global__ void uses_printf(int *out, int v) {
    if (threadIdx.x == 0) printf("externs: v=%d\n", v);
    out[threadIdx.x] = v + threadIdx.x;
}

__global__ void plain(int *out, int v) { out[threadIdx.x] = v * 2 + threadIdx.x; }

}
