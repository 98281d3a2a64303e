// APEX's device runtime for printf and assert on the direct path.
//
// nvcc compiles `printf(fmt, ...)` into a call of the external device function `vprintf(fmt, args)`, where `args`
// points at the arguments packed in local memory, each at an offset aligned to its own size; `assert` calls
// `__assertfail(message, file, line, function, charSize)`. Neither is in the module: the CUDA driver links its own.
// APEX links these two functions instead (its loader points the module's references to `vprintf` and
// `__assertfail` at `apex_vprintf` and `apex_assertfail`), and they write records into a ring in video memory that
// the host drains and formats (src/module/printf/). `apex_fifo` is left undefined here: the loader resolves it
// to the ring of the GPU the module is loaded on.
//
// Built relocatable (nvcc -rdc=true -cubin) by kernels/build.sh. Every helper is inlined so each entry point is one
// self-contained function: the loader appends their code to a module's image and applies their relocations.
//
// Record layout (little-endian, every field 8-byte aligned, total a multiple of 8):
//   u32 kind (1 printf, 2 assert; written last, after a fence), u32 bytes of the whole record
//   printf: format string, NUL-terminated, padded to 8; then one slot per argument in format order:
//           8 bytes for integers, doubles and pointers (as the caller packed them, zero-extended);
//           %s: u64 length (u64 max for a null pointer), then the bytes, padded to 8
//   assert: u32 line, u32 -, u32 block x y z, u32 thread x y z; then message, file, function as %s slots
#include <stdint.h>

struct ApexFifo {
    unsigned long long tail;      // bytes ever reserved (device)
    unsigned long long head;      // bytes ever consumed (host)
    unsigned long long capacity;  // bytes of the ring, a power of two
    unsigned long long dropped;   // records that did not fit
    unsigned long long flags;     // APEX_FIFO_ASSERT_ENDS_THREAD: a failed assert ends its thread instead of trapping
    unsigned long long assert_flag; // 0, or the address of a word (host memory) set nonzero by every failed assert
    unsigned long long reserved[2];
    unsigned long long data[1];   // the ring follows the 64-byte header
};

extern "C" __device__ ApexFifo apex_fifo;

// Longest %s string copied; longer ones are cut (CUDA also bounds what it copies).
#define APEX_MAX_STRING 4096u
#define KIND_PRINTF 1u
#define KIND_ASSERT 2u
// Set by the host (src/module/printf/, AssertAction::EndThread) where the context must not fault on an assert: an
// LD_PRELOAD host reports it through the CUDA driver instead, so the channel group it shares with CUDA stays alive.
#define APEX_FIFO_ASSERT_ENDS_THREAD 1ull

static __device__ __forceinline__ unsigned str_len(const char *s) {
    unsigned n = 0;
    if (s == nullptr) return 0;
#pragma unroll 1
    while (n < APEX_MAX_STRING && s[n] != 0) n++;
    return n;
}

static __device__ __forceinline__ unsigned long long round8(unsigned long long n) { return (n + 7) & ~7ull; }

// Writes one 8-byte word at ring position `at` (8-aligned).
static __device__ __forceinline__ void put(unsigned long long at, unsigned long long v) {
    unsigned long long mask = apex_fifo.capacity - 1;
    *(volatile unsigned long long *)&apex_fifo.data[(at & mask) >> 3] = v;
}

// Writes `n` bytes of `s` (then zero padding to 8) from ring position `at`; returns the position after them.
static __device__ __forceinline__ unsigned long long put_bytes(unsigned long long at, const char *s, unsigned n,
                                                               bool nul) {
    unsigned total = nul ? n + 1 : n;
#pragma unroll 1
    for (unsigned i = 0; i < total; i += 8) {
        unsigned long long w = 0;
#pragma unroll 1
        for (unsigned b = 0; b < 8 && i + b < n; b++) w |= (unsigned long long)(unsigned char)s[i + b] << (8 * b);
        put(at, w);
        at += 8;
    }
    return at;
}

static __device__ __forceinline__ unsigned long long put_string(unsigned long long at, const char *s) {
    if (s == nullptr) {
        put(at, ~0ull);
        return at + 8;
    }
    unsigned n = str_len(s);
    put(at, n);
    return put_bytes(at + 8, s, n, false);
}

// Reserves `len` bytes; returns false (and counts a drop) when the ring has no room.
static __device__ __forceinline__ bool reserve(unsigned long long len, unsigned long long *pos) {
    unsigned long long cap = apex_fifo.capacity;
    if (cap == 0 || len > cap) {
        if (cap != 0) atomicAdd(&apex_fifo.dropped, 1ull);
        return false;
    }
    unsigned long long t = *(volatile unsigned long long *)&apex_fifo.tail;
#pragma unroll 1
    for (;;) {
        unsigned long long h = *(volatile unsigned long long *)&apex_fifo.head;
        if (t + len - h > cap) {
            atomicAdd(&apex_fifo.dropped, 1ull);
            return false;
        }
        unsigned long long seen = atomicCAS(&apex_fifo.tail, t, t + len);
        if (seen == t) break;
        t = seen;
    }
    *pos = t;
    return true;
}

static __device__ __forceinline__ void publish(unsigned long long pos, unsigned kind, unsigned long long len) {
    __threadfence_system();
    put(pos, (unsigned long long)kind | (len << 32));
}

// What one conversion consumes: 0 nothing, 4 or 8 bytes of scalar, 'S' a string pointer.
enum { ARG_NONE = 0, ARG_4 = 4, ARG_8 = 8, ARG_STRING = 'S' };

// Walks the format string, calling `f(arg kind)` for each argument it consumes, in order. Returns the count.
template <typename F>
static __device__ __forceinline__ int walk(const char *fmt, F f) {
    int count = 0;
#pragma unroll 1
    for (unsigned i = 0; i < APEX_MAX_STRING && fmt[i] != 0; i++) {
        if (fmt[i] != '%') continue;
        i++;
        if (fmt[i] == '%') continue;
        // flags
        while (fmt[i] == '-' || fmt[i] == '+' || fmt[i] == ' ' || fmt[i] == '#' || fmt[i] == '0' || fmt[i] == '\'') i++;
        // width
        if (fmt[i] == '*') { f(ARG_4); count++; i++; }
        else while (fmt[i] >= '0' && fmt[i] <= '9') i++;
        // precision
        if (fmt[i] == '.') {
            i++;
            if (fmt[i] == '*') { f(ARG_4); count++; i++; }
            else while (fmt[i] >= '0' && fmt[i] <= '9') i++;
        }
        // length
        int wide = 0;
        for (;;) {
            char c = fmt[i];
            if (c == 'l' || c == 'z' || c == 'j' || c == 't' || c == 'q' || c == 'L') { wide = 1; i++; }
            else if (c == 'h') i++;
            else break;
        }
        char c = fmt[i];
        if (c == 0) break;
        // An if-chain, not a switch: a switch may become a jump table in a constant bank, and this code runs
        // with the calling kernel's banks bound.
        bool integer = c == 'd' || c == 'i' || c == 'u' || c == 'o' || c == 'x' || c == 'X' || c == 'c';
        bool floating = c == 'f' || c == 'F' || c == 'e' || c == 'E' || c == 'g' || c == 'G' || c == 'a' || c == 'A';
        if (integer) {
            f(wide ? ARG_8 : ARG_4);
            count++;
        } else if (floating || c == 'p' || c == 'n') {
            f(ARG_8);
            count++;
        } else if (c == 's') {
            f(ARG_STRING);
            count++;
        }
        // anything else is not a conversion C knows: printed as written, consumes nothing
    }
    return count;
}

extern "C" __device__ __noinline__ int apex_vprintf(const char *fmt, const char *args) {
    if (fmt == nullptr) return -1;
    unsigned fmt_len = str_len(fmt);
    // Pass 1: the record's size.
    unsigned long long len = 8 + round8(fmt_len + 1);
    unsigned long long off = 0;
    walk(fmt, [&](int kind) {
        unsigned long long a = kind == ARG_4 ? 4 : 8;
        off = (off + a - 1) & ~(a - 1);
        if (kind == ARG_STRING) {
            const char *s = *(const char *const *)(args + off);
            len += 8 + (s ? round8(str_len(s)) : 0);
        } else {
            len += 8;
        }
        off += a;
    });
    unsigned long long pos;
    if (!reserve(len, &pos)) return -2;
    // Pass 2: the record.
    unsigned long long at = put_bytes(pos + 8, fmt, fmt_len, true);
    off = 0;
    int count = walk(fmt, [&](int kind) {
        unsigned long long a = kind == ARG_4 ? 4 : 8;
        off = (off + a - 1) & ~(a - 1);
        if (kind == ARG_STRING) {
            at = put_string(at, *(const char *const *)(args + off));
        } else if (kind == ARG_4) {
            put(at, *(const unsigned *)(args + off));
            at += 8;
        } else {
            put(at, *(const unsigned long long *)(args + off));
            at += 8;
        }
        off += a;
    });
    publish(pos, KIND_PRINTF, len);
    return count;
}

extern "C" __device__ __noinline__ void apex_assertfail(const char *message, const char *file, unsigned line,
                                                        const char *function, size_t char_size) {
    (void)char_size;
    unsigned long long len = 8 + 8 + 24;
    len += 8 + (message ? round8(str_len(message)) : 0);
    len += 8 + (file ? round8(str_len(file)) : 0);
    len += 8 + (function ? round8(str_len(function)) : 0);
    unsigned long long pos;
    if (reserve(len, &pos)) {
        unsigned long long at = pos + 8;
        put(at, line); at += 8;
        put(at, (unsigned long long)blockIdx.x | ((unsigned long long)blockIdx.y << 32)); at += 8;
        put(at, (unsigned long long)blockIdx.z | ((unsigned long long)threadIdx.x << 32)); at += 8;
        put(at, (unsigned long long)threadIdx.y | ((unsigned long long)threadIdx.z << 32)); at += 8;
        at = put_string(at, message);
        at = put_string(at, file);
        at = put_string(at, function);
        publish(pos, KIND_ASSERT, len);
    }
    if (*(volatile unsigned long long *)&apex_fifo.flags & APEX_FIFO_ASSERT_ENDS_THREAD) {
        unsigned long long *seen = *(unsigned long long *volatile *)&apex_fifo.assert_flag;
        if (seen != nullptr) {
            // After the record (publish fenced it): the host reads the flag, then drains the ring.
            __threadfence_system();
            *(volatile unsigned long long *)seen = 1;
            __threadfence_system();
        }
        asm volatile("exit;");
    }
    __trap();
}
