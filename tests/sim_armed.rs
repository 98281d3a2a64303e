//! Armed submission (`Submission::Armed`) against the simulated front end: submissions through armed slots with
//! no doorbell, the gate, slots given up for submissions through the ring, re-arming, prebuilt methods between
//! armed work, and a queue dropped with armed slots. No GPU needed.

use std::sync::Arc;
use std::time::Duration;

use apex::gpfifo::ChannelConfig;
use apex::pushbuf::{Acquire, Armed, Push, Queue, QueueConfig, Release, Signal, Submission};
use apex::rm::GpuCore;
use apex::rm::sim::SimConfig;
use apex::sim::Simulator;

#[path = "support/sim.rs"]
mod sim;

const T: Duration = Duration::from_secs(30);

const STAMPED: Release = Release {
    wfi: false,
    wide: true,
    timestamp: true,
};

fn queue(gpu: &Arc<GpuCore>, armed: Armed, entries: u32) -> Queue {
    let config = sim::bare_queue_config(entries, T, Submission::Armed(armed));
    Queue::new(gpu, config).expect("armed queue on the simulated GPU")
}

#[test]
fn armed_submissions_run_in_order_without_doorbells() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, Armed::default(), 64);
    let aux = sim::host_page(&gpu);
    let before = q.channel().kicks();
    let n = 1000u64;
    for i in 1..=n {
        let slot = 8 * (i % 256);
        q.submit(8, Signal::Host, |p, _| {
            p.sem_release(aux.va() + slot, i, STAMPED)
        })
        .unwrap();
        if i % 10 == 0 {
            q.wait_idle(T).unwrap();
            // Every submission ran, none skipped: each wrote its own word.
            for j in i - 9..=i {
                assert_eq!(aux.read_u64_volatile(8 * (j % 256)).unwrap(), j);
            }
        }
    }
    let doorbells = q.channel().kicks() - before;
    // One doorbell arms half the slots again: 1000 submissions through 16 slots take about 1000 / 8.
    assert!(
        doorbells <= n / 4,
        "{doorbells} doorbells for {n} armed submissions"
    );
}

#[test]
fn a_slot_written_while_the_front_end_waits_at_its_gate_runs_as_written() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, Armed::default(), 64);
    let token = q.channel().token();
    let aux = sim::host_page(&gpu);
    for i in 1..=100u64 {
        // The front end is parked at the next slot's gate (and has fetched what it may fetch ahead) before the
        // CPU writes the slot.
        let retries = sim.stats_for(token).unwrap().acquire_retries;
        assert!(
            sim.wait_for(T, |s| s.stats_for(token).unwrap().acquire_retries
                > retries + 2)
        );
        q.submit(8, Signal::Host, |p, _| p.sem_release(aux.va(), i, STAMPED))
            .unwrap()
            .wait(T)
            .unwrap();
        assert_eq!(
            aux.read_u64_volatile(0).unwrap(),
            i,
            "submission {i} did not run"
        );
    }
}

#[test]
fn large_submissions_and_prebuilt_methods_go_through_the_ring_in_order() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let armed = Armed {
        slots: 4,
        slot_words: 32,
    };
    let mut q = queue(&gpu, armed, 32);
    let token = q.channel().token();
    let aux = sim::host_page(&gpu);
    let prebuilt = sim::host_page(&gpu);
    let mut want = Vec::new();
    let mut tag = 0u64;
    for round in 0..60u64 {
        // Small (a slot), large (the ring: 6 releases of 6 words do not fit 31 words), prebuilt (the ring), in a
        // pattern that changes every round.
        let kind = (round * 7 + round / 5) % 4;
        match kind {
            0 | 1 => {
                tag += 1;
                let t = tag;
                q.record(8, Signal::Recorded, |p, _| {
                    p.sem_release(aux.va() + 8 * (t % 64), t, STAMPED)
                })
                .unwrap();
                want.push(t);
            }
            2 => {
                let first = tag + 1;
                tag += 6;
                q.record(40, Signal::Recorded, |p, _| {
                    for t in first..=first + 5 {
                        p.sem_release(aux.va() + 8 * (t % 64), t, STAMPED);
                    }
                })
                .unwrap();
                want.extend(first..=first + 5);
            }
            _ => {
                tag += 1;
                let mut words = [0u32; 6];
                let mut p = Push::new(&mut words);
                p.sem_release(aux.va() + 8 * (tag % 64), tag, STAMPED);
                let n = p.finish().unwrap();
                let off = 64 * (round % 64);
                prebuilt.write_words(off, &words[..n]).unwrap();
                q.push_prebuilt(prebuilt.va() + off, n as u64).unwrap();
                want.push(tag);
            }
        }
        if round % 3 == 2 {
            q.submit(0, Signal::Host, |_, _| {})
                .unwrap()
                .wait(T)
                .unwrap();
            // The releases of the last rounds, each in its own word, all there.
            for &t in want.iter().rev().take(12) {
                assert_eq!(
                    aux.read_u64_volatile(8 * (t % 64)).unwrap(),
                    t,
                    "release {t}"
                );
            }
        }
    }
    q.wait_idle_kicking(T).unwrap();
    let stats = sim.stats_for(token).unwrap();
    assert!(
        !stats.faulted && sim.errors().is_empty(),
        "{:?}",
        sim.errors()
    );
    // Every release ran once: the tags, and the 20 signals above and the queue's first.
    assert_eq!(stats.releases as usize, want.len() + 21);
}

#[test]
fn a_queue_that_alternates_small_and_large_work_stops_arming() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let armed = Armed {
        slots: 16,
        slot_words: 16,
    };
    let mut q = queue(&gpu, armed, 256);
    let aux = sim::host_page(&gpu);
    let entries = |q: &Queue| q.channel().ring_state().put();
    // Warm: the first doorbell arms the slots, a large submission gives them up.
    q.submit(0, Signal::Host, |_, _| {}).unwrap();
    q.submit(40, Signal::Host, |p, v| p.sem_release(aux.va(), v, STAMPED))
        .unwrap();
    let start = entries(&q);
    for i in 0..20u64 {
        let words = if i % 2 == 0 { 0 } else { 40 };
        q.submit(words, Signal::Host, |p, v| {
            if words > 0 {
                p.sem_release(aux.va(), v, STAMPED);
            }
        })
        .unwrap()
        .wait(T)
        .unwrap();
    }
    // One entry per submission through the ring, no armed pairs: no slots armed only to be passed empty.
    let used = (entries(&q) + 256 - start) % 256;
    assert_eq!(
        used, 20,
        "{used} GPFIFO entries for 20 alternating submissions"
    );
    // Small work in a row arms again.
    for _ in 0..4 {
        q.submit(0, Signal::Host, |_, _| {}).unwrap();
    }
    let before = q.channel().kicks();
    for _ in 0..4 {
        q.submit(0, Signal::Host, |_, _| {})
            .unwrap()
            .wait(T)
            .unwrap();
    }
    assert_eq!(q.channel().kicks(), before, "no doorbell once armed again");
}

#[test]
fn a_queue_dropped_with_armed_slots_leaves_the_gpu_usable() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = queue(&gpu, Armed::default(), 64);
    q.submit(0, Signal::Host, |_, _| {}).unwrap();
    q.submit(0, Signal::Host, |_, _| {})
        .unwrap()
        .wait(T)
        .unwrap();
    // The gate is the first word of the armed memory; the queue's first slots are filled, the rest empty.
    let armed_slots = q.channel().ring_state().put();
    drop(q);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    assert!(armed_slots > 2, "slots were armed");
    // The GPU goes on with other queues.
    let mut other = queue(&gpu, Armed::default(), 64);
    for _ in 0..20 {
        other
            .submit(0, Signal::Host, |_, _| {})
            .unwrap()
            .wait(T)
            .unwrap();
    }
}

#[test]
fn armed_shapes_outside_the_limits_are_refused() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    for (slots, slot_words) in [(3, 64), (1, 64), (512, 64), (16, 8), (16, 100), (16, 8192)] {
        let config =
            QueueConfig::default().with_submission(Submission::Armed(Armed { slots, slot_words }));
        let e = Queue::new(&gpu, config).unwrap_err().to_string();
        assert!(
            e.contains("armed submission"),
            "{slots} x {slot_words}: {e}"
        );
    }
    // A ring too small to hold half the slots' entries beside other work: arming could never happen.
    let config = QueueConfig::default()
        .with_channel(ChannelConfig::default().with_entries(16))
        .with_submission(Submission::Armed(Armed::default()));
    let e = Queue::new(&gpu, config).unwrap_err().to_string();
    assert!(e.contains("ring of 16 GPFIFO entries"), "{e}");
}

#[test]
fn the_model_runs_a_prefetched_segment_as_it_was_fetched() {
    // What makes the `SYNC_WAIT` entries of armed slots necessary, checked on the model itself: a segment
    // rewritten after the front end fetched it ahead of a blocked acquire runs as fetched.
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let config = sim::bare_queue_config(64, T, Submission::Doorbell);
    let mut q = Queue::new(&gpu, config).unwrap();
    let token = q.channel().token();
    let aux = sim::host_page(&gpu);
    let prebuilt = sim::host_page(&gpu);
    let segment = |value: u64| {
        let mut words = [0u32; 6];
        let mut p = Push::new(&mut words);
        p.sem_release(aux.va() + 8, value, STAMPED);
        p.finish().unwrap();
        words
    };
    prebuilt.write_words(0, &segment(1)).unwrap();
    q.record(8, Signal::Recorded, |p, _| {
        p.sem_acquire(aux.va(), 1, Acquire::StrictGeq, true, false)
    })
    .unwrap();
    q.push_prebuilt(prebuilt.va(), 6).unwrap();
    q.kick();
    assert!(sim.wait_for(T, |s| s.stats_for(token).unwrap().prefetched > 0));
    prebuilt.write_words(0, &segment(2)).unwrap();
    aux.write_u64_volatile(0, 1).unwrap();
    q.submit(0, Signal::Host, |_, _| {})
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(aux.read_u64_volatile(8).unwrap(), 1);
}

#[test]
fn missed_doorbells_are_rung_again_on_an_armed_queue() {
    use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig, LaunchMemory};
    use apex::module::Module;
    let (gpu, sim) = Simulator::open(SimConfig {
        lost_doorbells: 3,
        ..SimConfig::default()
    })
    .unwrap();
    let config = ComputeQueueConfig::default()
        .with_memory(LaunchMemory::Host)
        .with_polling(true);
    let mut q = ComputeQueue::new(&gpu, config).expect("queue despite missed doorbells");
    assert!(q.queue().is_armed());
    let token = q.queue().channel().token();
    let k = Module::load(&gpu, sim::CUBIN)
        .unwrap()
        .kernel("empty")
        .unwrap();
    for _ in 0..20 {
        // SAFETY: the simulator runs no kernels.
        unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[]) }.unwrap();
    }
    q.synchronize().unwrap();
    let stats = sim.stats_for(token).unwrap();
    assert!(
        stats.lost_doorbells >= 1,
        "the model missed no doorbell: {stats:?}"
    );
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_submission_that_overflows_its_slot_leaves_the_slot_empty() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let armed = Armed {
        slots: 16,
        slot_words: 32,
    };
    let mut q = queue(&gpu, armed, 64);
    let token = q.channel().token();
    let aux = sim::host_page(&gpu);
    // Every slot once: each body now holds a release of 7 to aux[4], then the queue's own release.
    for _ in 0..40 {
        q.submit(8, Signal::Host, |p, _| {
            p.sem_release(aux.va() + 32, 7, STAMPED)
        })
        .unwrap()
        .wait(T)
        .unwrap();
    }
    // Asks for 2 words and writes a 6-word release to aux[0]: refused, as through the ring. Had its first two
    // words stayed in the slot, they would run with the old release's last four: 7 written to aux[0].
    let e = q
        .record(2, Signal::Recorded, |p, _| {
            p.sem_release(aux.va(), 99, STAMPED)
        })
        .unwrap_err();
    assert!(matches!(e, apex::pushbuf::Error::Overflow(_)), "{e}");
    // A large submission gives up the slots left empty, the refused one among them, and opens the gate over them.
    q.submit(40, Signal::Host, |p, _| {
        p.sem_release(aux.va() + 8, 5, STAMPED)
    })
    .unwrap()
    .wait(T)
    .unwrap();
    assert_eq!(
        aux.read_u64_volatile(0).unwrap(),
        0,
        "a fragment of the refused submission ran"
    );
    assert_eq!(aux.read_u64_volatile(8).unwrap(), 5);
    assert!(!sim.stats_for(token).unwrap().faulted, "{:?}", sim.errors());
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_gpu_behind_the_cpu_sends_work_through_the_ring_until_slots_are_free_again() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let armed = Armed {
        slots: 4,
        slot_words: 32,
    };
    let mut q = queue(&gpu, armed, 256);
    let aux = sim::host_page(&gpu);
    q.submit(0, Signal::Host, |_, _| {})
        .unwrap()
        .wait(T)
        .unwrap();
    // The GPU stands still while the CPU goes through the slots several times over.
    sim.pause();
    for i in 1..=40u64 {
        q.submit(8, Signal::Recorded, |p, _| {
            p.sem_release(aux.va() + 8 * i, i, STAMPED)
        })
        .unwrap();
    }
    sim.resume();
    q.submit(0, Signal::Host, |_, _| {})
        .unwrap()
        .wait(T)
        .unwrap();
    for i in 1..=40u64 {
        assert_eq!(aux.read_u64_volatile(8 * i).unwrap(), i, "submission {i}");
    }
    // Caught up, the queue arms again: small submissions need no doorbell.
    for _ in 0..4 {
        q.submit(0, Signal::Host, |_, _| {})
            .unwrap()
            .wait(T)
            .unwrap();
    }
    let before = q.channel().kicks();
    q.submit(0, Signal::Host, |_, _| {})
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(q.channel().kicks(), before, "a doorbell once armed again");
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}
