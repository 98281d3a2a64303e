/*
 * Issue 12, experiments E1 and E2 (docs/attach-cuda.md): find the current CUDA context's RM client, the
 * descriptor it is bound to, and its objects (device, subdevice, VA spaces, channel groups, context shares,
 * channels), from inside the process and without LD_PRELOAD.
 *
 * Build (GPU machine, repository root):
 *   H=open-gpu-headers/open-gpu-kernel-modules
 *   gcc -O2 -std=gnu11 -Wall -I probes/attach -I $H/src/common/sdk/nvidia/inc \
 *       -I $H/src/nvidia/arch/nvalloc/unix/include -I $H/kernel-open/nvidia-uvm -I $H/kernel-open/common/inc \
 *       -I /usr/local/cuda/include -o find_client probes/attach/find_client.c -lcuda
 * Run:  ./find_client [handle-scan-count, default 65536]
 *
 * What it proves or refutes (each line prints the NV_STATUS RM returned):
 *   - "client 0xc1d0xxxx ... DUP allowed": our own client can see and dup CUDA's client (same process);
 *   - "via fd N: GET_HANDLE_INFO NV_OK" on exactly one of CUDA's /dev/nvidiactl descriptors and
 *     NV_ERR_INVALID_CLIENT on ours: strict client validation binds the client to its open file;
 *   - "dup(fd)": a dup of that descriptor is the same open file and is accepted;
 *   - GET_CHILD_HANDLE with the class number 0x80 finds nothing, with the NVOC id 0xe0ac20 finds the device;
 *   - the object table: CUDA's handles, classes and parents (which TSG is the compute one, which VA space).
 */
#include "nvrm.h"
#include <cuda.h>

#define CK(x)                                                                                              \
    do {                                                                                                   \
        CUresult r_ = (x);                                                                                 \
        if (r_ != CUDA_SUCCESS) {                                                                          \
            const char *n_ = "?";                                                                          \
            cuGetErrorName(r_, &n_);                                                                       \
            printf("%s: %s\n", #x, n_);                                                                    \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

static void db_info(own_rm *o, const char *when) {
    NV0000_CTRL_SYSTEM_GET_CLIENT_DATABASE_INFO_PARAMS p;
    memset(&p, 0, sizeof p);
    NvU32 s = rm_control(o->ctl, o->client, o->client, NV0000_CTRL_CMD_SYSTEM_GET_CLIENT_DATABASE_INFO, &p,
                         sizeof p);
    printf("GET_CLIENT_DATABASE_INFO (%s): %s clients=%u resources=%llu\n", when, nvs(s), p.clientCount,
           (unsigned long long)p.resourceCount);
}

static void dump_tree(int fd, NvHandle client, NvU32 scan) {
    NvHandle dev = 0;
    NvU32 s = child_handle(fd, client, client, 0x0080, &dev);
    printf("  GET_CHILD_HANDLE(parent=client, classId=0x80 class number): %s -> 0x%x\n", nvs(s), dev);
    s = child_handle(fd, client, client, NVOC_ID_DEVICE, &dev);
    printf("  GET_CHILD_HANDLE(parent=client, classId=0x%x NVOC Device): %s -> 0x%x\n", NVOC_ID_DEVICE, nvs(s),
           dev);
    NvHandle sub = 0, vas = 0, tsg = 0;
    if (dev) {
        child_handle(fd, client, dev, NVOC_ID_SUBDEVICE, &sub);
        child_handle(fd, client, dev, NVOC_ID_VASPACE_API, &vas);
        child_handle(fd, client, dev, NVOC_ID_KERNEL_CHANNEL_GROUP_API, &tsg);
        printf("  first children of the device: subdevice 0x%x, VA space 0x%x, channel group 0x%x\n", sub, vas,
               tsg);
    }
    if (!dev) return;

    static rm_obj objs[8192];
    NvHandle bases[2] = {dev & 0xffff0000u, 0xcaf00000u};
    NvU32 counts[2] = {scan, 0x1000};
    int n = 0;
    for (int b = 0; b < 2; b++) {
        double t0 = now_s();
        int k = scan_objects(fd, client, bases[b], counts[b], objs + n, 8192 - n);
        double t1 = now_s();
        printf("  scanned 0x%x handles from 0x%08x: %d objects, %.2f us per GET_HANDLE_INFO pair\n", counts[b],
               bases[b], k, (t1 - t0) * 1e6 / counts[b]);
        n += k;
    }
    printf("  handle      parent      class\n");
    for (int i = 0; i < n; i++)
        printf("  0x%08x  0x%08x  0x%04x %s\n", objs[i].h, objs[i].parent, objs[i].cls, class_name(objs[i].cls));
    /* Channel groups: which engine (a channel with a compute object child = the GR group). */
    for (int i = 0; i < n; i++) {
        if (objs[i].cls != 0xa06c) continue;
        int chans = 0, compute = 0, copy = 0, shares = 0;
        for (int j = 0; j < n; j++) {
            if (objs[j].parent != objs[i].h) continue;
            if (objs[j].cls == 0x9067) shares++;
            if (objs[j].cls == 0xc86f) {
                chans++;
                for (int k = 0; k < n; k++) {
                    if (objs[k].parent != objs[j].h) continue;
                    compute += objs[k].cls == 0xcbc0;
                    copy += objs[k].cls == 0xc8b5;
                }
            }
        }
        NVA06C_CTRL_GET_INFO_PARAMS gi = {0};
        NvU32 st = rm_control(fd, client, objs[i].h, NVA06C_CTRL_CMD_GET_INFO, &gi, sizeof gi);
        printf("  TSG 0x%08x (parent 0x%08x): tsgID %u (%s), %d channels, %d ctxshares, %d compute, %d copy -> %s\n",
               objs[i].h, objs[i].parent, gi.tsgID, nvs(st), chans, shares, compute, copy,
               compute ? "GR (compute) group" : "copy-only group");
    }
}

int main(int argc, char **argv) {
    NvU32 scan = argc > 1 ? (NvU32)strtoul(argv[1], NULL, 0) : 0x10000;
    setvbuf(stdout, NULL, _IOLBF, 0);
    print_nvidia_fds();
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr ptr;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuMemAlloc(&ptr, 1 << 20)); /* the context is fully built once memory exists */
    printf("cuMemAlloc -> 0x%llx\n", (unsigned long long)ptr);
    print_nvidia_fds();

    own_rm o;
    if (own_rm_open(&o)) return 1;
    printf("own client 0x%08x on fd %d (device 0x%x, subdevice 0x%x, /dev/nvidia%u)\n", o.client, o.ctl,
           o.device, o.subdevice, o.minor);
    db_info(&o, "after cuInit");

    /* E1: find CUDA's client(s) through the access-rights oracle, then the descriptor each is bound to. */
    printf("E1: client indices below ours (GET_ACCESS_RIGHTS from our own client):\n");
    cuda_client cl[16];
    double t0 = now_s();
    int n = find_cuda_clients(&o, cl, 16, 4096, 1);
    printf("E1: %d same-process client(s) found in %.1f ms\n", n, (now_s() - t0) * 1e3);

    /* E1b: the same search without the oracle, through each CUDA descriptor (validates the oracle). */
    fd_list ctl = fds_of("/dev/nvidiactl");
    for (int i = 0; i < ctl.n; i++) {
        if (ctl.fd[i] == o.ctl) continue;
        int hits = 0;
        for (NvU32 k = 1; k <= 4096; k++) {
            NvHandle x = CLIENT_BASE | (((o.client & CLIENT_INDEX_MASK) - k) & CLIENT_INDEX_MASK);
            NvU32 cls = 0;
            NvHandle par = 0;
            if (handle_info(ctl.fd[i], x, x, &cls, &par) == NV_OK) {
                printf("E1b: fd %d owns client 0x%08x (class 0x%x)\n", ctl.fd[i], x, cls);
                hits++;
            }
        }
        if (!hits) printf("E1b: fd %d owns no client among the 4096 indices below ours\n", ctl.fd[i]);
    }

    for (int i = 0; i < n; i++) {
        cuda_client *c = &cl[i];
        NvU32 cls = 0;
        NvHandle par = 0;
        printf("client 0x%08x:\n", c->client);
        printf("  via our own fd %d: %s (expect NV_ERR_INVALID_CLIENT: strict validation)\n", o.ctl,
               nvs(handle_info(o.ctl, c->client, c->client, &cls, &par)));
        if (c->fd < 0) {
            printf("  no CUDA descriptor accepts it\n");
            continue;
        }
        int d = dup(c->fd);
        printf("  via dup(%d)=%d: %s (expect NV_OK: same open file)\n", c->fd, d,
               nvs(handle_info(d, c->client, c->client, &cls, &par)));
        close(d);
        /* A /dev/nvidiaN descriptor registered with CUDA's control fd carries that fd's identity (escape.c). */
        fd_list g = fds_of("/dev/nvidia0");
        for (int j = 0; j < g.n && j < 4; j++)
            printf("  via CUDA's /dev/nvidia0 fd %d: %s\n", g.fd[j],
                   nvs(handle_info(g.fd[j], c->client, c->client, &cls, &par)));
        dump_tree(c->fd, c->client, scan);
    }

    /* Which /dev/nvidia-uvm descriptor is CUDA's VA space (UVM_PAGEABLE_MEM_ACCESS needs an initialised one). */
    fd_list u = fds_of("/dev/nvidia-uvm");
    for (int i = 0; i < u.n; i++) {
        UVM_PAGEABLE_MEM_ACCESS_PARAMS p;
        memset(&p, 0, sizeof p);
        int r = ioctl(u.fd[i], UVM_PAGEABLE_MEM_ACCESS, &p);
        printf("uvm fd %d: UVM_PAGEABLE_MEM_ACCESS ioctl=%d errno=%d rmStatus=%s pageable=%u -> %s\n", u.fd[i], r,
               r < 0 ? errno : 0, nvs(p.rmStatus), p.pageableMemAccess,
               (r == 0 && p.rmStatus == 0) ? "VA-space fd" : "not a VA-space fd (mm fd?)");
    }
    db_info(&o, "end");
    rm_free(o.ctl, o.client, 0, o.client);
    CK(cuMemFree(ptr));
    return 0;
}
