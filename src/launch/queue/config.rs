//! Launch shapes, device limits and how a compute queue is built: `LaunchConfig`, `Limits`,
//! `ComputeQueueConfig`, `LaunchMemory`, `StreamOrder`.

use std::time::Duration;

use crate::hw::Generation;
use crate::pushbuf::{Acquire, Armed, QueueConfig, Submission};
use crate::rm::Placement;

use super::MAX_PARAM_BYTES;

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

/// How a [`ComputeQueue`](super::ComputeQueue) is built: start from [`ComputeQueueConfig::default`] and change it
/// with the `with_*` methods (`#[non_exhaustive]`, so new options are not breaking changes).
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
    /// ahead of the wait (five words). Only for QMDs the GPU fetches from a launch slot, a chain's head included
    /// (not inline, not gated, not while chains link with `ChainAction::Schedule`), and only where the queue has not yet seen the launch ahead complete. On by
    /// default: on an H100 it took 1000 dependent empty launches from 1718 to 1450 ns each (interleaved A/B) and
    /// GPT-2 eager from 758 to 696-699 µs per token; an isolated launch call stayed within the spread (BENCHMARKS.md).
    pub prefetch_qmds: bool,
    /// A chained stream (off by default): a stream-ordered or programmatic launch made while the queue's last
    /// submission is still running is held as the next link of a chain (as
    /// [`ComputeQueue::record_launch_chained`](super::ComputeQueue::record_launch_chained) records one), which the
    /// GPU's work distributor starts when the link before completes, with no wait in the channel's front end per
    /// launch; a launch made while the queue is idle is sent at once as usual, so a lone launch completes as soon.
    /// Held links are sent when a later launch finds the GPU has finished what was sent (the GPU never waits for
    /// more links than that launch), when a part of [`chain_part`](Self::chain_part) links is full, first thing in
    /// any other submission, by [`ComputeQueue::flush_held`](super::ComputeQueue::flush_held) and
    /// [`synchronize`](super::ComputeQueue::synchronize), and when the queue is dropped. A fence of a held launch
    /// completes once it has been sent.
    pub chained_stream: bool,
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
            chained_stream: false,
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
    /// `pushbuf::Submission::Armed`) or sent by doorbell.
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

    /// Sets [`chained_stream`](Self::chained_stream).
    pub fn with_chained_stream(mut self, chained: bool) -> ComputeQueueConfig {
        self.chained_stream = chained;
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

#[cfg(test)]
mod tests {
    use super::{Limits, MAX_CLUSTER_BLOCKS};

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
