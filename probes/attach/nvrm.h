/*
 * Shared helpers for the issue-12 attach probes (docs/attach-cuda.md): raw RM and UVM ioctls the way APEX
 * issues them (src/rm/ioctl.rs, src/rm/client.rs), the few RM control structures the vendored headers lack,
 * and the search for CUDA's RM client from inside the process.
 *
 * Nothing here changes GPU settings: it allocates, queries and frees RM objects of this process only.
 *
 * Include paths (from the repository root), as open-gpu-headers/README.md lists them:
 *   -I open-gpu-headers/open-gpu-kernel-modules/src/common/sdk/nvidia/inc
 *   -I open-gpu-headers/open-gpu-kernel-modules/src/nvidia/arch/nvalloc/unix/include
 *   -I open-gpu-headers/open-gpu-kernel-modules/kernel-open/nvidia-uvm
 *   -I open-gpu-headers/open-gpu-kernel-modules/kernel-open/common/inc
 */
#ifndef APEX_ATTACH_NVRM_H
#define APEX_ATTACH_NVRM_H

#define _GNU_SOURCE
#define NVRM_FN static __attribute__((unused))
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nvtypes.h"
#include "nvstatus.h"
#include "nvlimits.h"
#include "nvmisc.h"
#include "nvgputypes.h"
#include "nvos.h"
#include "rs_access.h"
#include "nv_escape.h"
#include "nv-ioctl-numbers.h"
#include "nv-ioctl.h"
#include "nv-unix-nvos-params-wrappers.h"
#include "alloc/alloc_channel.h"
#include "class/cl0000.h"
#include "class/cl0080.h"
#include "class/cl2080.h"
#include "class/cl003e.h"
#include "class/cl0040.h"
#include "class/cl9067.h"
#include "class/cl90f1.h"
#include "class/cla06c.h"
#include "class/clc361.h"
#include "class/clc661.h"
#include "class/clc86f.h"
#include "class/clc8b5.h"
#include "class/clcbc0.h"
#include "ctrl/ctrl0000/ctrl0000system.h"
#include "ctrl/ctrl0000/ctrl0000gpu.h"
#include "ctrl/ctrl2080/ctrl2080gpu.h"
#include "ctrl/ctrla06c.h"
#include "ctrl/ctrla06f/ctrla06fgpfifo.h"
#include "ctrl/ctrlc36f.h"
#include "uvm_types.h"
#include "uvm_ioctl.h"
#include "uvm_linux_ioctl.h"

/* ---- RM controls the vendored headers do not carry (ctrl0000client.h, ctrl0000unix.h of branch 580) ---- */
/* Layouts and numbers read from NVIDIA/open-gpu-kernel-modules tag 580.142; sizes must match exactly, RM
 * compares paramsSize with the exported method's size. */
#define P_NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO   0xd02u
#define P_NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS 0xd03u
#define P_NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE  0xd05u
#define P_HANDLE_INFO_INDEX_PARENT  1u
#define P_HANDLE_INFO_INDEX_CLASSID 2u
typedef struct {
    NvHandle hObject;
    NvU32 index;
    union {
        NvHandle hResult;
        NvU64 iResult NV_ALIGN_BYTES(8);
    } data;
} P_GET_HANDLE_INFO_PARAMS; /* 16 bytes */
typedef struct {
    NvHandle hObject;
    NvHandle hClient;
    RS_ACCESS_MASK maskResult;
} P_GET_ACCESS_RIGHTS_PARAMS; /* 12 bytes */
typedef struct {
    NvHandle hParent;
    NvU32 classId; /* RM's *internal* (NVOC) class id, not the class number: see docs/attach-cuda.md */
    NvHandle hObject;
} P_GET_CHILD_HANDLE_PARAMS; /* 12 bytes */

/* NVOC class ids (src/nvidia/generated/g_*_nvoc.h, identical in 535..595) */
#define NVOC_ID_DEVICE 0xe0ac20u
#define NVOC_ID_SUBDEVICE 0x4b01b3u
#define NVOC_ID_VASPACE_API 0xcd048bu
#define NVOC_ID_KERNEL_CHANNEL_GROUP_API 0x2b5b80u
#define NVOC_ID_KERNEL_CHANNEL 0x5d8d70u
#define NVOC_ID_KERNEL_CTXSHARE_API 0x1f9af1u

#define P_NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO 0x3d08u
#define P_NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD 0x3d0cu
typedef struct {
    NvS32 fd;
    NvU32 deviceInstance;
    NvU32 gpuInstanceId;
    NvU16 maxObjects;
    NvU8 metadata[64];
} P_GET_EXPORT_OBJECT_INFO_PARAMS; /* 80 bytes */
typedef struct {
    NvS32 fd;
    NvHandle hParent;
    NvHandle objects[128];
    NvU8 objectTypes[128];
    NvU16 numObjects;
    NvU16 index;
} P_IMPORT_OBJECTS_FROM_FD_PARAMS; /* 652 bytes */

/* ---- status names ---- */
NVRM_FN const char *nvs(NvU32 s) {
    static char buf[8][24];
    static int slot;
    switch (s) {
    case 0x00: return "NV_OK";
    case 0x16: return "NV_ERR_ILLEGAL_ACTION";
    case 0x19: return "NV_ERR_INSERT_DUPLICATE_NAME";
    case 0x1a: return "NV_ERR_INSUFFICIENT_RESOURCES";
    case 0x1b: return "NV_ERR_INSUFFICIENT_PERMISSIONS";
    case 0x1e: return "NV_ERR_INVALID_ADDRESS";
    case 0x1f: return "NV_ERR_INVALID_ARGUMENT";
    case 0x21: return "NV_ERR_INVALID_CHANNEL";
    case 0x22: return "NV_ERR_INVALID_CLASS";
    case 0x23: return "NV_ERR_INVALID_CLIENT";
    case 0x26: return "NV_ERR_INVALID_DEVICE";
    case 0x29: return "NV_ERR_INVALID_FLAGS";
    case 0x2f: return "NV_ERR_INVALID_LOCK_STATE";
    case 0x31: return "NV_ERR_INVALID_OBJECT";
    case 0x33: return "NV_ERR_INVALID_OBJECT_HANDLE";
    case 0x36: return "NV_ERR_INVALID_OBJECT_PARENT";
    case 0x3b: return "NV_ERR_INVALID_PARAMETER";
    case 0x3f: return "NV_ERR_INVALID_REQUEST";
    case 0x40: return "NV_ERR_INVALID_STATE";
    case 0x51: return "NV_ERR_NO_MEMORY";
    case 0x56: return "NV_ERR_NOT_SUPPORTED";
    case 0x57: return "NV_ERR_OBJECT_NOT_FOUND";
    case 0x5a: return "NV_ERR_OTHER_DEVICE_FOUND";
    case 0x5b: return "NV_ERR_OUT_OF_RANGE";
    case 0x68: return "NV_ERR_UVM_ADDRESS_IN_USE";
    case 0xffffffffu: return "ioctl failed (errno)";
    default:
        slot = (slot + 1) % 8;
        snprintf(buf[slot], sizeof buf[slot], "NV_STATUS 0x%x", s);
        return buf[slot];
    }
}

/* ---- ioctls ---- */
#define NV_IOCTL_RW(nr, size) _IOC(_IOC_READ | _IOC_WRITE, NV_IOCTL_MAGIC, (nr), (size))

NVRM_FN int nv_open(const char *path) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) fprintf(stderr, "open %s: %s\n", path, strerror(errno));
    return fd;
}

/* An RM escape; returns 0 or -errno. */
NVRM_FN int nv_escape(int fd, unsigned nr, void *arg, size_t size) {
    return ioctl(fd, NV_IOCTL_RW(nr, size), arg) < 0 ? -errno : 0;
}

/* NV_ESC_RM_ALLOC (NVOS21, paramsSize 0 as APEX and libcuda pass it). *h: in = wanted handle or 0. */
NVRM_FN NvU32 rm_alloc(int fd, NvHandle client, NvHandle parent, NvHandle *h, NvU32 cls, void *params) {
    NVOS21_PARAMETERS p;
    memset(&p, 0, sizeof p);
    p.hRoot = client;
    p.hObjectParent = parent;
    p.hObjectNew = h ? *h : 0;
    p.hClass = cls;
    p.pAllocParms = (NvP64)(uintptr_t)params;
    if (nv_escape(fd, NV_ESC_RM_ALLOC, &p, sizeof p)) return 0xffffffffu;
    if (p.status == 0 && h) *h = p.hObjectNew;
    return p.status;
}

NVRM_FN NvU32 rm_control(int fd, NvHandle client, NvHandle object, NvU32 cmd, void *params, NvU32 size) {
    NVOS54_PARAMETERS p;
    memset(&p, 0, sizeof p);
    p.hClient = client;
    p.hObject = object;
    p.cmd = cmd;
    p.params = (NvP64)(uintptr_t)params;
    p.paramsSize = size;
    if (nv_escape(fd, NV_ESC_RM_CONTROL, &p, sizeof p)) return 0xffffffffu;
    return p.status;
}

NVRM_FN NvU32 rm_free(int fd, NvHandle client, NvHandle parent, NvHandle object) {
    NVOS00_PARAMETERS p = {.hRoot = client, .hObjectParent = parent, .hObjectOld = object};
    if (nv_escape(fd, NV_ESC_RM_FREE, &p, sizeof p)) return 0xffffffffu;
    return p.status;
}

/* NV_ESC_RM_DUP_OBJECT: copies (client_src, obj_src) under (client_dst, parent_dst). *h: in = wanted or 0. */
NVRM_FN NvU32 rm_dup(int fd, NvHandle client_dst, NvHandle parent_dst, NvHandle *h, NvHandle client_src,
                    NvHandle obj_src) {
    NVOS55_PARAMETERS p;
    memset(&p, 0, sizeof p);
    p.hClient = client_dst;
    p.hParent = parent_dst;
    p.hObject = h ? *h : 0;
    p.hClientSrc = client_src;
    p.hObjectSrc = obj_src;
    if (nv_escape(fd, NV_ESC_RM_DUP_OBJECT, &p, sizeof p)) return 0xffffffffu;
    if (p.status == 0 && h) *h = p.hObject;
    return p.status;
}

/* NV_ESC_RM_MAP_MEMORY + mmap: RM attaches the mapping to `mapfd` (a fresh /dev/nvidiactl for system memory,
 * a fresh /dev/nvidiaN registered with `ctl` otherwise), as src/rm/memory.rs does. */
NVRM_FN void *rm_map_cpu(int ctl, NvHandle client, NvHandle device, NvHandle mem, size_t len, NvU32 flags,
                        int mapfd, NvU32 *status) {
    nv_ioctl_nvos33_parameters_with_fd p;
    memset(&p, 0, sizeof p);
    p.params.hClient = client;
    p.params.hDevice = device;
    p.params.hMemory = mem;
    p.params.length = len;
    p.params.flags = flags;
    p.fd = mapfd;
    if (nv_escape(ctl, NV_ESC_RM_MAP_MEMORY, &p, sizeof p)) {
        *status = 0xffffffffu;
        return NULL;
    }
    *status = p.params.status;
    if (p.params.status) return NULL;
    void *ptr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, mapfd, 0);
    return ptr == MAP_FAILED ? NULL : ptr;
}

/* A UVM ioctl whose parameters end in rmStatus; returns rmStatus, or 0xffffffff with errno on ioctl failure. */
#define UVM_CALL(fd, cmd, p) (ioctl((fd), (cmd), (p)) < 0 ? 0xffffffffu : (p)->rmStatus)

/* ---- the process's own view: which descriptors are NVIDIA device nodes ---- */
#define MAX_FDS 64
typedef struct {
    int fd[MAX_FDS];
    int n;
} fd_list;

/* Descriptors of this process whose target is exactly `path` (e.g. "/dev/nvidiactl"). */
NVRM_FN fd_list fds_of(const char *path) {
    fd_list l = {.n = 0};
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    char link[64], target[256];
    while (d && (e = readdir(d)) && l.n < MAX_FDS) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (strcmp(target, path) == 0) l.fd[l.n++] = fd;
    }
    if (d) closedir(d);
    return l;
}

NVRM_FN void print_nvidia_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    char link[64], target[256];
    printf("fds:");
    while (d && (e = readdir(d))) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (strncmp(target, "/dev/nvidia", 11) == 0) printf(" %d=%s", fd, target);
    }
    printf("\n");
    if (d) closedir(d);
}

/* ---- this probe's own RM client: root client, device, subdevice (as src/rm/gpu.rs builds them) ---- */
typedef struct {
    int ctl;           /* our own /dev/nvidiactl */
    NvHandle client, device, subdevice;
    NvU32 minor, device_instance;
    NvU8 uuid[16];
} own_rm;

NVRM_FN int own_rm_open(own_rm *o) {
    memset(o, 0, sizeof *o);
    o->ctl = nv_open("/dev/nvidiactl");
    if (o->ctl < 0) return -1;
    NvU32 s = rm_alloc(o->ctl, 0, 0, &o->client, NV01_ROOT_CLIENT, NULL);
    if (s) {
        printf("own root client: %s\n", nvs(s));
        return -1;
    }
    nv_ioctl_card_info_t cards[NV_MAX_DEVICES];
    memset(cards, 0, sizeof cards);
    if (nv_escape(o->ctl, NV_ESC_CARD_INFO, cards, sizeof cards)) return -1;
    int i;
    for (i = 0; i < NV_MAX_DEVICES && !cards[i].valid; i++) {}
    if (i == NV_MAX_DEVICES) return -1;
    o->minor = cards[i].minor_number;
    NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS id = {.gpuId = cards[i].gpu_id};
    s = rm_control(o->ctl, o->client, o->client, NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2, &id, sizeof id);
    if (s) return printf("GET_ID_INFO_V2: %s\n", nvs(s)), -1;
    o->device_instance = id.deviceInstance;
    NV0080_ALLOC_PARAMETERS dp;
    memset(&dp, 0, sizeof dp);
    dp.deviceId = id.deviceInstance;
    dp.hClientShare = o->client;
    dp.vaMode = NV_DEVICE_ALLOCATION_VAMODE_OPTIONAL_MULTIPLE_VASPACES;
    s = rm_alloc(o->ctl, o->client, o->client, &o->device, NV01_DEVICE_0, &dp);
    if (s) return printf("own NV01_DEVICE_0: %s\n", nvs(s)), -1;
    NV2080_ALLOC_PARAMETERS sp = {.subDeviceId = 0};
    s = rm_alloc(o->ctl, o->client, o->device, &o->subdevice, NV20_SUBDEVICE_0, &sp);
    if (s) return printf("own NV20_SUBDEVICE_0: %s\n", nvs(s)), -1;
    NV2080_CTRL_GPU_GET_GID_INFO_PARAMS gid;
    memset(&gid, 0, sizeof gid);
    gid.flags = NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_BINARY;
    gid.length = 16;
    s = rm_control(o->ctl, o->client, o->subdevice, NV2080_CTRL_CMD_GPU_GET_GID_INFO, &gid, sizeof gid);
    if (s) return printf("GET_GID_INFO: %s\n", nvs(s)), -1;
    memcpy(o->uuid, gid.data, 16);
    return 0;
}

/* /dev/nvidiaN registered with `ctl` (NV_ESC_REGISTER_FD), as RM wants for video-memory and register maps. */
NVRM_FN int open_gpu_node(int ctl, NvU32 minor) {
    char path[32];
    snprintf(path, sizeof path, "/dev/nvidia%u", minor);
    int fd = nv_open(path);
    if (fd < 0) return -1;
    nv_ioctl_register_fd_t r = {.ctl_fd = ctl};
    if (nv_escape(fd, NV_ESC_REGISTER_FD, &r, sizeof r)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- CUDA's RM client ---- */
#define CLIENT_BASE 0xC1D00000u
#define CLIENT_INDEX_MASK 0x000FFFFFu

/* Does client handle `x` exist, and may our client dup its objects? (NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS
 * on our own client looks the other client up without validating it against our fd.) */
NVRM_FN NvU32 probe_client(own_rm *o, NvHandle x, NvU32 *mask) {
    P_GET_ACCESS_RIGHTS_PARAMS p = {.hObject = x, .hClient = x};
    NvU32 s = rm_control(o->ctl, o->client, o->client, P_NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS, &p, sizeof p);
    *mask = p.maskResult.limbs[0];
    return s;
}

/* Class number and parent of `h` in `client`, asked through `fd` (which must be the client's own file). */
NVRM_FN NvU32 handle_info(int fd, NvHandle client, NvHandle h, NvU32 *cls, NvHandle *parent) {
    P_GET_HANDLE_INFO_PARAMS p = {.hObject = h, .index = P_HANDLE_INFO_INDEX_CLASSID};
    NvU32 s = rm_control(fd, client, client, P_NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO, &p, sizeof p);
    if (s) return s;
    *cls = (NvU32)p.data.iResult;
    P_GET_HANDLE_INFO_PARAMS q = {.hObject = h, .index = P_HANDLE_INFO_INDEX_PARENT};
    s = rm_control(fd, client, client, P_NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO, &q, sizeof q);
    *parent = q.data.hResult;
    return s;
}

NVRM_FN NvU32 child_handle(int fd, NvHandle client, NvHandle parent, NvU32 nvoc_id, NvHandle *out) {
    P_GET_CHILD_HANDLE_PARAMS p = {.hParent = parent, .classId = nvoc_id};
    NvU32 s = rm_control(fd, client, client, P_NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE, &p, sizeof p);
    *out = p.hObject;
    return s;
}

typedef struct {
    NvHandle client;
    int fd;      /* CUDA's /dev/nvidiactl descriptor that owns the client, or -1 */
    NvU32 mask;  /* our access rights on it (bit 0 = RS_ACCESS_DUP_OBJECT) */
} cuda_client;

/* Finds the clients of this process allocated before ours: scans client indices downward from our own (RM
 * hands them out from one global counter, rs_server.c), keeps those we may dup from (same process), and
 * names the descriptor each is bound to. Returns how many were found. */
NVRM_FN int find_cuda_clients(own_rm *o, cuda_client *out, int max, int window, int verbose) {
    fd_list ctl = fds_of("/dev/nvidiactl");
    int n = 0;
    NvU32 own_idx = o->client & CLIENT_INDEX_MASK;
    for (int k = 1; k <= window && n < max; k++) {
        NvHandle x = CLIENT_BASE | ((own_idx - k) & CLIENT_INDEX_MASK);
        NvU32 mask = 0, s = probe_client(o, x, &mask);
        if (s == NV_ERR_INVALID_CLIENT || s == NV_ERR_INVALID_OBJECT_HANDLE) continue;
        if (verbose) printf("  client 0x%08x: GET_ACCESS_RIGHTS %s, mask 0x%x%s\n", x, nvs(s), mask,
                            (mask & 1) ? " (DUP allowed: same process)" : "");
        if (s != NV_OK || !(mask & 1)) continue;
        cuda_client c = {.client = x, .fd = -1, .mask = mask};
        for (int i = 0; i < ctl.n; i++) {
            if (ctl.fd[i] == o->ctl) continue;
            NvU32 cls = 0;
            NvHandle par = 0;
            NvU32 t = handle_info(ctl.fd[i], x, x, &cls, &par);
            if (verbose) printf("    via fd %d: GET_HANDLE_INFO %s (class 0x%x)\n", ctl.fd[i], nvs(t), cls);
            if (t == NV_OK) c.fd = ctl.fd[i];
        }
        out[n++] = c;
    }
    return n;
}

/* The same search without the access-rights oracle: ask through each of the process's other /dev/nvidiactl
 * descriptors which client index below ours it accepts (only the owning open file does). */
NVRM_FN int find_clients_via_fds(own_rm *o, cuda_client *out, int max, int window) {
    fd_list ctl = fds_of("/dev/nvidiactl");
    int n = 0;
    for (int i = 0; i < ctl.n && n < max; i++) {
        if (ctl.fd[i] == o->ctl) continue;
        for (int k = 1; k <= window && n < max; k++) {
            NvHandle x = CLIENT_BASE | (((o->client & CLIENT_INDEX_MASK) - k) & CLIENT_INDEX_MASK);
            NvU32 cls = 0;
            NvHandle par = 0;
            if (handle_info(ctl.fd[i], x, x, &cls, &par) == NV_OK)
                out[n++] = (cuda_client){.client = x, .fd = ctl.fd[i], .mask = 0};
        }
    }
    return n;
}

/* Objects of `client` with handles in [base, base+count), asked through its own fd. */
typedef struct {
    NvHandle h, parent;
    NvU32 cls;
} rm_obj;

NVRM_FN int scan_objects(int fd, NvHandle client, NvHandle base, NvU32 count, rm_obj *out, int max) {
    int n = 0;
    for (NvU32 i = 0; i < count && n < max; i++) {
        NvU32 cls = 0;
        NvHandle par = 0;
        if (handle_info(fd, client, base + i, &cls, &par) == NV_OK) out[n++] = (rm_obj){base + i, par, cls};
    }
    return n;
}

NVRM_FN const char *class_name(NvU32 c) {
    switch (c) {
    case 0x0041: return "NV01_ROOT_CLIENT";
    case 0x0080: return "NV01_DEVICE_0";
    case 0x2080: return "NV20_SUBDEVICE_0";
    case 0x003e: return "NV01_MEMORY_SYSTEM";
    case 0x0040: return "NV01_MEMORY_LOCAL_USER";
    case 0x0070: return "NV01_MEMORY_VIRTUAL";
    case 0x0071: return "NV01_MEMORY_SYSTEM_OS_DESCRIPTOR";
    case 0x00de: return "RM_USER_SHARED_DATA";
    case 0x0005: return "NV01_EVENT";
    case 0x0079: return "NV01_EVENT_OS_EVENT";
    case 0x90f1: return "FERMI_VASPACE_A";
    case 0x9067: return "FERMI_CONTEXT_SHARE_A";
    case 0xa06c: return "KEPLER_CHANNEL_GROUP_A";
    case 0xc86f: return "HOPPER_CHANNEL_GPFIFO_A";
    case 0xc661: return "HOPPER_USERMODE_A";
    case 0xcbc0: return "HOPPER_COMPUTE_A";
    case 0xc8b5: return "HOPPER_DMA_COPY_A";
    case 0x83de: return "GT200_DEBUGGER";
    case 0xcb33: return "NV_CONFIDENTIAL_COMPUTE";
    case 0x90e6: return "GF100_SUBDEVICE_MASTER";
    case 0x90cc: return "GF100_PROFILER";
    case 0x00f2: return "IO_VASPACE_A";
    case 0xc637: return "AMPERE_SMC_PARTITION_REF";
    default: return "";
    }
}

NVRM_FN double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* An anonymous mapping at the first free 64 GiB multiple below 1 TiB (as APEX reserves its low region),
 * `prot` PROT_NONE for a pure reservation. */
NVRM_FN void *map_low(size_t size, int prot, NvU64 skip_below) {
    for (NvU64 i = 1; i < 16; i++) {
        NvU64 a = i << 36;
        if (a < skip_below) continue;
        void *p = mmap((void *)a, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE,
                       -1, 0);
        if (p == (void *)a) return p;
        if (p != MAP_FAILED) munmap(p, size);
    }
    return NULL;
}

#endif
