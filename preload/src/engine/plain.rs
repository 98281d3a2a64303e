//! Calls on streams no APEX queue relates to, forwarded without the engine.
//!
//! A stream that is not taken over and is related to no taken-over stream (a non-blocking one; a blocking one while
//! the legacy stream is not taken over) needs nothing of the engine for an event record, a wait for an event the
//! preload did not keep, or other work libcuda runs there: the call goes to libcuda as it is, and only the context's
//! books must learn that CUDA has work (a context synchronize must then reach libcuda). Through the engine such a
//! call cost about 0.2-0.3 µs more than libcuda's own (H100, 580.159.04: `cudaEventRecord` 258 ns plain, 534 ns
//! forwarded; `cudaStreamWaitEvent` 245 and 451 ns): two passes of the engine's lock and a `cuCtxGetCurrent` to
//! find the context. NCCL makes several such calls around every collective, PyTorch around every cross-stream use.
//!
//! The engine remembers such a stream here (with its own context, never the calling thread's current one) when it
//! forwards a call on one, and forgets every stream at once whenever relations could change (a context attached, a
//! stream taken over, released or destroyed, the end), before it changes them. The events it keeps are counted here by a hash of their handle, so that a hook tells
//! without the lock that an event is not kept. A hook that finds its stream remembered (and its event, if any, not
//! kept) bumps the context's work count, forwards, bumps it again, and, if the streams were forgotten meanwhile, has
//! the engine order the call after all ([`super::after_unordered`]), as for a call forwarded before anything was
//! attached. A context synchronize reaches libcuda unless the count is what it was at the last one that did.
//!
//! Nothing here after the forwarded call is a locked instruction: libcuda's call ends with stores to the GPU (its
//! pushbuffer, its doorbell), and a locked instruction right after waits until they have left the core (see
//! [`crate::lock`]). So the work counts and the counts by name are each thread's own, bumped with plain stores and
//! summed (with those of threads that ended) when a context synchronize or the summary asks.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Remembered streams: open addressing over this many slots, probed this far.
const STREAM_SLOTS: usize = 512;
const PROBE: usize = 8;
/// Counters of kept events, by a hash of the handle.
const KEPT_BUCKETS: usize = 1024;
/// Contexts whose work is counted here (a stream of a context past this is not remembered).
pub(crate) const MAX_CONTEXTS: usize = 64;
/// Driver functions whose forwarded calls are counted by name (for the summary's `cuda_work`): more than the hooks
/// that forward work (about a hundred).
const NAME_SLOTS: usize = 256;
const _: () = assert!(MAX_CONTEXTS < 0xff);
/// Where the context's index (plus one) sits in an entry; a stream handle (a user-space address) stays below it.
const TAG_SHIFT: u32 = 56;

/// The streams, kept-event counts and work counts the hooks read without the engine's lock.
#[derive(Debug)]
pub(crate) struct Plain {
    /// `(context index + 1) << 56 | stream handle`; 0: empty.
    streams: [AtomicU64; STREAM_SLOTS],
    kept: [AtomicU32; KEPT_BUCKETS],
    /// Bumped each time the streams are forgotten (after they are).
    generation: AtomicU64,
    /// Driver function names, by the slot their forwarded calls are counted in.
    names: [OnceLock<&'static str>; NAME_SLOTS],
    /// Every thread's counts.
    threads: Mutex<Threads>,
}

/// The counts of the threads that forwarded calls here.
#[derive(Debug)]
struct Threads {
    live: Vec<Arc<Counts>>,
    /// What threads that ended had counted.
    ended: Totals,
}

/// Sums of counts.
#[derive(Debug)]
struct Totals {
    work: [u64; MAX_CONTEXTS],
    names: [u64; NAME_SLOTS],
}

/// One thread's counts: written by that thread only (a plain store, no locked instruction), read by any.
#[derive(Debug)]
struct Counts {
    /// Per context index: bumped twice by each call forwarded here (before and after it).
    work: [AtomicU64; MAX_CONTEXTS],
    /// Per name slot: calls forwarded.
    names: [AtomicU64; NAME_SLOTS],
}

impl Counts {
    fn new() -> Counts {
        Counts {
            work: [const { AtomicU64::new(0) }; MAX_CONTEXTS],
            names: [const { AtomicU64::new(0) }; NAME_SLOTS],
        }
    }
}

/// Adds one to a count only its thread writes.
fn bump(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
}

/// A thread's counts in one table; given back to it (summed into what ended threads counted) when the thread ends.
struct Registered {
    plain: &'static Plain,
    counts: Arc<Counts>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.plain.retire(&self.counts);
    }
}

thread_local! {
    /// This thread's counts, one per table it forwarded calls through (one in a process; tests make more).
    static COUNTS: RefCell<Vec<Registered>> = const { RefCell::new(Vec::new()) };
}

/// A call forwarded on a remembered stream: what [`Plain::end`] needs. Used by the thread that made it only: the
/// raw pointer makes it neither `Send` nor `Sync`, and the counts it points at are kept alive by that thread's
/// registration until the thread ends, after every call it makes ([`Plain::end`] relies on both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket {
    generation: u64,
    /// The stream's context (its index).
    ctx: usize,
    /// The calling thread's counts (kept alive by its thread-local registration while the thread runs).
    counts: *const Counts,
}

fn hash(x: usize) -> usize {
    // Fibonacci hashing of the handle without its alignment bits.
    ((x as u64 >> 3).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize
}

impl Plain {
    pub(crate) const fn new() -> Plain {
        Plain {
            streams: [const { AtomicU64::new(0) }; STREAM_SLOTS],
            kept: [const { AtomicU32::new(0) }; KEPT_BUCKETS],
            generation: AtomicU64::new(0),
            names: [const { OnceLock::new() }; NAME_SLOTS],
            threads: Mutex::new(Threads {
                live: Vec::new(),
                ended: Totals {
                    work: [0; MAX_CONTEXTS],
                    names: [0; NAME_SLOTS],
                },
            }),
        }
    }

    /// The calling thread's counts in this table, registered at its first call (`None` while the thread ends).
    fn counts(&'static self) -> Option<*const Counts> {
        COUNTS
            .try_with(|all| {
                let mut all = all.try_borrow_mut().ok()?;
                if let Some(r) = all.iter().find(|r| std::ptr::eq(r.plain, self)) {
                    return Some(Arc::as_ptr(&r.counts));
                }
                let counts = Arc::new(Counts::new());
                self.threads.lock().ok()?.live.push(counts.clone());
                let p = Arc::as_ptr(&counts);
                all.push(Registered {
                    plain: self,
                    counts,
                });
                Some(p)
            })
            .ok()
            .flatten()
    }

    /// A thread ended: its counts join those of the threads that ended before.
    fn retire(&self, counts: &Arc<Counts>) {
        // A fork child's copy of the lock may have been held by a thread that does not exist there.
        if super::FORKED.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut t) = self.threads.lock() else {
            return;
        };
        for (sum, c) in t.ended.work.iter_mut().zip(&counts.work) {
            *sum += c.load(Ordering::Acquire);
        }
        for (sum, c) in t.ended.names.iter_mut().zip(&counts.names) {
            *sum += c.load(Ordering::Acquire);
        }
        t.live.retain(|c| !Arc::ptr_eq(c, counts));
    }

    fn entry(stream: usize, ctx: usize) -> Option<u64> {
        let s = stream as u64;
        (ctx < MAX_CONTEXTS && s != 0 && s >> TAG_SHIFT == 0)
            .then_some((ctx as u64 + 1) << TAG_SHIFT | s)
    }

    /// Remembers `stream` (a handle, not the legacy or per-thread stream) as related to no queue, in the context of
    /// index `ctx` (its own). Called under the engine's lock. A full neighbourhood remembers nothing: the stream's
    /// calls keep going through the engine.
    pub(crate) fn remember(&self, stream: usize, ctx: usize) {
        let Some(entry) = Plain::entry(stream, ctx) else {
            return;
        };
        let start = hash(stream);
        for i in 0..PROBE {
            let slot = &self.streams[(start + i) % STREAM_SLOTS];
            let v = slot.load(Ordering::SeqCst);
            if v & ((1 << TAG_SHIFT) - 1) == stream as u64 {
                // Already remembered (a stream is remembered with the context it was first seen in).
                return;
            }
            if v == 0 {
                slot.store(entry, Ordering::SeqCst);
                return;
            }
        }
    }

    /// Forgets every stream, then starts a new generation: a call that found its stream before and ends after
    /// sees the change. Called under the engine's lock before relations change.
    pub(crate) fn forget_streams(&self) {
        // Only the slots in use are stored to (each a locked `xchg`): most of the table is empty.
        for s in &self.streams {
            if s.load(Ordering::SeqCst) != 0 {
                s.store(0, Ordering::SeqCst);
            }
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// The remembered stream's context.
    fn find(&self, stream: usize) -> Option<usize> {
        let start = hash(stream);
        for i in 0..PROBE {
            let v = self.streams[(start + i) % STREAM_SLOTS].load(Ordering::SeqCst);
            if v == 0 {
                return None;
            }
            if v & ((1 << TAG_SHIFT) - 1) == stream as u64 {
                return Some(((v >> TAG_SHIFT) - 1) as usize);
            }
        }
        None
    }

    fn bucket(&self, event: usize) -> &AtomicU32 {
        &self.kept[hash(event) % KEPT_BUCKETS]
    }

    /// The engine keeps `event` (counted once per keeping; [`Plain::unkeep`] undoes it).
    pub(crate) fn keep(&self, event: usize) {
        self.bucket(event).fetch_add(1, Ordering::SeqCst);
    }

    /// The engine no longer keeps `event`.
    pub(crate) fn unkeep(&self, event: usize) {
        let _ = self
            .bucket(event)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether the engine may keep `event` (a false `true` only sends the call through the engine).
    pub(crate) fn may_keep(&self, event: usize) -> bool {
        self.bucket(event).load(Ordering::SeqCst) != 0
    }

    /// Before a call on `stream` (with `event`, if it names one): `Some` when the call can go to libcuda without
    /// the engine (the stream remembered, the event not kept); the call is then counted as the context's work.
    pub(crate) fn begin(&'static self, stream: usize, event: Option<usize>) -> Option<Ticket> {
        let generation = self.generation.load(Ordering::SeqCst);
        let ctx = self.find(stream)?;
        if event.is_some_and(|e| self.may_keep(e)) {
            return None;
        }
        let counts = self.counts()?;
        // SAFETY: this thread's counts, alive while its registration is (until the thread ends).
        bump(unsafe { &(*counts).work[ctx] });
        Some(Ticket {
            generation,
            ctx,
            counts,
        })
    }

    /// After the call of `t` returned, counted under driver function `name` (if it counts): `false` when the
    /// streams were forgotten meanwhile (the engine must then look at the call, as at one forwarded unordered).
    pub(crate) fn end(&self, t: Ticket, name: Option<&'static str>) -> bool {
        // SAFETY: `t` was made by this thread (tickets do not cross threads), whose counts outlive the call.
        let counts = unsafe { &*t.counts };
        bump(&counts.work[t.ctx]);
        if let Some(k) = name.and_then(|n| self.name_slot(n)) {
            bump(&counts.names[k]);
        }
        self.generation.load(Ordering::SeqCst) == t.generation
    }

    /// Context `ci`'s count of calls forwarded here, over every thread (changes while one runs, and after each).
    pub(crate) fn work(&self, ci: usize) -> u64 {
        if ci >= MAX_CONTEXTS {
            return 0;
        }
        let Ok(t) = self.threads.lock() else {
            return 0;
        };
        t.live
            .iter()
            .map(|c| c.work[ci].load(Ordering::Acquire))
            .fold(t.ended.work[ci], u64::wrapping_add)
    }

    /// The slot forwarded calls of driver function `name` (the literal each hook passes) are counted in.
    fn name_slot(&self, name: &'static str) -> Option<usize> {
        let start = hash(name.as_ptr() as usize) % NAME_SLOTS;
        (0..NAME_SLOTS)
            .map(|i| (start + i) % NAME_SLOTS)
            .find(|&k| {
                let held = *self.names[k].get_or_init(|| name);
                std::ptr::eq(held, name)
            })
    }

    /// Forwarded calls by driver function name, over every thread.
    pub(crate) fn counted(&self) -> Vec<(&'static str, u64)> {
        let Ok(t) = self.threads.lock() else {
            return Vec::new();
        };
        self.names
            .iter()
            .enumerate()
            .filter_map(|(k, n)| {
                let sum = t
                    .live
                    .iter()
                    .map(|c| c.names[k].load(Ordering::Acquire))
                    .fold(t.ended.names[k], u64::wrapping_add);
                Some((*n.get()?, sum))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remembered_stream_is_found_with_its_context_until_forgotten() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        assert_eq!(p.begin(0x7f00_1000, None), None);
        p.remember(0x7f00_1000, 3);
        p.remember(0x7f00_2000, 0);
        let t = p.begin(0x7f00_1000, None).expect("remembered");
        assert_eq!(t.ctx, 3);
        assert_eq!(p.work(3), 1);
        assert!(p.end(t, None));
        assert_eq!(p.work(3), 2);
        assert_eq!(p.begin(0x7f00_2000, None).map(|t| t.ctx), Some(0));
        // Remembered once.
        p.remember(0x7f00_1000, 5);
        assert_eq!(p.begin(0x7f00_1000, None).map(|t| t.ctx), Some(3));
        p.forget_streams();
        assert_eq!(p.begin(0x7f00_1000, None), None);
        assert_eq!(p.begin(0x7f00_2000, None), None);
    }

    #[test]
    fn a_call_that_spans_a_forgetting_is_told_so() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        p.remember(0x5000, 0);
        let t = p.begin(0x5000, None).expect("remembered");
        p.forget_streams();
        assert!(!p.end(t, None));
        // A call that begins after the change does not find the stream at all.
        assert_eq!(p.begin(0x5000, None), None);
    }

    #[test]
    fn a_kept_event_sends_the_call_through_the_engine() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        p.remember(0x5000, 1);
        p.keep(0xabc0);
        assert_eq!(p.begin(0x5000, Some(0xabc0)), None);
        // Another event (in another bucket) is not held up.
        assert_ne!(hash(0xabc0) % KEPT_BUCKETS, hash(0xdef0) % KEPT_BUCKETS);
        assert!(p.begin(0x5000, Some(0xdef0)).is_some());
        p.keep(0xabc0);
        p.unkeep(0xabc0);
        assert!(p.may_keep(0xabc0), "kept twice, released once");
        p.unkeep(0xabc0);
        assert!(!p.may_keep(0xabc0));
        assert!(p.begin(0x5000, Some(0xabc0)).is_some());
        // More releases than keepings never wrap the count.
        p.unkeep(0xabc0);
        assert!(!p.may_keep(0xabc0));
    }

    #[test]
    fn handles_that_cannot_be_tagged_and_contexts_past_the_table_are_not_remembered() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        p.remember(0, 0);
        p.remember(1 << 60, 0);
        p.remember(0x6000, MAX_CONTEXTS);
        assert_eq!(p.begin(0, None), None);
        assert_eq!(p.begin(1 << 60, None), None);
        assert_eq!(p.begin(0x6000, None), None);
    }

    #[test]
    fn a_full_neighbourhood_remembers_nothing_more() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        // Handles that hash to one slot fill its neighbourhood.
        let base = 0x10_0000usize;
        let same: Vec<usize> = (1..200_000usize)
            .map(|i| base + i * 8)
            .filter(|&h| hash(h) % STREAM_SLOTS == hash(base) % STREAM_SLOTS)
            .take(PROBE + 1)
            .collect();
        assert_eq!(same.len(), PROBE + 1);
        for &h in &same {
            p.remember(h, 0);
        }
        for &h in &same[..PROBE] {
            assert!(p.begin(h, None).is_some());
        }
        assert_eq!(p.begin(same[PROBE], None), None);
    }

    #[test]
    fn forwarded_calls_are_counted_by_name_and_context_over_threads_that_ended_too() {
        let p: &'static Plain = Box::leak(Box::new(Plain::new()));
        static A: &str = "cuStreamWaitEvent";
        static B: &str = "cuMemcpy2DAsync_v2";
        p.remember(0x5000, 2);
        let call = move |name| {
            let t = p.begin(0x5000, None).expect("remembered");
            assert!(p.end(t, name));
        };
        call(Some(A));
        call(None);
        std::thread::spawn(move || {
            call(Some(A));
            call(Some(B));
        })
        .join()
        .unwrap();
        let mut c = p.counted();
        c.sort();
        assert_eq!(c, vec![(B, 1), (A, 2)]);
        // Two bumps per call, four calls.
        assert_eq!(p.work(2), 8);
        assert_eq!(p.work(1), 0);
        assert_eq!(p.work(MAX_CONTEXTS), 0);
    }
}
