// Facts the preload's design rests on (apex-preload, issue 27), measured with libcuda alone:
//   costs   — CPU time of the driver calls a hook makes or replaces (median of many calls, ns);
//   assert  — what a failed device assert does: where the message goes, which codes later calls return;
//   replay  PTX — the preload's replay kernel asserting with the same strings, block and thread, for comparison.
// Build: nvcc -O2 -o preload_facts probes/preload_facts.cu -lcuda
#include <cuda.h>
#include <cassert>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>
#include <fstream>
#include <sstream>
#include <string>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_; cuGetErrorName(r_, &n_); \
    fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, n_); exit(1); } } while (0)

__global__ void empty_kernel() {}

#define FAIL_LINE 26
__global__ void fail_kernel(int *p, int v) {
    if (blockIdx.x == 2 && (threadIdx.x == 5 || threadIdx.x == 9)) {
        assert(v == 0);
    }
    p[threadIdx.x] = v;
}

static double now_ns() {
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F> static double median_ns(int n, F f) {
    std::vector<double> t(n);
    for (int i = 0; i < n; i++) { double a = now_ns(); f(i); t[i] = now_ns() - a; }
    std::sort(t.begin(), t.end());
    return t[n / 2];
}

static const char *name(CUresult r) { const char *n = "?"; cuGetErrorName(r, &n); return n; }

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "costs";
    CK(cuInit(0));
    CUdevice dev; CK(cuDeviceGet(&dev, 0));
    CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    CUstream s; CK(cuStreamCreate(&s, 0));
    if (!strcmp(mode, "costs")) {
        CUmodule m; CUfunction f;
        // The runtime registers kernels through its own path; take the empty kernel through the runtime-free way:
        // launch via the <<<>>> stub once is not possible without cudart, so load this binary's cubin via cuModuleLoad.
        CK(cuModuleLoad(&m, argv[2]));
        CK(cuModuleGetFunction(&f, m, "_Z12empty_kernelv"));
        const int N = 20000;
        CUcontext c;
        printf("cuCtxGetCurrent %.0f\n", median_ns(N, [&](int) { cuCtxGetCurrent(&c); }));
        CK(cuCtxSynchronize());
        printf("cuStreamQuery_idle %.0f\n", median_ns(N, [&](int) { cuStreamQuery(s); }));
        printf("cuStreamSynchronize_idle %.0f\n", median_ns(N, [&](int) { cuStreamSynchronize(s); }));
        printf("cuCtxSynchronize_idle %.0f\n", median_ns(N, [&](int) { cuCtxSynchronize(); }));
        printf("cuLaunchKernel_back_to_back %.0f\n", median_ns(N, [&](int i) {
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr);
            if (i % 256 == 255) cuStreamSynchronize(s);
        }));
        CK(cuStreamSynchronize(s));
        std::vector<double> iso;
        for (int i = 0; i < 5000; i++) {
            cuStreamSynchronize(s);
            double a = now_ns(); while (now_ns() - a < 2000) {}
            a = now_ns();
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr);
            iso.push_back(now_ns() - a);
        }
        std::sort(iso.begin(), iso.end());
        printf("cuLaunchKernel_isolated %.0f\n", iso[iso.size() / 2]);
        printf("launch_then_streamsync %.0f\n", median_ns(5000, [&](int) {
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr); cuStreamSynchronize(s); }));
        CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        printf("cuEventRecord %.0f\n", median_ns(N, [&](int i) { cuEventRecord(e, s); if (i % 256 == 255) cuStreamSynchronize(s); }));
        CK(cuStreamSynchronize(s));
        printf("cuEventQuery_done %.0f\n", median_ns(N, [&](int) { cuEventQuery(e); }));
        printf("cuEventSynchronize_done %.0f\n", median_ns(N, [&](int) { cuEventSynchronize(e); }));
        CUdeviceptr word; CK(cuMemAlloc(&word, 64)); CK(cuMemsetD8(word, 0, 64));
        printf("cuStreamWaitValue64_met %.0f\n", median_ns(N, [&](int i) {
            cuStreamWaitValue64(s, word, 0, CU_STREAM_WAIT_VALUE_GEQ); if (i % 256 == 255) cuStreamSynchronize(s); }));
        CK(cuStreamSynchronize(s));
        printf("cuStreamWriteValue64 %.0f\n", median_ns(N, [&](int i) {
            cuStreamWriteValue64(s, word + 8, i, 0); if (i % 256 == 255) cuStreamSynchronize(s); }));
        CK(cuStreamSynchronize(s));
        printf("launch_wait_launch_sync %.0f\n", median_ns(5000, [&](int) {
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr);
            cuStreamWaitValue64(s, word, 0, CU_STREAM_WAIT_VALUE_GEQ);
            cuStreamSynchronize(s); }));
        return 0;
    }
    if (!strcmp(mode, "assert")) {
        CUmodule m; CUfunction f;
        CK(cuModuleLoad(&m, argv[2]));
        CK(cuModuleGetFunction(&f, m, "_Z11fail_kernelPii"));
        CUdeviceptr p; CK(cuMemAlloc(&p, 4096));
        int v = 1; void *args[] = {&p, &v};
        CUresult r = cuLaunchKernel(f, 4, 1, 1, 32, 1, 1, 0, s, args, nullptr);
        printf("launch %s\n", name(r)); fflush(stdout);
        r = cuStreamSynchronize(s); printf("cuStreamSynchronize %s\n", name(r)); fflush(stdout);
        r = cuStreamQuery(s); printf("cuStreamQuery %s\n", name(r));
        CUdeviceptr q; r = cuMemAlloc(&q, 64); printf("cuMemAlloc %s\n", name(r));
        r = cuCtxSynchronize(); printf("cuCtxSynchronize %s\n", name(r));
        r = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, nullptr); printf("launch_after %s\n", name(r));
        fflush(stdout);
        return 0;
    }
    if (!strcmp(mode, "replay")) {
        std::ifstream in(argv[2]); std::stringstream ss; ss << in.rdbuf(); std::string ptx = ss.str();
        CUmodule m; CUfunction f;
        CK(cuModuleLoadData(&m, ptx.c_str()));
        CK(cuModuleGetFunction(&f, m, "apex_assert_replay"));
        const char *msg = "v == 0", *file = argv[3], *func = "void fail_kernel(int *, int)";
        std::vector<char> blob(4096, 0);
        size_t off = 64 * 2; // two records first
        auto put = [&](const char *str) { size_t at = off; memcpy(&blob[at], str, strlen(str) + 1); off += (strlen(str) + 8) & ~7ul; return at; };
        size_t om = put(msg), of = put(file), ofn = put(func);
        CUdeviceptr d; CK(cuMemAlloc(&d, blob.size()));
        struct Rec { unsigned long long key; unsigned line, pad; unsigned long long m, f, fn, cs; };
        Rec recs[2];
        unsigned threads[2] = {5, 9};
        for (int i = 0; i < 2; i++) {
            recs[i] = Rec{2ull * 1024 + threads[i], FAIL_LINE, 0, d + om, d + of, d + ofn, 1};
        }
        memcpy(&blob[0], recs, sizeof recs);
        CK(cuMemcpyHtoD(d, blob.data(), blob.size()));
        unsigned n = 2; void *args[] = {&d, &n};
        // Grid (bx+1) of the real kernel's block size: thread keys are linear in the replay's block shape, which
        // must be the original's for threads with y, z > 0; here x only.
        CUresult r = cuLaunchKernel(f, 3, 1, 1, 10, 1, 1, 0, s, args, nullptr);
        printf("launch %s\n", name(r)); fflush(stdout);
        r = cuStreamSynchronize(s); printf("cuStreamSynchronize %s\n", name(r)); fflush(stdout);
        r = cuMemAlloc(&d, 64); printf("cuMemAlloc %s\n", name(r));
        r = cuCtxSynchronize(); printf("cuCtxSynchronize %s\n", name(r));
        fflush(stdout);
        return 0;
    }
    fprintf(stderr, "usage: preload_facts costs|assert CUBIN | replay PTX FILE\n");
    return 2;
}
