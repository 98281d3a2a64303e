// Thread block clusters: distributed shared memory and cluster.sync() prove the blocks really form clusters.
#include <stdint.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" {

// Each block writes its rank into its shared memory, syncs the cluster, then reads every peer's shared memory.
// out[block] = cluster size * 1000 + sum of peers' ranks + 100 * own rank; -1 if a peer's value is wrong.
__device__ void cluster_body(int *out) {
    __shared__ int mine[1];
    cg::cluster_group cluster = cg::this_cluster();
    unsigned rank = cluster.block_rank();
    unsigned size = cluster.num_blocks();
    if (threadIdx.x == 0) mine[0] = (int)rank + 1;
    cluster.sync();
    if (threadIdx.x == 0) {
        int sum = 0;
        bool ok = true;
        for (unsigned r = 0; r < size; r++) {
            int *peer = cluster.map_shared_rank(mine, r);
            int v = *peer;
            if (v != (int)r + 1) ok = false;
            sum += v;
        }
        unsigned lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        out[lin] = ok ? (int)(size * 1000 + sum + 100 * rank) : -1;
    }
    cluster.sync();
}

__global__ void __cluster_dims__(2, 1, 1) cluster_fixed(int *out) { cluster_body(out); }

__global__ void cluster_runtime(int *out) { cluster_body(out); }

}
