// How CUDA graphs resolve fan-outs and fan-ins on Hopper: a root, W independent branches, and a join that
// depends on every branch, built node by node. Run under apex-trace to capture the QMDs libcuda uploads for the
// nodes (QmdUpload records) and the methods a replay sends:
//   nvcc -arch=sm_90 -O2 -o graph_fan graph_fan.cu
//   APEX_TRACE_FILE=t.jsonl LD_PRELOAD=libapex_trace.so ./graph_fan W REPLAYS
// Every node adds its own value into its own slot; the join checks that every branch has run before it.
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void node(unsigned *slots, int i, int after, int count) {
    // A join (count > 0) records how many of its predecessors' slots had reached this replay's value.
    if (count > 0) {
        unsigned want = slots[i] + 1, done = 0;
        for (int k = 0; k < count; k++) done += ((volatile unsigned *)slots)[after + k] >= want;
        slots[i + 1] += done;
    }
    slots[i] += 1;
}

int main(int argc, char **argv) {
    int w = argc > 1 ? atoi(argv[1]) : 2, reps = argc > 2 ? atoi(argv[2]) : 2;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned *slots;
    int n = w + 4;
    CK(cudaMalloc(&slots, n * sizeof(unsigned)));
    CK(cudaMemset(slots, 0, n * sizeof(unsigned)));
    CK(cudaDeviceSynchronize());
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    auto add = [&](int i, int after, int count, std::vector<cudaGraphNode_t> deps) {
        void *args[] = {&slots, &i, &after, &count};
        cudaKernelNodeParams p = {};
        p.func = (void *)node;
        p.gridDim = dim3(1);
        p.blockDim = dim3(1);
        p.kernelParams = args;
        cudaGraphNode_t nd;
        CK(cudaGraphAddKernelNode(&nd, g, deps.data(), deps.size(), &p));
        return nd;
    };
    // slot 0: root; slots 1..w: branches; slot w+1: join (w+2 holds the join's count).
    cudaGraphNode_t root = add(0, 0, 0, {});
    std::vector<cudaGraphNode_t> branches;
    for (int b = 0; b < w; b++) branches.push_back(add(1 + b, 0, 0, {root}));
    add(w + 1, 1, w, branches);
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
    std::vector<unsigned> got(n);
    CK(cudaMemcpy(got.data(), slots, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
    bool ok = true;
    for (int i = 0; i <= w + 1; i++) ok &= got[i] == (unsigned)reps;
    ok &= got[w + 2] == (unsigned)(reps * w);
    printf("graph fan %d x %d replays: best %.2f us; %s\n", w, reps, best, ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
}
