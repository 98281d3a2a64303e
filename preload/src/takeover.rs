//! When a stream's launches start going through APEX (`APEX_PRELOAD_TAKEOVER`).
//!
//! Taking a stream over has a price paid once: attaching to its context (a few ms, with the queue that proves the
//! channel) or, in an attached context, a queue of its own (about 5 ms on an H100, almost all of it RM's channel
//! creation). Each launch through APEX then saves about 3 µs of the program's CPU time against libcuda's
//! `cuLaunchKernel`. A program that launches a few hundred kernels never earns the price back, and paid up front it
//! made such a program slower than libcuda alone (a 0.3 s CUDA program with 3 streams: 0.88×). So, by default
//! (`earned`), a stream's launches go to libcuda until they have cost, at the saving per launch, what its takeover
//! costs, and then it is taken over: the ski-rental rule. An attach serves every stream of its context, so the
//! context's streams pay for it together; a queue is paid for by its own stream. A program that ends before that never pays for APEX; one
//! that goes on pays at most the price of one takeover more than libcuda would have cost it (the time its
//! launches already spent on libcuda). `first` takes every stream over at its first launch (the behaviour before
//! this policy, which tests and latency benchmarks ask for); a number takes a stream over after that many launches.
//!
//! The price is estimated from the set-up this process has made so far (the last attach and queue build timed),
//! starting from figures measured on an H100 (driver 580.159.04).

use std::collections::HashMap;
use std::time::Duration;

use crate::order::StreamKey;

/// The CPU time a launch through APEX saves against libcuda's, in nanoseconds, before this process has timed
/// libcuda's: the hook's isolated launch costs 0.39-0.41 µs where libcuda's `cuLaunchKernel` costs 3.5-3.9 µs (H100,
/// `preload/corpus/launch_sync.cu`); a launch followed by a synchronization saves more (about 5.8 µs), so this errs
/// towards taking over later.
pub(crate) const SAVED_PER_LAUNCH_NS: u64 = 3_000;

/// What a launch through the hook costs once taken over (H100: 0.39-0.41 µs isolated), subtracted from libcuda's
/// timed launch for the saving.
const APEX_LAUNCH_NS: u64 = 400;

/// The least saving per launch a timed libcuda launch is taken to show: a price is never divided by less (a launch
/// taken over also saves on the synchronizations after it, which the timed launch does not show).
const MIN_SAVED_NS: u64 = 500;

/// The most: a `cuLaunchKernel` that takes longer waited for room in libcuda's queue (a GPU-bound program), where
/// APEX's launches would wait as well and save nothing of it.
const MAX_SAVED_NS: u64 = 4 * SAVED_PER_LAUNCH_NS;

/// The price of attaching to a context before one was timed in this process: the attach and the queue that proves
/// the channel, which then serves the stream (H100, 580.159.04: 3.6 ms and 5.4-5.7 ms).
const ATTACH_NS: u64 = 8_500_000;

/// The price of a queue before one was timed in this process (H100, 580.159.04: 4.8-5.4 ms).
const QUEUE_NS: u64 = 5_400_000;

/// What loading a module for APEX costs per byte of the image the program loaded, before a load was timed in this
/// process. With module cache hits mapped rather than read (2026-11-27, ninth session), a decode process's 12
/// PyTorch modules (zstd-compressed fatbins, about 17 MB of images) took 33-47 ms at a takeover with the cache warm,
/// 2.0-2.8 ns per byte, and 117 ms with it cold, 6.9 (H200, 580.159.04; a small-ops process's 14 on an H100: 37 ms,
/// 2.1); before the mapping, 4.4-5.9 warm and 7.3-11.6 cold, when this was 8. 4, between warm and cold: a process
/// that finds the cache cold (the first on a machine) pays at most 1.7 times the price it was quoted. It counts as
/// one MiB of loads measured, so the first timed loads outweigh it.
const MODULE_NS_PER_BYTE: u64 = 4;
const MODULE_PRIOR_BYTES: u64 = 1 << 20;

/// Streams counted at most: beyond this, counts of streams never taken over are forgotten (a program that makes
/// and drops streams without destroying them through CUDA cannot grow the table without bound).
const MAX_COUNTED: usize = 4096;

/// When a stream is taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    /// At its first launch.
    First,
    /// After this many launches on libcuda.
    After(u64),
    /// Once its launches on libcuda have cost what its takeover costs (the default).
    Earned,
}

impl Policy {
    /// The policy `APEX_PRELOAD_TAKEOVER` names (`earned`, `first`, or a number of launches; unset: `earned`), or
    /// a sentence saying what the value should be.
    pub(crate) fn by(value: Option<&str>) -> Result<Policy, String> {
        match value.map(str::trim) {
            None | Some("" | "earned" | "auto") => Ok(Policy::Earned),
            Some("first" | "0") => Ok(Policy::First),
            Some(v) => match v.parse::<u64>() {
                Ok(n) => Ok(Policy::After(n)),
                Err(_) => Err(format!(
                    "APEX_PRELOAD_TAKEOVER={v:?} is not a policy: use earned (the default), first, or a number of \
                     launches a stream makes on libcuda before APEX takes it over"
                )),
            },
        }
    }

    /// The name the summary gives the policy.
    pub(crate) fn label(self) -> String {
        match self {
            Policy::First => "first".into(),
            Policy::After(n) => format!("after {n} launches"),
            Policy::Earned => "earned".into(),
        }
    }
}

/// What a stream's takeover needs that its context does not have yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Needs {
    /// An attach to the context (whose proving queue then serves the stream).
    Attach,
    /// A queue of its own in an attached context.
    Queue,
    /// Nothing: a built queue is waiting for a stream.
    Nothing,
}

/// The launches each stream not yet taken over has made on libcuda, and the price of a takeover.
#[derive(Debug)]
pub(crate) struct Takeover {
    policy: Policy,
    /// Launches on libcuda per stream not taken over yet: what it has paid towards its own queue.
    counts: HashMap<(usize, StreamKey), u64>,
    /// Launches on libcuda per context not attached yet, on any of its streams: what they have paid together
    /// towards the attach, which serves them all.
    context_counts: HashMap<usize, u64>,
    attach_ns: u64,
    queue_ns: u64,
    /// Modules whose kernels were launched on streams not taken over and that APEX has not loaded, per context:
    /// each one's estimated load time. A takeover pays for them too, since the launches that follow load them.
    owed: HashMap<(usize, usize), u64>,
    /// The sum of `owed` per context.
    owed_ns: HashMap<usize, u64>,
    /// Module loads timed so far (with the prior): nanoseconds and image bytes.
    module_ns: u64,
    module_bytes: u64,
    /// The CPU time a launch through APEX saves: [`SAVED_PER_LAUNCH_NS`] until libcuda's own launches were timed
    /// in this process ([`Takeover::libcuda_launch_took`]).
    saved_ns: u64,
    /// Whether [`Takeover::saved_ns`] comes from libcuda's launches timed in this process.
    saved_timed: bool,
    /// Earlier runs of the program advise taking it over at its first launch ([`crate::history`]): with `earned`, an
    /// attach is paid for at once.
    advised: bool,
    /// What this process's takeovers cost, as timed: attaches and module loads (without CUDA's loading of its own
    /// instances), nanoseconds.
    paid_ns: u64,
}

impl Takeover {
    pub(crate) fn new(policy: Policy) -> Takeover {
        Takeover {
            policy,
            counts: HashMap::new(),
            context_counts: HashMap::new(),
            attach_ns: ATTACH_NS,
            queue_ns: QUEUE_NS,
            owed: HashMap::new(),
            owed_ns: HashMap::new(),
            module_ns: MODULE_NS_PER_BYTE * MODULE_PRIOR_BYTES,
            module_bytes: MODULE_PRIOR_BYTES,
            saved_ns: SAVED_PER_LAUNCH_NS,
            saved_timed: false,
            advised: false,
            paid_ns: 0,
        }
    }

    /// Earlier runs of the program made launches enough to pay for its takeover from the first launch on
    /// ([`crate::history::History::advised`]): with `earned`, an attach (with the modules its kernels need) is
    /// taken as paid. Queues for further streams are still paid for by their own launches.
    pub(crate) fn advise(&mut self) {
        self.advised = self.policy == Policy::Earned;
    }

    /// Whether the takeover follows the earlier runs' advice.
    pub(crate) fn advised(&self) -> bool {
        self.advised
    }

    /// What this run's takeover cost for its record ([`crate::history`]): paid where an attach or a module load was
    /// timed, else the estimate of attaching and loading the modules owed so far.
    pub(crate) fn run_price(&self) -> crate::history::Price {
        if self.paid_ns > 0 {
            crate::history::Price::Paid(self.paid_ns)
        } else {
            crate::history::Price::Estimated(self.attach_ns.saturating_add(self.owed_total_ns()))
        }
    }

    /// The saving per launch, where libcuda's launches were timed in this process.
    pub(crate) fn timed_saving(&self) -> Option<u64> {
        self.saved_timed.then_some(self.saved_ns)
    }

    /// libcuda's `cuLaunchKernel` takes `ns` of the program's CPU time in this process (the engine's estimate of the
    /// forwarded launches, [`crate::engine`]; 0: none yet): a launch through APEX saves that less the hook's own
    /// cost, between [`MIN_SAVED_NS`] and [`MAX_SAVED_NS`]. A program whose launches cost libcuda more earns its
    /// takeover sooner.
    pub(crate) fn libcuda_launch_took(&mut self, ns: u64) {
        self.saved_timed = ns != 0;
        self.saved_ns = if ns == 0 {
            SAVED_PER_LAUNCH_NS
        } else {
            ns.saturating_sub(APEX_LAUNCH_NS)
                .clamp(MIN_SAVED_NS, MAX_SAVED_NS)
        };
    }

    pub(crate) fn policy(&self) -> Policy {
        self.policy
    }

    /// How many launches on libcuda pay for a takeover that `needs` this.
    pub(crate) fn threshold(&self, needs: Needs) -> u64 {
        match self.policy {
            Policy::First => 0,
            Policy::After(n) => n,
            Policy::Earned => {
                let price = match needs {
                    Needs::Attach => self.attach_ns,
                    Needs::Queue => self.queue_ns,
                    Needs::Nothing => 0,
                };
                price.div_ceil(self.saved_ns)
            }
        }
    }

    /// How many launches on libcuda pay for a takeover in context `ctx` that `needs` this: with the `earned`
    /// policy, the modules its streams' kernels need and APEX has not loaded are paid for too.
    pub(crate) fn threshold_in(&self, ctx: usize, needs: Needs) -> u64 {
        let base = self.threshold(needs);
        if self.policy != Policy::Earned {
            return base;
        }
        if self.advised && needs == Needs::Attach {
            return 0;
        }
        let owed = self.owed_ns.get(&ctx).copied().unwrap_or(0);
        base + owed.div_ceil(self.saved_ns)
    }

    /// Whether module `owner`'s load is counted in context `ctx`'s takeover price already.
    pub(crate) fn owes(&self, ctx: usize, owner: usize) -> bool {
        self.owed.contains_key(&(ctx, owner))
    }

    /// A kernel of module `owner` (an image of `image_bytes`), not loaded for APEX, was launched on a stream of
    /// context `ctx` not taken over: the takeover's price includes loading it, estimated from the loads timed so far.
    pub(crate) fn owe_module(&mut self, ctx: usize, owner: usize, image_bytes: usize) {
        if self.policy != Policy::Earned || self.owes(ctx, owner) {
            return;
        }
        if self.owed.len() >= MAX_COUNTED {
            self.owed.clear();
            self.owed_ns.clear();
        }
        let ns = self.module_estimate(image_bytes);
        self.owed.insert((ctx, owner), ns);
        *self.owed_ns.entry(ctx).or_insert(0) += ns;
    }

    /// Module `owner` was loaded for APEX in context `ctx` (or refused there): no takeover pays for it any more.
    pub(crate) fn module_loaded(&mut self, ctx: usize, owner: usize) {
        if let Some(ns) = self.owed.remove(&(ctx, owner))
            && let Some(total) = self.owed_ns.get_mut(&ctx)
        {
            *total = total.saturating_sub(ns);
        }
    }

    /// The estimated load time of every module owed now, in nanoseconds.
    pub(crate) fn owed_total_ns(&self) -> u64 {
        self.owed_ns.values().sum()
    }

    /// Module `owner` was unloaded: no context's takeover pays for it any more.
    pub(crate) fn forget_module(&mut self, owner: usize) {
        let owed_ns = &mut self.owed_ns;
        self.owed.retain(|&(ctx, o), ns| {
            if o != owner {
                return true;
            }
            if let Some(total) = owed_ns.get_mut(&ctx) {
                *total = total.saturating_sub(*ns);
            }
            false
        });
    }

    /// A module load of an `image_bytes` image took `took`: later estimates follow this process's loads.
    pub(crate) fn module_took(&mut self, image_bytes: usize, took: Duration) {
        let ns = took.as_nanos().min(u128::from(u64::MAX / 2)) as u64;
        self.paid_ns = self.paid_ns.saturating_add(ns);
        self.module_ns = self.module_ns.saturating_add(ns);
        self.module_bytes = self.module_bytes.saturating_add(image_bytes as u64);
    }

    /// The estimated time of loading a module from an image of `image_bytes`, in nanoseconds.
    pub(crate) fn module_estimate(&self, image_bytes: usize) -> u64 {
        let ns =
            u128::from(self.module_ns) * image_bytes as u128 / u128::from(self.module_bytes.max(1));
        ns.min(u128::from(u64::MAX / 2)) as u64
    }

    /// Whether a launch on stream `key` of context `ctx`, not taken over yet, goes through APEX: `false` counts it
    /// as one more launch on libcuda. Once paid, it answers `true` until the caller reports the stream taken over
    /// ([`Takeover::taken`]) or the context attached ([`Takeover::attached`]): a takeover postponed (the set-up
    /// still running in the background) does not make the stream pay again.
    ///
    /// With the `earned` policy an attach is paid for by every stream of the context together (it serves them
    /// all, and its proving queue serves the stream that completes the price), and a queue by its own stream's
    /// launches, counted from its first one: a stream that ran on libcuda while the context was being paid for
    /// has paid that much towards its queue already.
    pub(crate) fn earned(&mut self, ctx: usize, key: StreamKey, needs: Needs) -> bool {
        let threshold = self.threshold_in(ctx, needs);
        if threshold == 0 {
            return true;
        }
        if self.paid_towards(ctx, key, needs) >= threshold {
            return true;
        }
        self.add_launches(ctx, key, needs, 1);
        false
    }

    /// Whether stream `key`'s launches pay towards a takeover that `needs` this together with the other streams of
    /// its context (an attach with `earned`: it serves them all) rather than alone.
    fn shared(&self, needs: Needs) -> bool {
        self.policy == Policy::Earned && needs == Needs::Attach
    }

    /// What stream `key` of context `ctx` has paid so far towards a takeover that `needs` this.
    fn paid_towards(&self, ctx: usize, key: StreamKey, needs: Needs) -> u64 {
        if self.shared(needs) {
            self.context_counts.get(&ctx).copied().unwrap_or(0)
        } else {
            self.counts.get(&(ctx, key)).copied().unwrap_or(0)
        }
    }

    /// Counts `n` launches of stream `key` of context `ctx` on libcuda: towards its own queue, and towards the
    /// context's attach where that is shared. The tables are bounded by [`MAX_COUNTED`].
    fn add_launches(&mut self, ctx: usize, key: StreamKey, needs: Needs, n: u64) {
        if self.counts.len() >= MAX_COUNTED && !self.counts.contains_key(&(ctx, key)) {
            self.counts.clear();
        }
        *self.counts.entry((ctx, key)).or_insert(0) += n;
        if self.shared(needs) {
            if self.context_counts.len() >= MAX_COUNTED && !self.context_counts.contains_key(&ctx) {
                self.context_counts.clear();
            }
            *self.context_counts.entry(ctx).or_insert(0) += n;
        }
    }

    /// The launches on libcuda stream `key` of context `ctx` (not attached) still has to make before its takeover
    /// is paid for: the context's shared count with `earned`, the stream's own with a number.
    pub(crate) fn left_to_attach(&self, ctx: usize, key: StreamKey) -> u64 {
        self.threshold_in(ctx, Needs::Attach)
            .saturating_sub(self.paid_towards(ctx, key, Needs::Attach))
    }

    /// `n` launches on stream `key` of context `ctx` (not attached) went to libcuda without being asked about one
    /// by one ([`crate::engine`]'s forwarding credit): counted as [`Takeover::earned`] counts each.
    pub(crate) fn paid(&mut self, ctx: usize, key: StreamKey, n: u64) {
        self.add_launches(ctx, key, Needs::Attach, n);
    }

    /// Stream `key` of context `ctx` was taken over: its count goes.
    pub(crate) fn taken(&mut self, ctx: usize, key: StreamKey) {
        self.counts.remove(&(ctx, key));
    }

    /// Context `ctx` was attached: what its streams paid together goes (each stream's own count stays, towards its
    /// queue).
    pub(crate) fn attached(&mut self, ctx: usize) {
        self.context_counts.remove(&ctx);
    }

    /// The launches stream `key` of context `ctx` has made on libcuda so far (0 once taken over).
    #[cfg(test)]
    pub(crate) fn count(&self, ctx: usize, key: StreamKey) -> u64 {
        self.counts.get(&(ctx, key)).copied().unwrap_or(0)
    }

    /// The prices of an attach and of a queue, in nanoseconds.
    #[cfg(test)]
    pub(crate) fn prices(&self) -> (u64, u64) {
        (self.attach_ns, self.queue_ns)
    }

    /// A stream was destroyed: a later stream with its handle starts from nothing. Whether it was counted (a
    /// stream that went without being taken over).
    pub(crate) fn forget_stream(&mut self, key: StreamKey) -> bool {
        let before = self.counts.len();
        self.counts.retain(|(_, k), _| *k != key);
        self.counts.len() != before
    }

    /// Context `ctx` ends: its streams' counts go with it (a later context with its handle starts from nothing).
    pub(crate) fn forget_context(&mut self, ctx: usize) {
        self.counts.retain(|(c, _), _| *c != ctx);
        self.context_counts.remove(&ctx);
        self.owed.retain(|(c, _), _| *c != ctx);
        self.owed_ns.remove(&ctx);
    }

    /// Streams counted and not taken over (yet).
    pub(crate) fn counted(&self) -> u64 {
        self.counts.len() as u64
    }

    /// An attach (with its proving queue) took `took`: later prices follow it.
    pub(crate) fn attach_took(&mut self, took: Duration) {
        self.attach_ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.paid_ns = self.paid_ns.saturating_add(self.attach_ns);
    }

    /// A queue build took `took`: later prices follow it.
    pub(crate) fn queue_took(&mut self, took: Duration) {
        self.queue_ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: usize = 0xc0;

    #[test]
    fn the_policy_is_read_from_its_variable() {
        assert_eq!(Policy::by(None), Ok(Policy::Earned));
        assert_eq!(Policy::by(Some("earned")), Ok(Policy::Earned));
        assert_eq!(Policy::by(Some("first")), Ok(Policy::First));
        assert_eq!(Policy::by(Some("0")), Ok(Policy::First));
        assert_eq!(Policy::by(Some(" 250 ")), Ok(Policy::After(250)));
        let e = Policy::by(Some("soon")).unwrap_err();
        assert!(e.contains("\"soon\"") && e.contains("earned"), "{e}");
        assert_eq!(Policy::Earned.label(), "earned");
        assert_eq!(Policy::After(7).label(), "after 7 launches");
    }

    #[test]
    fn a_stream_is_taken_over_once_its_launches_have_paid_for_the_attach() {
        let mut t = Takeover::new(Policy::Earned);
        let n = t.threshold(Needs::Attach);
        assert_eq!(n, ATTACH_NS.div_ceil(SAVED_PER_LAUNCH_NS));
        let s = StreamKey::Handle(0x5000);
        for i in 0..n {
            assert!(
                !t.earned(CTX, s, Needs::Attach),
                "launch {i} stays on libcuda"
            );
        }
        assert_eq!(t.count(CTX, s), n);
        assert!(t.earned(CTX, s, Needs::Attach));
        assert!(
            t.earned(CTX, s, Needs::Attach),
            "paid: a takeover postponed (set-up in the background) does not make it pay again"
        );
        assert_eq!(t.count(CTX, s), n);
        t.attached(CTX);
        t.taken(CTX, s);
        assert_eq!(
            t.count(CTX, s),
            0,
            "the count goes once the stream is taken over"
        );
    }

    #[test]
    fn an_attach_is_paid_for_by_every_stream_of_the_context_and_a_queue_by_its_own() {
        let mut t = Takeover::new(Policy::Earned);
        t.attach_took(Duration::from_micros(3_000));
        t.queue_took(Duration::from_micros(1_500));
        let (a, b, c) = (
            StreamKey::Handle(1),
            StreamKey::Handle(2),
            StreamKey::Handle(3),
        );
        // Three streams launching in turn: 1000 launches of the context pay for the attach (334 of a's).
        let mut taken = None;
        'launches: for i in 0.. {
            for s in [a, b, c] {
                if t.earned(CTX, s, Needs::Attach) {
                    taken = Some((i, s));
                    break 'launches;
                }
            }
        }
        assert_eq!(
            taken,
            Some((333, b)),
            "the 1001st launch of the context, b's 334th"
        );
        t.attached(CTX);
        t.taken(CTX, b);
        // The others have paid 333 or 334 launches towards their own queues (500 each): 167 or 166 more.
        assert_eq!(t.count(CTX, a), 334);
        assert_eq!(t.count(CTX, c), 333);
        let more = |t: &mut Takeover, s| {
            (0..)
                .take_while(|_| !t.earned(CTX, s, Needs::Queue))
                .count()
        };
        assert_eq!(more(&mut t, a), 166);
        assert_eq!(more(&mut t, c), 167);
        // Another context pays for its own attach.
        assert!(!t.earned(CTX + 1, a, Needs::Attach));
    }

    #[test]
    fn a_ready_queue_costs_nothing_and_a_new_one_costs_less_than_an_attach() {
        let mut t = Takeover::new(Policy::Earned);
        assert!(t.earned(CTX, StreamKey::Legacy, Needs::Nothing));
        assert!(t.threshold(Needs::Queue) < t.threshold(Needs::Attach));
        assert!(t.threshold(Needs::Queue) > 0);
    }

    #[test]
    fn prices_follow_what_this_process_measured() {
        let mut t = Takeover::new(Policy::Earned);
        t.attach_took(Duration::from_millis(3));
        t.queue_took(Duration::from_micros(600));
        assert_eq!(t.threshold(Needs::Attach), 1000);
        assert_eq!(t.threshold(Needs::Queue), 200);
        // A stream counted against the old price keeps its count: it is taken over as soon as the new one is met.
        let s = StreamKey::Handle(0x10);
        for _ in 0..200 {
            assert!(!t.earned(CTX, s, Needs::Queue));
        }
        assert!(t.earned(CTX, s, Needs::Queue));
    }

    #[test]
    fn streams_are_counted_apart_per_context_and_forgotten_when_destroyed() {
        let mut t = Takeover::new(Policy::After(2));
        let (a, b) = (StreamKey::Handle(1), StreamKey::Handle(2));
        assert!(!t.earned(CTX, a, Needs::Queue));
        assert!(!t.earned(CTX, b, Needs::Queue));
        assert!(!t.earned(CTX + 1, a, Needs::Queue));
        assert!(!t.earned(CTX, a, Needs::Queue));
        assert!(t.earned(CTX, a, Needs::Queue), "the third launch of a");
        t.taken(CTX, a);
        assert_eq!(t.count(CTX, b), 1);
        assert_eq!(t.counted(), 2, "a was taken over");
        assert!(t.forget_stream(b));
        assert!(!t.forget_stream(b), "forgotten already");
        assert_eq!(t.count(CTX, b), 0);
        assert_eq!(
            t.count(CTX + 1, a),
            1,
            "the same handle in another context is another stream"
        );
    }

    #[test]
    fn first_takes_every_stream_at_once_and_a_number_is_exact() {
        let mut t = Takeover::new(Policy::First);
        assert!(t.earned(CTX, StreamKey::Legacy, Needs::Attach));
        let mut t = Takeover::new(Policy::After(3));
        let s = StreamKey::Legacy;
        assert_eq!(
            (0..4)
                .map(|_| t.earned(CTX, s, Needs::Attach))
                .collect::<Vec<_>>(),
            [false, false, false, true]
        );
    }

    #[test]
    fn a_takeover_also_pays_for_the_modules_its_kernels_need() {
        let mut t = Takeover::new(Policy::Earned);
        t.attach_took(Duration::from_millis(3));
        let base = t.threshold(Needs::Attach);
        assert_eq!(base, 1000);
        // Before any load was timed: the prior, 4 ns per image byte.
        assert_eq!(t.module_estimate(1_000_000), 4_000_000);
        t.owe_module(CTX, 0xa, 1_000_000);
        t.owe_module(CTX, 0xa, 1_000_000);
        assert!(t.owes(CTX, 0xa));
        assert_eq!(
            t.threshold_in(CTX, Needs::Attach),
            base + 1334,
            "one module of 4 ms (1334 launches at 3 µs saved each), owed once however often its kernels launch"
        );
        assert_eq!(
            t.threshold_in(CTX + 1, Needs::Attach),
            base,
            "another context owes nothing"
        );
        let s = StreamKey::Handle(7);
        let launches = (0..)
            .take_while(|_| !t.earned(CTX, s, Needs::Attach))
            .count();
        assert_eq!(launches, 2334);
        // Loaded: no later takeover pays for it.
        t.module_loaded(CTX, 0xa);
        assert!(!t.owes(CTX, 0xa));
        assert_eq!(t.threshold_in(CTX, Needs::Queue), t.threshold(Needs::Queue));
        // Loads timed in this process replace the prior: 2 ns per byte measured over 10 MiB.
        t.module_took(10 << 20, Duration::from_nanos(2 * (10 << 20)));
        let est = t.module_estimate(1 << 20);
        assert!((2 << 20..3 << 20).contains(&est), "{est} ns for 1 MiB");
        // Other policies never price modules.
        let mut f = Takeover::new(Policy::After(3));
        f.owe_module(CTX, 0xa, 1 << 30);
        assert_eq!(f.threshold_in(CTX, Needs::Attach), 3);
    }

    #[test]
    fn advice_from_earlier_runs_pays_for_an_attach_at_once_and_a_run_records_its_price() {
        use crate::history::Price;
        let mut t = Takeover::new(Policy::Earned);
        t.owe_module(CTX, 0xa, 4 << 20);
        assert_eq!(
            t.run_price(),
            Price::Estimated(ATTACH_NS + t.owed_total_ns()),
            "not taken over: the estimate"
        );
        assert_eq!(t.timed_saving(), None);
        t.advise();
        assert!(t.advised());
        assert_eq!(t.threshold_in(CTX, Needs::Attach), 0);
        assert!(t.earned(CTX, StreamKey::Legacy, Needs::Attach));
        assert_eq!(
            t.threshold_in(CTX, Needs::Queue),
            t.threshold(Needs::Queue) + t.owed_total_ns().div_ceil(SAVED_PER_LAUNCH_NS),
            "a further stream's queue (and the modules owed) is still paid for by its launches"
        );
        assert!(t.threshold(Needs::Queue) > 0);
        t.attach_took(Duration::from_millis(9));
        t.module_took(1 << 20, Duration::from_millis(2));
        assert_eq!(t.run_price(), Price::Paid(11_000_000));
        t.libcuda_launch_took(4_400);
        assert_eq!(t.timed_saving(), Some(4_000));
        // Only `earned` takes advice.
        let mut first = Takeover::new(Policy::After(50));
        first.advise();
        assert!(!first.advised());
        assert_eq!(first.threshold_in(CTX, Needs::Attach), 50);
    }

    #[test]
    fn the_table_of_counted_streams_is_bounded() {
        let mut t = Takeover::new(Policy::Earned);
        for h in 0..(MAX_COUNTED * 3) {
            assert!(!t.earned(CTX, StreamKey::Handle(h), Needs::Queue));
        }
        assert!(t.counts.len() <= MAX_COUNTED);
    }

    #[test]
    fn the_saving_per_launch_follows_libcudas_timed_launches() {
        let mut t = Takeover::new(Policy::Earned);
        assert_eq!(
            t.threshold(Needs::Attach),
            ATTACH_NS.div_ceil(SAVED_PER_LAUNCH_NS),
            "nothing timed: the prior"
        );
        // libcuda's launches cost 6.4 µs here: each through APEX saves 6 µs.
        t.libcuda_launch_took(6_400);
        assert_eq!(t.threshold(Needs::Attach), ATTACH_NS.div_ceil(6_000));
        t.owe_module(CTX, 7, 1 << 20);
        let owed = t.owed_total_ns();
        assert_eq!(
            t.threshold_in(CTX, Needs::Attach),
            ATTACH_NS.div_ceil(6_000) + owed.div_ceil(6_000)
        );
        // A libcuda faster than the hook's own launch: never divided by less than the floor.
        t.libcuda_launch_took(300);
        assert_eq!(t.threshold(Needs::Queue), QUEUE_NS.div_ceil(MIN_SAVED_NS));
        // One that blocks for room in libcuda's queue: no more than the ceiling.
        t.libcuda_launch_took(200_000);
        assert_eq!(t.threshold(Needs::Queue), QUEUE_NS.div_ceil(MAX_SAVED_NS));
        t.libcuda_launch_took(0);
        assert_eq!(
            t.threshold(Needs::Queue),
            QUEUE_NS.div_ceil(SAVED_PER_LAUNCH_NS)
        );
        // Other policies never price.
        let mut first = Takeover::new(Policy::First);
        first.libcuda_launch_took(10_000);
        assert_eq!(first.threshold(Needs::Attach), 0);
    }
}
