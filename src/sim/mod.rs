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

// Issue 14: public items here still lack docs; document them and drop this allow.
#![allow(missing_docs)]

mod frontend;
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
    #[error("MMU fault reading or writing the {what}: {source}")]
    Mmu {
        what: &'static str,
        source: AccessError,
    },
    #[error("malformed pushbuffer: {0}")]
    Decode(DecodeError),
    #[error("GP_PUT {put} is outside the {entries}-entry ring")]
    BadGpPut { put: u32, entries: u32 },
    #[error("method {method:#x} on subchannel {subchannel}, which has no class bound")]
    UnboundSubchannel { subchannel: u8, method: u32 },
    #[error(
        "SET_OBJECT of class {class:#06x} on subchannel {subchannel}: no such object on this channel"
    )]
    ClassNotOnChannel { subchannel: u8, class: u32 },
    #[error(
        "method {method:#x} is not one class {class:#06x} (subchannel {subchannel}) executes here"
    )]
    UnknownMethod {
        subchannel: u8,
        class: u32,
        method: u32,
    },
    #[error("semaphore at {va:#x}: {why}")]
    BadSemaphore { va: u64, why: &'static str },
    #[error("inline upload: {why}")]
    BadInlineUpload { why: &'static str },
    #[error("copy engine: {why}")]
    BadCopy { why: &'static str },
    #[error("QMD at {qmd_va:#x} rejected: {violation}")]
    BadQmd {
        qmd_va: u64,
        violation: QmdViolation,
    },
    #[error("doorbell rung with token {token:#x}, which no channel holds")]
    UnknownToken { token: u32 },
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
    pub kind: SimErrorKind,
}

/// A QMD that passed every check, as the model recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub token: u32,
    pub qmd_va: u64,
    /// Blocks per axis (for a cluster launch, the QMD's grid in clusters times the cluster shape).
    pub grid: [u32; 3],
    /// The thread block cluster shape of a cluster launch.
    pub cluster: Option<[u32; 3]>,
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub registers: u32,
    pub barriers: u32,
    pub program_va: u64,
    pub local_bytes_per_thread: u32,
    pub cbank0_va: u64,
    pub cbank0_size: u32,
    /// cbank0 after the 0x210 driver bytes, as the kernel would see it.
    pub params: Vec<u8>,
    /// cbank0's driver words (the first 0x210 bytes), as the kernel would see them.
    pub driver_words: Vec<u32>,
    /// (address, payload) of each release the QMD performed.
    pub releases: Vec<(u64, u64)>,
}

/// A QMD Hopper silently drops (major version 3): nothing ran, nothing was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DroppedQmd {
    pub token: u32,
    pub qmd_va: u64,
    pub major_version: u8,
}

/// Per-channel counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelStats {
    pub token: u32,
    /// GP entries fetched.
    pub entries: u64,
    pub gp_get: u32,
    pub methods: u64,
    pub releases: u64,
    pub acquires: u64,
    /// Times an unsatisfied acquire was retried.
    pub acquire_retries: u64,
    pub launches: u64,
    pub dropped_qmds: u64,
    pub inline_uploads: u64,
    /// Copy-engine LAUNCH_DMAs that moved data.
    pub copies: u64,
    pub wfis: u64,
    pub membars: u64,
    pub non_stall_interrupts: u64,
    pub cache_invalidations: u64,
    /// Doorbell writes seen with this channel's token (writes between two polls count once).
    pub doorbells: u64,
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
            model
                .channels
                .entry(ch.handle)
                .or_insert_with(|| ChannelModel::new(*ch, self.sm_version, self.threads_per_tpc));
        }
        let token = view.take_doorbell();
        if token != 0 {
            match model
                .channels
                .values_mut()
                .find(|m| m.live && m.ch.token == token)
            {
                Some(m) => m.stats.doorbells += 1,
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
        let (sm_version, threads_per_tpc) = (
            c.sm_version,
            u64::from(c.max_warps_per_sm) * 32 * u64::from(c.sms_per_tpc),
        );
        let inner = Arc::new(Inner {
            bus,
            model: Mutex::new(Model::default()),
            paused: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sm_version,
            threads_per_tpc,
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

    pub fn resume(&self) {
        self.inner.paused.store(false, Ordering::SeqCst);
    }

    pub fn is_paused(&self) -> bool {
        self.inner.paused.load(Ordering::SeqCst)
    }

    /// Every launch recorded so far, in execution order.
    pub fn launches(&self) -> Vec<Launch> {
        self.inner.model().records.launches.clone()
    }

    pub fn dropped_qmds(&self) -> Vec<DroppedQmd> {
        self.inner.model().records.dropped.clone()
    }

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
