// Which printf conversions the CUDA driver's own vprintf handles: one kernel per feature, each checked alone.
#include <cstdio>
__global__ void star_width(int i) { printf("[%*d]\n", 6, i); }
__global__ void star_prec(double d) { printf("[%.*f]\n", 2, d); }
__global__ void prec_str() { printf("[%10.4s]\n", "truncate"); }
int main() {
    star_width<<<1, 1>>>(-7); printf("star_width: %s\n", cudaGetErrorString(cudaDeviceSynchronize())); fflush(stdout);
    cudaDeviceReset();
    star_prec<<<1, 1>>>(3.25); printf("star_prec: %s\n", cudaGetErrorString(cudaDeviceSynchronize())); fflush(stdout);
    cudaDeviceReset();
    prec_str<<<1, 1>>>(); printf("prec_str: %s\n", cudaGetErrorString(cudaDeviceSynchronize())); fflush(stdout);
    return 0;
}
