// Register pressure across printf: which registers ptxas keeps live across the vprintf call tells what it
// assumes the callee preserves.
#include <stdint.h>
#include <stdio.h>
extern "C" __global__ void printf_pressure(uint32_t *out, uint32_t s) {
    uint32_t v[48];
#pragma unroll
    for (int i = 0; i < 48; i++) v[i] = (s * (i + 3)) ^ (threadIdx.x + i * 977u);
    printf("p %u\n", v[0]);
#pragma unroll
    for (int i = 0; i < 48; i++) out[threadIdx.x * 48 + i] = v[i] * v[(i + 1) % 48] + v[(i + 7) % 48];
}
extern "C" __global__ void printf_pressure_pred(uint32_t *out, uint32_t s) {
    uint32_t t = threadIdx.x;
    bool p0 = (s & 1) != 0, p1 = (s & 2) != 0, p2 = t > 5, p3 = (s ^ t) & 4;
    float f = __uint_as_float(s) * 1.5f;
    printf("q %u\n", t);
    uint32_t r = 0;
    if (p0) r += 1; if (p1) r += 2; if (p2) r += 4; if (p3) r += 8;
    out[t] = r + (uint32_t)f;
}
