//! Calls on streams no queue relates to, which the hooks forward without the engine ([`super::super::plain`]):
//! which streams the engine lets them forward, when it stops (before relations change), what the kept events and a
//! context synchronize make of such calls, against the simulated GPU.

use super::*;

/// A non-blocking stream (as NCCL's and PyTorch's side streams are).
const QUIET: usize = NON_BLOCKING + 0x1000;
const QUIET_SITE: Site = Site::Stream(QUIET, false);
/// A blocking stream.
const BLOCKING: usize = 0x5000;

impl Setup {
    /// A call on `site` forwarded through the engine, as the hooks forward work they cannot forward alone.
    fn forward_work(&mut self, site: Site) {
        let o = self.engine.before_work(site, "cuStreamWaitEvent");
        self.engine.after(site, o, false);
    }

    /// A call on `stream` (naming `event`) as the hooks make it without the engine: `None` when the engine must
    /// see it; `Some(false)` when relations changed while it ran (the engine is then told, as the hooks tell it).
    fn forward_plain(&mut self, stream: usize, event: Option<usize>) -> Option<bool> {
        let t = self.engine.plain.begin(stream, event)?;
        let unchanged = self.engine.plain.end(t, Some("cuStreamWaitEvent"));
        if !unchanged {
            self.engine
                .after(Site::Stream(stream, false), Ordered::UNKNOWN, false);
        }
        Some(unchanged)
    }
}

#[test]
fn a_stream_no_queue_relates_to_is_forwarded_without_the_engine_until_it_is_taken_over() {
    let mut s = Setup::new();
    assert!(s.launch());
    assert_eq!(
        s.forward_plain(QUIET, None),
        None,
        "a stream the engine has not seen goes through it"
    );
    s.forward_work(QUIET_SITE);
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    // A blocking stream is related to the legacy stream's queue: always through the engine.
    s.forward_work(Site::Stream(BLOCKING, false));
    assert_eq!(s.forward_plain(BLOCKING, None), None);
    // Taken over: through the engine again, and its first launch waits for what libcuda ran on it.
    s.calls();
    assert!(s.launch_on(QUIET, 1));
    assert_eq!(s.forward_plain(QUIET, None), None);
    assert!(
        s.calls()
            .contains(&format!("apex<-cuda {:?}", StreamKey::Handle(QUIET)))
    );
}

#[test]
fn a_blocking_stream_is_forwarded_alone_only_while_the_legacy_stream_is_not_taken_over() {
    let mut s = Setup::new();
    assert!(s.launch_on(QUIET, 1));
    s.forward_work(Site::Stream(BLOCKING, false));
    assert_eq!(s.forward_plain(BLOCKING, None), Some(true));
    // The legacy stream taken over relates every blocking stream to its queue.
    assert!(s.launch());
    assert_eq!(s.forward_plain(BLOCKING, None), None);
}

#[test]
fn a_call_that_ran_while_its_stream_was_taken_over_is_waited_for_by_the_next_launch() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    let t = s.engine.plain.begin(QUIET, None).expect("remembered");
    // Another thread takes the stream over while the call is in libcuda.
    assert!(s.launch_on(QUIET, 1));
    s.calls();
    assert!(
        !s.engine.plain.end(t, None),
        "the call learns of the change"
    );
    s.engine.after(QUIET_SITE, Ordered::UNKNOWN, false);
    assert!(s.launch_on(QUIET, 1));
    assert_eq!(
        s.calls(),
        vec![format!("apex<-cuda {:?}", StreamKey::Handle(QUIET))],
        "the next launch waits for the call's work"
    );
}

#[test]
fn a_destroyed_stream_is_forgotten() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    s.engine.stream_destroyed(QUIET);
    assert_eq!(s.forward_plain(QUIET, None), None);
}

#[test]
fn a_stream_is_remembered_only_with_its_own_context() {
    let mut s = Setup::new();
    assert!(s.launch());
    // A thread with no context current forwards a call on the stream: its context is not known, so not remembered
    // (another thread's calls on it would otherwise skip the engine uncounted).
    CURRENT.set(Some(None));
    s.forward_work(QUIET_SITE);
    CURRENT.set(None);
    assert_eq!(s.forward_plain(QUIET, None), None);
    // Found through its own context: remembered.
    s.forward_work(QUIET_SITE);
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    // A stream of another context, used while CTX is current: never remembered under CTX.
    s.forward_work(Site::Stream(FOREIGN, false));
    assert_eq!(s.forward_plain(FOREIGN, None), None);
}

#[test]
fn a_blocking_stream_s_wait_still_follows_the_legacy_stream_s_apex_work() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.idle();
    s.sim.pause();
    assert!(s.launch());
    s.calls();
    // CUDA orders a blocking stream's wait after the legacy stream's earlier work: that queue is handed over.
    let blocking = Site::Stream(BLOCKING, false);
    let o = s.engine.before_stream_wait(blocking, "cuStreamWaitEvent");
    s.engine.after(blocking, o, false);
    assert_eq!(s.calls(), vec!["cuda<-apex Legacy"]);
    // A non-blocking stream's wait hands nothing over.
    let o = s.engine.before_stream_wait(QUIET_SITE, "cuStreamWaitEvent");
    s.engine.after(QUIET_SITE, o, false);
    assert!(s.calls().is_empty());
    s.sim.resume();
    s.idle();
}

#[test]
fn an_event_the_engine_keeps_sends_calls_naming_it_through_the_engine() {
    let mut s = Setup::new();
    s.engine.event_created(EVENT, 2);
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    assert_eq!(s.engine.event_record(EVENT, LEGACY), Answer::Done(0));
    assert_eq!(s.forward_plain(QUIET, Some(EVENT)), None, "kept");
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    // Recorded on the quiet stream through the engine: libcuda's from then on.
    assert_eq!(s.engine.event_record(EVENT, QUIET_SITE), Answer::Forward);
    assert_eq!(s.forward_plain(QUIET, Some(EVENT)), Some(true));
    // Kept again, then destroyed.
    assert_eq!(s.engine.event_record(EVENT, LEGACY), Answer::Done(0));
    assert_eq!(s.forward_plain(QUIET, Some(EVENT)), None);
    s.engine.event_destroyed(EVENT);
    assert_eq!(s.forward_plain(QUIET, Some(EVENT)), Some(true));
    // Kept, then recorded in libcuda for a reader: no longer kept.
    s.engine.event_created(EVENT, 2);
    assert_eq!(s.engine.event_record(EVENT, LEGACY), Answer::Done(0));
    s.engine.materialize(EVENT, "cuStreamWaitEvent");
    assert_eq!(s.forward_plain(QUIET, Some(EVENT)), Some(true));
}

#[test]
fn a_context_synchronize_reaches_libcuda_after_calls_forwarded_without_the_engine() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    let m = forwarded_context_sync(&mut s);
    s.engine.context_synced(0, m);
    assert_eq!(s.engine.context_sync(), Answer::Done(0));
    // A call forwarded without the engine is CUDA work the next one must wait for.
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    let m = forwarded_context_sync(&mut s);
    // One forwarded while libcuda synchronizes is not completed by it, whether it ends before the synchronize does...
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    s.engine.context_synced(0, m);
    let m = forwarded_context_sync(&mut s);
    // ... or after.
    let t = s.engine.plain.begin(QUIET, None).expect("remembered");
    s.engine.context_synced(0, m);
    assert!(s.engine.plain.end(t, None));
    let m = forwarded_context_sync(&mut s);
    s.engine.context_synced(0, m);
    assert_eq!(s.engine.context_sync(), Answer::Done(0));
}

#[test]
fn with_chained_queues_every_call_goes_through_the_engine() {
    let mut s = Setup::with_chained(true);
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    assert_eq!(s.forward_plain(QUIET, None), None);
}

#[test]
fn calls_forwarded_without_the_engine_are_counted_by_name_in_the_summary() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.forward_work(QUIET_SITE);
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    assert_eq!(s.forward_plain(QUIET, None), Some(true));
    let sum = s.engine.summary();
    // One through the engine, two without it.
    assert_eq!(sum.cuda_work.get("cuStreamWaitEvent"), Some(&3));
}
