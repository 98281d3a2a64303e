//! Launches forwarded to libcuda without the engine, while nothing is attached.
//!
//! Until a stream's launches have paid for its takeover ([`crate::takeover`]) each of them goes to libcuda, and
//! going through the engine to be counted cost a forwarded launch about 0.4 µs (H100, 580.159.04: an isolated
//! `cuLaunchKernel` 3.68 µs plain, 4.12 µs forwarded; the engine's own code takes 90 ns of it against the
//! simulator, the rest is not broken down), up to a tenth of a launch-bound loop's time before APEX takes anything
//! over. So the engine, when it forwards a launch
//! before anything is attached, grants the hooks a credit: the number of further launches on that stream that can
//! go straight to libcuda without deciding anything (one short of what the stream still has to pay, so the launch
//! that completes the price reaches the engine), for functions whose modules it has priced already. The hooks spend
//! it with one atomic decrement; the engine counts what was spent towards the stream's takeover at its next launch.
//!
//! Forwarding is what the engine would have decided for every such launch: while nothing is attached no queue
//! exists, so nothing of APEX's orders with it (a thread that attaches meanwhile marks the stream, as for every
//! call forwarded without the lock: [`super::after_unordered`]). A credit spent on another context's or stream's
//! launch than it was granted for (threads racing a new grant, a second context appearing) only counts that launch
//! towards the wrong stream's takeover; the engine stops granting once it has seen two contexts.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Functions remembered as priced: open addressing over this many slots, probed this far.
const SEEN_SLOTS: usize = 1024;
const SEEN_PROBE: usize = 8;

/// Most launches granted at once: the engine still counts them in batches of this size.
pub(crate) const MAX_GRANT: u64 = 4096;

/// The credit the hooks spend, the stream it is for and the functions it covers.
#[derive(Debug)]
pub(crate) struct FastForward {
    credit: AtomicI64,
    /// The stream's handle plus one (0: no grant; the legacy stream is handle 0).
    stream: AtomicUsize,
    seen: [AtomicUsize; SEEN_SLOTS],
}

impl FastForward {
    pub(crate) const fn new() -> FastForward {
        FastForward {
            credit: AtomicI64::new(0),
            stream: AtomicUsize::new(0),
            seen: [const { AtomicUsize::new(0) }; SEEN_SLOTS],
        }
    }

    /// Whether a launch of function `f` on `stream` goes to libcuda on the credit (spending one launch of it).
    pub(crate) fn spend(&self, f: usize, stream: usize, per_thread: bool) -> bool {
        !per_thread
            && stream != crate::order::CU_STREAM_PER_THREAD
            && self.stream.load(Ordering::Acquire) == stream.wrapping_add(1)
            && self.has_seen(f)
            && self.credit.fetch_sub(1, Ordering::AcqRel) > 0
    }

    /// Grants `n` launches on `stream`, ending any earlier grant (whose spending the caller settled first).
    pub(crate) fn grant(&self, stream: usize, n: u64) {
        self.credit.store(0, Ordering::Release);
        self.stream.store(stream.wrapping_add(1), Ordering::Release);
        self.credit
            .store(n.min(MAX_GRANT) as i64, Ordering::Release);
    }

    /// Ends the grant: the launches it had left (the caller counts `granted - left` as spent).
    pub(crate) fn revoke(&self) -> u64 {
        self.stream.store(0, Ordering::Release);
        self.credit.swap(0, Ordering::AcqRel).max(0) as u64
    }

    /// The launches the grant has left now (for a summary written while it runs).
    pub(crate) fn left(&self) -> u64 {
        self.credit.load(Ordering::Acquire).max(0) as u64
    }

    /// Remembers function `f` as priced (its module owed or loaded). A full neighbourhood forgets nothing: the
    /// function's launches then keep going through the engine.
    pub(crate) fn saw(&self, f: usize) {
        if f == 0 {
            return;
        }
        let start = slot_of(f);
        for i in 0..SEEN_PROBE {
            let slot = &self.seen[(start + i) % SEEN_SLOTS];
            match slot.compare_exchange(0, f, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(held) if held == f => return,
                Err(_) => {}
            }
        }
    }

    fn has_seen(&self, f: usize) -> bool {
        // 0 marks an empty slot.
        if f == 0 {
            return false;
        }
        let start = slot_of(f);
        (0..SEEN_PROBE).any(|i| self.seen[(start + i) % SEEN_SLOTS].load(Ordering::Acquire) == f)
    }

    /// Forgets every function (a module was unloaded: its handles may name another module's functions later).
    pub(crate) fn forget_functions(&self) {
        for slot in &self.seen {
            slot.store(0, Ordering::Release);
        }
    }
}

/// Every this many forwarded launches, one is timed ([`LaunchCost`]).
const SAMPLE_EVERY: u32 = 16;
/// Timed launches per window: a window's fastest is its sample.
const WINDOW: u32 = 8;

/// What libcuda's `cuLaunchKernel` costs the program in this process, timed on the launches forwarded on the
/// credit: one in [`SAMPLE_EVERY`] (two clock reads, ~40 ns, spread over sixteen launches), the fastest of each
/// [`WINDOW`] of those taken as that window's cost (a launch that waited for room in libcuda's queue, or lost its
/// core, would overstate what APEX saves), and the windows averaged with a weight of a quarter on the newest. Updates
/// racing between threads may lose a sample: it is an estimate.
#[derive(Debug)]
pub(crate) struct LaunchCost {
    count: AtomicU32,
    window_min: AtomicU64,
    window_n: AtomicU32,
    /// Nanoseconds; 0 until a window is complete.
    estimate: AtomicU64,
}

impl LaunchCost {
    pub(crate) const fn new() -> LaunchCost {
        LaunchCost {
            count: AtomicU32::new(0),
            window_min: AtomicU64::new(u64::MAX),
            window_n: AtomicU32::new(0),
            estimate: AtomicU64::new(0),
        }
    }

    /// Runs `forward` (a launch handed to libcuda), timing it if it is the one of its [`SAMPLE_EVERY`] to be.
    pub(crate) fn forward<R>(&self, forward: impl FnOnce() -> R) -> R {
        if !self
            .count
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SAMPLE_EVERY)
        {
            return forward();
        }
        let started = std::time::Instant::now();
        let r = forward();
        self.record(started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
        r
    }

    /// Adds one timed launch of `ns`.
    pub(crate) fn record(&self, ns: u64) {
        self.window_min.fetch_min(ns, Ordering::Relaxed);
        if self.window_n.fetch_add(1, Ordering::Relaxed) + 1 < WINDOW {
            return;
        }
        self.window_n.store(0, Ordering::Relaxed);
        let fastest = self.window_min.swap(u64::MAX, Ordering::Relaxed);
        if fastest == u64::MAX {
            return;
        }
        let old = self.estimate.load(Ordering::Relaxed);
        let new = if old == 0 {
            fastest
        } else {
            old.saturating_mul(3).saturating_add(fastest) / 4
        };
        self.estimate.store(new.max(1), Ordering::Relaxed);
    }

    /// The estimate in nanoseconds; 0 while no window is complete.
    pub(crate) fn estimate(&self) -> u64 {
        self.estimate.load(Ordering::Relaxed)
    }
}

fn slot_of(f: usize) -> usize {
    // Function handles are pointers: drop the alignment bits, spread the rest.
    ((f >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % SEEN_SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_is_spent_once_per_launch_on_its_stream_for_seen_functions() {
        let ff = FastForward::new();
        ff.saw(0x7000);
        assert!(!ff.spend(0x7000, 0, false), "nothing granted yet");
        ff.grant(0, 3);
        assert!(!ff.spend(0x7010, 0, false), "a function not seen");
        assert!(!ff.spend(0x7000, 0x50, false), "another stream");
        assert!(!ff.spend(0x7000, 0, true), "the per-thread stream");
        assert!(ff.spend(0x7000, 0, false));
        assert!(ff.spend(0x7000, 0, false));
        assert_eq!(ff.left(), 1);
        assert!(ff.spend(0x7000, 0, false));
        assert!(!ff.spend(0x7000, 0, false), "spent");
        assert_eq!(ff.revoke(), 0);
        ff.grant(0x50, 10);
        assert!(ff.spend(0x7000, 0x50, false));
        assert_eq!(ff.revoke(), 9);
        assert!(!ff.spend(0x7000, 0x50, false), "revoked");
        ff.grant(0x50, u64::MAX);
        assert_eq!(ff.left(), MAX_GRANT);
        ff.forget_functions();
        assert!(!ff.spend(0x7000, 0x50, false), "forgotten");
        // CU_STREAM_PER_THREAD names each thread's own stream: never spent on.
        ff.saw(0x7000);
        ff.grant(crate::order::CU_STREAM_PER_THREAD, 10);
        assert!(!ff.spend(0x7000, crate::order::CU_STREAM_PER_THREAD, false));
    }

    #[test]
    fn the_seen_set_holds_many_functions_and_never_confuses_them() {
        let ff = FastForward::new();
        let fs: Vec<usize> = (0..600).map(|i| 0x5555_0000 + i * 0x40).collect();
        for &f in &fs {
            ff.saw(f);
        }
        let held = fs.iter().filter(|&&f| ff.has_seen(f)).count();
        assert!(held >= 590, "{held} of 600 remembered");
        assert!(!ff.has_seen(0x1234_5670));
        assert!(!ff.has_seen(0));
    }

    /// Threads racing over the windows lose samples, never the bounds: the estimate stays between the fastest and
    /// slowest launch timed.
    #[test]
    fn racing_threads_keep_the_estimate_between_the_samples() {
        let c = LaunchCost::new();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let c = &c;
                s.spawn(move || {
                    for i in 0..10_000u64 {
                        c.record(3_000 + (i * 7 + t * 13) % 2_000);
                    }
                });
            }
        });
        let e = c.estimate();
        assert!((3_000..5_000).contains(&e), "{e}");
    }

    #[test]
    fn the_launch_cost_is_the_fastest_of_each_window_averaged() {
        let c = LaunchCost::new();
        for ns in [9_000, 4_000, 5_000, 4_500, 30_000, 4_200, 4_100, 6_000] {
            assert_eq!(c.estimate(), 0, "no window complete yet");
            c.record(ns);
        }
        assert_eq!(c.estimate(), 4_000, "a window's fastest");
        for _ in 0..WINDOW {
            c.record(8_000);
        }
        assert_eq!(
            c.estimate(),
            (4_000 * 3 + 8_000) / 4,
            "a quarter of the newest window"
        );
        // Only one launch in SAMPLE_EVERY is timed.
        let c = LaunchCost::new();
        let timed = |c: &LaunchCost| c.window_n.load(Ordering::Relaxed);
        for i in 0..SAMPLE_EVERY * 3 {
            assert_eq!(c.forward(|| i), i);
        }
        assert_eq!(timed(&c), 3);
    }
}
