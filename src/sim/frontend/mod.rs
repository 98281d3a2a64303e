//! One channel's front end: GPFIFO fetch, method decode and execution, QMD launch, faults.
//!
//! The model's code is split by concern: `fetch` (GPFIFO entries, prefetch while blocked, decoding a segment and
//! dispatching each method to its engine), `decode` (the method headers, read with the simulator's own reading of
//! `clc56f.h`), `host` (host methods and semaphores), `copy` (the copy engine),
//! `compute` (the compute class's methods: inline uploads, state, inline QMDs and PCAS) and `launch` (the compute
//! work distributor: arming, scheduling and dependents, the checks a QMD must pass, its releases). This file holds
//! the channel model itself: its state, its steps, and its fault.

mod compute;
mod copy;
mod decode;
mod fetch;
mod host;
mod launch;

use crate::rm::sim::{AccessError, SimChannel, SimView};
use crate::rm::sys;

use super::qmd::{GpuMemory, LaunchState};
use super::{ChannelStats, Records, SimError, SimErrorKind};
use compute::{Inline, InlineQmd};
use copy::CopyState;
use decode::Method;
use host::Semaphore;
use launch::Armed;

/// Xid RM posts for an exception of the channel's engine (illegal method, bad QMD).
pub const XID_GRAPHICS: u32 = 13;
/// Xid RM posts for an MMU fault.
pub const XID_MMU: u32 = 31;

/// GP entries one channel may fetch per step before the others get a turn.
const ENTRIES_PER_STEP: u32 = 64;

const GP_GET: u64 = std::mem::offset_of!(sys::HopperAControlGPFifo, GPGet) as u64;
const GP_PUT: u64 = std::mem::offset_of!(sys::HopperAControlGPFifo, GPPut) as u64;

enum Flow {
    Continue,
    /// An acquire is not satisfied yet: retry this method next step.
    Blocked,
}

#[derive(Debug, Default)]
struct Compute {
    line_length: u32,
    line_count: u32,
    offset_out: u64,
    inline: Option<Inline>,
    launch: LaunchState,
    pcas_a: Option<u32>,
    /// QMDs armed by a copying PCAS or dependent action (or re-armed by their self-copy) and not yet scheduled, by
    /// address.
    armed: std::collections::HashMap<u64, Armed>,
    /// QMDs a PCAS PREFETCH read ahead, by address: a later schedule that does not copy (a host PCAS or a
    /// dependent's) runs this copy, as memory held it then, until an invalidating PCAS or a copying schedule drops
    /// it (the conservative reading of the work distributor's QMD cache: it is never refreshed on its own). Memory
    /// rewritten in between is reported as an error.
    prefetched: std::collections::HashMap<u64, Vec<u32>>,
    /// An inline QMD being loaded (`SET_INLINE_QMD_ADDRESS_A/B`, then `LOAD_INLINE_QMD_DATA`).
    inline_qmd: Option<InlineQmd>,
    /// Latches some grid of the channel has arrived at (ARRIVE_AT_LATCH): a grid waiting on any other latch would
    /// wait forever.
    latches: std::collections::HashSet<u32>,
    qmd_version: u32,
    spa_version: u32,
}

/// The model of one channel.
#[derive(Debug)]
pub(super) struct ChannelModel {
    pub ch: SimChannel,
    pub live: bool,
    get: u32,
    bound: [Option<u32>; 8],
    pending: Vec<Method>,
    next: usize,
    /// A malformed tail of the current segment: faults once the methods before it have run.
    tail_error: Option<SimErrorKind>,
    sem: Semaphore,
    compute: Compute,
    copy: CopyState,
    pub faulted: bool,
    pub stats: ChannelStats,
    sm_version: u32,
    /// Doorbells still to be missed (`SimConfig::lost_doorbells`).
    lost_doorbells: u32,
    /// With doorbells modelled, the GP_PUT read at the last doorbell seen: fetching stops there.
    doorbell_put: Option<u32>,
    fetch_on_doorbell: bool,
    /// Segments fetched ahead while the channel waits on an acquire, as the words read then: the front end
    /// prefetches past a blocked method, except at an entry marked to be fetched only after the methods before it
    /// (`SYNC_WAIT`). A CPU that rewrites a prefetched segment afterwards is not seen. The model prefetches only
    /// while blocked (the hardware may at any time), and a segment it cannot read faults when fetched, not when it
    /// would have run.
    prefetched: std::collections::VecDeque<Vec<u32>>,
}

impl GpuMemory for SimView<'_> {
    fn contains(&self, va: u64, len: u64) -> bool {
        SimView::contains(self, va, len)
    }
    fn read_words(&self, va: u64, n: usize) -> Option<Vec<u32>> {
        SimView::read_words(self, va, n).ok()
    }
}

fn mmu(what: &'static str) -> impl Fn(AccessError) -> SimErrorKind {
    move |source| SimErrorKind::Mmu { what, source }
}

impl ChannelModel {
    pub fn new(ch: SimChannel, sm_version: u32, threads_per_tpc: u64) -> ChannelModel {
        let mut bound = [None; 8];
        bound[0] = Some(ch.class);
        let compute = Compute {
            launch: LaunchState {
                threads_per_tpc,
                ..LaunchState::default()
            },
            ..Compute::default()
        };
        ChannelModel {
            ch,
            live: true,
            get: 0,
            bound,
            pending: Vec::new(),
            next: 0,
            tail_error: None,
            sem: Semaphore::default(),
            compute,
            copy: CopyState::default(),
            faulted: false,
            stats: ChannelStats {
                token: ch.token,
                engine: ch.engine,
                ..ChannelStats::default()
            },
            sm_version,
            lost_doorbells: 0,
            doorbell_put: None,
            fetch_on_doorbell: false,
            prefetched: std::collections::VecDeque::new(),
        }
    }

    /// Misses the first `n` doorbells; with any, fetches only what a doorbell announced.
    pub fn with_lost_doorbells(mut self, n: u32) -> ChannelModel {
        self.lost_doorbells = n;
        self.fetch_on_doorbell = n > 0;
        self
    }

    /// The channel's doorbell was rung: GP_PUT is read now, unless this doorbell is one to miss.
    pub fn doorbell(&mut self, view: &SimView<'_>) {
        if self.lost_doorbells > 0 {
            self.lost_doorbells -= 1;
            self.stats.lost_doorbells += 1;
            return;
        }
        if let Ok(put) = view.read_u32(self.ch.userd_va + GP_PUT) {
            self.doorbell_put = Some(put);
        }
    }

    /// Runs the channel until it is idle, blocked, faulted or out of budget. Returns whether anything happened.
    pub fn step(&mut self, view: &SimView<'_>, now: &dyn Fn() -> u64, rec: &mut Records) -> bool {
        if self.faulted || !self.live {
            return false;
        }
        match self.run(view, now, rec) {
            Ok(progress) => progress,
            Err(kind) => {
                self.fault(view, now(), kind, rec);
                true
            }
        }
    }

    fn run(
        &mut self,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<bool, SimErrorKind> {
        let mut progress = false;
        let mut fetched = 0;
        loop {
            while let Some(m) = self.pending.get(self.next).cloned() {
                match self.execute(&m, view, now, rec)? {
                    Flow::Continue => {
                        self.next += 1;
                        self.stats.methods += 1;
                        progress = true;
                    }
                    Flow::Blocked => {
                        self.stats.acquire_retries += 1;
                        self.prefetch(view)?;
                        return Ok(progress);
                    }
                }
            }
            if let Some(e) = self.tail_error.take() {
                return Err(e);
            }
            if fetched == ENTRIES_PER_STEP {
                return Ok(progress);
            }
            if let Some(words) = self.prefetched.pop_front() {
                fetched += 1;
                progress = true;
                self.load_words(&words);
                continue;
            }
            let Some(entry) = self.next_entry(view)? else {
                return Ok(progress);
            };
            self.take_entry(view)?;
            fetched += 1;
            progress = true;
            self.load(entry, view)?;
        }
    }

    /// Posts the error to the channel's notifier the way RM does and stops the channel.
    fn fault(&mut self, view: &SimView<'_>, now: u64, kind: SimErrorKind, rec: &mut Records) {
        let xid = kind.xid();
        let n = self.ch.notifier_va;
        let off_info32 = std::mem::offset_of!(sys::NvNotificationRec, info32) as u64;
        // Timestamp and code first, status last: a reader sees a complete record once status is non-zero.
        let _ = view.write_u64(n, now);
        let _ = view.write_u32(n + off_info32, xid);
        let _ = view.write_u32(n + off_info32 + 4, 0xffff << 16);
        self.faulted = true;
        self.stats.faulted = true;
        tracing::debug!(token = self.ch.token, %kind, "simulated channel faulted");
        rec.errors.push(SimError {
            token: self.ch.token,
            gp_get: self.get,
            xid,
            kind,
        });
    }
}

/// Methods that carry a 64-bit value in two halves: the upper half (A) and the lower half (B).
fn set_upper(x: &mut u64, upper: u32) {
    *x = (*x & 0xffff_ffff) | (u64::from(upper) << 32);
}

fn set_lower(x: &mut u64, lower: u32) {
    *x = (*x & !0xffff_ffff) | u64::from(lower);
}
