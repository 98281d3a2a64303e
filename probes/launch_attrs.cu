// What libcuda encodes for cuLaunchKernelEx attributes NCCL passes (issue 28): run under apex-trace, each variant
// launched with its own grid so its QMD can be told apart (a cluster launch's QMD counts its grid in clusters); probes/launch_attrs.py prints the QMD fields and methods
// that differ from the plain launch.
//   nvcc -O2 -arch=sm_90 -o launch_attrs probes/launch_attrs.cu -lcuda
//   APEX_TRACE_FILE=t.jsonl LD_PRELOAD=libapex_trace.so ./launch_attrs && python3 probes/launch_attrs.py t.jsonl
#include <cstdio>
#include <cuda_runtime.h>

__global__ void mark(int *p) { p[blockIdx.x] += 1; }

static void launch(int grid, int *p, cudaLaunchAttribute *attrs, int n, cudaStream_t s) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(32);
  c.stream = s;
  c.attrs = attrs;
  c.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&c, mark, p);
  if (e != cudaSuccess) printf("grid %d: %s\n", grid, cudaGetErrorString(e));
  cudaStreamSynchronize(s);
}

int main() {
  int *p;
  cudaMalloc(&p, 1024 * sizeof(int));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaLaunchAttribute a[2] = {};
  launch(8, p, nullptr, 0, s);  // plain
  a[0].id = cudaLaunchAttributeMemSyncDomain;
  a[0].val.memSyncDomain = cudaLaunchMemSyncDomainRemote;
  launch(10, p, a, 1, s);  // remote domain
  launch(20, p, a, 1, s);  // remote again
  launch(22, p, nullptr, 0, s);  // back to default
  a[0].id = cudaLaunchAttributeClusterDimension;
  a[0].val.clusterDim.x = 2; a[0].val.clusterDim.y = 1; a[0].val.clusterDim.z = 1;
  launch(60, p, a, 1, s);  // cluster of 2, default policy (30 clusters)
  a[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  a[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicySpread;
  launch(64, p, a, 2, s);  // cluster of 2, spread (32 clusters)
  a[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
  launch(68, p, a, 2, s);  // cluster of 2, load balancing (34 clusters)
  a[0].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  a[0].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicySpread;
  launch(18, p, a, 1, s);  // spread without a cluster
  a[0].id = cudaLaunchAttributeMemSyncDomainMap;
  a[0].val.memSyncDomainMap.default_ = 1; a[0].val.memSyncDomainMap.remote = 0;
  a[1].id = cudaLaunchAttributeMemSyncDomain;
  a[1].val.memSyncDomain = cudaLaunchMemSyncDomainRemote;
  launch(24, p, a, 2, s);  // remote through a swapped map: domain 0
  a[1].val.memSyncDomain = cudaLaunchMemSyncDomainDefault;
  launch(26, p, a, 2, s);  // default through a swapped map: domain 1
  int h[32];
  cudaMemcpy(h, p, sizeof h, cudaMemcpyDeviceToHost);
  printf("done %d %d\n", h[0], h[7]);
  return 0;
}
