//! The compute queue: a pushbuffer queue whose channel is set up for compute, with per-launch slots holding a
//! QMD and its constant bank 0, local memory sized from the kernels' stacks, and launches that run in order
//! like a CUDA stream.

//!
//! The queue's code is split by concern: `config` (launch shapes, limits, how a queue is built), `check`
//! (a launch against the kernel and the device), `slots` (launch slots, template QMDs, constant bank 0),
//! `launch` (launches built per call), `prepared` (`PreparedLaunch`), `order` (stream order and programmatic
//! gates), `chain` (chained launches), `submit` (sending, the timeline, synchronize), `copy` (copies and fills)
//! and `graph_exec` (instantiated graphs). This file holds the queue itself: its state, construction, accessors
//! and local memory.

mod chain;
mod check;
mod config;
mod copy;
mod graph_exec;
mod launch;
mod order;
mod prepared;
mod slots;
mod submit;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::debug;

pub use check::{cluster_shape, validate};
pub use config::{
    ClusterPolicy, ComputeQueueConfig, FIRST_CHAIN_PART, LaunchConfig, LaunchMemory, Limits,
    MAX_CLUSTER_BLOCKS, StreamOrder,
};
pub use graph_exec::{GraphExec, GraphSchedule, GraphStats};
pub use prepared::PreparedLaunch;
pub use submit::settle;

use crate::hw::Generation;
use crate::pushbuf::{Acquire, Queue, Signal};
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::cbank::{CLUSTER_WORDS, DRIVER_BYTES, PARAM_BLOCK_WORDS};
use super::qmd::{ChainAction, QMD_WORDS, QmdVersion};
use super::{Error, Result};
use crate::module::printf::PrintfFifo;
use chain::OpenChain;
use order::Gates;
use slots::TemplateKey;

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

/// Driver words of constant bank 0 that launches write (blockDim .. initial stack pointer).
const CBANK_DRIVER_WORDS: usize = super::cbank::LAUNCH_WORDS;

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
    /// The built-in kernels (copy, fill) and their prepared launches, loaded on first use.
    builtin: Option<Box<copy::BuiltinLaunches>>,
    /// The QMD of the last launch shape, patched per launch instead of rebuilt.
    template: Option<(TemplateKey, [u32; QMD_WORDS])>,
    /// What each slot's QMD and driver words hold now (the slots are write-only device memory).
    qmd_shadow: Vec<[u32; QMD_WORDS]>,
    cb_shadow: Vec<[u32; CBANK_DRIVER_WORDS]>,
    /// What each slot's cluster words of constant bank 0 hold now.
    cluster_shadow: Vec<[u32; CLUSTER_WORDS]>,
    /// What each slot's parameter block address words hold now (`c[0x0][0x198..0x1a8]`).
    param_block_shadow: Vec<[u32; PARAM_BLOCK_WORDS]>,
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
    /// Per slot, whether its last launch was read ahead (`PCAS PREFETCH`), so that the work distributor may hold a
    /// copy of that QMD: a [`ChainAction::Schedule`] link into the slot fetches afresh instead.
    read_ahead_slots: Vec<bool>,
    graph_schedule: GraphSchedule,
    chain_part: usize,
    /// The size of the next chain part: [`FIRST_CHAIN_PART`] for a new chain, doubling part by part up to
    /// `chain_part` while a long chain is recorded.
    next_part: usize,
    /// [`ComputeQueueConfig::chained_stream`]: launches made while the queue is busy are held as chain links.
    chained_stream: bool,
    /// Set while a built-in fill or copy is recorded: those are never held as chain links, since their callers send
    /// them with a plain doorbell and may wait for them at once.
    hold_off: bool,
    /// The printf FIFO of the modules launched so far (one per GPU), drained when the queue synchronizes.
    printf: Option<Arc<PrintfFifo>>,
    /// The grid barrier cooperative launches count in (zeroed once; it resets itself at every sync).
    grid_barrier: Option<Memory>,
    /// Set while a cooperative launch is being recorded: its grid barrier's address.
    cooperative: Option<u64>,
    /// The slot gates of programmatic launches, once the queue has launched one.
    gates: Option<Gates>,
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
        // Building a queue costs milliseconds; where they go is logged (debug) for set-up cost work.
        let started = Instant::now();
        let mut qc = config.queue;
        qc.channel.compute = true;
        let queue = Queue::new(gpu, qc)?;
        let channel_us = started.elapsed().as_micros();
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
        let slots_us = started.elapsed().as_micros() - channel_us;
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
            param_block_shadow: vec![[0; PARAM_BLOCK_WORDS]; config.slots],
            slot_owner: vec![0; config.slots],
            inline_qmd: config.inline_qmd,
            prefetch: config.prefetch_next,
            prefetch_qmds: config.prefetch_qmds,
            prefetch_slots,
            timeout: config.timeout,
            chain: None,
            chain_action: ChainAction::InvalidateCopySchedule,
            read_ahead_slots: vec![false; config.slots],
            graph_schedule: GraphSchedule::Gpu,
            chain_part: config.chain_part.clamp(1, config.slots),
            next_part: FIRST_CHAIN_PART.min(config.chain_part.clamp(1, config.slots)),
            chained_stream: config.chained_stream,
            hold_off: false,
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
        let before_local = started.elapsed().as_micros();
        cq.ensure_local_memory(INITIAL_STACK)?;
        let local_us = started.elapsed().as_micros() - before_local;
        cq.queue.wait_idle_kicking(cq.timeout)?;
        debug!(
            shared = format_args!("{shared:#x}"),
            local = format_args!("{local:#x}"),
            channel_us,
            slots_us,
            local_us,
            total_us = started.elapsed().as_micros(),
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

    /// How graphs instantiated from now on resolve their dependencies ([`GraphSchedule`]; `Gpu` by default).
    pub fn set_graph_schedule(&mut self, schedule: GraphSchedule) {
        self.graph_schedule = schedule;
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
