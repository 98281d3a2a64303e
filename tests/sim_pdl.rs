//! Eager programmatic launches (`ComputeQueue::launch_programmatic`) against the simulated front end and work
//! distributor: every launch runs once and in stream order, a programmatic launch right after a kernel launch is
//! scheduled by that launch's slot gate (two count-downs, one null grid, no front-end wait), and anything else
//! between them makes it an ordinary launch again.

use std::time::Duration;

use apex::hw::qmd::v04::{
    CONSTANT_BUFFER_PREFETCH_PREFETCH_POST as PREFETCH_POST,
    CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE as PREFETCH_PRE,
};
use apex::launch::{Arg, ComputeQueueConfig, LaunchConfig, LaunchMemory};
use apex::module::Module;
use apex::pushbuf::decode::decode_qmd;
use apex::sim::{Launch, Simulator};

#[path = "support/sim.rs"]
mod sim;

const T: Duration = Duration::from_secs(30);
const PDL: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");

/// The `v` argument of a recorded `pdl_step(buf, n, v)` launch.
fn step_v(params: &[u8]) -> u32 {
    u32::from_le_bytes(params[12..16].try_into().unwrap())
}

#[test]
fn programmatic_launches_run_in_order_through_the_gates_and_fall_back_after_other_work() {
    let (gpu, sim, mut q, tests) = sim::setup_with(ComputeQueueConfig::default().with_slots(8));
    let pdl = Module::load(&gpu, PDL).unwrap();
    let step = pdl.kernel("pdl_step").unwrap();
    let empty = tests.kernel("empty").unwrap();
    let buf = sim::host_page(&gpu);
    let flag = sim::host_page(&gpu);
    flag.write(0, &1u64.to_le_bytes()).unwrap();
    let cfg = LaunchConfig::linear(4, 256);
    let one = LaunchConfig::linear(1, 1);
    let token = q.queue().channel().token();
    let stats = |sim: &Simulator| sim.stats_for(token).unwrap();
    let args = |v: u32| [Arg::Ptr(buf.va()), Arg::U32(1024), Arg::U32(v)];
    let prepared = q.prepare_launch(&step, &cfg).unwrap();
    assert!(!q.is_programmatic());
    // Before any programmatic launch a prepared launch is an ordinary one (no gates yet).
    // SAFETY: the model does not execute kernels.
    unsafe { q.launch_prepared(&prepared, &args(1000)) }
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(!q.is_programmatic());

    // The first programmatic launch builds the gates; nothing before it was gated, so it waits as usual.
    let before = sim.launches().len();
    let start = stats(&sim);
    // SAFETY: as above.
    unsafe { q.launch_programmatic(&step, &cfg, &args(0)) }.unwrap();
    assert!(q.is_programmatic());
    let mut expect = vec![Some(0)];
    // Then 199 more, around the 8 slots many times, with other work now and then. Counted as they go: programmatic
    // launches (each arms its gate), and those scheduled by the gate of the programmatic launch right before them.
    let (mut gated, mut scheduled) = (1u64, 0u64);
    // Whether the last submission was a programmatic launch (the only launches that arm a gate).
    let mut after_programmatic = true;
    let mut last = None;
    // A programmatic launch: scheduled by the gate of the launch before it when that one was programmatic too.
    let mut programmatic = |after: bool| {
        gated += 1;
        scheduled += u64::from(after);
    };
    for v in 1..200u32 {
        // SAFETY: the model does not execute kernels.
        let f = unsafe {
            match v % 17 {
                3 => {
                    // A plain launch carries no gate: the programmatic one after it waits in the front end.
                    q.launch(&empty, &one, &[]).unwrap();
                    expect.push(None);
                    programmatic(false);
                    q.launch_programmatic(&step, &cfg, &args(v))
                }
                5 => {
                    // Prepared launches may be programmatic too.
                    programmatic(after_programmatic);
                    q.launch_prepared_programmatic(&prepared, &args(v))
                }
                6 => {
                    after_programmatic = false;
                    q.launch_prepared(&prepared, &args(v))
                }
                7 | 9 | 13 | 15 => {
                    // A wait, an unordered launch, a copy or a join in between: an ordinary launch.
                    match v % 17 {
                        7 => drop(q.wait_value(flag.va(), 1).unwrap()),
                        9 => {
                            q.record_launch_unordered(&empty, &one, &[]).unwrap();
                            expect.push(None);
                        }
                        13 => drop(q.copy(buf.va() + 2048, buf.va() + 3072, 256).unwrap()),
                        _ => drop(q.join().unwrap()),
                    }
                    programmatic(false);
                    after_programmatic = true;
                    q.launch_programmatic(&step, &cfg, &args(v))
                }
                11 => {
                    after_programmatic = false;
                    q.launch(&step, &cfg, &args(v))
                }
                _ => {
                    programmatic(after_programmatic);
                    after_programmatic = true;
                    q.launch_programmatic(&step, &cfg, &args(v))
                }
            }
        }
        .unwrap();
        if v % 17 == 3 || v % 17 == 5 {
            after_programmatic = true;
        }
        expect.push(Some(v));
        last = Some(f);
    }
    last.unwrap().wait(T).unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    let got: Vec<Option<u32>> = sim.launches()[before..]
        .iter()
        .map(|l| (l.program_va == step.program_va()).then(|| step_v(&l.params)))
        .collect();
    assert_eq!(got, expect, "every launch once, in stream order");
    // Every gated launch arrives at a latch of its own; each gate-scheduled one waits on the latch of the launch
    // right before it (the model also faults a wait on a latch nothing arrived at).
    let launches = &sim.launches()[before..];
    let arrivals: Vec<u32> = launches.iter().filter_map(|l| l.latch_arrive).collect();
    let mut distinct = arrivals.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), arrivals.len(), "latch ids repeat");
    assert_eq!(arrivals.len() as u64, gated);
    let mut waits = 0;
    for pair in launches.windows(2) {
        if let Some(w) = pair[1].latch_wait {
            assert_eq!(
                Some(w),
                pair[0].latch_arrive,
                "a programmatic launch waits on the latch of the launch before it"
            );
            waits += 1;
        }
    }
    assert_eq!(waits, scheduled);
    // A gated QMD changes as the work distributor runs it: never read ahead of its launch. The plain launches
    // that waited were.
    for l in launches {
        assert!(
            !(l.prefetched && l.latch_arrive.is_some()),
            "a gated launch ran from a copy read ahead"
        );
    }
    assert!(launches.iter().any(|l| l.prefetched));
    let end = stats(&sim);
    assert!(scheduled > 100, "{scheduled}");
    // Each gate-scheduled launch: its gate ran once as a null grid after two count-downs, the pre-exit of the
    // launch before it and the front end's; every other gated launch's gate was counted down once and re-armed.
    assert_eq!(end.null_grids - start.null_grids, scheduled);
    assert_eq!(end.decrements - start.decrements, gated + scheduled);
}

/// What `n` programmatic `pdl_step` launches on a fresh queue built with `config` did, once checked to have run in
/// order without a fault: whether the queue built gates, and how many gates ran and count-downs happened.
struct Steps {
    programmatic: bool,
    null_grids: u64,
    decrements: u64,
}

fn programmatic_steps(config: ComputeQueueConfig, n: u32) -> Steps {
    let (gpu, sim, mut q, _) = sim::setup_with(config);
    let pdl = Module::load(&gpu, PDL).unwrap();
    let step = pdl.kernel("pdl_step").unwrap();
    let buf = sim::host_page(&gpu);
    let cfg = LaunchConfig::linear(2, 128);
    let token = q.queue().channel().token();
    let start = sim.stats_for(token).unwrap();
    let before = sim.launches().len();
    let mut last = None;
    for v in 0..n {
        let args = [Arg::Ptr(buf.va()), Arg::U32(512), Arg::U32(v)];
        // SAFETY: the model does not execute kernels.
        last = Some(unsafe { q.launch_programmatic(&step, &cfg, &args) }.unwrap());
    }
    last.unwrap().wait(T).unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    let got: Vec<u32> = sim.launches()[before..]
        .iter()
        .map(|l| step_v(&l.params))
        .collect();
    assert_eq!(got, (0..n).collect::<Vec<_>>(), "in order");
    let end = sim.stats_for(token).unwrap();
    Steps {
        programmatic: q.is_programmatic(),
        null_grids: end.null_grids - start.null_grids,
        decrements: end.decrements - start.decrements,
    }
}

#[test]
fn programmatic_launches_on_inline_qmd_queues_are_ordinary_launches() {
    let s = programmatic_steps(
        ComputeQueueConfig::default().with_memory(LaunchMemory::Host),
        20,
    );
    assert!(
        !s.programmatic,
        "an inline QMD cannot be scheduled later: no gates"
    );
    assert_eq!(s.null_grids, 0);
    assert_eq!(s.decrements, 0);
}

#[test]
fn a_queue_needs_two_slots_for_gates() {
    for slots in [1usize, 2, 3] {
        let s = programmatic_steps(ComputeQueueConfig::default().with_slots(slots), 12);
        if slots == 1 {
            // With one slot the next launch's gate would be its producer's own: no gates, ordinary launches.
            assert!(!s.programmatic);
            assert_eq!(s.null_grids, 0);
        } else {
            assert!(s.programmatic);
            assert_eq!(
                s.null_grids, 11,
                "{slots} slots: every launch after the first scheduled by a gate"
            );
        }
    }
}

#[test]
fn chained_programmatic_links_wait_on_the_latch_of_the_link_before() {
    // Parts of 4: a chain of 11 is sent as parts of 4, 4 and 3, each part's head after the part before.
    let (gpu, sim, mut q, _) = sim::setup_with(
        ComputeQueueConfig::default()
            .with_slots(8)
            .with_chain_part(4),
    );
    let pdl = Module::load(&gpu, PDL).unwrap();
    let step = pdl.kernel("pdl_step").unwrap();
    let buf = sim::host_page(&gpu);
    let cfg = LaunchConfig::linear(4, 256);
    let args = |v: u32| [Arg::Ptr(buf.va()), Arg::U32(1024), Arg::U32(v)];
    let token = q.queue().channel().token();
    let before = sim.launches().len();
    let start = sim.stats_for(token).unwrap();
    // Link 5 is an ordinary link: it waits for the completion of link 4, not for a latch.
    for v in 0..11u32 {
        // SAFETY: the model does not execute kernels.
        unsafe {
            if v == 5 {
                q.record_launch_chained(&step, &cfg, &args(v))
            } else {
                q.record_launch_chained_programmatic(&step, &cfg, &args(v))
            }
        }
        .unwrap();
    }
    q.end_chain().unwrap().wait(T).unwrap();
    let ls = &sim.launches()[before..];
    assert_eq!(
        ls.iter().map(|l| step_v(&l.params)).collect::<Vec<_>>(),
        (0..11).collect::<Vec<_>>(),
        "every link once, in order"
    );
    for (i, l) in ls.iter().enumerate() {
        // Part heads (0, 4, 8) and the ordinary link 5 wait for no latch; every other link waits on the latch the
        // link before it arrives at, and only such a producer arrives at one.
        let programmatic_link = !matches!(i, 0 | 4 | 5 | 8);
        if programmatic_link {
            let producer = &ls[i - 1];
            assert!(producer.latch_arrive.is_some(), "link {} arrives", i - 1);
            assert_eq!(l.latch_wait, producer.latch_arrive, "link {i}");
        } else {
            assert_eq!(l.latch_wait, None, "link {i}");
        }
        let feeds_programmatic = i + 1 < ls.len() && !matches!(i + 1, 4 | 5 | 8);
        assert_eq!(l.latch_arrive.is_some(), feeds_programmatic, "link {i}");
    }
    let latches: std::collections::HashSet<_> = ls.iter().filter_map(|l| l.latch_arrive).collect();
    assert_eq!(
        latches.len(),
        7,
        "each programmatic edge has a latch of its own"
    );
    // The QMD fields of a programmatic edge, as the model read them: the producer pre-exits and does not prefetch
    // its dependent's bank (that would land too late); the consumer requires its scheduling and prefetches its own
    // bank 0 (bank 5 at bank 0's address, before it starts); ordinary links do not pre-exit (a part's last link is
    // sent as a stream launch, whose pre-exit schedules nothing).
    let field = |l: &Launch, name: &str| {
        let bytes: Vec<u8> = l.qmd.iter().flat_map(|w| w.to_le_bytes()).collect();
        decode_qmd(4, &bytes)
            .unwrap()
            .into_iter()
            .find(|f| f.0 == name)
            .map_or(0, |f| f.1)
    };
    for (i, l) in ls.iter().enumerate() {
        let pre_exit = field(l, "ENABLE_PROGRAM_PRE_EXIT");
        if l.latch_arrive.is_some() {
            assert_eq!(pre_exit, 1, "link {i} lets its consumer start at pre-exit");
            assert_ne!(
                field(l, "CONSTANT_BUFFER_PREFETCH(6)"),
                u64::from(PREFETCH_POST),
                "link {i} prefetches nothing for its programmatic consumer"
            );
        } else if field(l, "DEPENDENT_QMD_ENABLE(0)") == 1 {
            // An ordinary link: its dependent starts only once it has completed.
            assert_eq!(pre_exit, 0, "link {i}");
        }
        if l.latch_wait.is_some() {
            assert_eq!(field(l, "REQUIRE_SCHEDULING_PCAS"), 1, "link {i}");
            assert_eq!(
                field(l, "CONSTANT_BUFFER_PREFETCH(5)"),
                u64::from(PREFETCH_PRE),
                "link {i} prefetches its own bank 0"
            );
            assert_eq!(
                field(l, "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(5)"),
                field(l, "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(0)"),
                "link {i}: bank 5 is bank 0"
            );
        }
    }
    // No gates: links schedule each other directly.
    let end = sim.stats_for(token).unwrap();
    assert_eq!(end.null_grids - start.null_grids, 0, "chains need no gates");
}
