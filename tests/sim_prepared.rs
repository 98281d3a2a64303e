//! Prepared launches against the simulated GPU front end: each launch the model sees must carry its own
//! arguments, shape, program and release, whichever launch held its slot before (prepared or not); a prepared
//! launch is refused on another queue, follows the queue's local memory, allocates nothing, and works with the
//! launch memory in host memory.

use std::sync::Arc;
use std::time::Duration;

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, Error, LaunchConfig, LaunchMemory};
use apex::module::Module;
use apex::pushbuf::{Armed, Submission};
use apex::rm::GpuCore;
use apex::sim::Simulator;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
#[path = "support/sim.rs"]
mod sim;
use counting_alloc::allocations;

const T: Duration = Duration::from_secs(30);

fn setup(config: ComputeQueueConfig) -> (Arc<GpuCore>, Simulator, ComputeQueue, Arc<Module>) {
    sim::setup_with(config)
}

/// Four slots, so that slots pass between prepared launches, ordinary launches and the two prepared shapes.
fn small(memory: LaunchMemory) -> ComputeQueueConfig {
    ComputeQueueConfig::default()
        .with_slots(4)
        .with_chain_part(4)
        .with_memory(memory)
}

fn every_launch_carries_its_own_arguments(memory: LaunchMemory) {
    let mut config = small(memory);
    // The fetched-QMD path in both memories (host memory picks inline QMDs by default).
    config.inline_qmd = false;
    every_launch_carries_its_own_arguments_with(config);
}

fn every_launch_carries_its_own_arguments_with(config: ComputeQueueConfig) {
    let (gpu, sim, mut q, module) = setup(config);
    let saxpy = module.kernel("saxpy").unwrap();
    let step = module.kernel("chain_step").unwrap();
    let out = sim::host_page(&gpu);
    let a = q
        .prepare_launch(&saxpy, &LaunchConfig::linear(3, 128))
        .unwrap();
    let b = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let before = sim.launches().len();
    let mut fences = Vec::new();
    // A pattern that is not a multiple of the slot count: every slot sees every kind of launch.
    for i in 0..45u32 {
        let f = match i % 5 {
            0 | 1 => {
                let args = [
                    Arg::F32(i as f32),
                    Arg::Ptr(out.va()),
                    Arg::Ptr(out.va() + 64),
                    Arg::U32(i),
                ];
                // SAFETY: the model does not execute kernels.
                unsafe { q.launch_prepared(&a, &args) }.unwrap()
            }
            2 | 3 => {
                let args = [Arg::Ptr(out.va()), Arg::U64(u64::from(i)), Arg::U64(7)];
                // SAFETY: as above.
                unsafe { q.launch_prepared(&b, &args) }.unwrap()
            }
            _ => {
                let args = [Arg::Ptr(out.va()), Arg::U64(u64::from(i)), Arg::U64(9)];
                // SAFETY: as above; an ordinary launch of another shape takes the slot in between.
                unsafe { q.launch(&step, &LaunchConfig::linear(2, 32), &args) }.unwrap()
            }
        };
        fences.push(f);
    }
    fences.last().unwrap().wait(T).unwrap();
    let launches = &sim.launches()[before..];
    assert_eq!(launches.len(), 45);
    let timeline = q.queue().timeline().va();
    for (i, (l, f)) in launches.iter().zip(&fences).enumerate() {
        let i = i as u32;
        assert_eq!(l.releases, vec![(timeline, f.value())], "launch {i}");
        assert_eq!(l.cbank0_va, l.qmd_va + 512, "launch {i}");
        match i % 5 {
            0 | 1 => {
                assert_eq!((l.grid, l.block), ([3, 1, 1], [128, 1, 1]), "launch {i}");
                assert_eq!(l.program_va, saxpy.program_va());
                assert_eq!(l.params[0..4], (i as f32).to_le_bytes());
                assert_eq!(l.params[8..16], out.va().to_le_bytes());
                assert_eq!(l.params[16..24], (out.va() + 64).to_le_bytes());
                assert_eq!(l.params[24..28], i.to_le_bytes());
                assert_eq!(
                    l.driver_words[0..3],
                    [128, 1, 1],
                    "blockDim in the driver words"
                );
            }
            2 | 3 => {
                assert_eq!((l.grid, l.block), ([1, 1, 1], [1, 1, 1]), "launch {i}");
                assert_eq!(l.program_va, step.program_va());
                assert_eq!(l.params[8..16], u64::from(i).to_le_bytes());
                assert_eq!(l.params[16..24], 7u64.to_le_bytes());
                assert_eq!(l.driver_words[0..3], [1, 1, 1]);
            }
            _ => {
                assert_eq!((l.grid, l.block), ([2, 1, 1], [32, 1, 1]), "launch {i}");
                assert_eq!(l.params[16..24], 9u64.to_le_bytes());
                assert_eq!(l.driver_words[0..3], [32, 1, 1]);
            }
        }
    }
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    assert!(sim.dropped_qmds().is_empty());
    let inline = sim
        .stats_for(q.queue().channel().token())
        .unwrap()
        .inline_qmds;
    assert_eq!(inline > 0, config.inline_qmd, "{inline} inline QMDs");
    // A fetched QMD that waits for the launch before it is read ahead of that wait, and runs as read then.
    let stats = sim.stats_for(q.queue().channel().token()).unwrap();
    assert_eq!(
        stats.qmd_prefetches > 0,
        !config.inline_qmd,
        "{} QMDs read ahead",
        stats.qmd_prefetches
    );
    assert_eq!(stats.prefetched_runs, stats.qmd_prefetches);
}

/// A launch in stream order whose QMD the GPU fetches has the work distributor read that QMD before the front end
/// waits for the launch ahead of it (PCAS INVALIDATE, then PREFETCH), and launch the copy once the wait is over
/// (PREFETCH_SCHEDULE), so that the fetch overlaps the work ahead. The model runs the copy read at the prefetch
/// (and reports a QMD rewritten after it), so each launch releasing its own timeline value shows the QMD was final
/// when it was read. Launches whose predecessor the CPU already saw complete need no wait and are launched as
/// before.
#[test]
fn launches_that_wait_have_their_qmds_read_ahead_of_the_wait() {
    for memory in [LaunchMemory::Video, LaunchMemory::Host] {
        let mut config = ComputeQueueConfig::default().with_memory(memory);
        config.inline_qmd = false;
        let (gpu, sim, mut q, module) = setup(config);
        let step = module.kernel("chain_step").unwrap();
        let out = sim::host_page(&gpu);
        let prepared = q
            .prepare_launch(&step, &LaunchConfig::linear(1, 1))
            .unwrap();
        let token = q.queue().channel().token();
        let start = sim.stats_for(token).unwrap();
        let before = sim.launches().len();
        let n = 300u64;
        let mut fences = Vec::new();
        for i in 0..n {
            let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
            // SAFETY: the model does not execute kernels.
            fences.push(
                unsafe {
                    if i % 3 == 0 {
                        q.launch(&step, &LaunchConfig::linear(1, 1), &args)
                    } else {
                        q.launch_prepared(&prepared, &args)
                    }
                }
                .unwrap(),
            );
        }
        fences.last().unwrap().wait(T).unwrap();
        assert!(sim.errors().is_empty(), "{:?}", sim.errors());
        let launches = &sim.launches()[before..];
        let got: Vec<u64> = launches
            .iter()
            .map(|l| u64::from_le_bytes(l.params[8..16].try_into().unwrap()))
            .collect();
        assert_eq!(
            got,
            (0..n).collect::<Vec<_>>(),
            "{memory:?}: in order, each once"
        );
        // The release payload is the QMD's own field: each launch, read ahead or not, released its own value.
        let timeline = q.queue().timeline().va();
        for (i, (l, f)) in launches.iter().zip(&fences).enumerate() {
            assert_eq!(
                l.releases,
                vec![(timeline, f.value())],
                "{memory:?}: launch {i}"
            );
        }
        assert!(launches.iter().any(|l| l.prefetched), "{memory:?}");
        let end = sim.stats_for(token).unwrap();
        let prefetches = end.qmd_prefetches - start.qmd_prefetches;
        // The queue learns of completions only when it reads the timeline (for a slot to reuse): most launches still
        // have a predecessor it has not seen complete.
        assert!(
            prefetches > n / 2 && prefetches <= n,
            "{memory:?}: {prefetches} of {n}"
        );
        assert_eq!(end.prefetched_runs - start.prefetched_runs, prefetches);
    }
    // Inline QMDs travel in the pushbuffer: nothing to read ahead.
    let (gpu, sim, mut q, module) =
        setup(ComputeQueueConfig::default().with_memory(LaunchMemory::Host));
    let step = module.kernel("chain_step").unwrap();
    let out = sim::host_page(&gpu);
    let args = [Arg::Ptr(out.va()), Arg::U64(1), Arg::U64(1)];
    for _ in 0..50 {
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch(&step, &LaunchConfig::linear(1, 1), &args) }.unwrap();
    }
    q.synchronize().unwrap();
    let stats = sim.stats_for(q.queue().channel().token()).unwrap();
    assert!(stats.inline_qmds >= 50);
    assert_eq!(stats.qmd_prefetches, 0);
}

#[test]
fn prepared_launches_carry_their_own_arguments_with_inline_qmds() {
    for memory in [LaunchMemory::Video, LaunchMemory::Host] {
        every_launch_carries_its_own_arguments_with(small(memory).with_inline_qmd(true));
    }
}

#[test]
fn inline_qmds_mix_with_chains_on_the_same_slots() {
    let (gpu, sim, mut q, module) = setup(small(LaunchMemory::Video).with_inline_qmd(true));
    let step = module.kernel("chain_step").unwrap();
    let out = sim::host_page(&gpu);
    let p = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let before = sim.launches().len();
    let mut want = Vec::new();
    for round in 0..6u64 {
        for i in 0..3u64 {
            let tag = round * 10 + i;
            let args = [Arg::Ptr(out.va()), Arg::U64(tag), Arg::U64(0)];
            // SAFETY: the model does not execute kernels.
            unsafe { q.record_launch_chained(&step, &LaunchConfig::linear(1, 1), &args) }.unwrap();
            want.push(tag);
        }
        q.end_chain().unwrap();
        let tag = round * 10 + 5;
        // SAFETY: as above.
        unsafe { q.launch_prepared(&p, &[Arg::Ptr(out.va()), Arg::U64(tag), Arg::U64(0)]) }
            .unwrap();
        want.push(tag);
    }
    q.synchronize().unwrap();
    let got: Vec<u64> = sim.launches()[before..]
        .iter()
        .map(|l| u64::from_le_bytes(l.params[8..16].try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn prepared_launches_carry_their_own_arguments_through_armed_slots() {
    // Four slots of 64 words: fetched launches go through the slots, inline ones (over 100 words) through the
    // ring after the slots left empty, so the two alternate and the slots are given up and armed again.
    let armed = Armed {
        slots: 4,
        slot_words: 64,
    };
    for memory in [LaunchMemory::Video, LaunchMemory::Host] {
        for inline_qmd in [false, true] {
            let mut config = small(memory);
            config.inline_qmd = inline_qmd;
            config.queue.submission = Submission::Armed(armed);
            every_launch_carries_its_own_arguments_with(config);
        }
    }
}

#[test]
fn prepared_launches_carry_their_own_arguments_in_video_memory() {
    every_launch_carries_its_own_arguments(LaunchMemory::Video);
}

#[test]
fn prepared_launches_carry_their_own_arguments_in_host_memory() {
    every_launch_carries_its_own_arguments(LaunchMemory::Host);
}

#[test]
fn host_launch_memory_skips_the_store_fence_and_video_memory_keeps_it() {
    let (_gpu, _sim, q, _m) = setup(small(LaunchMemory::Host));
    assert!(!q.queue().channel().needs_store_fence());
    let (_gpu, _sim, q, _m) = setup(small(LaunchMemory::Video));
    assert!(q.queue().channel().needs_store_fence());
}

#[test]
fn a_prepared_launch_is_refused_on_another_queue_before_anything_is_sent() {
    let (gpu, sim, mut q, module) = setup(small(LaunchMemory::Video));
    let step = module.kernel("chain_step").unwrap();
    let p = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let mut other = ComputeQueue::new(&gpu, small(LaunchMemory::Video)).unwrap();
    let before = sim.launches().len();
    let out = sim::host_page(&gpu);
    let args = [Arg::Ptr(out.va()), Arg::U64(1), Arg::U64(1)];
    // SAFETY: the model does not execute kernels.
    let e = unsafe { other.launch_prepared(&p, &args) }.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidLaunch { why, .. } if why.contains("prepare it on this queue")),
        "{e}"
    );
    // Wrong arguments are refused as for an ordinary launch.
    // SAFETY: as above.
    let e = unsafe { q.launch_prepared(&p, &[Arg::U32(1)]) }.unwrap_err();
    assert!(matches!(e, Error::Params(_)), "{e}");
    other.synchronize().unwrap();
    q.synchronize().unwrap();
    assert_eq!(sim.launches().len(), before);
}

#[test]
fn a_prepared_launch_follows_local_memory_grown_after_it_was_prepared() {
    let (gpu, sim, mut q, module) = setup(small(LaunchMemory::Video));
    let step = module.kernel("chain_step").unwrap();
    let spill = module.kernel("spill").unwrap();
    let p = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let out = sim::host_page(&gpu);
    let args = [Arg::Ptr(out.va()), Arg::U64(1), Arg::U64(1)];
    // SAFETY: the model does not execute kernels.
    unsafe { q.launch_prepared(&p, &args) }.unwrap();
    let before = q.local_bytes_per_thread();
    // SAFETY: as above.
    unsafe {
        q.launch(
            &spill,
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(out.va()), Arg::U32(1), Arg::U32(64)],
        )
    }
    .unwrap();
    assert!(q.local_bytes_per_thread() > before);
    for _ in 0..6 {
        // SAFETY: as above.
        unsafe { q.launch_prepared(&p, &args) }.unwrap();
    }
    q.synchronize().unwrap();
    let launches = sim.launches();
    for l in &launches[launches.len() - 6..] {
        assert_eq!(l.program_va, step.program_va());
        assert_eq!(l.local_bytes_per_thread, q.local_bytes_per_thread());
    }
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_prepared_launch_allocates_nothing() {
    let (gpu, sim, mut q, module) =
        setup(ComputeQueueConfig::default().with_memory(LaunchMemory::Host));
    let step = module.kernel("chain_step").unwrap();
    let p = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let out = sim::host_page(&gpu);
    let before = sim.launches().len();
    // Warm: every slot once, so the pushbuffer and slot bookkeeping are in steady state.
    for i in 0..300u64 {
        let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch_prepared(&p, &args) }.unwrap();
    }
    q.synchronize().unwrap();
    let (last, allocs) = allocations(|| {
        let mut last = None;
        for i in 0..200u64 {
            let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
            // SAFETY: as above.
            last = Some(unsafe { q.launch_prepared(&p, &args) }.unwrap());
        }
        last
    });
    assert_eq!(allocs, 0, "heap allocations in 200 prepared launches");
    last.unwrap().wait(T).unwrap();
    assert_eq!(sim.launches().len() - before, 500);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn programmatic_launches_allocate_nothing_once_the_gates_exist() {
    let (gpu, sim, mut q, module) = setup(ComputeQueueConfig::default());
    let step = module.kernel("chain_step").unwrap();
    let one = LaunchConfig::linear(1, 1);
    let p = q.prepare_launch(&step, &one).unwrap();
    let out = sim::host_page(&gpu);
    let before = sim.launches().len();
    // Warm: the first programmatic launch builds the gates; then every slot once.
    for i in 0..300u64 {
        let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch_programmatic(&step, &one, &args) }.unwrap();
    }
    q.synchronize().unwrap();
    assert!(q.is_programmatic());
    let (last, allocs) = allocations(|| {
        let mut last = None;
        for i in 0..200u64 {
            let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
            // SAFETY: as above.
            last = Some(
                unsafe {
                    if i % 2 == 0 {
                        q.launch_programmatic(&step, &one, &args)
                    } else {
                        q.launch_prepared_programmatic(&p, &args)
                    }
                }
                .unwrap(),
            );
        }
        last
    });
    assert_eq!(allocs, 0, "heap allocations in 200 programmatic launches");
    last.unwrap().wait(T).unwrap();
    assert_eq!(sim.launches().len() - before, 500);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn an_unfenced_launch_allocates_nothing_and_its_value_makes_the_fence() {
    let mut config = ComputeQueueConfig::default().with_memory(LaunchMemory::Host);
    config.inline_qmd = false;
    config.queue.submission = Submission::Armed(Armed::default());
    let (gpu, sim, mut q, module) = setup(config);
    let step = module.kernel("chain_step").unwrap();
    let p = q
        .prepare_launch(&step, &LaunchConfig::linear(1, 1))
        .unwrap();
    let out = sim::host_page(&gpu);
    let before = sim.launches().len();
    for i in 0..300u64 {
        let args = [Arg::Ptr(out.va()), Arg::U64(i), Arg::U64(1)];
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch_prepared_value(&p, &args) }.unwrap();
    }
    q.synchronize().unwrap();
    let first = q.queue().last_submitted() + 1;
    let (values, allocs) = allocations(|| {
        let mut values = [0u64; 200];
        for (i, v) in values.iter_mut().enumerate() {
            let args = [Arg::Ptr(out.va()), Arg::U64(i as u64), Arg::U64(1)];
            // SAFETY: as above.
            *v = unsafe { q.launch_prepared_value(&p, &args) }.unwrap();
        }
        values
    });
    assert_eq!(
        allocs, 0,
        "heap allocations in 200 unfenced prepared launches"
    );
    // One value each, in order: the launches' places on the queue's timeline.
    assert!(
        values
            .iter()
            .enumerate()
            .all(|(i, v)| *v == first + i as u64)
    );
    q.fence_for(values[199]).wait(T).unwrap();
    let launches = &sim.launches()[before..];
    assert_eq!(launches.len(), 500);
    let timeline = q.queue().timeline().va();
    for (l, v) in launches[300..].iter().zip(values) {
        assert_eq!(l.releases, vec![(timeline, v)]);
    }
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}
