// Kernels for programmatic dependent launch (issue 11): each waits for the launch before it with
// griddepcontrol.wait before touching memory, and lets the next launch be scheduled early with
// griddepcontrol.launch_dependents. Both instructions are no-ops in an ordinary launch, so the kernels also run
// in plain stream order. Built by kernels/build.sh into apex_pdl.sm_90.cubin: nvcc -cubin -arch=sm_90 -O3.

extern "C" {

// Nothing but the two instructions: the cost of a programmatic launch itself.
__global__ void pdl_empty() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// One step of a dependent sequence: buf[i] = buf[i] * 3 + v for every i < n (mod 2^32). It triggers its
// dependent before its own writes, so the next step is scheduled while this one still runs and only its
// griddepcontrol.wait keeps it from reading stale values: a wrong latch shows up as a wrong result.
__global__ void pdl_step(unsigned *buf, unsigned n, unsigned v) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        buf[i] = buf[i] * 3u + v;
    }
}

// About `spins` iterations of dependent arithmetic per thread, then one word written: a kernel with a known
// run time, for measuring how much of a launch's latency a programmatic launch hides.
__global__ void pdl_busy(unsigned *out, unsigned spins) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned x = threadIdx.x;
    for (unsigned i = 0; i < spins; i++) {
        x = x * 1664525u + 1013904223u;
    }
    if (x == 0x12345678u) {
        out[blockIdx.x] = x;
    }
}

}
