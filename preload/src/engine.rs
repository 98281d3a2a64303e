//! The preload's state and decisions: the attach, one APEX queue per taken-over stream, the function cache, and
//! the ordering of queues with CUDA streams ([`crate::order`]). Every entry point takes the one lock; hooks call them
//! only from the outermost hook of a thread (never from APEX's own calls into libcuda).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use apex::{
    Arg, Backend, Fence, Gpu, Kernel, LaunchConfig, Module, PreparedLaunch, Queue, VariableHome,
};
use tracing::{debug, info, warn};

use crate::attrs::Extras;
use crate::order::{Hops, Order, Stream, StreamKey, Target};
use crate::registry::{ImageBytes, Owner, Registry};
use crate::stats::Summary;
use crate::{Refusal, check, image};

/// Prepared launch shapes kept per function (the oldest is replaced beyond this).
const PREPARED_PER_FUNCTION: usize = 8;
/// The stack CUDA gives each thread unless the program raises `CU_LIMIT_STACK_SIZE` (APEX's queues start alike).
const DEFAULT_STACK: usize = 1024;

/// Settings from the environment.
#[derive(Clone, Debug)]
struct Config {
    enabled: bool,
    max_queues: usize,
    stats: Option<PathBuf>,
}

impl Config {
    fn from_env() -> Config {
        let enabled = !matches!(
            std::env::var("APEX_PRELOAD").as_deref(),
            Ok("off" | "0" | "false")
        );
        let max_queues = std::env::var("APEX_PRELOAD_QUEUES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8);
        let stats = std::env::var_os("APEX_PRELOAD_STATS").map(PathBuf::from);
        Config {
            enabled,
            max_queues,
            stats,
        }
    }
}

/// Hashes pointer-sized handles with one multiplication (the launch path looks one up per launch).
#[derive(Default)]
struct HandleHasher(u64);

impl Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = (v as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

type Handles<V> = HashMap<usize, V, BuildHasherDefault<HandleHasher>>;

/// A launch as the program made it.
#[derive(Debug)]
pub(crate) struct Launch {
    pub f: usize,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    pub stream: usize,
    pub per_thread: bool,
    pub params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub extras: Result<Extras, Refusal>,
}

/// Where a CUDA operation runs, as a hook sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Site {
    /// A stream handle, and whether the entry point is a per-thread (`_ptsz`/`_ptds`) one.
    Stream(usize, bool),
    /// The whole context.
    Device,
}

/// A prepared launch of one function on one slot's queue.
struct Prepared {
    slot: usize,
    cfg: LaunchConfig,
    launch: Result<PreparedLaunch, Refusal>,
}

/// A function the preload launches itself.
struct Ready {
    kernel: Kernel,
    /// Parameter sizes in order, from the cubin's table.
    sizes: Box<[usize]>,
    owner: Owner,
    prepared: Vec<Prepared>,
}

enum FuncState {
    Ready(Box<Ready>),
    Refused(Refusal),
}

enum Attach {
    NotYet,
    Failed(Refusal),
    Ready { gpu: Gpu, ctx: usize },
}

pub(crate) struct Engine {
    config: Config,
    attach: Attach,
    registry: Registry,
    /// Image errors by module or library handle.
    unreadable: HashMap<usize, String>,
    modules: HashMap<Owner, Result<Module, Refusal>>,
    /// Modules unloaded by the program while APEX launches of theirs may still run: kept until the end.
    retired: Vec<Module>,
    funcs: Handles<FuncState>,
    /// Functions whose attributes the program set to something APEX does not apply.
    func_attrs: Handles<i32>,
    queues: Vec<Option<Queue>>,
    /// The fence of each slot's last launch, for other queues to wait for.
    last: Vec<Option<Fence>>,
    spare: Vec<Queue>,
    order: Order,
    /// Stream handle → blocking (not `CU_STREAM_NON_BLOCKING`).
    blocking: Handles<bool>,
    capturing: HashSet<StreamKey>,
    stack_raised: bool,
    /// Set when the takeover stops for good (an entry point it cannot order with, an internal error, the end).
    off: Option<Refusal>,
    /// The launch path's argument list, reused (empty between launches).
    args: Vec<Arg<'static>>,
    summary: Summary,
    logged: HashSet<(usize, &'static str)>,
    exit_hook: bool,
}

static ENGINE: Mutex<Option<Engine>> = Mutex::new(None);

/// Set in a forked child: its copy of the engine names channels and a CUDA context that are the parent's, so the
/// child forwards everything and never touches them (CUDA itself is unusable in a fork child).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn in_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Runs `f` on the engine (made on first use), under its lock, with panics contained: a panic turns the takeover off.
fn with<R>(f: impl FnOnce(&mut Engine) -> R) -> Option<R> {
    if FORKED.load(Ordering::Relaxed) {
        return None;
    }
    let mut guard: MutexGuard<'_, Option<Engine>> = match ENGINE.lock() {
        Ok(g) => g,
        Err(poisoned) => {
            let mut g = poisoned.into_inner();
            if let Some(e) = g.as_mut() {
                e.off.get_or_insert(Refusal::Internal);
            }
            ENGINE.clear_poison();
            g
        }
    };
    let engine = guard.get_or_insert_with(Engine::new);
    let _busy = crate::watchdog::busy();
    let r = apex_interpose::quietly(|| f(engine));
    if r.is_none() {
        engine.off.get_or_insert(Refusal::Internal);
        warn!("internal error in apex-preload: launches go to libcuda from now on");
    }
    r
}

// ---- the driver functions the engine asks (libcuda's own, never a wrapper) ----

macro_rules! driver_fn {
    ($getter:ident, $name:literal, $ty:ty) => {
        fn $getter() -> Option<$ty> {
            static SLOT: AtomicUsize = AtomicUsize::new(0);
            let mut p = SLOT.load(Ordering::Relaxed);
            if p == 0 {
                p = apex_interpose::libcuda_symbol($name).unwrap_or(0);
                SLOT.store(p, Ordering::Relaxed);
            }
            // SAFETY: libcuda exports this function with this signature.
            (p != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    };
}

driver_fn!(
    cu_ctx_get_current,
    c"cuCtxGetCurrent",
    unsafe extern "C" fn(*mut usize) -> c_int
);
driver_fn!(
    cu_stream_get_flags,
    c"cuStreamGetFlags",
    unsafe extern "C" fn(usize, *mut c_uint) -> c_int
);
driver_fn!(
    cu_func_get_name,
    c"cuFuncGetName",
    unsafe extern "C" fn(*mut *const c_char, usize) -> c_int
);
driver_fn!(
    cu_kernel_get_name,
    c"cuKernelGetName",
    unsafe extern "C" fn(*mut *const c_char, usize) -> c_int
);
driver_fn!(
    cu_func_get_module,
    c"cuFuncGetModule",
    unsafe extern "C" fn(*mut usize, usize) -> c_int
);
driver_fn!(
    cu_kernel_get_library,
    c"cuKernelGetLibrary",
    unsafe extern "C" fn(*mut usize, usize) -> c_int
);

driver_fn!(
    cu_module_get_global,
    c"cuModuleGetGlobal_v2",
    unsafe extern "C" fn(*mut u64, *mut usize, usize, *const c_char) -> c_int
);
driver_fn!(
    cu_library_get_global,
    c"cuLibraryGetGlobal",
    unsafe extern "C" fn(*mut u64, *mut usize, usize, *const c_char) -> c_int
);

/// Where CUDA's instance of module or library `owner` keeps its variable `name`, in the current context.
fn cuda_global(owner: Owner, library: bool, name: &str) -> Option<VariableHome> {
    let get = if library {
        cu_library_get_global()
    } else {
        cu_module_get_global()
    }?;
    let name = std::ffi::CString::new(name).ok()?;
    let (mut address, mut size) = (0u64, 0usize);
    // SAFETY: live out-parameters and a NUL-terminated name; the driver validates the handle.
    let r = unsafe { get(&mut address, &mut size, owner, name.as_ptr()) };
    (r == 0 && address != 0).then_some(VariableHome {
        address,
        size: size as u64,
    })
}

fn current_context() -> Option<usize> {
    let get = cu_ctx_get_current()?;
    let mut ctx = 0usize;
    // SAFETY: a live out-parameter.
    (unsafe { get(&mut ctx) } == 0).then_some(ctx)
}

/// A function's name through `get` (cuFuncGetName or cuKernelGetName).
fn driver_name(
    get: Option<unsafe extern "C" fn(*mut *const c_char, usize) -> c_int>,
    f: usize,
) -> Option<String> {
    let get = get?;
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: a live out-parameter; the driver validates the handle.
    if unsafe { get(&mut name, f) } != 0 || name.is_null() {
        return None;
    }
    // SAFETY: the driver returns a NUL-terminated name it owns.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn driver_owner(
    get: Option<unsafe extern "C" fn(*mut usize, usize) -> c_int>,
    f: usize,
) -> Option<usize> {
    let get = get?;
    let mut h = 0usize;
    // SAFETY: a live out-parameter; the driver validates the handle.
    (unsafe { get(&mut h, f) } == 0 && h != 0).then_some(h)
}

/// The GPU-side hops on the engine's queues.
struct QueueHops<'a> {
    queues: &'a mut [Option<Queue>],
    /// The fence of each slot's last launch.
    last: &'a [Option<Fence>],
}

impl QueueHops<'_> {
    fn queue(&mut self, slot: usize) -> Result<&mut Queue, String> {
        self.queues
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| format!("no queue in slot {slot}"))
    }
}

impl Hops for QueueHops<'_> {
    fn cuda_waits_for_apex(&mut self, slot: usize, stream: StreamKey) -> Result<(), String> {
        let q = self.queue(slot)?;
        // SAFETY: the stream is the program's, live (destroyed streams are handed over and forgotten first).
        unsafe { q.make_cuda_stream_wait(stream.raw() as _) }.map_err(|e| e.to_string())
    }

    fn apex_waits_for_cuda(&mut self, slot: usize, stream: StreamKey) -> Result<(), String> {
        let q = self.queue(slot)?;
        // SAFETY: as above.
        unsafe { q.wait_for_cuda_stream(stream.raw() as _) }.map_err(|e| e.to_string())
    }

    fn apex_waits_for_apex(&mut self, slot: usize, other: usize) -> Result<(), String> {
        let fence = self
            .last
            .get(other)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("no launch on slot {other}"))?;
        self.queue(slot)?.wait_for(fence).map_err(|e| e.to_string())
    }

    fn cpu_sync(&mut self, slot: usize) -> Result<(), String> {
        self.queue(slot)?.synchronize().map_err(|e| e.to_string())
    }
}

extern "C" fn at_exit() {
    // Thread-local destructors have run: nothing below may log through a formatter that uses them.
    crate::exit_safe::exiting();
    if let Some(_g) = apex_interpose::enter() {
        shutdown("the program exits");
    }
}

impl Engine {
    fn new() -> Engine {
        if let Some(level) = std::env::var("APEX_PRELOAD_LOG")
            .ok()
            .and_then(|l| l.parse::<tracing::Level>().ok())
        {
            // The program may have its own subscriber: then this one is not installed.
            let fmt = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_max_level(level)
                .finish();
            let _ = tracing::subscriber::set_global_default(crate::exit_safe::ExitSafe(fmt));
        }
        let config = Config::from_env();
        crate::watchdog::start();
        Engine {
            off: (!config.enabled).then_some(Refusal::Disabled),
            config,
            attach: Attach::NotYet,
            registry: Registry::new(),
            unreadable: HashMap::new(),
            modules: HashMap::new(),
            retired: Vec::new(),
            funcs: Handles::default(),
            func_attrs: Handles::default(),
            queues: Vec::new(),
            last: Vec::new(),
            spare: Vec::new(),
            order: Order::new(),
            blocking: Handles::default(),
            capturing: HashSet::new(),
            stack_raised: false,
            args: Vec::new(),
            summary: Summary {
                attach: "not attempted".into(),
                ..Summary::default()
            },
            logged: HashSet::new(),
            exit_hook: false,
        }
    }

    fn stream(&mut self, raw: usize, per_thread: bool) -> Stream {
        let key = StreamKey::of(raw, per_thread);
        let blocking = match key {
            StreamKey::Legacy | StreamKey::PerThread => true,
            StreamKey::Handle(h) => *self.blocking.entry(h).or_insert_with(|| {
                let mut flags: c_uint = 0;
                // SAFETY: a live out-parameter; the driver validates the handle. Unknown: taken as blocking, which
                // relates it to more streams (more hops, never fewer).
                cu_stream_get_flags()
                    .is_none_or(|get| unsafe { get(h, &mut flags) } != 0 || flags & 1 == 0)
            }),
        };
        Stream { key, blocking }
    }

    fn target(&mut self, site: Site) -> Target {
        match site {
            Site::Stream(raw, pt) => Target::Stream(self.stream(raw, pt)),
            Site::Device => Target::Device,
        }
    }

    fn before(&mut self, site: Site) {
        if self.order.live() == 0 {
            return;
        }
        let target = self.target(site);
        let mut hops = QueueHops {
            queues: &mut self.queues,
            last: &self.last,
        };
        if let Err(e) = self.order.before_cuda(target, &mut hops) {
            warn!(error = %e, "cannot order a CUDA operation after APEX's queue");
        }
    }

    fn after(&mut self, site: Site) {
        if self.order.live() == 0 {
            return;
        }
        if let Site::Stream(raw, pt) = site {
            let s = self.stream(raw, pt);
            self.order.after_cuda(s);
        }
    }

    fn ensure_attached(&mut self) -> Result<(&Gpu, usize), Refusal> {
        if let Attach::NotYet = self.attach {
            if !self.exit_hook {
                // Registered after the CUDA runtime's own exit handler, so it runs before the context goes away.
                // SAFETY: plain `extern "C" fn()` callbacks.
                unsafe {
                    libc::atexit(at_exit);
                    libc::pthread_atfork(None, None, Some(in_fork_child));
                }
                self.exit_hook = true;
            }
            self.attach = match (Gpu::attach_cuda(), current_context()) {
                (Ok(gpu), Some(ctx)) if gpu.backend() == Backend::Direct => {
                    info!(selection = %gpu.selection(), "apex-preload attached to the CUDA context");
                    self.summary.attach = "direct".into();
                    Attach::Ready { gpu, ctx }
                }
                (Ok(gpu), _) => {
                    let r = Refusal::DriverBackend(gpu.selection().to_string());
                    self.summary.attach = r.to_string();
                    Attach::Failed(r)
                }
                (Err(e), _) => {
                    let r = Refusal::AttachFailed(e.to_string());
                    warn!(reason = %r, "apex-preload leaves every launch to libcuda");
                    self.summary.attach = r.to_string();
                    Attach::Failed(r)
                }
            };
        }
        match &self.attach {
            Attach::Ready { gpu, ctx } => Ok((gpu, *ctx)),
            Attach::Failed(r) => Err(r.clone()),
            Attach::NotYet => Err(Refusal::Internal),
        }
    }

    /// The image an owner's kernels come from, loaded by APEX once.
    fn module(&mut self, owner: Owner) -> Result<Module, Refusal> {
        if let Some(m) = self.modules.get(&owner) {
            return m.clone();
        }
        let image = self.registry.image(owner).ok_or(Refusal::UnknownModule)?;
        let library = self.registry.is_library(owner);
        let (gpu, _) = self.ensure_attached()?;
        // The module's `__device__` variables are CUDA's instance's: kernels on both sides share them.
        let unplaced = std::cell::RefCell::new(Vec::new());
        let place = |name: &str, size: u64| {
            let home = cuda_global(owner, library, name)
                // The same variable in both instances: the sizes agree.
                .filter(|h| h.size == size);
            if home.is_none() {
                unplaced.borrow_mut().push(name.to_string());
            }
            home
        };
        let loaded = gpu
            .load_module_sharing(image.bytes(), &place)
            .map_err(|e| Refusal::ModuleRefused(e.to_string()))
            .and_then(|m| {
                if let Some(name) = unplaced.borrow().first() {
                    return Err(Refusal::ModuleGlobals(name.clone()));
                }
                match m.cubin().and_then(check::module_refusal) {
                    Some(r) => Err(r),
                    None => Ok(m),
                }
            });
        if loaded.is_ok() {
            self.summary.modules_loaded += 1;
        }
        debug!(
            owner = format_args!("{owner:#x}"),
            ok = loaded.is_ok(),
            "module loaded for APEX"
        );
        self.modules.insert(owner, loaded.clone());
        loaded
    }

    fn resolve(&mut self, f: usize) -> Result<Ready, Refusal> {
        if let Some(&attr) = self.func_attrs.get(&f) {
            return Err(Refusal::FunctionAttribute(attr));
        }
        let origin = match self.registry.origin(f) {
            Some(o) => o.clone(),
            None => {
                // A handle the program got some other way (enumeration, cudart's own lookups): ask the driver.
                let name = driver_name(cu_func_get_name(), f)
                    .or_else(|| driver_name(cu_kernel_get_name(), f))
                    .ok_or(Refusal::UnknownFunction)?;
                let handle = driver_owner(cu_func_get_module(), f)
                    .filter(|&m| self.registry.owner(m).is_some())
                    .or_else(|| driver_owner(cu_kernel_get_library(), f))
                    .ok_or(Refusal::UnknownFunction)?;
                if let Some(e) = self.unreadable.get(&handle) {
                    return Err(Refusal::UnreadableImage(e.clone()));
                }
                self.registry.function(f, handle, &name);
                self.registry
                    .origin(f)
                    .cloned()
                    .ok_or(Refusal::UnknownModule)?
            }
        };
        let module = self.module(origin.owner)?;
        // `__device__` variables are shared with CUDA's instance; `__constant__` ones are APEX's own copy, which a
        // write through the address the program took would miss.
        let constant_escaped = self.registry.escaped(origin.owner).iter().any(|name| {
            name.as_deref()
                .and_then(|n| module.cubin().and_then(|c| c.global(n)))
                .is_none_or(|g| g.is_constant())
        });
        if constant_escaped {
            return Err(Refusal::GlobalsEscaped);
        }
        let kernel = module
            .kernel(&origin.name)
            .map_err(|e| Refusal::KernelRefused(e.to_string()))?;
        let info = kernel
            .info()
            .ok_or_else(|| Refusal::KernelRefused("no parameter table".into()))?;
        if let Some(r) = check::kernel_refusal(info) {
            return Err(r);
        }
        let sizes = info.params.iter().map(|p| p.size as usize).collect();
        Ok(Ready {
            kernel,
            sizes,
            owner: origin.owner,
            prepared: Vec::new(),
        })
    }

    /// The slot (and queue) of a stream, taking it over on first use.
    fn slot_for(&mut self, key: StreamKey, stream: Stream) -> Result<usize, Refusal> {
        if let Some(s) = self.order.find(key) {
            return Ok(s);
        }
        if self.order.live() >= self.config.max_queues {
            return Err(Refusal::TooManyStreams(self.config.max_queues));
        }
        let queue = match self.spare.pop() {
            Some(q) => q,
            None => {
                let (gpu, _) = self.ensure_attached()?;
                let q = gpu
                    .queue()
                    .map_err(|e| Refusal::QueueFailed(e.to_string()))?;
                self.summary.queues += 1;
                q
            }
        };
        let slot = self.order.add(stream);
        if self.queues.len() <= slot {
            self.queues.resize_with(slot + 1, || None);
            self.last.resize_with(slot + 1, || None);
        }
        self.queues[slot] = Some(queue);
        self.last[slot] = None;
        info!(stream = ?key, slot, "stream taken over by an APEX queue");
        Ok(slot)
    }

    fn try_launch(&mut self, l: &Launch) -> Result<(), Refusal> {
        if let Some(r) = &self.off {
            return Err(r.clone());
        }
        if !self.capturing.is_empty() {
            return Err(Refusal::Capturing);
        }
        let extras = l.extras.clone()?;
        let key = StreamKey::of(l.stream, l.per_thread);
        if key == StreamKey::PerThread {
            return Err(Refusal::PerThreadStream);
        }
        if !l.extra.is_null() {
            return Err(Refusal::ExtraParams);
        }
        if self.stack_raised {
            return Err(Refusal::ContextLimit);
        }
        let (_, ctx) = self.ensure_attached()?;
        if current_context() != Some(ctx) {
            return Err(Refusal::OtherContext);
        }
        if !self.funcs.contains_key(&l.f) {
            let state = match self.resolve(l.f) {
                Ok(r) => FuncState::Ready(Box::new(r)),
                Err(r) if r.is_per_function() => FuncState::Refused(r),
                // Not the function's fault (the attach, an internal error): decided again next time.
                Err(r) => return Err(r),
            };
            self.funcs.insert(l.f, state);
        }
        let stream = self.stream(l.stream, l.per_thread);
        let slot = self.slot_for(key, stream)?;
        let Engine {
            funcs,
            queues,
            last,
            order,
            args,
            ..
        } = self;
        let ready = match funcs.get_mut(&l.f) {
            Some(FuncState::Ready(r)) => r,
            Some(FuncState::Refused(r)) => return Err(r.clone()),
            None => return Err(Refusal::Internal),
        };
        if l.params.is_null() && !ready.sizes.is_empty() {
            return Err(Refusal::ExtraParams);
        }
        let cfg = LaunchConfig {
            grid: l.grid,
            block: l.block,
            shared_bytes: l.shared,
            cluster: extras.cluster,
        };
        let queue = queues
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or(Refusal::Internal)?;
        let prepared = if extras.cooperative {
            None
        } else {
            let i = match ready
                .prepared
                .iter()
                .position(|p| p.slot == slot && p.cfg == cfg)
            {
                Some(i) => i,
                None => {
                    if ready.prepared.len() >= PREPARED_PER_FUNCTION {
                        ready.prepared.remove(0);
                    }
                    let launch = queue
                        .prepare(&ready.kernel, &cfg)
                        .map_err(|e| Refusal::LaunchRefused(e.to_string()));
                    ready.prepared.push(Prepared { slot, cfg, launch });
                    ready.prepared.len() - 1
                }
            };
            Some(ready.prepared[i].launch.as_ref().map_err(Clone::clone)?)
        };
        // The arguments: one pointer per parameter, each to a value of the parameter's size.
        args.clear();
        for (i, &size) in ready.sizes.iter().enumerate() {
            // SAFETY: the driver API passes one pointer per kernel parameter in `kernelParams`; the parameter table
            // says how many there are.
            let p = unsafe { *l.params.add(i) } as *const u8;
            if p.is_null() {
                args.clear();
                return Err(Refusal::ExtraParams);
            }
            // SAFETY: the program passes a value of the parameter's size at `p`, readable during this call; the
            // slice is removed from `args` before this function returns, so the 'static it is given never escapes.
            args.push(Arg::Bytes(unsafe { std::slice::from_raw_parts(p, size) }));
        }
        let mut hops = QueueHops {
            queues,
            last: last.as_slice(),
        };
        if let Err(e) = order.before_apex(slot, &mut hops) {
            args.clear();
            return Err(Refusal::LaunchFailed(format!(
                "ordering with the CUDA stream: {e}"
            )));
        }
        let queue = hops.queue(slot).map_err(|_| Refusal::Internal)?;
        // SAFETY: the program launches this kernel with these arguments on this stream; CUDA would run it the same
        // way, and the queue is ordered with the stream.
        let result = unsafe {
            match prepared {
                Some(p) if extras.programmatic => queue.launch_prepared_programmatic(p, args),
                Some(p) => queue.launch_prepared(p, args),
                // A cooperative launch runs in plain stream order, which programmatic serialization allows.
                None => queue.launch_cooperative(&ready.kernel, &cfg, args),
            }
        };
        args.clear();
        match result {
            Ok(fence) => {
                order.after_apex(slot);
                if let Some(l) = last.get_mut(slot) {
                    *l = Some(fence);
                }
                Ok(())
            }
            Err(e) => Err(Refusal::LaunchFailed(e.to_string())),
        }
    }

    fn launch(&mut self, l: &Launch) -> bool {
        match self.try_launch(l) {
            Ok(()) => {
                self.summary.taken();
                true
            }
            Err(r) => {
                if self.logged.insert((l.f, r.label())) {
                    info!(function = format_args!("{:#x}", l.f), reason = %r, "launch left to libcuda");
                }
                self.summary.refused(&r);
                false
            }
        }
    }

    fn loaded(&mut self, owner: usize, image: Result<ImageBytes, String>, library: bool) {
        self.summary.modules_seen += 1;
        self.forget_owner(owner);
        match image {
            Ok(bytes) => {
                self.unreadable.remove(&owner);
                self.registry.loaded(owner, bytes, library);
            }
            Err(e) => {
                debug!(owner = format_args!("{owner:#x}"), error = %e, "module image not readable");
                self.unreadable.insert(owner, e);
            }
        }
    }

    /// Drops everything cached for `owner` (unloaded, or a handle reused by a new load).
    fn forget_owner(&mut self, owner: Owner) {
        if let Some(Ok(m)) = self.modules.remove(&owner) {
            self.retired.push(m);
        }
        // Refusals are cheap to recompute; any of them may name a reused handle.
        self.funcs
            .retain(|_, s| matches!(s, FuncState::Ready(r) if r.owner != owner));
    }

    fn unloaded(&mut self, handle: usize) {
        self.unreadable.remove(&handle);
        if let Some(owner) = self.registry.unloaded(handle) {
            self.forget_owner(owner);
        }
    }

    fn escape(&mut self, handle: usize, name: Option<String>) {
        self.registry.escape(handle, name);
        if let Some(owner) = self.registry.owner(handle) {
            self.funcs
                .retain(|_, s| !matches!(s, FuncState::Ready(r) if r.owner == owner));
        }
    }

    fn stream_destroyed(&mut self, raw: usize) {
        let key = StreamKey::of(raw, false);
        if let Some(slot) = self.order.find(key) {
            self.order.remove(slot);
            for s in self.funcs.values_mut() {
                if let FuncState::Ready(r) = s {
                    r.prepared.retain(|p| p.slot != slot);
                }
            }
            if let Some(q) = self.queues.get_mut(slot).and_then(Option::take) {
                self.spare.push(q);
            }
        }
        self.blocking.remove(&raw);
    }

    fn shutdown(&mut self, why: &str) {
        self.before(Site::Device);
        for q in self
            .queues
            .iter_mut()
            .flatten()
            .chain(self.spare.iter_mut())
        {
            if let Err(e) = q.synchronize() {
                warn!(error = %e, "an APEX queue did not drain at shutdown");
            }
        }
        let counts = self.order.counts();
        self.summary.hops(counts);
        self.summary.modules_seen = self.summary.modules_seen.max(self.registry.len() as u64);
        if let Some(path) = &self.config.stats {
            match serde_json::to_vec_pretty(&self.summary) {
                Ok(json) => {
                    if let Err(e) = std::fs::write(path, json) {
                        warn!(path = %path.display(), error = %e, "cannot write the apex-preload summary");
                    }
                }
                Err(e) => warn!(error = %e, "cannot encode the apex-preload summary"),
            }
        }
        info!(
            why,
            launches = self.summary.launches,
            apex = self.summary.apex,
            fallback = self.summary.fallback,
            "apex-preload stops"
        );
        // Queues and modules go before the context does.
        self.funcs.clear();
        self.last.clear();
        self.queues.clear();
        self.spare.clear();
        self.order = Order::new();
        self.modules.clear();
        self.retired.clear();
        self.attach = Attach::Failed(Refusal::AttachFailed(format!(
            "apex-preload stopped: {why}"
        )));
        self.off = Some(Refusal::Disabled);
    }
}

// ---- the entry points the hooks call ----

/// Launches through APEX if it can; `false` when the caller must forward the launch to libcuda (ordered by
/// [`before`] and [`after`] like any CUDA operation).
pub(crate) fn launch(l: &Launch) -> bool {
    with(|e| e.launch(l)).unwrap_or(false)
}

/// A launch made through an entry point the preload always leaves to libcuda.
pub(crate) fn refused(why: Refusal) {
    with(|e| e.summary.refused(&why));
}

/// Before a CUDA operation at `site`: related queues' work is handed to CUDA.
pub(crate) fn before(site: Site) {
    with(|e| e.before(site));
}

/// After a CUDA operation that added work at `site`.
pub(crate) fn after(site: Site) {
    with(|e| e.after(site));
}

/// A module or library was loaded from the image at `p`.
pub(crate) fn loaded(owner: usize, p: *const u8, library: bool) {
    // SAFETY: the driver accepted `p` as a module image.
    let image = unsafe { image::locate(p) }
        .map_err(|e| e.to_string())
        .map(|(start, len, _)| {
            let mut info = libc::Dl_info {
                dli_fname: std::ptr::null(),
                dli_fbase: std::ptr::null_mut(),
                dli_sname: std::ptr::null(),
                dli_saddr: std::ptr::null_mut(),
            };
            // SAFETY: dladdr only reads the loader's tables.
            let mapped =
                unsafe { libc::dladdr(start.cast(), &mut info) } != 0 && !info.dli_fname.is_null();
            // SAFETY: `locate` measured `len` readable bytes at `start`.
            let bytes: &'static [u8] = unsafe { std::slice::from_raw_parts(start, len) };
            if mapped {
                ImageBytes::Mapped(bytes)
            } else {
                ImageBytes::Owned(bytes.into())
            }
        });
    with(|e| e.loaded(owner, image, library));
}

/// A module or library was loaded from the file `path`.
pub(crate) fn loaded_file(owner: usize, path: *const c_char, library: bool) {
    if path.is_null() {
        return;
    }
    // SAFETY: the driver accepted it as a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(path) }
        .to_string_lossy()
        .into_owned();
    let image = std::fs::read(&path)
        .map(|b| ImageBytes::Owned(b.into_boxed_slice()))
        .map_err(|e| format!("{path}: {e}"));
    with(|e| e.loaded(owner, image, library));
}

/// A module or library was unloaded.
pub(crate) fn unloaded(handle: usize) {
    with(|e| e.unloaded(handle));
}

/// `function` is kernel `name` of module or library `handle`.
pub(crate) fn function(function: usize, handle: usize, name: *const c_char) {
    if name.is_null() {
        return;
    }
    // SAFETY: the driver accepted it as a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    with(|e| e.registry.function(function, handle, &name));
}

/// `function` is the same kernel as `kernel`.
pub(crate) fn same_function(function: usize, kernel: usize) {
    with(|e| e.registry.same_function(function, kernel));
}

/// `module` is `library`'s.
pub(crate) fn library_module(module: usize, library: usize) {
    with(|e| e.registry.library_module(module, library));
}

/// The program took the address of a global of module or library `handle`.
pub(crate) fn escape(handle: usize, name: *const c_char) {
    let name = (!name.is_null()).then(|| {
        // SAFETY: the driver accepted it as a NUL-terminated name.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    });
    with(|e| e.escape(handle, name));
}

/// `cuFuncSetAttribute` / `cuKernelSetAttribute` on `f`.
pub(crate) fn func_attribute(f: usize, attr: c_int) {
    // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8) and _PREFERRED_SHARED_MEMORY_CARVEOUT (9) change nothing
    // APEX checks differently; cluster shapes and policies (10-14) and anything newer do.
    if attr == 8 || attr == 9 {
        return;
    }
    with(|e| {
        e.func_attrs.insert(f, attr);
        e.funcs.remove(&f);
    });
}

/// `cuCtxSetLimit`.
pub(crate) fn limit(limit: c_int, value: usize) {
    // CU_LIMIT_STACK_SIZE
    if limit == 0 && value > DEFAULT_STACK {
        with(|e| e.stack_raised = true);
    }
}

/// A stream was destroyed (its work was handed to CUDA before).
pub(crate) fn stream_destroyed(raw: usize) {
    with(|e| e.stream_destroyed(raw));
}

/// A stream capture began (`true`) or ended on the stream at `site`.
pub(crate) fn capture(raw: usize, per_thread: bool, begins: bool) {
    with(|e| {
        let key = StreamKey::of(raw, per_thread);
        if begins {
            e.capturing.insert(key);
        } else {
            e.capturing.remove(&key);
        }
    });
}

/// The program asked for a driver entry point in a variant the preload does not interpose: hand everything to CUDA
/// and stop taking launches over.
pub(crate) fn unknown_entry(name: &str) {
    with(|e| {
        e.before(Site::Device);
        if e.off.is_none() {
            warn!(
                entry = name,
                "unknown driver entry point variant: apex-preload stops taking launches over"
            );
            e.off = Some(Refusal::UnknownEntryPoint(name.to_string()));
        }
    });
}

/// Hands everything to CUDA, drains the queues, writes the summary and drops APEX's objects (before the CUDA context
/// goes away: at exit, or before `cuCtxDestroy`/`cuDevicePrimaryCtxReset`).
pub(crate) fn shutdown(why: &str) {
    with(|e| e.shutdown(why));
}
