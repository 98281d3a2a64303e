//! Where a taken-over launch's time goes (`APEX_PRELOAD_PROFILE=1`): the launch path stamps the CPU's time-stamp
//! counter between its phases, and the summary gets the median and mean nanoseconds of each phase per launch, over
//! launches that took no slow path (an attach, a module load, a new stream or launch shape). Off, a stamp is one
//! relaxed load; on, one `rdtsc` (a few nanoseconds, counted in the phases).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The phases of a launch through APEX, in order.
pub const PHASES: [&str; 6] = [
    "hook_to_engine",
    "context",
    "function_stream_shape",
    "order",
    "submit",
    "engine_to_return",
];

static ON: AtomicBool = AtomicBool::new(false);
/// Ticks spent in [`PHASES`]' last phase, summed (it ends after the engine's lock is released).
static TAIL_TICKS: AtomicU64 = AtomicU64::new(0);
/// The last phase's histogram ([`BUCKETS`]).
static TAIL_HIST: [AtomicU64; BUCKETS] = [const { AtomicU64::new(0) }; BUCKETS];
/// Time-stamp counter ticks per nanosecond, times 2^20, measured when the profile starts.
static RATE: AtomicU64 = AtomicU64::new(1 << 20);

/// Histogram buckets of [`BUCKET_NS`] each; the last one holds everything longer.
const BUCKETS: usize = 257;
const BUCKET_NS: f64 = 8.0;

/// Turns the profile on when `APEX_PRELOAD_PROFILE` says so, and measures the counter's rate.
pub(crate) fn start() {
    if matches!(
        std::env::var("APEX_PRELOAD_PROFILE").as_deref(),
        Ok("1" | "on" | "true")
    ) {
        RATE.store(
            (ticks_per_ns() * f64::from(1u32 << 20)) as u64,
            Ordering::Relaxed,
        );
        ON.store(true, Ordering::Relaxed);
    }
}

/// The bucket of `ticks`.
fn bucket(ticks: u64) -> usize {
    let rate = RATE.load(Ordering::Relaxed).max(1) as f64 / f64::from(1u32 << 20);
    ((ticks as f64 / rate / BUCKET_NS) as usize).min(BUCKETS - 1)
}

/// Whether the profile is on.
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The time-stamp counter now (0 when the profile is off).
#[inline]
pub(crate) fn stamp() -> u64 {
    if !on() {
        return 0;
    }
    ticks()
}

#[inline]
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Adds the last phase (from `since` to now; 0: not a profiled launch).
pub(crate) fn tail(since: u64) {
    if since != 0 {
        // Loads and stores, not read-modify-writes: a locked instruction here would wait for the launch's doorbell
        // to leave the core and count that in the phase. (Two threads may lose a count; it is a profile.)
        let t = ticks().wrapping_sub(since);
        TAIL_TICKS.store(TAIL_TICKS.load(Ordering::Relaxed) + t, Ordering::Relaxed);
        let b = &TAIL_HIST[bucket(t)];
        b.store(b.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// Ticks per phase, summed over launches, and each phase's histogram.
#[derive(Debug)]
pub(crate) struct Phases {
    ticks: [u64; 6],
    hist: Vec<[u64; BUCKETS]>,
    launches: u64,
}

impl Default for Phases {
    fn default() -> Phases {
        Phases {
            ticks: [0; 6],
            hist: vec![[0; BUCKETS]; 5],
            launches: 0,
        }
    }
}

/// The median of a histogram, in nanoseconds (the middle of its bucket).
fn median(h: &[u64; BUCKETS]) -> f64 {
    let n: u64 = h.iter().sum();
    let mut seen = 0;
    for (i, &c) in h.iter().enumerate() {
        seen += c;
        if seen * 2 >= n && n > 0 {
            return (i as f64 + 0.5) * BUCKET_NS;
        }
    }
    0.0
}

impl Phases {
    /// Adds one launch's stamps: `s[0]` at the hook's entry, `s[i + 1]` at the end of phase `i` (the last phase is
    /// added by [`tail`]).
    pub(crate) fn add(&mut self, s: &[u64; 6]) {
        if s[0] == 0 {
            return;
        }
        for i in 0..5 {
            let t = s[i + 1].wrapping_sub(s[i]);
            self.ticks[i] += t;
            self.hist[i][bucket(t)] += 1;
        }
        self.launches += 1;
    }

    /// The median and mean nanoseconds per launch of each phase (`<phase>_median_ns`, `<phase>_mean_ns`), the sums
    /// of both, and the launches counted.
    pub(crate) fn report(&self) -> Vec<(String, f64)> {
        if self.launches == 0 {
            return Vec::new();
        }
        let per_ns = RATE.load(Ordering::Relaxed).max(1) as f64 / f64::from(1u32 << 20);
        let mut ticks = self.ticks;
        ticks[5] = TAIL_TICKS.load(Ordering::Relaxed);
        let mut tail = [0u64; BUCKETS];
        for (t, a) in tail.iter_mut().zip(TAIL_HIST.iter()) {
            *t = a.load(Ordering::Relaxed);
        }
        let mut out = Vec::new();
        let (mut medians, mut means) = (0.0, 0.0);
        for (i, name) in PHASES.iter().enumerate() {
            let m = median(if i < 5 { &self.hist[i] } else { &tail });
            let mean = ticks[i] as f64 / per_ns / self.launches as f64;
            medians += m;
            means += mean;
            out.push((format!("{name}_median_ns"), m));
            out.push((format!("{name}_mean_ns"), mean));
        }
        out.push(("sum_of_medians_ns".into(), medians));
        out.push(("sum_of_means_ns".into(), means));
        out.push(("launches".into(), self.launches as f64));
        out
    }
}

/// The time-stamp counter's rate, measured over 20 ms.
fn ticks_per_ns() -> f64 {
    let (t0, c0) = (Instant::now(), ticks());
    std::thread::sleep(Duration::from_millis(20));
    let (dt, dc) = (t0.elapsed(), ticks().wrapping_sub(c0));
    (dc as f64 / dt.as_nanos() as f64).max(1e-9)
}
