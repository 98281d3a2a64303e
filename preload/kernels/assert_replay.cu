// apex-preload's replay of device asserts through the CUDA driver.
//
// Under the preload, a kernel launched through APEX that fails an `assert` runs APEX's `__assertfail`, which records
// the message, file, line, function, block and thread, and ends the thread without faulting (the channel group is
// the program's CUDA context: a fault there would end it with another error than CUDA's). At the program's next
// synchronization the preload launches this kernel through libcuda with those records, so the failure reaches the
// program exactly as libcuda reports a device assert: libcuda's own `__assertfail` prints each message from the same
// block and thread, and the context is left with CUDA_ERROR_ASSERT, sticky, as libcuda makes it.
//
// Built to PTX (so libcuda compiles it for whatever GPU the program runs on) by preload/kernels/build.sh; the PTX is
// committed and embedded in the preload.

extern "C" __device__ void __assertfail(const char *message, const char *file, unsigned int line,
                                        const char *function, unsigned long long char_size);

// One failed assert, as the preload lays it out (little-endian, 48 bytes). Sorted by (block, thread) key.
struct ApexAssertRecord {
    unsigned long long key;  // linear block index * 1024 + linear thread index (a block has at most 1024 threads)
    unsigned int line;
    unsigned int pad;
    const char *message;
    const char *file;
    const char *function;
    unsigned long long char_size;
};

// Launched with a grid and block large enough to hold every recorded block and thread; every thread looks itself up
// (binary search on the sorted keys) and asserts with its record, if it has one.
extern "C" __global__ void apex_assert_replay(const ApexAssertRecord *records, unsigned int n) {
    unsigned long long block = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    unsigned int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned long long key = block * 1024ull + thread;
    unsigned int lo = 0, hi = n;
    while (lo < hi) {
        unsigned int mid = (lo + hi) / 2;
        unsigned long long k = records[mid].key;
        if (k == key) {
            const ApexAssertRecord *r = &records[mid];
            __assertfail(r->message, r->file, r->line, r->function, r->char_size);
            return;
        }
        if (k < key) lo = mid + 1; else hi = mid;
    }
}
