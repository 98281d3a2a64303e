//! The public queue's one launch entry (`Queue::submit` with an `apex::Launch`) on the simulated GPU: refused
//! combinations are typed and submit nothing, tickets of chained links complete with their chain's part, prepared
//! links carry their own arguments, a prepared launch's ticket allocates nothing, and deferred launches wait for one
//! doorbell.

use std::time::Duration;

use apex::rm::sim::SimConfig;
use apex::{Arg, Error, Gpu, Launch, LaunchConfig};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

fn gpu() -> (Gpu, apex::sim::Simulator) {
    Gpu::open_simulated(SimConfig::default()).expect("simulated GPU")
}

/// What the chain_step tests share: a simulated GPU, the kernel, its 8-byte value, one queue and a prepared
/// one-thread launch of the kernel on it.
struct Step {
    sim: apex::sim::Simulator,
    step: apex::Kernel,
    v: apex::Buffer,
    one: LaunchConfig,
    q: apex::Queue,
    prepared: apex::PreparedLaunch,
}

fn chain_step() -> Step {
    let (gpu, sim) = gpu();
    let step = gpu
        .load_module(CUBIN)
        .unwrap()
        .kernel("chain_step")
        .unwrap();
    let v = gpu.alloc(8).unwrap();
    let one = LaunchConfig::linear(1, 1);
    let mut q = gpu.queue().unwrap();
    let prepared = q.prepare(&step, &one).unwrap();
    Step {
        sim,
        step,
        v,
        one,
        q,
        prepared,
    }
}

/// The timeline value a ticket stands for (its fence's, on the direct path).
fn value(q: &apex::Queue, t: apex::Ticket) -> u64 {
    q.fence(t).unwrap().direct().unwrap().value()
}

#[test]
fn combinations_that_mean_nothing_are_refused_before_anything_is_submitted() {
    let (gpu, sim) = gpu();
    let m = gpu.load_module(CUBIN).unwrap();
    let empty = m.kernel("empty").unwrap();
    let one = LaunchConfig::linear(1, 32);
    let mut q = gpu.queue().unwrap();
    let prepared = q.prepare(&empty, &one).unwrap();
    let before = sim.launches().len();
    let refused = [
        Launch::new(&empty, &one, &[]).cooperative().programmatic(),
        Launch::new(&empty, &one, &[]).programmatic().cooperative(),
        Launch::new(&empty, &one, &[]).cooperative().chained(),
        Launch::new(&empty, &one, &[])
            .chained()
            .programmatic()
            .cooperative(),
        Launch::prepared(&prepared, &[]).cooperative(),
    ];
    for launch in &refused {
        // SAFETY: refused before anything runs.
        match unsafe { q.submit(launch) } {
            Err(Error::InvalidArgument(why)) => {
                assert!(why.contains("cooperative"), "{launch:?}: {why}")
            }
            other => panic!("{launch:?} was not refused: {other:?}"),
        }
        // SAFETY: as above.
        assert!(unsafe { q.submit_fenced(launch) }.is_err(), "{launch:?}");
    }
    q.synchronize().unwrap();
    assert_eq!(
        sim.launches().len(),
        before,
        "a refused launch reached the GPU"
    );
    // A cooperative launch alone is accepted.
    // SAFETY: the simulated GPU runs no kernels.
    let t = unsafe { q.submit(&Launch::new(&empty, &one, &[]).cooperative()) }.unwrap();
    q.fence(t).unwrap().wait(T).unwrap();
    assert_eq!(sim.launches().len(), before + 1);
}

#[test]
fn a_chained_links_ticket_completes_with_its_chains_part() {
    let Step {
        sim,
        step,
        v,
        one,
        mut q,
        prepared,
        ..
    } = chain_step();
    let before = sim.launches().len();
    // Long enough for several parts (the first part holds 8 links, each after it more), plain and programmatic
    // links, prepared and not.
    let mut tickets = Vec::new();
    for i in 0..40u64 {
        let args = [v.arg(), Arg::U64(i), Arg::U64(1)];
        let launch = if i % 3 == 0 {
            Launch::prepared(&prepared, &args)
        } else {
            Launch::new(&step, &one, &args)
        };
        let launch = if i % 2 == 1 {
            launch.chained().programmatic()
        } else {
            launch.chained()
        };
        // SAFETY: the simulated GPU runs no kernels.
        tickets.push(unsafe { q.submit(&launch) }.unwrap());
    }
    let end = q.end_chain().unwrap();
    let values: Vec<u64> = tickets.iter().map(|&t| value(&q, t)).collect();
    // Links of one part share its value; parts follow each other, the last one is the chain's end.
    assert!(values.windows(2).all(|w| w[0] <= w[1]), "{values:?}");
    assert!(values[0] < values[39], "one part for 40 links: {values:?}");
    assert!(values[..8].iter().all(|&x| x == values[0]), "{values:?}");
    assert_eq!(values[39], end.direct().unwrap().value());
    end.wait(T).unwrap();
    for &t in &tickets {
        assert!(q.fence(t).unwrap().is_done());
    }
    // Every link reached the GPU with its own arguments, in order.
    let ls = sim.launches()[before..].to_vec();
    assert_eq!(ls.len(), 40);
    for (i, l) in ls.iter().enumerate() {
        assert_eq!(l.params[8..16], (i as u64).to_le_bytes(), "link {i}");
    }

    // A link's ticket, then a plain launch: the plain launch sends the chain first and follows it.
    // SAFETY: as above.
    let (link, plain) = unsafe {
        let args = [v.arg(), Arg::U64(1), Arg::U64(1)];
        (
            q.submit(&Launch::new(&step, &one, &args).chained())
                .unwrap(),
            q.submit(&Launch::prepared(&prepared, &args)).unwrap(),
        )
    };
    assert_eq!(value(&q, link) + 1, value(&q, plain));
    q.fence(plain).unwrap().wait(T).unwrap();
    assert!(q.fence(link).unwrap().is_done());

    // A link sent by flush alone.
    // SAFETY: as above.
    let link = unsafe {
        q.submit(&Launch::new(&step, &one, &[v.arg(), Arg::U64(1), Arg::U64(1)]).chained())
    }
    .unwrap();
    q.flush().unwrap();
    q.fence(link).unwrap().wait(T).unwrap();
    // No chain is open any more.
    assert!(q.end_chain().is_err());
}

#[test]
fn a_prepared_launchs_ticket_allocates_nothing() {
    let Step {
        sim,
        v,
        mut q,
        prepared,
        ..
    } = chain_step();
    let args = [v.arg(), Arg::U64(3), Arg::U64(4)];
    // Warm up: every slot holds the prepared launch, and the programmatic gates exist.
    for _ in 0..300 {
        // SAFETY: the simulated GPU runs no kernels.
        unsafe {
            q.submit(&Launch::prepared(&prepared, &args)).unwrap();
            q.submit(&Launch::prepared(&prepared, &args).programmatic())
                .unwrap();
        }
    }
    q.synchronize().unwrap();
    let before = sim.launches().len();
    let (last, allocs) = allocations(|| {
        let mut last = None;
        for i in 0..200 {
            let launch = Launch::prepared(&prepared, &args);
            let launch = if i % 2 == 0 {
                launch
            } else {
                launch.programmatic()
            };
            // SAFETY: as above.
            last = Some(unsafe { q.submit(&launch) }.unwrap());
        }
        last
    });
    assert_eq!(allocs, 0, "prepared launches with tickets allocated");
    q.fence(last.unwrap()).unwrap().wait(T).unwrap();
    assert_eq!(sim.launches().len(), before + 200);
}

/// Doorbells the simulated GPU has seen, over every channel, once the model has had time to see the last one (it
/// counts a doorbell when it next polls, which may be after the work it sent is done).
fn doorbells(sim: &apex::sim::Simulator) -> u64 {
    std::thread::sleep(Duration::from_millis(50));
    sim.channel_stats().iter().map(|s| s.doorbells).sum()
}

#[test]
fn deferred_launches_ring_no_doorbell_until_one_sends_them_all() {
    let Step {
        sim,
        step,
        v,
        one,
        mut q,
        prepared,
        ..
    } = chain_step();
    q.synchronize().unwrap();
    let (launched, rung) = (sim.launches().len(), doorbells(&sim));
    // Prepared and not, plain and programmatic: none rings.
    let mut tickets = Vec::new();
    for i in 0..12u64 {
        let args = [v.arg(), Arg::U64(i), Arg::U64(1)];
        let launch = if i % 2 == 0 {
            Launch::prepared(&prepared, &args)
        } else {
            Launch::new(&step, &one, &args)
        };
        let launch = if i % 3 == 1 {
            launch.programmatic()
        } else {
            launch
        };
        // SAFETY: the simulated GPU runs no kernels.
        tickets.push(unsafe { q.submit(&launch.deferred()) }.unwrap());
    }
    assert_eq!(doorbells(&sim), rung, "a deferred launch rang the doorbell");
    assert!(!q.fence(tickets[11]).unwrap().is_done());
    // One flush sends them all, in order, each with its own arguments.
    q.flush().unwrap();
    q.fence(tickets[11]).unwrap().wait(T).unwrap();
    assert_eq!(doorbells(&sim), rung + 1);
    let ls = sim.launches()[launched..].to_vec();
    assert_eq!(ls.len(), 12);
    for (i, l) in ls.iter().enumerate() {
        assert_eq!(l.params[8..16], (i as u64).to_le_bytes(), "launch {i}");
    }

    // A deferred launch, then a plain one: the plain launch's doorbell sends both.
    let rung = doorbells(&sim);
    let args = [v.arg(), Arg::U64(1), Arg::U64(1)];
    // SAFETY: as above.
    let held = unsafe { q.submit(&Launch::prepared(&prepared, &args).deferred()) }.unwrap();
    assert_eq!(doorbells(&sim), rung, "a deferred launch rang the doorbell");
    assert!(!q.fence(held).unwrap().is_done());
    // SAFETY: as above.
    let plain = unsafe { q.submit(&Launch::prepared(&prepared, &args)) }.unwrap();
    q.fence(plain).unwrap().wait(T).unwrap();
    assert!(q.fence(held).unwrap().is_done());

    // Deferred launches allocate nothing either.
    let (_, allocs) = allocations(|| {
        for _ in 0..100 {
            // SAFETY: as above.
            unsafe { q.submit(&Launch::prepared(&prepared, &args).deferred()) }.unwrap();
        }
    });
    assert_eq!(allocs, 0, "deferred prepared launches allocated");
    q.synchronize().unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}
