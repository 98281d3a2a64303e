//! A software model of the GPU's front end, for CI without a GPU.
//!
//! It reads our GPFIFO rings and pushbuffers in the hardware's memory layout, executes host semaphores (acquire,
//! release, timestamps), compute inline uploads and state methods, checks every QMD the way Hopper would reject it
//! and records launches; kernels are not executed. Anything malformed faults the channel the way RM does (error
//! notifier with Xid 13, or 31 for an address fault), so the real submission code ([`gpfifo::Channel`],
//! [`pushbuf::Queue`], [`launch::ComputeQueue`]) runs against it unchanged. It checks what hardware requires; it
//! is not a stand-in for GPU results.
//!
//! [`gpfifo::Channel`]: crate::gpfifo::Channel
//! [`pushbuf::Queue`]: crate::pushbuf::Queue
//! [`launch::ComputeQueue`]: crate::launch::ComputeQueue

mod frontend;
mod headers;
pub mod qmd;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::pushbuf::decode::DecodeError;
use crate::rm::sim::{AccessError, SimBus, SimConfig};
use crate::rm::{GpuCore, Handle};

use frontend::ChannelModel;
pub use frontend::{XID_GRAPHICS, XID_MMU};
pub use qmd::QmdViolation;

/// What went wrong on a simulated channel (the detail RM's notifier does not carry).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SimErrorKind {
    /// The front end touched memory that is not a live allocation.
    #[error("MMU fault reading or writing the {what}: {source}")]
    Mmu {
        /// What was being read or written (the GPFIFO ring, a pushbuffer segment, a semaphore, a QMD...).
        what: &'static str,
        /// Why the access failed.
        source: AccessError,
    },
    /// A pushbuffer segment does not decode as methods.
    #[error("malformed pushbuffer: {0}")]
    Decode(DecodeError),
    /// USERD's GP_PUT names an entry the ring does not have.
    #[error("GP_PUT {put} is outside the {entries}-entry ring")]
    BadGpPut {
        /// The GP_PUT read.
        put: u32,
        /// Entries in the ring.
        entries: u32,
    },
    /// A method went to a subchannel no `SET_OBJECT` bound.
    #[error("method {method:#x} on subchannel {subchannel}, which has no class bound")]
    UnboundSubchannel {
        /// The subchannel.
        subchannel: u8,
        /// The method's byte offset.
        method: u32,
    },
    /// `SET_OBJECT` named a class the channel has no object of.
    #[error(
        "SET_OBJECT of class {class:#06x} on subchannel {subchannel}: no such object on this channel"
    )]
    ClassNotOnChannel {
        /// The subchannel.
        subchannel: u8,
        /// The class asked for.
        class: u32,
    },
    /// A method the model does not execute for the bound class.
    #[error(
        "method {method:#x} is not one class {class:#06x} (subchannel {subchannel}) executes here"
    )]
    UnknownMethod {
        /// The subchannel.
        subchannel: u8,
        /// The class bound there.
        class: u32,
        /// The method's byte offset.
        method: u32,
    },
    /// A semaphore release or acquire the hardware would reject (misaligned, bad operation).
    #[error("semaphore at {va:#x}: {why}")]
    BadSemaphore {
        /// The semaphore's GPU address.
        va: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// An inline-to-memory upload the hardware would reject.
    #[error("inline upload: {why}")]
    BadInlineUpload {
        /// What is wrong with it.
        why: &'static str,
    },
    /// A copy-engine `LAUNCH_DMA` the hardware would reject.
    #[error("copy engine: {why}")]
    BadCopy {
        /// What is wrong with it.
        why: &'static str,
    },
    /// A QMD failed the checks Hopper makes before launching.
    #[error("QMD at {qmd_va:#x} rejected: {violation}")]
    BadQmd {
        /// The QMD's GPU address.
        qmd_va: u64,
        /// The first check it failed.
        violation: QmdViolation,
    },
    /// The doorbell was rung with a token no channel was given.
    #[error("doorbell rung with token {token:#x}, which no channel holds")]
    UnknownToken {
        /// The token written.
        token: u32,
    },
}

impl SimErrorKind {
    /// The Xid RM would post: 31 for address faults, 13 for everything the engine rejects.
    pub fn xid(&self) -> u32 {
        match self {
            SimErrorKind::Mmu { .. } => XID_MMU,
            _ => XID_GRAPHICS,
        }
    }
}

/// An error the model recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError {
    /// Work-submit token of the channel (0 for a doorbell that named no channel).
    pub token: u32,
    /// GP_GET when the error happened (the entry after the one being executed).
    pub gp_get: u32,
    /// What was written to the notifier's info32.
    pub xid: u32,
    /// What went wrong.
    pub kind: SimErrorKind,
}

/// A QMD that passed every check, as the model recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Work-submit token of the channel that launched it.
    pub token: u32,
    /// GPU address of the QMD.
    pub qmd_va: u64,
    /// Blocks per axis (for a cluster launch, the QMD's grid in clusters times the cluster shape).
    pub grid: [u32; 3],
    /// The thread block cluster shape of a cluster launch.
    pub cluster: Option<[u32; 3]>,
    /// Threads per block axis.
    pub block: [u32; 3],
    /// Shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers the kernel uses.
    pub barriers: u32,
    /// GPU address of the kernel's first instruction.
    pub program_va: u64,
    /// Local memory (stack) per thread, bytes.
    pub local_bytes_per_thread: u32,
    /// GPU address of constant bank 0 (driver words, then parameters).
    pub cbank0_va: u64,
    /// Bytes of constant bank 0.
    pub cbank0_size: u32,
    /// cbank0 after the 0x210 driver bytes, as the kernel would see it.
    pub params: Vec<u8>,
    /// cbank0's driver words (the first 0x210 bytes), as the kernel would see them.
    pub driver_words: Vec<u32>,
    /// (address, payload) of each release the QMD performed.
    pub releases: Vec<(u64, u64)>,
    /// The latch the grid arrived at when it completed (ARRIVE_AT_LATCH), if any.
    pub latch_arrive: Option<u32>,
    /// The latch its `griddepcontrol.wait` waited for (WAIT_ON_LATCH), if any.
    pub latch_wait: Option<u32>,
    /// The QMD's words as the model read them when it launched the grid (to decode, pass their little-endian
    /// bytes to [`crate::pushbuf::decode::decode_qmd`]).
    pub qmd: Vec<u32>,
    /// Whether the grid ran from a copy a PCAS PREFETCH read ahead of its launch.
    pub prefetched: bool,
}

/// A QMD Hopper silently drops (major version 3): nothing ran, nothing was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DroppedQmd {
    /// Work-submit token of the channel that sent it.
    pub token: u32,
    /// GPU address of the QMD.
    pub qmd_va: u64,
    /// The major version the QMD claimed.
    pub major_version: u8,
}

/// Per-channel counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// The channel's work-submit token.
    pub token: u32,
    /// The engine its channel group runs on (`NV2080_ENGINE_TYPE_GRAPHICS`, or a copy engine's
    /// `NV2080_ENGINE_TYPE_COPY(n)`: see [`crate::rm::lce_of_engine_type`]).
    pub engine: u32,
    /// GP entries fetched.
    pub entries: u64,
    /// Of those, entries whose segment was fetched ahead while the channel waited on an acquire.
    pub prefetched: u64,
    /// The next GP entry the model fetches (what it writes to USERD's GP_GET).
    pub gp_get: u32,
    /// Methods executed.
    pub methods: u64,
    /// Host semaphore releases performed (a QMD's releases are in its [`Launch`]).
    pub releases: u64,
    /// Semaphore acquires satisfied.
    pub acquires: u64,
    /// Times an unsatisfied acquire was retried.
    pub acquire_retries: u64,
    /// QMDs launched.
    pub launches: u64,
    /// QMDs dropped as Hopper drops them (see [`DroppedQmd`]).
    pub dropped_qmds: u64,
    /// Inline-to-memory uploads performed.
    pub inline_uploads: u64,
    /// Copy-engine LAUNCH_DMAs that moved data.
    pub copies: u64,
    /// Waits for idle executed: `WFI` methods, and semaphore releases with `RELEASE_WFI`.
    pub wfis: u64,
    /// Memory barriers executed.
    pub membars: u64,
    /// Non-stall interrupts requested.
    pub non_stall_interrupts: u64,
    /// Shader cache invalidations executed (`INVALIDATE_SHADER_CACHES`).
    pub cache_invalidations: u64,
    /// Doorbell writes seen with this channel's token (writes between two polls count once).
    pub doorbells: u64,
    /// QMDs launched inline from the pushbuffer (`LOAD_INLINE_QMD_DATA`).
    pub inline_qmds: u64,
    /// Dependence counters counted down (a PCAS or a completed QMD's DECREMENT_DEPENDENCE).
    pub decrements: u64,
    /// QMDs read ahead of their launch by a PCAS PREFETCH.
    pub qmd_prefetches: u64,
    /// QMDs that ran from the copy a PCAS PREFETCH read, not from what memory held when they were scheduled.
    pub prefetched_runs: u64,
    /// Null grids (QMDs of no blocks) scheduled: they only perform their dependent actions.
    pub null_grids: u64,
    /// Of the doorbells, those the model missed on purpose (`SimConfig::lost_doorbells`).
    pub lost_doorbells: u64,
    /// Whether the channel faulted (it executes nothing more).
    pub faulted: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Records {
    launches: Vec<Launch>,
    dropped: Vec<DroppedQmd>,
    errors: Vec<SimError>,
}

#[derive(Debug, Default)]
struct Model {
    channels: BTreeMap<Handle, ChannelModel>,
    records: Records,
}

#[derive(Debug)]
struct Inner {
    bus: SimBus,
    model: Mutex<Model>,
    paused: AtomicBool,
    stop: AtomicBool,
    sm_version: u32,
    threads_per_tpc: u64,
    lost_doorbells: u32,
}

impl Inner {
    fn model(&self) -> MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One pass; a background pass (`honor_pause`) does nothing while paused. The flag is read under the model
    /// lock, so once `pause` has taken that lock no background pass can start.
    fn step(&self, honor_pause: bool) -> bool {
        let mut model = self.model();
        if honor_pause && self.paused.load(Ordering::SeqCst) {
            return false;
        }
        let model = &mut *model;
        let view = self.bus.lock();
        let now = || self.bus.now_ns();
        let live = view.channels();
        for m in model.channels.values_mut() {
            m.live = live.iter().any(|c| c.handle == m.ch.handle);
        }
        for ch in &live {
            model.channels.entry(ch.handle).or_insert_with(|| {
                ChannelModel::new(*ch, self.sm_version, self.threads_per_tpc)
                    .with_lost_doorbells(self.lost_doorbells)
            });
        }
        let token = view.take_doorbell();
        if token != 0 {
            // A doorbell that reaches the GPU after its channel was freed (a queue rang again while it waited, and the
            // work completed first) finds nothing to fetch: the hardware drops it, and so does the model.
            let freed = model
                .channels
                .values()
                .any(|m| !m.live && m.ch.token == token);
            match model
                .channels
                .values_mut()
                .find(|m| m.live && m.ch.token == token)
            {
                Some(m) => {
                    m.stats.doorbells += 1;
                    m.doorbell(&view);
                }
                None if freed => {}
                None => model.records.errors.push(SimError {
                    token: 0,
                    gp_get: 0,
                    xid: XID_GRAPHICS,
                    kind: SimErrorKind::UnknownToken { token },
                }),
            }
        }
        let mut progress = false;
        for m in model.channels.values_mut() {
            progress |= m.step(&view, &now, &mut model.records);
        }
        progress
    }
}

/// The front-end model of one simulated GPU. With [`open`](Simulator::open) a background thread runs it;
/// [`step`](Simulator::step) runs it by hand. Dropping it stops the thread.
#[derive(Debug)]
pub struct Simulator {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl Simulator {
    /// Opens a simulated GPU (see [`GpuCore::open_simulated`]) with its front end running on a background thread.
    pub fn open(config: SimConfig) -> crate::rm::Result<(Arc<GpuCore>, Simulator)> {
        let (core, bus) = GpuCore::open_simulated(config)?;
        let sim = Simulator::start(bus, true).map_err(|e| crate::rm::Error::Open {
            path: "simulator thread".into(),
            source: e,
        })?;
        Ok((core, sim))
    }

    /// Opens a simulated GPU whose front end runs only when [`step`](Simulator::step) is called.
    pub fn open_manual(config: SimConfig) -> crate::rm::Result<(Arc<GpuCore>, Simulator)> {
        let (core, bus) = GpuCore::open_simulated(config)?;
        let sim = Simulator::start(bus, false).map_err(|e| crate::rm::Error::Open {
            path: "simulator thread".into(),
            source: e,
        })?;
        Ok((core, sim))
    }

    /// Runs the model over `bus`, on a background thread when `background`.
    pub fn start(bus: SimBus, background: bool) -> std::io::Result<Simulator> {
        let c = bus.config();
        let (sm_version, threads_per_tpc, lost_doorbells) = (
            c.sm_version,
            u64::from(c.max_warps_per_sm) * 32 * u64::from(c.sms_per_tpc),
            c.lost_doorbells,
        );
        let inner = Arc::new(Inner {
            bus,
            model: Mutex::new(Model::default()),
            paused: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sm_version,
            threads_per_tpc,
            lost_doorbells,
        });
        let thread = if background {
            let i = inner.clone();
            Some(
                std::thread::Builder::new()
                    .name("apex-sim-frontend".into())
                    .spawn(move || run(&i))?,
            )
        } else {
            None
        };
        Ok(Simulator { inner, thread })
    }

    /// One pass over every channel (each fetches a bounded number of entries). Returns whether anything happened.
    /// Runs even while paused, so a test can advance a paused model by hand.
    pub fn step(&self) -> bool {
        self.inner.step(false)
    }

    /// Steps until nothing happens (blocked acquires and empty rings), at most `max_steps` times.
    pub fn run_until_idle(&self, max_steps: usize) -> usize {
        (0..max_steps).take_while(|_| self.step()).count()
    }

    /// Stops the background thread from processing; returns once any pass in progress has finished.
    pub fn pause(&self) {
        self.inner.paused.store(true, Ordering::SeqCst);
        drop(self.inner.model());
    }

    /// Lets the background thread process again after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.inner.paused.store(false, Ordering::SeqCst);
    }

    /// Whether the background thread is paused.
    pub fn is_paused(&self) -> bool {
        self.inner.paused.load(Ordering::SeqCst)
    }

    /// Every launch recorded so far, in execution order.
    pub fn launches(&self) -> Vec<Launch> {
        self.inner.model().records.launches.clone()
    }

    /// Every QMD dropped so far (as Hopper drops a version-3 QMD), in execution order.
    pub fn dropped_qmds(&self) -> Vec<DroppedQmd> {
        self.inner.model().records.dropped.clone()
    }

    /// Every error recorded so far, in the order they happened.
    pub fn errors(&self) -> Vec<SimError> {
        self.inner.model().records.errors.clone()
    }

    /// Counters of every channel the model has seen.
    pub fn channel_stats(&self) -> Vec<ChannelStats> {
        self.inner
            .model()
            .channels
            .values()
            .map(|m| m.stats)
            .collect()
    }

    /// Counters of the channel with work-submit `token`.
    pub fn stats_for(&self, token: u32) -> Option<ChannelStats> {
        self.channel_stats().into_iter().find(|s| s.token == token)
    }

    /// Waits until `pred` holds for the recorded state, up to `timeout` (stepping by hand when there is no thread).
    pub fn wait_for(&self, timeout: Duration, mut pred: impl FnMut(&Simulator) -> bool) -> bool {
        let start = Instant::now();
        loop {
            if pred(self) {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            if self.thread.is_none() {
                self.step();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(inner: &Inner) {
    while !inner.stop.load(Ordering::SeqCst) {
        if inner.paused.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        if inner.step(true) {
            std::thread::yield_now();
        } else {
            // Idle: poll GP_PUT again soon (a doorbell here is a memory write, not an interrupt).
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}
