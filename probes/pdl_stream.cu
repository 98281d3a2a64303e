// Programmatic stream serialization on Hopper, eager: which QMD fields and front-end methods libcuda uses when a
// launch on a stream carries cudaLaunchAttributeProgrammaticStreamSerialization (and when the one before did).
// Run under apex-trace:
//   nvcc -arch=sm_90 -O2 -o pdl_stream pdl_stream.cu && APEX_TRACE_FILE=t.jsonl LD_PRELOAD=libapex_trace.so ./pdl_stream
// The launches, in order, each marked on stderr: plain, PSS, PSS, plain, plain, PSS; then 1000 PSS launches of an
// empty kernel timed beside 1000 plain ones (the eager cost of a programmatic launch); any argument: the six only.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void step(int *buf, int n, int v) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) buf[i] = buf[i] * 3 + v;
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void empty_pdl() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

static void launch(const void *k, dim3 grid, void **args, cudaStream_t s, bool programmatic) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = programmatic ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, k, args));
}

int main(int argc, char **argv) {
    int n = 4096;
    int *buf;
    CK(cudaMalloc(&buf, n * 4));
    CK(cudaMemset(buf, 0, n * 4));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const bool order[6] = {false, true, true, false, false, true};
    int want = 0;
    for (int i = 0; i < 6; i++) {
        int v = i + 1;
        void *a[] = {&buf, &n, &v};
        fprintf(stderr, "MARK launch %d %s\n", i, order[i] ? "pss" : "plain");
        launch((const void *)step, dim3(8), a, s, order[i]);
        want = want * 3 + v;
    }
    CK(cudaStreamSynchronize(s));
    int h;
    CK(cudaMemcpy(&h, buf + 100, 4, cudaMemcpyDeviceToHost));
    printf("buf[100] = %d (want %d)\n", h, want);
    if (argc > 1) return h == want ? 0 : 1;  // traced: the six launches only
    fprintf(stderr, "MARK timing\n");
    for (int pss = 0; pss < 2; pss++) {
        for (int r = 0; r < 3; r++) {
            auto t = std::chrono::steady_clock::now();
            for (int i = 0; i < 1000; i++) launch((const void *)empty_pdl, dim3(1), nullptr, s, pss);
            CK(cudaStreamSynchronize(s));
            double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
            printf("%s: %.3f us per dependent launch\n", pss ? "programmatic" : "plain", us / 1000);
        }
    }
    return h == want ? 0 : 1;
}
