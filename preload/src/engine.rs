//! The preload's state and decisions: one attachment per CUDA context, one APEX queue per taken-over stream, the
//! function cache, the ordering of queues with CUDA streams ([`crate::order`]), synchronizations answered from APEX's
//! fences, events recorded after APEX's work, and device asserts. Every entry point takes the one lock; hooks call
//! them only from the outermost hook of a thread (never from APEX's own calls into libcuda).
//!
//! The launch path is one lock, one `cuCtxGetCurrent`, three lookups (context, function, stream) and APEX's
//! prepared launch, which returns a ticket rather than a reference-counted fence.

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use apex::{
    Arg, Backend, Fence, Gpu, Kernel, LaunchConfig, LaunchMemory, Module, PreparedLaunch, Queue,
    QueueOptions, Ticket,
};
use tracing::{debug, info, warn};

use crate::attrs::Extras;
use crate::cuda::{
    CUDA_ERROR_ASSERT, CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CudaSide, Libcuda, Pointer,
};
use crate::lock::StoreLock;
use crate::order::{Hops, Order, Stream, StreamKey, Target};
use crate::registry::{ImageBytes, Owner, Registry};
use crate::stats::Summary;
use crate::{Refusal, check, image};

/// Prepared launch shapes kept per function (the least recently used is replaced beyond this).
const PREPARED_PER_FUNCTION: usize = 16;
/// The stack CUDA gives each thread unless the program raises `CU_LIMIT_STACK_SIZE` (APEX's queues start alike).
const DEFAULT_STACK: usize = 1024;
/// How long one CPU wait on a queue looks before it checks again (a synchronize waits as long as the work runs).
const WAIT_SLICE: Duration = Duration::from_secs(3600);
/// Copies between the host and the device up to this size run on the stream's queue (the `.item()` and small
/// upload patterns); larger ones go to libcuda, whose copy engines and pinned staging suit them. Copies between
/// device buffers run on the queue at any size.
pub(crate) const COPY_MAX: usize = 256 << 10;
/// Each context's pinned staging ring for copies from and to pageable host memory.
const STAGING_BYTES: u64 = 1 << 20;

/// Settings from the environment.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub enabled: bool,
    pub max_queues: usize,
    pub stats: Option<PathBuf>,
    /// Where the queues keep their rings and launch slots (`APEX_PRELOAD_LAUNCH_MEMORY=video|host`).
    pub launch_memory: LaunchMemory,
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
        let launch_memory = match std::env::var("APEX_PRELOAD_LAUNCH_MEMORY").as_deref() {
            Ok("host") => LaunchMemory::Host,
            _ => LaunchMemory::Video,
        };
        Config {
            enabled,
            max_queues,
            stats,
            launch_memory,
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

/// Which way a program's copy goes, as its entry point says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyDir {
    /// `cuMemcpyDtoH*`.
    DeviceToHost,
    /// `cuMemcpyHtoD*`.
    HostToDevice,
    /// `cuMemcpyDtoD*`.
    DeviceToDevice,
    /// `cuMemcpy` / `cuMemcpyAsync`: told by the pointers.
    Any,
}

/// A copy the program asked for (`cuMemcpy*`), which the engine may run on the stream's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyOp {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub site: Site,
    pub dir: CopyDir,
    /// The synchronous entry point (`cuMemcpyDtoH`, not `...Async`): it returns once the copy is done, except from
    /// pageable host memory to the device, which returns once the data is staged (as CUDA does).
    pub blocking: bool,
}

/// A memset the program asked for (`cuMemsetD8/16/32*`), which the engine may run on the stream's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SetOp {
    pub dst: u64,
    pub value: u32,
    /// Bytes per element: 1, 2 or 4.
    pub width: u32,
    pub count: usize,
    pub site: Site,
}

/// How the engine runs a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CopyPlan {
    /// Between two GPU addresses (device memory, pinned host memory's device pointer).
    Direct { src: u64, dst: u64 },
    /// Device memory to pageable host memory, through the staging ring (waited for, then read by the CPU).
    StageOut { src: u64 },
    /// Pageable host memory to device memory, through the staging ring (written by the CPU first).
    StageIn { dst: u64 },
}

impl CopyPlan {
    fn new(dir: CopyDir, src: Pointer, dst: Pointer, op: &CopyOp) -> Option<CopyPlan> {
        let n = op.bytes as u64;
        let host = matches!(src, Pointer::Pinned { .. } | Pointer::Pageable)
            || matches!(dst, Pointer::Pinned { .. } | Pointer::Pageable);
        if host && op.bytes > COPY_MAX {
            return None;
        }
        let fits = |p: Pointer| match p {
            Pointer::Device { bytes } | Pointer::Pinned { bytes, .. } => bytes >= n,
            Pointer::Pageable => true,
            Pointer::Other => false,
        };
        if !fits(src) || !fits(dst) {
            return None;
        }
        let to_host = matches!(dir, CopyDir::DeviceToHost | CopyDir::Any);
        let to_device = matches!(dir, CopyDir::HostToDevice | CopyDir::Any);
        let between = matches!(dir, CopyDir::DeviceToDevice | CopyDir::Any);
        match (src, dst) {
            // Between device buffers at any size: the SMs copy at the HBM's bandwidth.
            (Pointer::Device { .. }, Pointer::Device { .. }) if between => Some(CopyPlan::Direct {
                src: op.src,
                dst: op.dst,
            }),
            (Pointer::Device { .. }, Pointer::Pinned { device, .. }) if to_host => {
                Some(CopyPlan::Direct {
                    src: op.src,
                    dst: device,
                })
            }
            (Pointer::Device { .. }, Pointer::Pageable) if to_host => {
                Some(CopyPlan::StageOut { src: op.src })
            }
            (Pointer::Pinned { device, .. }, Pointer::Device { .. }) if to_device => {
                Some(CopyPlan::Direct {
                    src: device,
                    dst: op.dst,
                })
            }
            (Pointer::Pageable, Pointer::Device { .. }) if to_device => {
                Some(CopyPlan::StageIn { dst: op.dst })
            }
            _ => None,
        }
    }
}

/// A context's pinned staging memory for copies from and to pageable host memory: a ring used in laps; each lap
/// starts once every copy of the last one is complete.
struct Staging {
    buffer: apex::HostBuffer,
    head: u64,
    /// Copies in flight that read or write the ring.
    inflight: Vec<Fence>,
}

impl Staging {
    /// `bytes` of the ring for the next copy (at most [`STAGING_BYTES`]).
    fn take(&mut self, bytes: u64) -> Result<u64, String> {
        let bytes = bytes.next_multiple_of(64);
        if self.head + bytes > self.buffer.size() {
            // Every copy of the lap is waited for, also after one fails (they may still read the ring).
            let mut failed = None;
            for f in self.inflight.drain(..) {
                if let Err(e) = wait_fence(&f) {
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            self.head = 0;
        }
        let at = self.head;
        self.head += bytes;
        self.inflight.retain(|f| !f.is_done());
        Ok(at)
    }
}

/// What a synchronizing hook asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SyncKind {
    /// `cuStreamSynchronize`: wait.
    Wait,
    /// `cuStreamQuery`: look.
    Query,
}

/// What the engine made of a call: answered (the hook returns this code without calling libcuda), or libcuda must
/// run it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Return this `CUresult`; libcuda is not called.
    Done(c_int),
    /// Call libcuda.
    Forward,
}

/// What the first step of a synchronization decided: the answer, or the fences to wait for first.
pub(crate) enum Step {
    /// Answered (or to be answered by libcuda) without waiting.
    Answer(Answer),
    /// Wait for these, outside the engine's lock, then take the last step.
    Wait(Waits),
}

/// Fences of one context's queues to wait for outside the engine's lock.
pub(crate) struct Waits {
    /// The context's index, and its handle (checked again after the wait).
    ctx: usize,
    handle: usize,
    /// (slot, the fence of its last launch when the wait began).
    items: Vec<(usize, Fence)>,
}

impl Waits {
    /// Waits for every fence (as long as the work runs), without draining the printf FIFO.
    pub(crate) fn wait(&self) -> Result<(), String> {
        for (_, f) in &self.items {
            wait_fence(f)?;
        }
        Ok(())
    }
}

/// Where a queue's last launch stands, looked at without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Done,
    Running,
    /// The queue's channel faulted: libcuda must answer (with the context's error).
    Failed,
}

/// Where the work before `fence` stands: complete, running, or never to complete (a fault).
fn fence_state(fence: &Fence) -> SlotState {
    if fence.is_done() {
        return SlotState::Done;
    }
    let Some(f) = fence.direct() else {
        return SlotState::Running;
    };
    // A zero-length wait looks at the channel's error notifier as well.
    match f.wait(Duration::ZERO) {
        Ok(()) => SlotState::Done,
        Err(apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })) => {
            SlotState::Running
        }
        Err(_) => SlotState::Failed,
    }
}

/// Set when a failed assert could not be replayed through libcuda: every call through the preload then answers
/// this (`CUDA_ERROR_ASSERT`), as libcuda's failed context would.
pub(crate) static STICKY: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The sticky error the preload answers every call with, if any.
pub(crate) fn sticky() -> Option<c_int> {
    match STICKY.load(Ordering::Relaxed) {
        0 => None,
        e => Some(e),
    }
}

/// A prepared launch of one function on one slot's queue.
struct Prepared {
    slot: usize,
    cfg: LaunchConfig,
    launch: Result<PreparedLaunch, Refusal>,
}

/// A function the preload launches itself, in one context.
struct Ready {
    kernel: Kernel,
    /// Parameter sizes in order, from the cubin's table.
    sizes: Box<[usize]>,
    owner: Owner,
    /// Most recently used first.
    prepared: Vec<Prepared>,
}

enum FuncState {
    Ready(Box<Ready>),
    Refused(Refusal),
}

/// A queue's last launch: a ticket (plain launches, no reference count) or a fence.
enum Last {
    Ticket(Ticket),
    Fence(Fence),
}

impl Last {
    fn fence(&self, q: &Queue) -> Result<Fence, String> {
        match self {
            Last::Ticket(t) => q.fence(*t).map_err(|e| e.to_string()),
            Last::Fence(f) => Ok(f.clone()),
        }
    }
}

/// An event the program recorded after a queue's work, kept by the preload instead of libcuda until something
/// only libcuda can answer needs it.
struct VirtualEvent {
    slot: usize,
    /// The queue's last launch when the event was recorded.
    fence: Fence,
}

/// APEX inside one CUDA context.
struct Ctx {
    handle: usize,
    gpu: Gpu,
    /// Failed asserts end their thread, so kernels that call `__assertfail` run on APEX.
    asserts_on_apex: bool,
    modules: HashMap<Owner, Result<Module, Refusal>>,
    /// Modules unloaded by the program while APEX launches of theirs may still run: kept until the end.
    retired: Vec<Module>,
    funcs: Handles<FuncState>,
    queues: Vec<Option<Queue>>,
    /// Each slot's last launch.
    last: Vec<Option<Last>>,
    spare: Vec<Queue>,
    order: Order,
    /// Stream handle → blocking (not `CU_STREAM_NON_BLOCKING`).
    blocking: Handles<bool>,
    events: Handles<VirtualEvent>,
    /// The preload's own stream for recording events (0 until first used).
    side: usize,
    /// Pinned memory for copies from and to pageable host memory (made on first use).
    staging: Option<Staging>,
    /// CUDA work was submitted in this context since its last `cuCtxSynchronize` (launches left to libcuda, copies,
    /// hops): a context synchronize must then reach libcuda.
    cuda_work: bool,
    /// Set when APEX stops in this context (a replayed assert, a fault): launches go to libcuda.
    failed: Option<Refusal>,
    /// Bumped by every piece of work submitted in the context (APEX's or CUDA's): a synchronization through libcuda
    /// clears what it completed only if no work came in while it ran (from another thread).
    epoch: u64,
}

pub(crate) struct Engine {
    config: Config,
    cuda: Box<dyn CudaSide>,
    registry: Registry,
    /// Image errors by module or library handle.
    unreadable: HashMap<usize, String>,
    /// Functions whose attributes the program set to something APEX does not apply.
    func_attrs: Handles<i32>,
    contexts: Vec<Ctx>,
    /// The context of the last launch (an index into `contexts`).
    recent: usize,
    /// Contexts APEX could not attach to, and why.
    unattached: Handles<Refusal>,
    /// Event handle → created with `CU_EVENT_DISABLE_TIMING` (only those are recorded by the preload itself).
    event_untimed: Handles<bool>,
    /// Streams being captured into a CUDA graph.
    capturing: HashSet<StreamKey>,
    stack_raised: bool,
    /// Set when the takeover stops for good (an entry point it cannot order with, an internal error, the end).
    off: Option<Refusal>,
    /// The launch path's argument list, reused (empty between launches).
    args: Vec<Arg<'static>>,
    summary: Summary,
    /// `APEX_PRELOAD_PROFILE`'s sums.
    phases: crate::profile::Phases,
    logged: HashSet<(usize, &'static str)>,
    exit_hook: bool,
}

static ENGINE: StoreLock<Option<Engine>> = StoreLock::new(None);

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
    // A panic inside `f` is contained below and turns the takeover off: there is no poisoning to undo.
    let mut guard = ENGINE.lock();
    let engine = guard.get_or_insert_with(|| Engine::new(Config::from_env(), Box::new(Libcuda)));
    let _busy = crate::watchdog::busy();
    let r = apex_interpose::quietly(|| f(engine));
    if r.is_none() {
        engine.off.get_or_insert(Refusal::Internal);
        warn!("internal error in apex-preload: launches go to libcuda from now on");
    }
    r
}

/// The GPU-side hops on one context's queues.
struct QueueHops<'a> {
    cuda: &'a dyn CudaSide,
    queues: &'a mut [Option<Queue>],
    last: &'a [Option<Last>],
    cuda_work: &'a mut bool,
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
        let cuda = self.cuda;
        let q = self.queue(slot)?;
        cuda.cuda_waits_for_apex(q, stream)?;
        *self.cuda_work = true;
        Ok(())
    }

    fn apex_waits_for_cuda(&mut self, slot: usize, stream: StreamKey) -> Result<(), String> {
        let cuda = self.cuda;
        let q = self.queue(slot)?;
        cuda.apex_waits_for_cuda(q, stream)?;
        *self.cuda_work = true;
        Ok(())
    }

    fn apex_waits_for_apex(&mut self, slot: usize, other: usize) -> Result<(), String> {
        let last = self
            .last
            .get(other)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("no launch on slot {other}"))?;
        let fence = {
            let q = self
                .queues
                .get(other)
                .and_then(Option::as_ref)
                .ok_or_else(|| format!("no queue in slot {other}"))?;
            last.fence(q)?
        };
        self.queue(slot)?
            .wait_for(&fence)
            .map_err(|e| e.to_string())
    }

    fn cpu_sync(&mut self, slot: usize) -> Result<(), String> {
        // The last launch's fence, not `Queue::synchronize`: that would drain the printf FIFO and take the failed
        // asserts the engine replays through libcuda.
        let fence = match (self.last.get(slot), self.queues.get(slot)) {
            (Some(Some(last)), Some(Some(q))) => last.fence(q)?,
            _ => return Ok(()),
        };
        wait_fence(&fence)
    }

    fn apex_done(&mut self, slot: usize) -> bool {
        let (Some(Some(last)), Some(Some(q))) = (self.last.get(slot), self.queues.get(slot)) else {
            return false;
        };
        last.fence(q).is_ok_and(|f| f.is_done())
    }
}

/// Waits on the CPU for `fence` (as long as the work runs: a CUDA synchronize has no timeout), without draining
/// the printf FIFO (the engine reports asserts itself).
fn wait_fence(fence: &Fence) -> Result<(), String> {
    let Some(f) = fence.direct() else {
        return fence.wait(WAIT_SLICE).map_err(|e| e.to_string());
    };
    loop {
        match f.wait(WAIT_SLICE) {
            Ok(()) => return Ok(()),
            Err(apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

extern "C" fn at_exit() {
    // Thread-local destructors have run: nothing below may log through a formatter that uses them.
    crate::exit_safe::exiting();
    if let Some(_g) = apex_interpose::enter() {
        shutdown("the program exits");
    }
}

impl Ctx {
    /// The queue of `slot`'s last launch, as a fence.
    fn last_fence(&self, slot: usize) -> Option<Result<Fence, String>> {
        let last = self.last.get(slot)?.as_ref()?;
        let q = self.queues.get(slot)?.as_ref()?;
        Some(last.fence(q))
    }

    /// Where the last launch of `slot`'s queue stands (no waiting).
    fn slot_state(&self, slot: usize) -> SlotState {
        match self.last_fence(slot) {
            None => SlotState::Done,
            Some(Err(_)) => SlotState::Failed,
            Some(Ok(f)) => fence_state(&f),
        }
    }

    fn stream(&mut self, cuda: &dyn CudaSide, raw: usize, per_thread: bool) -> Stream {
        let key = StreamKey::of(raw, per_thread);
        let blocking = match key {
            StreamKey::Legacy | StreamKey::PerThread => true,
            StreamKey::Handle(h) => *self
                .blocking
                .entry(h)
                .or_insert_with(|| cuda.stream_blocking(h)),
        };
        Stream { key, blocking }
    }

    fn hops<'a>(&'a mut self, cuda: &'a dyn CudaSide) -> (QueueHops<'a>, &'a mut Order) {
        (
            QueueHops {
                cuda,
                queues: &mut self.queues,
                last: &self.last,
                cuda_work: &mut self.cuda_work,
            },
            &mut self.order,
        )
    }
}

impl Engine {
    pub(crate) fn new(config: Config, cuda: Box<dyn CudaSide>) -> Engine {
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
        crate::watchdog::start();
        crate::profile::start();
        Engine {
            off: (!config.enabled).then_some(Refusal::Disabled),
            config,
            cuda,
            registry: Registry::new(),
            unreadable: HashMap::new(),
            func_attrs: Handles::default(),
            contexts: Vec::new(),
            recent: 0,
            unattached: Handles::default(),
            event_untimed: Handles::default(),
            capturing: HashSet::new(),
            stack_raised: false,
            args: Vec::new(),
            summary: Summary {
                attach: "not attempted".into(),
                ..Summary::default()
            },
            phases: crate::profile::Phases::default(),
            logged: HashSet::new(),
            exit_hook: false,
        }
    }

    /// The summary so far (hop counts included).
    pub(crate) fn summary(&self) -> Summary {
        let mut s = self.summary.clone();
        for c in &self.contexts {
            s.add_hops(c.order.counts());
        }
        s.modules_seen = s.modules_seen.max(self.registry.len() as u64);
        s.profile = self.phases.report().into_iter().collect();
        s
    }

    // ---- contexts ----

    /// The index of the attached context `handle`, if APEX attached to it.
    fn find_context(&mut self, handle: usize) -> Option<usize> {
        if self
            .contexts
            .get(self.recent)
            .is_some_and(|c| c.handle == handle)
        {
            return Some(self.recent);
        }
        let i = self.contexts.iter().position(|c| c.handle == handle)?;
        self.recent = i;
        Some(i)
    }

    /// The context current on this thread, attached to on first use.
    fn context(&mut self) -> Result<usize, Refusal> {
        let handle = self.cuda.current_context().ok_or(Refusal::NoContext)?;
        if let Some(i) = self.find_context(handle) {
            return Ok(i);
        }
        if let Some(r) = self.unattached.get(&handle) {
            return Err(r.clone());
        }
        self.attach(handle)
    }

    fn attach(&mut self, handle: usize) -> Result<usize, Refusal> {
        if !self.exit_hook {
            // Registered after the CUDA runtime's own exit handler, so it runs before the context goes away.
            // SAFETY: plain `extern "C" fn()` callbacks.
            unsafe {
                libc::atexit(at_exit);
                libc::pthread_atfork(None, None, Some(in_fork_child));
            }
            self.exit_hook = true;
        }
        let result = match self.cuda.attach() {
            Ok((gpu, asserts)) if gpu.backend() == Backend::Direct => {
                info!(selection = %gpu.selection(), asserts_on_apex = asserts, "apex-preload attached to the CUDA context");
                Ok((gpu, asserts))
            }
            Ok((gpu, _)) => Err(Refusal::DriverBackend(gpu.selection().to_string())),
            Err(e) => Err(Refusal::AttachFailed(e)),
        };
        let outcome = match &result {
            Ok(_) => "direct".to_string(),
            Err(r) => r.to_string(),
        };
        self.summary.attach = outcome.clone();
        self.summary.contexts.push(outcome);
        match result {
            Ok((gpu, asserts_on_apex)) => {
                self.contexts.push(Ctx {
                    handle,
                    gpu,
                    asserts_on_apex,
                    modules: HashMap::new(),
                    retired: Vec::new(),
                    funcs: Handles::default(),
                    queues: Vec::new(),
                    last: Vec::new(),
                    spare: Vec::new(),
                    order: Order::new(),
                    blocking: Handles::default(),
                    events: Handles::default(),
                    side: 0,
                    staging: None,
                    cuda_work: true,
                    failed: None,
                    epoch: 1,
                });
                self.recent = self.contexts.len() - 1;
                Ok(self.recent)
            }
            Err(r) => {
                warn!(reason = %r, "apex-preload leaves this context's launches to libcuda");
                self.unattached.insert(handle, r.clone());
                Err(r)
            }
        }
    }

    /// The attached context a CUDA operation at `site` belongs to: a stream's (searched among taken-over streams),
    /// else the current one's. `None` when APEX has no queue that could be involved.
    fn site_context(&mut self, site: Site) -> Option<usize> {
        if let Site::Stream(raw, pt) = site {
            let key = StreamKey::of(raw, pt);
            if let StreamKey::Handle(_) = key
                && let Some(i) = self
                    .contexts
                    .iter()
                    .position(|c| c.order.find(key).is_some())
            {
                return Some(i);
            }
        }
        let handle = self.cuda.current_context()?;
        self.find_context(handle)
    }

    // ---- launches ----

    /// Takes launch `l` over; `s` gets the profile's stamps (see [`crate::profile::Phases::add`]).
    fn try_launch(&mut self, l: &Launch, s: &mut [u64; 6]) -> Result<(), Refusal> {
        if let Some(r) = &self.off {
            return Err(r.clone());
        }
        if !self.capturing.is_empty() {
            return Err(Refusal::Capturing);
        }
        let extras = match &l.extras {
            Ok(e) => *e,
            Err(r) => return Err(r.clone()),
        };
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
        let ci = self.context()?;
        s[2] = crate::profile::stamp();
        if let Some(r) = &self.contexts[ci].failed {
            return Err(r.clone());
        }
        // A failed assert of an earlier launch stops the context's work here, as CUDA's trap stops it (one cached
        // word read): the assert is reported, and the launch goes to libcuda, which fails it.
        if self.contexts[ci].asserts_on_apex && self.contexts[ci].gpu.device_assert_pending() {
            let _ = self.report_asserts(ci);
            return Err(Refusal::AssertReported);
        }
        if !self.contexts[ci].funcs.contains_key(&l.f) {
            // A slow path: not profiled.
            s[0] = 0;
            let state = match self.resolve(ci, l.f) {
                Ok(r) => FuncState::Ready(Box::new(r)),
                Err(r) if r.is_per_function() => FuncState::Refused(r),
                // Not the function's fault (an internal error): decided again next time.
                Err(r) => return Err(r),
            };
            self.contexts[ci].funcs.insert(l.f, state);
        }
        let slot = match self.contexts[ci].order.find(key) {
            Some(slot) => slot,
            None => {
                s[0] = 0;
                self.slot_for(ci, key, l.stream, l.per_thread)?
            }
        };
        let Engine {
            contexts,
            args,
            cuda,
            summary,
            ..
        } = self;
        let Ctx {
            funcs,
            queues,
            last,
            order,
            cuda_work,
            epoch,
            ..
        } = &mut contexts[ci];
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
        let prepared = if extras.cooperative {
            None
        } else {
            match ready
                .prepared
                .iter()
                .position(|p| p.slot == slot && p.cfg == cfg)
            {
                // Most recently used first: a loop of a few shapes finds its own at the front.
                Some(i) => ready.prepared[..=i].rotate_right(1),
                None => {
                    s[0] = 0;
                    summary.prepared_shapes += 1;
                    let queue = queues[slot].as_mut().ok_or(Refusal::Internal)?;
                    let launch = queue
                        .prepare(&ready.kernel, &cfg)
                        .map_err(|e| Refusal::LaunchRefused(e.to_string()));
                    ready.prepared.truncate(PREPARED_PER_FUNCTION - 1);
                    ready.prepared.insert(0, Prepared { slot, cfg, launch });
                }
            }
            Some(ready.prepared[0].launch.as_ref().map_err(Clone::clone)?)
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
        s[3] = crate::profile::stamp();
        let mut hops = QueueHops {
            cuda: cuda.as_ref(),
            queues,
            last,
            cuda_work,
        };
        if let Err(e) = order.before_apex(slot, &mut hops) {
            args.clear();
            return Err(Refusal::LaunchFailed(format!(
                "ordering with the CUDA stream: {e}"
            )));
        }
        s[4] = crate::profile::stamp();
        // The slot's previous last launch goes before the doorbell: dropping a fence is a locked instruction, which
        // after the doorbell would wait for it to leave the core.
        drop(last[slot].take());
        let Some(queue) = queues[slot].as_mut() else {
            args.clear();
            return Err(Refusal::Internal);
        };
        // SAFETY: the program launches this kernel with these arguments on this stream; CUDA would run it the same
        // way, and the queue is ordered with the stream.
        let result = unsafe {
            match prepared {
                Some(p) if extras.programmatic => queue
                    .launch_prepared_programmatic_ticket(p, args)
                    .map(Last::Ticket),
                Some(p) => queue.launch_prepared_ticket(p, args).map(Last::Ticket),
                // A cooperative launch runs in plain stream order, which programmatic serialization allows.
                None => queue
                    .launch_cooperative(&ready.kernel, &cfg, args)
                    .map(Last::Fence),
            }
        };
        args.clear();
        *epoch += 1;
        match result {
            Ok(l) => {
                order.after_apex(slot);
                last[slot] = Some(l);
                s[5] = crate::profile::stamp();
                Ok(())
            }
            Err(e) => Err(Refusal::LaunchFailed(e.to_string())),
        }
    }

    /// Takes launch `l` over if it can; `Some(stamp)` when it did (`t0`: the profile's stamp at the hook's entry; the
    /// stamp returned starts the profile's last phase).
    pub(crate) fn launch(&mut self, l: &Launch, t0: u64) -> Option<u64> {
        let mut s = [t0, crate::profile::stamp(), 0, 0, 0, 0];
        match self.try_launch(l, &mut s) {
            Ok(()) => {
                self.summary.taken();
                self.phases.add(&s);
                // 0 when the launch took a slow path: its last phase is not counted either.
                Some(if s[0] == 0 { 0 } else { s[5] })
            }
            Err(r) => {
                if self.logged.insert((l.f, r.label())) {
                    info!(function = format_args!("{:#x}", l.f), reason = %r, "launch left to libcuda");
                }
                self.summary.refused(&r);
                None
            }
        }
    }

    /// The image an owner's kernels come from, loaded by APEX once per context.
    fn module(&mut self, ci: usize, owner: Owner) -> Result<Module, Refusal> {
        if let Some(m) = self.contexts[ci].modules.get(&owner) {
            return m.clone();
        }
        let image = self.registry.image(owner).ok_or(Refusal::UnknownModule)?;
        let library = self.registry.is_library(owner);
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        // The module's `__device__` variables are CUDA's instance's: kernels on both sides share them.
        let unplaced = std::cell::RefCell::new(Vec::new());
        let place = |name: &str, size: u64| {
            let home = cuda
                .global(owner, library, name)
                // The same variable in both instances: the sizes agree.
                .filter(|h| h.size == size);
            if home.is_none() {
                unplaced.borrow_mut().push(name.to_string());
            }
            home
        };
        let asserts = ctx.asserts_on_apex;
        let loaded = ctx
            .gpu
            .load_module_sharing(image.bytes(), &place)
            .map_err(|e| Refusal::ModuleRefused(e.to_string()))
            .and_then(|m| {
                if let Some(name) = unplaced.borrow().first() {
                    return Err(Refusal::ModuleGlobals(name.clone()));
                }
                match m.cubin().and_then(|c| check::module_refusal(c, asserts)) {
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
        ctx.modules.insert(owner, loaded.clone());
        loaded
    }

    fn resolve(&mut self, ci: usize, f: usize) -> Result<Ready, Refusal> {
        if let Some(&attr) = self.func_attrs.get(&f) {
            return Err(Refusal::FunctionAttribute(attr));
        }
        let origin = match self.registry.origin(f) {
            Some(o) => o.clone(),
            None => {
                // A handle the program got some other way (enumeration, cudart's own lookups): ask the driver.
                let name = self.cuda.function_name(f).ok_or(Refusal::UnknownFunction)?;
                let registry = &self.registry;
                let handle = self
                    .cuda
                    .function_owner(f, &|m| registry.owner(m).is_some())
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
        let module = self.module(ci, origin.owner)?;
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
        if let Some(r) = check::kernel_refusal(info, self.contexts[ci].asserts_on_apex) {
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

    /// The slot (and queue) of a stream in context `ci`, taking it over on first use.
    fn slot_for(
        &mut self,
        ci: usize,
        key: StreamKey,
        raw: usize,
        per_thread: bool,
    ) -> Result<usize, Refusal> {
        if let Some(s) = self.contexts[ci].order.find(key) {
            return Ok(s);
        }
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        if ctx.order.live() >= self.config.max_queues {
            return Err(Refusal::TooManyStreams(self.config.max_queues));
        }
        let queue = match ctx.spare.pop() {
            Some(q) => q,
            None => {
                let options = QueueOptions::default().launch_memory(self.config.launch_memory);
                let q = ctx
                    .gpu
                    .queue_with(options)
                    .map_err(|e| Refusal::QueueFailed(e.to_string()))?;
                self.summary.queues += 1;
                q
            }
        };
        let stream = ctx.stream(cuda, raw, per_thread);
        let slot = ctx.order.add(stream);
        if ctx.queues.len() <= slot {
            ctx.queues.resize_with(slot + 1, || None);
            ctx.last.resize_with(slot + 1, || None);
        }
        ctx.queues[slot] = Some(queue);
        ctx.last[slot] = None;
        info!(stream = ?key, slot, "stream taken over by an APEX queue");
        Ok(slot)
    }

    // ---- ordering with CUDA ----

    /// Before a CUDA operation that adds work at `site`: related queues' work is handed to CUDA (a hop, unless it
    /// is complete already). Returns the context's generation after it, for [`after`](Self::after).
    pub(crate) fn before(&mut self, site: Site) -> u64 {
        let Some(ci) = self.site_context(site) else {
            return 0;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        ctx.epoch += 1;
        if ctx.order.live() > 0 {
            let target = match site {
                Site::Stream(raw, pt) => Target::Stream(ctx.stream(cuda, raw, pt)),
                Site::Device => Target::Device,
            };
            let (mut hops, order) = ctx.hops(cuda);
            if let Err(e) = order.before_cuda(target, &mut hops) {
                warn!(error = %e, "cannot order a CUDA operation after APEX's queue");
            }
        }
        ctx.epoch
    }

    /// After a CUDA operation that added work at `site`. `completed`: the call returned only once the stream's work
    /// was done (a synchronous copy to the host), with the generation [`before`](Self::before) returned: the stream
    /// then needs no hop, unless other work came in between.
    pub(crate) fn after(&mut self, site: Site, completed: Option<u64>) {
        let Site::Stream(raw, pt) = site else { return };
        let Some(ci) = self.site_context(site) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        let unchanged = completed == Some(ctx.epoch);
        ctx.epoch += 1;
        if ctx.order.live() == 0 {
            return;
        }
        let s = ctx.stream(cuda, raw, pt);
        ctx.order.after_cuda(s);
        if unchanged {
            ctx.order.cuda_synchronized(s);
        }
    }

    // ---- synchronization ----
    //
    // A synchronization runs in two steps around a wait that holds no lock: `*_begin` decides under the engine's lock
    // and returns the fences to wait for, the caller waits for them without the lock (other threads keep launching,
    // and a kernel that waits for another thread's CUDA call still gets it), and `*_end` applies what the wait
    // showed under the lock again. The single-threaded forms (`stream_sync`, ...) run the three in a row.

    /// The fences of `slots` in context `ci`, to wait for.
    fn waits(&self, ci: usize, slots: impl IntoIterator<Item = usize>) -> Step {
        let ctx = &self.contexts[ci];
        let items = slots
            .into_iter()
            .filter_map(|s| Some((s, ctx.last_fence(s)?.ok()?)))
            .collect();
        Step::Wait(Waits {
            ctx: ci,
            handle: ctx.handle,
            items,
        })
    }

    /// After the waits of `w` (`waited`): the queues whose last launch is still the one waited for are complete;
    /// `None` when the context is gone or a queue failed (libcuda then answers).
    fn waited(&mut self, w: &Waits, waited: &Result<(), String>) -> Option<usize> {
        let ci = w.ctx;
        if self.contexts.get(ci).is_none_or(|c| c.handle != w.handle) {
            return None;
        }
        if let Err(e) = waited {
            // A fault: libcuda reports the context's error (the queues are in its channel group).
            debug!(error = %e, "an APEX queue faulted; libcuda answers");
            return None;
        }
        let ctx = &mut self.contexts[ci];
        for (slot, fence) in &w.items {
            // A launch another thread made meanwhile is not complete.
            let same = ctx
                .last_fence(*slot)
                .and_then(Result::ok)
                .and_then(|f| Some(f.direct()?.value()))
                == fence.direct().map(|f| f.value());
            if same {
                ctx.order.apex_complete(*slot);
            }
        }
        Some(ci)
    }

    /// `cuStreamSynchronize` / `cuStreamQuery` at `site`, first step: the queue's work is waited for (or looked at)
    /// on the CPU; libcuda is called only where the stream holds CUDA work of its own, with no hop before it.
    pub(crate) fn stream_sync_begin(&mut self, site: Site, kind: SyncKind) -> Step {
        let Site::Stream(raw, pt) = site else {
            return Step::Answer(Answer::Forward);
        };
        let Some(ci) = self.site_context(site) else {
            return Step::Answer(Answer::Forward);
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        // A failed context answers through libcuda, which keeps its error; a capture makes libcuda's answer an error.
        if ctx.order.live() == 0 || ctx.failed.is_some() || !self.capturing.is_empty() {
            return Step::Answer(Answer::Forward);
        }
        let stream = ctx.stream(cuda, raw, pt);
        let own = ctx.order.find(stream.key);
        // The slots whose work the stream's synchronize covers: its own queue, and for the legacy stream every
        // blocking stream's queue (conservative: CUDA's legacy stream orders itself after their work).
        let slots: Vec<usize> = if stream.key == StreamKey::Legacy {
            ctx.order.related(stream).collect()
        } else {
            own.into_iter().collect()
        };
        if kind == SyncKind::Query {
            for &s in &slots {
                match ctx.slot_state(s) {
                    SlotState::Done => {}
                    SlotState::Running => {
                        self.summary.syncs_on_cpu += 1;
                        return Step::Answer(Answer::Done(CUDA_ERROR_NOT_READY));
                    }
                    SlotState::Failed => return Step::Answer(Answer::Forward),
                }
            }
        }
        self.waits(ci, slots)
    }

    /// `cuStreamSynchronize` / `cuStreamQuery`, last step: the answer, and the generation to give
    /// [`stream_synced`](Self::stream_synced) after a forwarded call.
    pub(crate) fn stream_sync_end(
        &mut self,
        site: Site,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> (Answer, u64) {
        let Some(ci) = self.waited(w, waited) else {
            return (self.forward_after_asserts(w.ctx, w.handle), 0);
        };
        if let Some(a) = self.report_asserts(ci) {
            return (a, 0);
        }
        let Site::Stream(raw, pt) = site else {
            return (Answer::Forward, 0);
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let stream = ctx.stream(cuda, raw, pt);
        match ctx.order.find(stream.key) {
            Some(slot) if ctx.order.cuda_clean(slot) => {
                self.summary.syncs_on_cpu += 1;
                (Answer::Done(CUDA_SUCCESS), 0)
            }
            _ => {
                self.summary.syncs_forwarded += 1;
                (Answer::Forward, ctx.epoch)
            }
        }
    }

    /// `cuStreamSynchronize` / `cuStreamQuery` in one thread (the steps in a row).
    #[cfg(test)]
    pub(crate) fn stream_sync(&mut self, site: Site, kind: SyncKind) -> Answer {
        match self.stream_sync_begin(site, kind) {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.stream_sync_end(site, &w, &waited).0
            }
        }
    }

    /// After a forwarded stream synchronize returned `result`; `epoch`: what [`stream_sync_end`](Self::stream_sync_end)
    /// returned (0: nothing to do).
    pub(crate) fn stream_synced(&mut self, site: Site, result: c_int, epoch: u64) {
        let Site::Stream(raw, pt) = site else { return };
        if result != CUDA_SUCCESS || epoch == 0 {
            return;
        }
        let Some(ci) = self.site_context(site) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        // Only if no work came in while libcuda synchronized (another thread's): that work is not complete.
        if ctx.epoch == epoch {
            let s = ctx.stream(cuda, raw, pt);
            ctx.order.cuda_synchronized(s);
        }
    }

    /// `cuCtxSynchronize`, first step: every queue of the current context waited for on the CPU.
    pub(crate) fn context_sync_begin(&mut self) -> Step {
        let Some(ci) = self.site_context(Site::Device) else {
            return Step::Answer(Answer::Forward);
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        let slots: Vec<usize> = self.contexts[ci].order.slots().collect();
        self.waits(ci, slots)
    }

    /// `cuCtxSynchronize`, last step: libcuda only if CUDA has had work since the context's last synchronize. The
    /// generation is for [`context_synced`](Self::context_synced).
    pub(crate) fn context_sync_end(
        &mut self,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> (Answer, u64) {
        let Some(ci) = self.waited(w, waited) else {
            return (self.forward_after_asserts(w.ctx, w.handle), 0);
        };
        if let Some(a) = self.report_asserts(ci) {
            return (a, 0);
        }
        let ctx = &self.contexts[ci];
        if ctx.cuda_work || ctx.failed.is_some() || !self.capturing.is_empty() {
            self.summary.syncs_forwarded += 1;
            (Answer::Forward, ctx.epoch)
        } else {
            self.summary.syncs_on_cpu += 1;
            (Answer::Done(CUDA_SUCCESS), 0)
        }
    }

    /// `cuCtxSynchronize` in one thread.
    #[cfg(test)]
    pub(crate) fn context_sync(&mut self) -> Answer {
        match self.context_sync_begin() {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.context_sync_end(&w, &waited).0
            }
        }
    }

    /// After a forwarded `cuCtxSynchronize` returned `result` (`epoch`: what `context_sync_end` returned).
    pub(crate) fn context_synced(&mut self, result: c_int, epoch: u64) {
        if result != CUDA_SUCCESS || epoch == 0 {
            return;
        }
        if let Some(ci) = self.site_context(Site::Device) {
            let ctx = &mut self.contexts[ci];
            // Work another thread submitted while libcuda synchronized is not complete.
            if ctx.epoch == epoch {
                ctx.order.context_synchronized();
                ctx.cuda_work = false;
            }
        }
    }

    /// Before a CUDA call that frees or unloads what work may use, or needs the whole device idle, first step:
    /// every queue's work is waited for on the CPU (libcuda's own call waits for CUDA's), so no hop is needed.
    pub(crate) fn device_quiet_begin(&mut self) -> Step {
        let Some(ci) = self.site_context(Site::Device) else {
            return Step::Answer(Answer::Forward);
        };
        let slots: Vec<usize> = self.contexts[ci].order.slots().collect();
        self.waits(ci, slots)
    }

    /// Last step of [`device_quiet_begin`](Self::device_quiet_begin): a queue that could not be waited for is
    /// handed to CUDA instead; a failed assert is reported (libcuda's call then returns it).
    pub(crate) fn device_quiet_end(&mut self, w: &Waits, waited: &Result<(), String>) -> Answer {
        match self.waited(w, waited) {
            Some(ci) => self.report_asserts(ci).unwrap_or(Answer::Forward),
            None => {
                if let Some(ctx) = self
                    .contexts
                    .get_mut(w.ctx)
                    .filter(|c| c.handle == w.handle)
                {
                    let cuda = self.cuda.as_ref();
                    let (mut hops, order) = ctx.hops(cuda);
                    let _ = order.before_cuda(Target::Device, &mut hops);
                }
                self.report_asserts(w.ctx).unwrap_or(Answer::Forward)
            }
        }
    }

    /// Every queue of context `ci` waited for on the CPU, under the lock (at shutdown and when the takeover stops:
    /// nothing runs beside it then).
    fn wait_all(&mut self, ci: usize) {
        if let Step::Wait(w) = self.waits(ci, self.contexts[ci].order.slots().collect::<Vec<_>>()) {
            let waited = w.wait();
            if self.waited(&w, &waited).is_none()
                && let Some(ctx) = self.contexts.get_mut(ci)
            {
                warn!("an APEX queue failed while the preload waited for it");
                let cuda = self.cuda.as_ref();
                let (mut hops, order) = ctx.hops(cuda);
                let _ = order.before_cuda(Target::Device, &mut hops);
            }
        }
    }

    /// Failed asserts of APEX's kernels in context `ci`, reported as libcuda reports its own. `Some` when one was:
    /// what the call that found it returns.
    fn report_asserts(&mut self, ci: usize) -> Option<Answer> {
        let ctx = self.contexts.get_mut(ci)?;
        if !ctx.asserts_on_apex || !ctx.gpu.device_assert_pending() {
            return None;
        }
        let failures = match ctx.gpu.take_device_asserts() {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot read the failed device asserts");
                Vec::new()
            }
        };
        self.summary.asserts += failures.len() as u64;
        ctx.failed = Some(Refusal::AssertReported);
        // The context is unusable from here on, as libcuda makes it: the program's call reaches libcuda, which
        // answers CUDA_ERROR_ASSERT once the replay has run.
        match self.cuda.replay_asserts(ctx.handle, &failures) {
            Ok(()) => Some(Answer::Forward),
            Err(e) => {
                // libcuda could not replay (its context already failed, or no record survived): CUDA's lines printed
                // here, and every call through the preload answers CUDA_ERROR_ASSERT from now on.
                warn!(error = %e, "device asserts could not be replayed through libcuda");
                for f in &failures {
                    eprintln!("{f}");
                }
                STICKY.store(CUDA_ERROR_ASSERT, Ordering::Relaxed);
                Some(Answer::Done(CUDA_ERROR_ASSERT))
            }
        }
    }

    /// A failed assert of APEX's kernels in context `ci`, reported: what a call that found it returns
    /// (`CUDA_ERROR_ASSERT`, libcuda's context failed by the replay).
    fn assert_answer(&mut self, ci: usize) -> Option<c_int> {
        match self.report_asserts(ci)? {
            Answer::Done(code) => Some(code),
            Answer::Forward => Some(CUDA_ERROR_ASSERT),
        }
    }

    /// libcuda answers, after a failed assert of the context (`ci`, if it is still `handle`) is reported.
    fn forward_after_asserts(&mut self, ci: usize, handle: usize) -> Answer {
        self.summary.syncs_forwarded += 1;
        if self.contexts.get(ci).is_some_and(|c| c.handle == handle) {
            self.report_asserts(ci).unwrap_or(Answer::Forward)
        } else {
            Answer::Forward
        }
    }

    // ---- copies ----

    /// Runs a program's copy between the host and the device on the stream's APEX queue, in its order, when the
    /// stream is taken over and the pointers are memory the queue reaches (`Some(CUresult)`); `None` leaves it to
    /// libcuda (ordered with the queues like any CUDA work).
    pub(crate) fn copy(&mut self, op: &CopyOp) -> Option<c_int> {
        if self.off.is_some() || !self.capturing.is_empty() || op.bytes == 0 {
            return None;
        }
        let Site::Stream(raw, pt) = op.site else {
            return None;
        };
        let key = StreamKey::of(raw, pt);
        let ci = self.site_context(op.site)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        if ctx.failed.is_some() {
            return None;
        }
        let slot = ctx.order.find(key)?;
        let plan = CopyPlan::new(
            op.dir,
            cuda.pointer(op.src, ctx.handle),
            cuda.pointer(op.dst, ctx.handle),
            op,
        )?;
        let waits = matches!(plan, CopyPlan::StageOut { .. }) || op.blocking;
        ctx.epoch += 1;
        match Self::run_copy(cuda, ctx, slot, plan, op) {
            Ok(()) => {
                self.summary.copies_on_apex += 1;
                // A copy that returned once done reports a failed assert of an earlier kernel, as libcuda's would.
                if waits && let Some(code) = self.assert_answer(ci) {
                    return Some(code);
                }
                Some(CUDA_SUCCESS)
            }
            Err(e) => {
                debug!(error = %e, "a copy goes to libcuda");
                None
            }
        }
    }

    /// Runs a program's memset of device memory on the stream's APEX queue, in its order, when the stream is taken
    /// over (`Some(CUresult)`); `None` leaves it to libcuda.
    pub(crate) fn fill(&mut self, op: &SetOp) -> Option<c_int> {
        if self.off.is_some() || !self.capturing.is_empty() || op.count == 0 {
            return None;
        }
        let Site::Stream(raw, pt) = op.site else {
            return None;
        };
        let key = StreamKey::of(raw, pt);
        let ci = self.site_context(op.site)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        if ctx.failed.is_some() || !op.dst.is_multiple_of(u64::from(op.width)) {
            return None;
        }
        let slot = ctx.order.find(key)?;
        let bytes = (op.count as u64).checked_mul(u64::from(op.width))?;
        match cuda.pointer(op.dst, ctx.handle) {
            Pointer::Device { bytes: room } if room >= bytes => {}
            _ => return None,
        }
        ctx.epoch += 1;
        let run = |ctx: &mut Ctx| -> Result<(), String> {
            let (mut hops, order) = ctx.hops(cuda);
            order.before_apex(slot, &mut hops)?;
            let queue = ctx.queues[slot]
                .as_mut()
                .ok_or_else(|| format!("no queue in slot {slot}"))?;
            // SAFETY: libcuda says `dst` is device memory of this context for `bytes` bytes, aligned to the width.
            let fence =
                unsafe { queue.fill_addresses(op.dst, op.value, op.width, op.count as u64) }
                    .map_err(|e| e.to_string())?;
            ctx.order.after_apex(slot);
            ctx.last[slot] = Some(Last::Fence(fence));
            Ok(())
        };
        match run(ctx) {
            Ok(()) => {
                self.summary.sets_on_apex += 1;
                Some(CUDA_SUCCESS)
            }
            Err(e) => {
                debug!(error = %e, "a memset goes to libcuda");
                None
            }
        }
    }

    fn run_copy(
        cuda: &dyn CudaSide,
        ctx: &mut Ctx,
        slot: usize,
        plan: CopyPlan,
        op: &CopyOp,
    ) -> Result<(), String> {
        let n = op.bytes as u64;
        if !matches!(plan, CopyPlan::Direct { .. }) && ctx.staging.is_none() {
            let buffer = ctx
                .gpu
                .alloc_host(STAGING_BYTES)
                .map_err(|e| e.to_string())?;
            ctx.staging = Some(Staging {
                buffer,
                head: 0,
                inflight: Vec::new(),
            });
        }
        // The queue waits for the stream's CUDA work first, as a launch does.
        let (mut hops, order) = ctx.hops(cuda);
        order.before_apex(slot, &mut hops)?;
        let queue = ctx.queues[slot]
            .as_mut()
            .ok_or_else(|| format!("no queue in slot {slot}"))?;
        let fence = match plan {
            CopyPlan::Direct { src, dst } => {
                // SAFETY: libcuda says both are memory of this context the GPU reaches, for `n` bytes; the program
                // keeps them until the copy is done, as it must for CUDA's.
                let f = unsafe { queue.copy_addresses(src, dst, n) }.map_err(|e| e.to_string())?;
                // A synchronous entry point returns once the copy is done (from pinned memory too).
                if op.blocking {
                    wait_fence(&f)?;
                }
                f
            }
            CopyPlan::StageOut { src } => {
                let staging = ctx.staging.as_mut().ok_or("no staging memory")?;
                let at = staging.take(n)?;
                let base = staging.buffer.device_ptr();
                // SAFETY: as above for `src`; the staging ring is ours.
                let f = unsafe { queue.copy_addresses(src, base + at, n) }
                    .map_err(|e| e.to_string())?;
                // To pageable memory CUDA returns once the data is there: so does this.
                wait_fence(&f)?;
                // SAFETY: the program passed `dst` as host memory of `n` writable bytes.
                let out = unsafe { std::slice::from_raw_parts_mut(op.dst as *mut u8, op.bytes) };
                staging.buffer.read(at, out).map_err(|e| e.to_string())?;
                f
            }
            CopyPlan::StageIn { dst } => {
                let staging = ctx.staging.as_mut().ok_or("no staging memory")?;
                let at = staging.take(n)?;
                // SAFETY: the program passed `src` as host memory of `n` readable bytes.
                let data = unsafe { std::slice::from_raw_parts(op.src as *const u8, op.bytes) };
                staging.buffer.write(at, data).map_err(|e| e.to_string())?;
                let base = staging.buffer.device_ptr();
                // SAFETY: as above for `dst`; the staging ring's bytes stay until the copy is done.
                let f = unsafe { queue.copy_addresses(base + at, dst, n) }
                    .map_err(|e| e.to_string())?;
                // From pageable memory CUDA returns once the data is staged, also for the synchronous entry point.
                staging.inflight.push(f.clone());
                f
            }
        };
        ctx.order.after_apex(slot);
        ctx.last[slot] = Some(Last::Fence(fence));
        Ok(())
    }

    // ---- events ----

    /// `cuEventCreate` made `event` with `flags`.
    pub(crate) fn event_created(&mut self, event: usize, flags: u32) {
        // Kept by the preload only with CU_EVENT_DISABLE_TIMING (2), never with CU_EVENT_INTERPROCESS (4): another
        // process reads an interprocess event's state from libcuda.
        self.event_untimed
            .insert(event, flags & 2 != 0 && flags & 4 == 0);
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroyed(&mut self, event: usize) {
        self.event_untimed.remove(&event);
        for c in &mut self.contexts {
            c.events.remove(&event);
        }
    }

    /// `cuEventRecord(event, site)`: recorded by the preload itself when everything it stands for is an APEX
    /// queue's work and the event does not time; otherwise the stream's queues are handed over and libcuda records
    /// it.
    pub(crate) fn event_record(&mut self, event: usize, site: Site) -> Answer {
        // A new record replaces the last one, wherever it was kept.
        for c in &mut self.contexts {
            c.events.remove(&event);
        }
        let Site::Stream(raw, pt) = site else {
            return Answer::Forward;
        };
        let untimed = self.event_untimed.get(&event).copied().unwrap_or(false);
        if untimed
            && self.capturing.is_empty()
            && let Some(ci) = self.site_context(site)
            && self.contexts[ci].failed.is_none()
        {
            let cuda = self.cuda.as_ref();
            let ctx = &mut self.contexts[ci];
            let stream = ctx.stream(cuda, raw, pt);
            // Only a taken-over stream whose CUDA side holds nothing the queue did not wait for, and whose queue
            // waited for every related queue's last launch (CUDA orders a record on a blocking stream after the
            // legacy stream's earlier work): then the queue's last launch stands for all of it. (The legacy stream
            // orders after every blocking stream's work: not kept.)
            if stream.key != StreamKey::Legacy
                && let Some(slot) = ctx.order.find(stream.key)
                && ctx.order.cuda_clean(slot)
                && ctx.order.covers_related(slot)
                && let Some(Ok(fence)) = ctx.last_fence(slot)
            {
                ctx.events.insert(event, VirtualEvent { slot, fence });
                self.summary.events_on_apex += 1;
                return Answer::Done(CUDA_SUCCESS);
            }
        }
        self.before(site);
        Answer::Forward
    }

    fn event_home(&self, event: usize) -> Option<usize> {
        self.contexts
            .iter()
            .position(|c| c.events.contains_key(&event))
    }

    /// `cuEventSynchronize` / `cuEventQuery`, first step: an event the preload kept is answered from its fence;
    /// any other goes to libcuda, after a failed assert of APEX's is reported (libcuda then answers with it).
    pub(crate) fn event_sync_begin(&mut self, event: usize, kind: SyncKind) -> Step {
        let Some(ci) = self.event_home(event) else {
            let current = self.site_context(Site::Device);
            return Step::Answer(
                current
                    .and_then(|ci| self.report_asserts(ci))
                    .unwrap_or(Answer::Forward),
            );
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        let ctx = &mut self.contexts[ci];
        let Some(v) = ctx.events.get(&event) else {
            return Step::Answer(Answer::Forward);
        };
        if ctx.failed.is_some() {
            return Step::Answer(Answer::Forward);
        }
        if kind == SyncKind::Query {
            match fence_state(&v.fence) {
                SlotState::Done => {}
                SlotState::Running => {
                    self.summary.syncs_on_cpu += 1;
                    return Step::Answer(Answer::Done(CUDA_ERROR_NOT_READY));
                }
                SlotState::Failed => {
                    ctx.events.remove(&event);
                    return Step::Answer(Answer::Forward);
                }
            }
        }
        Step::Wait(Waits {
            ctx: ci,
            handle: ctx.handle,
            items: vec![(v.slot, v.fence.clone())],
        })
    }

    /// `cuEventSynchronize` / `cuEventQuery`, last step.
    pub(crate) fn event_sync_end(
        &mut self,
        event: usize,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> Answer {
        if waited.is_err() {
            // The queue faulted: libcuda's event (never recorded) would say nothing; libcuda's context error is
            // what the program must see, from a call that reaches libcuda with the event recorded.
            if let Some(ctx) = self
                .contexts
                .get_mut(w.ctx)
                .filter(|c| c.handle == w.handle)
            {
                ctx.events.remove(&event);
            }
            return self.forward_after_asserts(w.ctx, w.handle);
        }
        if let Some(a) = self.report_asserts(w.ctx) {
            return a;
        }
        self.summary.syncs_on_cpu += 1;
        Answer::Done(CUDA_SUCCESS)
    }

    /// `cuEventSynchronize` / `cuEventQuery` in one thread.
    #[cfg(test)]
    pub(crate) fn event_sync(&mut self, event: usize, kind: SyncKind) -> Answer {
        match self.event_sync_begin(event, kind) {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.event_sync_end(event, &w, &waited)
            }
        }
    }

    /// Before libcuda looks at `event` (a stream waits for it, elapsed time, IPC), first step: an event the preload
    /// kept is recorded in libcuda now, on the preload's own stream. Its work complete: with nothing before it. Its
    /// queue has launched nothing since: after the queue's work. Otherwise its fence is returned to wait for first
    /// (waiting for the queue's later work too could wait for work that itself waits for what follows).
    pub(crate) fn materialize_begin(&mut self, event: usize) -> Option<(Fence, usize)> {
        let ci = self.event_home(event)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let v = ctx.events.remove(&event)?;
        self.summary.events_materialized += 1;
        ctx.cuda_work = true;
        ctx.epoch += 1;
        let latest = ctx
            .last_fence(v.slot)
            .and_then(Result::ok)
            .and_then(|f| Some(f.direct()?.value()));
        let result = if v.fence.is_done() {
            cuda.record_event_now(ctx.handle, event, &mut ctx.side)
        } else if latest == v.fence.direct().map(|f| f.value()) {
            match ctx.queues.get_mut(v.slot).and_then(Option::as_mut) {
                Some(q) => cuda.record_event_after(ctx.handle, q, event, &mut ctx.side),
                None => Err("the event's queue is gone".into()),
            }
        } else {
            return Some((v.fence, ctx.handle));
        };
        if let Err(e) = result {
            warn!(error = %e, "cannot record an event after APEX's queue; waiting for the queue instead");
            return Some((v.fence, ctx.handle));
        }
        None
    }

    /// After the fence [`materialize_begin`](Self::materialize_begin) returned was waited for: libcuda records the
    /// event with nothing pending.
    pub(crate) fn materialize_end(&mut self, event: usize, handle: usize) {
        let Some(ci) = self.find_context(handle) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        if let Err(e) = cuda.record_event_now(ctx.handle, event, &mut ctx.side) {
            warn!(error = %e, "cannot record an event in libcuda");
        }
    }

    /// [`materialize_begin`](Self::materialize_begin), the wait and the end in one thread.
    pub(crate) fn materialize(&mut self, event: usize) {
        if let Some((f, handle)) = self.materialize_begin(event) {
            let _ = wait_fence(&f);
            self.materialize_end(event, handle);
        }
    }

    /// Every event the preload kept, recorded in libcuda (before a capture begins or a graph launches).
    pub(crate) fn materialize_all(&mut self) {
        let events: Vec<usize> = self
            .contexts
            .iter()
            .flat_map(|c| c.events.keys().copied())
            .collect();
        for e in events {
            self.materialize(e);
        }
    }

    // ---- what the program loaded ----

    pub(crate) fn loaded(
        &mut self,
        owner: usize,
        image: Result<ImageBytes, String>,
        library: bool,
    ) {
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
        for c in &mut self.contexts {
            if let Some(Ok(m)) = c.modules.remove(&owner) {
                c.retired.push(m);
            }
            // Refusals are cheap to recompute; any of them may name a reused handle.
            c.funcs
                .retain(|_, s| matches!(s, FuncState::Ready(r) if r.owner != owner));
        }
    }

    pub(crate) fn unloaded(&mut self, handle: usize) {
        self.unreadable.remove(&handle);
        if let Some(owner) = self.registry.unloaded(handle) {
            self.forget_owner(owner);
        }
    }

    pub(crate) fn function(&mut self, function: usize, handle: usize, name: &str) {
        self.registry.function(function, handle, name);
    }

    pub(crate) fn same_function(&mut self, function: usize, kernel: usize) {
        self.registry.same_function(function, kernel);
    }

    pub(crate) fn library_module(&mut self, module: usize, library: usize) {
        self.registry.library_module(module, library);
    }

    pub(crate) fn escape(&mut self, handle: usize, name: Option<String>) {
        self.registry.escape(handle, name);
        if let Some(owner) = self.registry.owner(handle) {
            for c in &mut self.contexts {
                c.funcs
                    .retain(|_, s| !matches!(s, FuncState::Ready(r) if r.owner == owner));
            }
        }
    }

    pub(crate) fn func_attribute(&mut self, f: usize, attr: c_int) {
        self.func_attrs.insert(f, attr);
        for c in &mut self.contexts {
            c.funcs.remove(&f);
        }
    }

    pub(crate) fn raise_stack(&mut self) {
        self.stack_raised = true;
    }

    pub(crate) fn stream_destroyed(&mut self, raw: usize) {
        let key = StreamKey::of(raw, false);
        // Events kept after the stream's queue are recorded in libcuda while the queue still serves it.
        let kept: Vec<usize> = self
            .contexts
            .iter()
            .flat_map(|c| {
                let slot = c.order.find(key);
                c.events
                    .iter()
                    .filter(move |(_, v)| Some(v.slot) == slot)
                    .map(|(&e, _)| e)
            })
            .collect();
        for e in kept {
            self.materialize(e);
        }
        for c in &mut self.contexts {
            if let Some(slot) = c.order.find(key) {
                c.order.remove(slot);
                for s in c.funcs.values_mut() {
                    if let FuncState::Ready(r) = s {
                        r.prepared.retain(|p| p.slot != slot);
                    }
                }
                c.last[slot] = None;
                if let Some(q) = c.queues.get_mut(slot).and_then(Option::take) {
                    c.spare.push(q);
                }
                c.events.retain(|_, v| v.slot != slot);
            }
            c.blocking.remove(&raw);
        }
    }

    pub(crate) fn capture(&mut self, raw: usize, per_thread: bool, begins: bool) {
        let key = StreamKey::of(raw, per_thread);
        if begins {
            self.capturing.insert(key);
        } else {
            self.capturing.remove(&key);
        }
    }

    pub(crate) fn unknown_entry(&mut self, name: &str) {
        for ci in 0..self.contexts.len() {
            self.wait_all(ci);
        }
        if self.off.is_none() {
            warn!(
                entry = name,
                "unknown driver entry point variant: apex-preload stops taking launches over"
            );
            self.off = Some(Refusal::UnknownEntryPoint(name.to_string()));
        }
    }

    pub(crate) fn shutdown(&mut self, why: &str) {
        self.materialize_all();
        for ci in 0..self.contexts.len() {
            self.wait_all(ci);
            // Queues of destroyed streams: their work was handed to CUDA, and may still run.
            for q in &mut self.contexts[ci].spare {
                if let Err(e) = q.synchronize() {
                    warn!(error = %e, "an APEX queue did not drain at shutdown");
                }
            }
            // A failed assert nobody synchronized for: CUDA reports it when the context goes; so does the replay.
            let _ = self.report_asserts(ci);
        }
        let summary = self.summary();
        if let Some(path) = &self.config.stats {
            match serde_json::to_vec_pretty(&summary) {
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
            launches = summary.launches,
            apex = summary.apex,
            fallback = summary.fallback,
            "apex-preload stops"
        );
        // Queues and modules go before the contexts do.
        for c in &mut self.contexts {
            c.funcs.clear();
            c.events.clear();
            c.last.clear();
            c.queues.clear();
            c.spare.clear();
            c.modules.clear();
            c.retired.clear();
        }
        self.contexts.clear();
        self.off = Some(Refusal::Disabled);
    }
}

// ---- the entry points the hooks call ----

/// Launches through APEX if it can (`Some`: the profile's stamp where the hook's last phase starts); `None` when the
/// caller must forward the launch to libcuda (ordered by [`before`] and [`after`] like any CUDA operation). `t0`:
/// the profile's stamp at the hook's entry.
pub(crate) fn launch(l: &Launch, t0: u64) -> Option<u64> {
    with(|e| e.launch(l, t0)).flatten()
}

/// A launch made through an entry point the preload always leaves to libcuda.
pub(crate) fn refused(why: Refusal) {
    with(|e| e.summary.refused(&why));
}

/// Before a CUDA operation at `site`: related queues' work is handed to CUDA. Returns the context's generation, for
/// [`after`].
pub(crate) fn before(site: Site) -> u64 {
    with(|e| e.before(site)).unwrap_or(0)
}

/// After a CUDA operation that added work at `site` (`completed`: the generation [`before`] returned, when the
/// stream's work is done as the call returns).
pub(crate) fn after(site: Site, completed: Option<u64>) {
    with(|e| e.after(site, completed));
}

/// Runs a synchronization's first step under the lock, waits without it, and its last step under it again.
fn two_steps<R>(
    begin: impl FnOnce(&mut Engine) -> Step,
    end: impl FnOnce(&mut Engine, &Waits, &Result<(), String>) -> R,
    forward: R,
    answer: impl FnOnce(Answer) -> R,
) -> R {
    match with(begin) {
        None => forward,
        Some(Step::Answer(a)) => answer(a),
        Some(Step::Wait(w)) => {
            let waited = w.wait();
            with(|e| end(e, &w, &waited)).unwrap_or(forward)
        }
    }
}

/// Before a call that frees, unloads or otherwise needs every queue's work done: waited for on the CPU, without
/// the lock. `Done` when a failed assert could not be replayed (the call answers that).
pub(crate) fn device_quiet() -> Answer {
    two_steps(
        |e| e.device_quiet_begin(),
        |e, w, r| e.device_quiet_end(w, r),
        Answer::Forward,
        |a| a,
    )
}

/// A failed assert of APEX's kernels in the current context, reported before a call that returns only once its
/// work is done reaches libcuda: `Some` is what the call returns (the replay has failed libcuda's context).
pub(crate) fn pending_assert() -> Option<c_int> {
    with(|e| {
        let ci = e.site_context(Site::Device)?;
        e.assert_answer(ci)
    })
    .flatten()
}

/// A stream synchronize or query; the epoch is for [`stream_synced`] after a forwarded call.
pub(crate) fn stream_sync(site: Site, kind: SyncKind) -> (Answer, u64) {
    two_steps(
        |e| e.stream_sync_begin(site, kind),
        |e, w, r| e.stream_sync_end(site, w, r),
        (Answer::Forward, 0),
        |a| (a, 0),
    )
}

/// After a forwarded stream synchronize.
pub(crate) fn stream_synced(site: Site, result: c_int, epoch: u64) {
    with(|e| e.stream_synced(site, result, epoch));
}

/// A context synchronize; the epoch is for [`context_synced`].
pub(crate) fn context_sync() -> (Answer, u64) {
    two_steps(
        |e| e.context_sync_begin(),
        |e, w, r| e.context_sync_end(w, r),
        (Answer::Forward, 0),
        |a| (a, 0),
    )
}

/// After a forwarded context synchronize.
pub(crate) fn context_synced(result: c_int, epoch: u64) {
    with(|e| e.context_synced(result, epoch));
}

/// The program submits CUDA work through driver function `name` (counted in the stats, by name).
pub(crate) fn cuda_work(name: &'static str) {
    with(|e| *e.summary.cuda_work.entry(name.to_string()).or_default() += 1);
}

/// A memset: run on APEX's queue (`Some(CUresult)`), or `None` for libcuda.
pub(crate) fn fill(op: &SetOp) -> Option<c_int> {
    with(|e| e.fill(op)).flatten()
}

/// A copy: run on APEX's queue (`Some(CUresult)`), or `None` for libcuda.
pub(crate) fn copy(op: &CopyOp) -> Option<c_int> {
    with(|e| e.copy(op)).flatten()
}

/// An event was created.
pub(crate) fn event_created(event: usize, flags: u32) {
    with(|e| e.event_created(event, flags));
}

/// An event was destroyed.
pub(crate) fn event_destroyed(event: usize) {
    with(|e| e.event_destroyed(event));
}

/// An event record.
pub(crate) fn event_record(event: usize, site: Site) -> Answer {
    with(|e| e.event_record(event, site)).unwrap_or(Answer::Forward)
}

/// An event synchronize or query.
pub(crate) fn event_sync(event: usize, kind: SyncKind) -> Answer {
    two_steps(
        |e| e.event_sync_begin(event, kind),
        |e, w, r| e.event_sync_end(event, w, r),
        Answer::Forward,
        |a| a,
    )
}

/// Before libcuda looks at `event` (a wait for its work, if any, runs without the lock).
pub(crate) fn materialize(event: usize) {
    if let Some((fence, handle)) = with(|e| e.materialize_begin(event)).flatten() {
        let _ = wait_fence(&fence);
        with(|e| e.materialize_end(event, handle));
    }
}

/// Before libcuda looks at any event (a capture, a graph launch).
pub(crate) fn materialize_all() {
    with(|e| e.materialize_all());
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
    with(|e| e.function(function, handle, &name));
}

/// `function` is the same kernel as `kernel`.
pub(crate) fn same_function(function: usize, kernel: usize) {
    with(|e| e.same_function(function, kernel));
}

/// `module` is `library`'s.
pub(crate) fn library_module(module: usize, library: usize) {
    with(|e| e.library_module(module, library));
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
    with(|e| e.func_attribute(f, attr));
}

/// `cuCtxSetLimit`.
pub(crate) fn limit(limit: c_int, value: usize) {
    // CU_LIMIT_STACK_SIZE
    if limit == 0 && value > DEFAULT_STACK {
        with(|e| e.raise_stack());
    }
}

/// A stream was destroyed (its work was handed to CUDA before).
pub(crate) fn stream_destroyed(raw: usize) {
    with(|e| e.stream_destroyed(raw));
}

/// A stream capture began (`true`) or ended on the stream at `site`.
pub(crate) fn capture(raw: usize, per_thread: bool, begins: bool) {
    with(|e| e.capture(raw, per_thread, begins));
}

/// The program asked for a driver entry point in a variant the preload does not interpose: hand everything to CUDA
/// and stop taking launches over.
pub(crate) fn unknown_entry(name: &str) {
    with(|e| e.unknown_entry(name));
}

/// Hands everything to CUDA, drains the queues, writes the summary and drops APEX's objects (before the CUDA context
/// goes away: at exit, or before `cuCtxDestroy`/`cuDevicePrimaryCtxReset`).
pub(crate) fn shutdown(why: &str) {
    with(|e| e.shutdown(why));
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
