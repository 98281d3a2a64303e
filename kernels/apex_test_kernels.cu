// Kernels for APEX's tests, examples and benchmarks. Built by kernels/build.sh (nvcc, sm_80/sm_90/sm_100);
// the cubins are committed beside this file and compiled into the crate with include_bytes!.
#include <stdint.h>

extern "C" {

// Launch-latency probe: does nothing.
__global__ void empty() {}

__global__ void saxpy(float a, const float *x, float *y, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

__global__ void vector_add(const float *a, const float *b, float *out, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// Every scalar width, in an order that forces padding between parameters.
__global__ void scalar_params(uint64_t *out, int8_t a, int16_t b, int32_t c, int64_t d, float e, double f,
                              uint8_t g, uint64_t h) {
    out[0] = (uint64_t)(int64_t)a;
    out[1] = (uint64_t)(int64_t)b;
    out[2] = (uint64_t)(int64_t)c;
    out[3] = (uint64_t)d;
    out[4] = (uint64_t)__float_as_uint(e);
    out[5] = (uint64_t)__double_as_longlong(f);
    out[6] = (uint64_t)g;
    out[7] = h;
}

struct Triple { uint32_t x; uint64_t y; uint8_t z; };

// A by-value struct between two pointers.
__global__ void struct_param(uint64_t *out, Triple t, const uint32_t *in) {
    out[0] = t.x;
    out[1] = t.y;
    out[2] = t.z;
    out[3] = in[0];
}

struct Big { uint32_t words[1024]; };

// A 4 KiB parameter block: each thread copies one word out.
__global__ void big_param(uint32_t *out, Big big) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 1024) out[i] = big.words[i];
}

// Writes blockDim, gridDim and blockIdx of the block at linear block index `probe` (blocks elsewhere exit).
// Thread (0,0,0) of each block also counts blocks into out[9], bounded by `count_limit` so huge grids stay cheap.
__global__ void dims(uint32_t *out, uint64_t probe) {
    uint64_t lin = (uint64_t)blockIdx.x + (uint64_t)gridDim.x * ((uint64_t)blockIdx.y + (uint64_t)gridDim.y * blockIdx.z);
    if (lin != probe) return;
    if (threadIdx.x == blockDim.x - 1 && threadIdx.y == blockDim.y - 1 && threadIdx.z == blockDim.z - 1) {
        out[0] = blockDim.x; out[1] = blockDim.y; out[2] = blockDim.z;
        out[3] = gridDim.x;  out[4] = gridDim.y;  out[5] = gridDim.z;
        out[6] = blockIdx.x; out[7] = blockIdx.y; out[8] = blockIdx.z;
    }
    atomicAdd(&out[9], 1u);
}

// Counts every thread of every block: blocks * threads must come back.
__global__ void count_threads(uint32_t *counter) { atomicAdd(counter, 1u); }

// Dynamic shared memory: every word written by one thread and read back by another.
__global__ void dyn_shared(uint32_t *out, uint32_t words) {
    extern __shared__ uint32_t smem[];
    for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) smem[i] = i * 2654435761u;
    __syncthreads();
    uint32_t sum = 0;
    for (uint32_t i = (threadIdx.x + 1) % blockDim.x; i < words; i += blockDim.x) sum += smem[i] ^ i;
    atomicAdd(out, sum);
}

// Forces a large stack frame (local memory) by indexing a local array with runtime values.
__global__ void spill(uint32_t *out, uint32_t seed, uint32_t n) {
    volatile uint32_t local[1024];
    for (uint32_t i = 0; i < 1024; i++) local[i] = seed * (i + 1);
    uint32_t acc = 0;
    for (uint32_t i = 0; i < n; i++) acc += local[(seed + i * 7) & 1023];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Atomics across blocks: histogram of i % bins.
__global__ void histogram(uint32_t *bins, uint32_t nbins, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&bins[i % nbins], 1u);
}

// One link of a dependent chain: reads the previous value and writes a function of it.
__global__ void chain_step(uint64_t *value, uint64_t mul, uint64_t add) {
    value[0] = value[0] * mul + add;
}

// Faults: a store to an address nothing maps.
__global__ void fault_store(uint32_t *bad) { *bad = 0xdeadbeef; }

// Faults: a trap instruction.
__global__ void trap() { __trap(); }

// Never ends unless `*stop` becomes non-zero.
__global__ void spin(volatile uint32_t *stop) { while (*stop == 0) {} }

}
