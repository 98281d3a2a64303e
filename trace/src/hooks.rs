//! The interposed C symbols. Each hook forwards to the real function exactly once, outside any
//! `catch_unwind`; the tracing around it runs under a thread-local guard (so the tracer's own
//! calls, and calls made while a hook runs, pass straight through) and inside `catch_unwind` (a
//! bug in the tracer must not unwind into C).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulong, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use apex::rm::sys;
use apex_interpose::{
    CUDA_ERROR_STUB_LIBRARY, GpaFn, GpaV2Fn, Guard, errno, install, next, quietly, real, set_errno,
};

use crate::names;
use crate::record::{ChannelRecord, DriverLaunchRecord, IoctlRecord, Record};
use crate::tracer::{self, DISABLED, Node};

/// `None` when tracing must not happen on this thread now (nested call, tracer thread, fork child).
pub(crate) fn enter() -> Option<Guard> {
    if DISABLED.load(Ordering::Relaxed) {
        return None;
    }
    apex_interpose::enter()
}

/// For the tracer's own thread: never trace it.
pub(crate) fn enter_forever() {
    apex_interpose::enter_forever();
}

// ---- real functions ----

type OpenFn = unsafe extern "C" fn(*const c_char, c_int, c_uint) -> c_int;
type OpenAtFn = unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint) -> c_int;
type CloseFn = unsafe extern "C" fn(c_int) -> c_int;
type MmapFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, i64) -> *mut c_void;
type MunmapFn = unsafe extern "C" fn(*mut c_void, usize) -> c_int;
type IoctlFn = unsafe extern "C" fn(c_int, c_ulong, *mut c_void) -> c_int;

real!(real_open, c"open", OpenFn);
real!(real_open64, c"open64", OpenFn);
real!(real_openat, c"openat", OpenAtFn);
real!(real_openat64, c"openat64", OpenAtFn);
real!(real_close, c"close", CloseFn);
real!(real_mmap, c"mmap", MmapFn);
real!(real_mmap64, c"mmap64", MmapFn);
real!(real_munmap, c"munmap", MunmapFn);
real!(real_ioctl, c"ioctl", IoctlFn);

// ---- tracer lifecycle ----

extern "C" fn at_exit() {
    if let Some(_g) = enter() {
        quietly(|| {
            if let Some(t) = tracer::started() {
                t.finish();
            }
        });
    }
}

extern "C" fn in_fork_child() {
    DISABLED.store(true, Ordering::Relaxed);
}

/// Called once when the tracer starts: final poll and summary at exit; no tracing in fork children.
pub(crate) fn on_tracer_start() {
    // SAFETY: registering plain `extern "C" fn()` callbacks.
    unsafe {
        libc::atexit(at_exit);
        libc::pthread_atfork(None, None, Some(in_fork_child));
    }
}

// ---- open / close ----

fn opened(path: *const c_char, fd: c_int) {
    if fd < 0 || path.is_null() {
        return;
    }
    // SAFETY: the C library just opened this NUL-terminated path.
    let node = Node::of_path(unsafe { CStr::from_ptr(path) }.to_bytes());
    tracer::set_fd(fd, node);
    if node.is_nvidia() {
        tracer::get();
    }
}

/// # Safety
/// C `open`: `path` is a NUL-terminated string; `mode` is read as the variadic third argument
/// (on x86-64 it travels in a register either way).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    let Some(real) = real_open() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real(path, flags, mode) };
    if guard.is_some() {
        let e = errno();
        quietly(|| opened(path, fd));
        set_errno(e);
    }
    fd
}

/// # Safety
/// As for [`open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    let Some(real) = real_open64() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real(path, flags, mode) };
    if guard.is_some() {
        let e = errno();
        quietly(|| opened(path, fd));
        set_errno(e);
    }
    fd
}

/// # Safety
/// C `openat`; as for [`open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openat(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    let Some(real) = real_openat() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real(dirfd, path, flags, mode) };
    if guard.is_some() {
        let e = errno();
        quietly(|| opened(path, fd));
        set_errno(e);
    }
    fd
}

/// # Safety
/// As for [`openat`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openat64(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    let Some(real) = real_openat64() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real(dirfd, path, flags, mode) };
    if guard.is_some() {
        let e = errno();
        quietly(|| opened(path, fd));
        set_errno(e);
    }
    fd
}

/// # Safety
/// C `close`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let Some(real) = real_close() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // Forget the fd first: the number may be reused by the next open.
    tracer::set_fd(fd, Node::Unknown);
    // SAFETY: forwarded unchanged.
    unsafe { real(fd) }
}

// ---- mmap / munmap ----

fn do_mmap(
    real: MmapFn,
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    let guard = enter();
    let t = guard.as_ref().and_then(|_| tracer::started());
    // A fixed mapping replaces what was there: hold the poller off while it happens.
    let hold = t
        .filter(|_| flags & libc::MAP_FIXED != 0)
        .map(|t| t.unmapping(addr as u64, len as u64));
    // SAFETY: forwarded unchanged.
    let res = unsafe { real(addr, len, prot, flags, fd, off) };
    drop(hold);
    if guard.is_some() && res != libc::MAP_FAILED && fd >= 0 {
        let e = errno();
        quietly(|| {
            if tracer::fd_node(fd).is_nvidia() {
                tracer::get().mapped(fd, res as u64, len as u64, prot);
            }
        });
        set_errno(e);
    }
    res
}

/// # Safety
/// C `mmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    match real_mmap() {
        Some(real) => do_mmap(real, addr, len, prot, flags, fd, off),
        None => libc::MAP_FAILED,
    }
}

/// # Safety
/// C `mmap64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    match real_mmap64() {
        Some(real) => do_mmap(real, addr, len, prot, flags, fd, off),
        None => libc::MAP_FAILED,
    }
}

/// # Safety
/// C `munmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    let Some(real) = real_munmap() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    let hold = guard
        .as_ref()
        .and_then(|_| tracer::started())
        .map(|t| t.unmapping(addr as u64, len as u64));
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(addr, len) };
    drop(hold);
    r
}

// ---- ioctl ----

/// Reads a `T` the program passed to an ioctl.
///
/// # Safety
/// `p` is null or points at a readable `T` (the ioctl argument the driver just accepted).
unsafe fn read<T>(p: *const c_void) -> Option<T> {
    // SAFETY: per the contract; unaligned because nothing promises alignment.
    (!p.is_null()).then(|| unsafe { std::ptr::read_unaligned(p.cast::<T>()) })
}

/// # Safety
/// C `ioctl`: `arg` is whatever the request expects.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    let Some(real) = real_ioctl() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let guard = enter();
    let node = if guard.is_some() {
        tracer::fd_node(fd)
    } else {
        Node::Other
    };
    if !node.is_nvidia() {
        // SAFETY: forwarded unchanged.
        return unsafe { real(fd, request, arg) };
    }
    let t0 = Instant::now();
    // SAFETY: forwarded unchanged.
    let ret = unsafe { real(fd, request, arg) };
    let dur = t0.elapsed().as_nanos() as u64;
    let e = errno();
    quietly(|| {
        // SAFETY: `arg` is the argument the driver accepted for `request` on an NVIDIA node.
        unsafe { record_ioctl(fd, node, request, arg, ret, e, dur) }
    });
    set_errno(e);
    ret
}

/// # Safety
/// `arg` is the argument of a completed ioctl `request` on NVIDIA node `node`.
unsafe fn record_ioctl(
    fd: c_int,
    node: Node,
    request: u64,
    arg: *mut c_void,
    ret: c_int,
    errno: c_int,
    dur: u64,
) {
    let t = tracer::get();
    let mut r = IoctlRecord {
        t_ns: t.now_ns().saturating_sub(dur),
        dur_ns: dur,
        fd,
        node: node.name(),
        request,
        ret,
        errno: (ret < 0).then_some(errno),
        ..IoctlRecord::default()
    };
    let mut channel = None;
    if node == Node::Uvm {
        r.name = names::uvm_ioctl(request as u32).map(str::to_string);
    } else if (request >> 8) & 0xff == u64::from(sys::NV_IOCTL_MAGIC) {
        let mut nr = (request & 0xff) as u32;
        let mut size = ((request >> 16) & 0x3fff) as usize;
        let mut p: *const c_void = arg;
        if nr == sys::NV_ESC_IOCTL_XFER_CMD {
            // SAFETY: XFER's argument is an nv_ioctl_xfer.
            if let Some(x) = unsafe { read::<sys::nv_ioctl_xfer>(p) } {
                nr = x.cmd;
                size = x.size as usize;
                p = x.ptr;
                r.params.push(("xfer".into(), 1));
            }
        }
        r.name = names::escape(nr).map(str::to_string);
        let mut param = |k: &str, v: u64| r.params.push((k.to_string(), v));
        match nr {
            sys::NV_ESC_RM_ALLOC => {
                // libcuda uses NVOS64; NVOS21 is the shorter legacy form.
                // SAFETY: the escape's argument is an NVOS64 or NVOS21, told apart by size.
                let a = if size >= size_of::<sys::NVOS64_PARAMETERS>() {
                    unsafe { read::<sys::NVOS64_PARAMETERS>(p) }.map(|a| {
                        (
                            a.hRoot,
                            a.hObjectParent,
                            a.hObjectNew,
                            a.hClass,
                            a.pAllocParms,
                            a.paramsSize,
                            a.status,
                        )
                    })
                } else {
                    unsafe { read::<sys::NVOS21_PARAMETERS>(p) }.map(|a| {
                        (
                            a.hRoot,
                            a.hObjectParent,
                            a.hObjectNew,
                            a.hClass,
                            a.pAllocParms,
                            a.paramsSize,
                            a.status,
                        )
                    })
                };
                if let Some((root, parent, new, class, parms, psize, status)) = a {
                    param("hRoot", root.into());
                    param("hObjectParent", parent.into());
                    param("hObjectNew", new.into());
                    param("pAllocParms", parms as u64);
                    param("paramsSize", psize.into());
                    r.class = Some(class);
                    r.class_name = names::class(class).map(str::to_string);
                    r.status = Some(status);
                    if ret == 0 && status == 0 && names::is_gpfifo_class(class) {
                        // SAFETY: a GPFIFO class's allocation parameters are NV_CHANNEL_ALLOC_PARAMS.
                        if let Some(c) = unsafe { read::<sys::NV_CHANNEL_ALLOC_PARAMS>(parms) } {
                            param("gpFifoOffset", c.gpFifoOffset);
                            param("gpFifoEntries", c.gpFifoEntries.into());
                            param("hUserdMemory0", c.hUserdMemory[0].into());
                            param("userdOffset0", c.userdOffset[0]);
                            channel = Some(ChannelRecord {
                                t_ns: t.now_ns(),
                                handle: new,
                                class,
                                class_name: names::class(class).map(str::to_string),
                                gpfifo_va: c.gpFifoOffset,
                                entries: c.gpFifoEntries,
                                userd_handle: c.hUserdMemory[0],
                                userd_offset: c.userdOffset[0],
                            });
                        }
                    }
                }
            }
            sys::NV_ESC_RM_CONTROL => {
                // SAFETY: RM_CONTROL's argument is an NVOS54.
                if let Some(c) = unsafe { read::<sys::NVOS54_PARAMETERS>(p) } {
                    param("hClient", c.hClient.into());
                    param("hObject", c.hObject.into());
                    param("paramsSize", c.paramsSize.into());
                    param("flags", c.flags.into());
                    r.cmd = Some(c.cmd);
                    r.cmd_name = names::ctrl_cmd(c.cmd).map(str::to_string);
                    r.status = Some(c.status);
                }
            }
            sys::NV_ESC_RM_FREE => {
                // SAFETY: RM_FREE's argument is an NVOS00.
                if let Some(f) = unsafe { read::<sys::NVOS00_PARAMETERS>(p) } {
                    param("hRoot", f.hRoot.into());
                    param("hObjectParent", f.hObjectParent.into());
                    param("hObjectOld", f.hObjectOld.into());
                    r.status = Some(f.status);
                }
            }
            sys::NV_ESC_RM_MAP_MEMORY => {
                // SAFETY: RM_MAP_MEMORY's argument is nv_ioctl_nvos33_parameters_with_fd.
                if let Some(m) = unsafe { read::<sys::nv_ioctl_nvos33_parameters_with_fd>(p) } {
                    let q = m.params;
                    param("hClient", q.hClient.into());
                    param("hDevice", q.hDevice.into());
                    param("hMemory", q.hMemory.into());
                    param("offset", q.offset);
                    param("length", q.length);
                    param("flags", q.flags.into());
                    param("fd", m.fd as u64);
                    r.status = Some(q.status);
                    if ret == 0 && q.status == 0 {
                        t.map_requested(m.fd, q.hMemory, q.offset, q.length);
                    }
                }
            }
            sys::NV_ESC_RM_UNMAP_MEMORY => {
                // SAFETY: RM_UNMAP_MEMORY's argument is an NVOS34.
                if let Some(u) = unsafe { read::<sys::NVOS34_PARAMETERS>(p) } {
                    param("hMemory", u.hMemory.into());
                    param("pLinearAddress", u.pLinearAddress as u64);
                    r.status = Some(u.status);
                }
            }
            _ => {}
        }
    }
    t.emit(Record::Ioctl(r));
    if let Some(c) = channel {
        t.channel(c);
    }
}

// ---- dlsym and the CUDA driver API ----

type LaunchFn = apex_interpose::LaunchKernelFn;
type LaunchExFn = unsafe extern "C" fn(
    *const LaunchConfig,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type NameFn = unsafe extern "C" fn(*mut *const c_char, *mut c_void) -> c_int;

/// The leading fields of `CUlaunchConfig`.
#[repr(C)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: *mut c_void,
}

static REAL_GPA: AtomicUsize = AtomicUsize::new(0);
static REAL_GPA_V2: AtomicUsize = AtomicUsize::new(0);
/// Real launch functions: [legacy stream, per-thread stream].
static REAL_LAUNCH: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
static REAL_LAUNCH_EX: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Our replacement for a driver entry point named `name`, after storing the real one `real`.
fn wrap(name: &[u8], real: usize, per_thread: bool) -> Option<usize> {
    let (store, ours): (&AtomicUsize, usize) = match name {
        b"cuGetProcAddress_v2" => (&REAL_GPA_V2, cuGetProcAddress_v2 as *const () as usize),
        b"cuGetProcAddress" => (&REAL_GPA, cuGetProcAddress as *const () as usize),
        b"cuLaunchKernel" if per_thread => {
            (&REAL_LAUNCH[1], cuLaunchKernel_ptsz as *const () as usize)
        }
        b"cuLaunchKernel" => (&REAL_LAUNCH[0], cuLaunchKernel as *const () as usize),
        b"cuLaunchKernel_ptsz" => (&REAL_LAUNCH[1], cuLaunchKernel_ptsz as *const () as usize),
        b"cuLaunchKernelEx" if per_thread => (
            &REAL_LAUNCH_EX[1],
            cuLaunchKernelEx_ptsz as *const () as usize,
        ),
        b"cuLaunchKernelEx" => (&REAL_LAUNCH_EX[0], cuLaunchKernelEx as *const () as usize),
        b"cuLaunchKernelEx_ptsz" => (
            &REAL_LAUNCH_EX[1],
            cuLaunchKernelEx_ptsz as *const () as usize,
        ),
        _ => return crate::calls::wrap(name, real, per_thread),
    };
    install(store, real, ours)
}

/// Interposed so that `dlsym(libcuda, "cuGetProcAddress_v2")` (how cudart finds the driver) and
/// lookups of the launch functions return our wrappers.
///
/// # Safety
/// C `dlsym`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: forwarded unchanged.
    unsafe {
        apex_interpose::forward_dlsym(handle, name, |n, real| {
            (!DISABLED.load(Ordering::Relaxed))
                .then(|| wrap(n, real, false))
                .flatten()
        })
    }
}

/// After a successful `cuGetProcAddress`: our wrapper instead of the driver's function, where we have one.
///
/// # Safety
/// As [`apex_interpose::replace_proc_address`].
unsafe fn cuda_ok_and_replace(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) {
    // SAFETY: forwarded.
    unsafe {
        apex_interpose::replace_proc_address(symbol, pfn, version, flags, |n, real, pt, _| {
            wrap(n, real, pt)
        })
    }
}

/// # Safety
/// `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    let p = next(&REAL_GPA_V2, c"cuGetProcAddress_v2");
    if p == 0 {
        return CUDA_ERROR_STUB_LIBRARY;
    }
    // SAFETY: the driver's cuGetProcAddress_v2.
    let real = unsafe { std::mem::transmute::<usize, GpaV2Fn>(p) };
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(symbol, pfn, version, flags, status) };
    if r == 0 && !DISABLED.load(Ordering::Relaxed) {
        // SAFETY: the driver returned success for these arguments.
        unsafe { cuda_ok_and_replace(symbol, pfn, version, flags) };
    }
    r
}

/// # Safety
/// `cuGetProcAddress` (CUDA 11 signature).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> c_int {
    let p = next(&REAL_GPA, c"cuGetProcAddress");
    if p == 0 {
        return CUDA_ERROR_STUB_LIBRARY;
    }
    // SAFETY: the driver's cuGetProcAddress.
    let real = unsafe { std::mem::transmute::<usize, GpaFn>(p) };
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(symbol, pfn, version, flags) };
    if r == 0 && !DISABLED.load(Ordering::Relaxed) {
        // SAFETY: the driver returned success for these arguments.
        unsafe { cuda_ok_and_replace(symbol, pfn, version, flags) };
    }
    r
}

static NAMES: Mutex<Option<HashMap<usize, Option<String>>>> = Mutex::new(None);

/// The kernel name of a CUfunction (or CUkernel) through the driver's cuFuncGetName /
/// cuKernelGetName, cached.
fn kernel_name(f: *mut c_void) -> Option<String> {
    let mut cache = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if let Some(n) = cache.get(&(f as usize)) {
        return n.clone();
    }
    let lookup = |sym: &CStr| -> Option<String> {
        let p = apex_interpose::libcuda_symbol(sym)?;
        // SAFETY: cuFuncGetName and cuKernelGetName share this signature.
        let get = unsafe { std::mem::transmute::<usize, NameFn>(p) };
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: live out-parameter; the driver validates the handle.
        (unsafe { get(&mut name, f) } == 0 && !name.is_null())
            // SAFETY: the driver returns a NUL-terminated name it owns.
            .then(|| {
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            })
    };
    let n = lookup(c"cuFuncGetName").or_else(|| lookup(c"cuKernelGetName"));
    cache.insert(f as usize, n.clone());
    n
}

#[allow(clippy::too_many_arguments)]
fn launch(
    slot: usize,
    api: &str,
    f: *mut c_void,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    let p = if slot == 0 {
        next(&REAL_LAUNCH[0], c"cuLaunchKernel")
    } else {
        next(&REAL_LAUNCH[1], c"cuLaunchKernel_ptsz")
    };
    if p == 0 {
        return CUDA_ERROR_STUB_LIBRARY;
    }
    // SAFETY: the driver's cuLaunchKernel(_ptsz).
    let real = unsafe { std::mem::transmute::<usize, LaunchFn>(p) };
    // The guard is taken after the call, not across it: the ioctls and mappings libcuda makes inside it (lazy
    // loading) are traced too.
    let t0 = Instant::now();
    // SAFETY: forwarded unchanged.
    let r = unsafe {
        real(
            f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, stream, params,
            extra,
        )
    };
    if let Some(_g) = enter() {
        let dur = t0.elapsed().as_nanos() as u64;
        quietly(|| record_launch(api, f, grid, block, shared, stream, r, dur));
    }
    r
}

#[allow(clippy::too_many_arguments)]
fn record_launch(
    api: &str,
    f: *mut c_void,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: *mut c_void,
    result: c_int,
    dur: u64,
) {
    let t = tracer::get();
    t.emit(Record::DriverLaunch(DriverLaunchRecord {
        t_ns: t.now_ns().saturating_sub(dur),
        dur_ns: dur,
        api: api.to_string(),
        function: f as u64,
        name: kernel_name(f),
        grid,
        block,
        shared_bytes: shared,
        stream: stream as u64,
        result,
    }));
}

macro_rules! launch_kernel {
    ($name:ident, $slot:expr) => {
        /// # Safety
        /// The CUDA driver function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: *mut c_void,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: *mut c_void,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> c_int {
            launch(
                $slot,
                stringify!($name),
                f,
                [gx, gy, gz],
                [bx, by, bz],
                shared,
                stream,
                params,
                extra,
            )
        }
    };
}

launch_kernel!(cuLaunchKernel, 0);
launch_kernel!(cuLaunchKernel_ptsz, 1);

fn launch_ex(
    slot: usize,
    api: &str,
    config: *const LaunchConfig,
    f: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    let p = if slot == 0 {
        next(&REAL_LAUNCH_EX[0], c"cuLaunchKernelEx")
    } else {
        next(&REAL_LAUNCH_EX[1], c"cuLaunchKernelEx_ptsz")
    };
    if p == 0 {
        return CUDA_ERROR_STUB_LIBRARY;
    }
    // SAFETY: the driver's cuLaunchKernelEx(_ptsz).
    let real = unsafe { std::mem::transmute::<usize, LaunchExFn>(p) };
    // As in the cuLaunchKernel hook: the guard is taken after the call.
    let t0 = Instant::now();
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(config, f, params, extra) };
    if let Some(_g) = enter().filter(|_| !config.is_null()) {
        let dur = t0.elapsed().as_nanos() as u64;
        // SAFETY: the driver read the same config; it starts with these fields.
        let c = unsafe { &*config };
        quietly(|| record_launch(api, f, c.grid, c.block, c.shared, c.stream, r, dur));
    }
    r
}

/// # Safety
/// `cuLaunchKernelEx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    launch_ex(0, "cuLaunchKernelEx", config, f, params, extra)
}

/// # Safety
/// `cuLaunchKernelEx_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const LaunchConfig,
    f: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    launch_ex(1, "cuLaunchKernelEx_ptsz", config, f, params, extra)
}
