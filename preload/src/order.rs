//! Stream order between APEX queues and CUDA streams.
//!
//! Each stream the preload has taken over has an APEX queue. Work on the queue is invisible to CUDA, and work on the
//! CUDA stream is invisible to the queue, so the preload keeps two flags per taken-over stream and makes a *hop*
//! (an ordering point on the GPU, no CPU wait) only when one side is about to depend on work the other has not
//! seen:
//!
//! - `apex_dirty`: the queue has work the CUDA stream has not been made to wait for. Before any CUDA operation that
//!   is ordered after that stream — on the stream itself, or, through the legacy default stream's implicit
//!   synchronization, on a related one — the CUDA stream waits for the queue ([`Hops::cuda_waits_for_apex`]:
//!   `cuStreamWaitValue64` on a value the queue releases).
//! - `cuda_dirty`: the CUDA stream (or a related one) got work since the queue last waited for it. Before the
//!   queue's next launch, the queue waits for the stream ([`Hops::apex_waits_for_cuda`]: `cuStreamWriteValue64` that
//!   the queue acquires).
//!
//! Two streams are related when they are the same, or one is the legacy default stream and the other a blocking
//! stream (CUDA orders every operation on the legacy stream after all earlier work of blocking streams, and all
//! later work of blocking streams after it). Since the hops go through the CUDA streams themselves, CUDA's own
//! implicit synchronization then carries the order to the related stream.
//!
//! Between two taken-over related streams no CUDA call is needed: before a launch, the queue waits on the GPU for
//! the last launch of each related queue it has not yet waited for ([`Hops::apex_waits_for_apex`], a semaphore
//! acquire in its own pushbuffer). Only when that fails does the order go through the CUDA streams.
//!
//! Hops are avoided where the CPU already knows the answer: a queue whose last launch is complete (the engine saw it
//! on the CPU: [`Order::apex_complete`]) needs no hop before CUDA work, and a CUDA stream the program synchronized
//! ([`Order::cuda_synchronized`], [`Order::context_synchronized`]) needs none before the queue's next launch. CUDA
//! work on the slot's own stream and on a related one are told apart, because synchronizing a stream completes only
//! its own work.

/// A CUDA stream as the driver API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKey {
    /// The legacy default stream (handle 0 on the non-`_ptsz` entry points, or `CU_STREAM_LEGACY`).
    Legacy,
    /// A thread's per-thread default stream (handle 0 on `_ptsz`/`_ptds` entry points, or `CU_STREAM_PER_THREAD`),
    /// named by the thread's serial number ([`thread_serial`]): each thread's is a stream of its own.
    PerThread(u64),
    /// A stream the program created.
    Handle(usize),
}

/// `CU_STREAM_LEGACY`.
pub const CU_STREAM_LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`.
pub const CU_STREAM_PER_THREAD: usize = 2;

/// The calling thread's serial number: given at its first call, from 1, never reused (a thread id may be, once its
/// thread ends; a later thread's per-thread default stream is another stream).
pub fn thread_serial() -> u64 {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        // No destructor: readable until the thread's very end.
        static SERIAL: Cell<u64> = const { Cell::new(0) };
    }
    SERIAL.with(|s| match s.get() {
        0 => {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            s.set(n);
            n
        }
        n => n,
    })
}

impl StreamKey {
    /// The stream a driver call of this thread names with `raw`; `per_thread` for the `_ptsz`/`_ptds` entry points.
    pub fn of(raw: usize, per_thread: bool) -> StreamKey {
        match raw {
            0 if per_thread => StreamKey::PerThread(thread_serial()),
            0 | CU_STREAM_LEGACY => StreamKey::Legacy,
            CU_STREAM_PER_THREAD => StreamKey::PerThread(thread_serial()),
            h => StreamKey::Handle(h),
        }
    }

    /// The handle to pass to the driver, from this thread, for waiting on or after this stream's work (the legacy
    /// stream as null). Another thread's per-thread default stream cannot be named from here: its handle is the
    /// legacy default stream's instead, which CUDA orders with every blocking stream both ways (the legacy stream's
    /// work after all earlier work of blocking streams, theirs after all its earlier work), so a wait or a value
    /// written there orders that stream's work as one made on the stream itself would, and more.
    pub fn raw(self) -> usize {
        match self {
            StreamKey::Legacy => 0,
            StreamKey::PerThread(t) if t == thread_serial() => CU_STREAM_PER_THREAD,
            StreamKey::PerThread(_) => 0,
            StreamKey::Handle(h) => h,
        }
    }

    /// Whether this is a per-thread default stream (of any thread).
    pub fn is_per_thread(self) -> bool {
        matches!(self, StreamKey::PerThread(_))
    }

    /// Whether this is another thread's per-thread default stream, which this thread cannot name.
    pub fn is_other_threads(self) -> bool {
        matches!(self, StreamKey::PerThread(t) if t != thread_serial())
    }
}

/// A stream and whether it synchronizes with the legacy default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream {
    /// Which stream.
    pub key: StreamKey,
    /// Not created with `CU_STREAM_NON_BLOCKING` (the default streams always are blocking).
    pub blocking: bool,
}

impl Stream {
    /// Whether work on `self` and work on `other` are ordered with each other by CUDA.
    pub fn related(self, other: Stream) -> bool {
        self.key == other.key
            || (self.key == StreamKey::Legacy && other.blocking)
            || (other.key == StreamKey::Legacy && self.blocking)
    }
}

/// The GPU-side ordering operations, done by the caller for a taken-over stream's slot.
pub trait Hops {
    /// Makes `stream`, the CUDA stream of `slot`, wait on the GPU for everything submitted to the slot's APEX queue so
    /// far.
    fn cuda_waits_for_apex(&mut self, slot: usize, stream: StreamKey) -> Result<(), String>;
    /// Makes the APEX queue of `slot` wait on the GPU for everything submitted to `stream`, its CUDA stream, so far.
    fn apex_waits_for_cuda(&mut self, slot: usize, stream: StreamKey) -> Result<(), String>;
    /// Makes the APEX queue of `slot` wait on the GPU for the last launch of the queue of `other`.
    fn apex_waits_for_apex(&mut self, slot: usize, other: usize) -> Result<(), String>;
    /// The last resort when a hop fails: waits on the CPU until the queue of `slot` is idle.
    fn cpu_sync(&mut self, slot: usize) -> Result<(), String>;
    /// Whether the last launch of the queue of `slot` is already complete (no waiting): then CUDA needs no hop
    /// to wait for it.
    fn apex_done(&mut self, _slot: usize) -> bool {
        false
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    stream: Stream,
    apex_dirty: bool,
    /// CUDA work on the slot's own stream the queue has not waited for.
    cuda_own: bool,
    /// CUDA work on a related stream (the legacy stream for a blocking one, or the reverse) the queue has not
    /// waited for.
    cuda_related: bool,
    live: bool,
    /// The launch number (counted over all queues, from 1) of the queue's last launch; 0 before any.
    last: u64,
    /// The launch number when the slot began to serve its stream.
    since: u64,
    /// No wait was put on the queue since its last launch without a launch after it (a launch whose submission
    /// failed leaves one): the queue holds nothing of its stream but its launches.
    settled: bool,
}

impl Slot {
    /// A slot that begins to serve `stream`, which may already have CUDA work: the queue's first launch waits for it.
    fn serving(stream: Stream, since: u64) -> Slot {
        Slot {
            stream,
            apex_dirty: false,
            cuda_own: true,
            cuda_related: true,
            live: true,
            last: 0,
            since,
            settled: true,
        }
    }

    /// CUDA work ordered with `stream` was added: on the slot's own stream, or a related one.
    fn mark_cuda(&mut self, stream: Stream) {
        if stream.key == self.stream.key {
            self.cuda_own = true;
        } else {
            self.cuda_related = true;
        }
    }
}

/// Hop counts, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HopCounts {
    /// CUDA streams made to wait for a queue.
    pub to_cuda: u64,
    /// Queues made to wait for a CUDA stream.
    pub to_apex: u64,
    /// Hops that failed and were replaced by a CPU wait.
    pub cpu_syncs: u64,
    /// Queues made to wait for another queue (no CUDA call).
    pub between_queues: u64,
    /// Hops to CUDA not made because the queue's work was already complete.
    pub avoided: u64,
}

/// The ordering state of every taken-over stream, indexed by slot.
#[derive(Debug, Default)]
pub struct Order {
    slots: Vec<Slot>,
    /// `seen[a][b]`: the launch number of queue `b` that queue `a` last waited for.
    seen: Vec<Vec<u64>>,
    launches: u64,
    counts: HopCounts,
}

/// What a CUDA operation is ordered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Work on one stream.
    Stream(Stream),
    /// Everything: a context-wide synchronization, a free that waits for the device, a module unload, the end of the
    /// process.
    Device,
    /// A capture beginning: every stream but other threads' per-thread default streams. This thread cannot name
    /// those, and a hop made for them through the legacy stream would make every blocking stream wait for their
    /// queues, an order CUDA does not have; their own thread hands them over at its next CUDA call on them.
    CaptureBegins,
}

impl Order {
    /// An empty state.
    pub fn new() -> Order {
        Order::default()
    }

    /// The slot of a taken-over stream.
    pub fn find(&self, key: StreamKey) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.live && s.stream.key == key)
    }

    /// Takes `stream` over; returns its slot (a freed one when there is one). The stream may already have CUDA work,
    /// so the queue's first launch waits for it.
    pub fn add(&mut self, stream: Stream) -> usize {
        let i = match self.slots.iter().position(|s| !s.live) {
            Some(i) => i,
            None => {
                self.slots.push(Slot::serving(stream, self.launches));
                self.slots.len() - 1
            }
        };
        self.serve(i, stream);
        i
    }

    /// Hands live `slot`, whose queue's work is all complete, from its stream to `stream`, which is taken over as by
    /// [`add`](Order::add) (its queue's first launch waits for it); the former stream is no longer taken over.
    pub fn reassign(&mut self, slot: usize, stream: Stream) {
        if slot < self.slots.len() {
            self.serve(slot, stream);
        }
    }

    /// `stream` from now on in slot `i` (which exists).
    fn serve(&mut self, i: usize, stream: Stream) {
        self.slots[i] = Slot::serving(stream, self.launches);
        // Launch numbers only grow, so what other queues saw of the slot's former stream stays below its new work.
        let n = self.slots.len();
        self.seen.resize_with(n, Vec::new);
        for row in &mut self.seen {
            row.resize(n, 0);
        }
        self.seen[i].iter_mut().for_each(|v| *v = 0);
    }

    /// Launches made on every queue so far: the clock [`last_launch`](Order::last_launch) reads.
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// The launch number of `slot`'s last launch (0: none since it began to serve its stream).
    pub fn last_launch(&self, slot: usize) -> u64 {
        self.slots.get(slot).map_or(0, |s| s.last)
    }

    /// The launch number since which live `slot`'s stream has not used its queue (its last launch, or when the slot
    /// began to serve it); `None` when the queue holds a wait with no launch after it (its submission failed), or
    /// the slot is not live.
    pub fn unused_since(&self, slot: usize) -> Option<u64> {
        self.slots
            .get(slot)
            .filter(|s| s.live && s.settled)
            .map(|s| s.last.max(s.since))
    }

    /// Live slots.
    pub fn live(&self) -> usize {
        self.slots.iter().filter(|s| s.live).count()
    }

    /// Forgets a slot whose stream is destroyed, after handing its work to CUDA (call [`before_cuda`] first).
    ///
    /// [`before_cuda`]: Order::before_cuda
    pub fn remove(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.live = false;
        }
    }

    /// Whether the queue of `slot` has work its CUDA stream has not been made to wait for.
    pub fn apex_dirty(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.apex_dirty)
    }

    /// Whether the queue of `slot` must wait for its CUDA stream before its next launch.
    pub fn cuda_dirty(&self, slot: usize) -> bool {
        self.slots
            .get(slot)
            .is_some_and(|s| s.cuda_own || s.cuda_related)
    }

    /// The stream of `slot`.
    pub fn stream(&self, slot: usize) -> Option<Stream> {
        self.slots.get(slot).filter(|s| s.live).map(|s| s.stream)
    }

    /// Live slots whose streams are related to `stream` (itself included).
    pub fn related(&self, stream: Stream) -> impl Iterator<Item = usize> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(move |(_, s)| s.live && s.stream.related(stream))
            .map(|(i, _)| i)
    }

    /// Every live slot.
    pub fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.live)
            .map(|(i, _)| i)
    }

    /// The queue of `slot` was seen complete on the CPU (its last launch, and with it everything that launch
    /// waited for): CUDA needs no hop to wait for it.
    pub fn apex_complete(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.apex_dirty = false;
        }
    }

    /// A synchronization of `stream` through libcuda returned success: its own CUDA work is complete, so its queue
    /// needs no hop for it. (Work on related streams is not covered: a stream's synchronize waits for its own.)
    pub fn cuda_synchronized(&mut self, stream: Stream) {
        for s in self.slots.iter_mut() {
            if s.live && s.stream.key == stream.key {
                s.cuda_own = false;
            }
        }
    }

    /// The context was synchronized: every CUDA stream's work is complete, and so is every queue's (the caller
    /// waited for them).
    pub fn context_synchronized(&mut self) {
        for s in self.slots.iter_mut() {
            s.cuda_own = false;
            s.cuda_related = false;
            s.apex_dirty = false;
        }
    }

    /// Whether the queue of `slot` has waited (on the GPU) for the last launch of every related live queue: then its
    /// own last launch completes after all of them.
    pub fn covers_related(&self, slot: usize) -> bool {
        let Some(me) = self.slots.get(slot) else {
            return false;
        };
        self.slots.iter().enumerate().all(|(i, s)| {
            i == slot || !s.live || !s.stream.related(me.stream) || s.last <= self.seen[slot][i]
        })
    }

    /// Whether CUDA has work on the slot's stream, or on a related one, that the queue's launches have not waited
    /// for: if not, the queue's last launch completing means the stream's work is complete.
    pub fn cuda_clean(&self, slot: usize) -> bool {
        !self.cuda_dirty(slot)
    }

    /// The hop counts so far.
    pub fn counts(&self) -> HopCounts {
        self.counts
    }

    fn hand_over(&mut self, slot: usize, hops: &mut dyn Hops) -> Result<(), String> {
        if !self.slots[slot].apex_dirty {
            return Ok(());
        }
        if hops.apex_done(slot) {
            // Complete already: nothing for CUDA to wait for, and no CUDA work added.
            self.counts.avoided += 1;
            self.slots[slot].apex_dirty = false;
            return Ok(());
        }
        match hops.cuda_waits_for_apex(slot, self.slots[slot].stream.key) {
            Ok(()) => self.counts.to_cuda += 1,
            Err(e) => {
                // The stream cannot wait on the GPU: the queue's work completes before anything else is submitted.
                self.counts.cpu_syncs += 1;
                hops.cpu_sync(slot)
                    .map_err(|e2| format!("{e}; then {e2}"))?;
            }
        }
        self.slots[slot].apex_dirty = false;
        // The hop is CUDA work on this stream: related queues must see it before their next launch.
        let stream = self.slots[slot].stream;
        for (i, s) in self.slots.iter_mut().enumerate() {
            if i != slot && s.live && s.stream.related(stream) {
                s.mark_cuda(stream);
            }
        }
        Ok(())
    }

    /// Before a CUDA operation ordered with `target`: every related queue's work is handed to CUDA.
    pub fn before_cuda(&mut self, target: Target, hops: &mut dyn Hops) -> Result<(), String> {
        self.hand_over_where(hops, |s| match target {
            Target::Device => true,
            Target::CaptureBegins => !s.key.is_other_threads(),
            Target::Stream(t) => t.related(s),
        })
    }

    /// Before `stream` waits for an event in CUDA: the queues of related streams other than its own are handed to
    /// CUDA (CUDA orders a blocking stream's wait after the legacy stream's earlier work, and the legacy stream's
    /// after every blocking stream's); its own queue is not, since the wait adds no work of its own: the queue's next
    /// launch waits for the stream, and later CUDA work on the stream hands the queue over when it comes.
    pub fn before_cuda_wait(&mut self, stream: Stream, hops: &mut dyn Hops) -> Result<(), String> {
        self.hand_over_where(hops, |s| s.key != stream.key && stream.related(s))
    }

    /// Hands the work of every live slot whose stream `which` picks to CUDA; the last failure, if any.
    fn hand_over_where(
        &mut self,
        hops: &mut dyn Hops,
        which: impl Fn(Stream) -> bool,
    ) -> Result<(), String> {
        let mut result = Ok(());
        for i in 0..self.slots.len() {
            let s = self.slots[i];
            if s.live
                && which(s.stream)
                && let Err(e) = self.hand_over(i, hops)
            {
                result = Err(e);
            }
        }
        result
    }

    /// After a CUDA operation that added work ordered with `stream`: related queues wait for it before their next
    /// launch.
    pub fn after_cuda(&mut self, stream: Stream) {
        for s in self.slots.iter_mut() {
            if s.live && s.stream.related(stream) {
                s.mark_cuda(stream);
            }
        }
    }

    /// Before a launch on the queue of `slot`: the queue waits for related queues' launches it has not seen (through
    /// CUDA if a direct wait fails), then for its stream if the stream has work it has not seen.
    pub fn before_apex(&mut self, slot: usize, hops: &mut dyn Hops) -> Result<(), String> {
        let stream = self.slots[slot].stream;
        // Until the launch is sent ([`after_apex`](Order::after_apex)): a wait put on the queue below stays in it.
        self.slots[slot].settled = false;
        for i in 0..self.slots.len() {
            let s = self.slots[i];
            if i == slot || !s.live || !s.stream.related(stream) || s.last <= self.seen[slot][i] {
                continue;
            }
            match hops.apex_waits_for_apex(slot, i) {
                Ok(()) => self.counts.between_queues += 1,
                Err(_) if s.apex_dirty => {
                    // CUDA orders it: the other stream waits for its queue, this queue for its own stream below.
                    self.hand_over(i, hops)?;
                }
                // Already handed to CUDA since its last launch: this queue's wait for its stream covers it.
                Err(_) => self.slots[slot].cuda_related = true,
            }
            self.seen[slot][i] = s.last;
        }
        if self.cuda_dirty(slot) {
            hops.apex_waits_for_cuda(slot, stream.key)?;
            self.counts.to_apex += 1;
            self.slots[slot].cuda_own = false;
            self.slots[slot].cuda_related = false;
        }
        Ok(())
    }

    /// After a launch on the queue of `slot`.
    pub fn after_apex(&mut self, slot: usize) {
        self.launches += 1;
        self.slots[slot].apex_dirty = true;
        self.slots[slot].last = self.launches;
        self.slots[slot].settled = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records hops as `(kind, slot)`; fails the CUDA-side hop of the slots listed in `fail`.
    #[derive(Default)]
    struct Log {
        hops: Vec<(&'static str, usize)>,
        fail: Vec<usize>,
        /// Direct queue-to-queue waits fail (the queue cannot acquire another's semaphore).
        no_direct: bool,
    }

    impl Hops for Log {
        fn cuda_waits_for_apex(&mut self, slot: usize, _: StreamKey) -> Result<(), String> {
            if self.fail.contains(&slot) {
                return Err("refused".into());
            }
            self.hops.push(("cuda<-apex", slot));
            Ok(())
        }
        fn apex_waits_for_cuda(&mut self, slot: usize, _: StreamKey) -> Result<(), String> {
            self.hops.push(("apex<-cuda", slot));
            Ok(())
        }
        fn apex_waits_for_apex(&mut self, slot: usize, other: usize) -> Result<(), String> {
            if self.no_direct {
                return Err("no direct wait".into());
            }
            self.hops.push(("apex<-apex", slot * 100 + other));
            Ok(())
        }
        fn cpu_sync(&mut self, slot: usize) -> Result<(), String> {
            self.hops.push(("cpu", slot));
            Ok(())
        }
    }

    const LEGACY: Stream = Stream {
        key: StreamKey::Legacy,
        blocking: true,
    };
    const BLOCKING: Stream = Stream {
        key: StreamKey::Handle(0x1000),
        blocking: true,
    };
    const NON_BLOCKING: Stream = Stream {
        key: StreamKey::Handle(0x2000),
        blocking: false,
    };
    const PER_THREAD: Stream = Stream {
        key: StreamKey::PerThread(1),
        blocking: true,
    };
    const OTHER_PER_THREAD: Stream = Stream {
        key: StreamKey::PerThread(2),
        blocking: true,
    };

    fn launch(o: &mut Order, slot: usize, log: &mut Log) {
        o.before_apex(slot, log).unwrap();
        o.after_apex(slot);
    }

    #[test]
    fn stream_keys_follow_the_driver_api() {
        assert_eq!(StreamKey::of(0, false), StreamKey::Legacy);
        assert_eq!(StreamKey::of(1, false), StreamKey::Legacy);
        assert_eq!(StreamKey::of(1, true), StreamKey::Legacy);
        let me = StreamKey::PerThread(thread_serial());
        assert_eq!(StreamKey::of(0, true), me);
        assert_eq!(StreamKey::of(2, false), me);
        assert_eq!(StreamKey::of(0x55, true), StreamKey::Handle(0x55));
        assert_eq!(StreamKey::Legacy.raw(), 0);
        assert_eq!(me.raw(), CU_STREAM_PER_THREAD);
        assert!(me.is_per_thread() && !StreamKey::Legacy.is_per_thread());
    }

    #[test]
    fn each_thread_names_its_own_per_thread_stream_and_reaches_others_through_the_legacy_stream() {
        let here = StreamKey::of(0, true);
        assert_eq!(StreamKey::of(0, true), here, "stable within a thread");
        let there = std::thread::spawn(|| {
            let k = StreamKey::of(CU_STREAM_PER_THREAD, false);
            (k, k.raw())
        })
        .join()
        .unwrap();
        assert_ne!(
            there.0, here,
            "another thread's per-thread stream is another stream"
        );
        assert_eq!(
            there.1, CU_STREAM_PER_THREAD,
            "named as itself in its own thread"
        );
        // From this thread that stream is reached through the legacy stream, which orders it both ways.
        assert_eq!(there.0.raw(), 0);
        assert_eq!(here.raw(), CU_STREAM_PER_THREAD);
    }

    #[test]
    fn relations_are_cudas_implicit_synchronization() {
        assert!(LEGACY.related(BLOCKING) && BLOCKING.related(LEGACY));
        assert!(LEGACY.related(PER_THREAD));
        assert!(!LEGACY.related(NON_BLOCKING) && !NON_BLOCKING.related(LEGACY));
        assert!(!BLOCKING.related(NON_BLOCKING));
        assert!(
            !BLOCKING.related(PER_THREAD),
            "two created streams do not synchronize"
        );
        assert!(NON_BLOCKING.related(NON_BLOCKING));
        assert!(
            !PER_THREAD.related(OTHER_PER_THREAD) && OTHER_PER_THREAD.related(LEGACY),
            "two threads' default streams are ordered only through the legacy stream"
        );
    }

    #[test]
    fn a_wait_hands_over_the_queues_of_related_streams_but_not_its_own() {
        let mut o = Order::new();
        let mut log = Log::default();
        let legacy = o.add(LEGACY);
        let blocking = o.add(BLOCKING);
        let other = o.add(NON_BLOCKING);
        for s in [legacy, blocking, other] {
            launch(&mut o, s, &mut log);
        }
        log.hops.clear();
        // A blocking stream's wait follows the legacy stream's earlier work in CUDA: that queue is handed over.
        o.before_cuda_wait(BLOCKING, &mut log).unwrap();
        assert_eq!(log.hops, vec![("cuda<-apex", legacy)]);
        log.hops.clear();
        // A non-blocking stream's wait hands nothing over.
        o.before_cuda_wait(NON_BLOCKING, &mut log).unwrap();
        assert!(log.hops.is_empty());
        // Its own queue is still to be handed over to later CUDA work on the stream.
        o.before_cuda(Target::Stream(NON_BLOCKING), &mut log)
            .unwrap();
        assert_eq!(log.hops, vec![("cuda<-apex", other)]);
    }

    #[test]
    fn back_to_back_launches_make_no_hop_after_the_first() {
        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(LEGACY);
        for _ in 0..100 {
            launch(&mut o, s, &mut log);
        }
        // The stream may have had work before it was taken over: one wait, then none.
        assert_eq!(log.hops, vec![("apex<-cuda", s)]);
        assert_eq!(o.counts().to_apex, 1);
    }

    #[test]
    fn cuda_work_on_the_stream_is_ordered_both_ways() {
        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(BLOCKING);
        launch(&mut o, s, &mut log);
        log.hops.clear();
        // A cudaMemcpyAsync on the same stream: waits for the queue, and the next launch waits for it.
        o.before_cuda(Target::Stream(BLOCKING), &mut log).unwrap();
        o.after_cuda(BLOCKING);
        launch(&mut o, s, &mut log);
        assert_eq!(log.hops, vec![("cuda<-apex", s), ("apex<-cuda", s)]);
        // A second CUDA operation with nothing new on the queue: no hop before it.
        log.hops.clear();
        o.before_cuda(Target::Stream(BLOCKING), &mut log).unwrap();
        o.before_cuda(Target::Stream(BLOCKING), &mut log).unwrap();
        assert_eq!(log.hops, vec![("cuda<-apex", s)]);
    }

    #[test]
    fn unrelated_streams_need_no_hop() {
        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(NON_BLOCKING);
        launch(&mut o, s, &mut log);
        log.hops.clear();
        // Work on the legacy stream does not synchronize with a non-blocking stream.
        o.before_cuda(Target::Stream(LEGACY), &mut log).unwrap();
        o.after_cuda(LEGACY);
        launch(&mut o, s, &mut log);
        assert!(log.hops.is_empty(), "{:?}", log.hops);
    }

    #[test]
    fn legacy_stream_work_orders_blocking_queues() {
        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(BLOCKING);
        launch(&mut o, s, &mut log);
        log.hops.clear();
        // A synchronous cudaMemcpy (legacy stream) waits for the blocking stream's queue.
        o.before_cuda(Target::Stream(LEGACY), &mut log).unwrap();
        o.after_cuda(LEGACY);
        assert_eq!(log.hops, vec![("cuda<-apex", s)]);
        launch(&mut o, s, &mut log);
        assert_eq!(log.hops, vec![("cuda<-apex", s), ("apex<-cuda", s)]);
    }

    #[test]
    fn taken_over_related_streams_order_each_other_without_cuda() {
        let mut o = Order::new();
        let mut log = Log::default();
        let l = o.add(LEGACY);
        let b = o.add(BLOCKING);
        let n = o.add(NON_BLOCKING);
        launch(&mut o, l, &mut log);
        launch(&mut o, n, &mut log);
        log.hops.clear();
        // The blocking queue waits for the legacy queue's launch on the GPU; the non-blocking one is not related.
        launch(&mut o, b, &mut log);
        assert_eq!(
            log.hops,
            vec![("apex<-apex", b * 100 + l), ("apex<-cuda", b)]
        );
        log.hops.clear();
        launch(&mut o, l, &mut log);
        assert_eq!(log.hops, vec![("apex<-apex", l * 100 + b)]);
        log.hops.clear();
        // Back-to-back launches on one queue wait for nothing new; a launch already waited for is not waited again.
        launch(&mut o, l, &mut log);
        launch(&mut o, b, &mut log);
        launch(&mut o, b, &mut log);
        assert_eq!(log.hops, vec![("apex<-apex", b * 100 + l)]);
        assert_eq!(o.counts().to_cuda, 0, "no CUDA call between two queues");
        assert_eq!(o.counts().between_queues, 3);
        // CUDA work on the legacy stream still reaches the blocking queue through its stream.
        log.hops.clear();
        o.before_cuda(Target::Stream(LEGACY), &mut log).unwrap();
        o.after_cuda(LEGACY);
        launch(&mut o, b, &mut log);
        assert_eq!(
            log.hops,
            vec![("cuda<-apex", l), ("cuda<-apex", b), ("apex<-cuda", b)]
        );
    }

    #[test]
    fn a_taken_over_legacy_stream_and_a_blocking_stream_order_each_other_through_cuda() {
        let mut o = Order::new();
        let mut log = Log {
            no_direct: true,
            ..Log::default()
        };
        let l = o.add(LEGACY);
        let b = o.add(BLOCKING);
        launch(&mut o, l, &mut log);
        log.hops.clear();
        // A launch on the blocking stream must run after the legacy queue's work: the legacy stream waits for its
        // queue, then the blocking queue waits for its own stream (which CUDA orders after the legacy stream).
        launch(&mut o, b, &mut log);
        assert_eq!(log.hops, vec![("cuda<-apex", l), ("apex<-cuda", b)]);
        log.hops.clear();
        // And back: the legacy queue waits for the blocking queue the same way.
        launch(&mut o, l, &mut log);
        assert_eq!(log.hops, vec![("cuda<-apex", b), ("apex<-cuda", l)]);
    }

    #[test]
    fn device_wide_operations_hand_over_every_queue() {
        let mut o = Order::new();
        let mut log = Log::default();
        let a = o.add(NON_BLOCKING);
        let b = o.add(BLOCKING);
        launch(&mut o, a, &mut log);
        launch(&mut o, b, &mut log);
        log.hops.clear();
        o.before_cuda(Target::Device, &mut log).unwrap();
        assert_eq!(log.hops, vec![("cuda<-apex", a), ("cuda<-apex", b)]);
        assert!(!o.apex_dirty(a) && !o.apex_dirty(b));
    }

    #[test]
    fn a_capture_beginning_leaves_other_threads_default_streams_to_their_thread() {
        let mut o = Order::new();
        let mut log = Log::default();
        let mine = Stream {
            key: StreamKey::PerThread(thread_serial()),
            blocking: true,
        };
        let theirs = Stream {
            key: StreamKey::PerThread(u64::MAX),
            blocking: true,
        };
        let (a, b, c) = (o.add(BLOCKING), o.add(mine), o.add(theirs));
        for slot in [a, b, c] {
            launch(&mut o, slot, &mut log);
        }
        log.hops.clear();
        o.before_cuda(Target::CaptureBegins, &mut log).unwrap();
        assert_eq!(log.hops, vec![("cuda<-apex", a), ("cuda<-apex", b)]);
        assert!(o.apex_dirty(c), "handed over by its own thread later");
        // A device-wide operation still waits for it (through the legacy stream, from here).
        o.before_cuda(Target::Device, &mut log).unwrap();
        assert!(!o.apex_dirty(c));
    }

    #[test]
    fn a_failed_hop_falls_back_to_a_cpu_wait() {
        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(BLOCKING);
        launch(&mut o, s, &mut log);
        log.hops.clear();
        log.fail.push(s);
        o.before_cuda(Target::Stream(BLOCKING), &mut log).unwrap();
        assert_eq!(log.hops, vec![("cpu", s)]);
        assert_eq!(o.counts().cpu_syncs, 1);
        assert!(!o.apex_dirty(s));
    }

    #[test]
    fn a_reassigned_slot_serves_its_new_stream_from_a_clean_start() {
        let mut o = Order::new();
        let mut log = Log::default();
        let a = o.add(BLOCKING);
        let b = o.add(NON_BLOCKING);
        launch(&mut o, a, &mut log);
        launch(&mut o, b, &mut log);
        launch(&mut o, b, &mut log);
        assert_eq!(
            (o.launches(), o.last_launch(a), o.last_launch(b)),
            (3, 1, 3)
        );
        let c = Stream {
            key: StreamKey::Handle(0x3000),
            blocking: false,
        };
        o.reassign(a, c);
        assert_eq!(
            o.find(BLOCKING.key),
            None,
            "the former stream is not taken over"
        );
        assert_eq!(o.find(c.key), Some(a));
        assert_eq!((o.live(), o.launches(), o.last_launch(a)), (2, 3, 0));
        assert_eq!(
            o.unused_since(a),
            Some(3),
            "unused since it began to serve c, not since launch 0"
        );
        assert!(
            o.cuda_dirty(a) && !o.apex_dirty(a),
            "the new stream's CUDA work is waited for first"
        );
        log.hops.clear();
        launch(&mut o, a, &mut log);
        assert_eq!(
            log.hops,
            vec![("apex<-cuda", a)],
            "unrelated to b: no wait for b's queue"
        );
        assert_eq!(o.last_launch(a), 4);
        assert_eq!(o.unused_since(a), Some(4));
        // A wait put on the queue for a launch that was never sent: the queue is not settled until a launch is.
        o.before_apex(b, &mut log).unwrap();
        assert_eq!(o.unused_since(b), None);
        o.after_apex(b);
        assert_eq!(o.unused_since(b), Some(5));
    }

    #[test]
    fn removed_slots_are_reused_and_start_dirty() {
        // A reused slot's new queue is waited for afresh by the others.
        let mut o2 = Order::new();
        let mut log2 = Log::default();
        let a = o2.add(LEGACY);
        let b = o2.add(BLOCKING);
        launch(&mut o2, b, &mut log2);
        launch(&mut o2, a, &mut log2);
        o2.before_cuda(Target::Stream(BLOCKING), &mut log2).unwrap();
        o2.remove(b);
        let c = o2.add(Stream {
            key: StreamKey::Handle(0x3000),
            blocking: true,
        });
        assert_eq!(c, b);
        launch(&mut o2, c, &mut log2);
        log2.hops.clear();
        launch(&mut o2, a, &mut log2);
        // (The legacy queue also waits for its stream: the hand-over above was CUDA work on a related stream.)
        assert_eq!(
            log2.hops,
            vec![("apex<-apex", a * 100 + c), ("apex<-cuda", a)]
        );

        let mut o = Order::new();
        let mut log = Log::default();
        let s = o.add(BLOCKING);
        launch(&mut o, s, &mut log);
        o.before_cuda(Target::Stream(BLOCKING), &mut log).unwrap();
        o.remove(s);
        assert_eq!(o.find(BLOCKING.key), None);
        assert_eq!(o.live(), 0);
        let t = o.add(NON_BLOCKING);
        assert_eq!(t, s, "the freed slot (and its queue) is reused");
        assert!(o.cuda_dirty(t), "a new stream may have CUDA work already");
        assert_eq!(o.find(NON_BLOCKING.key), Some(t));
    }
}
