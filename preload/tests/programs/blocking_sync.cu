// A program that asks CUDA to sleep while it waits for the GPU: `cudaDeviceScheduleBlockingSync` (argument "device")
// or, in a spinning context, events made with `cudaEventBlockingSync` (argument "events"). It waits for ~20 ms
// kernels through each kind of wait (stream, device and event synchronizes, and a synchronous copy to pageable
// memory) and prints the CPU time those waits took beside their wall time (`metric`, not compared) and what the
// kernels computed (`result`). A sleeping wait costs a few ms of CPU for 300 ms of waiting; a spinning one ~300.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <sys/resource.h>

__global__ void spin_then_add(long long cycles, int* out, int v) {
    long long t = clock64();
    while (clock64() - t < cycles) {
    }
    if (threadIdx.x == 0) atomicAdd(out, v);
}

static double cpu_ms() {
    rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

#define CK(x)                                                                                          \
    do {                                                                                               \
        cudaError_t e_ = (x);                                                                          \
        if (e_ != cudaSuccess) {                                                                       \
            printf("result error %s at line %d\n", cudaGetErrorName(e_), __LINE__);                  \
            return 1;                                                                                  \
        }                                                                                              \
    } while (0)

int main(int argc, char** argv) {
    bool device = argc > 1 && strcmp(argv[1], "device") == 0;
    if (device) CK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
    int* d;
    CK(cudaMalloc(&d, sizeof(int)));
    CK(cudaMemset(d, 0, sizeof(int)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Made to sleep in either mode; untimed, as the preload keeps such events itself.
    cudaEvent_t e;
    CK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming));
    spin_then_add<<<1, 32, 0, s>>>(1000, d, 1);
    CK(cudaStreamSynchronize(s));
    // ~20 ms at Hopper's clocks.
    const long long cycles = 36000000;
    int v = 1, host = 0;
    double c0 = cpu_ms();
    auto w0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; i++) {
        spin_then_add<<<1, 32, 0, s>>>(cycles, d, ++v);
        CK(cudaEventRecord(e, s));
        CK(cudaEventSynchronize(e));
    }
    if (device) {
        for (int i = 0; i < 4; i++) {
            spin_then_add<<<1, 32, 0, s>>>(cycles, d, ++v);
            CK(cudaStreamSynchronize(s));
        }
        for (int i = 0; i < 3; i++) {
            spin_then_add<<<1, 32, 0, s>>>(cycles, d, ++v);
            CK(cudaDeviceSynchronize());
        }
        for (int i = 0; i < 3; i++) {
            spin_then_add<<<1, 32, 0, s>>>(cycles, d, ++v);
            // To pageable memory on the kernel's stream: returns once the data is there.
            CK(cudaMemcpyAsync(&host, d, sizeof(int), cudaMemcpyDeviceToHost, s));
            printf("result copied %d\n", host);
        }
    }
    double cpu = cpu_ms() - c0;
    double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
    CK(cudaMemcpy(&host, d, sizeof(int), cudaMemcpyDeviceToHost));
    printf("result sum %d\n", host);
    printf("result last %s\n", cudaGetErrorName(cudaGetLastError()));
    printf("metric wait_cpu_ms %.1f\nmetric wait_wall_ms %.1f\n", cpu, wall);
    return 0;
}
