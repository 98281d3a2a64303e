// Streams of two priorities and launches that ask for a priority: kernels on the high-priority stream, and launches
// with `cudaLaunchAttributePriority`, stay on libcuda, which schedules them ahead of other streams' work; the
// default-priority stream's plain launches run through APEX. Prints what the kernels computed (`result` lines).
#include <cstdio>
#include <cstdint>
#include <vector>

__global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

static uint64_t fnv(const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

#define CK(x)                                                                             \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            printf("result error %s at line %d\n", cudaGetErrorName(e_), __LINE__);     \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

int main() {
    int lowest, highest;
    CK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    cudaStream_t low, high;
    CK(cudaStreamCreateWithPriority(&low, cudaStreamNonBlocking, lowest));
    CK(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, highest));
    const int n = 1 << 18;
    float *x, *y1, *y2, *y3;
    CK(cudaMalloc(&x, n * sizeof(float)));
    CK(cudaMalloc(&y1, n * sizeof(float)));
    CK(cudaMalloc(&y2, n * sizeof(float)));
    CK(cudaMalloc(&y3, n * sizeof(float)));
    std::vector<float> h(n);
    for (int i = 0; i < n; i++) h[i] = i * 1e-3f;
    CK(cudaMemcpy(x, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(y1, 0, n * sizeof(float)));
    CK(cudaMemset(y2, 0, n * sizeof(float)));
    CK(cudaMemset(y3, 0, n * sizeof(float)));
    CK(cudaDeviceSynchronize());
    cudaEvent_t done_low, done_high;
    CK(cudaEventCreateWithFlags(&done_low, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done_high, cudaEventDisableTiming));
    for (int it = 0; it < 300; it++) {
        axpy<<<n / 256, 256, 0, low>>>(0.5f, x, y1, n);
        CK(cudaEventRecord(done_low, low));
        CK(cudaStreamWaitEvent(high, done_low, 0));
        axpy<<<n / 256, 256, 0, high>>>(0.25f, y1, y2, n);
        CK(cudaEventRecord(done_high, high));
        CK(cudaStreamWaitEvent(low, done_high, 0));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = n / 256;
        cfg.blockDim = 256;
        cfg.stream = low;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributePriority;
        at[0].val.priority = highest;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, axpy, 0.125f, (const float*)y2, y3, n));
    }
    CK(cudaDeviceSynchronize());
    std::vector<float> a(n);
    for (float* y : {y1, y2, y3}) {
        CK(cudaMemcpy(a.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
        printf("result y %016llx\n", (unsigned long long)fnv(a.data(), n * sizeof(float)));
    }
    printf("result priorities %d %d\n", lowest, highest);
    printf("result last %s\n", cudaGetErrorName(cudaGetLastError()));
    return 0;
}
