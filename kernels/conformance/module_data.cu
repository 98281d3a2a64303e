// Module data in every combination the loader must lay out and relocate: initialized and zeroed __constant__ and
// __device__ data, pointers to globals and to device functions, several kernels sharing data, several banks.
#include <stdint.h>

__constant__ int table[4] = {11, 22, 33, 44};
__constant__ int ctable_zero[8];
__device__ int dev_value = 1234;
__device__ int *dev_ptr = &dev_value;
__device__ int dev_zero[16];
__device__ int dev_array[5] = {5, 4, 3, 2, 1};
__device__ int *dev_ptr_mid = &dev_array[2];
__constant__ double cdouble[3] = {0.5, 1.5, 2.5};
__constant__ int *cptr = &dev_array[4];

typedef int (*binop)(int, int);
__device__ __noinline__ int op_add(int a, int b) { return a + b; }
__device__ __noinline__ int op_mul(int a, int b) { return a * b; }
__device__ binop ops[2] = {op_add, op_mul};

extern "C" {

// The combination from issue 10: __constant__ table, __device__ int, __device__ pointer to it.
__global__ void combo(int *out) {
    out[0] = table[0] + table[1] + table[2] + table[3];
    out[1] = dev_value;
    out[2] = *dev_ptr;
}

__global__ void everything(int *out, int sel) {
    int s = 0;
    for (int k = 0; k < 4; k++) s += table[k];
    for (int k = 0; k < 8; k++) s += ctable_zero[k];
    out[0] = s;
    out[1] = *dev_ptr + dev_zero[3];
    out[2] = *dev_ptr_mid;
    out[3] = (int)(cdouble[0] + cdouble[1] + cdouble[2]);
    out[4] = *cptr;
    out[5] = ops[sel & 1](6, 7);
    out[6] = ops[(sel + 1) & 1](6, 7);
}

// Writes module globals so a later kernel (or the host) sees them.
__global__ void bump(int by) {
    dev_value += by;
    dev_zero[threadIdx.x & 15] = by;
}

__global__ void read_back(int *out) {
    out[0] = dev_value;
    for (int k = 0; k < 16; k++) out[1 + k] = dev_zero[k];
    for (int k = 0; k < 8; k++) out[17 + k] = ctable_zero[k];
}

}
