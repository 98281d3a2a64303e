//! The background set-up (`APEX_PRELOAD_SETUP=background`, the default) against the simulated GPU: launches made
//! while the attach, a stream's queue or a module is being prepared go to libcuda (counted as warm-up, ordered as
//! any forwarded launch), the launch after the piece is picked up goes through APEX, and what is set up for
//! something gone (a destroyed stream, an unloaded module, the end) is recycled or dropped.
//!
//! The engine picks finished pieces up only at a launch, so each test decides when that happens: it waits for the
//! worker to be idle ([`Setup::settle`]) and then launches.

use std::time::Instant;

use super::*;

const SITE_A: usize = 0x5000;
const SITE_B: usize = 0x6000;
const SITE_C: usize = 0x7000;

impl Setup {
    /// Waits until the set-up worker has finished everything asked of it (not picked up yet).
    pub(super) fn settle(&self) {
        assert!(
            self.engine.setup.wait_idle(Duration::from_secs(30)),
            "the set-up worker did not finish"
        );
    }

    /// A launch as the hook makes it: through APEX (`true`), or forwarded to libcuda with the ordering a forwarded
    /// launch gets (`false`).
    pub(super) fn hook_launch(&mut self, stream: usize) -> bool {
        if self.launch_on(stream, 1) {
            return true;
        }
        let site = Site::Stream(stream, false);
        let o = self.engine.before(site);
        self.engine.after(site, o, false);
        false
    }

    /// Runs the set-up a launch on `stream` needs to its end: the attach, the module, the stream's queue.
    fn warm_up(&mut self, stream: usize) {
        for _ in 0..4 {
            if self.hook_launch(stream) {
                return;
            }
            self.settle();
        }
        panic!("still not taken over after the set-up");
    }
}

#[test]
fn launches_go_to_libcuda_while_apex_sets_up_and_through_apex_once_it_is_ready() {
    let mut s = Setup::background(None);
    s.gate.close();
    for _ in 0..3 {
        assert!(!s.hook_launch(0), "forwarded while the attach is in flight");
    }
    let sum = s.engine.summary();
    assert_eq!(
        (sum.launches, sum.apex, sum.fallback, sum.warmup),
        (3, 0, 0, 3)
    );
    assert!(sum.reasons.is_empty(), "warm-up launches are not refusals");
    assert_eq!(sum.setup.mode, "background");
    assert!(s.engine.contexts.is_empty());
    s.gate.open();
    s.settle();
    // The attach is picked up (with the GPU's first queue, which the legacy stream takes); the module is asked for.
    assert!(!s.hook_launch(0), "forwarded while the module loads");
    assert!(
        s.engine.contexts[0].order.find(StreamKey::Legacy).is_some(),
        "the stream took the attach's first queue"
    );
    s.settle();
    s.calls();
    assert!(s.hook_launch(0), "through APEX once the module is there");
    assert_eq!(
        s.calls(),
        vec!["apex<-cuda Legacy"],
        "the queue's first launch waits for what libcuda ran before it"
    );
    assert!(s.hook_launch(0));
    assert!(s.calls().is_empty(), "back-to-back launches make no hop");
    let sum = s.engine.summary();
    assert_eq!(
        (sum.launches, sum.apex, sum.fallback, sum.warmup),
        (6, 2, 0, 4)
    );
    assert_eq!(
        (
            sum.setup.attach.count,
            sum.setup.module.count,
            sum.setup.failed,
            sum.setup.dropped
        ),
        (1, 1, 0, 0)
    );
    assert!(sum.setup.attach.total_ms > 0.0 && sum.setup.attach.max_ms > 0.0);
    assert_eq!(sum.contexts, vec!["direct".to_string()]);
    // The worker made the program's context current for each piece, and none after it.
    let made = s.made_current.lock().unwrap().clone();
    assert!(
        made.iter().all(|(thread, _)| thread == "apex-setup"),
        "{made:?}"
    );
    assert_eq!(made.first().map(|m| m.1), Some(Some(CTX)));
    assert_eq!(made.last().map(|m| m.1), Some(None));
}

#[test]
fn a_spare_queue_is_kept_ready_so_a_new_stream_is_taken_over_at_its_first_launch() {
    let mut s = Setup::background(None);
    s.warm_up(0);
    s.settle();
    assert!(
        s.hook_launch(0),
        "picks the spare built after the first queue was taken"
    );
    assert_eq!(s.engine.contexts[0].spare.len(), 1);
    let before = s.engine.summary();
    assert!(
        s.hook_launch(SITE_A),
        "a new stream takes the spare at its first launch"
    );
    s.settle();
    assert!(s.hook_launch(SITE_A));
    assert_eq!(
        s.engine.contexts[0].spare.len(),
        1,
        "and another is built for the next"
    );
    let sum = s.engine.summary();
    assert_eq!(sum.warmup, before.warmup, "no launch waited for a queue");
    assert_eq!(
        sum.queues, 3,
        "the first queue, then one ahead each time one was taken"
    );
    assert_eq!(sum.setup.queue.count, 2, "the first came with the attach");
}

/// By default (`APEX_PRELOAD_QUEUES_AHEAD` 0) no queue is built before a stream asks for one: a queue's GPU memory
/// (its local memory alone is sized for every thread the GPU can hold) is not spent on a stream that may never come.
#[test]
fn by_default_no_queue_is_built_ahead_of_a_stream() {
    let mut s = Setup::background(None);
    s.engine.config.queues_ahead = 0;
    s.warm_up(0);
    s.settle();
    assert!(s.hook_launch(0));
    let ctx = &s.engine.contexts[0];
    assert_eq!(
        (ctx.spare.len(), ctx.building),
        (0, 0),
        "nothing built ahead"
    );
    // A new stream asks for its queue at its first launch (forwarded meanwhile) and is taken over once it is built.
    assert!(!s.hook_launch(SITE_A));
    assert_eq!(s.engine.contexts[0].building, 1, "only the one asked for");
    s.settle();
    assert!(s.hook_launch(SITE_A));
    let ctx = &s.engine.contexts[0];
    assert_eq!((ctx.spare.len(), ctx.building), (0, 0));
    assert_eq!(
        s.engine.summary().queues,
        2,
        "the attach's first queue, and A's"
    );
}

#[test]
fn once_set_up_a_launch_allocates_nothing() {
    let mut s = Setup::background(None);
    s.warm_up(0);
    s.settle();
    // Picks the spare queue up (its vector may grow).
    assert!(s.hook_launch(0));
    let mut params = s.params;
    let mut ptrs: [*mut c_void; 4] = params.each_mut().map(|p| (p as *mut u64).cast());
    let l = Launch {
        params: ptrs.as_mut_ptr(),
        ..bare_launch()
    };
    assert!(s.engine.launch(&l, 0).is_some());
    let before = allocations();
    for _ in 0..100 {
        assert!(s.engine.launch(&l, 0).is_some());
    }
    assert_eq!(allocations() - before, 0, "allocations in 100 launches");
}

#[test]
fn the_inline_mode_sets_up_at_the_first_launch_and_starts_no_worker() {
    let mut s = Setup::new();
    assert!(s.launch(), "the first launch goes through APEX");
    let sum = s.engine.summary();
    assert_eq!((sum.launches, sum.apex, sum.warmup), (1, 1, 0));
    assert_eq!(sum.setup.mode, "inline");
    assert_eq!(
        (
            sum.setup.attach.count,
            sum.setup.queue.count,
            sum.setup.module.count
        ),
        (1, 1, 1),
        "each piece timed on the program's thread"
    );
    assert!(
        s.made_current.lock().unwrap().is_empty(),
        "no context was switched: nothing ran on another thread"
    );
}

#[test]
fn a_failed_attach_keeps_the_context_on_libcuda_with_the_reason() {
    let mut s = Setup::background(Some("no channel group"));
    assert!(!s.hook_launch(0));
    s.settle();
    assert!(!s.hook_launch(0));
    assert!(!s.hook_launch(0));
    s.settle();
    let sum = s.engine.summary();
    assert_eq!(
        (sum.launches, sum.apex, sum.warmup, sum.fallback),
        (3, 0, 1, 2)
    );
    assert_eq!(sum.reasons["attach_failed"].launches, 2);
    assert!(
        sum.reasons["attach_failed"]
            .example
            .contains("no channel group")
    );
    assert_eq!(sum.setup.failed, 1);
    assert_eq!(sum.setup.attach.count, 1, "tried once, not at every launch");
}

#[test]
fn a_module_apex_refuses_is_remembered_as_in_the_inline_mode() {
    const BAD: usize = 0x20;
    const BAD_FUNC: usize = 0x200;
    let mut s = Setup::background(None);
    s.warm_up(0);
    s.engine.loaded(
        BAD,
        Ok(ImageBytes::Owned(b"not a module".to_vec().into())),
        false,
    );
    s.engine.function(BAD_FUNC, BAD, "k");
    let l = Launch {
        f: BAD_FUNC,
        ..bare_launch()
    };
    assert!(s.engine.launch(&l, 0).is_none(), "forwarded while it loads");
    s.settle();
    assert!(s.engine.launch(&l, 0).is_none());
    assert!(s.engine.launch(&l, 0).is_none());
    let sum = s.engine.summary();
    assert_eq!(sum.reasons["module_refused"].launches, 2);
    assert_eq!(sum.setup.failed, 1);
    assert_eq!(
        sum.setup.module.count, 2,
        "the good module and the bad one, once each"
    );
}

#[test]
fn a_stream_destroyed_while_its_queue_is_built_leaves_the_queue_to_the_next_stream() {
    let mut s = Setup::background(None);
    s.warm_up(0);
    s.settle();
    // The worker's jobs wait until B is gone: a queue built between A's launch and B's would take B over.
    s.jobs.close();
    // A takes the spare; B finds none ready and asks for one (forwarded meanwhile).
    assert!(s.hook_launch(SITE_A));
    assert!(!s.hook_launch(SITE_B));
    assert_eq!(s.engine.contexts[0].wanted, vec![StreamKey::Handle(SITE_B)]);
    assert_eq!(s.engine.contexts[0].building, 2, "B's, and one ahead");
    s.engine.stream_destroyed(SITE_B);
    assert!(s.engine.contexts[0].wanted.is_empty());
    s.jobs.open();
    s.settle();
    // C's first launch picks both queues up and takes one over.
    assert!(s.hook_launch(SITE_C));
    let ctx = &s.engine.contexts[0];
    assert!(ctx.order.find(StreamKey::Handle(SITE_B)).is_none());
    assert!(ctx.order.find(StreamKey::Handle(SITE_C)).is_some());
    assert_eq!((ctx.building, ctx.spare.len()), (0, 1));
    let sum = s.engine.summary();
    // Two while the attach and the module were set up, one on B.
    assert_eq!((sum.warmup, sum.fallback, sum.setup.dropped), (3, 0, 0));
}

#[test]
fn a_module_unloaded_while_it_loads_is_dropped_and_loaded_again() {
    let mut s = Setup::background(None);
    assert!(!s.hook_launch(0));
    s.settle();
    assert!(!s.hook_launch(0), "the module is asked for");
    // Unloaded (as the hook does it: the load is withdrawn first; here it has finished, not picked up yet), and a
    // module loaded again under the same handle.
    s.settle();
    s.engine.unloading(MODULE);
    assert!(s.engine.contexts[0].loading.is_empty());
    s.engine.unloaded(MODULE);
    s.engine
        .loaded(MODULE, Ok(ImageBytes::Owned(CUBIN.into())), false);
    let name = s.engine.registry.origin(FUNC).map(|o| o.name.clone());
    assert!(name.is_none(), "the unload forgot the function");
    register_test_kernel(&mut s.engine);
    s.settle();
    assert!(
        !s.hook_launch(0),
        "the old load is dropped, a new one asked for"
    );
    assert_eq!(s.engine.summary().setup.dropped, 1);
    s.settle();
    assert!(s.hook_launch(0));
    let sum = s.engine.summary();
    assert_eq!(
        (sum.apex, sum.modules_loaded, sum.setup.module.count),
        (1, 1, 2)
    );
}

#[test]
fn the_end_waits_for_the_set_up_in_flight_with_a_bound_and_drops_what_it_made() {
    // A finished attach not picked up yet: dropped at the end, with everything else.
    let mut s = Setup::background(None);
    assert!(!s.hook_launch(0));
    s.settle();
    s.engine.shutdown("test");
    let sum = s.engine.summary();
    assert_eq!((sum.setup.dropped, sum.warmup), (1, 1));
    assert_eq!(sum.attach, "direct (ready only after the last launch)");
    assert!(!s.hook_launch(0), "the takeover is over");
    let ended = &s.engine.summary().reasons["takeover_ended"];
    assert_eq!(ended.launches, 1);
    assert_eq!(
        ended.example,
        "the takeover ended when test; work after it stays on libcuda"
    );

    // An attach that does not finish: the end waits for it up to the bound, then leaves it. (It fails once let
    // through: an abandoned GPU would be leaked, and the simulator has room for only a few per process.)
    let mut s = Setup::background(Some("too late"));
    s.gate.close();
    assert!(!s.hook_launch(0));
    // The worker is inside the attach (it made the context current first), not about to start it.
    let t = Instant::now();
    while s.made_current.lock().unwrap().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the worker never started the attach"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    s.engine.setup_bound = Duration::from_millis(200);
    let t = Instant::now();
    s.engine.shutdown("test");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    assert!(s.engine.attaching.is_empty());
    assert_eq!(s.engine.summary().attach, "being set up in the background");
    // It finishes later: leaked by the worker, never handed back.
    s.gate.open();
    std::thread::sleep(Duration::from_millis(100));
    assert!(!s.engine.setup.has_results());
    assert!(!s.hook_launch(0));
}
