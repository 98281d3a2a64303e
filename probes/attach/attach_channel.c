/*
 * Issue 12, experiments E3 to E6 (docs/attach-cuda.md): a GPFIFO channel of our own RM client inside the
 * current CUDA context's channel group and VA space, ordered with a CUDA stream both ways without the CPU.
 *
 * Build (GPU machine, repository root):
 *   H=open-gpu-headers/open-gpu-kernel-modules
 *   gcc -O2 -std=gnu11 -Wall -I probes/attach -I $H/src/common/sdk/nvidia/inc \
 *       -I $H/src/nvidia/arch/nvalloc/unix/include -I $H/kernel-open/nvidia-uvm -I $H/kernel-open/common/inc \
 *       -I /usr/local/cuda/include -o attach_channel probes/attach/attach_channel.c -lcuda
 * Run:  ./attach_channel [ping-pong iterations, default 2000]
 *
 * Steps, each printing the NV_STATUS RM or UVM returned:
 *   E3a  fd binding: a context share under CUDA's channel group, allocated in CUDA's client through our own
 *        /dev/nvidiactl (expect NV_ERR_INVALID_CLIENT) and through CUDA's (expect NV_OK, then freed).
 *   E3b  NV_ESC_RM_DUP_OBJECT of CUDA's channel group, VA spaces and context share into our client (expect
 *        NV_OK: same process); of a channel and of the device (expect NV_ERR_INVALID_ARGUMENT: not copyable).
 *   E3c  in the dup'd group: our context share on the dup'd VA space (new subcontext id), a
 *        HOPPER_CHANNEL_GPFIFO_A with our own USERD and error notifier, HOPPER_COMPUTE_A, the work-submit
 *        token, UVM_REGISTER_CHANNEL through CUDA's UVM descriptor (NV_ERR_INVALID_CHANNEL means the wrong VA
 *        space: the next one is tried), NVA06F_CTRL_CMD_GPFIFO_SCHEDULE on the channel alone.
 *   E4   the channel runs: a host semaphore release lands at a cuMemAlloc'd CUdeviceptr (read back by
 *        cuMemcpyDtoH) and in host memory the CPU polls.
 *   E5   ordering without the CPU: our acquire waits for cuStreamWriteValue32, cuStreamWaitValue32 waits for
 *        our release; then a ping-pong of N round trips, timed, beside the same ping-pong between two CUDA
 *        streams and beside our channel in a channel group of its own on CUDA's VA space (E6).
 *   After each variant the channel is torn down and CUDA must still work (cuMemsetD32 + read back).
 * A ping-pong per round trip near the CUDA-streams figure means no channel-group switch; near 150 us, a switch.
 */
#include "nvrm.h"
#include <cuda.h>

#define CK(x)                                                                                              \
    do {                                                                                                   \
        CUresult r_ = (x);                                                                                 \
        if (r_ != CUDA_SUCCESS) {                                                                          \
            const char *n_ = "?";                                                                          \
            cuGetErrorName(r_, &n_);                                                                       \
            printf("%s: %s (line %d)\n", #x, n_, __LINE__);                                               \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

static own_rm o;
static cuda_client cc;
static int uvm_fd = -1;
static NvHandle c_dev, c_tsg, c_share, c_chan, c_vas[8];
static int n_vas;

/* Host memory CUDA maps for the GPU (cuMemHostRegister) below 1 TiB: ring, polled words, pushbuffers. */
#define REGION (4u << 20)
static NvU8 *region;
static NvU64 region_va;
#define RING_OFF 0x0
#define WORDS_OFF 0x1000
#define PB_OFF 0x10000
static NvU64 chan_va_base; /* UVM_REGISTER_CHANNEL range: our own PROT_NONE reservation */
#define CHAN_VA_SIZE (64ull << 20)

/* Our memory in our client: USERD and error notifier (RM and the GPU use them by physical address). */
static NvHandle h_userd, h_notifier, h_usermode;
static volatile NvU32 *userd, *notifier, *doorbell;

static CUstream s1, s2;
static CUdeviceptr X, A, B;

typedef struct {
    NvHandle tsg, share, chan, compute;
    NvU32 subctx, token, put, pb_words;
    int registered, own_tsg;
} chan_t;

static volatile NvU32 *word(int i) { return (volatile NvU32 *)(region + WORDS_OFF) + i; }
static NvU64 word_va(int i) { return region_va + WORDS_OFF + 4u * i; }

static NvU32 hdr(NvU32 method, NvU32 count) { return (1u << 29) | (count << 16) | (method >> 2); }
static int sem(NvU32 *w, NvU64 va, NvU32 payload, NvU32 exec) {
    w[0] = hdr(NVC86F_SEM_ADDR_LO, 5);
    w[1] = (NvU32)va & ~3u;
    w[2] = (NvU32)(va >> 32) & 0x1ffffffu;
    w[3] = payload;
    w[4] = 0;
    w[5] = exec;
    return 6;
}
static int release(NvU32 *w, NvU64 va, NvU32 v) { return sem(w, va, v, 0x1); /* RELEASE, 32-bit, no WFI */ }
static int acquire_geq(NvU32 *w, NvU64 va, NvU32 v, int switch_tsg) {
    return sem(w, va, v, 0x3 | (switch_tsg ? 1u << 12 : 0)); /* ACQ_CIRC_GEQ, 32-bit */
}

/* Appends `n` words to the channel's pushbuffer, one GPFIFO entry, GPPut, doorbell (src/gpfifo/channel/mod.rs). */
static void submit(chan_t *c, const NvU32 *w, NvU32 n) {
    NvU32 *pb = (NvU32 *)(region + PB_OFF) + c->pb_words;
    NvU64 va = region_va + PB_OFF + 4ull * c->pb_words;
    memcpy(pb, w, 4ull * n);
    c->pb_words += n;
    volatile NvU64 *ring = (volatile NvU64 *)(region + RING_OFF);
    ring[c->put % 512] = (va & ~3ull) | (((va >> 32) & 0xff) << 32) | (1ull << 41) | ((NvU64)n << 42);
    c->put++;
    __sync_synchronize();
    userd[0x8c / 4] = c->put % 512;
    __sync_synchronize();
    *doorbell = c->token;
}

static int wait_word(volatile NvU32 *p, NvU32 want, double timeout, double *took) {
    double t0 = now_s();
    while (*p != want) {
        if (now_s() - t0 > timeout) return 0;
    }
    if (took) *took = now_s() - t0;
    return 1;
}

static void report_fault(const char *when) {
    NvU32 info32 = notifier[2], last = notifier[3];
    printf("  %s: GP_GET %u, error notifier status 0x%x info32 %u info16 0x%x\n", when, userd[0x88 / 4],
           last >> 16, info32, last & 0xffff);
}

/* A kernel CUDA compiles from PTX: CUDA's own launches must keep working next to our channel. */
static const char ADD1_PTX[] = ".version 8.0\n.target sm_90\n.address_size 64\n"
                               ".visible .entry add1(.param .u64 p) {\n"
                               "  .reg .b32 %r<2>;\n  .reg .b64 %rd<2>;\n"
                               "  ld.param.u64 %rd1, [p];\n  cvta.to.global.u64 %rd1, %rd1;\n"
                               "  ld.global.u32 %r1, [%rd1];\n  add.s32 %r1, %r1, 1;\n"
                               "  st.global.u32 [%rd1], %r1;\n  ret;\n}\n";
static CUfunction add1;

static void cuda_health(const char *when) {
    CUresult r1 = cuMemsetD32(X, 0x12345678u, 1);
    void *args[] = {&X};
    CUresult r4 = cuLaunchKernel(add1, 1, 1, 1, 1, 1, 1, 0, s1, args, NULL);
    CUresult r2 = cuCtxSynchronize();
    NvU32 v = 0;
    CUresult r3 = cuMemcpyDtoH(&v, X, 4);
    printf("CUDA health %s: memset %d launch %d sync %d read %d value 0x%x -> %s\n", when, r1, r4, r2, r3, v,
           (r1 | r2 | r3 | r4) == 0 && v == 0x12345679u ? "OK" : "BROKEN");
}

static NvU32 alloc_sysmem(NvHandle *h, volatile NvU32 **cpu, const char *what) {
    NV_MEMORY_ALLOCATION_PARAMS p;
    memset(&p, 0, sizeof p);
    p.owner = o.client;
    p.type = NVOS32_TYPE_NOTIFIER;
    p.flags = NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE | NVOS32_ALLOC_FLAGS_MAP_NOT_REQUIRED |
              NVOS32_ALLOC_FLAGS_IGNORE_BANK_PLACEMENT | NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED;
    p.attr = 0x2a800000u; /* cached, non-contiguous, PCI, 4 KiB pages (src/rm/memory.rs SystemCached) */
    p.attr2 = 9;          /* not GPU-cacheable */
    p.format = 6;
    p.size = 0x1000;
    p.alignment = 0x1000;
    p.limit = 0xfff;
    *h = 0;
    NvU32 s = rm_alloc(o.ctl, o.client, o.device, h, NV01_MEMORY_SYSTEM, &p);
    printf("  %s: NV01_MEMORY_SYSTEM %s handle 0x%x\n", what, nvs(s), *h);
    if (s) return s;
    int mapfd = nv_open("/dev/nvidiactl");
    *cpu = rm_map_cpu(o.ctl, o.client, o.device, *h, 0x1000, 0, mapfd, &s);
    printf("  %s: NV_ESC_RM_MAP_MEMORY %s -> %p\n", what, nvs(s), (void *)*cpu);
    if (*cpu) memset((void *)*cpu, 0, 0x1000);
    return s ? s : (*cpu ? 0 : 0xffffffffu);
}

/* Context share on `vas`, channel, compute object, token, UVM registration, schedule. Returns 0 when the
 * channel is ready to run; *uvm_status gets UVM_REGISTER_CHANNEL's status. */
static int make_channel(chan_t *c, NvHandle tsg, NvHandle vas, int own_tsg, NvU32 *uvm_status) {
    memset(c, 0, sizeof *c);
    c->tsg = tsg;
    c->own_tsg = own_tsg;
    *uvm_status = 0xffffffffu;
    NV_CTXSHARE_ALLOCATION_PARAMETERS cs = {.hVASpace = vas, .flags = NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC};
    NvU32 s = rm_alloc(o.ctl, o.client, tsg, &c->share, FERMI_CONTEXT_SHARE_A, &cs);
    printf("  FERMI_CONTEXT_SHARE_A (vas 0x%x) under 0x%x: %s handle 0x%x subctxId %u\n", vas, tsg, nvs(s),
           c->share, cs.subctxId);
    if (s) return -1;
    c->subctx = cs.subctxId;

    memset((void *)userd, 0, 0x1000);
    memset((void *)notifier, 0, 0x1000);
    memset(region + RING_OFF, 0, 0x1000);
    static NV_CHANNEL_ALLOC_PARAMS cp;
    memset(&cp, 0, sizeof cp);
    cp.hObjectError = h_notifier;
    cp.hObjectBuffer = 0; /* "no longer used" (alloc_channel.h) */
    cp.gpFifoOffset = region_va + RING_OFF;
    cp.gpFifoEntries = 512;
    cp.hContextShare = c->share;
    cp.hUserdMemory[0] = h_userd;
    cp.userdOffset[0] = 0;
    s = rm_alloc(o.ctl, o.client, tsg, &c->chan, HOPPER_CHANNEL_GPFIFO_A, &cp);
    printf("  HOPPER_CHANNEL_GPFIFO_A under 0x%x: %s handle 0x%x\n", tsg, nvs(s), c->chan);
    if (s) return -1;
    s = rm_alloc(o.ctl, o.client, c->chan, &c->compute, HOPPER_COMPUTE_A, NULL);
    printf("  HOPPER_COMPUTE_A: %s handle 0x%x\n", nvs(s), c->compute);
    NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS tok = {.workSubmitToken = ~0u};
    s = rm_control(o.ctl, o.client, c->chan, NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN, &tok, sizeof tok);
    printf("  GET_WORK_SUBMIT_TOKEN: %s token 0x%x\n", nvs(s), tok.workSubmitToken);
    if (s) return -1;
    c->token = tok.workSubmitToken;

    UVM_REGISTER_CHANNEL_PARAMS rc;
    memset(&rc, 0, sizeof rc);
    memcpy(rc.gpuUuid.uuid, o.uuid, 16);
    rc.rmCtrlFd = o.ctl;
    rc.hClient = o.client;
    rc.hChannel = c->chan;
    rc.base = chan_va_base;
    rc.length = CHAN_VA_SIZE;
    *uvm_status = UVM_CALL(uvm_fd, UVM_REGISTER_CHANNEL, &rc);
    printf("  UVM_REGISTER_CHANNEL via CUDA's uvm fd %d: %s%s\n", uvm_fd, nvs(*uvm_status),
           *uvm_status == 0xffffffffu ? strerror(errno) : "");
    if (*uvm_status) return -1;
    c->registered = 1;

    if (c->own_tsg) {
        NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS sp;
        memset(&sp, 0, sizeof sp);
        sp.bEnable = 1;
        s = rm_control(o.ctl, o.client, tsg, NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, &sp, sizeof sp);
        printf("  NVA06C_CTRL_CMD_GPFIFO_SCHEDULE (our own group): %s\n", nvs(s));
    } else {
        NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS sp;
        memset(&sp, 0, sizeof sp);
        sp.bEnable = 1;
        s = rm_control(o.ctl, o.client, c->chan, NVA06F_CTRL_CMD_GPFIFO_SCHEDULE, &sp, sizeof sp);
        printf("  NVA06F_CTRL_CMD_GPFIFO_SCHEDULE (this channel only): %s\n", nvs(s));
        if (s) {
            NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS gp;
            memset(&gp, 0, sizeof gp);
            gp.bEnable = 1;
            s = rm_control(o.ctl, o.client, tsg, NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, &gp, sizeof gp);
            printf("  fallback NVA06C_CTRL_CMD_GPFIFO_SCHEDULE on the dup'd group (CUDA's): %s\n", nvs(s));
        }
    }
    return s ? -1 : 0;
}

static void free_channel(chan_t *c) {
    if (c->registered) {
        UVM_UNREGISTER_CHANNEL_PARAMS u;
        memset(&u, 0, sizeof u);
        memcpy(u.gpuUuid.uuid, o.uuid, 16);
        u.hClient = o.client;
        u.hChannel = c->chan;
        printf("  UVM_UNREGISTER_CHANNEL: %s\n", nvs(UVM_CALL(uvm_fd, UVM_UNREGISTER_CHANNEL, &u)));
    }
    if (c->compute) printf("  free compute: %s\n", nvs(rm_free(o.ctl, o.client, c->chan, c->compute)));
    if (c->chan) printf("  free channel: %s\n", nvs(rm_free(o.ctl, o.client, c->tsg, c->chan)));
    if (c->share) printf("  free ctxshare: %s\n", nvs(rm_free(o.ctl, o.client, c->tsg, c->share)));
    memset(c, 0, sizeof *c);
}

/* E4 + E5 on a running channel. */
static void run_tests(chan_t *c, int iters, const char *tag) {
    NvU32 w[64];
    int n;
    double took;
    for (int i = 0; i < 8; i++) *word(i) = 0;
    CK(cuMemsetD32(X, 0, 1));
    CK(cuMemsetD32(A, 0, 1));
    CK(cuMemsetD32(B, 0, 1));
    CK(cuCtxSynchronize());

    /* E4: the channel runs and writes a CUdeviceptr. */
    n = release(w, X, 0xC0FFEE01u);
    n += release(w + n, word_va(0), 1);
    submit(c, w, n);
    int ok = wait_word(word(0), 1, 2.0, &took);
    NvU32 xv = 0;
    CK(cuMemcpyDtoH(&xv, X, 4));
    printf("[%s] E4 release seen by the CPU: %s (%.1f us); value at CUdeviceptr 0x%llx = 0x%x (%s)\n", tag,
           ok ? "yes" : "NO (timeout)", ok ? took * 1e6 : 0, (unsigned long long)X, xv,
           xv == 0xC0FFEE01u ? "CUDA's VA space shared" : "NOT written");
    if (!ok) {
        report_fault("E4 timeout");
        return;
    }

    /* E5a: CUDA -> us. Our acquire on B waits for cuStreamWriteValue32. */
    n = acquire_geq(w, B, 1, 0);
    n += release(w + n, word_va(1), 2);
    submit(c, w, n);
    usleep(20000);
    NvU32 early = *word(1);
    double t0 = now_s();
    CK(cuStreamWriteValue32(s1, B, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    ok = wait_word(word(1), 2, 2.0, &took);
    printf("[%s] E5a acquire blocked before the write: %s; released after cuStreamWriteValue32: %s (%.1f us)\n", tag,
           early == 0 ? "yes" : "NO", ok ? "yes" : "NO (timeout)", (now_s() - t0) * 1e6);
    if (!ok) {
        report_fault("E5a timeout");
        return;
    }

    /* E5b: us -> CUDA. cuStreamWaitValue32 on A waits for our release. */
    CK(cuStreamWaitValue32(s1, A, 3, CU_STREAM_WAIT_VALUE_GEQ));
    CK(cuStreamWriteValue32(s1, word_va(2), 7, CU_STREAM_WRITE_VALUE_DEFAULT));
    usleep(20000);
    early = *word(2);
    n = release(w, A, 3);
    t0 = now_s();
    submit(c, w, n);
    ok = wait_word(word(2), 7, 2.0, &took);
    printf("[%s] E5b CUDA stream blocked before our release: %s; ran after it: %s (%.1f us)\n", tag,
           early == 0 ? "yes" : "NO", ok ? "yes" : "NO (timeout)", (now_s() - t0) * 1e6);
    if (!ok) {
        CK(cuMemsetD32Async(A, 3, 1, s2)); /* unblock CUDA from another stream */
        report_fault("E5b timeout");
        CK(cuStreamSynchronize(s1));
        return; /* a ping-pong could block CUDA's enqueue for good */
    }
    CK(cuStreamSynchronize(s1));

    /* E5c: ping-pong, N round trips: we wait for B >= i then write A = i; CUDA writes B = i then waits A >= i. */
    for (int sw = 0; sw < 2; sw++) {
        CK(cuMemsetD32(A, 0, 1));
        CK(cuMemsetD32(B, 0, 1));
        CK(cuCtxSynchronize());
        NvU32 words = 12u * iters + 6;
        NvU32 *pb = malloc(4ull * words);
        NvU32 k = 0;
        for (int i = 1; i <= iters; i++) {
            k += acquire_geq(pb + k, B, i, sw);
            k += release(pb + k, A, i);
        }
        k += release(pb + k, word_va(3), 100 + sw);
        if (4ull * (c->pb_words + k) > REGION - PB_OFF) {
            printf("[%s] pushbuffer area too small for %d iterations\n", tag, iters);
            free(pb);
            return;
        }
        t0 = now_s();
        submit(c, pb, k);
        for (int i = 1; i <= iters; i++) {
            CK(cuStreamWriteValue32(s1, B, i, CU_STREAM_WRITE_VALUE_DEFAULT));
            CK(cuStreamWaitValue32(s1, A, i, CU_STREAM_WAIT_VALUE_GEQ));
        }
        double t_enq = now_s() - t0;
        CUresult q;
        while ((q = cuStreamQuery(s1)) == CUDA_ERROR_NOT_READY && now_s() - t0 < 30.0) {}
        double t1 = now_s();
        ok = q == CUDA_SUCCESS && wait_word(word(3), 100 + sw, 2.0, NULL);
        NvU32 av = 0, bv = 0;
        if (q == CUDA_ERROR_NOT_READY) {
            CK(cuMemsetD32Async(A, iters, 1, s2));
            report_fault("E5c timeout");
        }
        CK(cuStreamSynchronize(s1));
        CK(cuMemcpyDtoH(&av, A, 4));
        CK(cuMemcpyDtoH(&bv, B, 4));
        printf("[%s] E5c ping-pong %d round trips, ACQUIRE_SWITCH_TSG=%d: %s, %.2f us per round trip "
               "(enqueue alone %.2f us per iteration), A=%u B=%u\n",
               tag, iters, sw, ok ? "completed" : "FAILED", (t1 - t0) * 1e6 / iters, t_enq * 1e6 / iters, av, bv);
        free(pb);
    }
}

/* Baseline: the same ping-pong between two CUDA streams (both on CUDA's own channels). */
static void cuda_pingpong(int iters) {
    CK(cuMemsetD32(A, 0, 1));
    CK(cuMemsetD32(B, 0, 1));
    CK(cuCtxSynchronize());
    double t0 = now_s();
    /* interleaved, so that neither stream's enqueue can block on a ring the other one has to drain */
    for (int i = 1; i <= iters; i++) {
        CK(cuStreamWaitValue32(s2, B, i, CU_STREAM_WAIT_VALUE_GEQ));
        CK(cuStreamWriteValue32(s2, A, i, CU_STREAM_WRITE_VALUE_DEFAULT));
        CK(cuStreamWriteValue32(s1, B, i, CU_STREAM_WRITE_VALUE_DEFAULT));
        CK(cuStreamWaitValue32(s1, A, i, CU_STREAM_WAIT_VALUE_GEQ));
    }
    double t_enq = now_s() - t0;
    CK(cuStreamSynchronize(s1));
    CK(cuStreamSynchronize(s2));
    double t1 = now_s();
    printf("[cuda-streams] E5c ping-pong %d round trips between two CUDA streams: %.2f us per round trip "
           "(enqueue alone %.2f us per iteration)\n",
           iters, (t1 - t0) * 1e6 / iters, t_enq * 1e6 / iters);
}

static void pick_cuda_objects(void) {
    static rm_obj objs[8192];
    NvHandle dev = 0;
    child_handle(cc.fd, cc.client, cc.client, NVOC_ID_DEVICE, &dev);
    int n = scan_objects(cc.fd, cc.client, dev & 0xffff0000u, 0x10000, objs, 8192);
    n += scan_objects(cc.fd, cc.client, 0xcaf00000u, 0x1000, objs + n, 8192 - n);
    c_dev = dev;
    for (int i = 0; i < n; i++) {
        if (objs[i].cls == 0x90f1 && objs[i].parent == dev && n_vas < 8) c_vas[n_vas++] = objs[i].h;
        if (objs[i].cls != 0xa06c || c_tsg) continue;
        /* the GR group: a channel of it carries a compute object */
        for (int j = 0; j < n && !c_tsg; j++) {
            if (objs[j].parent != objs[i].h || objs[j].cls != 0xc86f) continue;
            for (int k = 0; k < n; k++)
                if (objs[k].parent == objs[j].h && objs[k].cls == 0xcbc0) {
                    c_tsg = objs[i].h;
                    c_chan = objs[j].h;
                }
        }
    }
    for (int i = 0; i < n; i++)
        if (objs[i].cls == 0x9067 && objs[i].parent == c_tsg && !c_share) c_share = objs[i].h;
    printf("CUDA objects (%d scanned): device 0x%x, GR channel group 0x%x, its context share 0x%x, a channel 0x%x,"
           " %d VA space(s):",
           n, c_dev, c_tsg, c_share, c_chan, n_vas);
    for (int i = 0; i < n_vas; i++) printf(" 0x%x", c_vas[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CK(cuMemAlloc(&X, 4096));
    CK(cuMemAlloc(&A, 4096));
    CK(cuMemAlloc(&B, 4096));
    CUmodule mod;
    CK(cuModuleLoadData(&mod, ADD1_PTX));
    CK(cuModuleGetFunction(&add1, mod, "add1"));
    int v64 = 0;
    cuDeviceGetAttribute(&v64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
    printf("cuMemAlloc: X 0x%llx A 0x%llx B 0x%llx; 64-bit stream mem ops: %d\n", (unsigned long long)X,
           (unsigned long long)A, (unsigned long long)B, v64);
    print_nvidia_fds();
    cuda_health("before attaching");

    if (own_rm_open(&o)) return 1;
    printf("own client 0x%08x (fd %d)\n", o.client, o.ctl);
    cuda_client list[8];
    int n = find_cuda_clients(&o, list, 8, 4096, 0);
    if (n == 0) n = find_clients_via_fds(&o, list, 8, 4096);
    cc.fd = -1;
    for (int i = 0; i < n; i++) {
        printf("same-process client 0x%08x, fd %d, rights 0x%x\n", list[i].client, list[i].fd, list[i].mask);
        if (list[i].fd >= 0 && cc.fd < 0) cc = list[i];
    }
    if (cc.fd < 0) {
        printf("CUDA's client not found (%d candidates)\n", n);
        return 1;
    }
    printf("CUDA client 0x%08x on fd %d (rights mask 0x%x)\n", cc.client, cc.fd, cc.mask);
    fd_list u = fds_of("/dev/nvidia-uvm");
    for (int i = 0; i < u.n && uvm_fd < 0; i++) {
        UVM_PAGEABLE_MEM_ACCESS_PARAMS p;
        memset(&p, 0, sizeof p);
        if (ioctl(u.fd[i], UVM_PAGEABLE_MEM_ACCESS, &p) == 0 && p.rmStatus == 0) uvm_fd = u.fd[i];
    }
    printf("CUDA's UVM VA-space fd: %d\n", uvm_fd);
    pick_cuda_objects();
    if (!c_tsg || !n_vas || uvm_fd < 0) return 1;

    /* E3a: the fd binding. */
    NV_CTXSHARE_ALLOCATION_PARAMETERS cs = {.flags = NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC};
    NvHandle h = 0;
    cs.hVASpace = c_vas[0];
    NvU32 s = rm_alloc(o.ctl, cc.client, c_tsg, &h, FERMI_CONTEXT_SHARE_A, &cs);
    printf("E3a ctxshare in CUDA's client via OUR fd: %s (expect NV_ERR_INVALID_CLIENT)\n", nvs(s));
    if (s == NV_OK) rm_free(o.ctl, cc.client, c_tsg, h);
    {
        int d = dup(cc.fd); /* a dup of CUDA's descriptor is the same open file */
        h = 0;
        cs.subctxId = 0;
        s = rm_alloc(d, cc.client, c_tsg, &h, FERMI_CONTEXT_SHARE_A, &cs);
        printf("E3a ctxshare in CUDA's client via dup(CUDA's fd %d)=%d on VA space 0x%x: %s handle 0x%x subctxId %u\n",
               cc.fd, d, c_vas[0], nvs(s), h, cs.subctxId);
        if (s == NV_OK) printf("    freed: %s\n", nvs(rm_free(d, cc.client, c_tsg, h)));
        close(d);
    }

    /* E3b: dup into our client (through our own fd). */
    NvHandle d_tsg = 0, d_vas[8] = {0}, d_share = 0, d_chan = 0, d_dev = 0;
    s = rm_dup(o.ctl, o.client, o.device, &d_tsg, cc.client, c_tsg);
    printf("E3b dup CUDA channel group 0x%x -> 0x%x: %s\n", c_tsg, d_tsg, nvs(s));
    for (int k = 0; k < n_vas; k++) {
        s = rm_dup(o.ctl, o.client, o.device, &d_vas[k], cc.client, c_vas[k]);
        printf("E3b dup CUDA VA space 0x%x -> 0x%x: %s\n", c_vas[k], d_vas[k], nvs(s));
    }
    if (d_tsg && c_share) {
        s = rm_dup(o.ctl, o.client, d_tsg, &d_share, cc.client, c_share);
        printf("E3b dup CUDA context share 0x%x -> 0x%x: %s\n", c_share, d_share, nvs(s));
        if (s == NV_OK) rm_free(o.ctl, o.client, d_tsg, d_share);
    }
    if (d_tsg && c_chan) {
        s = rm_dup(o.ctl, o.client, d_tsg, &d_chan, cc.client, c_chan);
        printf("E3b dup CUDA channel 0x%x: %s (expect NV_ERR_INVALID_ARGUMENT: channels are not copyable)\n", c_chan,
               nvs(s));
        if (s == NV_OK) rm_free(o.ctl, o.client, d_tsg, d_chan);
    }
    s = rm_dup(o.ctl, o.client, o.client, &d_dev, cc.client, c_dev);
    printf("E3b dup CUDA device 0x%x: %s\n", c_dev, nvs(s));
    if (s == NV_OK) rm_free(o.ctl, o.client, o.client, d_dev);
    if (!d_tsg) return 1;

    /* Our memory: USERD, error notifier, usermode (doorbell), low host region, channel VA range. */
    if (alloc_sysmem(&h_userd, &userd, "USERD") || alloc_sysmem(&h_notifier, &notifier, "error notifier"))
        return 1;
    s = rm_alloc(o.ctl, o.client, o.subdevice, &h_usermode, HOPPER_USERMODE_A, NULL);
    int gfd = open_gpu_node(o.ctl, o.minor);
    NvU8 *um = rm_map_cpu(o.ctl, o.client, o.device, h_usermode, 0x10000, 0, gfd, &s);
    printf("  HOPPER_USERMODE_A mapped: %s -> %p\n", nvs(s), (void *)um);
    if (!um) return 1;
    doorbell = (volatile NvU32 *)(um + NVC361_NOTIFY_CHANNEL_PENDING);
    region = map_low(REGION, PROT_READ | PROT_WRITE, 0);
    void *resv = map_low(CHAN_VA_SIZE, PROT_NONE, 0);
    chan_va_base = (NvU64)(uintptr_t)resv;
    if (!region || !resv) return printf("no low address range\n"), 1;
    memset(region, 0, REGION);
    CK(cuMemHostRegister(region, REGION, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
    CUdeviceptr rdev = 0;
    CK(cuMemHostGetDevicePointer(&rdev, region, 0));
    region_va = rdev;
    printf("host region %p registered with CUDA: device pointer 0x%llx (%s); channel VA range 0x%llx\n",
           (void *)region, (unsigned long long)rdev, rdev == (CUdeviceptr)(uintptr_t)region ? "identity" : "differs",
           (unsigned long long)chan_va_base);
    if (region_va >> 40) return printf("device pointer above 1 TiB: cannot hold a ring\n"), 1;

    /* E3c + E4 + E5: our channel in CUDA's channel group, on each dup'd VA space until UVM accepts one. */
    chan_t c;
    int chosen = -1;
    for (int k = 0; k < n_vas && chosen < 0; k++) {
        if (!d_vas[k]) continue;
        NvU32 us;
        printf("E3c attach in CUDA's group, VA space candidate 0x%x (dup 0x%x):\n", c_vas[k], d_vas[k]);
        int r = make_channel(&c, d_tsg, d_vas[k], 0, &us);
        if (r == 0) {
            chosen = k;
            break;
        }
        free_channel(&c);
        if (us != NV_ERR_INVALID_CHANNEL) break;
    }
    if (chosen >= 0) {
        run_tests(&c, iters, "attached, CUDA's group");
        report_fault("after tests");
        free_channel(&c);
    }
    cuda_health("after the attached channel");
    cuda_pingpong(iters);

    /* E6: our own channel group on CUDA's VA space (no group sharing): expect the channel-group switch cost. */
    if (chosen >= 0) {
        NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS gp;
        memset(&gp, 0, sizeof gp);
        gp.hVASpace = d_vas[chosen];
        gp.engineType = NV2080_ENGINE_TYPE_GRAPHICS;
        NvHandle own_tsg = 0;
        s = rm_alloc(o.ctl, o.client, o.device, &own_tsg, KEPLER_CHANNEL_GROUP_A, &gp);
        printf("E6 own KEPLER_CHANNEL_GROUP_A on CUDA's VA space: %s handle 0x%x\n", nvs(s), own_tsg);
        if (s == NV_OK) {
            chan_t c2;
            NvU32 us;
            if (make_channel(&c2, own_tsg, d_vas[chosen], 1, &us) == 0) run_tests(&c2, iters, "own group, CUDA's VA space");
            free_channel(&c2);
            printf("  free own group: %s\n", nvs(rm_free(o.ctl, o.client, o.device, own_tsg)));
        }
        cuda_health("after the own-group channel");
    }

    printf("free dup'd group: %s\n", nvs(rm_free(o.ctl, o.client, o.device, d_tsg)));
    for (int k = 0; k < n_vas; k++)
        if (d_vas[k]) printf("free dup'd VA space 0x%x: %s\n", d_vas[k], nvs(rm_free(o.ctl, o.client, o.device, d_vas[k])));
    cuda_health("after freeing the dups");
    CK(cuMemHostUnregister(region));
    rm_free(o.ctl, o.client, 0, o.client);
    cuda_health("at the end");
    return 0;
}
