//! The preload's state and decisions: one attachment per CUDA context, one APEX queue per taken-over stream, the
//! function cache, the ordering of queues with CUDA streams ([`crate::order`]), synchronizations answered from APEX's
//! fences, events recorded after APEX's work, and device asserts. Every entry point takes the one lock; hooks call
//! them only from the outermost hook of a thread (never from APEX's own calls into libcuda). Calls on streams no queue
//! relates to skip the engine altogether once it has seen such a stream ([`plain`]).
//!
//! The launch path is one lock, one `cuCtxGetCurrent`, one load (is set-up work waiting to be picked up:
//! [`crate::setup`]), three lookups (context, function, stream) and APEX's prepared launch, which returns a ticket
//! rather than a reference-counted fence. What a launch needs and does not have yet (the context's attachment, its
//! stream's queue, its module) is prepared by the set-up worker while the launch goes to libcuda (`warmup`), unless
//! `APEX_PRELOAD_SETUP=inline` asks for it to be made on the spot ([`warmup`]).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use apex::{
    Arg, Backend, Fence, Gpu, Kernel, LaunchConfig, LaunchMemory, Module, PreparedLaunch, Queue,
    QueueOptions, Ticket,
};
use tracing::{debug, info, warn};

use crate::attrs::Extras;
use crate::cuda::{
    CUDA_ERROR_ASSERT, CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CudaSide, Libcuda, Pointer, ReleaseMark,
};
use crate::history::History;
use crate::lock::StoreLock;
use crate::order::{Hops, Order, Stream, StreamKey, Target};
use crate::registry::{ImageBytes, Owner, Registry};
use crate::setup::{self, Mode, Worker};
use crate::stats::Summary;
use crate::takeover::{Needs, Policy, Takeover};
use crate::{Refusal, check, image};

mod copies;
mod fast;
mod plain;
mod sync;
mod warmup;

use copies::Staging;
pub(crate) use copies::{CopyDir, CopyOp, SetOp};
pub(crate) use plain::Ticket as PlainTicket;
pub(crate) use sync::{Answer, CtxMark, Ordered, Step, SyncKind, Waits, sticky};
use sync::{Sleeper, SlotState, fence_state};

/// Prepared launch shapes kept per function (the least recently used is replaced beyond this).
const PREPARED_PER_FUNCTION: usize = 16;
/// The stack CUDA gives each thread unless the program raises `CU_LIMIT_STACK_SIZE` (APEX's queues start alike).
const DEFAULT_STACK: usize = 1024;

/// Launches (on any queue of the context) a stream must have made none of before its idle queue may be handed to
/// another stream: a few streams that take turns keep their queues, and a handover (a hop for the new stream's
/// first launch, events recorded in libcuda) is paid for by many launches on APEX.
const REASSIGN_AFTER_LAUNCHES: u64 = 64;

/// Kept events after a queue's work, at most, for it to be handed to another stream (each is recorded in libcuda
/// then).
const REASSIGN_MAX_KEPT_EVENTS: usize = 16;
/// How long one CPU wait on a queue looks before it checks again (a synchronize waits as long as the work runs).
const WAIT_SLICE: Duration = Duration::from_secs(3600);
/// Copies between the host and the device up to this size run on the stream's queue (the `.item()` and small
/// upload patterns); larger ones go to libcuda, whose copy engines and pinned staging suit them. Copies between
/// device buffers run on the queue at any size.
pub(crate) const COPY_MAX: usize = 256 << 10;
/// Each context's pinned staging ring for copies from and to pageable host memory.
const STAGING_BYTES: u64 = 1 << 20;
/// How long the end of the process or of a context waits for a set-up piece in flight (pieces take milliseconds;
/// compiling a large module's PTX, up to seconds) before it abandons it ([`setup::Worker::quiesce`]).
const SETUP_BOUND: Duration = Duration::from_secs(5);

/// Settings from the environment.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// Why the environment turns the takeover off for the process ([`off_in_env`]); `None`: on.
    pub off: Option<Refusal>,
    pub max_queues: usize,
    pub stats: Option<PathBuf>,
    /// Where the queues keep their rings and launch slots (`APEX_PRELOAD_LAUNCH_MEMORY=video|host`).
    pub launch_memory: LaunchMemory,
    /// `APEX_PRELOAD_CHAINED=1`: queues the GPU chains by itself (`QueueOptions::chained`). Launches made while a
    /// queue is busy are held as chain links until the program's next CUDA call other than a launch on the same
    /// stream (every such call sends them first). Off by default: a program that waits for a kernel through host
    /// memory the kernel writes, making no CUDA call meanwhile, would wait for ever for a held launch.
    pub chained: bool,
    /// `APEX_PRELOAD_SETUP`: where the set-up a launch needs is made ([`crate::setup`]).
    pub setup: Mode,
    /// `APEX_PRELOAD_QUEUES_AHEAD` (default 0): queues the background set-up builds before a stream asks, so that a
    /// new stream is taken over at its first launch. Off by default because a queue holds GPU memory whether or not
    /// a stream ever uses it: its local memory alone is sized for every thread the GPU can hold (about 430 MB on an
    /// H100 at the 1.6 KB per thread libcuda also starts with).
    pub queues_ahead: usize,
    /// `APEX_PRELOAD_TAKEOVER`: when a stream's launches start going through APEX ([`crate::takeover`]).
    pub takeover: Policy,
}

/// Whether a value of `APEX_PRELOAD_CHAINED` turns chained queues on (`1`, `on`, `true`).
pub(crate) fn chained_by(value: Option<&str>) -> bool {
    matches!(value, Some("1" | "on" | "true"))
}

/// Whether a value of `APEX_PRELOAD` leaves the takeover on (anything but `off`, `0` or `false`).
pub(crate) fn enabled_by(value: Option<&[u8]>) -> bool {
    !matches!(value, Some(b"off" | b"0" | b"false"))
}

/// Whether a value of `CUDA_LAUNCH_BLOCKING` makes libcuda's launches synchronous: one `atoi` reads as non-zero, as
/// libcuda reads it (`1`; `0`, `true` and unset do not).
pub(crate) fn launch_blocking_by(value: Option<&[u8]>) -> bool {
    let Some(v) = value else { return false };
    let v = v.trim_ascii_start();
    let digits = v
        .strip_prefix(b"-")
        .or_else(|| v.strip_prefix(b"+"))
        .unwrap_or(v);
    digits
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .any(|&b| b != b'0')
}

/// An environment variable's value, read without allocating (`getenv`).
fn env_bytes(name: &CStr) -> Option<&'static [u8]> {
    // SAFETY: a NUL-terminated name; the program does not change its environment while CUDA calls run.
    let p = unsafe { libc::getenv(name.as_ptr()) };
    // SAFETY: getenv's answer is null or a NUL-terminated string, which stays while the environment is unchanged.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// Why the environment turns the takeover off for the whole process, if it does: `APEX_PRELOAD=off`;
/// `CUDA_LAUNCH_BLOCKING=1`, with which libcuda makes every launch synchronous (so that an error shows at the launch
/// that caused it, what a program is run with to debug one) and APEX's asynchronous launches would not; or a CUDA
/// tool injected into the process (`CUDA_INJECTION64_PATH`; `NV_SANITIZER_INJECTION_PORT_BASE`, which
/// compute-sanitizer sets in its target, and `NV_NSIGHT_INJECTION_PORT_BASE`, which Nsight Compute sets: both seen
/// on CUDA 13.0), which sees, checks and times only the work libcuda runs. Read without allocating: the hooks ask on
/// their first call.
fn off_in_env() -> Option<Refusal> {
    if !enabled_by(env_bytes(c"APEX_PRELOAD")) {
        Some(Refusal::Disabled)
    } else if launch_blocking_by(env_bytes(c"CUDA_LAUNCH_BLOCKING")) {
        Some(Refusal::LaunchBlocking)
    } else if env_bytes(c"CUDA_INJECTION64_PATH").is_some_and(|v| !v.is_empty())
        || env_bytes(c"NV_SANITIZER_INJECTION_PORT_BASE").is_some()
        || env_bytes(c"NV_NSIGHT_INJECTION_PORT_BASE").is_some()
    {
        Some(Refusal::ToolInjected)
    } else {
        None
    }
}

/// Whether APEX has, or is making, anything a CUDA call must be ordered with: an attached context (queues, kept
/// events, fences) or an attach in flight. Until then every wrapped call but a launch (which counts towards its
/// stream's takeover) and the calls that keep the preload's own books (module loads, stream and event lifetimes,
/// captures, frees, teardown) goes straight to libcuda without the engine's lock: a program that APEX never takes
/// over — too short to earn a takeover, or all its kernels refused — pays one load per call. Set once, never
/// cleared (after a teardown the ordering paths stay, and answer quickly with nothing attached).
static ENGAGED: AtomicBool = AtomicBool::new(false);

/// The credit the launch hooks spend forwarding launches without the engine before anything is attached
/// ([`fast`]).
static FAST: fast::FastForward = fast::FastForward::new();

/// Streams no queue relates to, which the hooks forward calls on without the engine ([`plain`]).
static PLAIN: plain::Plain = plain::Plain::new();

/// What libcuda's launches cost in this process, timed on those forwarded on the credit ([`fast::LaunchCost`]).
static LIBCUDA_LAUNCH: fast::LaunchCost = fast::LaunchCost::new();

/// Hands a launch to libcuda (`forward`) on the credit, timing one in sixteen: what libcuda's launches cost prices
/// the takeovers ([`crate::takeover::Takeover::libcuda_launch_took`]).
pub(crate) fn forward_on_credit<R>(forward: impl FnOnce() -> R) -> R {
    LIBCUDA_LAUNCH.forward(forward)
}

/// Whether launch `l` goes to libcuda on the engine's credit, without the engine ([`fast`]): nothing is attached, and
/// the engine granted launches of this function on this stream.
pub(crate) fn fast_forward(l: &Launch) -> bool {
    // A launch with attributes APEX refuses is a refusal, which the engine counts as one.
    l.extras.is_ok() && !engaged() && FAST.spend(l.f, l.stream, l.per_thread)
}

/// Launches granted to the hooks ([`fast`]) for one stream, counted towards its takeover when settled.
#[derive(Debug)]
struct Grant {
    ctx: usize,
    key: StreamKey,
    granted: u64,
}

/// Whether APEX has, or is making, anything a CUDA call must be ordered with ([`ENGAGED`]).
pub(crate) fn engaged() -> bool {
    ENGAGED.load(Ordering::Acquire)
}

/// The takeover's switch: 0 not read yet, 1 on, 2 off (`APEX_PRELOAD=off`), 3 off (`CUDA_LAUNCH_BLOCKING=1`), 4 off
/// (a CUDA tool injected).
static SWITCH: AtomicU8 = AtomicU8::new(0);

/// Whether the environment turned the takeover off for the whole process ([`off_in_env`]). Then every hook forwards
/// at once (one load), launches are counted without the engine's lock, and `cuGetProcAddress` and `dlsym` hand out
/// libcuda's own functions for everything but launches, module loads and themselves: no queue can exist, so nothing
/// needs ordering.
pub(crate) fn disabled() -> bool {
    // A forked child forwards everything too: its copies of the engine and the allocation cache are the parent's
    // (a cached block answered there would be a success libcuda, unusable in a fork child, would not give).
    if FORKED.load(Ordering::Relaxed) {
        return true;
    }
    match SWITCH.load(Ordering::Relaxed) {
        1 => false,
        2..=4 => true,
        _ => {
            let switch = match off_in_env() {
                None => 1,
                Some(Refusal::LaunchBlocking) => 3,
                Some(Refusal::ToolInjected) => 4,
                Some(_) => 2,
            };
            SWITCH.store(switch, Ordering::Relaxed);
            switch != 1
        }
    }
}

/// Launches forwarded while the takeover is off (counted without the engine's lock; the summary adds them).
static DISABLED_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Counts a launch forwarded because `APEX_PRELOAD=off`.
pub(crate) fn count_disabled_launch() {
    DISABLED_LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

impl Config {
    fn from_env() -> Config {
        // As the hooks' switch read it (the environment may have changed since).
        let off = if disabled() {
            match SWITCH.load(Ordering::Relaxed) {
                3 => Some(Refusal::LaunchBlocking),
                4 => Some(Refusal::ToolInjected),
                // `APEX_PRELOAD=off` (a fork child never makes the engine).
                _ => Some(Refusal::Disabled),
            }
        } else {
            None
        };
        let max_queues = std::env::var("APEX_PRELOAD_QUEUES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8);
        let stats = std::env::var_os("APEX_PRELOAD_STATS").map(PathBuf::from);
        let launch_memory = match std::env::var("APEX_PRELOAD_LAUNCH_MEMORY").as_deref() {
            Ok("host") => LaunchMemory::Host,
            _ => LaunchMemory::Video,
        };
        let chained = chained_by(std::env::var("APEX_PRELOAD_CHAINED").ok().as_deref());
        let setup = Mode::by(std::env::var("APEX_PRELOAD_SETUP").ok().as_deref());
        let queues_ahead = std::env::var("APEX_PRELOAD_QUEUES_AHEAD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let takeover = Policy::by(std::env::var("APEX_PRELOAD_TAKEOVER").ok().as_deref())
            .unwrap_or_else(|e| {
                warn!("{e}; using earned");
                Policy::Earned
            });
        Config {
            off,
            max_queues,
            stats,
            launch_memory,
            chained,
            setup,
            queues_ahead,
            takeover,
        }
    }
}

/// `CU_LAUNCH_PARAM_END`, `CU_LAUNCH_PARAM_BUFFER_POINTER`, `CU_LAUNCH_PARAM_BUFFER_SIZE` (cuda.h).
const PARAM_END: usize = 0;
const PARAM_BUFFER_POINTER: usize = 1;
const PARAM_BUFFER_SIZE: usize = 2;
/// Entries of an `extra` array read before it is taken as unterminated.
const EXTRA_ENTRIES: usize = 16;

/// The arguments a launch passes in `extra` as one packed buffer: `Some((buffer, bytes))`, or `None` when `extra` is
/// null (arguments in `kernelParams`). Anything else the driver would refuse or that the preload does not know — both
/// `kernelParams` and `extra`, a key other than the buffer's pointer and size, no pointer, no size, an unterminated
/// array — is left to libcuda, which answers for it.
///
/// # Safety
/// `extra` must be null or the program's `extra` array as `cuLaunchKernel` reads it: key/value pairs ending in
/// `CU_LAUNCH_PARAM_END`, the size's value pointing at a `size_t`.
unsafe fn packed_params(
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<Option<(*const u8, usize)>, Refusal> {
    if extra.is_null() {
        return Ok(None);
    }
    if !params.is_null() {
        return Err(Refusal::ExtraParams);
    }
    let mut buffer: Option<*const u8> = None;
    let mut size: Option<usize> = None;
    for i in 0..EXTRA_ENTRIES {
        // SAFETY: the array's entries up to its END, per the contract.
        let key = unsafe { *extra.add(2 * i) } as usize;
        match key {
            PARAM_END => {
                return match (buffer, size) {
                    (Some(b), Some(n)) if !b.is_null() => Ok(Some((b, n))),
                    _ => Err(Refusal::ExtraParams),
                };
            }
            PARAM_BUFFER_POINTER => {
                // SAFETY: a key's value follows it.
                buffer = Some(unsafe { *extra.add(2 * i + 1) } as *const u8);
            }
            PARAM_BUFFER_SIZE => {
                // SAFETY: the value follows its key and points at a `size_t`.
                let p = unsafe { *extra.add(2 * i + 1) } as *const usize;
                if p.is_null() {
                    return Err(Refusal::ExtraParams);
                }
                // SAFETY: as above.
                size = Some(unsafe { p.read_unaligned() });
            }
            _ => return Err(Refusal::ExtraParams),
        }
    }
    Err(Refusal::ExtraParams)
}

/// The file the summary is written to: `path` with every `%p` replaced by the process id, so that the processes
/// of one job (torchrun's ranks, multiprocessing workers) each keep their own summary.
fn stats_path(path: &std::path::Path, pid: u32) -> PathBuf {
    match path.to_str() {
        Some(s) if s.contains("%p") => PathBuf::from(s.replace("%p", &pid.to_string())),
        _ => path.to_path_buf(),
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

/// Why a launch was not taken over.
pub(crate) enum NotTaken {
    /// A refusal made at this launch, still to be counted and logged.
    Refused(Refusal),
    /// A refusal the engine keeps (the takeover's, the context's, the function's, a launch shape's), counted by
    /// reference already: a launch refused for a kept reason allocates nothing, whatever text the reason carries.
    Counted,
    /// What the launch needs is being set up in the background: not a refusal (counted as `warmup`).
    SettingUp,
}

/// Why a function cannot be launched through APEX (yet).
enum Unresolved {
    Refused(Refusal),
    /// Its module is being loaded in the background.
    SettingUp(Owner),
}

impl From<Refusal> for Unresolved {
    fn from(r: Refusal) -> Unresolved {
        Unresolved::Refused(r)
    }
}

impl From<Refusal> for NotTaken {
    fn from(r: Refusal) -> NotTaken {
        NotTaken::Refused(r)
    }
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

/// A function the preload launches itself, in one context.
struct Ready {
    kernel: Kernel,
    /// Parameter sizes in order, from the cubin's table.
    sizes: Box<[usize]>,
    /// Their offsets in the parameter block (where a packed `extra` buffer holds them).
    offsets: Box<[usize]>,
    /// The parameter block's size, as the launch packs it (`EIATTR_PARAM_CBANK`): the bytes a packed `extra` buffer may
    /// hold at most.
    block: usize,
    owner: Owner,
    /// The most dynamic shared memory a launch may ask for (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` as
    /// libcuda last said; 0 once a set made it stale): a launch asking for more asks libcuda again, and is libcuda's
    /// to refuse if it still asks for more.
    max_dynamic_shared: u32,
    /// Most recently used first.
    prepared: Vec<Prepared>,
}

enum FuncState {
    Ready(Box<Ready>),
    Refused(Refusal),
    /// Waits for its owner's module, being loaded in the background (resolved again once it is there).
    Pending(Owner),
}

/// A queue's last work: a ticket (launches, memsets and copies between GPU addresses: no reference count) or a fence
/// (staged copies, joins).
pub(super) enum Last {
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

/// A stream APEX did not take over that, since libcuda last held work of it, has only waited for events the preload
/// kept: the one queue position it waits for lives here and libcuda holds none of it, until the stream gets work of
/// its own ([`Engine::make_real`]). NCCL's internal stream waits for the compute stream and is waited for by it around
/// every collective: kept here, neither wait reaches libcuda or crosses between APEX and CUDA on the GPU.
struct DependencyStream {
    slot: usize,
    /// The queue's launch the stream waits for.
    fence: Fence,
    /// The queue's release right after that launch, for libcuda to wait for once the stream gets work (`None`: the
    /// launch was complete when the stream began to wait for it).
    release: Option<ReleaseMark>,
}

/// The events a context keeps, each counted in the hooks' table ([`plain::Plain::keep`]) while it is kept, so
/// that a hook tells without the engine's lock that an event is not.
struct KeptEvents {
    map: Handles<VirtualEvent>,
    plain: &'static plain::Plain,
}

impl KeptEvents {
    fn new(plain: &'static plain::Plain) -> KeptEvents {
        KeptEvents {
            map: Handles::default(),
            plain,
        }
    }

    fn insert(&mut self, event: usize, v: VirtualEvent) {
        if self.map.insert(event, v).is_none() {
            self.plain.keep(event);
        }
    }

    fn remove(&mut self, event: &usize) -> Option<VirtualEvent> {
        let v = self.map.remove(event);
        if v.is_some() {
            self.plain.unkeep(*event);
        }
        v
    }

    fn get(&self, event: &usize) -> Option<&VirtualEvent> {
        self.map.get(event)
    }

    fn contains_key(&self, event: &usize) -> bool {
        self.map.contains_key(event)
    }

    fn iter(&self) -> impl Iterator<Item = (&usize, &VirtualEvent)> {
        self.map.iter()
    }

    fn keys(&self) -> impl Iterator<Item = &usize> {
        self.map.keys()
    }

    fn retain(&mut self, mut keep: impl FnMut(&usize, &mut VirtualEvent) -> bool) {
        let plain = self.plain;
        self.map.retain(|e, v| {
            let k = keep(e, v);
            if !k {
                plain.unkeep(*e);
            }
            k
        });
    }

    fn clear(&mut self) {
        self.retain(|_, _| false);
    }
}

impl Drop for KeptEvents {
    fn drop(&mut self) {
        self.clear();
    }
}

/// APEX inside one CUDA context.
struct Ctx {
    handle: usize,
    /// Shared with the set-up worker, which builds queues and loads modules of this GPU.
    gpu: Arc<Gpu>,
    /// Failed asserts end their thread, so kernels that call `__assertfail` run on APEX.
    asserts_on_apex: bool,
    modules: HashMap<Owner, Result<Module, Refusal>>,
    /// Modules unloaded by the program while APEX launches of theirs may still run: kept until the end.
    retired: Vec<Module>,
    funcs: Handles<FuncState>,
    queues: Vec<Option<Queue>>,
    /// Each slot's last launch.
    last: Vec<Option<Last>>,
    /// Queues serving no stream: of destroyed streams, or built ahead (in the background) for the next new stream.
    spare: Vec<Queue>,
    /// Queues the set-up worker is building for this context.
    building: usize,
    /// Streams that asked for a queue while none was ready (their launches go to libcuda until one is).
    wanted: Vec<StreamKey>,
    /// Why the context's queues can no longer be built (a build failed): streams without a queue stay on libcuda.
    queue_failed: Option<Refusal>,
    /// Modules the set-up worker is loading for this context, with the ticket of the job.
    loading: HashMap<Owner, u64>,
    order: Order,
    /// Stream handle → blocking (not `CU_STREAM_NON_BLOCKING`).
    blocking: Handles<bool>,
    events: KeptEvents,
    /// Streams that only wait, kept by the preload ([`DependencyStream`]), by handle.
    dependency: Handles<DependencyStream>,
    /// The preload's own stream for recording events (0 until first used).
    side: usize,
    /// Events of the preload's own whose synchronize sleeps, each with a stream of its own, free for the next wait
    /// that sleeps ([`Engine::sleep_ticket`]); libcuda frees them with the context.
    sleepers: Vec<Sleeper>,
    /// Pinned memory for copies from and to pageable host memory (made on first use).
    staging: Option<Staging>,
    /// CUDA work was submitted in this context since its last `cuCtxSynchronize` (launches left to libcuda, copies,
    /// hops): a context synchronize must then reach libcuda.
    cuda_work: bool,
    /// The count of calls the hooks forwarded on streams no queue relates to ([`plain`]) that the last context
    /// synchronize through libcuda covered: a different count is CUDA work too.
    plain_synced: u64,
    /// Set when APEX stops in this context (a replayed assert, a fault): launches go to libcuda.
    failed: Option<Refusal>,
    /// Bumped by every piece of work submitted in the context (APEX's or CUDA's): a synchronization through libcuda
    /// clears what it completed only if no work came in while it ran (from another thread).
    epoch: u64,
}

pub(crate) struct Engine {
    config: Config,
    /// What earlier runs of the program advise, and where this run's record goes.
    history: History,
    /// Shared with the set-up worker.
    cuda: Arc<dyn CudaSide>,
    /// The set-up worker ([`Mode::Background`]).
    setup: Worker,
    /// Launches each stream not taken over yet has made on libcuda, and when it is ([`crate::takeover`]).
    takeover: Takeover,
    /// Contexts the set-up worker is attaching to, with the ticket of the job.
    attaching: Handles<u64>,
    /// How long the end of the process or of a context waits for set-up in flight ([`SETUP_BOUND`]).
    setup_bound: Duration,
    registry: Registry,
    /// Image errors by module or library handle.
    unreadable: HashMap<usize, String>,
    /// Functions whose attributes the program set to something APEX does not apply.
    func_attrs: Handles<i32>,
    /// Per kernel name (as the program asked for it, and as its module spells it), the function handles resolved to
    /// a launch of APEX's in any context: the handles a set of the kernel's dynamic shared memory limit makes stale.
    kernel_handles: HashMap<String, Vec<usize>>,
    contexts: Vec<Ctx>,
    /// The context of the last launch (an index into `contexts`).
    recent: usize,
    /// Contexts APEX could not attach to, and why.
    unattached: Handles<Refusal>,
    /// Event handle → created with `CU_EVENT_DISABLE_TIMING` (only those are recorded by the preload itself).
    event_untimed: Handles<bool>,
    /// Events the program made with `CU_EVENT_BLOCKING_SYNC`: a synchronize on one sleeps, as in libcuda.
    event_sleeps: Handles<()>,
    /// Streams not taken over, by context and handle: their priority where it is above the default (kept on
    /// libcuda), else 0. Asked of libcuda once per stream, forgotten when it or its context is destroyed.
    stream_priorities: HashMap<(usize, usize), i32>,
    /// Streams being captured into a CUDA graph.
    capturing: HashSet<StreamKey>,
    stack_raised: bool,
    /// With chained queues ([`Config::chained`]): the stream whose queue may hold launches not sent yet. Only one
    /// queue holds at a time, so no hop ever waits for a value that was not sent.
    held: Option<StreamKey>,
    /// Set when the takeover stops for good (an entry point it cannot order with, an internal error, the end).
    off: Option<Refusal>,
    /// The launch path's argument list, reused (empty between launches).
    args: Vec<Arg<'static>>,
    /// A packed `extra` buffer shorter than the kernel's parameters, copied and padded with zeros (reused: its
    /// capacity grows to the largest parameter block once, so the launch path does not allocate after that).
    padded: Vec<u8>,
    summary: Summary,
    /// `APEX_PRELOAD_PROFILE`'s sums.
    phases: crate::profile::Phases,
    /// CUDA work the program gave libcuda, by driver function (into the summary's `cuda_work`): keyed by the name's
    /// address, which each hook passes as one literal, so counting hashes one word rather than the name.
    cuda_work: Handles<(&'static str, u64)>,
    /// Bumped whenever a context is attached or dropped or a stream taken over or released: an [`Ordered`] from an
    /// earlier generation is looked at again.
    generation: u64,
    logged: HashSet<(usize, &'static str)>,
    exit_hook: bool,
    /// The hooks' credit for launches forwarded without the engine (the process's one; a test engine's own).
    fast: &'static fast::FastForward,
    /// The streams the hooks forward calls on without the engine (the process's table; a test engine's own).
    plain: &'static plain::Plain,
    /// Stream handle → its own context (0: libcuda could not say), asked before a stream is remembered in `plain`.
    stream_ctx: Handles<usize>,
    /// What is granted on it now.
    grant: Option<Grant>,
    /// The context grants were made for: a second one stops them for good.
    grant_ctx: Option<usize>,
    grants_off: bool,
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
    with_engine(true, f)
}

/// As [`with`]; `send_held`: first send the launches a chained queue holds (every entry but a launch, which decides
/// for itself: [`Engine::launch`]).
fn with_engine<R>(send_held: bool, f: impl FnOnce(&mut Engine) -> R) -> Option<R> {
    if FORKED.load(Ordering::Relaxed) {
        return None;
    }
    resolve_driver_functions();
    // A panic inside `f` is contained below and turns the takeover off: there is no poisoning to undo.
    let mut guard = ENGINE.lock();
    let made = guard.is_none();
    let engine = guard.get_or_insert_with(|| Engine::new(Config::from_env(), Box::new(Libcuda)));
    if made {
        // Asked for after the lock is released ([`watch_cupti`]).
        WATCH_CUPTI.store(true, Ordering::Release);
    }
    let _busy = crate::watchdog::busy();
    let r = apex_interpose::quietly(|| {
        if send_held {
            engine.send_held();
        }
        f(engine)
    });
    if r.is_none() {
        engine.off.get_or_insert(Refusal::Internal);
        warn!("internal error in apex-preload: launches go to libcuda from now on");
    }
    drop(guard);
    if WATCH_CUPTI.load(Ordering::Acquire) {
        watch_cupti();
    }
    r
}

/// Whether libcuda's functions the engine calls were looked up ([`crate::cuda::resolve_driver_functions`]).
static DRIVER_RESOLVED: AtomicBool = AtomicBool::new(false);

/// Looks libcuda's functions up before the engine's lock is taken, until libcuda is found (then one load).
fn resolve_driver_functions() {
    if !DRIVER_RESOLVED.load(Ordering::Relaxed) && crate::cuda::resolve_driver_functions() {
        DRIVER_RESOLVED.store(true, Ordering::Relaxed);
    }
}

/// Set when the engine is made: CUPTI's activity switches are to be watched in the libraries loaded by then
/// ([`watch_cupti`]), outside the engine's lock.
static WATCH_CUPTI: AtomicBool = AtomicBool::new(false);

/// A profiler the program turns on (torch.profiler) must see its GPU work: CUPTI's switches are watched in the
/// libraries that import them by versioned references, when the engine is made and whenever a module load follows
/// libraries loaded since. The redirect itself runs on a thread of its own ([`crate::cupti::request_redirect`]),
/// which holds no lock of the program's: it takes the loader's lock, which a thread inside `dlopen` holds while its
/// constructors call CUDA (and with it cudart's and the engine's locks).
fn watch_cupti() {
    if cfg!(test) || disabled() || crate::exit_safe::is_exiting() {
        return;
    }
    if WATCH_CUPTI.swap(false, Ordering::AcqRel) {
        crate::cupti::request_redirect();
    } else {
        crate::cupti::request_redirect_if_loaded();
    }
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
pub(crate) fn wait_fence(fence: &Fence) -> Result<(), String> {
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
        with(|e| e.record_run());
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
            StreamKey::Legacy | StreamKey::PerThread(_) => true,
            StreamKey::Handle(h) => *self
                .blocking
                .entry(h)
                .or_insert_with(|| cuda.stream_blocking(h)),
        };
        Stream { key, blocking }
    }

    /// Runs work other than a launch (a copy, a memset) on `slot`'s queue in stream order, as a launch runs: the
    /// queue waits for its stream's CUDA work first, and the work's fence becomes the slot's last launch. `work`
    /// gets the queue and the context's staging ring.
    fn run_on_queue(
        &mut self,
        cuda: &dyn CudaSide,
        slot: usize,
        work: impl FnOnce(&mut Queue, &mut Option<Staging>) -> Result<Last, String>,
    ) -> Result<(), String> {
        self.epoch += 1;
        let (mut hops, order) = self.hops(cuda);
        order.before_apex(slot, &mut hops)?;
        let queue = self.queues[slot]
            .as_mut()
            .ok_or_else(|| format!("no queue in slot {slot}"))?;
        let last = work(queue, &mut self.staging)?;
        self.order.after_apex(slot);
        self.last[slot] = Some(last);
        Ok(())
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
        let cuda: Arc<dyn CudaSide> = Arc::from(cuda);
        // Tests' engines neither read nor leave records.
        let history = if cfg!(test) || config.off.is_some() {
            History::off()
        } else {
            History::open()
        };
        let mut takeover = Takeover::new(config.takeover);
        if history.advised() {
            takeover.advise();
        }
        let mut engine = Engine {
            off: config.off.clone(),
            takeover,
            history,
            config,
            setup: Worker::new(cuda.clone()),
            attaching: Handles::default(),
            setup_bound: SETUP_BOUND,
            cuda,
            registry: Registry::new(),
            unreadable: HashMap::new(),
            func_attrs: Handles::default(),
            kernel_handles: HashMap::new(),
            contexts: Vec::new(),
            recent: 0,
            unattached: Handles::default(),
            event_untimed: Handles::default(),
            event_sleeps: Handles::default(),
            stream_priorities: HashMap::new(),
            capturing: HashSet::new(),
            stack_raised: false,
            held: None,
            args: Vec::new(),
            padded: Vec::new(),
            summary: Summary {
                attach: "not attempted".into(),
                ..Summary::default()
            },
            phases: crate::profile::Phases::default(),
            cuda_work: Handles::default(),
            generation: 0,
            logged: HashSet::new(),
            exit_hook: false,
            // Tests run many engines at once: each gets a credit of its own.
            fast: if cfg!(test) {
                Box::leak(Box::new(fast::FastForward::new()))
            } else {
                &FAST
            },
            plain: if cfg!(test) {
                Box::leak(Box::new(plain::Plain::new()))
            } else {
                &PLAIN
            },
            stream_ctx: Handles::default(),
            grant: None,
            grant_ctx: None,
            grants_off: false,
        };
        if engine.config.off.is_some() {
            // No context is ever attached with the takeover off: the summary is written at exit all the same.
            engine.exit_hooks();
        }
        engine
    }

    /// Starts a new generation: [`Ordered`] answers from before are looked at again, and the hooks forget the
    /// streams they forwarded calls on without the engine ([`plain`]). Called before a context is attached or a
    /// stream taken over or released, so that a call forwarded without the engine either ended before the change or
    /// is ordered by the engine after it.
    fn new_generation(&mut self) {
        self.plain.forget_streams();
        self.generation += 1;
    }

    /// Registers the exit handler (after the CUDA runtime's own, so it runs before the context goes away) and the
    /// fork handler, once.
    fn exit_hooks(&mut self) {
        if !self.exit_hook {
            // SAFETY: plain `extern "C" fn()` callbacks.
            unsafe {
                libc::atexit(at_exit);
                libc::pthread_atfork(None, None, Some(in_fork_child));
            }
            self.exit_hook = true;
        }
    }

    /// The summary so far (hop counts included).
    pub(crate) fn summary(&self) -> Summary {
        let mut s = self.summary.clone();
        if let Some(g) = &self.grant {
            let spent = g.granted.saturating_sub(self.fast.left());
            s.launches += spent;
            s.warmup += spent;
        }
        for c in &self.contexts {
            s.add_hops(c.order.counts());
        }
        s.modules_seen = s.modules_seen.max(self.registry.len() as u64);
        if let Some(c) = crate::alloc_cache::lock() {
            let a = c.stats();
            s.alloc_cache_hits = a.hits;
            s.alloc_cache_misses = a.misses;
            s.alloc_cache_peak_bytes = a.peak_bytes;
            s.alloc_cache_held_bytes = a.held_bytes;
            s.alloc_async_hits = a.async_hits;
            s.alloc_async_misses = a.async_misses;
            s.alloc_async_unready = a.async_unready;
            s.alloc_async_kept = a.async_kept;
        }
        s.profile = self.phases.report().into_iter().collect();
        s.setup.mode = self.config.setup.label().to_string();
        s.setup.takeover = self.takeover.policy().label();
        s.setup.history = self.history.describe();
        if self.history.advised() && !self.takeover.advised() {
            s.setup
                .history
                .push_str(" (not followed: the policy is not earned)");
        }
        s.setup.streams_not_earned += self.takeover.counted();
        s.setup.modules_owed_ms = self.takeover.owed_total_ns() as f64 / 1e6;
        s.setup.libcuda_launch_ns = LIBCUDA_LAUNCH.estimate();
        for (name, n) in self.cuda_work.values() {
            *s.cuda_work.entry(name.to_string()).or_default() += n;
        }
        for (name, n) in self.plain.counted() {
            *s.cuda_work.entry(name.to_string()).or_default() += n;
        }
        let off = DISABLED_LAUNCHES.load(Ordering::Relaxed);
        if let (Some(r), true) = (&self.config.off, off > 0) {
            s.launches += off;
            s.fallback += off;
            let e = s.reasons.entry(r.label().to_string()).or_default();
            e.launches += off;
            if e.example.is_empty() {
                e.example = r.to_string();
            }
        }
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

    /// Context `handle` (the one current on this thread), attached to on first use (launch `f` is the one asking: a
    /// refusal kept for the context is counted for it). In the background mode the attach is the set-up worker's:
    /// `NotTaken::SettingUp` until it is picked up.
    fn context_of(&mut self, handle: usize, f: usize) -> Result<usize, NotTaken> {
        if let Some(i) = self.find_context(handle) {
            return Ok(i);
        }
        if let Some(r) = self.unattached.get(&handle) {
            self.summary.refused(r);
            if self.logged.insert((f, r.label())) {
                info!(function = format_args!("{f:#x}"), reason = %r, "launch left to libcuda");
            }
            return Err(NotTaken::Counted);
        }
        if self.attaching.contains_key(&handle) {
            return Err(NotTaken::SettingUp);
        }
        if self.config.setup == Mode::Background {
            // Registered now, so that the end of the process waits for the attach (and drops what it made).
            self.exit_hooks();
            let job = setup::Job::Attach {
                ctx: handle,
                options: self.queue_options(),
            };
            if let Some(ticket) = self.request(job) {
                info!(
                    ctx = format_args!("{handle:#x}"),
                    "apex-preload attaches to the CUDA context in the background; launches go to libcuda meanwhile"
                );
                ENGAGED.store(true, Ordering::Release);
                self.attaching.insert(handle, ticket);
                self.summary.attach = "being set up in the background".into();
                return Err(NotTaken::SettingUp);
            }
        }
        let started = Instant::now();
        self.exit_hooks();
        let result = self
            .cuda
            .attach()
            .map(|(gpu, asserts)| (Arc::new(gpu), asserts));
        let took = started.elapsed();
        self.summary.setup.attach.add(took);
        if result.is_ok() {
            self.takeover.attach_took(took);
        }
        Ok(self.adopt(handle, result, None)?)
    }

    /// Whether a launch on stream `key` of context `handle` (attached as `found`), a stream not taken over yet, has
    /// earned the stream's takeover ([`crate::takeover`]); counted as one more launch on libcuda if not.
    fn takeover_earned(
        &mut self,
        handle: usize,
        found: Option<usize>,
        key: StreamKey,
        f: usize,
    ) -> bool {
        // The summary is written at exit even if no stream is ever taken over (a launch ran: the CUDA runtime's own
        // exit handler is registered by now, so this one runs first).
        self.exit_hooks();
        let needs = match found {
            None => Needs::Attach,
            Some(ci) => {
                let ctx = &self.contexts[ci];
                if ctx.failed.is_some() || ctx.queue_failed.is_some() {
                    // Nothing to pay for: the launch goes on to its refusal, counted as one.
                    return true;
                }
                if !ctx.spare.is_empty() || ctx.gpu.queue_is_built(self.queue_options()) {
                    Needs::Nothing
                } else {
                    Needs::Queue
                }
            }
        };
        // The kernel's module, if APEX has not loaded it, is loaded at the takeover: its price is part of it.
        if self.takeover.policy() == Policy::Earned
            && let Some(owner) = self.registry.origin(f).map(|o| o.owner)
            && !self.takeover.owes(handle, owner)
            && !found.is_some_and(|ci| self.contexts[ci].modules.contains_key(&owner))
            && let Some(image) = self.registry.image(owner)
        {
            self.takeover.owe_module(handle, owner, image.bytes().len());
        }
        self.takeover.libcuda_launch_took(LIBCUDA_LAUNCH.estimate());
        self.takeover.earned(handle, key, needs)
    }

    /// Keeps the outcome of attaching to context `handle` (and the GPU's `first` queue, when the set-up worker took
    /// it): the context's index, or the refusal its launches get from now on.
    fn adopt(
        &mut self,
        handle: usize,
        result: Result<(Arc<Gpu>, bool), String>,
        first: Option<Result<Queue, String>>,
    ) -> Result<usize, Refusal> {
        self.exit_hooks();
        self.new_generation();
        let result = match result {
            Ok((gpu, asserts)) if gpu.backend() == Backend::Direct => {
                ENGAGED.store(true, Ordering::Release);
                self.takeover.attached(handle);
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
                let mut spare = Vec::new();
                let mut queue_failed = None;
                match first {
                    Some(Ok(q)) => {
                        self.summary.queues += 1;
                        spare.push(q);
                    }
                    Some(Err(e)) => {
                        warn!(error = %e, "the context's first APEX queue could not be built");
                        self.summary.setup.failed += 1;
                        queue_failed = Some(Refusal::QueueFailed(e));
                    }
                    None => {}
                }
                self.contexts.push(Ctx {
                    handle,
                    gpu,
                    asserts_on_apex,
                    modules: HashMap::new(),
                    retired: Vec::new(),
                    funcs: Handles::default(),
                    queues: Vec::new(),
                    last: Vec::new(),
                    spare,
                    building: 0,
                    wanted: Vec::new(),
                    queue_failed,
                    loading: HashMap::new(),
                    order: Order::new(),
                    blocking: Handles::default(),
                    events: KeptEvents::new(self.plain),
                    dependency: Handles::default(),
                    side: 0,
                    sleepers: Vec::new(),
                    staging: None,
                    cuda_work: true,
                    plain_synced: 0,
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
            // A stream taken over or kept as waits only is its context's whatever context is current: a thread may
            // work on another device's stream.
            if let StreamKey::Handle(h) = key
                && let Some(i) = self
                    .contexts
                    .iter()
                    .position(|c| c.order.find(key).is_some() || c.dependency.contains_key(&h))
            {
                return Some(i);
            }
        }
        let handle = self.cuda.current_context()?;
        self.find_context(handle)
    }

    // ---- launches ----

    /// Takes launch `l` over; `s` gets the profile's stamps (see [`crate::profile::Phases::add`]).
    fn try_launch(&mut self, l: &Launch, s: &mut [u64; 6]) -> Result<(), NotTaken> {
        if let Some(r) = &self.off {
            self.summary.refused(r);
            if self.logged.insert((l.f, r.label())) {
                info!(function = format_args!("{:#x}", l.f), reason = %r, "launch left to libcuda");
            }
            return Err(NotTaken::Counted);
        }
        if !self.capturing.is_empty() {
            return Err(Refusal::Capturing.into());
        }
        if crate::cupti::recording() {
            return Err(Refusal::Profiled.into());
        }
        let extras = match &l.extras {
            Ok(e) => *e,
            // An attribute refusal carries no text of its own: the clone allocates nothing.
            Err(r) => return Err(r.clone().into()),
        };
        let key = StreamKey::of(l.stream, l.per_thread);
        // SAFETY: `extra` is the program's `extra` array, as the driver would read it.
        let packed = unsafe { packed_params(l.params, l.extra) }?;
        if self.stack_raised {
            return Err(Refusal::ContextLimit.into());
        }
        let handle = self.cuda.current_context().ok_or(Refusal::NoContext)?;
        // The stream's slot when it is taken over already (the hot path: looked up once, used below).
        let found = self.find_context(handle);
        let taken = found.and_then(|ci| self.contexts[ci].order.find(key));
        let ci = match (found, taken) {
            (Some(ci), Some(_)) => ci,
            _ => {
                // A function already refused in this context pays nothing towards its stream's takeover.
                if let Some(ci) = found
                    && self.contexts[ci].failed.is_none()
                    && let Some(FuncState::Refused(r)) = self.contexts[ci].funcs.get(&l.f)
                {
                    self.summary.refused(r);
                    return Err(NotTaken::Counted);
                }
                // A stream made with a priority above the default stays on libcuda, which schedules its work ahead
                // of other streams' (APEX's queues are all of one priority).
                if let StreamKey::Handle(h) = key {
                    let cuda = self.cuda.as_ref();
                    // Bounded: a program that drops streams without destroying them through CUDA leaves entries.
                    if self.stream_priorities.len() >= 4096
                        && !self.stream_priorities.contains_key(&(handle, h))
                    {
                        self.stream_priorities.clear();
                    }
                    let p = *self
                        .stream_priorities
                        .entry((handle, h))
                        .or_insert_with(|| cuda.stream_priority(h).min(0));
                    if p < 0 {
                        return Err(Refusal::StreamPriority(p).into());
                    }
                }
                if !self.unattached.contains_key(&handle)
                    && !self.takeover_earned(handle, found, key, l.f)
                {
                    return Err(NotTaken::SettingUp);
                }
                self.context_of(handle, l.f)?
            }
        };
        s[2] = crate::profile::stamp();
        if let Some(r) = &self.contexts[ci].failed {
            // Logged when the context failed.
            self.summary.refused(r);
            return Err(NotTaken::Counted);
        }
        // A failed assert of an earlier launch stops the context's work here, as CUDA's trap stops it (one cached
        // word read): the assert is reported, and the launch goes to libcuda, which fails it.
        if self.contexts[ci].asserts_on_apex && self.contexts[ci].gpu.device_assert_pending() {
            let _ = self.report_asserts(ci);
            return Err(Refusal::AssertReported.into());
        }
        // A function refused at this launch is logged with it; later launches count the kept refusal by reference.
        let mut fresh = false;
        let known = match self.contexts[ci].funcs.get(&l.f) {
            None => false,
            // Waiting for its module: resolved again once the module is no longer loading (loaded, refused, or the
            // load withdrawn).
            Some(FuncState::Pending(owner)) => self.contexts[ci].loading.contains_key(owner),
            Some(_) => true,
        };
        if !known {
            // A slow path: not profiled.
            s[0] = 0;
            let state = match self.resolve(ci, l.f) {
                Ok(r) => {
                    let asked = self.registry.origin(l.f).map(|o| o.name.as_str());
                    for name in [Some(r.kernel.name()), asked].into_iter().flatten() {
                        let handles = self.kernel_handles.entry(name.to_string()).or_default();
                        if !handles.contains(&l.f) {
                            handles.push(l.f);
                        }
                    }
                    FuncState::Ready(Box::new(r))
                }
                Err(Unresolved::SettingUp(owner)) => FuncState::Pending(owner),
                Err(Unresolved::Refused(r)) if r.is_per_function() => FuncState::Refused(r),
                // Not the function's fault (an internal error): decided again next time.
                Err(Unresolved::Refused(r)) => return Err(r.into()),
            };
            self.contexts[ci].funcs.insert(l.f, state);
            fresh = true;
        }
        // A refused function's launch stays on libcuda without taking its stream over: a stream whose kernels APEX
        // refuses (NCCL's) would get a queue it never uses, and its libcuda launches would be ordered against it.
        if taken.is_none()
            && let Some(FuncState::Refused(r)) = self.contexts[ci].funcs.get(&l.f)
        {
            if fresh {
                return Err(r.clone().into());
            }
            self.summary.refused(r);
            return Err(NotTaken::Counted);
        }
        // `None`: the stream's queue is being built in the background.
        let slot = match taken {
            Some(slot) => Some(slot),
            None => {
                s[0] = 0;
                let slot = self.slot_for(ci, key, l.stream, l.per_thread)?;
                if slot.is_some() {
                    self.takeover.taken(handle, key);
                }
                slot
            }
        };
        // The doorbell once the launch's ticket is back (below); not on a chained queue, where flushing would send the
        // links it holds.
        let defer = !self.config.chained;
        let Engine {
            contexts,
            args,
            padded,
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
            Some(FuncState::Refused(r)) if fresh => return Err(r.clone().into()),
            Some(FuncState::Refused(r)) => {
                summary.refused(r);
                return Err(NotTaken::Counted);
            }
            Some(FuncState::Pending(_)) => return Err(NotTaken::SettingUp),
            None => return Err(Refusal::Internal.into()),
        };
        let Some(slot) = slot else {
            return Err(NotTaken::SettingUp);
        };
        if packed.is_none() && l.params.is_null() && !ready.sizes.is_empty() {
            return Err(Refusal::ExtraParams.into());
        }
        if l.shared > ready.max_dynamic_shared {
            // The limit may have been raised through another handle of the kernel, or marked stale (0) by a set:
            // libcuda says, for this context's device.
            ready.max_dynamic_shared = cuda.max_dynamic_shared(l.f).unwrap_or_else(|| {
                default_dynamic_shared(ready.kernel.info().map_or(0, |i| i.static_shared))
            });
            if l.shared > ready.max_dynamic_shared {
                return Err(Refusal::LaunchRefused(format!(
                    "{} bytes of dynamic shared memory exceed the function's limit of {} \
                     (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                    l.shared, ready.max_dynamic_shared
                ))
                .into());
            }
        }
        let cfg = LaunchConfig::new(l.grid, l.block)
            .with_shared_bytes(l.shared)
            .with_cluster_shape(extras.cluster)
            .with_sync_domain(extras.sync_domain)
            .with_cluster_policy(extras.cluster_policy);
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
                    fresh = true;
                    summary.prepared_shapes += 1;
                    let queue = queues[slot].as_mut().ok_or(Refusal::Internal)?;
                    let launch = queue
                        .prepare(&ready.kernel, &cfg)
                        .map_err(|e| Refusal::LaunchRefused(e.to_string()));
                    ready.prepared.truncate(PREPARED_PER_FUNCTION - 1);
                    ready.prepared.insert(0, Prepared { slot, cfg, launch });
                }
            }
            match &ready.prepared[0].launch {
                Ok(p) => Some(p),
                Err(r) if fresh => return Err(r.clone().into()),
                Err(r) => {
                    summary.refused(r);
                    return Err(NotTaken::Counted);
                }
            }
        };
        // The arguments: one pointer per parameter, each to a value of the parameter's size.
        args.clear();
        if let Some((buffer, len)) = packed {
            // One packed buffer (`CU_LAUNCH_PARAM_BUFFER_POINTER`, as NCCL passes its arguments): each parameter at
            // its offset in the parameter table, as the driver lays the buffer into constant bank 0. The driver
            // takes a buffer shorter than the parameters (NCCL passes the bytes its arguments use of a 4 KiB
            // parameter, rounded to 16) and no longer: the rest is zero here.
            if len > ready.block {
                return Err(Refusal::ExtraParams.into());
            }
            // SAFETY: the program's buffer holds `len` readable bytes during this call.
            let given = unsafe { std::slice::from_raw_parts(buffer, len) };
            let bytes: &[u8] = if len == ready.block {
                given
            } else {
                padded.clear();
                padded.extend_from_slice(given);
                padded.resize(ready.block, 0);
                padded.as_slice()
            };
            for (&offset, &size) in ready.offsets.iter().zip(ready.sizes.iter()) {
                // SAFETY: `bytes` (the program's buffer or `padded`, untouched until the next launch) outlives the
                // slice, which is removed from `args` before this function returns.
                let arg: &'static [u8] =
                    unsafe { std::slice::from_raw_parts(bytes.as_ptr().add(offset), size) };
                args.push(Arg::Bytes(arg));
            }
        } else {
            for (i, &size) in ready.sizes.iter().enumerate() {
                // SAFETY: the driver API passes one pointer per kernel parameter in `kernelParams`; the parameter table
                // says how many there are.
                let p = unsafe { *l.params.add(i) } as *const u8;
                if p.is_null() {
                    args.clear();
                    return Err(Refusal::ExtraParams.into());
                }
                // SAFETY: the program passes a value of the parameter's size at `p`, readable during this call; the
                // slice is removed from `args` before this function returns, so the 'static it is given never escapes.
                args.push(Arg::Bytes(unsafe { std::slice::from_raw_parts(p, size) }));
            }
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
            return Err(
                Refusal::LaunchFailed(format!("ordering with the CUDA stream: {e}")).into(),
            );
        }
        s[4] = crate::profile::stamp();
        // The slot's previous last launch, put back if this launch fails. Usually a ticket, a plain copy; a fence
        // (the last was a copy or a wait) is dropped after the doorbell, a locked instruction that waits for the
        // doorbell's write to leave the core, once after such work.
        let previous = last[slot].take();
        let Some(queue) = queues[slot].as_mut() else {
            args.clear();
            last[slot] = previous;
            return Err(Refusal::Internal.into());
        };
        // SAFETY: the program launches this kernel with these arguments on this stream; CUDA would run it the same
        // way, and the queue is ordered with the stream.
        let result = unsafe {
            match prepared {
                Some(p) => {
                    let mut launch = apex::Launch::prepared(p, args);
                    if extras.programmatic {
                        launch = launch.programmatic();
                    }
                    if defer {
                        launch = launch.deferred();
                    }
                    queue.submit(&launch)
                }
                // A cooperative launch runs in plain stream order, which programmatic serialization allows.
                None => queue.submit(&apex::Launch::new(&ready.kernel, &cfg, args).cooperative()),
            }
        };
        // The doorbell once the launch call has returned its ticket ([`Launch::deferred`](apex::Launch::deferred)),
        // not inside it: the doorbell's store fences and uncached store leave the core only after the call, and until
        // they have, a load the CPU cannot forward from a store made after them waits for them (moving the ticket
        // into `last` is a 16-byte copy of what the call stored as two 8-byte words): 0.3-0.4 µs of the hook on an
        // H200 host. Returned before the doorbell, the ticket waits for nothing, and the GPU still hears of the
        // launch right after its writes.
        if defer
            && prepared.is_some()
            && result.is_ok()
            && let Err(e) = queue.flush()
        {
            // Only an open chain can fail to send, and a queue of the preload has none.
            warn!(error = %e, "ringing a queue's doorbell failed");
        }
        args.clear();
        *epoch += 1;
        match result {
            Ok(ticket) => {
                order.after_apex(slot);
                last[slot] = Some(Last::Ticket(ticket));
                s[5] = crate::profile::stamp();
                drop(previous);
                Ok(())
            }
            Err(e) => {
                // Nothing was sent: the slot's last launch is still the one before, which synchronizations wait for.
                last[slot] = previous;
                // A shape the checks refuse (a cooperative grid that cannot be resident, checked at its launch since
                // cooperative launches are not prepared) is a refusal, as at `prepare`; anything else a failure.
                let refused = matches!(
                    e,
                    apex::Error::Direct(apex::launch::Error::InvalidLaunch { .. })
                );
                Err(match refused {
                    true => Refusal::LaunchRefused(e.to_string()),
                    false => Refusal::LaunchFailed(e.to_string()),
                }
                .into())
            }
        }
    }

    /// Sends the launches a chained queue holds ([`Config::chained`]); nothing to do (one load) otherwise.
    pub(crate) fn send_held(&mut self) {
        if self.held.take().is_none() {
            return;
        }
        for c in &mut self.contexts {
            for q in c.queues.iter_mut().flatten() {
                if let Err(e) = q.flush() {
                    warn!(error = %e, "sending the launches a chained queue held failed");
                }
            }
        }
    }

    /// Takes launch `l` over if it can; `Some(stamp)` when it did (`t0`: the profile's stamp at the hook's entry; the
    /// stamp returned starts the profile's last phase).
    pub(crate) fn launch(&mut self, l: &Launch, t0: u64) -> Option<u64> {
        let mut s = [t0, crate::profile::stamp(), 0, 0, 0, 0];
        if self.grant.is_some() {
            self.settle_grant();
        }
        // One load, unless the set-up worker finished something since the last launch.
        if self.setup.has_results() {
            // A slow path: not profiled.
            s[0] = 0;
            self.collect();
        }
        let key = StreamKey::of(l.stream, l.per_thread);
        if self.held.is_some_and(|h| h != key) {
            // Work on another stream may be ordered after the held launches: they go first.
            self.send_held();
        }
        match self.try_launch(l, &mut s) {
            Ok(()) => {
                if self.config.chained {
                    self.held = Some(key);
                }
                self.summary.taken();
                self.phases.add(&s);
                // 0 when the launch took a slow path: its last phase is not counted either.
                Some(if s[0] == 0 { 0 } else { s[5] })
            }
            Err(NotTaken::Refused(r)) => {
                if self.logged.insert((l.f, r.label())) {
                    info!(function = format_args!("{:#x}", l.f), reason = %r, "launch left to libcuda");
                }
                self.summary.refused(&r);
                None
            }
            Err(NotTaken::Counted) => None,
            Err(NotTaken::SettingUp) => {
                self.summary.warmed();
                self.grant_forwarding(l);
                None
            }
        }
    }

    /// Counts the launches the hooks forwarded on the grant ([`fast`]) towards its stream's takeover, and ends it.
    fn settle_grant(&mut self) {
        let Some(g) = self.grant.take() else { return };
        let spent = g.granted.saturating_sub(self.fast.revoke());
        if spent > 0 {
            self.summary.launches += spent;
            self.summary.warmup += spent;
            self.takeover.paid(g.ctx, g.key, spent);
        }
    }

    /// After launch `l` went to libcuda to pay towards an attach: lets the hooks forward the stream's next launches
    /// of the same function themselves, one fewer than the stream still has to pay ([`fast`]).
    fn grant_forwarding(&mut self, l: &Launch) {
        // A per-thread default stream is named alike in every thread: a credit for it would be spent by all of them.
        if self.grants_off
            || StreamKey::of(l.stream, l.per_thread).is_per_thread()
            || !self.contexts.is_empty()
            || !self.attaching.is_empty()
            || self.off.is_some()
            || !self.capturing.is_empty()
        {
            return;
        }
        let Some(ctx) = self.cuda.current_context() else {
            return;
        };
        if *self.grant_ctx.get_or_insert(ctx) != ctx {
            // Two contexts: a credit cannot tell whose launch spends it.
            self.grants_off = true;
            return;
        }
        let key = StreamKey::of(l.stream, false);
        let n = self
            .takeover
            .left_to_attach(ctx, key)
            .saturating_sub(1)
            .min(fast::MAX_GRANT);
        if n == 0 {
            return;
        }
        // Its module is priced by now (the launch went through `takeover_earned`).
        self.fast.saw(l.f);
        self.fast.grant(l.stream, n);
        self.grant = Some(Grant {
            ctx,
            key,
            granted: n,
        });
    }

    /// The image an owner's kernels come from, loaded by APEX once per context: `None` while the set-up worker
    /// loads it (asked for here the first time).
    fn module(&mut self, ci: usize, owner: Owner) -> Result<Option<Module>, Refusal> {
        let ctx = &self.contexts[ci];
        if let Some(m) = ctx.modules.get(&owner) {
            return m.clone().map(Some);
        }
        if ctx.loading.contains_key(&owner) {
            return Ok(None);
        }
        let image = self.registry.image(owner).ok_or(Refusal::UnknownModule)?;
        let library = self.registry.is_library(owner);
        let (handle, asserts, gpu) = (ctx.handle, ctx.asserts_on_apex, ctx.gpu.clone());
        if self.config.setup == Mode::Background {
            let job = setup::Job::Module {
                ctx: handle,
                gpu: gpu.clone(),
                owner,
                library,
                image: image.clone(),
                asserts,
            };
            if let Some(ticket) = self.request(job) {
                self.contexts[ci].loading.insert(owner, ticket);
                return Ok(None);
            }
            // The worker could not start: loaded here, as in the inline mode.
        }
        let started = Instant::now();
        let (loaded, placing) = setup::load_module_timed(
            self.cuda.as_ref(),
            &gpu,
            owner,
            library,
            image.bytes(),
            asserts,
        );
        let took = started.elapsed();
        self.summary.setup.module.add(took);
        // Only loads that did the work price later ones (a refusal can come early); CUDA's loading of its own
        // instance (asked where the variables live) is not APEX's price.
        if loaded.is_ok() {
            self.takeover
                .module_took(image.bytes().len(), took.saturating_sub(placing));
        }
        self.module_loaded(ci, owner, loaded).map(Some)
    }

    /// Keeps a module loaded for context `ci` (or the refusal its kernels get).
    fn module_loaded(
        &mut self,
        ci: usize,
        owner: Owner,
        loaded: Result<Module, Refusal>,
    ) -> Result<Module, Refusal> {
        if loaded.is_ok() {
            self.summary.modules_loaded += 1;
        }
        debug!(
            owner = format_args!("{owner:#x}"),
            ok = loaded.is_ok(),
            "module loaded for APEX"
        );
        self.takeover.module_loaded(self.contexts[ci].handle, owner);
        self.contexts[ci].modules.insert(owner, loaded.clone());
        loaded
    }

    fn resolve(&mut self, ci: usize, f: usize) -> Result<Ready, Unresolved> {
        if let Some(&attr) = self.func_attrs.get(&f) {
            return Err(Refusal::FunctionAttribute(attr).into());
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
                    return Err(Refusal::UnreadableImage(e.clone()).into());
                }
                self.registry.function(f, handle, &name);
                self.registry
                    .origin(f)
                    .cloned()
                    .ok_or(Refusal::UnknownModule)?
            }
        };
        let Some(module) = self.module(ci, origin.owner)? else {
            return Err(Unresolved::SettingUp(origin.owner));
        };
        // `__device__` variables are shared with CUDA's instance, and so is the `__constant__` bank where CUDA said
        // where it lives; otherwise `__constant__` variables are APEX's own copy, which a write through the address
        // the program took would miss.
        let constants_shared = module.shares_constants();
        let library = self.registry.is_library(origin.owner);
        let cuda = self.cuda.as_ref();
        // A shared bank was checked against a sample of its variables: each one whose address the program took is
        // checked exactly (where CUDA has it is where APEX's launches read it).
        let same_home = |name: &str| {
            let ours = module.global(name).ok().map(|g| g.device_ptr());
            ours.is_some() && cuda.global(origin.owner, library, name).map(|h| h.address) == ours
        };
        let constant_escaped = self.registry.escaped(origin.owner).iter().any(|name| {
            name.as_deref()
                .and_then(|n| module.cubin().and_then(|c| c.global(n)).map(|g| (n, g)))
                .is_none_or(|(n, g)| g.is_constant() && !(constants_shared && same_home(n)))
        });
        if constant_escaped {
            debug!(
                escaped = ?self.registry.escaped(origin.owner),
                constants_shared,
                "a module variable's address escaped"
            );
            return Err(Refusal::GlobalsEscaped.into());
        }
        let kernel = module
            .kernel(&origin.name)
            .map_err(|e| Refusal::KernelRefused(e.to_string()))?;
        let info = kernel
            .info()
            .ok_or_else(|| Refusal::KernelRefused("no parameter table".into()))?;
        if let Some(r) = check::kernel_refusal(info, self.contexts[ci].asserts_on_apex) {
            return Err(r.into());
        }
        let sizes = info.params.iter().map(|p| p.size as usize).collect();
        let offsets = info.params.iter().map(|p| p.offset as usize).collect();
        // The block the launch packs parameters into (`EIATTR_PARAM_CBANK`).
        let block = info.param_cbank_size as usize;
        let max_dynamic_shared = self
            .cuda
            .max_dynamic_shared(f)
            .unwrap_or_else(|| default_dynamic_shared(info.static_shared));
        Ok(Ready {
            kernel,
            sizes,
            offsets,
            block,
            owner: origin.owner,
            max_dynamic_shared,
            prepared: Vec::new(),
        })
    }

    /// The slot (and queue) of a stream in context `ci`, taking it over on first use. `None` when no queue is
    /// ready for it and one is being built in the background (the stream is taken over at a launch after that).
    fn slot_for(
        &mut self,
        ci: usize,
        key: StreamKey,
        raw: usize,
        per_thread: bool,
    ) -> Result<Option<usize>, NotTaken> {
        if let Some(s) = self.contexts[ci].order.find(key) {
            return Ok(Some(s));
        }
        let background = self.config.setup == Mode::Background;
        // Every queue serves a stream: an idle one is handed over, or the launch stays on libcuda.
        let reassigned = if self.contexts[ci].order.live() >= self.config.max_queues {
            match self.idle_queue(ci) {
                Some(slot) => Some(slot),
                None => return Err(Refusal::TooManyStreams(self.config.max_queues).into()),
            }
        } else {
            None
        };
        let ctx = &mut self.contexts[ci];
        let spare = if reassigned.is_none() {
            ctx.spare.pop()
        } else {
            None
        };
        let queue = match spare {
            _ if reassigned.is_some() => None,
            Some(q) => Some(q),
            None if background => {
                if let Some(r) = &ctx.queue_failed {
                    // Counted by reference: kept for the context.
                    self.summary.refused(r);
                    return Err(NotTaken::Counted);
                }
                if !ctx.wanted.contains(&key) {
                    ctx.wanted.push(key);
                }
                self.top_up(ci);
                if self.config.setup == Mode::Background {
                    return Ok(None);
                }
                // The worker could not start: built here, as in the inline mode.
                Some(self.build_queue(ci)?)
            }
            None => Some(self.build_queue(ci)?),
        };
        // A stream kept as waits only: libcuda holds its waits first, which the queue's first launch waits for.
        self.make_real(ci, Site::Stream(raw, per_thread));
        // Before the stream is related to a queue: a hook that forwards a call on it without the engine must see it.
        self.new_generation();
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let stream = ctx.stream(cuda, raw, per_thread);
        let slot = match (reassigned, queue) {
            // The queue stays in its slot: its prepared launches stay valid.
            (Some(slot), _) => {
                ctx.order.reassign(slot, stream);
                slot
            }
            (None, Some(queue)) => {
                let slot = ctx.order.add(stream);
                if ctx.queues.len() <= slot {
                    ctx.queues.resize_with(slot + 1, || None);
                    ctx.last.resize_with(slot + 1, || None);
                }
                ctx.queues[slot] = Some(queue);
                slot
            }
            (None, None) => return Err(Refusal::Internal.into()),
        };
        ctx.last[slot] = None;
        info!(stream = ?key, slot, "stream taken over by an APEX queue");
        if background {
            // The next new stream should find a queue ready.
            self.contexts[ci].wanted.retain(|k| *k != key);
            self.top_up(ci);
        }
        Ok(Some(slot))
    }

    /// Every queue of context `ci` serves a stream (`APEX_PRELOAD_QUEUES`) and another stream asks for one: the queue
    /// of the stream that used its queue least recently is freed for it if that stream has used it for none of the
    /// context's last [`REASSIGN_AFTER_LAUNCHES`] launches (counted from its last launch, or from when it got the
    /// queue), all the queue's work is complete, no wait is left on it without its launch, and few events are kept
    /// after it
    /// (each is recorded in libcuda now, as at a stream's destruction). The former stream is no longer taken over:
    /// with nothing of APEX's left to wait for, its later work goes to libcuda, or takes a queue over again as any
    /// stream does. A program that uses more streams than queues one after another (PyTorch hands out streams from
    /// a pool of 32) keeps its launches on APEX. The slot that is free, its queue still in place; `None` when no
    /// queue may be handed over.
    fn idle_queue(&mut self, ci: usize) -> Option<usize> {
        let ctx = &self.contexts[ci];
        let now = ctx.order.launches();
        // Least recently used first, without allocating: a launch refused for want of a queue comes here each time.
        let mut tried = 0u64;
        let slot = loop {
            let (slot, _) = ctx
                .order
                .slots()
                .filter(|&slot| slot < 64 && tried & (1 << slot) == 0)
                .filter_map(|slot| Some((slot, ctx.order.unused_since(slot)?)))
                .filter(|&(_, since)| now.saturating_sub(since) >= REASSIGN_AFTER_LAUNCHES)
                .min_by_key(|&(_, since)| since)?;
            tried |= 1 << slot;
            let kept = ctx
                .events
                .iter()
                .filter(|(_, v)| v.slot == slot)
                .take(REASSIGN_MAX_KEPT_EVENTS + 1)
                .count();
            if ctx.queues.get(slot).is_some_and(Option::is_some)
                && ctx
                    .order
                    .stream(slot)
                    .is_some_and(|s| self.held != Some(s.key))
                && ctx.slot_state(slot) == SlotState::Done
                && kept <= REASSIGN_MAX_KEPT_EVENTS
            {
                break slot;
            }
        };
        let former = ctx.order.stream(slot)?.key;
        // Complete: libcuda records each kept event with nothing before it, and a stream that only waited for the
        // queue waits for its mark (passed) in libcuda.
        self.hand_slot_to_cuda(ci, slot, "queue handed to another stream");
        let ctx = &mut self.contexts[ci];
        ctx.events.retain(|_, v| v.slot != slot);
        ctx.dependency.retain(|_, d| d.slot != slot);
        ctx.last[slot] = None;
        self.summary.queues_reassigned += 1;
        info!(from = ?former, slot, "an idle APEX queue is handed to another stream");
        Some(slot)
    }

    /// What the preload keeps that stands for the work of `slot`'s queue in context `ci` becomes libcuda's, while the
    /// queue still serves its stream: each kept event is recorded in libcuda ([`materialize`](Self::materialize),
    /// `why` its cause in the summary), and each stream that only waits for the queue waits in libcuda
    /// ([`make_real`](Self::make_real)).
    fn hand_slot_to_cuda(&mut self, ci: usize, slot: usize, why: &'static str) {
        let c = &self.contexts[ci];
        let events: Vec<usize> = c
            .events
            .iter()
            .filter(|(_, v)| v.slot == slot)
            .map(|(&e, _)| e)
            .collect();
        let waiting: Vec<usize> = c
            .dependency
            .iter()
            .filter(|(_, d)| d.slot == slot)
            .map(|(&h, _)| h)
            .collect();
        for e in events {
            self.materialize(e, why);
        }
        for h in waiting {
            self.make_real(ci, Site::Stream(h, false));
        }
    }

    /// A queue of context `ci` built on this thread (the inline mode).
    fn build_queue(&mut self, ci: usize) -> Result<Queue, Refusal> {
        let started = Instant::now();
        let built = self.contexts[ci].gpu.queue_is_built(self.queue_options());
        let q = self.contexts[ci]
            .gpu
            .queue_with(self.queue_options())
            .map_err(|e| Refusal::QueueFailed(e.to_string()))?;
        let took = started.elapsed();
        self.summary.setup.queue.add(took);
        if !built {
            // The kept proving queue costs nothing: only a real build prices the next takeover.
            self.takeover.queue_took(took);
        }
        self.summary.queues += 1;
        Ok(q)
    }

    /// How the preload's queues are built (`APEX_PRELOAD_LAUNCH_MEMORY`, `APEX_PRELOAD_CHAINED`).
    fn queue_options(&self) -> QueueOptions {
        QueueOptions::default()
            .launch_memory(self.config.launch_memory)
            .chained(self.config.chained)
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
            // A load in flight is of the old image: its result is dropped when it comes ([`Engine::collect`]).
            c.loading.remove(&owner);
            // Refusals (and functions waiting for a module) are cheap to recompute; any of them may name a reused
            // handle.
            c.funcs
                .retain(|_, s| matches!(s, FuncState::Ready(r) if r.owner != owner));
        }
    }

    pub(crate) fn unloaded(&mut self, handle: usize) {
        // The unloaded module's function handles may come back as another module's.
        self.settle_grant();
        self.fast.forget_functions();
        self.unreadable.remove(&handle);
        if let Some(owner) = self.registry.unloaded(handle) {
            self.forget_owner(owner);
            // No takeover loads it any more (a module loaded again under the handle is priced afresh).
            self.takeover.forget_module(owner);
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
        // A name seen before changes nothing (a program may look a variable up before each copy to it).
        if let Some(owner) = self.registry.owner(handle)
            && self.registry.escaped(owner).contains(&name)
        {
            return;
        }
        self.registry.escape(handle, name);
        if let Some(owner) = self.registry.owner(handle) {
            for c in &mut self.contexts {
                c.funcs
                    .retain(|_, s| !matches!(s, FuncState::Ready(r) if r.owner == owner));
            }
        }
    }

    /// The program set the most dynamic shared memory `f`'s launches may ask for. The value is not taken: a kernel has
    /// several handles (its `CUkernel`, a `CUfunction` per context) and `cuKernelSetAttribute` names one device, so
    /// the cached limit of every handle of the same kernel is marked stale (0) and asked of libcuda again at its next
    /// launch with dynamic shared memory; where the kernel cannot be named, every function's is.
    pub(crate) fn dynamic_shared_limit(&mut self, f: usize) {
        let name = match self.registry.origin(f) {
            Some(o) => Some(o.name.clone()),
            None => self.cuda.function_name(f),
        };
        let handles = match &name {
            Some(n) => {
                let mut h = self.kernel_handles.get(n).cloned().unwrap_or_default();
                h.push(f);
                Some(h)
            }
            None => None,
        };
        for c in &mut self.contexts {
            match &handles {
                Some(handles) => {
                    for h in handles {
                        if let Some(FuncState::Ready(r)) = c.funcs.get_mut(h) {
                            r.max_dynamic_shared = 0;
                        }
                    }
                }
                None => {
                    for s in c.funcs.values_mut() {
                        if let FuncState::Ready(r) = s {
                            r.max_dynamic_shared = 0;
                        }
                    }
                }
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
        // Launches are refused from now on: none is forwarded on the credit as if it paid towards a takeover.
        self.settle_grant();
        self.stack_raised = true;
    }

    pub(crate) fn stream_destroyed(&mut self, raw: usize) {
        self.settle_grant();
        self.stream_priorities.retain(|&(_, h), _| h != raw);
        let key = StreamKey::of(raw, false);
        if self.takeover.forget_stream(key) {
            self.summary.setup.streams_not_earned += 1;
        }
        // What the preload keeps for the stream's queue is libcuda's while the queue still serves the stream.
        for ci in 0..self.contexts.len() {
            if let Some(slot) = self.contexts[ci].order.find(key) {
                self.hand_slot_to_cuda(ci, slot, "stream destroyed");
            }
        }
        self.new_generation();
        for c in &mut self.contexts {
            // A destroyed stream that only waited: nothing of it is left to order.
            c.dependency.remove(&raw);
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
            // A stream that waited for a queue being built: the queue, when it comes, waits for the next new stream.
            c.wanted.retain(|k| *k != key);
            c.blocking.remove(&raw);
        }
        self.stream_ctx.remove(&raw);
    }

    /// A capture of stream `raw` begins or ends; whether that changed what the engine knew (a stream already
    /// capturing, or not capturing, leaves it as it was).
    pub(crate) fn capture(&mut self, raw: usize, per_thread: bool, begins: bool) -> bool {
        let key = StreamKey::of(raw, per_thread);
        if begins {
            // Captured launches are refusals, not launches paying towards a takeover: the credit ends.
            self.settle_grant();
            self.capturing.insert(key)
        } else {
            self.capturing.remove(&key)
        }
    }

    pub(crate) fn unknown_entry(&mut self, name: &str) {
        self.settle_grant();
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

    /// Leaves this run's record for the program's next runs ([`crate::history`]), at exit. The launches counted are
    /// those a takeover could have served (through APEX, or on libcuda before their stream's takeover): refused ones
    /// pay for nothing. A process that made none (a launcher, a parent that spawns the workers) leaves no record.
    fn record_run(&mut self) {
        let s = self.summary();
        let launches = s.apex.saturating_add(s.warmup);
        if self.config.off.is_some() || launches == 0 {
            return;
        }
        self.takeover.libcuda_launch_took(LIBCUDA_LAUNCH.estimate());
        // The price is the takeover's as `earned` prices it (the attach and the module loads): freeing APEX's objects at
        // exit (6-18 ms on an H100) is left out of both alike.
        let run = crate::history::Run {
            launches,
            price_ns: self.takeover.run_price(),
            saved_ns: self.takeover.timed_saving(),
        };
        // At exit nothing may be logged (thread-local state is gone): a record that cannot be written is left out.
        let _ = self.history.record(&run);
    }

    /// A context is about to be destroyed: when APEX never attached to it (nor is attaching), what the preload keeps
    /// under its handle is forgotten (a refused attach, the takeover's counts of its streams), so a later context
    /// given the same handle starts from nothing, and `true` is returned; `false` when APEX has anything in it.
    pub(crate) fn context_destroyed_alone(&mut self, handle: usize) -> bool {
        if self.find_context(handle).is_some() || self.attaching.contains_key(&handle) {
            return false;
        }
        self.settle_grant();
        self.unattached.remove(&handle);
        self.takeover.forget_context(handle);
        self.stream_priorities.retain(|&(c, _), _| c != handle);
        // Its streams went with it, without a cuStreamDestroy each: a later stream given one of their handles is
        // another stream.
        let gone: Vec<usize> = self
            .stream_ctx
            .iter()
            .filter(|&(_, &c)| c == handle)
            .map(|(&s, _)| s)
            .collect();
        for s in gone {
            self.stream_ctx.remove(&s);
            for c in &mut self.contexts {
                c.blocking.remove(&s);
            }
        }
        self.new_generation();
        info!(
            context = format_args!("{handle:#x}"),
            "a CUDA context APEX never attached to ends; the takeover goes on"
        );
        true
    }

    pub(crate) fn shutdown(&mut self, why: &str) {
        let started = std::time::Instant::now();
        // Set-up in flight works in the program's context, which may go away once this returns: waited for (with a
        // bound), and what it made is dropped below with the rest.
        self.stop_setup();
        // Events the program keeps alive past this point are libcuda's from here.
        self.materialize_all("end of the takeover");
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
        let drained_us = started.elapsed().as_micros();
        let mut summary = self.summary();
        // Queues and modules go before the contexts do.
        let freeing = Instant::now();
        for c in &mut self.contexts {
            c.funcs.clear();
            c.events.clear();
            c.last.clear();
            c.queues.clear();
            c.spare.clear();
            c.modules.clear();
            c.retired.clear();
        }
        let had_contexts = !self.contexts.is_empty();
        self.contexts.clear();
        if had_contexts {
            self.summary.setup.teardown.add(freeing.elapsed());
            summary.setup.teardown = self.summary.setup.teardown.clone();
        }
        self.new_generation();
        self.settle_grant();
        self.off = Some(Refusal::Ended(why.to_string()));
        if let Some(path) = &self.config.stats {
            let path = stats_path(path, std::process::id());
            match serde_json::to_vec_pretty(&summary) {
                Ok(json) => {
                    if let Err(e) = std::fs::write(&path, json) {
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
        debug!(
            drained_us,
            total_us = started.elapsed().as_micros(),
            "apex-preload's shutdown: work drained, then APEX's objects freed"
        );
    }
}

// ---- the entry points the hooks call ----

/// Launches through APEX if it can (`Ok`: the launch is sent and the engine still locked until [`Taken::finish`],
/// which returns the profile's stamp where the hook's last phase starts). `Err` when the
/// caller must forward the launch to libcuda: ordered already, under the same lock, as [`before`] orders CUDA work
/// (the caller gives the answer to [`after`]); `Err(None)` while nothing is attached, when there is nothing of
/// APEX's to order it with (the caller then calls [`after_unordered`], which costs one load unless an attach began
/// meanwhile). `t0`: the profile's stamp at the hook's entry.
pub(crate) fn launch(l: &Launch, t0: u64) -> Result<Taken, Option<Ordered>> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(Some(Ordered::UNKNOWN));
    }
    resolve_driver_functions();
    let mut guard = ENGINE.lock();
    if guard.is_none() {
        // Watched at the next call that releases the lock ([`with_engine`]).
        WATCH_CUPTI.store(true, Ordering::Release);
    }
    let engine = guard.get_or_insert_with(|| Engine::new(Config::from_env(), Box::new(Libcuda)));
    // After the engine is made: making it starts the watchdog.
    let busy = crate::watchdog::busy();
    let r = apex_interpose::quietly(|| match engine.launch(l, t0) {
        Some(stamp) => Ok(stamp),
        // A launch left to libcuda before anything is attached (a background attach asked for sets the flag too): no
        // queue exists, so none holds launches or needs this one ordered after it.
        None if !engaged() => Err(None),
        None => {
            // Left to libcuda, which may have to wait for APEX's launches: held ones are sent first.
            engine.send_held();
            Err(Some(engine.before(Site::Stream(l.stream, l.per_thread))))
        }
    });
    match r {
        Some(Ok(since)) => Ok(Taken { since, guard, busy }),
        Some(Err(o)) => Err(o),
        None => {
            engine.off.get_or_insert(Refusal::Internal);
            warn!("internal error in apex-preload: launches go to libcuda from now on");
            Err(Some(Ordered::UNKNOWN))
        }
    }
}

/// A launch APEX took over, sent (or held as a link, on a chained queue) and the engine still locked:
/// [`Taken::finish`] releases the lock.
///
/// Until the doorbell's stores have left the core, a load that reads back a store made after them in a size the CPU
/// cannot forward from its store buffer waits for them (about 0.3 µs on an H200 host). [`with_engine`] moves its
/// result out of the panic guard with 16-byte copies of what was stored as 8-byte words, so a launch returns through
/// this instead: its fields are single words, read back as they were written, and the lock is released last.
pub(crate) struct Taken {
    /// The profile's stamp where the hook's last phase starts (0: not profiled).
    since: u64,
    guard: crate::lock::Guard<'static, Option<Engine>>,
    busy: Option<crate::watchdog::Busy>,
}

impl Taken {
    /// Releases the engine's lock and returns the profile's stamp.
    #[inline]
    pub(crate) fn finish(self) -> u64 {
        drop(self.busy);
        drop(self.guard);
        self.since
    }
}

/// Before a CUDA operation at `site`: related queues' work is handed to CUDA. The answer is for [`after`].
pub(crate) fn before(site: Site) -> Ordered {
    with(|e| e.before(site)).unwrap_or(Ordered::UNKNOWN)
}

/// After a CUDA operation that added work at `site` (`completed`: the stream's work is done as the call returns);
/// `o`: what [`before`] answered.
pub(crate) fn after(site: Site, o: Ordered, completed: bool) {
    with(|e| e.after(site, o, completed));
}

/// After CUDA work at `site` that went to libcuda without [`before_work`] (nothing was attached when it started):
/// if something was attached meanwhile, the site's stream is marked as having CUDA work its queue must wait for.
pub(crate) fn after_unordered(site: Site) {
    if engaged() {
        after(site, Ordered::UNKNOWN, false);
    }
}

/// Runs a synchronization's first step under the lock, waits without it, and its last step under it again.
fn two_steps<R>(
    begin: impl FnOnce(&mut Engine) -> Step,
    end: impl FnOnce(&mut Engine, &Waits, &Result<(), String>) -> R,
    forward: R,
    answer: impl FnOnce(Answer) -> R,
) -> R {
    two_steps_for(None, begin, end, forward, answer)
}

/// As [`two_steps`], for a synchronize on the program's `event` (which sleeps if the program made it so).
fn two_steps_for<R>(
    event: Option<usize>,
    begin: impl FnOnce(&mut Engine) -> Step,
    end: impl FnOnce(&mut Engine, &Waits, &Result<(), String>) -> R,
    forward: R,
    answer: impl FnOnce(Answer) -> R,
) -> R {
    match with(begin) {
        None => forward,
        Some(Step::Answer(a)) => answer(a),
        Some(Step::Wait(w)) => {
            let waited = wait_or_sleep(&w, event);
            with(|e| end(e, &w, &waited)).unwrap_or(forward)
        }
    }
}

/// How long a wait spins before it sleeps, where the program asked CUDA to sleep while it waits: a synchronize on
/// a short kernel answers as quickly as a spinning one (libcuda's own sleeping synchronize after an empty kernel
/// takes about 18 µs against 4-10 µs spinning, H200, 580.159.04), and a long wait costs this much CPU time once.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(20);

/// Waits for `w`'s fences without the engine's lock. Where the program asked CUDA to sleep while it waits (a
/// context made with `CU_CTX_SCHED_BLOCKING_SYNC`, or `event` made with `CU_EVENT_BLOCKING_SYNC`), a wait still
/// running after [`SPIN_BEFORE_SLEEP`] sleeps in libcuda on an event recorded after the queues' work
/// ([`Engine::sleep_ticket`]) instead of spinning for as long as the work runs.
fn wait_or_sleep(w: &Waits, event: Option<usize>) -> Result<(), String> {
    if let Some(done) = w.wait_briefly(SPIN_BEFORE_SLEEP) {
        return done;
    }
    if let Some(Some(sleep)) = with(|e| e.sleep_ticket(w, event)) {
        // An error (the context faulted) shows in the wait below as well.
        if let Err(e) = sleep.cuda.sleep_on_event(sleep.sleeper.event) {
            debug!(error = %e, "a sleeping wait returned early; the fences are waited for");
        }
        with(|e| e.slept(sleep));
    }
    w.wait()
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

/// A context synchronize; the mark is for [`context_synced`].
pub(crate) fn context_sync() -> (Answer, CtxMark) {
    two_steps(
        |e| e.context_sync_begin(),
        |e, w, r| e.context_sync_end(w, r),
        (Answer::Forward, CtxMark::NONE),
        |a| (a, CtxMark::NONE),
    )
}

/// After a forwarded context synchronize.
pub(crate) fn context_synced(result: c_int, mark: CtxMark) {
    with(|e| e.context_synced(result, mark));
}

/// Before CUDA work the program submits through driver function `name`: counted by name (for the stats), then
/// ordered as [`before`] orders it, under one lock.
pub(crate) fn before_work(site: Site, name: &'static str) -> Ordered {
    with(|e| e.before_work(site, name)).unwrap_or(Ordered::UNKNOWN)
}

/// Before `cuStreamWaitEvent(site, event)`, under one lock: `Ok(CUresult)` when the preload kept the event and the
/// stream's queue waits for it ([`Engine::wait_on_apex`], only where `on_apex`); otherwise ordered as a wait
/// ([`Engine::before_stream_wait`]: nothing handed to CUDA first), an event the preload kept recorded in libcuda
/// first ([`materialize`]), `Err` holding the answer for [`after`].
pub(crate) fn before_wait(
    event: usize,
    site: Site,
    name: &'static str,
    on_apex: bool,
) -> Result<c_int, Ordered> {
    if let Some(Some(done)) = with(|e| e.stream_wait(event, site, name, on_apex)) {
        return done;
    }
    materialize(
        event,
        if on_apex {
            name
        } else {
            "cuStreamWaitEvent with flags"
        },
    );
    Err(with(|e| e.before_stream_wait(site, name)).unwrap_or(Ordered::UNKNOWN))
}

/// Where a stream's work stands at a stream-ordered free the allocation cache keeps ([`Engine::free_point`]): the
/// fence of its queue (with the queue's context), or, after the stream was ordered after related queues, the answer
/// for [`after`] once CUDA marked the point.
pub(crate) fn free_point(site: Site, name: &'static str) -> Result<(usize, Fence), Ordered> {
    with(|e| e.free_point(site, name)).unwrap_or(Err(Ordered::UNKNOWN))
}

/// Whether a stream of the program is capturing a CUDA graph (a context synchronize could then invalidate it).
pub(crate) fn capturing() -> bool {
    with(|e| !e.capturing.is_empty()).unwrap_or(false)
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
    two_steps_for(
        Some(event),
        |e| e.event_sync_begin(event, kind),
        |e, w, r| e.event_sync_end(event, w, r),
        Answer::Forward,
        |a| a,
    )
}

/// Before libcuda looks at `event` (a wait for its work, if any, runs without the lock).
pub(crate) fn materialize(event: usize, why: &'static str) {
    if let Some((fence, handle)) = with(|e| e.materialize_begin(event, why)).flatten() {
        let _ = wait_fence(&fence);
        with(|e| e.materialize_end(event, handle));
    }
}

/// Before a capture: libcuda holds every kept event and every stream kept as waits only
/// ([`Engine::materialize_all`]).
pub(crate) fn materialize_all() {
    with(|e| e.materialize_all("capture"));
}

/// Every event the preload kept, recorded in libcuda ([`Engine::materialize_events`]).
pub(crate) fn materialize_events() {
    with(|e| e.materialize_events("graph launch"));
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
    // A library loaded since the engine started may import CUPTI (a module load often follows a library load).
    watch_cupti();
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
    watch_cupti();
    with(|e| e.loaded(owner, image, library));
}

/// A module or library is about to be unloaded (the set-up worker must not be loading it meanwhile).
pub(crate) fn unloading(handle: usize) {
    with(|e| e.unloading(handle));
}

/// A module or library was unloaded.
pub(crate) fn unloaded(handle: usize) {
    with(|e| e.unloaded(handle));
}

/// `function` is kernel `name` of module or library `handle`.
pub(crate) fn function(function: usize, handle: usize, name: *const c_char) {
    // With the takeover off no launch is taken over: nothing needs a function's origin.
    if name.is_null() || disabled() {
        return;
    }
    // SAFETY: the driver accepted it as a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    with(|e| e.function(function, handle, &name));
}

/// `function` is the same kernel as `kernel`.
pub(crate) fn same_function(function: usize, kernel: usize) {
    if disabled() {
        return;
    }
    with(|e| e.same_function(function, kernel));
}

/// `module` is `library`'s.
pub(crate) fn library_module(module: usize, library: usize) {
    if disabled() {
        return;
    }
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

/// `cuFuncSetAttribute` / `cuKernelSetAttribute` on `f`, which libcuda accepted.
pub(crate) fn func_attribute(f: usize, attr: c_int) {
    match attr {
        // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: launches asking for more are libcuda's to refuse.
        8 => {
            with(|e| e.dynamic_shared_limit(f));
        }
        // _PREFERRED_SHARED_MEMORY_CARVEOUT: a preference, which APEX's own choice of carveout meets.
        9 => {}
        // Cluster shapes and policies (10-14) and anything newer change what APEX would have to send.
        _ => {
            with(|e| e.func_attribute(f, attr));
        }
    }
}

/// CUDA's default for `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, for when libcuda cannot be asked: 48 KiB
/// less the kernel's static shared memory. Counting the 1 KiB the sm_90 compiler reserves there too errs towards
/// leaving a launch to libcuda, which then decides.
fn default_dynamic_shared(static_shared: u64) -> u32 {
    u32::try_from((48u64 << 10).saturating_sub(static_shared)).unwrap_or(0)
}

/// `cuCtxSetLimit`.
pub(crate) fn limit(limit: c_int, value: usize) {
    // CU_LIMIT_STACK_SIZE
    if limit == 0 && value > DEFAULT_STACK {
        with(|e| e.raise_stack());
    }
}

/// Before libcuda destroys a stream: the hooks stop forwarding calls on it without the engine ([`plain`]), so that
/// a stream made later with the same handle is looked at afresh.
/// Before `cuStreamDestroy`: a stream kept as waits only is forgotten, with no wait handed to libcuda (a destroyed
/// stream gets no more work; events recorded on it stay kept).
pub(crate) fn forget_dependency(raw: usize) {
    with(|e| {
        for c in &mut e.contexts {
            c.dependency.remove(&raw);
        }
    });
}

pub(crate) fn stream_destroying() {
    with(|e| e.new_generation());
}

/// A call at `site` (naming `event`, if any) that needs nothing of the engine where the stream is related to no
/// queue and the event is not kept: `Some` when the hooks may forward it without the engine ([`plain`]); the ticket
/// goes to [`plain_end`] after the call.
pub(crate) fn plain_begin(site: Site, event: Option<usize>) -> Option<PlainTicket> {
    let Site::Stream(raw, pt) = site else {
        return None;
    };
    let StreamKey::Handle(h) = StreamKey::of(raw, pt) else {
        return None;
    };
    if FORKED.load(Ordering::Relaxed) {
        return None;
    }
    PLAIN.begin(h, event)
}

/// After a call [`plain_begin`] let through: counted as CUDA work by driver function `name` (if it counts), and
/// ordered by the engine after all if relations changed while it ran.
pub(crate) fn plain_end(t: PlainTicket, site: Site, name: Option<&'static str>) {
    if !PLAIN.end(t, name) {
        after(site, Ordered::UNKNOWN, false);
    }
}

/// A stream was destroyed (its work was handed to CUDA before).
pub(crate) fn stream_destroyed(raw: usize) {
    with(|e| e.stream_destroyed(raw));
}

/// A stream capture began (`true`) or ended on the stream at `site`.
pub(crate) fn capture(raw: usize, per_thread: bool, begins: bool) -> bool {
    with(|e| e.capture(raw, per_thread, begins)).unwrap_or(false)
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

/// Before a capture begins on this thread ([`Engine::before_capture`]).
pub(crate) fn before_capture() {
    with(|e| e.before_capture());
}

/// Before `cuCtxDestroy(ctx)`: a context APEX never attached to (and is not attaching to) is forgotten alone, and
/// `true` returned; `false` when APEX has something in it (then the takeover ends with it).
pub(crate) fn context_destroyed_alone(ctx: usize) -> bool {
    with(|e| e.context_destroyed_alone(ctx)).unwrap_or(false)
}

#[cfg(test)]
mod tests;
