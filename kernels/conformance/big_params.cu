// Kernel parameters beyond 4 KiB (CUDA 12.1 allows up to 32764 bytes): nvcc 13.0 describes them with
// EIATTR_KPARAM_INFO_V2 records, whose sizes do not fit EIATTR_KPARAM_INFO's 14 bits (tests/cubin.rs,
// tests/gpu_conformance.rs; preload/tests/programs/big_params.cu launches the same kernels).
// Build: nvcc -cubin -arch=sm_90 -O2 -o big_params.sm_90.cubin big_params.cu
struct P5K { int v[1250]; };
struct P32K { int v[8000]; };
__global__ void k5(P5K p, int *out, int salt) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 1250) out[i] = out[i] * 3 + p.v[i] + salt; }
__global__ void k32(int *out, P32K p, int salt) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 8000) out[i] = out[i] * 5 + p.v[(i * 7) % 8000] - salt; }
