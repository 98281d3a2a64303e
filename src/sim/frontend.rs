//! One channel's front end: GPFIFO fetch, method decode and execution, QMD launch, faults.

use super::headers::{c8b5 as copy, c56f, c86f as host, cbc0 as compute};
use crate::gpfifo::GpEntry;
use crate::pushbuf::decode::{DecodedMethod, HeaderKind, SubchannelClasses, decode};
use crate::rm::sim::{AccessError, SimChannel, SimView};
use crate::rm::sys;

use super::qmd::{self, EnvFault, GpuMemory, LaunchState, QMD_WORDS_V04, ReleaseKind};
use super::{ChannelStats, DroppedQmd, Launch, Records, SimError, SimErrorKind};

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
struct Semaphore {
    addr_lo: u32,
    addr_hi: u32,
    payload_lo: u32,
    payload_hi: u32,
}

#[derive(Debug)]
struct Inline {
    dst: u64,
    bytes: usize,
    data: Vec<u8>,
}

/// The copy engine's registers (the pitch-linear, virtual-address subset APEX uses).
#[derive(Debug, Default)]
struct CopyState {
    offset_in: u64,
    offset_out: u64,
    line_length: u32,
    semaphore: u64,
    payload: u32,
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

/// A QMD as the work distributor holds it once armed: its counter and requirement, and the QMD itself as it was
/// when copied. The model runs that copy, not what memory holds later: a QMD rewritten in memory runs as rewritten
/// only once a copying PCAS armed it again (the conservative reading; whether Hopper's self-copy re-reads memory is
/// not known).
#[derive(Debug)]
struct Armed {
    counter: u32,
    require: bool,
    words: Vec<u32>,
}

/// Whether and how a scheduled QMD runs.
enum Run {
    /// Not yet (armed and still waiting).
    No,
    /// From memory (a QMD never armed).
    FromMemory,
    /// The armed copy.
    Armed(Vec<u32>),
    /// The copy a PCAS PREFETCH read.
    Prefetched(Vec<u32>),
}

#[derive(Debug, Default)]
struct InlineQmd {
    /// The address's upper bits and the inline size, from `_A`.
    upper: Option<(u64, usize)>,
    va: Option<u64>,
    words: Vec<u32>,
}

/// The model of one channel.
#[derive(Debug)]
pub(super) struct ChannelModel {
    pub ch: SimChannel,
    pub live: bool,
    get: u32,
    bound: [Option<u32>; 8],
    pending: Vec<DecodedMethod>,
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

/// Segments the front end fetches ahead of a blocked method.
const PREFETCH_ENTRIES: usize = 8;

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

    /// The GPFIFO entry at GP_GET, if GP_PUT (as this model fetches: from USERD, or as the last doorbell read it)
    /// is past it.
    fn next_entry(&self, view: &SimView<'_>) -> Result<Option<GpEntry>, SimErrorKind> {
        let put = if self.fetch_on_doorbell {
            self.doorbell_put.unwrap_or(self.get)
        } else {
            view.read_u32(self.ch.userd_va + GP_PUT)
                .map_err(mmu("USERD"))?
        };
        if put >= self.ch.entries {
            return Err(SimErrorKind::BadGpPut {
                put,
                entries: self.ch.entries,
            });
        }
        if put == self.get {
            return Ok(None);
        }
        let slot = self.ch.ring_va + u64::from(self.get) * 8;
        Ok(Some(GpEntry(
            view.read_u64(slot).map_err(mmu("GPFIFO ring"))?,
        )))
    }

    /// Moves GP_GET past the entry [`next_entry`](Self::next_entry) returned, and tells USERD.
    fn take_entry(&mut self, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        self.get = (self.get + 1) % self.ch.entries;
        view.write_u32(self.ch.userd_va + GP_GET, self.get)
            .map_err(mmu("USERD"))?;
        self.stats.entries += 1;
        self.stats.gp_get = self.get;
        Ok(())
    }

    /// While the channel is blocked: fetches the segments of the entries after the current one, up to one marked
    /// to be fetched only after the methods before it.
    fn prefetch(&mut self, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        while self.prefetched.len() < PREFETCH_ENTRIES {
            let entry = match self.next_entry(view) {
                Ok(Some(e)) if !e.is_fetched_after_previous() => e,
                // A bad GP_PUT faults when the channel fetches next, not while it waits.
                Ok(_) | Err(SimErrorKind::BadGpPut { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.take_entry(view)?;
            self.stats.prefetched += 1;
            let words = if entry.dwords() == 0 {
                Vec::new()
            } else {
                view.read_words(entry.va(), entry.dwords() as usize)
                    .map_err(mmu("pushbuffer segment"))?
            };
            self.prefetched.push_back(words);
        }
        Ok(())
    }

    /// Fetches and decodes the segment an entry points to.
    fn load(&mut self, entry: GpEntry, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        let dwords = entry.dwords();
        // A zero-length entry is a control entry (NOP); APEX never writes one, hardware skips it.
        if dwords == 0 {
            return Ok(());
        }
        let words = view
            .read_words(entry.va(), dwords as usize)
            .map_err(mmu("pushbuffer segment"))?;
        self.load_words(&words);
        Ok(())
    }

    /// Decodes a fetched segment's words as the methods to run next.
    fn load_words(&mut self, words: &[u32]) {
        if words.is_empty() {
            self.pending.clear();
            self.next = 0;
            return;
        }
        let mut classes = SubchannelClasses::new(self.ch.class);
        for (sc, class) in self.bound.iter().enumerate().skip(1) {
            if let Some(c) = class {
                classes.bind(sc as u8, *c);
            }
        }
        self.next = 0;
        self.pending = match decode(words, &classes) {
            Ok(m) => m,
            Err(e) => {
                let at = match &e {
                    crate::pushbuf::decode::DecodeError::Truncated { at_word, .. }
                    | crate::pushbuf::decode::DecodeError::UnknownHeader { at_word, .. } => {
                        *at_word
                    }
                };
                self.tail_error = Some(SimErrorKind::Decode(e));
                // The methods before the bad word were fetched and run, as on hardware.
                decode(&words[..at], &classes).unwrap_or_default()
            }
        };
    }

    fn execute(
        &mut self,
        m: &DecodedMethod,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<Flow, SimErrorKind> {
        if m.kind == HeaderKind::EndSegment {
            return Ok(Flow::Continue);
        }
        // Methods below 0x100 belong to the host (PBDMA) on every subchannel.
        if m.offset < 0x100 {
            return self.host_method(m, view, now);
        }
        let class = self.bound.get(usize::from(m.subchannel)).copied().flatten();
        match class {
            None => Err(SimErrorKind::UnboundSubchannel {
                subchannel: m.subchannel,
                method: m.offset,
            }),
            Some(compute::CLASS) if m.subchannel != 0 => self.compute_method(m, view, now, rec),
            Some(copy::CLASS) if m.subchannel != 0 => self.copy_method(m, view),
            Some(class) => Err(SimErrorKind::UnknownMethod {
                subchannel: m.subchannel,
                class,
                method: m.offset,
            }),
        }
    }

    fn host_method(
        &mut self,
        m: &DecodedMethod,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
    ) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        match m.offset {
            host::SET_OBJECT => {
                let class = c56f::SET_OBJECT_NVCLASS.unpack(v);
                let ok = if m.subchannel == 0 {
                    class == self.ch.class
                } else {
                    view.channel_has_class(self.ch.handle, class)
                };
                if !ok {
                    return Err(SimErrorKind::ClassNotOnChannel {
                        subchannel: m.subchannel,
                        class,
                    });
                }
                self.bound[usize::from(m.subchannel)] = Some(class);
            }
            c56f::NOP => {}
            c56f::NON_STALL_INTERRUPT => self.stats.non_stall_interrupts += 1,
            host::MEM_OP_A | host::MEM_OP_B | host::MEM_OP_C => {}
            host::MEM_OP_D => {
                if host::MEM_OP_D_OPERATION.unpack(v) == host::MEM_OP_D_OPERATION_MEMBAR {
                    self.stats.membars += 1;
                }
            }
            host::SEM_ADDR_LO => self.sem.addr_lo = v,
            host::SEM_ADDR_HI => self.sem.addr_hi = v,
            host::SEM_PAYLOAD_LO => self.sem.payload_lo = v,
            host::SEM_PAYLOAD_HI => self.sem.payload_hi = v,
            host::SEM_EXECUTE => return self.sem_execute(v, view, now),
            host::WFI => self.stats.wfis += 1,
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: self.ch.class,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }

    fn sem_execute(
        &mut self,
        exec: u32,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
    ) -> Result<Flow, SimErrorKind> {
        let s = &self.sem;
        let va = (u64::from(host::SEM_ADDR_HI_OFFSET.unpack(s.addr_hi)) << 32)
            | u64::from(host::SEM_ADDR_LO_OFFSET.unpack(s.addr_lo) << 2);
        let wide =
            host::SEM_EXECUTE_PAYLOAD_SIZE.unpack(exec) == c56f::SEM_EXECUTE_PAYLOAD_SIZE_64BIT;
        let payload = if wide {
            u64::from(s.payload_lo) | (u64::from(s.payload_hi) << 32)
        } else {
            u64::from(s.payload_lo)
        };
        let op = host::SEM_EXECUTE_OPERATION.unpack(exec);
        let timestamp = host::SEM_EXECUTE_RELEASE_TIMESTAMP.unpack(exec)
            == host::SEM_EXECUTE_RELEASE_TIMESTAMP_EN
            && op == host::SEM_EXECUTE_OPERATION_RELEASE;
        let align = if wide || timestamp { 8 } else { 4 };
        if !va.is_multiple_of(align) {
            return Err(SimErrorKind::BadSemaphore {
                va,
                why: "address not aligned to the payload (and timestamp)",
            });
        }
        let read = |view: &SimView<'_>| -> Result<u64, SimErrorKind> {
            if wide {
                view.read_u64(va).map_err(mmu("semaphore"))
            } else {
                view.read_u32(va).map(u64::from).map_err(mmu("semaphore"))
            }
        };
        let satisfied = match op {
            host::SEM_EXECUTE_OPERATION_RELEASE => {
                if wide {
                    view.write_u64(va, payload).map_err(mmu("semaphore"))?;
                } else {
                    view.write_u32(va, payload as u32)
                        .map_err(mmu("semaphore"))?;
                }
                if timestamp {
                    view.write_u64(va + 8, now())
                        .map_err(mmu("semaphore timestamp"))?;
                }
                self.stats.releases += 1;
                if host::SEM_EXECUTE_RELEASE_WFI.unpack(exec) == c56f::SEM_EXECUTE_RELEASE_WFI_EN {
                    self.stats.wfis += 1;
                }
                true
            }
            host::SEM_EXECUTE_OPERATION_ACQUIRE => read(view)? == payload,
            c56f::SEM_EXECUTE_OPERATION_ACQ_STRICT_GEQ => read(view)? >= payload,
            host::SEM_EXECUTE_OPERATION_ACQ_CIRC_GEQ => {
                let cur = read(view)?;
                if wide {
                    cur.wrapping_sub(payload) as i64 >= 0
                } else {
                    (cur as u32).wrapping_sub(payload as u32) as i32 >= 0
                }
            }
            _ => {
                return Err(SimErrorKind::BadSemaphore {
                    va,
                    why: "semaphore operation not modelled (AND, NOR, reductions)",
                });
            }
        };
        if !satisfied {
            return Ok(Flow::Blocked);
        }
        if op != host::SEM_EXECUTE_OPERATION_RELEASE {
            self.stats.acquires += 1;
        }
        Ok(Flow::Continue)
    }

    /// The copy engine: linear copies between virtual addresses, checked against the live allocations this GPU
    /// can reach (its own and those mapped on it from peers), and its one-word completion semaphore.
    fn copy_method(&mut self, m: &DecodedMethod, view: &SimView<'_>) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        let c = &mut self.copy;
        match m.offset {
            copy::NOP => {}
            copy::OFFSET_IN_UPPER => {
                set_upper(&mut c.offset_in, copy::OFFSET_IN_UPPER_UPPER.unpack(v))
            }
            copy::OFFSET_IN_LOWER => set_lower(&mut c.offset_in, v),
            copy::OFFSET_OUT_UPPER => {
                set_upper(&mut c.offset_out, copy::OFFSET_OUT_UPPER_UPPER.unpack(v))
            }
            copy::OFFSET_OUT_LOWER => set_lower(&mut c.offset_out, v),
            copy::LINE_LENGTH_IN => c.line_length = v,
            copy::SET_SEMAPHORE_A => {
                set_upper(&mut c.semaphore, copy::SET_SEMAPHORE_A_UPPER.unpack(v))
            }
            copy::SET_SEMAPHORE_B => set_lower(&mut c.semaphore, v),
            copy::SET_SEMAPHORE_PAYLOAD => c.payload = v,
            copy::LAUNCH_DMA => {
                let bad = |why| Err(SimErrorKind::BadCopy { why });
                if copy::LAUNCH_DMA_SRC_TYPE.unpack(v) != copy::LAUNCH_DMA_SRC_TYPE_VIRTUAL
                    || copy::LAUNCH_DMA_DST_TYPE.unpack(v) != copy::LAUNCH_DMA_DST_TYPE_VIRTUAL
                {
                    return bad("physical addresses are not modelled");
                }
                if copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT.unpack(v)
                    != copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT_PITCH
                    || copy::LAUNCH_DMA_DST_MEMORY_LAYOUT.unpack(v)
                        != copy::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH
                {
                    return bad("block-linear layouts are not modelled");
                }
                if copy::LAUNCH_DMA_MULTI_LINE_ENABLE.unpack(v)
                    != copy::LAUNCH_DMA_MULTI_LINE_ENABLE_FALSE
                {
                    return bad("multi-line copies are not modelled");
                }
                if copy::LAUNCH_DMA_DATA_TRANSFER_TYPE.unpack(v)
                    != copy::LAUNCH_DMA_DATA_TRANSFER_TYPE_NONE
                {
                    let mut bytes = vec![0u8; c.line_length as usize];
                    view.read(c.offset_in, &mut bytes)
                        .map_err(mmu("copy source"))?;
                    view.write(c.offset_out, &bytes)
                        .map_err(mmu("copy destination"))?;
                    self.stats.copies += 1;
                }
                match copy::LAUNCH_DMA_SEMAPHORE_TYPE.unpack(v) {
                    copy::LAUNCH_DMA_SEMAPHORE_TYPE_NONE => {}
                    copy::LAUNCH_DMA_SEMAPHORE_TYPE_RELEASE_ONE_WORD_SEMAPHORE => view
                        .write_u32(c.semaphore, c.payload)
                        .map_err(mmu("copy semaphore"))?,
                    _ => return bad("four-word and conditional semaphores are not modelled"),
                }
            }
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: copy::CLASS,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }

    fn compute_method(
        &mut self,
        m: &DecodedMethod,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        let c = &mut self.compute;
        match m.offset {
            compute::NO_OPERATION | compute::WAIT_FOR_IDLE => {}
            compute::LINE_LENGTH_IN => c.line_length = v,
            compute::LINE_COUNT => c.line_count = v,
            compute::OFFSET_OUT_UPPER => {
                set_upper(&mut c.offset_out, compute::OFFSET_OUT_UPPER_VALUE.unpack(v))
            }
            compute::OFFSET_OUT => set_lower(&mut c.offset_out, v),
            compute::LAUNCH_DMA => {
                let bad = |why| Err(SimErrorKind::BadInlineUpload { why });
                if compute::LAUNCH_DMA_DST_MEMORY_LAYOUT.unpack(v)
                    != compute::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH
                {
                    return bad("block-linear destinations are not modelled");
                }
                if compute::LAUNCH_DMA_COMPLETION_TYPE.unpack(v)
                    == compute::LAUNCH_DMA_COMPLETION_TYPE_RELEASE_SEMAPHORE
                    || compute::LAUNCH_DMA_REDUCTION_ENABLE.unpack(v) != 0
                {
                    return bad("semaphore completion and reductions are not modelled");
                }
                if c.line_count != 1 {
                    return bad(
                        "LINE_COUNT must be 1 (pitched multi-line copies are not modelled)",
                    );
                }
                if c.inline.is_some() {
                    return bad("LAUNCH_DMA before the previous upload's data arrived");
                }
                c.inline = Some(Inline {
                    dst: c.offset_out,
                    bytes: c.line_length as usize,
                    data: Vec::with_capacity(c.line_length as usize),
                });
            }
            compute::LOAD_INLINE_DATA => {
                let Some(up) = c.inline.as_mut() else {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_DATA with no upload in progress",
                    });
                };
                up.data.extend_from_slice(&v.to_le_bytes());
                if up.data.len() >= up.bytes {
                    up.data.truncate(up.bytes);
                    view.write(up.dst, &up.data)
                        .map_err(mmu("inline upload destination"))?;
                    c.inline = None;
                    self.stats.inline_uploads += 1;
                }
            }
            compute::SET_SHADER_SHARED_MEMORY_WINDOW_A => set_upper(
                &mut c.launch.shared_window,
                compute::SET_SHADER_SHARED_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_SHARED_MEMORY_WINDOW_B => set_lower(&mut c.launch.shared_window, v),
            compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A => set_upper(
                &mut c.launch.local_window,
                compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_WINDOW_B => set_lower(&mut c.launch.local_window, v),
            compute::SET_SHADER_LOCAL_MEMORY_A => set_upper(
                &mut c.launch.local_memory_va,
                compute::SET_SHADER_LOCAL_MEMORY_A_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_B => set_lower(&mut c.launch.local_memory_va, v),
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A => set_upper(
                &mut c.launch.local_bytes_per_tpc,
                compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A_SIZE_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_B => {
                set_lower(&mut c.launch.local_bytes_per_tpc, v)
            }
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C => {
                c.launch.local_max_sm_count =
                    compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C_MAX_SM_COUNT.unpack(v)
            }
            compute::SET_QMD_VERSION => c.qmd_version = v,
            compute::SET_SPA_VERSION => c.spa_version = v,
            compute::INVALIDATE_SHADER_CACHES | compute::INVALIDATE_SHADER_CACHES_NO_WFI => {
                self.stats.cache_invalidations += 1
            }
            compute::SET_INLINE_QMD_ADDRESS_A => {
                let size = match compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE.unpack(v) {
                    compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE_INLINE_384 => 96,
                    _ => 64,
                };
                let upper = u64::from(
                    compute::SET_INLINE_QMD_ADDRESS_A_QMD_ADDRESS_SHIFTED8_UPPER.unpack(v),
                );
                c.inline_qmd = Some(InlineQmd {
                    upper: Some((upper << 40, size)),
                    ..InlineQmd::default()
                });
            }
            compute::SET_INLINE_QMD_ADDRESS_B => {
                let q = c.inline_qmd.as_mut().ok_or(SimErrorKind::BadInlineUpload {
                    why: "SET_INLINE_QMD_ADDRESS_B without SET_INLINE_QMD_ADDRESS_A",
                })?;
                let upper = q.upper.map_or(0, |(u, _)| u);
                q.va = Some(upper | (u64::from(v) << 8));
            }
            o if (compute::LOAD_INLINE_QMD_DATA(0)..compute::LOAD_INLINE_QMD_DATA(96))
                .contains(&o) =>
            {
                let i = ((o - compute::LOAD_INLINE_QMD_DATA(0)) / 4) as usize;
                let q = c.inline_qmd.as_mut().ok_or(SimErrorKind::BadInlineUpload {
                    why: "LOAD_INLINE_QMD_DATA without SET_INLINE_QMD_ADDRESS_A/B",
                })?;
                let (Some((_, size)), Some(va)) = (q.upper, q.va) else {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_QMD_DATA before the QMD's address was set",
                    });
                };
                if i != q.words.len() {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_QMD_DATA words out of order",
                    });
                }
                q.words.push(v);
                if q.words.len() == size {
                    // The hardware stores the QMD at its address, then launches it.
                    let bytes: Vec<u8> = q.words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    c.inline_qmd = None;
                    view.write(va, &bytes).map_err(mmu("inline QMD address"))?;
                    self.stats.inline_qmds += 1;
                    self.launch(
                        va,
                        Event::HostSchedule {
                            copy: true,
                            force_require: false,
                        },
                        view,
                        now,
                        rec,
                    )?;
                }
            }
            compute::SEND_PCAS_A => c.pcas_a = Some(v),
            compute::SEND_SIGNALING_PCAS2_B => {
                let action = compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION.unpack(v);
                let named = || {
                    c.pcas_a.map(|a| u64::from(a) << 8).ok_or(SimErrorKind::BadQmd {
                        qmd_va: 0,
                        violation: qmd::QmdViolation::State(
                            "SEND_SIGNALING_PCAS2_B acts on a QMD but SEND_PCAS_A never named one",
                        ),
                    })
                };
                // The QMD cache: invalidating actions drop a prefetched copy; PREFETCH reads one.
                match action {
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_FORCE_REQUIRE_SCHEDULING => {
                        c.prefetched.remove(&named()?);
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH => {
                        let va = named()?;
                        qmd::check_address(va).map_err(|v| SimErrorKind::BadQmd {
                            qmd_va: va,
                            violation: v,
                        })?;
                        let words = view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?;
                        c.prefetched.insert(va, words);
                        self.stats.qmd_prefetches += 1;
                    }
                    _ => {}
                }
                let c = &mut self.compute;
                let event = match action {
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH_SCHEDULE => {
                        Some(Event::HostSchedule { copy: false, force_require: false })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE => {
                        Some(Event::HostSchedule { copy: true, force_require: false })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_FORCE_REQUIRE_SCHEDULING => {
                        Some(Event::HostSchedule { copy: true, force_require: true })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_DECREMENT_DEPENDENCE => Some(Event::Decrement),
                    _ => None,
                };
                if let Some(event) = event {
                    let a = c.pcas_a.ok_or(SimErrorKind::BadQmd {
                        qmd_va: 0,
                        violation: qmd::QmdViolation::State(
                            "SEND_SIGNALING_PCAS2_B acts on a QMD but SEND_PCAS_A never named one",
                        ),
                    })?;
                    self.launch(u64::from(a) << 8, event, view, now, rec)?;
                }
            }
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: compute::CLASS,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }

    /// Performs `event` on the QMD at `qmd_va` and then everything it leads to, in order: a QMD runs once it is
    /// scheduled (not armed, or armed with no requirement and no count left, or counted down to zero), and when it
    /// completes its dependents are scheduled or counted down (DEPENDENT_QMD0, then 1) and it re-arms itself if it
    /// copies itself on completion. A model of the compute work distributor's dependency resolution as libcuda's
    /// graphs use it; the work it leads to is finite or the graph has a cycle, which the hardware would run forever.
    fn launch(
        &mut self,
        qmd_va: u64,
        event: Event,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<(), SimErrorKind> {
        const MAX_STEPS: usize = 1 << 22;
        let mut work = std::collections::VecDeque::from([(qmd_va, event)]);
        for _ in 0..MAX_STEPS {
            let Some((va, event)) = work.pop_front() else {
                return Ok(());
            };
            let (words, prefetched) = match self.schedules(va, event, view)? {
                Run::No => continue,
                Run::FromMemory => (
                    view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?,
                    false,
                ),
                Run::Armed(words) => (words, false),
                Run::Prefetched(words) => (words, true),
            };
            let d = self.launch_one(va, &words, prefetched, view, now, rec)?;
            if d.self_copy {
                // Re-armed from the copy it ran.
                let (counter, require) = qmd::arming(&words);
                self.compute.armed.insert(
                    va,
                    Armed {
                        counter,
                        require,
                        words,
                    },
                );
            }
            for &(dep, kind) in &d.dependents {
                work.push_back((
                    dep,
                    match kind {
                        qmd::DependentKind::Schedule => Event::Schedule { copy: false },
                        qmd::DependentKind::CopySchedule => Event::Schedule { copy: true },
                        qmd::DependentKind::Decrement => Event::Decrement,
                    },
                ));
            }
        }
        Err(SimErrorKind::BadQmd {
            qmd_va,
            violation: qmd::QmdViolation::State("the dependent QMDs it leads to do not end"),
        })
    }

    /// Applies `event` to the QMD at `va`'s armed state; whether (and which copy of it) runs now.
    fn schedules(
        &mut self,
        va: u64,
        event: Event,
        view: &SimView<'_>,
    ) -> Result<Run, SimErrorKind> {
        let bad = |why| SimErrorKind::BadQmd {
            qmd_va: va,
            violation: qmd::QmdViolation::State(why),
        };
        qmd::check_address(va).map_err(|v| SimErrorKind::BadQmd {
            qmd_va: va,
            violation: v,
        })?;
        let arm = |armed: &mut std::collections::HashMap<u64, Armed>, force: bool| {
            view.read_words(va, QMD_WORDS_V04)
                .map_err(mmu("QMD"))
                .map(|words| {
                    let (counter, require) = qmd::arming(&words);
                    armed.insert(
                        va,
                        Armed {
                            counter,
                            require: require || force,
                            words,
                        },
                    );
                })
        };
        // A copying schedule (an inline QMD's too) reads memory afresh: a copy read ahead is gone.
        if matches!(
            event,
            Event::HostSchedule { copy: true, .. } | Event::Schedule { copy: true }
        ) {
            self.compute.prefetched.remove(&va);
        }
        let armed = &mut self.compute.armed;
        let runs = match event {
            Event::HostSchedule {
                copy,
                force_require,
            } => {
                if copy {
                    arm(armed, force_require)?;
                }
                // A host PCAS schedules a QMD only when nothing else must: no requirement, no count.
                armed.get(&va).is_none_or(|a| a.counter == 0 && !a.require)
            }
            Event::Schedule { copy } => {
                if copy {
                    arm(armed, false)?;
                }
                armed.get(&va).is_none_or(|a| a.counter == 0)
            }
            Event::Decrement => {
                self.stats.decrements += 1;
                let Some(state) = armed.get_mut(&va) else {
                    return Err(bad("DECREMENT_DEPENDENCE on a QMD no copying PCAS armed"));
                };
                if state.counter == 0 {
                    return Err(bad("DECREMENT_DEPENDENCE below zero"));
                }
                state.counter -= 1;
                state.counter == 0
            }
        };
        if !runs {
            return Ok(Run::No);
        }
        if let Some(a) = armed.remove(&va) {
            return Ok(Run::Armed(a.words));
        }
        // Not armed: a copy a PREFETCH read runs instead of memory. Memory rewritten since is an error here: the
        // hardware would run the stale copy without a word.
        if let Some(words) = self.compute.prefetched.get(&va) {
            let now = view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?;
            if now != *words {
                return Err(bad(
                    "rewritten in memory after a PCAS PREFETCH read it ahead of its launch: the copy read \
                     then would run",
                ));
            }
            self.stats.prefetched_runs += 1;
            return Ok(Run::Prefetched(words.clone()));
        }
        Ok(Run::FromMemory)
    }

    /// Validates the QMD at `qmd_va` like Hopper and, if it would run, records it and performs its releases; returns
    /// the QMD it schedules next.
    fn launch_one(
        &mut self,
        qmd_va: u64,
        words: &[u32],
        prefetched: bool,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<qmd::QmdDesc, SimErrorKind> {
        let bad = |violation| SimErrorKind::BadQmd { qmd_va, violation };
        qmd::check_address(qmd_va).map_err(bad)?;
        let major = qmd::major_version(words);
        if major == 3 {
            // Hopper drops a V03 QMD without an error: nothing runs and nothing is released.
            self.stats.dropped_qmds += 1;
            rec.dropped.push(DroppedQmd {
                token: self.ch.token,
                qmd_va,
                major_version: major as u8,
            });
            return Ok(qmd::QmdDesc {
                dependents: Vec::new(),
                self_copy: false,
                ..qmd::QmdDesc::null()
            });
        }
        let d = qmd::check_fields(words, self.sm_version).map_err(bad)?;
        if d.null {
            self.stats.null_grids += 1;
            for r in &d.releases {
                release(view, r, now)?;
            }
            return Ok(d);
        }
        qmd::check_environment(&d, &self.compute.launch, view).map_err(|e| match e {
            EnvFault::Address { what, va, len } => SimErrorKind::Mmu {
                what,
                source: AccessError::Unmapped { va, len },
            },
            EnvFault::Violation(v) => bad(v),
        })?;
        let (cb0, cb0_size) = d.const_banks[0].unwrap_or_default();
        let mut params =
            vec![0u8; (cb0_size as usize).saturating_sub(crate::launch::cbank::DRIVER_BYTES)];
        view.read(cb0 + crate::launch::cbank::DRIVER_BYTES as u64, &mut params)
            .map_err(mmu("constant bank 0"))?;
        let mut driver = vec![0u8; crate::launch::cbank::DRIVER_BYTES.min(cb0_size as usize)];
        view.read(cb0, &mut driver)
            .map_err(mmu("constant bank 0"))?;
        if let Some(l) = d.wait_latch
            && !self.compute.latches.contains(&l)
        {
            return Err(bad(qmd::QmdViolation::State(
                "WAIT_ON_LATCH names a latch no earlier grid of the channel arrived at: it would wait forever",
            )));
        }
        for r in &d.releases {
            release(view, r, now)?;
        }
        if let Some(l) = d.arrive_latch {
            self.compute.latches.insert(l);
        }
        self.stats.launches += 1;
        rec.launches.push(Launch {
            token: self.ch.token,
            qmd_va,
            grid: d.grid,
            cluster: d.cluster,
            block: d.block,
            shared_bytes: d.shared_bytes,
            registers: d.registers,
            barriers: d.barriers,
            program_va: d.program_va,
            local_bytes_per_thread: d.local_bytes_per_thread,
            cbank0_va: cb0,
            cbank0_size: cb0_size as u32,
            params,
            driver_words: driver
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect(),
            releases: d.releases.iter().map(|r| (r.va, r.payload)).collect(),
            latch_arrive: d.arrive_latch,
            latch_wait: d.wait_latch,
            qmd: words.to_vec(),
            prefetched,
        });
        Ok(d)
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

/// What reaches a QMD: a PCAS from the host (copying or not), a predecessor's schedule or decrement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    HostSchedule { copy: bool, force_require: bool },
    Schedule { copy: bool },
    Decrement,
}

/// Performs one release of a completed QMD.
fn release(
    view: &SimView<'_>,
    r: &qmd::ReleaseDesc,
    now: &dyn Fn() -> u64,
) -> Result<(), SimErrorKind> {
    let res = match r.kind {
        ReleaseKind::FourWords { payload64 } => {
            let first = if payload64 {
                view.write_u64(r.va, r.payload)
            } else {
                view.write_u32(r.va, r.payload as u32)
            };
            first.and_then(|()| view.write_u64(r.va + 8, now()))
        }
        ReleaseKind::OneWord => view.write_u32(r.va, r.payload as u32),
        ReleaseKind::AddOneWord => view
            .read_words(r.va, 1)
            .and_then(|w| view.write_u32(r.va, w[0].wrapping_add(r.payload as u32))),
        ReleaseKind::TwoWords => view.write_u64(r.va, r.payload),
    };
    res.map_err(mmu("QMD release semaphore"))
}

/// Methods that carry a 64-bit value in two halves: the upper half (A) and the lower half (B).
fn set_upper(x: &mut u64, upper: u32) {
    *x = (*x & 0xffff_ffff) | (u64::from(upper) << 32);
}

fn set_lower(x: &mut u64, lower: u32) {
    *x = (*x & !0xffff_ffff) | u64::from(lower);
}
