//! When streams are taken over (`APEX_PRELOAD_TAKEOVER`, [`crate::takeover`]) against the simulated GPU: a stream's
//! launches go to libcuda (counted as warm-up, ordered as any forwarded launch, nothing of APEX's set up) until they
//! have paid for its takeover; then it is taken over, its first APEX launch waiting for what libcuda ran on it.

use super::*;

const SITE_A: usize = 0x5000;
const SITE_B: usize = 0x6000;

#[test]
fn a_stream_goes_to_libcuda_until_its_count_is_met_and_then_through_apex_in_order() {
    let mut s = Setup::with_takeover(Policy::After(5));
    for i in 0..5 {
        assert!(!s.hook_launch(0), "launch {i} goes to libcuda");
    }
    assert!(
        s.engine.contexts.is_empty(),
        "nothing of APEX's is set up before the takeover is earned"
    );
    let sum = s.engine.summary();
    assert_eq!(
        (sum.launches, sum.apex, sum.fallback, sum.warmup),
        (5, 0, 0, 5)
    );
    assert!(
        sum.reasons.is_empty(),
        "launches before the takeover are not refusals"
    );
    assert_eq!(sum.setup.takeover, "after 5 launches");
    assert_eq!(sum.setup.streams_not_earned, 1);
    s.calls();
    assert!(s.hook_launch(0), "the sixth launch is APEX's");
    assert_eq!(
        s.calls(),
        vec!["apex<-cuda Legacy"],
        "the queue's first launch waits for what libcuda ran on the stream"
    );
    assert!(s.hook_launch(0));
    assert!(s.calls().is_empty(), "then no hop");
    let sum = s.engine.summary();
    assert_eq!(
        (sum.launches, sum.apex, sum.warmup, sum.setup.attach.count),
        (7, 2, 5, 1)
    );
    assert_eq!(sum.setup.streams_not_earned, 0);
}

#[test]
fn the_default_policy_prices_the_attach_then_each_queue_by_what_it_took() {
    let mut s = Setup::with_takeover(Policy::Earned);
    let attach = s.engine.takeover.threshold(Needs::Attach);
    assert!(
        attach > 100,
        "an attach costs milliseconds: {attach} launches"
    );
    assert!(!s.hook_launch(0));
    // The kernel's module, which the takeover loads, is priced at its first launch.
    let first = s.engine.takeover.threshold_in(CTX, Needs::Attach);
    assert!(first > attach, "the module is priced: {first} launches");
    for _ in 1..first {
        assert!(!s.hook_launch(0));
    }
    assert!(
        s.hook_launch(0),
        "taken over once the attach and the module are paid for"
    );
    assert_eq!(
        s.engine.takeover.threshold_in(CTX, Needs::Queue),
        s.engine.takeover.threshold(Needs::Queue),
        "the module is loaded: no later takeover pays for it"
    );
    // The attach was timed: the next attach's price is what this one took.
    let took_ns = s.engine.summary().setup.attach.max_ms * 1e6;
    let (attach_ns, queue_ns) = s.engine.takeover.prices();
    assert!(
        (attach_ns as f64 - took_ns).abs() < 500_000.0,
        "priced {attach_ns} ns, took {took_ns} ns"
    );
    // A second stream needs a queue of its own; no queue was built yet in this process, so the default price holds.
    let second = s.engine.takeover.threshold(Needs::Queue);
    assert!(second > 0);
    for _ in 0..second {
        assert!(
            !s.hook_launch(SITE_A),
            "the second stream pays for its queue first"
        );
    }
    assert!(s.hook_launch(SITE_A));
    assert!(s.hook_launch(0), "the first stream stays taken over");
    let built = s.engine.summary().setup.queue;
    assert_eq!(built.count, 2, "the kept queue and one built");
    // Priced by the build just made now.
    let (_, rebuilt_ns) = s.engine.takeover.prices();
    assert_ne!(rebuilt_ns, queue_ns, "the queue's price follows the build");
    assert!((rebuilt_ns as f64 - built.max_ms * 1e6).abs() < 500_000.0);
    let third = s.engine.takeover.threshold(Needs::Queue);
    for _ in 0..third {
        assert!(!s.hook_launch(SITE_B));
    }
    assert!(s.hook_launch(SITE_B));
    let sum = s.engine.summary();
    assert_eq!(sum.warmup, first + second + third);
    assert_eq!(sum.apex, 4);
    assert_eq!(sum.setup.takeover, "earned");
}

#[test]
fn a_stream_destroyed_before_its_takeover_is_counted_and_its_handle_starts_again() {
    let mut s = Setup::with_takeover(Policy::After(3));
    for _ in 0..3 {
        assert!(!s.hook_launch(SITE_A));
    }
    s.engine.stream_destroyed(SITE_A);
    assert_eq!(s.engine.summary().setup.streams_not_earned, 1);
    for _ in 0..3 {
        assert!(
            !s.hook_launch(SITE_A),
            "a new stream with the same handle counts from nothing"
        );
    }
    assert!(s.hook_launch(SITE_A));
    assert_eq!(s.engine.summary().setup.streams_not_earned, 1);
}

#[test]
fn a_context_that_cannot_be_attached_counts_refusals_not_warm_up() {
    let mut s = Setup::build(
        false,
        Mode::Inline,
        Some("no channel group"),
        Policy::After(2),
    );
    assert!(!s.hook_launch(0));
    assert!(!s.hook_launch(0));
    assert!(!s.hook_launch(0), "the attach is tried here and fails");
    assert!(!s.hook_launch(0));
    let sum = s.engine.summary();
    assert_eq!((sum.warmup, sum.fallback), (2, 2));
    assert_eq!(sum.setup.attach.count, 1, "tried once");
}

/// With the set-up in the background, a stream that has paid is not made to pay again while its attach, module
/// and queue are being made: it is taken over at its first launch once they are ready. The worker's timings price
/// later takeovers.
#[test]
fn a_paid_stream_waits_for_the_background_set_up_without_paying_again() {
    let mut s = Setup::build(false, Mode::Background, None, Policy::After(3));
    for i in 0..3 {
        assert!(!s.hook_launch(0), "launch {i}: not paid yet");
    }
    assert!(s.engine.contexts.is_empty());
    let mut taken_at = None;
    for i in 3..12 {
        if s.hook_launch(0) {
            taken_at = Some(i);
            break;
        }
        // The attach, then the module, each made by the worker.
        s.settle();
    }
    let taken_at = taken_at.expect("taken over once the set-up is ready");
    assert!(
        taken_at <= 6,
        "taken at launch {taken_at}: the stream paid once (3 launches), then waited only for the set-up"
    );
    assert_eq!(s.engine.takeover.count(CTX, StreamKey::Legacy), 0);
    let sum = s.engine.summary();
    assert_eq!(sum.setup.streams_not_earned, 0, "{:?}", sum.setup);
    // The background attach priced the next one.
    let (attach_ns, _) = s.engine.takeover.prices();
    let took_ns = sum.setup.attach.max_ms * 1e6;
    assert!(
        (attach_ns as f64 - took_ns).abs() < 500_000.0,
        "priced {attach_ns} ns, took {took_ns} ns"
    );
}

/// A stream that takes a queue built already pays nothing and keeps no count.
#[test]
fn a_stream_taking_a_built_queue_keeps_no_count() {
    let mut s = Setup::with_takeover(Policy::Earned);
    assert!(!s.hook_launch(SITE_A));
    let first = s.engine.takeover.threshold_in(CTX, Needs::Attach);
    for _ in 1..first {
        assert!(!s.hook_launch(SITE_A));
    }
    assert!(
        s.hook_launch(SITE_A),
        "paid for the attach and the module; takes the kept queue"
    );
    assert_eq!(s.engine.takeover.count(CTX, StreamKey::Handle(SITE_A)), 0);
    // A second stream starts paying for a queue of its own...
    assert!(!s.hook_launch(SITE_B));
    assert!(!s.hook_launch(SITE_B));
    assert_eq!(s.engine.takeover.count(CTX, StreamKey::Handle(SITE_B)), 2);
    // ...until the first stream is destroyed: its queue is kept for the next stream, which takes it at once and
    // keeps no count (it is not a stream left on libcuda).
    s.engine.stream_destroyed(SITE_A);
    assert!(s.hook_launch(SITE_B), "takes the destroyed stream's queue");
    assert_eq!(s.engine.takeover.count(CTX, StreamKey::Handle(SITE_B)), 0);
    assert_eq!(s.engine.summary().setup.streams_not_earned, 0);
}

/// A stream whose kernels APEX refuses (NCCL's) is never taken over: a refused function's launch neither takes its
/// stream (no queue built for it, no ordering against one) nor, once refused, counts towards the stream's takeover.
#[test]
fn a_refused_kernel_neither_takes_its_stream_over_nor_pays_for_it() {
    // Every stream at its first launch: a refused one would have taken its stream before this change.
    let mut s = Setup::with_takeover(Policy::After(0));
    assert!(s.hook_launch(0), "attached, the legacy stream taken over");
    let queues = s.engine.summary().queues;
    const REFUSED: usize = 0xbad;
    s.engine.func_attribute(REFUSED, 99);
    let refused = Launch {
        f: REFUSED,
        stream: SITE_A,
        ..bare_launch()
    };
    for _ in 0..3 {
        assert!(s.engine.launch(&refused, 0).is_none());
    }
    assert!(
        s.engine.contexts[0]
            .order
            .find(StreamKey::Handle(SITE_A))
            .is_none(),
        "the stream is not taken over"
    );
    let sum = s.engine.summary();
    assert_eq!(sum.queues, queues, "no queue built for it");
    assert_eq!(sum.reasons["function_attribute"].launches, 3);
    assert_eq!(sum.setup.streams_not_earned, 0);

    // With a price on queues, a function is resolved once its stream has paid: refused then, it takes no queue,
    // and its later launches count as refusals, not towards the stream's takeover.
    let mut s = Setup::with_takeover(Policy::After(4));
    for _ in 0..4 {
        assert!(!s.hook_launch(0));
    }
    assert!(s.hook_launch(0), "the legacy stream paid and is taken over");
    let queues = s.engine.summary().queues;
    s.engine.func_attribute(REFUSED, 99);
    for _ in 0..10 {
        assert!(s.engine.launch(&refused, 0).is_none());
    }
    assert_eq!(
        s.engine.takeover.count(CTX, StreamKey::Handle(SITE_A)),
        4,
        "the launches before the function was resolved paid; none after"
    );
    let sum = s.engine.summary();
    assert_eq!(sum.queues, queues, "no queue built for the stream");
    assert_eq!(sum.reasons["function_attribute"].launches, 6);
    assert_eq!((sum.warmup, sum.apex), (4 + 4, 1));
    // Known to be refused, the function pays nothing on another stream either.
    let elsewhere = Launch {
        stream: SITE_B,
        ..refused
    };
    for _ in 0..5 {
        assert!(s.engine.launch(&elsewhere, 0).is_none());
    }
    assert_eq!(s.engine.takeover.count(CTX, StreamKey::Handle(SITE_B)), 0);
    assert_eq!(
        s.engine.summary().reasons["function_attribute"].launches,
        11
    );
}

/// Before anything is attached, the engine lets the hooks forward a stream's launches on a credit ([`super::fast`]):
/// the launches spent on it count towards the takeover exactly as if each had reached the engine, and the launch that
/// completes the price reaches the engine, which takes the stream over then.
#[test]
fn launches_forwarded_on_the_credit_pay_for_the_takeover_as_if_counted_one_by_one() {
    let mut s = Setup::with_takeover(Policy::Earned);
    assert!(!s.hook_launch(0));
    let price = s.engine.takeover.threshold_in(CTX, Needs::Attach);
    let mut through_engine = 1;
    let mut spent = 0;
    let taken = loop {
        // What the hooks do: spend the credit while there is some...
        while s.engine.fast.spend(FUNC, 0, false) {
            spent += 1;
        }
        // ...then ask the engine.
        through_engine += 1;
        if s.hook_launch(0) {
            break through_engine + spent;
        }
        assert!(
            through_engine < 100,
            "the credit covers almost every launch"
        );
    };
    assert_eq!(
        taken,
        price + 1,
        "taken over at the launch after the price, as without the credit"
    );
    assert!(
        spent > price / 2,
        "{spent} of {price} launches forwarded on the credit"
    );
    let sum = s.engine.summary();
    assert_eq!((sum.launches, sum.warmup, sum.apex), (price + 1, price, 1));
    // Attached: a launch forwarded now (on another stream, still paying for its queue) gets no credit.
    assert!(!s.hook_launch(SITE_A));
    assert!(s.engine.grant.is_none(), "no credit once attached");
    // Another function, or another stream, is not covered by a grant for this one.
    let mut s = Setup::with_takeover(Policy::Earned);
    assert!(!s.hook_launch(0));
    assert!(s.engine.fast.spend(FUNC, 0, false));
    assert!(!s.engine.fast.spend(FUNC + 0x10, 0, false));
    assert!(!s.engine.fast.spend(FUNC, SITE_A, false));
    // Spent launches show in a summary written before the engine settles them.
    assert_eq!(s.engine.summary().warmup, 2);
    // A destroyed stream settles its grant first: what it paid is counted, then forgotten with it.
    s.engine.stream_destroyed(0);
    assert_eq!(s.engine.summary().warmup, 2);
    assert!(!s.engine.fast.spend(FUNC, 0, false));
}

/// Launches the engine would refuse (a capture began, the stack limit raised) are not forwarded on a credit granted
/// before, where they would count as paying towards a takeover.
#[test]
fn a_capture_or_a_raised_stack_ends_the_credit() {
    let mut s = Setup::with_takeover(Policy::Earned);
    assert!(!s.hook_launch(0));
    assert!(s.engine.fast.spend(FUNC, 0, false));
    s.engine.capture(0, false, true);
    assert!(!s.engine.fast.spend(FUNC, 0, false), "capturing");
    assert_eq!(
        s.engine.summary().warmup,
        2,
        "the launch spent before counts"
    );
    s.engine.capture(0, false, false);
    assert!(!s.hook_launch(0));
    assert!(
        s.engine.fast.spend(FUNC, 0, false),
        "granted again after the capture"
    );
    s.engine.raise_stack();
    assert!(
        !s.engine.fast.spend(FUNC, 0, false),
        "the stack limit raised"
    );
}

/// An unloaded module is no longer part of any takeover's price.
#[test]
fn an_unloaded_module_is_no_longer_owed() {
    let mut s = Setup::with_takeover(Policy::Earned);
    let base = s.engine.takeover.threshold(Needs::Attach);
    assert!(!s.hook_launch(0));
    assert!(s.engine.takeover.threshold_in(CTX, Needs::Attach) > base);
    assert!(
        s.engine.summary().setup.modules_owed_ms > 0.0,
        "the summary says what the takeover would load"
    );
    s.engine.unloaded(MODULE);
    assert_eq!(s.engine.takeover.threshold_in(CTX, Needs::Attach), base);
    assert_eq!(s.engine.summary().setup.modules_owed_ms, 0.0);
}

/// At exit a run leaves its record: the launches a takeover could serve (refused ones left out), the price it paid
/// (the attach and the module load, as timed), and a process that made no launch leaves none.
/// The next run of the program is advised by it.
#[test]
fn a_run_records_its_servable_launches_and_its_paid_price_at_exit() {
    use crate::history::History;
    let dir = std::env::temp_dir().join(format!("apex-engine-history-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let open = || History::at(Some(dir.clone()), "/bin/prog".into(), b"prog\0");
    // A process that made no launch (a launcher) leaves nothing.
    let mut idle = Setup::with_takeover(Policy::Earned);
    idle.engine.history = open();
    idle.engine.shutdown("the program exits");
    idle.engine.record_run();
    assert!(open().previous().is_none(), "no launch: no record");
    let mut s = Setup::with_takeover(Policy::After(3));
    s.engine.history = open();
    for _ in 0..10 {
        s.hook_launch(0);
    }
    // A launch of a refused function pays for nothing and is not counted.
    let f = bare_launch().f;
    s.engine.contexts[0]
        .funcs
        .insert(f, FuncState::Refused(Refusal::ModuleGlobals("v".into())));
    assert!(!s.hook_launch(0));
    let sum = s.engine.summary();
    assert_eq!((sum.apex, sum.warmup, sum.fallback), (7, 3, 1), "{sum:?}");
    s.engine.shutdown("the program exits");
    s.engine.record_run();
    let r = open().previous().cloned().expect("a record");
    assert_eq!(
        r.launches,
        vec![10],
        "launches through APEX and before the takeover, not the refused one"
    );
    let sum = s.engine.summary();
    let timed = (sum.setup.attach.total_ms + sum.setup.module.total_ms) * 1e6;
    assert!(
        r.price_ns > 0 && (r.price_ns as f64 - timed).abs() <= 10_000.0, // the same durations, summed as ms
        "the price paid is what the attach and the load took (CUDA's own loading, none here, left out): {r:?}, \
         {timed} ns timed"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
