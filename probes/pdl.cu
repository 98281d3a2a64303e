// Programmatic dependent launch on Hopper: which QMD fields libcuda sets for a consumer launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, on a stream and in a captured graph. Run under apex-trace:
//   nvcc -arch=sm_90 -O2 -o pdl pdl.cu && APEX_TRACE_FILE=t.jsonl LD_PRELOAD=libapex_trace.so ./pdl
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void producer(int *buf, int n, int v) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) buf[i] = v + i;
}

__global__ void consumer(const int *buf, int *out, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = buf[i] * 2;
}

static void launch(void (*k)(), void **args, cudaStream_t s, bool programmatic) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(8);
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = programmatic ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, (const void *)k, args));
}

int main() {
    int n = 4096;
    int *buf, *out;
    CK(cudaMalloc(&buf, n * 4));
    CK(cudaMalloc(&out, n * 4));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int v = 7;
    void *pa[] = {&buf, &n, &v};
    void *ca[] = {&buf, &out, &n};
    fprintf(stderr, "MARK stream\n");
    launch((void (*)())producer, pa, s, false);
    launch((void (*)())consumer, ca, s, true);
    CK(cudaStreamSynchronize(s));
    fprintf(stderr, "MARK graph\n");
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    launch((void (*)())producer, pa, s, false);
    launch((void (*)())consumer, ca, s, true);
    launch((void (*)())producer, pa, s, true);
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphUpload(ge, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    int h[4];
    CK(cudaMemcpy(h, out + 100, 16, cudaMemcpyDeviceToHost));
    printf("out[100] = %d (want %d)\n", h[0], (7 + 100) * 2);
    return 0;
}
