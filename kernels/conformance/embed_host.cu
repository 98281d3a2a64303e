// A host program whose kernels nvcc embeds as a fatbin (.nv_fatbin); APEX loads kernels out of the built file.
#include <cstdio>
#include <cstdint>
extern "C" __global__ void embedded_scale(float *x, float a, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
extern "C" int embed_host_entry(void) { return 42; }
#ifndef EMBED_LIB
int main() { printf("%d\n", embed_host_entry()); return 0; }
#endif
