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

// A producer that finishes long after its dependent could: it lets the dependent start at once, spins for about
// `spins` iterations, then sets flag[0] to 1.
__global__ void pdl_late(unsigned *flag, unsigned spins) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned x = threadIdx.x;
    for (unsigned i = 0; i < spins; i++) {
        x = x * 1664525u + 1013904223u;
    }
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        flag[0] = 1u + (x == 0x12345678u ? 1u : 0u);
    }
}

// A dependent that touches nothing its producer writes, so it runs no griddepcontrol.wait. It records what it saw
// of the producer's flag (10: not yet set; 11: set), which tells whether it really ran before the producer ended.
__global__ void pdl_nowait(unsigned *out, const volatile unsigned *flag) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = 10u + flag[0];
    }
}

}
