// Kernels that show what constant bank 0's driver words hold, for a launch by libcuda and by APEX to be compared
// (tests/gpu_driver_words.rs). Built on the GPU machine:
//   nvcc -O2 -arch=sm_90 -cubin -o driver_words.sm_90.cubin driver_words.cu
#include <cstdint>

struct Block { unsigned long long w[4]; };

// A 32-bit load through a generic address, which the compiler cannot turn back into a constant-bank load.
__device__ __forceinline__ unsigned load_generic(const void *p) {
  unsigned v;
  asm volatile("ld.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Writes the address of its grid constant `tag` (which the compiler takes from c[0x0][0x198], the parameter block's
// start) to addr[0], then copies `count` words of this launch's constant bank 0 from byte `first`, read through that
// address (the bank starts 0x210 bytes before it), into out[block * count ...].
extern "C" __global__ void bank_words(const __grid_constant__ Block tag, unsigned *out, unsigned long long *addr,
                                      unsigned first, unsigned count) {
  const unsigned char *param = reinterpret_cast<const unsigned char *>(&tag);
  const unsigned char *bank = param - 0x210 + first;
  unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (b == 0 && threadIdx.x == 0) addr[0] = reinterpret_cast<unsigned long long>(param);
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x) out[b * count + i] = load_generic(bank + 4 * i);
}

// Sums a grid constant's words read through its address (generic loads from c[0x0][0x198] + offset).
extern "C" __global__ void grid_constant_sum(const __grid_constant__ Block b, unsigned long long *out, int n) {
  const unsigned char *p = reinterpret_cast<const unsigned char *>(&b);
  unsigned long long s = 0;
  for (int i = 0; i < n; i++) {
    const unsigned char *w = p + 8 * ((i + threadIdx.x) % 4);
    unsigned long long v = load_generic(w) | (static_cast<unsigned long long>(load_generic(w + 4)) << 32);
    s = s * 31 + v;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// The cluster special registers every block sees, 12 words per block: %clusterid (3), %cluster_ctaid (3),
// %cluster_ctarank, %nclusterid (3), %cluster_nctaid.x, %cluster_nctarank. The compiler derives %clusterid and
// %cluster_ctaid from %ctaid and driver words (c[0x0][0x150..0x158] scale %ctaid to the cluster).
__device__ __forceinline__ unsigned sreg(int which) {
  unsigned v = 0;
  switch (which) {
    case 0: asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(v)); break;
    case 1: asm volatile("mov.u32 %0, %%clusterid.y;" : "=r"(v)); break;
    case 2: asm volatile("mov.u32 %0, %%clusterid.z;" : "=r"(v)); break;
    case 3: asm volatile("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(v)); break;
    case 4: asm volatile("mov.u32 %0, %%cluster_ctaid.y;" : "=r"(v)); break;
    case 5: asm volatile("mov.u32 %0, %%cluster_ctaid.z;" : "=r"(v)); break;
    case 6: asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(v)); break;
    case 7: asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(v)); break;
    case 8: asm volatile("mov.u32 %0, %%nclusterid.y;" : "=r"(v)); break;
    case 9: asm volatile("mov.u32 %0, %%nclusterid.z;" : "=r"(v)); break;
    case 10: asm volatile("mov.u32 %0, %%cluster_nctaid.x;" : "=r"(v)); break;
    default: asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(v)); break;
  }
  return v;
}

extern "C" __global__ void cluster_registers(unsigned *out) {
  unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x < 12) out[b * 12 + threadIdx.x] = sreg(threadIdx.x);
}
