// Launches cluster kernels through the CUDA runtime so apex-trace can record the QMD fields libcuda sets for
// clusters: compile-time (__cluster_dims__) and run-time (cudaLaunchAttributeClusterDimension) shapes.
//   nvcc -arch=sm_90 -o cluster_launch probes/cluster_launch.cu kernels/conformance/cluster.cu -rdc=true
#include <cstdio>
#include <cuda_runtime.h>
extern "C" __global__ void cluster_fixed(int *out);
extern "C" __global__ void cluster_runtime(int *out);
int main() {
    int *d;
    cudaMalloc(&d, 64 * sizeof(int));
    cluster_fixed<<<8, 32>>>(d);
    cudaDeviceSynchronize();
    int h[64];
    cudaMemcpy(h, d, 8 * sizeof(int), cudaMemcpyDeviceToHost);
    printf("fixed:");
    for (int i = 0; i < 8; i++) printf(" %d", h[i]);
    printf("\n");
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(12, 1, 1);
    cfg.blockDim = dim3(64, 1, 1);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 4;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, cluster_runtime, d);
    cudaDeviceSynchronize();
    cudaMemcpy(h, d, 12 * sizeof(int), cudaMemcpyDeviceToHost);
    printf("runtime (%s):", cudaGetErrorString(e));
    for (int i = 0; i < 12; i++) printf(" %d", h[i]);
    printf("\n");
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, 0);
    printf("cluster launch attr %d\n", v);
    return 0;
}
