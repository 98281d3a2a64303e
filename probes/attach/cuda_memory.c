/*
 * Issue 12, experiments E7 to E12 (docs/attach-cuda.md): where APEX's ring, pushbuffer, QMDs and semaphores
 * can live in CUDA's VA space without breaking CUDA's own bookkeeping, and how an RM handle is had for memory
 * CUDA allocated.
 *
 * Build (GPU machine, repository root):
 *   H=open-gpu-headers/open-gpu-kernel-modules
 *   gcc -O2 -std=gnu11 -Wall -I probes/attach -I $H/src/common/sdk/nvidia/inc \
 *       -I $H/src/nvidia/arch/nvalloc/unix/include -I $H/kernel-open/nvidia-uvm -I $H/kernel-open/common/inc \
 *       -I /usr/local/cuda/include -o cuda_memory probes/attach/cuda_memory.c -lcuda
 * Run:  ./cuda_memory
 *
 *   E7   CUDA's VA layout: cuMemAlloc, cuMemHostAlloc, cuMemAddressReserve addresses (above or below 1 TiB,
 *        the limit for rings, pushbuffers and QMDs); whether CUDA keeps out of a CPU range we reserved; whether
 *        cuMemAddressReserve honours a low address hint; CUDA's PROT_NONE reservations in /proc/self/maps.
 *   E8   cuMemCreate + cuMemAddressReserve(low hint) + cuMemMap + cuMemExportToShareableHandle(POSIX fd):
 *        what the fd is, NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO on it, IMPORT_OBJECTS_FROM_FD into
 *        our client, the imported class, a CPU mapping of it (BAR1), and data written by the CPU read back by
 *        cuMemcpyDtoH at the CUdeviceptr (and the other way).
 *   E9   cuMemHostRegister of host memory we placed below 1 TiB: is the device pointer the host address?
 *   E10  CUDA's shared and local memory windows, read by a kernel (cvta) - the values APEX's compute state
 *        on an attached channel can reuse.
 *   E11  what the public API says about a cuMemAlloc pointer (range, buffer id, IPC, allowed handle types,
 *        cuMemRetainAllocationHandle): no RM handle.
 *   E12  our own RM memory mapped into CUDA's VA space through CUDA's UVM descriptor inside a range CUDA
 *        reserved (cuMemAddressReserve): UVM_CREATE_EXTERNAL_RANGE / UVM_MAP_EXTERNAL_ALLOCATION statuses,
 *        then a CUDA kernel increments a word there and the CPU reads it through our mapping.
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
#define TRY(x) report(#x, (x))

static CUresult report(const char *what, CUresult r) {
    const char *n = "CUDA_SUCCESS";
    if (r) cuGetErrorName(r, &n);
    printf("  %s -> %s\n", what, n);
    return r;
}

static const char PTX[] =
    ".version 8.0\n.target sm_90\n.address_size 64\n"
    ".visible .entry windows(.param .u64 out) {\n"
    "  .reg .b64 %rd<8>;\n  .shared .align 8 .b8 sh[16];\n  .local .align 8 .b8 lo[16];\n"
    "  ld.param.u64 %rd1, [out];\n  cvta.to.global.u64 %rd1, %rd1;\n"
    "  mov.u64 %rd2, sh;\n  cvta.shared.u64 %rd3, %rd2;\n  mov.u64 %rd4, lo;\n  cvta.local.u64 %rd5, %rd4;\n"
    "  st.local.u64 [lo], %rd5;\n  st.shared.u64 [sh], %rd3;\n"
    "  st.global.u64 [%rd1], %rd3;\n  st.global.u64 [%rd1+8], %rd5;\n"
    "  st.global.u64 [%rd1+16], %rd2;\n  st.global.u64 [%rd1+24], %rd4;\n  ret;\n}\n"
    ".visible .entry add1(.param .u64 p) {\n"
    "  .reg .b32 %r<2>;\n  .reg .b64 %rd<2>;\n"
    "  ld.param.u64 %rd1, [p];\n  cvta.to.global.u64 %rd1, %rd1;\n"
    "  ld.global.u32 %r1, [%rd1];\n  add.s32 %r1, %r1, 1;\n  st.global.u32 [%rd1], %r1;\n  ret;\n}\n";

static const char *where(NvU64 a) { return a >> 40 ? "above 1 TiB" : "below 1 TiB"; }

static void big_prot_none_maps(const char *when) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;
    printf("E7 PROT_NONE mappings of 1 GiB or more (%s):\n", when);
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long a, b;
        char perm[8];
        if (sscanf(line, "%llx-%llx %7s", &a, &b, perm) != 3) continue;
        if (strcmp(perm, "---p") || b - a < (1ull << 30)) continue;
        printf("  %llx-%llx (%.1f GiB)\n", a, b, (b - a) / 1073741824.0);
        n++;
    }
    if (f) fclose(f);
    printf("  %d such mappings\n", n);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    int a1 = 0, a2 = 0, a3 = 0;
    cuDeviceGetAttribute(&a1, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    cuDeviceGetAttribute(&a2, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    cuDeviceGetAttribute(&a3, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev);
    printf("VMM %d, POSIX fd handles %d, host pointer usable for registered memory %d\n", a1, a2, a3);

    /* ---- E7 ---- */
    big_prot_none_maps("after context creation");
    void *lowres = map_low(64ull << 30, PROT_NONE, 0); /* as APEX reserves its low region (src/rm/va.rs) */
    printf("E7 our PROT_NONE reservation: %p (64 GiB)\n", lowres);
    CUdeviceptr small, big[64], resv[16], hinted = 0;
    void *host[16], *wc;
    CK(cuMemAlloc(&small, 4096));
    int inside = 0;
    NvU64 lo = (NvU64)(uintptr_t)lowres, hi = lo + (64ull << 30);
    for (int i = 0; i < 64; i++) {
        CK(cuMemAlloc(&big[i], 64u << 20));
        inside += big[i] >= lo && big[i] < hi;
    }
    for (int i = 0; i < 16; i++) {
        CK(cuMemAddressReserve(&resv[i], 1ull << 30, 0, 0, 0));
        inside += resv[i] >= lo && resv[i] < hi;
        CK(cuMemHostAlloc(&host[i], 2u << 20, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
        inside += (NvU64)(uintptr_t)host[i] >= lo && (NvU64)(uintptr_t)host[i] < hi;
    }
    CK(cuMemHostAlloc(&wc, 2u << 20, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED));
    CUdeviceptr wcdev = 0;
    CK(cuMemHostGetDevicePointer(&wcdev, wc, 0));
    printf("E7 cuMemAlloc 4 KiB 0x%llx (%s); 64 MiB 0x%llx..0x%llx; cuMemAddressReserve 1 GiB 0x%llx (%s); "
           "cuMemHostAlloc %p (%s), write-combined %p device 0x%llx\n",
           (unsigned long long)small, where(small), (unsigned long long)big[0], (unsigned long long)big[63],
           (unsigned long long)resv[0], where(resv[0]), host[0], where((NvU64)(uintptr_t)host[0]), wc,
           (unsigned long long)wcdev);
    printf("E7 CUDA addresses inside our reservation: %d of %d (0 = CUDA keeps out of CPU ranges it did not "
           "reserve)\n",
           inside, 64 + 32);
    /* A hint inside our reservation, and a hint in free low space. */
    CUresult r = cuMemAddressReserve(&hinted, 2u << 20, 2u << 20, lo + (1ull << 30), 0);
    printf("E7 cuMemAddressReserve hint 0x%llx (inside our PROT_NONE range): %d -> 0x%llx (%s)\n",
           (unsigned long long)(lo + (1ull << 30)), r, (unsigned long long)hinted,
           hinted == lo + (1ull << 30) ? "HONOURED: CUDA does not check CPU mappings" : "moved elsewhere");
    if (!r) cuMemAddressFree(hinted, 2u << 20);
    munmap(lowres, 64ull << 30);
    NvU64 hint = 0;
    for (NvU64 i = 1; i < 16 && !hint; i++) { /* a free low CPU range, then released so CUDA may take it */
        void *p = mmap((void *)(i << 36), 2u << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE,
                       -1, 0);
        if (p == (void *)(i << 36)) {
            hint = i << 36;
            munmap(p, 2u << 20);
        } else if (p != MAP_FAILED)
            munmap(p, 2u << 20);
    }
    hinted = 0;
    r = cuMemAddressReserve(&hinted, 2u << 20, 2u << 20, hint, 0);
    printf("E7 cuMemAddressReserve hint 0x%llx (free low range): %d -> 0x%llx (%s)\n", (unsigned long long)hint, r,
           (unsigned long long)hinted, hinted == hint ? "honoured" : "not honoured");
    big_prot_none_maps("after the allocations");
    for (int i = 0; i < 64; i++) cuMemFree(big[i]);
    for (int i = 0; i < 16; i++) {
        cuMemAddressFree(resv[i], 1ull << 30);
        cuMemFreeHost(host[i]);
    }

    own_rm o;
    if (own_rm_open(&o)) return 1;
    printf("own client 0x%08x\n", o.client);

    /* ---- E8: VMM allocation exported as a POSIX fd, imported into our client ---- */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle mh;
    CK(cuMemCreate(&mh, gran, &prop, 0));
    CUdeviceptr vmm = hinted ? hinted : 0;
    if (!vmm) CK(cuMemAddressReserve(&vmm, gran, gran, 0, 0));
    CK(cuMemMap(vmm, gran, 0, mh, 0));
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(vmm, gran, &acc, 1));
    printf("E8 cuMemCreate %zu bytes mapped at 0x%llx (%s); generic handle value 0x%llx\n", gran,
           (unsigned long long)vmm, where(vmm), (unsigned long long)mh);
    int efd = -1;
    if (TRY(cuMemExportToShareableHandle(&efd, mh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) == 0) {
        char link[64], target[256] = "";
        snprintf(link, sizeof link, "/proc/self/fd/%d", efd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n > 0) target[n] = 0;
        printf("E8 exported fd %d -> %s\n", efd, target);
        P_GET_EXPORT_OBJECT_INFO_PARAMS info;
        memset(&info, 0, sizeof info);
        info.fd = efd;
        NvU32 s = rm_control(o.ctl, o.client, o.client, P_NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO, &info,
                             sizeof info);
        printf("E8 GET_EXPORT_OBJECT_INFO: %s deviceInstance %u gpuInstanceId %u maxObjects %u metadata", nvs(s),
               info.deviceInstance, info.gpuInstanceId, info.maxObjects);
        for (int i = 0; i < 32; i++) printf(" %02x", info.metadata[i]);
        printf("\n");
        if (s == NV_OK && info.maxObjects) {
            static P_IMPORT_OBJECTS_FROM_FD_PARAMS im;
            memset(&im, 0, sizeof im);
            im.fd = efd;
            im.hParent = o.device;
            im.numObjects = info.maxObjects < 128 ? info.maxObjects : 128;
            for (int i = 0; i < im.numObjects; i++) im.objects[i] = 0xa7700000u + i;
            s = rm_control(o.ctl, o.client, o.client, P_NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD, &im,
                           sizeof im);
            printf("E8 IMPORT_OBJECTS_FROM_FD (hParent = our device): %s\n", nvs(s));
            for (int i = 0; s == NV_OK && i < im.numObjects; i++) {
                if (!im.objectTypes[i]) continue;
                NvU32 cls = 0;
                NvHandle par = 0;
                handle_info(o.ctl, o.client, im.objects[i], &cls, &par);
                printf("  object %d -> our handle 0x%x, type %u (1 vidmem, 2 sysmem), class 0x%x %s\n", i,
                       im.objects[i], im.objectTypes[i], cls, class_name(cls));
                int gfd = open_gpu_node(o.ctl, o.minor);
                NvU32 ms;
                volatile NvU32 *cpu = rm_map_cpu(o.ctl, o.client, o.device, im.objects[i], gran,
                                                 2u << 23 /* CACHING_TYPE_WRITECOMBINED */, gfd, &ms);
                printf("  CPU map of the imported object: %s -> %p\n", nvs(ms), (void *)cpu);
                if (cpu) {
                    cpu[0] = 0xfeedf00du;
                    cpu[1] = 0x0badcafeu;
                    __sync_synchronize();
                    (void)cpu[0]; /* flush write-combining */
                    NvU32 back[2] = {0, 0};
                    CK(cuMemcpyDtoH(back, vmm, 8));
                    printf("  CPU wrote through our mapping, cuMemcpyDtoH at 0x%llx read 0x%x 0x%x (%s)\n",
                           (unsigned long long)vmm, back[0], back[1],
                           back[0] == 0xfeedf00du && back[1] == 0x0badcafeu ? "same memory" : "DIFFERENT");
                    CK(cuMemsetD32(vmm + 8, 0x5a5a5a5au, 1));
                    CK(cuCtxSynchronize());
                    printf("  cuMemsetD32 at CUdeviceptr+8, our CPU mapping reads 0x%x\n", cpu[2]);
                    munmap((void *)cpu, gran);
                }
            }
        }
        close(efd);
    }
    CUmemGenericAllocationHandle back_h = 0;
    TRY(cuMemRetainAllocationHandle(&back_h, (void *)(uintptr_t)vmm));
    printf("E8 cuMemRetainAllocationHandle(VMM pointer) -> 0x%llx (same as cuMemCreate's: %s)\n",
           (unsigned long long)back_h, back_h == mh ? "yes" : "no");
    if (back_h) cuMemRelease(back_h);

    /* ---- E9: registered host memory below 1 TiB ---- */
    void *h = map_low(2u << 20, PROT_READ | PROT_WRITE, 0);
    if (h) {
        memset(h, 0, 2u << 20);
        CUdeviceptr hd = 0;
        if (TRY(cuMemHostRegister(h, 2u << 20, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE)) == 0 &&
            TRY(cuMemHostGetDevicePointer(&hd, h, 0)) == 0)
            printf("E9 host %p registered: device pointer 0x%llx (%s, %s)\n", h, (unsigned long long)hd,
                   hd == (CUdeviceptr)(uintptr_t)h ? "identity" : "differs", where(hd));
        cuMemHostUnregister(h);
        munmap(h, 2u << 20);
    }

    /* ---- E10: CUDA's shared and local windows ---- */
    CUmodule mod;
    CUfunction win, add1;
    CK(cuModuleLoadData(&mod, PTX));
    CK(cuModuleGetFunction(&win, mod, "windows"));
    CK(cuModuleGetFunction(&add1, mod, "add1"));
    CUdeviceptr out;
    CK(cuMemAlloc(&out, 64));
    void *args[] = {&out};
    CK(cuLaunchKernel(win, 1, 1, 1, 1, 1, 1, 0, 0, args, NULL));
    CK(cuCtxSynchronize());
    NvU64 w[4];
    CK(cuMemcpyDtoH(w, out, sizeof w));
    printf("E10 shared: generic 0x%llx (offset 0x%llx) -> window 0x%llx; local: generic 0x%llx (offset 0x%llx) "
           "-> window 0x%llx\n",
           (unsigned long long)w[0], (unsigned long long)w[2], (unsigned long long)(w[0] - w[2]),
           (unsigned long long)w[1], (unsigned long long)w[3], (unsigned long long)(w[1] - w[3]));

    /* ---- E11: the public API on a cuMemAlloc pointer ---- */
    CUdeviceptr base = 0;
    size_t size = 0;
    unsigned long long bufid = 0, handles = 0;
    int ipc = 0;
    TRY(cuMemGetAddressRange(&base, &size, small));
    TRY(cuPointerGetAttribute(&bufid, CU_POINTER_ATTRIBUTE_BUFFER_ID, small));
    TRY(cuPointerGetAttribute(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, small));
    TRY(cuPointerGetAttribute(&handles, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, small));
    printf("E11 cuMemAlloc 0x%llx: range 0x%llx+0x%zx, buffer id %llu, legacy IPC %d, allowed handle types 0x%llx\n",
           (unsigned long long)small, (unsigned long long)base, size, bufid, ipc, handles);
    CUmemGenericAllocationHandle g = 0;
    TRY(cuMemRetainAllocationHandle(&g, (void *)(uintptr_t)small));
    CUipcMemHandle ih;
    memset(&ih, 0, sizeof ih);
    if (TRY(cuIpcGetMemHandle(&ih, small)) == 0) {
        printf("E11 legacy IPC handle:");
        for (int i = 0; i < 64; i++) printf("%s%02x", i % 4 ? "" : " ", (unsigned char)ih.reserved[i]);
        printf("\n");
    }

    /* ---- E12: our RM memory in CUDA's VA space, inside a CUDA reservation, through CUDA's UVM fd ---- */
    int uvm = -1;
    fd_list u = fds_of("/dev/nvidia-uvm");
    for (int i = 0; i < u.n && uvm < 0; i++) {
        UVM_PAGEABLE_MEM_ACCESS_PARAMS p;
        memset(&p, 0, sizeof p);
        if (ioctl(u.fd[i], UVM_PAGEABLE_MEM_ACCESS, &p) == 0 && p.rmStatus == 0) uvm = u.fd[i];
    }
    CUdeviceptr r12 = 0;
    CK(cuMemAddressReserve(&r12, 2u << 20, 2u << 20, 0, 0));
    NV_MEMORY_ALLOCATION_PARAMS mp;
    memset(&mp, 0, sizeof mp);
    mp.owner = o.client;
    mp.type = NVOS32_TYPE_NOTIFIER;
    mp.flags = NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE | NVOS32_ALLOC_FLAGS_MAP_NOT_REQUIRED |
               NVOS32_ALLOC_FLAGS_IGNORE_BANK_PLACEMENT | NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED;
    mp.attr = 0x2a800000u;
    mp.attr2 = 9;
    mp.format = 6;
    mp.size = 2u << 20;
    mp.alignment = 0x1000;
    mp.limit = (2u << 20) - 1;
    NvHandle hm = 0;
    NvU32 s = rm_alloc(o.ctl, o.client, o.device, &hm, NV01_MEMORY_SYSTEM, &mp);
    int mfd = nv_open("/dev/nvidiactl");
    NvU32 ms;
    volatile NvU32 *cpu = s ? NULL : rm_map_cpu(o.ctl, o.client, o.device, hm, 2u << 20, 0, mfd, &ms);
    printf("E12 CUDA reservation 0x%llx (%s); our sysmem 0x%x: %s, CPU %p; CUDA's uvm fd %d\n",
           (unsigned long long)r12, where(r12), hm, nvs(s), (void *)cpu, uvm);
    if (cpu && uvm >= 0) {
        cpu[0] = 41;
        UVM_CREATE_EXTERNAL_RANGE_PARAMS cr = {.base = r12, .length = 2u << 20};
        NvU32 us = UVM_CALL(uvm, UVM_CREATE_EXTERNAL_RANGE, &cr);
        int created = us == NV_OK;
        printf("E12 UVM_CREATE_EXTERNAL_RANGE in CUDA's VA space: %s (NV_ERR_UVM_ADDRESS_IN_USE = CUDA made a UVM "
               "range at reserve time)\n",
               nvs(us));
        static UVM_MAP_EXTERNAL_ALLOCATION_PARAMS m;
        memset(&m, 0, sizeof m);
        m.base = r12;
        m.length = 2u << 20;
        m.gpuAttributesCount = 1;
        memcpy(m.perGpuAttributes[0].gpuUuid.uuid, o.uuid, 16);
        m.perGpuAttributes[0].gpuMappingType = 1; /* UvmGpuMappingTypeReadWriteAtomic */
        m.rmCtrlFd = o.ctl;
        m.hClient = o.client;
        m.hMemory = hm;
        us = UVM_CALL(uvm, UVM_MAP_EXTERNAL_ALLOCATION, &m);
        printf("E12 UVM_MAP_EXTERNAL_ALLOCATION of our handle at 0x%llx: %s\n", (unsigned long long)r12, nvs(us));
        if (us == NV_OK) {
            void *a[] = {&r12};
            CK(cuLaunchKernel(add1, 1, 1, 1, 1, 1, 1, 0, 0, a, NULL));
            CK(cuCtxSynchronize());
            printf("E12 a CUDA kernel incremented the word at 0x%llx: our CPU mapping reads %u (expect 42)\n",
                   (unsigned long long)r12, cpu[0]);
            if (created) { /* our range: free it whole */
                UVM_FREE_PARAMS f = {.base = r12, .length = 2u << 20};
                printf("E12 UVM_FREE: %s\n", nvs(UVM_CALL(uvm, UVM_FREE, &f)));
            } else { /* CUDA's range: take our mapping out, leave the range */
                UVM_UNMAP_EXTERNAL_PARAMS un;
                memset(&un, 0, sizeof un);
                un.base = r12;
                un.length = 2u << 20;
                memcpy(un.gpuUuid.uuid, o.uuid, 16);
                printf("E12 UVM_UNMAP_EXTERNAL: %s\n", nvs(UVM_CALL(uvm, UVM_UNMAP_EXTERNAL, &un)));
            }
        }
    }
    printf("E12 cuMemAddressFree of the reservation: %d\n", cuMemAddressFree(r12, 2u << 20));
    CK(cuMemsetD32(small, 1, 1));
    CK(cuCtxSynchronize());
    printf("CUDA still works at the end\n");
    rm_free(o.ctl, o.client, 0, o.client);
    return 0;
}
