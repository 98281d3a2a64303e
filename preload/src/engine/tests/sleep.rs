//! Waits that sleep in libcuda where the program asked CUDA to sleep while it waits (`CU_CTX_SCHED_BLOCKING_SYNC`,
//! `CU_EVENT_BLOCKING_SYNC`), against the simulated GPU: when a wait sleeps, on what, and when it spins instead.

use super::*;

const STREAM: usize = NON_BLOCKING + 0x2000;
const SITE: Site = Site::Stream(STREAM, false);

impl Setup {
    /// A stream synchronize on `site` whose work is still running (the simulated front end paused): its waits.
    fn running_sync(&mut self, site: Site) -> Waits {
        let Step::Wait(w) = self.engine.stream_sync_begin(site, SyncKind::Wait) else {
            panic!("the stream's queue is waited for");
        };
        assert!(
            w.items.iter().any(|(_, f)| !f.is_done()),
            "the launch is running"
        );
        assert!(
            w.wait_briefly(SPIN_BEFORE_SLEEP).is_none(),
            "still running after the spin"
        );
        w
    }
}

#[test]
fn a_wait_in_a_context_that_sleeps_sleeps_in_libcuda_on_an_event_after_the_queues_work() {
    let mut s = Setup::new();
    s.sleeps.store(true, AtomicOrdering::Relaxed);
    assert!(s.launch_on(STREAM, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(STREAM, 2));
    s.calls();
    let w = s.running_sync(SITE);
    let sleep = s
        .engine
        .sleep_ticket(&w, None)
        .expect("a context made to sleep sleeps");
    let first = SLEEPING_EVENTS;
    assert_eq!(sleep.sleeper.event, first);
    assert_ne!(sleep.sleeper.stream, 0, "recorded on a stream of its own");
    assert_ne!(
        sleep.sleeper.stream, s.engine.contexts[0].side,
        "not the stream the preload records the program's events on"
    );
    let stream = sleep.sleeper.stream;
    assert_eq!(
        s.calls(),
        [
            format!("sleeping event {first:#x}"),
            format!("record after {first:#x}")
        ],
        "an event of the preload's own, recorded after the queue's work (on its own stream): the program's streams \
         and events are not touched"
    );
    assert_eq!(s.engine.summary().syncs_asleep, 1);
    s.sim.resume();
    assert_eq!(sleep.cuda.sleep_on_event(sleep.sleeper.event), Ok(()));
    s.engine.slept(sleep);
    let waited = w.wait();
    assert_eq!(
        s.engine.stream_sync_end(SITE, &w, &waited).0,
        Answer::Done(CUDA_SUCCESS),
        "answered from the fences, as a spinning wait is"
    );
    // The next sleep takes the same event again.
    s.sim.pause();
    assert!(s.launch_on(STREAM, 3));
    s.calls();
    let w = s.running_sync(SITE);
    let sleep = s.engine.sleep_ticket(&w, None).expect("sleeps again");
    assert_eq!(
        sleep.sleeper,
        Sleeper {
            event: first,
            stream
        },
        "events are reused, with their streams"
    );
    assert_eq!(
        s.calls(),
        [format!("record after {first:#x}")],
        "no new event"
    );
    s.sim.resume();
    s.engine.slept(sleep);
    let waited = w.wait();
    assert!(waited.is_ok());
    assert_eq!(s.engine.summary().syncs_asleep, 2);
}

#[test]
fn a_wait_spins_where_the_program_did_not_ask_to_sleep() {
    let mut s = Setup::new();
    assert!(s.launch_on(STREAM, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(STREAM, 2));
    s.calls();
    let w = s.running_sync(SITE);
    assert!(s.engine.sleep_ticket(&w, None).is_none());
    assert!(s.calls().is_empty(), "nothing asked of libcuda");
    s.sim.resume();
    let waited = w.wait();
    assert_eq!(
        s.engine.stream_sync_end(SITE, &w, &waited).0,
        Answer::Done(CUDA_SUCCESS)
    );
    assert_eq!(s.engine.summary().syncs_asleep, 0);
}

#[test]
fn a_wait_spins_when_its_queue_has_launched_since() {
    let mut s = Setup::new();
    s.sleeps.store(true, AtomicOrdering::Relaxed);
    assert!(s.launch_on(STREAM, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(STREAM, 2));
    let w = s.running_sync(SITE);
    // Another thread's launch on the same stream after the synchronize began: an event after the queue's work
    // would wait for it too (and it may wait for what follows this synchronize).
    assert!(s.launch_on(STREAM, 3));
    s.calls();
    assert!(s.engine.sleep_ticket(&w, None).is_none());
    assert!(s.calls().is_empty());
    s.sim.resume();
    assert!(w.wait().is_ok());
}

#[test]
fn a_synchronize_on_an_event_made_to_sleep_sleeps_in_any_context() {
    let mut s = Setup::new();
    assert!(s.launch_on(STREAM, 1));
    s.idle();
    // CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING: kept by the preload, and its synchronize sleeps.
    s.engine.event_created(EVENT, 0x1 | 0x2);
    s.sim.pause();
    assert!(s.launch_on(STREAM, 2));
    assert_eq!(
        s.engine.event_record(EVENT, SITE),
        Answer::Done(CUDA_SUCCESS)
    );
    s.calls();
    let Step::Wait(w) = s.engine.event_sync_begin(EVENT, SyncKind::Wait) else {
        panic!("the kept event's fence is waited for");
    };
    assert!(w.wait_briefly(SPIN_BEFORE_SLEEP).is_none());
    assert!(
        s.engine.sleep_ticket(&w, None).is_none(),
        "a stream synchronize in this context spins"
    );
    let sleep = s
        .engine
        .sleep_ticket(&w, Some(EVENT))
        .expect("the event's synchronize sleeps");
    assert_eq!(
        s.calls(),
        [
            format!("sleeping event {SLEEPING_EVENTS:#x}"),
            format!("record after {SLEEPING_EVENTS:#x}")
        ]
    );
    s.sim.resume();
    s.engine.slept(sleep);
    let waited = w.wait();
    assert_eq!(
        s.engine.event_sync_end(EVENT, &w, &waited),
        Answer::Done(CUDA_SUCCESS)
    );
    // Made again without the flag (the handle reused): it spins.
    s.engine.event_destroyed(EVENT);
    s.engine.event_created(EVENT, 0x2);
    s.sim.pause();
    assert!(s.launch_on(STREAM, 3));
    assert_eq!(
        s.engine.event_record(EVENT, SITE),
        Answer::Done(CUDA_SUCCESS)
    );
    let Step::Wait(w) = s.engine.event_sync_begin(EVENT, SyncKind::Wait) else {
        panic!("waited for");
    };
    assert!(s.engine.sleep_ticket(&w, Some(EVENT)).is_none());
    s.sim.resume();
    assert!(w.wait().is_ok());
}

#[test]
fn a_synchronous_copy_in_a_context_that_sleeps_is_answered_as_before() {
    // The copy's wait happens under the engine's lock; with the simulated GPU running it completes either within
    // the spin or after the sleep (the double's sleep returns at once, and the fence is then waited for).
    let mut s = Setup::new();
    s.sleeps.store(true, AtomicOrdering::Relaxed);
    assert!(s.launch());
    let dev = device_memory(&s, 4096);
    s.idle();
    s.calls();
    let mut out = vec![0u8; 64];
    let op = CopyOp {
        dst: out.as_mut_ptr() as u64,
        src: dev.device_ptr(),
        bytes: 64,
        site: LEGACY,
        dir: CopyDir::DeviceToHost,
        blocking: true,
    };
    assert_eq!(s.engine.copy(&op), Some(CUDA_SUCCESS));
    let calls = s.calls();
    let asleep = s.engine.summary().syncs_asleep;
    match asleep {
        0 => assert!(
            calls.iter().all(|c| !c.starts_with("record after")),
            "{calls:?}"
        ),
        1 => assert!(
            calls.iter().any(|c| c.starts_with("record after")),
            "{calls:?}"
        ),
        n => panic!("{n} sleeps for one copy"),
    }
    assert_eq!(s.engine.summary().copies_on_apex, 1);
    assert_eq!(
        s.engine.contexts[0].sleepers.len(),
        usize::from(calls.iter().any(|c| c.starts_with("sleeping event"))),
        "an event taken for the copy is back in the pool"
    );
}

#[test]
fn two_waits_asleep_at_once_sleep_on_events_and_streams_of_their_own() {
    let mut s = Setup::new();
    s.sleeps.store(true, AtomicOrdering::Relaxed);
    let other = NON_BLOCKING + 0x2100;
    assert!(s.launch_on(STREAM, 1));
    assert!(s.launch_on(other, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(STREAM, 2));
    assert!(s.launch_on(other, 2));
    // Two threads' synchronizes, each asleep before the other wakes: neither event nor stream is shared (an event
    // re-recorded by the other, or recorded behind the other's wait, would wait for the other's work too).
    let w1 = s.running_sync(SITE);
    let w2 = s.running_sync(Site::Stream(other, false));
    let a = s.engine.sleep_ticket(&w1, None).expect("sleeps");
    let b = s.engine.sleep_ticket(&w2, None).expect("sleeps");
    assert_ne!(a.sleeper.event, b.sleeper.event);
    assert_ne!(a.sleeper.stream, b.sleeper.stream);
    s.sim.resume();
    s.engine.slept(a);
    s.engine.slept(b);
    assert!(w1.wait().is_ok() && w2.wait().is_ok());
    assert_eq!(
        s.engine.contexts[0].sleepers.len(),
        2,
        "both back in the pool"
    );
}
