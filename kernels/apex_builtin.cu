// Kernels APEX itself launches (compiled into the library from the cubin beside this file, built by build.sh).
#include <stdint.h>

extern "C" {

// Device-to-device copy of `n` bytes: 16-byte vector loads and stores when both addresses allow it, then the tail;
// grid-stride, so any grid covers any size. The copy engine moves device memory at about 90 GB/s on the H200;
// the SMs reach the HBM's bandwidth.
__global__ void apex_copy(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst, uint64_t n) {
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t head = 0;
    if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
        const uint4 *s = (const uint4 *)src;
        uint4 *d = (uint4 *)dst;
        uint64_t n16 = n / 16;
        for (uint64_t k = i; k < n16; k += stride) d[k] = s[k];
        head = n16 * 16;
    }
    for (uint64_t k = head + i; k < n; k += stride) dst[k] = src[k];
}

// Sets `count` elements of `width` bytes (1, 2 or 4) at `dst` to the low bytes of `value`, as cuMemsetD8/16/32 do
// (`dst` aligned to `width`): 16-byte stores when `dst` allows them, then the tail; grid-stride.
__global__ void apex_fill(uint8_t *__restrict__ dst, uint32_t value, uint32_t width, uint64_t count) {
    uint64_t n = count * width;
    // The elements' pattern over four bytes (for width 1 and 2, the element repeated).
    uint32_t word = width == 1 ? (value & 0xffu) * 0x01010101u : width == 2 ? (value & 0xffffu) * 0x00010001u : value;
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t head = 0;
    if (((uintptr_t)dst & 15) == 0) {
        uint4 v = make_uint4(word, word, word, word);
        uint4 *d = (uint4 *)dst;
        uint64_t n16 = n / 16;
        for (uint64_t k = i; k < n16; k += stride) d[k] = v;
        head = n16 * 16;
    }
    // `dst` is aligned to `width`, so byte k of the range is byte k % 4 of the pattern.
    for (uint64_t k = head + i; k < n; k += stride) dst[k] = (uint8_t)(word >> (8 * (k & 3)));
}

}
