// Graphs built node by node (kernel, memcpy, host, child graph and event nodes), updated in place and as a whole,
// captured from two streams, and with a conditional while node, each launched between plain launches on the same
// streams.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("result error %s line %d\n", cudaGetErrorName(e), __LINE__); return 0; } } while (0)
__global__ void k_scale(float *y, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = y[i] * a + 1.0f; }
__global__ void k_mix(float *y, const float *x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 0.5f * y[i] + 0.25f * x[(i * 7) % n]; }
__global__ void k_body(cudaGraphConditionalHandle h, int *counter, float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = y[i] * 0.5f + 1.0f;
  if (i == 0) { int c = --(*counter); cudaGraphSetConditional(h, c > 0 ? 1 : 0); }
}
__global__ void k_reset(int *counter, int v) { *counter = v; }
static int host_calls = 0;
static void CUDART_CB on_host(void *p) { host_calls += *(int *)p; }
static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull; const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; } return h; }
int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  const int n = 1 << 14;
  float *x, *y, *z; CHECK(cudaMalloc(&x, n * 4)); CHECK(cudaMalloc(&y, n * 4)); CHECK(cudaMalloc(&z, n * 4));
  static float h[1 << 14];
  for (int i = 0; i < n; i++) h[i] = (i % 113) * 0.01f;
  CHECK(cudaMemcpy(x, h, n * 4, cudaMemcpyHostToDevice)); CHECK(cudaMemset(y, 0, n * 4)); CHECK(cudaMemset(z, 0, n * 4));
  cudaStream_t s1, s2; CHECK(cudaStreamCreate(&s1)); CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t ev; CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  // Child graph: one kernel.
  cudaGraph_t child; CHECK(cudaGraphCreate(&child, 0));
  float a1 = 0.75f; int nn = n;
  void *scale_args[] = {&z, &a1, &nn};
  cudaKernelNodeParams kp = {}; kp.func = (void *)k_scale; kp.gridDim = dim3(n / 256); kp.blockDim = dim3(256); kp.kernelParams = scale_args;
  cudaGraphNode_t cnode; CHECK(cudaGraphAddKernelNode(&cnode, child, nullptr, 0, &kp));
  // Main graph: memset z? no: memcpy x->z, kernel mix(y, z), child graph, host node, event record.
  cudaGraph_t g; CHECK(cudaGraphCreate(&g, 0));
  cudaGraphNode_t ncpy, nmix, nchild, nhost, nscale, nrec;
  CHECK(cudaGraphAddMemcpyNode1D(&ncpy, g, nullptr, 0, z, x, n * 4, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphAddChildGraphNode(&nchild, g, &ncpy, 1, child));
  void *mix_args[] = {&y, &z, &nn};
  cudaKernelNodeParams mp = {}; mp.func = (void *)k_mix; mp.gridDim = dim3(n / 256); mp.blockDim = dim3(256); mp.kernelParams = mix_args;
  CHECK(cudaGraphAddKernelNode(&nmix, g, &nchild, 1, &mp));
  int one = 1; cudaHostNodeParams hp = {on_host, &one};
  CHECK(cudaGraphAddHostNode(&nhost, g, &nmix, 1, &hp));
  float a2 = 0.5f; void *scale2[] = {&y, &a2, &nn};
  cudaKernelNodeParams sp = kp; sp.kernelParams = scale2;
  CHECK(cudaGraphAddKernelNode(&nscale, g, &nmix, 1, &sp));
  CHECK(cudaGraphAddEventRecordNode(&nrec, g, &nscale, 1, ev));
  cudaGraphExec_t ge; CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int it = 0; it < iters; it++) {
    k_scale<<<n / 256, 256, 0, s1>>>(y, 0.9f, n);
    CHECK(cudaGraphLaunch(ge, s1));
    k_mix<<<n / 256, 256, 0, s1>>>(y, x, n);
    if (it % 10 == 0) {
      // A stream of the program's waits for the graph's event node, then works on z.
      CHECK(cudaStreamWaitEvent(s2, ev, 0));
      k_scale<<<n / 256, 256, 0, s2>>>(z, 1.01f, n);
      CHECK(cudaStreamSynchronize(s2));
    }
    if (it == iters / 2) {
      // In place: the second scale's factor; then a whole update from an edited copy of the graph.
      float a3 = 0.25f; void *scale3[] = {&y, &a3, &nn}; cudaKernelNodeParams p3 = sp; p3.kernelParams = scale3;
      CHECK(cudaGraphExecKernelNodeSetParams(ge, nscale, &p3));
      float a4 = 0.625f; void *scale4[] = {&z, &a4, &nn}; cudaKernelNodeParams p4 = kp; p4.kernelParams = scale4;
      CHECK(cudaGraphKernelNodeSetParams(cnode, &p4));
      cudaGraph_t g2; CHECK(cudaGraphClone(&g2, g));
      cudaGraphExecUpdateResultInfo info; CHECK(cudaGraphExecUpdate(ge, g2, &info));
      printf("result update %d\n", (int)info.result);
      CHECK(cudaGraphDestroy(g2));
    }
  }
  CHECK(cudaStreamSynchronize(s1));
  CHECK(cudaMemcpy(h, y, n * 4, cudaMemcpyDeviceToHost)); printf("result y %016llx\n", (unsigned long long)fnv(h, n * 4));
  CHECK(cudaMemcpy(h, z, n * 4, cudaMemcpyDeviceToHost)); printf("result z %016llx\n", (unsigned long long)fnv(h, n * 4));
  printf("result host_calls %d\n", host_calls);
  // Captured from two streams with a fork and a join, then replayed between plain launches.
  cudaGraph_t cg; cudaGraphExec_t cge;
  CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  k_scale<<<n / 256, 256, 0, s1>>>(y, 0.5f, n);
  CHECK(cudaEventRecord(ev, s1)); CHECK(cudaStreamWaitEvent(s2, ev, 0));
  k_scale<<<n / 256, 256, 0, s2>>>(z, 0.5f, n);
  k_mix<<<n / 256, 256, 0, s1>>>(y, x, n);
  cudaEvent_t ev2; CHECK(cudaEventCreateWithFlags(&ev2, cudaEventDisableTiming));
  CHECK(cudaEventRecord(ev2, s2)); CHECK(cudaStreamWaitEvent(s1, ev2, 0));
  k_mix<<<n / 256, 256, 0, s1>>>(y, z, n);
  CHECK(cudaStreamEndCapture(s1, &cg)); CHECK(cudaGraphInstantiate(&cge, cg, 0));
  for (int it = 0; it < iters; it++) {
    k_scale<<<n / 256, 256, 0, s2>>>(z, 1.001f, n);
    CHECK(cudaGraphLaunch(cge, s2));
    k_mix<<<n / 256, 256, 0, s2>>>(z, y, n);
  }
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(h, y, n * 4, cudaMemcpyDeviceToHost)); printf("result y2 %016llx\n", (unsigned long long)fnv(h, n * 4));
  CHECK(cudaMemcpy(h, z, n * 4, cudaMemcpyDeviceToHost)); printf("result z2 %016llx\n", (unsigned long long)fnv(h, n * 4));
  // A graph with a conditional while node, set from the kernel in its body (CUDA 12.4+).
  int *counter; CHECK(cudaMalloc(&counter, 4));
  cudaGraph_t wg; CHECK(cudaGraphCreate(&wg, 0));
  cudaGraphConditionalHandle cond; CHECK(cudaGraphConditionalHandleCreate(&cond, wg, 1, cudaGraphCondAssignDefault));
  cudaGraphNodeParams cp = {}; cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = cond; cp.conditional.type = cudaGraphCondTypeWhile; cp.conditional.size = 1;
  cudaGraphNode_t cn; CHECK(cudaGraphAddNode(&cn, wg, nullptr, nullptr, 0, &cp));
  void *body_args[] = {&cond, &counter, &y, &nn};
  cudaKernelNodeParams bp = {}; bp.func = (void *)k_body; bp.gridDim = dim3(n / 256); bp.blockDim = dim3(256); bp.kernelParams = body_args;
  cudaGraphNode_t bn; CHECK(cudaGraphAddKernelNode(&bn, cp.conditional.phGraph_out[0], nullptr, 0, &bp));
  cudaGraphExec_t wge; CHECK(cudaGraphInstantiate(&wge, wg, 0));
  for (int it = 0; it < iters; it++) {
    k_reset<<<1, 1, 0, s1>>>(counter, 1 + it % 5);
    CHECK(cudaGraphLaunch(wge, s1));
    k_scale<<<n / 256, 256, 0, s1>>>(y, 0.99f, n);
  }
  CHECK(cudaStreamSynchronize(s1));
  CHECK(cudaMemcpy(h, y, n * 4, cudaMemcpyDeviceToHost)); printf("result y3 %016llx\n", (unsigned long long)fnv(h, n * 4));
  CHECK(cudaGetLastError());
  printf("result no error\n");
  return 0;
}
