//! The compute queue: a pushbuffer queue whose channel is set up for compute, with per-launch slots holding a
//! QMD and its constant bank 0, local memory sized from the kernels' stacks, and launches that run in order
//! like a CUDA stream.

mod graph_exec;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tracing::debug;

pub use graph_exec::{GraphExec, GraphSchedule, GraphStats};

use crate::hw::Generation;
use crate::pushbuf::{Acquire, Armed, Fence, Queue, QueueConfig, Signal, Submission};
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::cbank::{
    CLUSTER_WORDS, CLUSTER_WORDS_START, DRIVER_BYTES, write_cluster_words, write_driver_words,
    write_grid_barrier,
};
use super::copies::{COPY_SEMAPHORE_SLOT, record_copy};
use super::params::{Arg, pack};
use super::qmd::{self, ChainAction, ConstBuffer, QMD_WORDS, QmdParams, QmdVersion};
use super::{Error, Result};
use crate::module::cubin::KernelInfo;
use crate::module::printf::{Drained, PrintfFifo};
use crate::module::{Kernel, newest_generation};

/// Grid and block shape, dynamic shared memory and thread block cluster shape of one launch.
///
/// Marked `#[non_exhaustive]` so that new launch attributes are not breaking changes: build one with
/// [`LaunchConfig::new`] or [`LaunchConfig::linear`] and the `with_*` methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchConfig {
    /// Blocks per axis (in blocks, also for cluster launches).
    pub grid: [u32; 3],
    /// Threads per block per axis.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_bytes: u32,
    /// A run-time thread block cluster shape (sm_90+, as `cudaLaunchAttributeClusterDimension`): the grid runs as
    /// clusters of this many blocks per axis, each cluster resident at once on one GPC, its blocks sharing
    /// distributed shared memory and `cluster.sync()`. `None`: the kernel's compile-time `__cluster_dims__`, if
    /// any. The grid must be a multiple of the shape, and a cluster at most 8 blocks.
    pub cluster: Option<[u32; 3]>,
    /// The memory synchronization domain the kernel runs in (sm_90+, 0 to 3; as `cudaLaunchAttributeMemSyncDomain`
    /// after the domain map): a fence in the kernel orders memory only with kernels of its own domain, so
    /// communication kernels (NCCL's run in domain 1, "remote") do not make compute kernels' fences wait for
    /// their traffic. 0, the default, is the domain every kernel shares.
    pub sync_domain: u8,
    /// How the clusters of a cluster launch are spread over the GPU (`cudaLaunchAttributeClusterSchedulingPolicy
    /// Preference`); ignored without a cluster shape.
    pub cluster_policy: ClusterPolicy,
}

/// How the thread block clusters of a launch are placed on the GPU's SMs (CUDA's cluster scheduling policy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ClusterPolicy {
    /// The hardware's default, what libcuda sends without a preference: each cluster's blocks multicast to the SMs
    /// of one GPC.
    #[default]
    Default,
    /// Spread a cluster's blocks over the GPC's SMs (libcuda encodes it as the default).
    Spread,
    /// Let the hardware balance blocks of clusters across SMs by load.
    LoadBalancing,
}

impl LaunchConfig {
    /// A grid of `grid` blocks of `block` threads (x y z), no dynamic shared memory, no run-time cluster shape,
    /// synchronization domain 0 and the default cluster policy. Change the rest with the `with_*` methods:
    ///
    /// ```
    /// use apex::LaunchConfig;
    /// let cfg = LaunchConfig::new([64, 2, 1], [128, 1, 1]).with_shared_bytes(16 << 10);
    /// assert_eq!(cfg.grid, [64, 2, 1]);
    /// assert_eq!(cfg.shared_bytes, 16 << 10);
    /// ```
    pub const fn new(grid: [u32; 3], block: [u32; 3]) -> LaunchConfig {
        LaunchConfig {
            grid,
            block,
            shared_bytes: 0,
            cluster: None,
            sync_domain: 0,
            cluster_policy: ClusterPolicy::Default,
        }
    }

    /// `blocks` blocks of `threads` threads along x, no dynamic shared memory, no run-time cluster shape.
    pub const fn linear(blocks: u32, threads: u32) -> LaunchConfig {
        LaunchConfig::new([blocks, 1, 1], [threads, 1, 1])
    }

    /// The same launch with a grid of `grid` blocks per axis (see [`LaunchConfig::grid`]).
    pub const fn with_grid(self, grid: [u32; 3]) -> LaunchConfig {
        LaunchConfig { grid, ..self }
    }

    /// The same launch with blocks of `block` threads per axis (see [`LaunchConfig::block`]).
    pub const fn with_block(self, block: [u32; 3]) -> LaunchConfig {
        LaunchConfig { block, ..self }
    }

    /// The same launch with `bytes` of dynamic shared memory per block (see [`LaunchConfig::shared_bytes`]).
    pub const fn with_shared_bytes(self, bytes: u32) -> LaunchConfig {
        LaunchConfig {
            shared_bytes: bytes,
            ..self
        }
    }

    /// The same launch in thread block clusters of `shape` blocks (see [`LaunchConfig::cluster`]).
    pub const fn with_cluster(self, shape: [u32; 3]) -> LaunchConfig {
        LaunchConfig {
            cluster: Some(shape),
            ..self
        }
    }

    /// The same launch with run-time cluster shape `shape`, or with none (`None`: the kernel's compile-time shape,
    /// if any; see [`LaunchConfig::cluster`]).
    pub const fn with_cluster_shape(self, shape: Option<[u32; 3]>) -> LaunchConfig {
        LaunchConfig {
            cluster: shape,
            ..self
        }
    }

    /// The same launch in memory synchronization domain `domain` (see [`LaunchConfig::sync_domain`]).
    pub const fn with_sync_domain(self, domain: u8) -> LaunchConfig {
        LaunchConfig {
            sync_domain: domain,
            ..self
        }
    }

    /// The same launch with cluster scheduling policy `policy` (see [`LaunchConfig::cluster_policy`]).
    pub const fn with_cluster_policy(self, policy: ClusterPolicy) -> LaunchConfig {
        LaunchConfig {
            cluster_policy: policy,
            ..self
        }
    }
}

/// Most blocks in a thread block cluster: CUDA's portable cluster size. Hopper runs up to 16 for kernels that opt
/// in (`cudaFuncAttributeNonPortableClusterSizeAllowed`), which APEX does not offer.
pub const MAX_CLUSTER_BLOCKS: u32 = 8;

/// Device limits a launch is checked against. Made by [`Limits::for_sm`], [`Limits::for_generation`] or
/// [`Limits::portable`]; `#[non_exhaustive]`, so new limits are not breaking changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Most blocks per grid axis, x y z.
    pub max_grid: [u32; 3],
    /// Most threads per block axis, x y z.
    pub max_block: [u32; 3],
    /// Most threads in one block.
    pub max_threads_per_block: u32,
    /// Shared memory one block may use, the compiler's reserved 1 KiB included.
    pub max_shared_per_block: u32,
    /// 32-bit registers per SM, which a block's registers must fit in.
    pub registers_per_sm: u32,
    /// Most bytes of kernel parameters.
    pub max_param_bytes: u32,
    /// Most blocks in a thread block cluster; 0 on GPUs without clusters (before sm_90).
    pub max_cluster_blocks: u32,
}

impl Limits {
    /// The limits of a GPU with SM version `sm_version` (major × 10 + minor), from its row of the GPU-generation
    /// table ([`crate::hw::generation`]). An SM version without a row gets [`Limits::portable`], never another
    /// generation's numbers.
    pub fn for_sm(sm_version: u32) -> Limits {
        Generation::for_sm(sm_version).map_or_else(Limits::portable, Limits::for_generation)
    }

    /// The limits of generation `g`: shared memory per block up to the largest carveout (the compiler's 1 KiB
    /// included), clusters of at most [`MAX_CLUSTER_BLOCKS`] blocks where the generation has them.
    pub fn for_generation(g: &Generation) -> Limits {
        let l = &g.limits;
        Limits {
            max_grid: l.max_grid,
            max_block: l.max_block,
            max_threads_per_block: l.max_threads_per_block,
            max_shared_per_block: g.smem_per_sm_kib() * 1024,
            registers_per_sm: l.regs_per_sm,
            max_param_bytes: MAX_PARAM_BYTES as u32,
            max_cluster_blocks: MAX_CLUSTER_BLOCKS.min(l.max_cluster_blocks),
        }
    }

    /// The documented fallback for a GPU the generation table does not know: what every CUDA GPU since Volta
    /// offers a launch (1024 threads per block, 48 KiB of shared memory per block without opting in, 64 Ki
    /// registers per SM) and no clusters. A launch beyond these on such a GPU is refused before it is submitted.
    pub fn portable() -> Limits {
        Limits {
            max_grid: [i32::MAX as u32, 65535, 65535],
            max_block: [1024, 1024, 64],
            max_threads_per_block: 1024,
            max_shared_per_block: 48 * 1024,
            registers_per_sm: 65536,
            max_param_bytes: MAX_PARAM_BYTES as u32,
            max_cluster_blocks: 0,
        }
    }
}

/// Where a compute queue keeps what the GPU fetches for every launch: the GPFIFO ring and USERD, the pushbuffer,
/// and the launch slots (QMDs and parameter blocks). The choice trades the CPU's cost per launch against the time
/// from launch to completion (figures in BENCHMARKS.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LaunchMemory {
    /// Video memory, written by the CPU through write-combined BAR1 mappings, as libcuda keeps them: the GPU's
    /// fetches stay on the GPU, so a launch completes soonest, but every doorbell needs a store fence that drains
    /// the CPU's write-combining buffers across PCIe.
    #[default]
    Video,
    /// CPU-cached system memory: a launch is a few cached stores and the doorbell (x86 keeps cached stores in
    /// order, so no store fence), the lowest CPU cost; the GPU fetches ring, methods and parameters across PCIe,
    /// which makes each launch reach the GPU later. QMDs go inline in the pushbuffer, which saves one such fetch.
    Host,
}

impl LaunchMemory {
    /// The memory placement this choice gives the ring, pushbuffer and launch slots.
    pub fn placement(self) -> Placement {
        match self {
            LaunchMemory::Video => Placement::Video,
            LaunchMemory::Host => Placement::SystemCached,
        }
    }
}

/// How a [`ComputeQueue`] is built: start from [`ComputeQueueConfig::default`] and change it with the `with_*`
/// methods (`#[non_exhaustive]`, so new options are not breaking changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ComputeQueueConfig {
    /// The pushbuffer queue (and channel) under the compute queue.
    pub queue: QueueConfig,
    /// Where the launch slots (QMD and constant bank 0 of each launch) live.
    pub slot_placement: Placement,
    /// Send each launch's QMD inline in the pushbuffer (`LOAD_INLINE_QMD_DATA`) instead of writing it to its slot
    /// for the GPU to fetch: the compute work distributor skips the QMD fetch, and the CPU writes one sequential
    /// run of methods instead of scattered QMD words. Chained launches are always fetched.
    pub inline_qmd: bool,
    /// Launch slots (QMD + constant bank 0 each): how many launches can be in flight.
    pub slots: usize,
    /// How long the queue's own waits (for a free launch slot, for the set-up submission, in `synchronize`) may
    /// take before failing.
    pub timeout: Duration,
    /// Chained launches sent together: a longer chain is sent in parts of at most this many as it is recorded, so
    /// the GPU runs one part while the CPU records the next (each part waits for the one before, one front-end
    /// round trip). A chain's first part is [`FIRST_CHAIN_PART`] links (or this many, if fewer) and each part after
    /// it twice the one before, so the GPU starts on a chain soon after its first launches are recorded.
    pub chain_part: usize,
    /// After each launch, ask the CPU for write ownership of the lines the next one writes (the next slot's release
    /// payload and parameters, the pushbuffer's head, the ring's next entry or the next armed slot), so that its
    /// stores do not wait for it. On by default; it takes effect where the launch slots are in CPU-cached host
    /// memory ([`LaunchMemory::Host`]), whose lines the GPU's reads leave shared (write-combined mappings are not
    /// cached), and for the bodies of armed slots, which are always there. On an H100 host it took 36-65 ns off a
    /// prepared launch call with fetched QMDs and 5-60 ns with inline ones (interleaved A/B, BENCHMARKS.md).
    pub prefetch_next: bool,
    /// Have the GPU read a launch's QMD before the front end waits for the launch ahead of it (stream order), so that
    /// the fetch overlaps that launch's work instead of following it: two more compute methods in the pushbuffer
    /// ahead of the wait (five words). Only for QMDs the GPU fetches from a plain launch slot (not inline, not
    /// gated, not a chain's head), and only where the queue has not yet seen the launch ahead complete. On by
    /// default: on an H100 it took 1000 dependent empty launches from 1718 to 1450 ns each (interleaved A/B) and
    /// GPT-2 eager from 758 to 696-699 µs per token; an isolated launch call stayed within the spread (BENCHMARKS.md).
    pub prefetch_qmds: bool,
}

/// Links in the first part of a chain ([`ComputeQueueConfig::chain_part`]): the GPU starts on a chain once this many
/// are recorded, instead of a whole part. Measured on an H100: a GPT-2 step of 136 chained programmatic launches
/// that waits for every token took 1.14× the graph's time with whole parts of 128 (see BENCHMARKS.md).
pub const FIRST_CHAIN_PART: usize = 8;

impl Default for ComputeQueueConfig {
    fn default() -> ComputeQueueConfig {
        let queue = QueueConfig {
            push_placement: Placement::Video,
            ..QueueConfig::default()
        };
        ComputeQueueConfig {
            queue,
            slot_placement: Placement::Video,
            inline_qmd: false,
            slots: 256,
            timeout: Duration::from_secs(10),
            chain_part: 128,
            prefetch_next: true,
            prefetch_qmds: true,
        }
    }
}

impl ComputeQueueConfig {
    /// Places the ring and USERD, the pushbuffer and the launch slots in `memory`. Host memory also sends QMDs
    /// inline: the GPU then fetches one thing less across PCIe per launch (7.0 instead of 8.4 µs to completion on
    /// an H100); in video memory inline QMDs measured the same as fetched ones and stay off. Host memory gets a
    /// 128 KiB pushbuffer, room for as many inline launches as there are slots, that stays in the CPU's caches
    /// (a 4 MiB one made each call 10-20 % dearer on an H100 host).
    pub fn with_memory(mut self, memory: LaunchMemory) -> ComputeQueueConfig {
        let p = memory.placement();
        self.queue.channel.ring_placement = p;
        self.queue.push_placement = p;
        self.slot_placement = p;
        self.inline_qmd = memory == LaunchMemory::Host;
        if memory == LaunchMemory::Host {
            self.queue.push_bytes = HOST_PUSH_BYTES;
        }
        self
    }

    /// The same with the queue's submissions polled for by the front end (`polled`: armed GPFIFO slots,
    /// [`Submission::Armed`](crate::pushbuf::Submission::Armed)) or sent by doorbell.
    pub fn with_polling(mut self, polled: bool) -> ComputeQueueConfig {
        self.queue.submission = match (polled, self.queue.submission) {
            // A shape set before stays.
            (true, armed @ Submission::Armed(_)) => armed,
            (true, Submission::Doorbell) => Submission::Armed(Armed::default()),
            (false, _) => Submission::Doorbell,
        };
        self
    }

    /// Sets [`queue`](Self::queue), the pushbuffer queue's and channel's configuration.
    pub fn with_queue(mut self, queue: QueueConfig) -> ComputeQueueConfig {
        self.queue = queue;
        self
    }

    /// Sets [`slot_placement`](Self::slot_placement).
    pub fn with_slot_placement(mut self, placement: Placement) -> ComputeQueueConfig {
        self.slot_placement = placement;
        self
    }

    /// Sets [`inline_qmd`](Self::inline_qmd).
    pub fn with_inline_qmd(mut self, inline: bool) -> ComputeQueueConfig {
        self.inline_qmd = inline;
        self
    }

    /// Sets [`slots`](Self::slots).
    pub fn with_slots(mut self, slots: usize) -> ComputeQueueConfig {
        self.slots = slots;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> ComputeQueueConfig {
        self.timeout = timeout;
        self
    }

    /// Sets [`chain_part`](Self::chain_part).
    pub fn with_chain_part(mut self, links: usize) -> ComputeQueueConfig {
        self.chain_part = links;
        self
    }

    /// Sets [`prefetch_next`](Self::prefetch_next).
    pub fn with_prefetch_next(mut self, prefetch: bool) -> ComputeQueueConfig {
        self.prefetch_next = prefetch;
        self
    }

    /// Sets [`prefetch_qmds`](Self::prefetch_qmds).
    pub fn with_prefetch_qmds(mut self, prefetch: bool) -> ComputeQueueConfig {
        self.prefetch_qmds = prefetch;
        self
    }
}

/// The pushbuffer of a queue in host launch memory: small enough to stay in the CPU's caches, large enough for a
/// launch in every slot with its QMD inline (about 440 bytes each).
const HOST_PUSH_BYTES: u64 = 128 << 10;

/// Largest parameter block (sm_90 kernels may take up to 32764 bytes).
const MAX_PARAM_BYTES: usize = 32 * 1024;
const QMD_BYTES: u64 = 512;
const CBANK_BYTES: u64 = (DRIVER_BYTES + MAX_PARAM_BYTES).next_multiple_of(256) as u64;
const SLOT_BYTES: u64 = QMD_BYTES + CBANK_BYTES;
/// Local memory per thread that the queue starts with: 1 KiB of stack plus what the driver reserves (0x240),
/// as libcuda does.
const LOCAL_RESERVE: u32 = 0x240;
const INITIAL_STACK: u32 = 1024;
/// Address range for the shared- and local-memory windows: no mapping may lie in the 4 GiB above the shared
/// window (Hopper), so the whole range stays empty.
const WINDOWS_BYTES: u64 = 12 << 30;
const WINDOW_ALIGN: u64 = 4 << 30;
/// Kernels APEX launches itself (kernels/apex_builtin.cu).
const BUILTIN_CUBIN: &[u8] = include_bytes!("../../kernels/apex_builtin.sm_90.cubin");

/// Bytes per slot gate ([`Gates`]): a QMD, on the 256-byte alignment SEND_PCAS and dependent pointers address.
const GATE_BYTES: u64 = 512;

/// Latch ids of eager programmatic launches and of programmatic chain links: above the ids graphs number their
/// producers with (node + 1), counting up per launch as libcuda numbers them, from one counter for the whole
/// process so that launches of different
/// queues (whose channels may share latches: their scope is not documented) do not share an id until 2^23 launches
/// later.
const EAGER_LATCH_FIRST: u32 = 0x0080_0000;
const EAGER_LATCH_SPAN: u32 = 0x0080_0000;
static NEXT_EAGER_LATCH: AtomicU32 = AtomicU32::new(0);

/// The `n`th eager latch id: in `EAGER_LATCH_FIRST..EAGER_LATCH_FIRST + EAGER_LATCH_SPAN` (24-bit ids), consecutive
/// `n` (wrapping at 2^32 included) giving different ids.
fn eager_latch(n: u32) -> u32 {
    EAGER_LATCH_FIRST + (n & (EAGER_LATCH_SPAN - 1))
}

/// Eager programmatic launches (CUDA's programmatic stream serialization): one gate per launch slot, a null grid
/// that the slot's programmatic launch counts down when it pre-exits and the front end counts down when the launch
/// after it is programmatic too; the gate then schedules that launch (in the next slot). Built when a queue first
/// launches programmatically.
struct Gates {
    mem: Memory,
    /// The last launch sent with its gate armed: (slot, timeline value, latch it arrives at).
    last: Option<(usize, u64, u32)>,
}

impl Gates {
    /// Gates for `slots` launch slots starting at `slots_va`, built from `template` (any launch's QMD of this
    /// queue: only its scheduling fields matter once it is a null grid).
    fn new(
        gpu: &Arc<GpuCore>,
        version: QmdVersion,
        template: &[u32; QMD_WORDS],
        slots_va: u64,
        slots: usize,
    ) -> Result<Gates> {
        let mem = Memory::alloc(
            gpu,
            MemoryDesc::video(GATE_BYTES * slots as u64)
                .with_cpu()
                .low(),
        )?;
        for s in 0..slots {
            let next = slots_va + ((s + 1) % slots) as u64 * SLOT_BYTES;
            let mut g = *template;
            if !qmd::set_gate(version, &mut g, next)? {
                return Err(Error::Unsupported(format!(
                    "programmatic launches on QMD {version:?}"
                )));
            }
            mem.write_words(s as u64 * GATE_BYTES, &g[..version.size_bytes() / 4])?;
        }
        debug!(
            slots,
            "launch gates ready: programmatic launches on this queue"
        );
        Ok(Gates { mem, last: None })
    }

    fn va(&self, slot: usize) -> u64 {
        self.mem.va() + slot as u64 * GATE_BYTES
    }
}

/// A fresh latch id for an eager programmatic launch or a programmatic chain link ([`eager_latch`]).
fn take_latch() -> u32 {
    eager_latch(NEXT_EAGER_LATCH.fetch_add(1, Ordering::Relaxed))
}

/// How a launch is ordered against the work before it on its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    /// Not at all (until a join).
    Unordered,
    /// After the work before it has completed.
    Stream,
    /// Scheduled once the launch right before it has pre-exited (all its blocks exited or ran
    /// `griddepcontrol.launch_dependents`); its `griddepcontrol.wait` waits for that launch's completion.
    Programmatic,
}

/// How a programmatic launch goes through the gates: the gate of its own slot, armed before it is sent, and the
/// gate of the slot before when that slot's programmatic launch schedules it (counted down instead of waiting).
#[derive(Clone, Copy, Debug)]
struct GateSend {
    own: u64,
    after: Option<u64>,
}

/// Driver words of constant bank 0 that launches write (blockDim .. initial stack pointer).
const CBANK_DRIVER_WORDS: usize = super::cbank::LAUNCH_WORDS;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TemplateKey {
    program_va: u64,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    local: u32,
    cbank_size: u32,
    ordered: bool,
    cluster: Option<[u32; 3]>,
    sync_domain: u8,
    cluster_policy: ClusterPolicy,
}

/// Writes the words of `new` that differ from `shadow` (runs of them at once) and updates the shadow.
fn write_changed(mem: &Memory, offset: u64, shadow: &mut [u32], new: &[u32]) -> Result<()> {
    let mut i = 0;
    while i < new.len() {
        if shadow[i] == new[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < new.len() && shadow[i] != new[i] {
            i += 1;
        }
        mem.write_words(offset + start as u64 * 4, &new[start..i])?;
        shadow[start..i].copy_from_slice(&new[start..i]);
    }
    Ok(())
}
/// Identities of prepared launches (0 is no launch), for the slots that hold one's QMD.
static NEXT_PREPARED_ID: AtomicU64 = AtomicU64::new(1);

/// A launch of one kernel over one shape, checked and built once by [`ComputeQueue::prepare_launch`] for one queue:
/// launching it again only packs the arguments and writes what differs per launch.
#[derive(Clone)]
pub struct PreparedLaunch {
    id: u64,
    queue: u64,
    kernel: Kernel,
    cfg: LaunchConfig,
    /// Local memory per thread the QMD was built for.
    local: u32,
    /// The QMD, constant bank 0 at address 0 and release payload 0 (both patched per slot and launch).
    qmd: Box<[u32; QMD_WORDS]>,
    driver: [u32; CBANK_DRIVER_WORDS],
    cluster: [u32; CLUSTER_WORDS],
}

impl PreparedLaunch {
    /// The kernel it launches.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// The grid, block, shared memory and cluster shape it launches with.
    pub fn config(&self) -> &LaunchConfig {
        &self.cfg
    }
}

impl std::fmt::Debug for PreparedLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLaunch")
            .field("kernel", &self.kernel.info().name)
            .field("config", &self.cfg)
            .field("queue", &self.queue)
            .finish()
    }
}

/// Identities of compute queues, for objects that belong to one queue (a [`GraphExec`]).
static NEXT_QUEUE_ID: AtomicU64 = AtomicU64::new(1);

/// Kernel launches in order on our own channel.
pub struct ComputeQueue {
    /// Unique in the process: what a [`GraphExec`] checks it is replayed on.
    id: u64,
    queue: Queue,
    gpu: Arc<GpuCore>,
    version: QmdVersion,
    limits: Limits,
    slots: Memory,
    slot_values: Vec<u64>,
    next_slot: usize,
    params: Vec<u8>,
    windows_va: u64,
    local: Option<Memory>,
    local_per_thread: u32,
    retired_local: Vec<(Memory, u64)>,
    seen_generation: u64,
    /// Launches recorded without their own completion signal since the last join.
    unordered_pending: bool,
    /// The last timeline value the front end released itself after acquiring everything before it (a wait or a
    /// release of a value): a launch right after it needs no acquire of its own, the in-order front end has already
    /// waited.
    front_settled: u64,
    /// How a launch waits for the previous one: the acquire comparison and whether the scheduler may switch
    /// channel groups while it waits.
    ordering: StreamOrder,
    /// The built-in kernels' module (copy, fill), loaded on first use.
    builtin: Option<Arc<crate::module::Module>>,
    /// The QMD of the last launch shape, patched per launch instead of rebuilt.
    template: Option<(TemplateKey, [u32; QMD_WORDS])>,
    /// What each slot's QMD and driver words hold now (the slots are write-only device memory).
    qmd_shadow: Vec<[u32; QMD_WORDS]>,
    cb_shadow: Vec<[u32; CBANK_DRIVER_WORDS]>,
    /// What each slot's cluster words of constant bank 0 hold now.
    cluster_shadow: Vec<[u32; CLUSTER_WORDS]>,
    /// Per slot, the [`PreparedLaunch`] whose QMD and driver words the slot holds (0: none), so launching it there
    /// again rewrites only the parameters and the release payload.
    slot_owner: Vec<u64>,
    inline_qmd: bool,
    /// [`ComputeQueueConfig::prefetch_next`].
    prefetch: bool,
    /// [`ComputeQueueConfig::prefetch_qmds`].
    prefetch_qmds: bool,
    /// The address of the slots' CPU mapping where they are CPU-cached and prefetched (an address, not a pointer:
    /// it is only ever a prefetch hint, never dereferenced).
    prefetch_slots: Option<usize>,
    timeout: Duration,
    /// The chain being recorded by `record_launch_chained`, sent by `end_chain`.
    chain: Option<OpenChain>,
    chain_action: ChainAction,
    graph_schedule: GraphSchedule,
    chain_part: usize,
    /// The size of the next chain part: [`FIRST_CHAIN_PART`] for a new chain, doubling part by part up to
    /// `chain_part` while a long chain is recorded.
    next_part: usize,
    /// The printf FIFO of the modules launched so far (one per GPU), drained when the queue synchronizes.
    printf: Option<Arc<PrintfFifo>>,
    /// The grid barrier cooperative launches count in (zeroed once; it resets itself at every sync).
    grid_barrier: Option<Memory>,
    /// Set while a cooperative launch is being recorded: its grid barrier's address.
    cooperative: Option<u64>,
    /// The slot gates of programmatic launches, once the queue has launched one.
    gates: Option<Gates>,
}

/// How a launch in stream order waits for the work before it on its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrder {
    /// The front end acquires the queue's timeline at the previous submission's value before sending the launch
    /// (what libcuda does for back-to-back launches on a stream).
    Acquire {
        /// The acquire's comparison.
        cmp: Acquire,
        /// Whether the scheduler may switch channel groups while the acquire waits (`ACQUIRE_SWITCH_TSG`). On a queue
        /// in the channel group the GPU's queues share, that switches out every queue of the group, their running
        /// kernels included; build the queue with `ChannelConfig::own_group` to yield alone.
        switch_tsg: bool,
    },
    /// The front end waits for the engine to go idle (host `WFI`) before sending the launch. Every grid of the
    /// engine's context counts, also another channel's of the same channel group.
    WaitForIdle,
}

impl StreamOrder {
    /// Records the wait for timeline value `prev` at `timeline_va`.
    pub(crate) fn wait(self, p: &mut crate::pushbuf::Push<'_>, timeline_va: u64, prev: u64) {
        match self {
            StreamOrder::Acquire { cmp, switch_tsg } => {
                p.sem_acquire(timeline_va, prev, cmp, true, switch_tsg)
            }
            StreamOrder::WaitForIdle => p.wfi(),
        }
    }
}

/// The timeline release a launch's QMD carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// None: an unordered launch.
    None,
    /// The value the launch's own submission will have (after a join of unordered launches, if one is pending).
    Next,
    /// Set when the chain it belongs to ends.
    Later,
}

impl Release {
    fn next_if(ordered: bool) -> Release {
        if ordered {
            Release::Next
        } else {
            Release::None
        }
    }
}

/// Chained launches recorded but not sent. The last one's QMD is held back until the next launch (or the chain's
/// end) says what follows it, so every QMD is written once and completely before the chain's head is sent.
#[derive(Clone, Copy)]
struct OpenChain {
    first_slot: usize,
    len: usize,
    /// Links this part holds before it is sent.
    limit: usize,
    invalidate: bool,
    last_slot: usize,
    last_qmd: [u32; QMD_WORDS],
}

impl std::fmt::Debug for ComputeQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeQueue")
            .field("version", &self.version)
            .field("last", &self.queue.last_submitted())
            .finish()
    }
}

impl ComputeQueue {
    /// Builds a compute queue on `gpu`: the channel and pushbuffer, the launch slots, the shader windows and
    /// local memory; waits until the GPU has run the set-up, so a queue that exists is known to work.
    pub fn new(gpu: &Arc<GpuCore>, config: ComputeQueueConfig) -> Result<ComputeQueue> {
        if config.slots == 0 {
            return Err(Error::Unsupported(
                "a compute queue needs at least one launch slot".into(),
            ));
        }
        let mut qc = config.queue;
        qc.channel.compute = true;
        let queue = Queue::new(gpu, qc)?;
        let class = queue
            .channel()
            .classes()
            .compute
            .ok_or_else(|| Error::Unsupported("no compute class".into()))?;
        let sm = gpu.info().sm_version;
        let generation = Generation::lookup(sm).map_err(|e| Error::Unsupported(e.to_string()))?;
        let version = generation.qmd;
        if generation.classes.map(|c| c.compute) != Some(class) {
            return Err(Error::Unsupported(format!(
                "compute class {class:#x} on sm_{sm}, whose row in the GPU-generation table names {:?}",
                generation.classes
            )));
        }
        if !generation.direct_launch() {
            // The cbank0 driver layout and QMD recipe are verified on Hopper; other generations use the driver.
            return Err(Error::Unsupported(format!(
                "sm_{sm} ({} {}, QMD {version:?}): {:?}; the direct launch path runs on Hopper (sm_90)",
                generation.name, generation.chips, generation.verified
            )));
        }
        if config.slot_placement == Placement::Semaphores {
            return Err(Error::Unsupported(
                "launch slots cannot live in GPU-cacheable semaphore memory (the GPU could run a stale QMD)".into(),
            ));
        }
        let mut queue = queue;
        queue.note_write_combined(config.slot_placement);
        let slots = Memory::alloc(
            gpu,
            MemoryDesc::video(SLOT_BYTES * config.slots as u64)
                .placement(config.slot_placement)
                .with_cpu()
                .low(),
        )?;
        let prefetch_slots = (config.prefetch_next
            && config.slot_placement == Placement::SystemCached)
            .then(|| slots.cpu_ptr().map(|p| p.as_ptr() as usize))
            .flatten();
        // What the per-slot shadows say the slots hold: a zero QMD and zero driver words (the launches write only the
        // words that differ), so zero those once; parameters are written whole by every launch, so the rest of each
        // slot (most of its 33 KiB) is never read before it is written and is left as allocated.
        for s in 0..config.slots as u64 {
            slots.fill(s * SLOT_BYTES, QMD_BYTES + DRIVER_BYTES as u64, 0)?;
        }
        let windows_va = gpu.window_range(WINDOWS_BYTES, WINDOW_ALIGN)?;
        let mut cq = ComputeQueue {
            id: NEXT_QUEUE_ID.fetch_add(1, Ordering::Relaxed),
            queue,
            gpu: gpu.clone(),
            version,
            limits: Limits::for_generation(generation),
            slots,
            slot_values: vec![0; config.slots],
            next_slot: 0,
            params: vec![0; MAX_PARAM_BYTES],
            windows_va,
            local: None,
            local_per_thread: 0,
            retired_local: Vec::new(),
            seen_generation: 0,
            unordered_pending: false,
            front_settled: 0,
            ordering: StreamOrder::Acquire {
                cmp: Acquire::CircularGeq,
                switch_tsg: false,
            },
            builtin: None,
            template: None,
            qmd_shadow: vec![[0; QMD_WORDS]; config.slots],
            cb_shadow: vec![[0; CBANK_DRIVER_WORDS]; config.slots],
            cluster_shadow: vec![[0; CLUSTER_WORDS]; config.slots],
            slot_owner: vec![0; config.slots],
            inline_qmd: config.inline_qmd,
            prefetch: config.prefetch_next,
            prefetch_qmds: config.prefetch_qmds,
            prefetch_slots,
            timeout: config.timeout,
            chain: None,
            chain_action: ChainAction::InvalidateCopySchedule,
            graph_schedule: GraphSchedule::Gpu,
            chain_part: config.chain_part.clamp(1, config.slots),
            next_part: FIRST_CHAIN_PART.min(config.chain_part.clamp(1, config.slots)),
            printf: None,
            grid_barrier: None,
            cooperative: None,
            gates: None,
        };
        let (shared, local) = (cq.shared_window(), cq.local_window());
        cq.queue.submit(16, Signal::Host, |p, _| {
            p.set_spa_version(sm / 10, sm % 10);
            p.set_qmd_version(0x40, 1);
            p.set_shader_windows(shared, local);
        })?;
        cq.ensure_local_memory(INITIAL_STACK)?;
        cq.queue.wait_idle_kicking(cq.timeout)?;
        debug!(
            shared = format_args!("{shared:#x}"),
            local = format_args!("{local:#x}"),
            "compute queue ready"
        );
        Ok(cq)
    }

    /// This queue's identity, unique in the process (what a [`GraphExec`] is bound to).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// GPU address of the local-memory window: where each thread's local memory (stack) appears in the
    /// generic address space.
    pub fn local_window(&self) -> u64 {
        self.windows_va
    }

    /// GPU address of the shared-memory window: where a block's shared memory appears in the generic address
    /// space.
    pub fn shared_window(&self) -> u64 {
        self.windows_va + WINDOW_ALIGN
    }

    /// The limits every launch on this queue is checked against.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The GPU the queue runs on.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        &self.gpu
    }

    /// The pushbuffer queue under this one.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The pushbuffer queue under this one, to record methods of one's own between launches.
    pub fn queue_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }

    /// How launches wait for the previous one (the host acquire's comparison and ACQUIRE_SWITCH_TSG, which on a queue
    /// of the shared channel group yields every queue of it: see [`StreamOrder::Acquire`]).
    /// The default is a 64-bit circular >= without switching, the form tinygrad runs on the H200.
    pub fn set_ordering(&mut self, cmp: Acquire, switch_tsg: bool) {
        self.ordering = StreamOrder::Acquire { cmp, switch_tsg };
    }

    /// How a launch waits for the one before it (see [`StreamOrder`]).
    pub fn set_stream_order(&mut self, order: StreamOrder) {
        self.ordering = order;
    }

    /// How launches wait for the one before.
    pub fn stream_order(&self) -> StreamOrder {
        self.ordering
    }

    /// Local memory per thread the queue provides now.
    pub fn local_bytes_per_thread(&self) -> u32 {
        self.local_per_thread
    }

    /// Grows the local-memory buffer so every thread has `stack` bytes of stack. The old buffer stays alive
    /// until the launches that may use it are complete.
    fn ensure_local_memory(&mut self, stack: u32) -> Result<()> {
        let per_thread = (stack + LOCAL_RESERVE).next_multiple_of(16);
        if per_thread <= self.local_per_thread {
            return Ok(());
        }
        let info = self.gpu.info();
        // Every thread an SM can hold, on both SMs of a TPC (libcuda: 0x640 per thread gives 0x640000 per TPC).
        let threads_per_tpc = u64::from(info.max_warps_per_sm) * 32 * u64::from(info.sms_per_tpc);
        let per_tpc = (u64::from(per_thread) * threads_per_tpc).next_multiple_of(0x8000);
        let total = (per_tpc * u64::from(info.tpc_count)).next_multiple_of(2 << 20);
        let mem = Memory::alloc(&self.gpu, MemoryDesc::video(total))?;
        let va = mem.va();
        let tpcs = info.tpc_count;
        self.queue.submit(24, Signal::Host, |p, _| {
            p.wfi();
            p.set_local_memory(va, per_tpc, tpcs);
        })?;
        if let Some(old) = self.local.replace(mem) {
            self.retired_local.push((old, self.queue.last_submitted()));
        }
        self.local_per_thread = per_thread;
        debug!(per_thread, total, "local memory grown");
        Ok(())
    }

    /// Checks a launch: the block's shared memory and the cluster shape it runs with.
    fn check(&self, kernel: &Kernel, cfg: &LaunchConfig) -> Result<(u32, Option<[u32; 3]>)> {
        let k = kernel.info();
        if !Arc::ptr_eq(kernel.module().gpu(), &self.gpu) {
            return Err(Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!(
                    "the module is loaded on {} and the queue runs on {}; load the module on the queue's GPU",
                    kernel.module().gpu().info().uuid,
                    self.gpu.info().uuid
                ),
            });
        }
        let shared = validate(k, cfg, &self.limits)?;
        Ok((shared, cluster_shape(k, cfg, &self.limits)?))
    }

    /// Launches `kernel` over `cfg` with `args` (checked against the kernel's parameter table). Launches on one
    /// queue run in order. The fence completes when the kernel has finished.
    ///
    /// # Safety
    /// The kernel runs with the queue's GPU access: it may read and write any address the arguments lead it to.
    /// The caller guarantees that buffers the kernel writes are not in use elsewhere until the fence completes.
    pub unsafe fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_launch(kernel, cfg, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// Launches a kernel that synchronizes its whole grid (cooperative groups `this_grid().sync()`), as
    /// `cuLaunchCooperativeKernel` does: refused unless every block of the grid can be resident at once, and the
    /// kernel gets the grid barrier it synchronizes on. Cooperative launches on one queue run in order and share
    /// one barrier. A kernel that syncs its grid but is launched with [`launch`](Self::launch) traps, as it does
    /// under CUDA.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_cooperative(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let k = kernel.info();
        let info = self.gpu.info();
        let blocks = u64::from(cfg.grid[0]) * u64::from(cfg.grid[1]) * u64::from(cfg.grid[2]);
        let threads = cfg.block[0]
            .saturating_mul(cfg.block[1])
            .saturating_mul(cfg.block[2]);
        let limits = super::occupancy::DeviceLimits::for_sm(info.sm_version, info.sm_count)
            .ok_or_else(|| {
                Error::Unsupported(format!("no occupancy table for sm_{}", info.sm_version))
            })?;
        let resources =
            super::occupancy::KernelResources::from_kernel(k, kernel.module().cubin().sm_version());
        let occ = super::occupancy::occupancy(&limits, &resources, threads, cfg.shared_bytes)
            .map_err(|e| Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: e.to_string(),
            })?;
        let resident = u64::from(occ.active_blocks) * u64::from(info.sm_count);
        if blocks > resident {
            return Err(Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!(
                    "a cooperative launch of {blocks} blocks, but at most {resident} can be resident at once \
                     ({} per SM on {} SMs); a grid-wide sync would wait forever",
                    occ.active_blocks, info.sm_count
                ),
            });
        }
        let barrier = match &self.grid_barrier {
            Some(m) => m.va(),
            None => {
                let m = Memory::alloc(&self.gpu, MemoryDesc::video(256).with_cpu())?;
                m.fill(0, 256, 0)?;
                let va = m.va();
                self.grid_barrier = Some(m);
                va
            }
        };
        self.cooperative = Some(barrier);
        // SAFETY: forwarded.
        let fence = unsafe { self.launch(kernel, cfg, args) };
        self.cooperative = None;
        fence
    }

    /// As [`launch`](Self::launch) without ringing the doorbell; [`flush`](Self::flush) sends everything
    /// recorded under one doorbell.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record(kernel, cfg, args, Order::Stream)?;
        Ok(self.queue.fence_for(value))
    }

    /// Launches `kernel` as a programmatic dependent of the launch right before it on this queue, as CUDA's
    /// programmatic stream serialization does (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`): the GPU
    /// schedules it once every block of that launch has exited or run `griddepcontrol.launch_dependents`
    /// (`cudaTriggerProgrammaticLaunchCompletion`), and its `griddepcontrol.wait` (`cudaGridDependencySynchronize`)
    /// returns once that launch has completed and its writes are visible. The launch's start overlaps the tail of
    /// the one before instead of waiting for its completion in the channel's front end.
    ///
    /// Built as libcuda builds it (apex-trace of `probes/pdl_stream.cu`): a programmatic launch counts down a gate of
    /// its slot when it pre-exits, and the programmatic launch after it counts the same gate down from the front end,
    /// which then schedules it. Only programmatic launches carry gates (a gate costs the GPU ~0.3 µs per launch,
    /// which plain launches do not pay), so a programmatic launch right after a plain one, a copy, a wait, a join or
    /// a chain, the first of a queue, and one on a queue that sends QMDs inline ([`LaunchMemory::Host`]) or has a
    /// single launch slot are ordered as ordinary launches: nothing can start them early. That is always correct:
    /// the attribute allows overlap, it does not require it.
    ///
    /// A kernel that touches nothing the launch before it writes may skip `griddepcontrol.wait`: it then runs
    /// alongside that launch, but its fence still completes only after that launch has (the work distributor holds
    /// a gate-scheduled grid's completion until its latch; `tests/gpu_pdl.rs` checks it on the GPU), so fences and
    /// the queue's order stay as for any launch.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, the kernel must run `griddepcontrol.wait` before it touches memory
    /// the launch before it writes, and must not, before that wait, write memory the launch before it reads or
    /// writes (that launch may still be running).
    pub unsafe fn launch_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_launch_programmatic(kernel, cfg, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`launch_programmatic`](Self::launch_programmatic) without ringing the doorbell.
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    pub unsafe fn record_launch_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record(kernel, cfg, args, Order::Programmatic)?;
        Ok(self.queue.fence_for(value))
    }

    /// Whether this queue has launched programmatically ([`launch_programmatic`](Self::launch_programmatic)) and
    /// built the gates its programmatic launches use.
    pub fn is_programmatic(&self) -> bool {
        self.gates.is_some()
    }

    /// Records a launch that may run concurrently with the launches around it (no wait for the previous one,
    /// no completion signal of its own). [`join`](Self::join) returns the fence that covers it; an ordered
    /// launch or copy after it joins first.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, nothing orders this kernel against the other unordered ones.
    pub unsafe fn record_launch_unordered(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record(kernel, cfg, args, Order::Unordered).map(drop)
    }

    /// Checks a launch of `kernel` over `cfg` once and builds its QMD and driver words, so that
    /// [`launch_prepared`](Self::launch_prepared) only packs the arguments and writes what changes per launch (on a
    /// slot that held the same prepared launch before: the parameters and two words of the QMD). Grows the queue's
    /// local memory for the kernel now. Cooperative launches are not prepared.
    pub fn prepare_launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
    ) -> Result<PreparedLaunch> {
        let checked = self.check(kernel, cfg)?;
        let k = kernel.info();
        if k.min_stack_size + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(k.min_stack_size)?;
        }
        let release = (self.queue.timeline().va(), 0);
        let params = qmd_params(
            kernel,
            cfg,
            checked,
            0,
            self.local_per_thread,
            Some(release),
        )?;
        let mut qmd = [0u32; QMD_WORDS];
        qmd::build(self.version, &params, &mut qmd)?;
        qmd::prefetch_bank0(self.version, &mut qmd)?;
        let (driver, cluster) = self.bank_words(cfg, checked.1, None);
        Ok(PreparedLaunch {
            id: NEXT_PREPARED_ID.fetch_add(1, Ordering::Relaxed),
            queue: self.id,
            kernel: kernel.clone(),
            cfg: *cfg,
            local: self.local_per_thread,
            qmd: Box::new(qmd),
            driver,
            cluster,
        })
    }

    /// Launches a [`PreparedLaunch`] of this queue with `args` (checked against the kernel's parameter table), in
    /// order with everything else on the queue, and rings the doorbell. Allocates nothing.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_prepared(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_prepared(prepared, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`launch_prepared`](Self::launch_prepared) without ringing the doorbell.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_prepared(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record_prepared_as(prepared, args, Order::Stream)?;
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_prepared`](Self::launch_prepared), returning the launch's value on the queue's timeline instead
    /// of a fence ([`fence_for`](Self::fence_for) makes one when it is wanted): a fence holds a reference count,
    /// and taking and dropping it are locked instructions, which wait until every store before them has left the
    /// CPU: the launch's own stores and its doorbell. The cheapest launch call for a caller that waits on the
    /// queue, or on a later launch's fence.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    #[inline]
    pub unsafe fn launch_prepared_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record_prepared_as(prepared, args, Order::Stream)?;
        self.send_launch_now();
        Ok(value)
    }

    /// Sends the launch just recorded (the doorbell, or the gate of a polled queue), then prefetches for writing
    /// what the next launch writes.
    #[inline]
    fn send_launch_now(&mut self) {
        self.queue.kick();
        self.prefetch_next();
    }

    /// [`ComputeQueueConfig::prefetch_next`]: prefetches for writing what the next launch writes.
    #[inline]
    fn prefetch_next(&self) {
        if !self.prefetch {
            return;
        }
        if let Some(base) = self.prefetch_slots {
            let slot = base + self.next_slot * SLOT_BYTES as usize;
            // An inline QMD's release payload travels in the pushbuffer, not the slot.
            if !self.inline_qmd
                && let Some(w) = qmd::release_payload_word(self.version)
            {
                crate::gpfifo::prefetch_for_write((slot + w * 4) as *const u8);
            }
            crate::gpfifo::prefetch_for_write(
                (slot + (QMD_BYTES + DRIVER_BYTES as u64) as usize) as *const u8,
            );
        }
        self.queue.prefetch_next();
    }

    /// A fence that completes once the queue's timeline reaches `value` (a value
    /// [`launch_prepared_value`](Self::launch_prepared_value) returned).
    pub fn fence_for(&self, value: u64) -> Fence {
        self.queue.fence_for(value)
    }

    /// Launches a [`PreparedLaunch`] of this queue as a programmatic dependent of the launch right before it
    /// ([`launch_programmatic`](Self::launch_programmatic)), and rings the doorbell. Allocates nothing once the
    /// queue's gates exist (its first programmatic launch builds them).
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    pub unsafe fn launch_prepared_programmatic(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record_prepared_as(prepared, args, Order::Programmatic)?;
        self.send_launch_now();
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_prepared_programmatic`](Self::launch_prepared_programmatic), returning the launch's value on
    /// the queue's timeline instead of a fence (see [`launch_prepared_value`](Self::launch_prepared_value)).
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    #[inline]
    pub unsafe fn launch_prepared_programmatic_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record_prepared_as(prepared, args, Order::Programmatic)?;
        self.send_launch_now();
        Ok(value)
    }

    fn record_prepared_as(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
        order: Order,
    ) -> Result<u64> {
        let p = prepared;
        let kernel = &p.kernel;
        if p.queue != self.id {
            return Err(Error::InvalidLaunch {
                kernel: kernel.info().name.clone(),
                why: format!(
                    "it was prepared on compute queue {} and is launched on queue {}; prepare it on this queue",
                    p.queue, self.id
                ),
            });
        }
        if p.local != self.local_per_thread {
            // Another kernel grew local memory since: the prepared QMD names the old size, so build afresh.
            return self.record(kernel, &p.cfg, args, order);
        }
        self.end_open_chain()?;
        let n = pack(kernel.info(), args, &mut self.params)?;
        self.adopt_printf(kernel);
        self.retire_local();
        let slot = self.claim_slot()?;
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let prev = self.queue.last_submitted();
        let value = prev + 1;
        let slot_off = slot as u64 * SLOT_BYTES;
        // A programmatic launch gets its own gate and latch fields, so its slot holds no reusable QMD afterwards.
        let gates = order == Order::Programmatic && self.can_gate();
        let mut gated = None;
        match qmd::release_payload_word(self.version) {
            Some(w) if self.slot_owner[slot] == p.id && !gates => {
                // The slot holds this launch's QMD and driver words: only the release payload changes.
                let payload = [value as u32, (value >> 32) as u32];
                if !self.inline_qmd {
                    self.slots.write_words(slot_off + w as u64 * 4, &payload)?;
                }
                self.qmd_shadow[slot][w..w + 2].copy_from_slice(&payload);
            }
            _ => {
                let mut q = *p.qmd;
                let cb_va = self.slot_qmd_va(slot) + QMD_BYTES;
                qmd::patch_launch(self.version, &mut q, cb_va, Some(value))?;
                gated = self.gate(order, slot, &mut q)?;
                self.stage_qmd(slot, &q)?;
                self.write_bank_words(slot, &p.driver, &p.cluster)?;
                self.slot_owner[slot] = if gated.is_some() { 0 } else { p.id };
            }
        }
        self.slots.write(
            slot_off + QMD_BYTES + DRIVER_BYTES as u64,
            &self.params[..n],
        )?;
        self.next_slot = (slot + 1) % self.slot_values.len();
        self.send_ordered(slot, kernel, true, gated)
    }

    /// Records a signal that completes once every launch so far has completed (waiting for the compute engine to
    /// go idle), rings the doorbell, and returns its fence.
    pub fn join(&mut self) -> Result<Fence> {
        self.end_open_chain()?;
        let fence = self.queue.submit(0, Signal::Host, |_, _| {})?;
        self.unordered_pending = false;
        Ok(fence)
    }

    /// Sends an open chain and joins unordered launches, so that the queue's last timeline value covers all its
    /// work so far; returns that value (what later work waits for).
    /// Whether work sent after timeline value `prev` on this queue's channel needs no acquire of it: the CPU has
    /// seen it reached, or the front end released it itself after waiting for everything before it (its in-order
    /// processing then holds later methods until then).
    fn settled(&self, prev: u64) -> bool {
        prev == self.front_settled || self.queue.timeline().is_known_reached(prev)
    }

    /// Whether `prev` is settled ([`settled`](Self::settled)), reading the timeline if need be.
    pub(crate) fn settled_now(&self, prev: u64) -> bool {
        prev == self.front_settled || self.queue.timeline().is_reached(prev)
    }

    /// The timeline value that, once reached, means every launch and copy submitted to this queue so far is
    /// complete: what a stream-ordered free records. Sends an open chain and joins unordered launches first; with
    /// neither (the usual case) it reads one field and submits nothing.
    #[inline]
    pub fn completion_value(&mut self) -> Result<u64> {
        if self.chain.is_none() && !self.unordered_pending {
            return Ok(self.queue.last_submitted());
        }
        self.settle_earlier()
    }

    fn settle_earlier(&mut self) -> Result<u64> {
        self.end_open_chain()?;
        if self.unordered_pending {
            self.join()?;
        }
        Ok(self.queue.last_submitted())
    }

    /// Makes this queue's later launches and copies wait, on the GPU, until the 64-bit word at `va` reaches
    /// `value` (compared circularly, as 64-bit timelines are): how a queue waits for another agent, such as a
    /// CUDA stream's `cuStreamWriteValue64`. The word must be mapped in this GPU's address space.
    pub fn wait_value(&mut self, va: u64, value: u64) -> Result<Fence> {
        let prev = self.settle_earlier()?;
        let prev_done = self.settled(prev);
        let timeline_va = self.queue.timeline().va();
        // No wait for idle: the acquires order the release, and the timeline's earlier values were released after
        // their own work, so this value still means "everything before is done".
        let fence = self.queue.submit(24, Signal::Recorded, |p, own| {
            p.sem_acquire(va, value, Acquire::CircularGeq, true, false);
            if !prev_done {
                p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
            }
            p.sem_release(timeline_va, own, crate::pushbuf::Release::NOW_64);
        })?;
        self.front_settled = fence.value();
        Ok(fence)
    }

    /// Writes the 64-bit `value` at `va` once every earlier launch and copy of this queue has completed (their
    /// memory writes visible): how another agent, such as a CUDA stream's `cuStreamWaitValue64`, waits for this
    /// queue.
    pub fn release_value(&mut self, va: u64, value: u64) -> Result<Fence> {
        let prev = self.settle_earlier()?;
        let prev_done = self.settled(prev);
        let timeline_va = self.queue.timeline().va();
        // Every earlier value was released after its work and its memory barrier, so once the acquire sees `prev`
        // the writes are visible: release at once, without waiting for the engine to idle (which costs ~1.5 us).
        let fence = self.queue.submit(24, Signal::Recorded, |p, own| {
            if !prev_done {
                p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
            }
            p.sem_release(va, value, crate::pushbuf::Release::NOW_64);
            p.sem_release(timeline_va, own, crate::pushbuf::Release::NOW_64);
        })?;
        self.front_settled = fence.value();
        Ok(fence)
    }

    /// Makes this queue's later work wait, on the GPU, for `fence` of another queue, on this GPU or another one
    /// of its peer domain (whose semaphore page is then mapped on this GPU, once): no CPU in between.
    pub fn wait_fence(&mut self, fence: &Fence) -> Result<Fence> {
        // Idempotent: a no-op for this GPU's own fences and for pages mapped here before.
        fence.timeline().semaphores().memory().map_on(&self.gpu)?;
        self.wait_value(fence.timeline().va(), fence.value())
    }

    /// Copies `bytes` from `src` to `dst` on the copy engines of `engines` (split across them), after every
    /// earlier launch and copy of this queue; later ones run after it. Both ranges must be mapped on the
    /// engines' GPU (a peer's memory included): the way to fill an NVLink with one copy. The engines may belong
    /// to another GPU of this queue's peer domain (the source GPU of a copy between GPUs, pushing into the
    /// destination's memory): this queue's timeline is then mapped on that GPU and the engines' on this one,
    /// once, so the GPUs order the copy between them without the CPU.
    pub fn copy_on(
        &mut self,
        engines: &mut super::CopyEngines,
        src: u64,
        dst: u64,
        bytes: u64,
    ) -> Result<Fence> {
        if !Arc::ptr_eq(engines.gpu(), &self.gpu) {
            // Refused with the reason (no shared address space) before anything is mapped.
            self.gpu.check_same_domain(engines.gpu())?;
            self.queue
                .timeline()
                .semaphores()
                .memory()
                .map_on(engines.gpu())?;
            engines.map_semaphores_on(&self.gpu)?;
        }
        let prev = self.settle_earlier()?;
        let after =
            (!self.queue.timeline().is_reached(prev)).then(|| (self.queue.timeline().va(), prev));
        let parts = engines.copy(src, dst, bytes, after)?;
        // Yield while the engines work (see CopyEngines::copy), unless yielding would switch out the group other
        // queues' kernels run in; spinning there holds up only this channel.
        let yield_group = !self.queue.channel().shares_group();
        Ok(self
            .queue
            .submit(8 * parts.len() + 8, Signal::Host, |p, _| {
                for &(va, value) in parts {
                    p.sem_acquire(va, value, Acquire::CircularGeq, true, yield_group);
                }
            })?)
    }

    /// Copies `bytes` of device memory from `src` to `dst` with a copy kernel on the SMs, ordered like a launch:
    /// the copy engine moves device-to-device data at about 90 GB/s on the H200, the SMs at the HBM's bandwidth.
    ///
    /// # Safety
    /// Both ranges must be device memory mapped in this GPU's address space for `bytes` bytes; the kernel writes
    /// `dst` as any kernel would.
    pub unsafe fn copy_device(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "apex_copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        let (k, cfg) = self.copy_launch(bytes)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(&k, &cfg, &[Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(bytes)]) }
    }

    /// Sets `count` elements of `width` bytes (1, 2 or 4) at `dst` to the low bytes of `value`
    /// (`cuMemsetD8/16/32`) with a fill kernel on the SMs, ordered like a launch.
    ///
    /// # Safety
    /// `dst` must be memory mapped in this GPU's address space for `count * width` bytes, aligned to `width`; the
    /// kernel writes it as any kernel would.
    pub unsafe fn fill(&mut self, dst: u64, value: u32, width: u32, count: u64) -> Result<Fence> {
        let bad = |why: String| Error::InvalidLaunch {
            kernel: "apex_fill".into(),
            why,
        };
        if !matches!(width, 1 | 2 | 4) {
            return Err(bad(format!(
                "an element width of {width} bytes (1, 2 or 4)"
            )));
        }
        if !dst.is_multiple_of(u64::from(width)) {
            return Err(bad(format!("{dst:#x} is not aligned to {width} bytes")));
        }
        let bytes = count
            .checked_mul(u64::from(width))
            .filter(|&b| b > 0)
            .ok_or_else(|| bad(format!("{count} elements of {width} bytes")))?;
        let (k, cfg) = self.builtin_launch("apex_fill", bytes)?;
        // SAFETY: forwarded to the caller.
        unsafe {
            self.launch(
                &k,
                &cfg,
                &[
                    Arg::Ptr(dst),
                    Arg::U32(value),
                    Arg::U32(width),
                    Arg::U64(count),
                ],
            )
        }
    }

    /// The built-in copy kernel (loaded on first use) and the launch shape that copies `bytes` bytes with it:
    /// 16 bytes per thread per pass, at most 8 blocks per SM (grid-stride beyond).
    fn copy_launch(&mut self, bytes: u64) -> Result<(Kernel, LaunchConfig)> {
        self.builtin_launch("apex_copy", bytes)
    }

    /// Built-in kernel `name` (its module loaded on first use) and the launch shape that covers `bytes` bytes with
    /// it: 16 bytes per thread per pass, at most 8 blocks per SM (grid-stride beyond).
    fn builtin_launch(&mut self, name: &str, bytes: u64) -> Result<(Kernel, LaunchConfig)> {
        if self.builtin.is_none() {
            self.builtin = Some(crate::module::Module::load(&self.gpu, BUILTIN_CUBIN)?);
        }
        let module = self
            .builtin
            .as_ref()
            .ok_or(Error::Unsupported("the built-in kernels".into()))?;
        let k = module.kernel(name)?;
        let threads = 256u64;
        let blocks = bytes
            .div_ceil(16 * threads)
            .clamp(1, u64::from(self.gpu.info().sm_count) * 8) as u32;
        Ok((k, LaunchConfig::linear(blocks, threads as u32)))
    }

    /// Copies `bytes` from `src` to `dst` (GPU addresses: device or host memory mapped for the GPU) with the copy
    /// engine, after every earlier launch and copy of this queue; later ones run after it.
    pub fn copy(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        let prev = self.settle_earlier()?;
        let prev_done = self.queue.timeline().is_reached(prev);
        let timeline_va = self.queue.timeline().va();
        let copy_sem = self.queue.channel().semaphores().va(COPY_SEMAPHORE_SLOT);
        let chunks = bytes.div_ceil(crate::pushbuf::Push::MAX_COPY_CHUNK) as usize;
        let fence = self
            .queue
            .submit(chunks * 12 + 32, Signal::Recorded, |p, v| {
                if !prev_done {
                    p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
                }
                record_copy(p, src, dst, bytes, copy_sem, timeline_va, v);
            })?;
        Ok(fence)
    }

    fn record(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        order: Order,
    ) -> Result<u64> {
        self.end_open_chain()?;
        let ordered = order != Order::Unordered;
        let (slot, mut q) = self.prepare(kernel, cfg, args, Release::next_if(ordered))?;
        let gated = self.gate(order, slot, &mut q)?;
        self.stage_qmd(slot, &q)?;

        if ordered && self.unordered_pending {
            // Join the unordered launches first (recorded; the doorbell below sends both).
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let value = self.send_ordered(slot, kernel, ordered, gated)?;
        if !ordered {
            self.unordered_pending = true;
        }
        Ok(value)
    }

    /// Gives the QMD `q` of a programmatic launch in `slot` its gate fields: it arms its slot's gate (built here by
    /// the queue's first programmatic launch, from `q`), so that a programmatic launch after it may be scheduled by
    /// that gate; and when it comes right after such a launch in the slot before, it waits for that one's latch and
    /// is scheduled by that one's gate. Returns the latch the launch arrives at and the slot whose gate schedules
    /// it, for [`send_ordered`](Self::send_ordered); `None` for any other launch, and on queues that cannot have
    /// gates.
    ///
    /// Only programmatic launches are gated: a gate costs the GPU about 0.3 µs per launch (the GPT-2 step's plain
    /// launches took 788 instead of 744 µs per token with gates, H100), which a launch that lets nothing overlap it
    /// should not pay. A programmatic launch after a plain one is therefore ordered as an ordinary launch.
    fn gate(
        &mut self,
        order: Order,
        slot: usize,
        q: &mut [u32; QMD_WORDS],
    ) -> Result<Option<(u32, Option<usize>)>> {
        if order != Order::Programmatic || !self.can_gate() {
            return Ok(None);
        }
        if self.gates.is_none() {
            self.gates = Some(Gates::new(
                &self.gpu,
                self.version,
                q,
                self.slots.va(),
                self.slot_values.len(),
            )?);
            // The gates are written through the write-combined BAR1 mapping: doorbells must drain it first, also
            // on a queue whose ring, pushbuffer and slots are in host memory.
            self.queue.note_write_combined(Placement::Video);
        }
        let last_submitted = self.queue.last_submitted();
        let n = self.slot_values.len();
        let pending = self.unordered_pending;
        let Some(g) = &mut self.gates else {
            return Ok(None);
        };
        let latch = take_latch();
        qmd::set_gated_producer(self.version, q, g.va(slot), latch)?;
        let after = match g.last {
            Some((s, value, l)) if !pending && value == last_submitted && (s + 1) % n == slot => {
                qmd::set_latch_wait(self.version, q, l)?;
                Some(s)
            }
            _ => None,
        };
        Ok(Some((latch, after)))
    }

    /// Whether this queue can have gates: its QMDs are fetched (an inline QMD cannot be scheduled later) and it has
    /// two slots or more (with one, the next launch's gate would be the one its producer counts down).
    fn can_gate(&self) -> bool {
        !self.inline_qmd && self.slot_values.len() >= 2
    }

    /// Sends the launch staged in `slot`: through the gates when [`gate`](Self::gate) gave it gate fields, else
    /// as [`send_launch`](Self::send_launch) does.
    fn send_ordered(
        &mut self,
        slot: usize,
        kernel: &Kernel,
        ordered: bool,
        gated: Option<(u32, Option<usize>)>,
    ) -> Result<u64> {
        let Some((latch, after)) = gated else {
            return self.send_launch(slot, kernel, ordered, None);
        };
        let gate = self.gates.as_ref().map(|g| GateSend {
            own: g.va(slot),
            after: after.map(|s| g.va(s)),
        });
        let value = self.send_launch(slot, kernel, true, gate)?;
        if let Some(g) = &mut self.gates {
            g.last = Some((slot, value, latch));
        }
        Ok(value)
    }

    /// Sends the launch staged in `slot` (the next value on the timeline), after the previous one when `ordered`,
    /// invalidating the shader caches first if `kernel`'s module is newer than what the queue has run; through
    /// `gate` when it is a programmatic launch ([`GateSend`]).
    fn send_launch(
        &mut self,
        slot: usize,
        kernel: &Kernel,
        ordered: bool,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let prev = self.queue.last_submitted();
        // Only what an earlier read showed: reading the semaphore would cost a cache miss on every launch, and an
        // acquire of a value already released costs the GPU little.
        let prev_done = !ordered || self.settled(prev);
        let invalidate = self.seen_generation < kernel.module().generation();
        let value = self.send_slot(slot, invalidate, prev_done, prev, gate)?;
        debug_assert_eq!(value, prev + 1);
        if invalidate {
            self.seen_generation = newest_generation();
        }
        self.slot_values[slot] = value;
        Ok(value)
    }

    /// Checks a launch, packs its parameters, takes the next free slot and writes the slot's constant bank 0; returns
    /// the slot and the launch's QMD (not yet written).
    fn prepare(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        release: Release,
    ) -> Result<(usize, [u32; QMD_WORDS])> {
        let k = kernel.info();
        let (shared, cluster) = self.check(kernel, cfg)?;
        let n = pack(k, args, &mut self.params)?;
        self.adopt_printf(kernel);
        if k.min_stack_size + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(k.min_stack_size)?;
        }
        self.retire_local();

        let slot = self.claim_slot()?;
        // The general path rewrites whatever differs, so no prepared launch owns the slot afterwards.
        self.slot_owner[slot] = 0;
        let slot_off = slot as u64 * SLOT_BYTES;
        let cb_va = self.slot_qmd_va(slot) + QMD_BYTES;
        // After anything above that submitted (local memory, a join): the value this launch will be sent with.
        let release = match release {
            Release::None => None,
            Release::Next => {
                Some(self.queue.last_submitted() + 1 + u64::from(self.unordered_pending))
            }
            Release::Later => Some(0),
        };

        let key = TemplateKey {
            program_va: kernel.program_va(),
            grid: cfg.grid,
            block: cfg.block,
            shared,
            local: self.local_per_thread,
            cbank_size: k.param_cbank_size,
            ordered: release.is_some(),
            cluster,
            sync_domain: cfg.sync_domain,
            cluster_policy: cfg.cluster_policy,
        };
        let release_va = self.queue.timeline().va();
        let mut q = [0u32; QMD_WORDS];
        let reused = match &self.template {
            Some((t, words)) if *t == key => {
                q = *words;
                qmd::patch_launch(self.version, &mut q, cb_va, release)?
            }
            _ => false,
        };
        if !reused {
            let params = qmd_params(
                kernel,
                cfg,
                (shared, cluster),
                cb_va,
                self.local_per_thread,
                release.map(|v| (release_va, v)),
            )?;
            qmd::build(self.version, &params, &mut q)?;
            qmd::prefetch_bank0(self.version, &mut q)?;
            self.template = Some((key, q));
        }

        // Only the words that differ from what the slot already holds go over the bus (write-combined BAR1).
        let (driver, cluster_words) = self.bank_words(cfg, cluster, self.cooperative);
        self.write_bank_words(slot, &driver, &cluster_words)?;
        self.slots.write(
            slot_off + QMD_BYTES + DRIVER_BYTES as u64,
            &self.params[..n],
        )?;
        self.next_slot = (slot + 1) % self.slot_values.len();
        Ok((slot, q))
    }

    /// Takes the printf FIFO of `kernel`'s module when it has one of its own, draining the one held so far.
    fn adopt_printf(&mut self, kernel: &Kernel) {
        if let Some(fifo) = kernel.module().printf_fifo()
            && !self.printf.as_ref().is_some_and(|f| Arc::ptr_eq(f, fifo))
            && let Some(old) = self.printf.replace(fifo.clone())
        {
            let _ = old.drain();
        }
    }

    /// The next launch slot, once the launch that used it last has completed (the caller advances `next_slot`).
    fn claim_slot(&mut self) -> Result<usize> {
        let slot = self.next_slot;
        let busy_until = self.slot_values[slot];
        if !self.queue.timeline().is_reached(busy_until) {
            if self.unordered_pending {
                // Unordered launches release nothing themselves: a join makes their slots free again.
                self.queue.record(0, Signal::Host, |_, _| {})?;
                self.unordered_pending = false;
            }
            // The launch that holds the slot may only be recorded so far: send it before waiting.
            self.queue.kick();
            self.queue.wait_kicking(busy_until, self.timeout)?;
        }
        Ok(slot)
    }

    fn slot_qmd_va(&self, slot: usize) -> u64 {
        self.slots.va() + slot as u64 * SLOT_BYTES
    }

    /// The driver and cluster words constant bank 0 holds for a launch over `cfg` with cluster shape `cluster`, and
    /// the grid barrier of a cooperative launch.
    fn bank_words(
        &self,
        cfg: &LaunchConfig,
        cluster: Option<[u32; 3]>,
        grid_barrier: Option<u64>,
    ) -> ([u32; CBANK_DRIVER_WORDS], [u32; CLUSTER_WORDS]) {
        let mut driver = [0u32; CBANK_DRIVER_WORDS];
        write_driver_words(
            &mut driver,
            cfg.block,
            cfg.grid,
            self.shared_window(),
            self.local_window(),
        );
        write_grid_barrier(&mut driver, grid_barrier);
        let mut words = [0u32; CLUSTER_WORDS];
        write_cluster_words(&mut words, cfg.grid, cluster);
        (driver, words)
    }

    /// Writes the driver and cluster words of a slot's constant bank 0 that differ from what it holds.
    fn write_bank_words(
        &mut self,
        slot: usize,
        driver: &[u32; CBANK_DRIVER_WORDS],
        cluster: &[u32; CLUSTER_WORDS],
    ) -> Result<()> {
        let bank = slot as u64 * SLOT_BYTES + QMD_BYTES;
        write_changed(&self.slots, bank, &mut self.cb_shadow[slot], driver)?;
        write_changed(
            &self.slots,
            bank + CLUSTER_WORDS_START as u64,
            &mut self.cluster_shadow[slot],
            cluster,
        )
    }

    /// Writes the words of a slot's QMD that differ from what it holds.
    fn write_qmd(&mut self, slot: usize, q: &[u32; QMD_WORDS]) -> Result<()> {
        let qmd_words = self.version.size_bytes() / 4;
        write_changed(
            &self.slots,
            slot as u64 * SLOT_BYTES,
            &mut self.qmd_shadow[slot][..qmd_words],
            &q[..qmd_words],
        )
    }

    /// Records a launch as the next link of a chain: it starts when the launch before it in the chain has
    /// completed, scheduled by the GPU's compute work distributor itself (the QMD dependency libcuda's graphs use on
    /// Hopper), with no round trip through the channel's front end in between. The links are sent when the chain
    /// ends: by [`end_chain`](Self::end_chain), or first thing in any other launch, copy, join or synchronize, or when
    /// the queue is dropped. A long chain is also sent part by part while it is recorded
    /// (`ComputeQueueConfig::chain_part`), each part after the one before.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_launch_chained(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record_chained_as(kernel, cfg, args, false)
    }

    /// Records a launch as the next link of a chain ([`record_launch_chained`](Self::record_launch_chained)) that
    /// is a programmatic dependent of the link before it: the work distributor schedules it once every block of
    /// that link has exited or run `griddepcontrol.launch_dependents`, and its `griddepcontrol.wait` returns once
    /// that link has completed and its writes are visible (the link arrives at a latch the launch waits on), as a
    /// programmatic edge of a graph is built. The first launch of a chain, or of a chain part, waits for the work
    /// before it as usual.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, the kernel must run `griddepcontrol.wait` before it touches memory
    /// the launch before it writes, and must not, before that wait, write memory the launch before it reads or
    /// writes (that launch may still be running).
    pub unsafe fn record_launch_chained_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record_chained_as(kernel, cfg, args, true)
    }

    fn record_chained_as(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<()> {
        if let Some(c) = &self.chain {
            // Local memory may not change under recorded links, and a slot may not be reused inside its own chain
            // (chain_part <= slots).
            let grows = kernel.info().min_stack_size + LOCAL_RESERVE > self.local_per_thread;
            if c.len >= c.limit || grows {
                let next = (c.limit * 2).min(self.chain_part);
                self.end_open_chain()?;
                self.queue.kick();
                // The chain goes on: its next part is larger (end_open_chain started a new chain's count).
                self.next_part = next;
            }
        }
        let (slot, mut q) = self.prepare(kernel, cfg, args, Release::Later)?;
        let invalidate = self.seen_generation < kernel.module().generation();
        match self.chain {
            None => {
                self.chain = Some(OpenChain {
                    first_slot: slot,
                    len: 1,
                    limit: self.next_part,
                    invalidate,
                    last_slot: slot,
                    last_qmd: q,
                })
            }
            Some(mut c) => {
                let next = (self.slot_qmd_va(slot), self.chain_action);
                qmd::set_chain_link(self.version, &mut c.last_qmd, Some(next))?;
                if programmatic {
                    // The link before lets this one be scheduled at its pre-exit and arrives at a latch this one's
                    // griddepcontrol.wait waits on. Scheduled that early, this launch relies on the prefetch of its
                    // own bank 0 every prepared QMD carries (bank 5, PRE): a POST prefetch by the link before would
                    // land too late (as for a graph's programmatic nodes), so none is asked for.
                    let latch = take_latch();
                    qmd::set_latch_arrive(self.version, &mut c.last_qmd, latch)?;
                    qmd::set_latch_wait(self.version, &mut q, latch)?;
                } else {
                    let bank = ConstBuffer {
                        va: self.slot_qmd_va(slot) + QMD_BYTES,
                        size: bank0_size(kernel),
                    };
                    qmd::prefetch_next_bank(self.version, &mut c.last_qmd, bank)?;
                }
                self.write_qmd(c.last_slot, &c.last_qmd)?;
                c.len += 1;
                c.invalidate |= invalidate;
                c.last_slot = slot;
                c.last_qmd = q;
                self.chain = Some(c);
            }
        }
        Ok(())
    }

    /// Ends the chain recorded by [`record_launch_chained`](Self::record_launch_chained) and rings the doorbell: its
    /// first launch waits for the queue's earlier work, and the fence completes when its last launch has completed.
    pub fn end_chain(&mut self) -> Result<Fence> {
        let fence = self.end_open_chain()?.ok_or(Error::NoChain)?;
        self.queue.kick();
        Ok(fence)
    }

    /// Launches recorded in the open chain, not yet sent.
    pub fn chain_len(&self) -> usize {
        self.chain.map_or(0, |c| c.len)
    }

    /// How a chain's QMDs schedule the next one: `InvalidateCopySchedule` (the default) fetches each QMD afresh, as
    /// rewritten slots need; `Schedule` is what libcuda's graphs use for QMDs that never change.
    pub fn set_chain_action(&mut self, action: ChainAction) {
        self.chain_action = action;
    }

    /// How graphs instantiated from now on resolve their dependencies ([`GraphSchedule`]; `Gpu` by default).
    pub fn set_graph_schedule(&mut self, schedule: GraphSchedule) {
        self.graph_schedule = schedule;
    }

    fn end_open_chain(&mut self) -> Result<Option<Fence>> {
        let Some(mut c) = self.chain.take() else {
            return Ok(None);
        };
        self.next_part = FIRST_CHAIN_PART.min(self.chain_part);
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let prev = self.queue.last_submitted();
        let value = prev + 1;
        let prev_done = self.settled_now(prev);
        let cb_va = self.slot_qmd_va(c.last_slot) + QMD_BYTES;
        qmd::patch_launch(self.version, &mut c.last_qmd, cb_va, Some(value))?;
        qmd::set_chain_link(self.version, &mut c.last_qmd, None)?;
        self.write_qmd(c.last_slot, &c.last_qmd)?;
        let sent = self.send(
            self.slot_qmd_va(c.first_slot),
            c.invalidate,
            prev_done,
            prev,
        )?;
        debug_assert_eq!(sent, value);
        if c.invalidate {
            self.seen_generation = newest_generation();
        }
        let n = self.slot_values.len();
        for i in 0..c.len {
            self.slot_values[(c.first_slot + i) % n] = value;
        }
        Ok(Some(self.queue.fence_for(sent)))
    }

    /// Writes a slot's QMD for the GPU to fetch, or with inline QMDs only notes it (the launch carries it).
    fn stage_qmd(&mut self, slot: usize, q: &[u32; QMD_WORDS]) -> Result<()> {
        if self.inline_qmd {
            // The launch carries the QMD and the GPU stores it in the slot: the shadow is what the slot will hold.
            self.qmd_shadow[slot] = *q;
            Ok(())
        } else {
            self.write_qmd(slot, q)
        }
    }

    /// Records the methods that launch the QMD staged for `slot`: inline, or fetched from the slot.
    fn send_slot(
        &mut self,
        slot: usize,
        invalidate: bool,
        prev_done: bool,
        prev: u64,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let inline = self.inline_qmd.then_some(slot);
        let qmd_va = self.slot_qmd_va(slot);
        // A slot's QMD is only ever written by the CPU, before the launch is sent, so it may be fetched early; a
        // gated QMD is not (its gate and latch change as the work distributor runs it).
        let early = self.prefetch_qmds && gate.is_none();
        self.send_qmd(qmd_va, inline, early, invalidate, prev_done, prev, gate)
    }

    /// Records the methods that launch the QMD at `qmd_va`, fetched by the GPU (chain heads; not fetched early: only
    /// a plain slot's QMD is known to be written by the CPU alone).
    fn send(&mut self, qmd_va: u64, invalidate: bool, prev_done: bool, prev: u64) -> Result<u64> {
        self.send_qmd(qmd_va, None, false, invalidate, prev_done, prev, None)
    }

    /// Records a launch of the QMD at `qmd_va`: sent inline from slot `inline`'s staged words, or fetched. A fetched
    /// QMD that waits for the work before it is, where `early`, fetched before that wait, so that the fetch overlaps
    /// the work instead of following it. With a gate ([`GateSend`]), that gate is armed first, and a launch the
    /// previous slot's gate schedules has that gate counted down instead of waiting for the work before it.
    #[allow(clippy::too_many_arguments)]
    fn send_qmd(
        &mut self,
        qmd_va: u64,
        inline: Option<usize>,
        early: bool,
        invalidate: bool,
        prev_done: bool,
        prev: u64,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let timeline_va = self.queue.timeline().va();
        let order = self.ordering;
        let words = inline.map(|slot| &self.qmd_shadow[slot]);
        // At most 17 words besides an inline QMD (cache invalidation 2, read-ahead 5, acquire 6, PCAS 4; or a gate's
        // 4 and a count-down's 4 in their place), so armed slots of 32 words still take every fetched launch.
        let max_words = 24 + words.map_or(0, |_| 3 + QMD_WORDS);
        let after = gate.and_then(|g| g.after);
        let waits = !prev_done && after.is_none();
        let prefetch = early && waits && words.is_none();
        Ok(self
            .queue
            .record_value(max_words, Signal::Recorded, |p, _| {
                if invalidate {
                    p.invalidate_shader_caches_no_wfi();
                }
                if let Some(g) = gate {
                    // Armed (afresh, from memory) before this launch can pre-exit and count it down.
                    p.send_pcas(g.own);
                }
                if prefetch {
                    p.prefetch_qmd(qmd_va);
                }
                if waits {
                    // Stream order: this grid starts only after the previous one has completed.
                    order.wait(p, timeline_va, prev);
                }
                match words {
                    Some(w) => p.send_inline_qmd(qmd_va, w),
                    None if prefetch => p.schedule_prefetched(qmd_va),
                    None => p.send_pcas(qmd_va),
                }
                if let Some(previous) = after {
                    // This QMD requires a scheduling PCAS: the copy just sent waits for the previous slot's gate, which
                    // runs once the previous launch has pre-exited and this decrement has arrived.
                    p.send_pcas_decrement(previous);
                }
            })?)
    }

    /// Rings the doorbell for everything recorded.
    pub fn flush(&mut self) {
        self.queue.kick();
    }

    /// Waits until every launch so far (an open chain included) has completed, then prints what their kernels
    /// `printf`ed. A failed device `assert` is [`Error::Assert`].
    pub fn synchronize(&mut self) -> Result<()> {
        self.end_open_chain()?;
        // What is only recorded so far is sent first.
        self.queue.kick();
        let waited = self.queue.wait_idle_kicking(self.timeout);
        settle(self.printf.as_ref(), waited)
    }

    /// The printf FIFO this queue's kernels write to, once a kernel that calls `printf` or `assert` was launched.
    pub fn printf_fifo(&self) -> Option<&Arc<PrintfFifo>> {
        self.printf.as_ref()
    }

    /// Prints what the kernels completed so far have `printf`ed (waiting on a [`Fence`] of this layer does not).
    pub fn drain_printf(&self) -> Result<Drained> {
        Ok(match &self.printf {
            Some(f) => f.drain()?,
            None => Drained::default(),
        })
    }

    fn retire_local(&mut self) {
        if self.retired_local.is_empty() {
            return;
        }
        let t = self.queue.timeline();
        self.retired_local.retain(|(_, v)| !t.is_reached(*v));
    }
}

impl Drop for ComputeQueue {
    fn drop(&mut self) {
        // Let in-flight launches finish before their memory goes (a short wait: a hung queue is torn down
        // with its channel anyway). A chain still open is sent first: recorded work is never dropped silently.
        if let Err(e) = self.end_open_chain() {
            tracing::warn!(error = %e, "sending the open chain on drop failed");
        }
        self.queue.kick();
        let _ = self.queue.wait_idle(Duration::from_secs(2));
        if let Some(f) = &self.printf
            && let Err(e) = f.drain()
        {
            tracing::warn!(error = %e, "draining printf output on drop failed");
        }
    }
}

/// What the QMD of a launch of `kernel` over `cfg` says, with the block's shared memory and cluster shape
/// `checked` by [`validate`] and [`cluster_shape`], constant bank 0 at `cb_va`, `local` bytes of local memory per
/// thread, and the semaphore release `(va, payload)` it performs on completion.
/// The size constant bank 0 of `kernel`'s launches is bound with (driver words, then the parameters).
fn bank0_size(kernel: &Kernel) -> u32 {
    (DRIVER_BYTES as u32 + kernel.info().param_cbank_size).next_multiple_of(16)
}

fn qmd_params(
    kernel: &Kernel,
    cfg: &LaunchConfig,
    (shared, cluster): (u32, Option<[u32; 3]>),
    cb_va: u64,
    local: u32,
    release: Option<(u64, u64)>,
) -> Result<QmdParams> {
    let k = kernel.info();
    let mut cbs = [None; 8];
    cbs[0] = Some(ConstBuffer {
        va: cb_va,
        size: bank0_size(kernel),
    });
    for bank in k.const_banks.iter().filter(|b| b.bank != 0 && b.bank < 8) {
        if let Some(off) = bank.image_offset {
            let size = u32::try_from(bank.size).map_err(|_| Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!("constant bank {} of {} bytes", bank.bank, bank.size),
            })?;
            cbs[bank.bank as usize] = Some(ConstBuffer {
                va: kernel.module().base_va() + off,
                size,
            });
        }
    }
    Ok(QmdParams {
        sm_version: kernel.module().gpu().info().sm_version,
        program_va: kernel.program_va(),
        program_bytes: k.code_size,
        registers: k.registers,
        barriers: k.barrier_count.max(1),
        grid: cfg.grid,
        block: cfg.block,
        // At least the 1 KiB the sm_90 compiler reserves at shared address 0 (libcuda never sends less).
        shared_bytes: shared.max(1024).next_multiple_of(256),
        local_bytes_per_thread: local,
        const_buffers: cbs,
        release,
        cluster,
        sync_domain: cfg.sync_domain,
        cluster_load_balancing: cfg.cluster_policy == ClusterPolicy::LoadBalancing,
    })
}

/// Finishes a wait on work that may have called `printf` or `assert`: drains the FIFO, and turns a channel fault
/// caused by a failed assertion into [`Error::Assert`].
pub fn settle(
    printf: Option<&Arc<PrintfFifo>>,
    waited: std::result::Result<(), crate::pushbuf::Error>,
) -> Result<()> {
    let Some(fifo) = printf else {
        return Ok(waited?);
    };
    let drained = fifo.drain();
    match (waited, drained) {
        // An assert that ended its thread faults nothing: the drain is where it shows.
        (Ok(()), Ok(mut d))
            if !d.asserts.is_empty()
                && fifo.assert_action() == crate::module::printf::AssertAction::EndThread =>
        {
            Err(Error::Assert(Box::new(super::AssertError {
                failure: d.asserts.swap_remove(0),
                fault: None,
            })))
        }
        (Ok(()), Ok(_)) => Ok(()),
        (Ok(()), Err(e)) => Err(e.into()),
        (Err(fault), Ok(mut d)) if !d.asserts.is_empty() => {
            Err(Error::Assert(Box::new(super::AssertError {
                failure: d.asserts.swap_remove(0),
                fault: Some(fault),
            })))
        }
        (Err(fault), _) => Err(fault.into()),
    }
}

/// Checks a launch of the kernel described by `k` against the device limits; returns the block's shared memory
/// (static + dynamic). Nothing is submitted.
pub fn validate(k: &KernelInfo, cfg: &LaunchConfig, l: &Limits) -> Result<u32> {
    let bad = |why: String| Error::InvalidLaunch {
        kernel: k.name.clone(),
        why,
    };
    for (i, axis) in ["x", "y", "z"].iter().enumerate() {
        if cfg.grid[i] == 0 || cfg.grid[i] > l.max_grid[i] {
            return Err(bad(format!(
                "grid.{axis} = {} (must be 1..={})",
                cfg.grid[i], l.max_grid[i]
            )));
        }
        if cfg.block[i] == 0 || cfg.block[i] > l.max_block[i] {
            return Err(bad(format!(
                "block.{axis} = {} (must be 1..={})",
                cfg.block[i], l.max_block[i]
            )));
        }
    }
    let threads = cfg.block.iter().map(|&b| u64::from(b)).product::<u64>();
    if threads > u64::from(l.max_threads_per_block) {
        return Err(bad(format!(
            "{threads} threads per block (at most {})",
            l.max_threads_per_block
        )));
    }
    if let Some(max) = k.max_threads.filter(|&m| threads > u64::from(m)) {
        return Err(bad(format!(
            "{threads} threads per block, the kernel was compiled for at most {max}"
        )));
    }
    if let Some(req) = k.required_block.filter(|r| *r != cfg.block) {
        return Err(bad(format!(
            "block {:?}, the kernel requires {req:?}",
            cfg.block
        )));
    }
    // Registers are allocated per warp in units of 256.
    let per_warp = (u64::from(k.registers.max(1)) * 32).next_multiple_of(256);
    let warps = threads.div_ceil(32);
    if per_warp * warps > u64::from(l.registers_per_sm) {
        return Err(bad(format!(
            "{threads} threads need {} registers ({} per thread), an SM has {}",
            per_warp * warps,
            k.registers,
            l.registers_per_sm
        )));
    }
    let shared = k.static_shared.saturating_add(u64::from(cfg.shared_bytes));
    if shared > u64::from(l.max_shared_per_block) {
        return Err(bad(format!(
            "{shared} bytes of shared memory ({} static + {} dynamic), at most {}",
            k.static_shared, cfg.shared_bytes, l.max_shared_per_block
        )));
    }
    if k.param_cbank_size as usize > MAX_PARAM_BYTES {
        return Err(bad(format!(
            "a {}-byte parameter block (at most {MAX_PARAM_BYTES})",
            k.param_cbank_size
        )));
    }
    if k.param_cbank_offset as usize != DRIVER_BYTES && !k.params.is_empty() {
        return Err(bad(format!(
            "parameters at c[0x0][{:#x}], expected {DRIVER_BYTES:#x} on sm_90",
            k.param_cbank_offset
        )));
    }
    cluster_shape(k, cfg, l)?;
    Ok(shared as u32)
}

/// The thread block cluster shape a launch runs with: the run-time shape of `cfg`, else the kernel's
/// compile-time `__cluster_dims__`; `None` for a launch without clusters. Refused, before anything is submitted:
/// a run-time shape other than the compile-time one, clusters on a GPU without them (before sm_90), a shape with a
/// zero axis, a grid that is not a multiple of the shape, a cluster of more than
/// [`Limits::max_cluster_blocks`] blocks, and a kernel compiled for cluster launches (`.explicitcluster`) launched
/// without a shape. A cluster's blocks must be resident at once on one GPC: [`validate`] has checked that one
/// block fits an SM (threads, registers, shared memory), so the at most 8 blocks of a cluster need at most 8 SMs,
/// fewer than any Hopper GPC has.
pub fn cluster_shape(k: &KernelInfo, cfg: &LaunchConfig, l: &Limits) -> Result<Option<[u32; 3]>> {
    let bad = |why: String| Error::InvalidLaunch {
        kernel: k.name.clone(),
        why,
    };
    let shape = match (cfg.cluster, k.cluster_dims) {
        (Some(run), Some(fixed)) if run != fixed => {
            return Err(bad(format!(
                "a cluster shape of {run:?} at launch, but the kernel was compiled with __cluster_dims__{fixed:?}; \
                 give the compiled shape or none"
            )));
        }
        (run, fixed) => run.or(fixed),
    };
    let Some(s) = shape else {
        if k.explicit_cluster {
            return Err(bad(
                "the kernel was compiled for cluster launches (.explicitcluster): give a cluster shape \
                 (LaunchConfig::with_cluster)"
                    .into(),
            ));
        }
        return Ok(None);
    };
    if l.max_cluster_blocks == 0 {
        return Err(bad(format!(
            "a cluster shape of {s:?}, but this GPU has no thread block clusters (they need sm_90 or newer)"
        )));
    }
    for (i, axis) in ["x", "y", "z"].iter().enumerate() {
        if s[i] == 0 {
            return Err(bad(format!("cluster.{axis} = 0 (must be at least 1)")));
        }
        if !cfg.grid[i].is_multiple_of(s[i]) {
            return Err(bad(format!(
                "grid.{axis} = {} is not a multiple of the cluster's {} (cluster shape {s:?})",
                cfg.grid[i], s[i]
            )));
        }
    }
    let blocks = s.iter().map(|&v| u64::from(v)).product::<u64>();
    if blocks > u64::from(l.max_cluster_blocks) {
        return Err(bad(format!(
            "a cluster of {blocks} blocks ({s:?}); at most {} (the portable cluster size)",
            l.max_cluster_blocks
        )));
    }
    Ok(Some(s))
}

#[cfg(test)]
mod tests {
    use super::{EAGER_LATCH_FIRST, EAGER_LATCH_SPAN, Limits, MAX_CLUSTER_BLOCKS, eager_latch};

    #[test]
    fn eager_latches_stay_in_their_range_and_differ_for_consecutive_launches() {
        let last = EAGER_LATCH_FIRST + EAGER_LATCH_SPAN - 1;
        assert_eq!(eager_latch(0), EAGER_LATCH_FIRST);
        assert_eq!(eager_latch(EAGER_LATCH_SPAN - 1), last);
        assert_eq!(last, 0x00ff_ffff, "latch ids have 24 bits");
        // Around the range's end and the counter's wrap at 2^32.
        for n in [EAGER_LATCH_SPAN - 2, u32::MAX - 1, u32::MAX] {
            let (a, b) = (eager_latch(n), eager_latch(n.wrapping_add(1)));
            assert_ne!(a, b, "{n}");
            for l in [a, b] {
                assert!((EAGER_LATCH_FIRST..=last).contains(&l), "{l:#x}");
            }
        }
        assert_eq!(eager_latch(u32::MAX), last);
        assert_eq!(
            eager_latch(0u32.wrapping_add(EAGER_LATCH_SPAN)),
            EAGER_LATCH_FIRST
        );
    }

    #[test]
    fn limits_come_from_the_generation_row_or_the_portable_fallback() {
        // Hopper's as before the table: 228 KiB per block (the largest carveout), clusters of 8.
        let h = Limits::for_sm(90);
        assert_eq!(h.max_shared_per_block, 228 * 1024);
        assert_eq!(h.max_cluster_blocks, MAX_CLUSTER_BLOCKS);
        assert_eq!((h.max_threads_per_block, h.registers_per_sm), (1024, 65536));
        assert_eq!(Limits::for_sm(89).max_shared_per_block, 100 * 1024);
        assert_eq!(Limits::for_sm(80).max_cluster_blocks, 0);
        // An SM version without a row gets the portable limits, not Hopper's.
        assert_eq!(Limits::for_sm(75), Limits::portable());
        assert_eq!(Limits::portable().max_shared_per_block, 48 * 1024);
        assert_eq!(Limits::portable().max_cluster_blocks, 0);
    }
}
