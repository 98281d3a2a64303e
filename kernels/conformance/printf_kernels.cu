// printf and assert in ordinary kernels: what nvcc emits for them is what APEX's device runtime must serve.
#include <stdint.h>
#include <assert.h>
#include <stdio.h>

extern "C" {

__global__ void printf_types(int i, unsigned u, long long ll, double d, float f, const char *s, char c) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        printf("i=%d u=%u ll=%lld d=%.3f f=%g s=%s c=%c\n", i, u, ll, d, f, s, c);
        printf("x=%#x o=%o X=%08X e=%e p=%p %%\n", u, u, u, d, (void *)s);
        printf("width [%8d] [%-8d] [%+d] [%10.4s]\n", i, i, i, "truncate");
        printf("literal %s and short %hd char %hhu ul %lu zu %zu\n", "in-image", (short)i, (unsigned char)c,
               (unsigned long)u, (size_t)ll);
    }
}

// `*` widths and precisions, taken from the arguments as C does. The CUDA driver's vprintf prints `%.*f` verbatim
// and reads the arguments after it out of step (a `%s` after it faulted), so only the direct path runs this.
__global__ void printf_star(int i, double d) {
    printf("star [%*d] [%-*d] [%.*f] [%*.*f]\n", 6, i, 5, i, 2, d, 9, 3, d);
}

// Every thread prints: order across threads is unspecified, the set of lines is not.
__global__ void printf_each(int tag) {
    printf("tag %d block %d thread %d\n", tag, blockIdx.x, threadIdx.x);
}

// Many live values across the call: a runtime that clobbers what the caller keeps would corrupt `out`.
__global__ void printf_live(uint32_t *out, uint32_t seed) {
    uint32_t t = threadIdx.x;
    uint32_t a = seed * 3 + t, b = seed ^ t, c = seed + 7 * t, d = seed * t + 1, e = a * b, f = c - d, g = e ^ f;
    uint32_t h = a + b + c, k = d * e, l = f + g;
    if ((seed & 1) == 0 || t < 2) printf("live %u %u\n", t, a);
    out[t * 10 + 0] = a; out[t * 10 + 1] = b; out[t * 10 + 2] = c; out[t * 10 + 3] = d;
    out[t * 10 + 4] = e; out[t * 10 + 5] = f; out[t * 10 + 6] = g; out[t * 10 + 7] = h;
    out[t * 10 + 8] = k; out[t * 10 + 9] = l;
}

// No printf: a kernel of a module that has printf elsewhere must run as usual.
__global__ void plain_add(const float *a, const float *b, float *o, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = a[i] + b[i];
}

__global__ void assert_when(const int *v, int bad) {
    int x = v[threadIdx.x];
    assert(x != bad);
}

// printf in a loop: overflows a small FIFO.
__global__ void printf_flood(int lines) {
    for (int k = 0; k < lines; k++) printf("flood %d %d %d\n", blockIdx.x, threadIdx.x, k);
}

}
