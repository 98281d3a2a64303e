// C++ templates: mangled kernel names.
#include <stdint.h>
template <typename T, int N>
__global__ void scale_n(T *x, T a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) x[i] = x[i] * a;
}
namespace apex_ns {
__global__ void in_namespace(int *x) { x[threadIdx.x] = threadIdx.x; }
}
template __global__ void scale_n<float, 256>(float *, float);
template __global__ void scale_n<int, 128>(int *, int);
