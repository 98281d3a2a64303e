// Issue 10, driver parity: after a sticky error (a trap: CUDA_ERROR_LAUNCH_FAILED), can the same process use the
// GPU again through the CUDA driver? Tries primary-context release + reset + retain, then a new context.
// Build: nvcc -o sticky_reset probes/sticky_reset.cu -lcuda
#include <cstdio>
#include <cuda.h>
__global__ void trap_kernel() { __trap(); }
__global__ void ok_kernel(int *p) { *p = 42; }
#define P(x) do { CUresult r_ = (x); const char *n_ = 0; cuGetErrorName(r_, &n_); printf("%-60s -> %d %s\n", #x, r_, n_ ? n_ : "?"); } while (0)
int main() {
    CUdevice d; CUcontext c, c2; int *p;
    cuInit(0); cuDeviceGet(&d, 0);
    P(cuDevicePrimaryCtxRetain(&c, d)); P(cuCtxSetCurrent(c));
    trap_kernel<<<1, 1>>>();
    P(cuCtxSynchronize());
    P(cuDevicePrimaryCtxRelease(d));
    unsigned flags; int active;
    P(cuDevicePrimaryCtxGetState(d, &flags, &active)); printf("active %d\n", active);
    P(cuDevicePrimaryCtxRetain(&c, d));
    P(cuDevicePrimaryCtxReset(d));
    P(cuDevicePrimaryCtxRetain(&c, d));
    P(cuCtxSetCurrent(c));
    P(cuCtxSynchronize());
    CUctxCreateParams params = {};
    P(cuCtxCreate(&c2, &params, 0, d));
    P(cuMemAlloc((CUdeviceptr *)&p, 4));
    return 0;
}
