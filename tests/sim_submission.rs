//! The real submission path (gpfifo::Channel, pushbuf::Queue) against the simulated GPU front end: ring wrap, a
//! full ring, ordering through acquire/release, fences, malformed methods. No GPU needed.

use std::sync::Arc;
use std::time::Duration;

use apex::gpfifo::Error as ChannelError;
use apex::pushbuf::{Acquire, Error, Queue, Release, Signal, Subchannel, Submission};
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory};
use apex::sim::{SimErrorKind, Simulator, XID_GRAPHICS, XID_MMU};

#[path = "support/sim.rs"]
mod sim;

/// Generous: CI machines are small and loaded; nothing here waits this long when it works.
const T: Duration = Duration::from_secs(30);

fn queue(gpu: &Arc<GpuCore>, entries: u32, timeout: Duration) -> Queue {
    let config = sim::bare_queue_config(entries, timeout, Submission::Doorbell);
    Queue::new(gpu, config).expect("queue on the simulated GPU")
}

fn sem_page(gpu: &Arc<GpuCore>) -> Memory {
    sim::host_page(gpu)
}

const STAMPED: Release = Release {
    wfi: false,
    wide: true,
    timestamp: true,
};

#[test]
fn thousands_of_submissions_wrap_a_16_entry_ring() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, 16, T);
    let aux = sem_page(&gpu);
    let n = 3000u64;
    let mut last = None;
    for i in 1..=n {
        let f = q
            .submit(8, Signal::Host, |p, v| {
                p.sem_release(aux.va() + 16 * (i % 8), v * 3 + 1, STAMPED)
            })
            .unwrap();
        if i % 97 == 0 {
            f.wait(T).unwrap();
            assert_eq!(
                aux.read_u64_volatile(16 * (i % 8)).unwrap(),
                f.value() * 3 + 1
            );
            assert_ne!(
                aux.read_u64_volatile(16 * (i % 8) + 8).unwrap(),
                0,
                "timestamp"
            );
        }
        last = Some(f);
    }
    let last = last.unwrap();
    last.wait(T).unwrap();
    assert_eq!(q.timeline().completed(), last.value());
    assert_eq!(
        aux.read_u64_volatile(16 * (n % 8)).unwrap(),
        last.value() * 3 + 1
    );
    let s = sim.stats_for(q.channel().token()).unwrap();
    assert_eq!(
        s.entries,
        n + 1,
        "every submission (and the queue's first) is one GP entry"
    );
    assert_eq!(
        s.releases,
        2 * n + 1,
        "the queue's own first submission releases once"
    );
    assert_eq!(u64::from(s.gp_get), (n + 1) % 16);
    assert!(s.doorbells > 0);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_full_ring_times_out_then_drains_without_loss() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, 8, Duration::from_millis(200));
    let aux = sem_page(&gpu);
    sim.pause();
    let mut fences = Vec::new();
    // 7 of the 8 entries are usable (one stays empty so put == get means empty).
    for i in 0..7u64 {
        let f = q
            .record(8, Signal::Host, |p, v| {
                p.sem_release(aux.va() + 16 * i, v, STAMPED)
            })
            .unwrap();
        fences.push(f);
    }
    assert_eq!(q.channel().ring_state().free(), 0);
    let e = q
        .record(8, Signal::Host, |p, v| p.sem_release(aux.va(), v, STAMPED))
        .unwrap_err();
    assert!(
        matches!(e, Error::Channel(ChannelError::Timeout { .. })),
        "a full ring is a timeout, not an overwrite: {e}"
    );
    assert!(fences.iter().all(|f| !f.is_done()));
    sim.resume();
    q.kick();
    for (i, f) in fences.iter().enumerate() {
        f.wait(T).unwrap();
        assert_eq!(aux.read_u64_volatile(16 * i as u64).unwrap(), f.value());
    }
    // The queue goes on where it stopped: the failed record consumed no value.
    let f = q
        .submit(8, Signal::Host, |p, v| {
            p.sem_release(aux.va() + 0x100, v, STAMPED)
        })
        .unwrap();
    assert_eq!(f.value(), fences.last().unwrap().value() + 1);
    f.wait(T).unwrap();
    assert_eq!(aux.read_u64_volatile(0x100).unwrap(), f.value());
    assert!(sim.errors().is_empty());
}

#[test]
fn two_queues_are_ordered_by_acquire_and_release() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut producer = queue(&gpu, 64, T);
    let mut consumer = queue(&gpu, 64, T);
    let marker = sem_page(&gpu);
    sim.pause();
    let wait_for = producer.last_submitted() + 1;
    let (pt, mv) = (producer.timeline().va(), marker.va());
    let consumed = consumer
        .submit(16, Signal::Host, |p, _| {
            p.sem_acquire(pt, wait_for, Acquire::StrictGeq, true, false);
            p.sem_release(mv, 2, STAMPED);
        })
        .unwrap();
    // The consumer's channel blocks on its acquire; passes by hand show it stays blocked.
    for _ in 0..5 {
        sim.step();
    }
    assert!(!consumed.is_done());
    assert_eq!(marker.read_u64_volatile(0).unwrap(), 0);
    let stats = sim.stats_for(consumer.channel().token()).unwrap();
    assert!(stats.acquire_retries >= 5, "{stats:?}");

    let produced = producer
        .submit(16, Signal::Host, |p, _| p.sem_release(mv, 1, STAMPED))
        .unwrap();
    assert_eq!(produced.value(), wait_for);
    sim.resume();
    consumed.wait(T).unwrap();
    produced.wait(T).unwrap();
    assert_eq!(
        marker.read_u64_volatile(0).unwrap(),
        2,
        "the consumer wrote after the producer"
    );

    // Circular and equal acquires on 32-bit values, while another channel keeps running.
    let sems = sem_page(&gpu);
    let sv = sems.va();
    let f = consumer
        .submit(32, Signal::Host, |p, _| {
            p.sem_acquire(sv, 0xffff_fff0, Acquire::CircularGeq, false, false);
            p.sem_acquire(sv + 16, 7, Acquire::Equal, false, true);
        })
        .unwrap();
    let g = producer
        .submit(8, Signal::Host, |p, _| p.sem_release(sv + 32, 9, STAMPED))
        .unwrap();
    g.wait(T).unwrap();
    assert!(!f.is_done());
    // 5 is "after" 0xfffffff0 in wrapping order.
    sems.write_u64_volatile(0, 5).unwrap();
    sems.write_u64_volatile(16, 7).unwrap();
    f.wait(T).unwrap();
    assert!(sim.errors().is_empty());
}

#[test]
fn fences_wait_report_done_and_time_out() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, 32, T);
    sim.pause();
    let f = q.submit(8, Signal::Host, |p, _| p.wfi()).unwrap();
    assert!(!f.is_done());
    let e = f.wait(Duration::from_millis(50)).unwrap_err();
    assert!(
        matches!(e, Error::Channel(ChannelError::Timeout { .. })),
        "{e}"
    );
    sim.resume();
    f.wait(T).unwrap();
    assert!(f.is_done());
    assert!(
        q.fence_for(f.value() - 1).is_done(),
        "earlier values are done too"
    );
    q.wait_idle(T).unwrap();
    let s = sim.stats_for(q.channel().token()).unwrap();
    assert!(s.wfis >= 1);
}

fn fault_of(e: Error) -> apex::gpfifo::ChannelFault {
    match e {
        Error::Channel(ChannelError::Fault(f)) => f,
        e => panic!("expected a channel fault, got {e}"),
    }
}

/// Graphics-engine channels of one GPU share a channel group, so that their kernels run side by side as a CUDA
/// context's streams do; a channel asked to have its own group and a polled queue's (whose gate yields its group)
/// get one each; once a channel of the shared group has faulted (RM ends the whole group), new channels found a new
/// group instead of joining the ended one.
#[test]
fn channels_share_a_group_until_it_faults() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let group = |q: &Queue| q.channel().handles().0;
    let mut a = queue(&gpu, 16, T);
    let b = queue(&gpu, 16, T);
    assert!(a.channel().shares_group() && b.channel().shares_group());
    assert_eq!(group(&a), group(&b));

    let mut own = sim::bare_queue_config(16, T, Submission::Doorbell);
    own.channel.own_group = true;
    let own = Queue::new(&gpu, own).unwrap();
    assert!(!own.channel().shares_group());
    assert_ne!(group(&own), group(&a));
    let polled = Queue::new(
        &gpu,
        sim::bare_queue_config(64, T, Submission::Armed(apex::pushbuf::Armed::default())),
    )
    .unwrap();
    assert!(!polled.channel().shares_group());
    assert_ne!(group(&polled), group(&a));

    let f = a
        .submit(16, Signal::Host, |p, _| p.raw(&[0xc000_0000]))
        .unwrap();
    fault_of(f.wait(T).unwrap_err());
    let mut c = queue(&gpu, 16, T);
    let d = queue(&gpu, 16, T);
    assert_ne!(
        group(&c),
        group(&a),
        "a new channel joined a group that faulted"
    );
    assert_eq!(group(&c), group(&d));
    let e = c.submit(8, Signal::Host, |_, _| {}).unwrap();
    e.wait(T).unwrap();

    // With every member gone the group is freed; the next channel founds another.
    let ended = group(&c);
    drop((c, d, e));
    let next = queue(&gpu, 16, T);
    assert!(next.channel().shares_group());
    assert_ne!(group(&next), ended);

    // A fault nobody has asked about: RM has posted it to the notifier, and the group is not joined either.
    let mut x = queue(&gpu, 16, T);
    assert_eq!(group(&x), group(&next));
    let seen = sim.errors().len();
    x.submit(16, Signal::Host, |p, _| p.raw(&[0xc000_0000]))
        .unwrap();
    assert!(sim.wait_for(T, |s| s.errors().len() > seen));
    let z = queue(&gpu, 16, T);
    assert_ne!(
        group(&z),
        group(&next),
        "a new channel joined a group with an unseen fault"
    );
}

#[test]
fn malformed_methods_fault_the_channel_with_a_reason() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();

    // A reserved header opcode: the methods before it run, then the channel faults.
    let mut q = queue(&gpu, 16, T);
    let aux = sem_page(&gpu);
    let av = aux.va();
    let f = q
        .submit(16, Signal::Host, |p, _| {
            p.sem_release(av, 41, STAMPED);
            p.raw(&[0xc000_0000]);
        })
        .unwrap();
    let fault = fault_of(f.wait(T).unwrap_err());
    assert_eq!((fault.info32, fault.status), (XID_GRAPHICS, 0xffff));
    assert_eq!(q.channel().fault(), Some(fault));
    assert_eq!(aux.read_u64_volatile(0).unwrap(), 41);
    let errs = sim.errors();
    assert!(
        matches!(&errs[..], [e] if e.token == q.channel().token()
            && matches!(e.kind, SimErrorKind::Decode(_))),
        "{errs:?}"
    );
    assert!(errs[0].kind.to_string().contains("unknown method header"));
    // A faulted channel stays faulted: later work fails at once instead of hanging.
    let g = q.submit(8, Signal::Host, |p, _| p.wfi()).unwrap();
    assert!(matches!(
        g.wait(T),
        Err(Error::Channel(ChannelError::Fault(_)))
    ));

    // A header whose data runs past the segment.
    let mut q = queue(&gpu, 16, T);
    let f = q
        .submit(16, Signal::Recorded, |p, _| {
            p.raw(&[
                apex::pushbuf::header(
                    apex::pushbuf::Header::Incrementing,
                    Subchannel::HOST,
                    0x5c,
                    5,
                ),
                0,
            ])
        })
        .unwrap();
    assert_eq!(fault_of(f.wait(T).unwrap_err()).info32, XID_GRAPHICS);
    assert!(sim.errors().iter().any(
        |e| e.token == q.channel().token() && e.kind.to_string().contains("needs 5 data words")
    ));

    // A method on a subchannel with no class, and a release to an unmapped address (MMU fault, Xid 31).
    let mut q = queue(&gpu, 16, T);
    let f = q
        .submit(8, Signal::Host, |p, _| p.method(Subchannel(2), 0x200, 0))
        .unwrap();
    assert_eq!(fault_of(f.wait(T).unwrap_err()).info32, XID_GRAPHICS);
    assert!(sim.errors().iter().any(|e| e.token == q.channel().token()
        && matches!(
            e.kind,
            SimErrorKind::UnboundSubchannel { subchannel: 2, .. }
        )));

    let mut q = queue(&gpu, 16, T);
    let f = q
        .submit(8, Signal::Host, |p, v| p.sem_release(0x1000, v, STAMPED))
        .unwrap();
    assert_eq!(fault_of(f.wait(T).unwrap_err()).info32, XID_MMU);

    // Binding a class that was never allocated on the channel.
    let mut q = queue(&gpu, 16, T);
    let f = q
        .submit(8, Signal::Host, |p, _| {
            p.set_object(Subchannel::COMPUTE, 0xcbc0)
        })
        .unwrap();
    assert_eq!(fault_of(f.wait(T).unwrap_err()).info32, XID_GRAPHICS);
    assert!(sim.errors().iter().any(|e| matches!(
        e.kind,
        SimErrorKind::ClassNotOnChannel { class: 0xcbc0, .. }
    )));
}

#[test]
fn a_manual_model_only_moves_when_stepped() {
    let (gpu, sim) = Simulator::open_manual(SimConfig::default()).unwrap();
    // Queue::new waits for its first submission, so step from another thread meanwhile.
    let q = std::thread::scope(|s| {
        let stepper = s.spawn(|| {
            sim.wait_for(T, |sim| {
                !sim.channel_stats().is_empty()
                    && sim.channel_stats().iter().all(|c| c.releases > 0)
            })
        });
        let q = queue(&gpu, 16, T);
        assert!(stepper.join().unwrap());
        q
    });
    let mut q = q;
    let f = q.submit(8, Signal::Host, |p, _| p.wfi()).unwrap();
    assert!(!f.is_done());
    sim.run_until_idle(100);
    assert!(f.is_done());
}

/// A front end that fetches only on doorbells and misses some (as a freshly started GPU was seen to): queue
/// creation and the owner's waits ring the doorbell again instead of timing out; a plain fence wait, which cannot
/// ring, shows that the missed doorbell really held the work back.
#[test]
fn missed_doorbells_are_rung_again_by_the_queue_owner() {
    use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig};
    use apex::module::Module;
    let (gpu, sim) = Simulator::open(SimConfig {
        lost_doorbells: 3,
        ..SimConfig::default()
    })
    .unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())
        .expect("queue despite missed doorbells");
    let token = q.queue().channel().token();
    let stats = sim.stats_for(token).unwrap();
    let lost = stats.lost_doorbells;
    assert!(lost >= 1, "the model missed no doorbell: {stats:?}");
    let k = Module::load(
        &gpu,
        include_bytes!("../kernels/apex_test_kernels.sm_90.cubin"),
    )
    .unwrap()
    .kernel("empty")
    .unwrap();
    // SAFETY: the simulator runs no kernels.
    unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[]) }.unwrap();
    q.synchronize().unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());

    // The model fetches only what a doorbell announced: published work without one stays unfetched, which is
    // what a missed doorbell leaves behind when nobody rings again.
    let (gpu, sim) = Simulator::open(SimConfig {
        lost_doorbells: 1,
        ..SimConfig::default()
    })
    .unwrap();
    let mut raw = queue(&gpu, 64, Duration::from_secs(5));
    let token = raw.channel().token();
    assert_eq!(sim.stats_for(token).unwrap().lost_doorbells, 1);
    let f = raw.record(0, Signal::Host, |_, _| {}).unwrap();
    let e = f.wait(Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(e, Error::Channel(ChannelError::Timeout { .. })),
        "{e}"
    );
    raw.kick();
    f.wait(T).unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}
