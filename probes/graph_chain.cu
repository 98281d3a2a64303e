// How CUDA graphs chain dependent kernels on this GPU: run under apex-trace to capture the pushbuffers and QMDs
// of a captured chain of N dependent launches, and time it against the same chain launched on a stream.
//   nvcc -arch=sm_90 -O2 -o graph_chain graph_chain.cu -lcuda
//   APEX_TRACE_FILE=t.jsonl LD_PRELOAD=libapex_trace.so ./graph_chain 4 2
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cuda_runtime.h>

__global__ void step(unsigned long long *v, unsigned long long mul, unsigned long long add) {
    *v = *v * mul + add;
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static unsigned long long expect_after(int n, int rounds) {
    unsigned long long x = 0;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < n; i++) x = x * ((unsigned long long)i * 0x9e3779b9ULL | 1) + (i ^ 7);
    return x;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4, reps = argc > 2 ? atoi(argv[2]) : 2;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned long long *v;
    CK(cudaMalloc(&v, 8));
    CK(cudaMemset(v, 0, 8));
    CK(cudaDeviceSynchronize());
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) step<<<1, 1, 0, s>>>(v, (unsigned long long)i * 0x9e3779b9ULL | 1, i ^ 7);
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    fprintf(stderr, "MARK instantiated\n");
    CK(cudaGraphUpload(ge, s));
    CK(cudaStreamSynchronize(s));
    fprintf(stderr, "MARK uploaded\n");
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        auto t = std::chrono::steady_clock::now();
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
        if (us < best) best = us;
    }
    unsigned long long got;
    CK(cudaMemcpy(&got, v, 8, cudaMemcpyDeviceToHost));
    unsigned long long want = expect_after(n, reps);
    printf("graph of %d dependent launches x %d: best %.2f us (%.3f us per launch); result %s\n", n, reps, best,
           best / n, got == want ? "ok" : "WRONG");
    CK(cudaMemset(v, 0, 8));
    best = 1e30;
    for (int r = 0; r < reps; r++) {
        auto t = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) step<<<1, 1, 0, s>>>(v, (unsigned long long)i * 0x9e3779b9ULL | 1, i ^ 7);
        CK(cudaStreamSynchronize(s));
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
        if (us < best) best = us;
    }
    CK(cudaMemcpy(&got, v, 8, cudaMemcpyDeviceToHost));
    printf("stream of %d dependent launches x %d: best %.2f us (%.3f us per launch); result %s\n", n, reps, best,
           best / n, got == want ? "ok" : "WRONG");
    return got == want ? 0 : 1;
}
