// Kernels that show what constant bank 0's driver words hold, for a launch by libcuda and by APEX to be compared
// (tests/gpu_globals_clusters.rs). Built on the GPU machine:
//   nvcc -O2 -arch=sm_90 -cubin -o driver_words.sm_90.cubin driver_words.cu
#include <cstdint>

struct Block { unsigned long long w[4]; };

// Copies `count` words of this launch's constant bank 0 from byte `first` into out[block * count ...]. Taking the
// address of a __grid_constant__ parameter reads the parameter block's address from c[0x0][0x198]; the bank starts
// 0x210 bytes before it.
extern "C" __global__ void bank_words(const __grid_constant__ Block tag, unsigned *out, unsigned first, unsigned count) {
  const unsigned char *param = reinterpret_cast<const unsigned char *>(&tag);
  const unsigned *bank = reinterpret_cast<const unsigned *>(param - 0x210 + first);
  unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x) out[b * count + i] = bank[i];
}

// Reads a grid constant through its address (and the parameter block's end, c[0x0][0x1a0], is not read by code).
extern "C" __global__ void grid_constant_sum(const __grid_constant__ Block b, unsigned long long *out, int n) {
  const Block *p = &b;
  unsigned long long s = 0;
  for (int i = 0; i < n; i++) s = s * 31 + p->w[(i + threadIdx.x) % 4];
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
