// A cooperative kernel: grid-wide sync through cooperative groups (needs cuLaunchCooperativeKernel).
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" __global__ void grid_sum(const int *x, int *partial, int *out, int n) {
    cg::grid_group grid = cg::this_grid();
    int i = grid.thread_rank();
    int v = 0;
    for (int k = i; k < n; k += grid.size()) v += x[k];
    atomicAdd(&partial[blockIdx.x], v);
    grid.sync();
    if (i == 0) {
        int s = 0;
        for (unsigned b = 0; b < gridDim.x; b++) s += partial[b];
        *out = s;
    }
}
