//! Real ComputeQueue launches of the test cubin against the simulated GPU front end: what the model records must
//! be what was asked, V03 QMDs are dropped like Hopper drops them, and bad launches never reach the ring.

use std::sync::Arc;
use std::time::Duration;

use apex::launch::qmd::{self, ConstBuffer, QMD_WORDS, QmdParams, QmdVersion};
use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, Error, FIRST_CHAIN_PART, LaunchConfig};
use apex::module::{Kernel, Module};
use apex::pushbuf::Signal;
use apex::rm::{GpuCore, Memory, MemoryDesc};
use apex::sim::{QmdViolation, SimErrorKind, Simulator, XID_GRAPHICS};

#[path = "support/sim.rs"]
mod sim;
const T: Duration = Duration::from_secs(30);

fn setup() -> (Arc<GpuCore>, Simulator, ComputeQueue, Arc<Module>) {
    setup_with(ComputeQueueConfig::default())
}

fn setup_with(config: ComputeQueueConfig) -> (Arc<GpuCore>, Simulator, ComputeQueue, Arc<Module>) {
    sim::setup_with(config)
}

fn page(gpu: &Arc<GpuCore>) -> Memory {
    sim::host_page(gpu)
}

#[test]
fn launches_are_recorded_as_asked_in_order() {
    let (gpu, sim, mut q, module) = setup();
    let saxpy = module.kernel("saxpy").unwrap();
    let big = module.kernel("big_param").unwrap();
    let x = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu()).unwrap();
    let y = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu()).unwrap();
    let words: Vec<u8> = (0..1024u32)
        .flat_map(|w| (w * 7 + 1).to_le_bytes())
        .collect();
    let before = sim.launches().len();
    let mut fences = Vec::new();
    for i in 0..40u32 {
        let f = if i % 2 == 0 {
            let cfg = LaunchConfig::linear(i + 1, 256);
            let args = [
                Arg::F32(1.5 + i as f32),
                Arg::Ptr(x.va()),
                Arg::Ptr(y.va()),
                Arg::U32(1000 + i),
            ];
            // SAFETY: the model does not execute kernels.
            unsafe { q.launch(&saxpy, &cfg, &args) }.unwrap()
        } else {
            let cfg = LaunchConfig::linear(4, 256);
            // SAFETY: as above.
            unsafe { q.launch(&big, &cfg, &[Arg::Ptr(x.va()), Arg::Bytes(&words)]) }.unwrap()
        };
        fences.push((i, f));
    }
    for (_, f) in &fences {
        f.wait(T).unwrap();
    }
    let launches = sim.launches();
    assert_eq!(launches.len() - before, 40);
    let timeline = q.queue().timeline().va();
    for ((i, f), l) in fences.iter().zip(&launches[before..]) {
        assert_eq!(l.token, q.queue().channel().token());
        assert_eq!(
            l.releases,
            vec![(timeline, f.value())],
            "launch {i} releases its fence"
        );
        assert_eq!(l.cbank0_va, l.qmd_va + 512);
        if i % 2 == 0 {
            assert_eq!((l.grid, l.block), ([i + 1, 1, 1], [256, 1, 1]));
            assert_eq!(l.program_va, saxpy.program_va());
            assert_eq!(l.params[0..4], (1.5 + *i as f32).to_le_bytes());
            assert_eq!(l.params[8..16], x.va().to_le_bytes());
            assert_eq!(l.params[16..24], y.va().to_le_bytes());
            assert_eq!(l.params[24..28], (1000 + i).to_le_bytes());
            assert_eq!(l.registers, saxpy.info().registers);
        } else {
            assert_eq!((l.grid, l.block), ([4, 1, 1], [256, 1, 1]));
            assert_eq!(l.program_va, big.program_va());
            assert!(l.params.len() >= 8 + 4096);
            assert_eq!(l.params[0..8], x.va().to_le_bytes());
            assert_eq!(l.params[8..8 + 4096], words[..]);
        }
        assert!(l.local_bytes_per_thread > 0);
    }
    let s = sim.stats_for(q.queue().channel().token()).unwrap();
    assert!(
        s.cache_invalidations >= 1,
        "a new module invalidates the caches"
    );
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    assert!(sim.dropped_qmds().is_empty());
}

/// A QMD like the queue's for `saxpy`, written to fresh memory with a cbank0 that passes the checks.
fn raw_qmd(
    gpu: &Arc<GpuCore>,
    q: &ComputeQueue,
    module: &Arc<Module>,
    version: QmdVersion,
    release: (u64, u64),
) -> Memory {
    let k = module.kernel("saxpy").unwrap();
    let mem = Memory::alloc(gpu, MemoryDesc::video(0x2000).with_cpu().low()).unwrap();
    mem.fill(0, 0x2000, 0).unwrap();
    let cb = mem.va() + 0x1000;
    let mut driver = [0u32; 11];
    apex::launch::cbank::write_driver_words(
        &mut driver,
        [32, 1, 1],
        [1, 1, 1],
        q.shared_window(),
        q.local_window(),
    );
    mem.write_words(0x1000, &driver).unwrap();
    let mut cluster = [0u32; apex::launch::cbank::CLUSTER_WORDS];
    apex::launch::cbank::write_cluster_words(&mut cluster, [1, 1, 1], None);
    mem.write_words(
        0x1000 + apex::launch::cbank::CLUSTER_WORDS_START as u64,
        &cluster,
    )
    .unwrap();
    let block = apex::launch::cbank::param_block_words(cb, k.info().param_cbank_size);
    mem.write_words(
        0x1000 + apex::launch::cbank::PARAM_BLOCK_START as u64,
        &block,
    )
    .unwrap();
    let mut cbs = [None; 8];
    cbs[0] = Some(ConstBuffer {
        va: cb,
        size: 0x300,
    });
    let p = QmdParams {
        sm_version: 90,
        program_va: k.program_va(),
        program_bytes: k.info().code_size,
        registers: k.info().registers,
        barriers: 1,
        grid: [1, 1, 1],
        block: [32, 1, 1],
        shared_bytes: 0x400,
        local_bytes_per_thread: q.local_bytes_per_thread(),
        const_buffers: cbs,
        release: Some(release),
        cluster: None,
        sync_domain: 0,
        cluster_load_balancing: false,
    };
    let mut words = [0u32; QMD_WORDS];
    qmd::build(version, &p, &mut words).unwrap();
    mem.write_words(0, &words[..version.size_bytes() / 4])
        .unwrap();
    mem
}

#[test]
fn a_v03_qmd_is_dropped_and_never_released() {
    let (gpu, sim, mut q, module) = setup();
    let aux = page(&gpu);
    // Control: the same QMD as V04 runs and releases.
    let v4 = raw_qmd(&gpu, &q, &module, QmdVersion::V04, (aux.va(), 11));
    let v4va = v4.va();
    let f = q
        .queue_mut()
        .submit(8, Signal::Host, |p, _| p.send_pcas(v4va))
        .unwrap();
    f.wait(T).unwrap();
    assert_eq!(aux.read_u64_volatile(0).unwrap(), 11);

    let v3 = raw_qmd(&gpu, &q, &module, QmdVersion::V03, (aux.va() + 16, 12));
    let v3va = v3.va();
    let f = q
        .queue_mut()
        .submit(8, Signal::Host, |p, _| p.send_pcas(v3va))
        .unwrap();
    f.wait(T).unwrap();
    assert_eq!(
        aux.read_u64_volatile(16).unwrap(),
        0,
        "a dropped QMD releases nothing"
    );
    let dropped = sim.dropped_qmds();
    assert_eq!(dropped.len(), 1);
    assert_eq!((dropped[0].qmd_va, dropped[0].major_version), (v3va, 3));
    assert!(sim.launches().iter().all(|l| l.qmd_va != v3va));
    assert!(
        sim.errors().is_empty(),
        "dropping is silent: {:?}",
        sim.errors()
    );
}

#[test]
fn a_bad_qmd_faults_the_channel_with_the_field_named() {
    let (gpu, sim, mut q, module) = setup();
    let aux = page(&gpu);
    let bad = raw_qmd(&gpu, &q, &module, QmdVersion::V04, (aux.va(), 1));
    let mut words = vec![0u32; 96];
    for (i, w) in words.iter_mut().enumerate() {
        *w = u32::from_le_bytes({
            let mut b = [0u8; 4];
            bad.read(i as u64 * 4, &mut b).unwrap();
            b
        });
    }
    apex::hw::qmd::v04::GRID_HEIGHT.set(&mut words, 0).unwrap();
    bad.write_words(0, &words).unwrap();
    let va = bad.va();
    let f = q
        .queue_mut()
        .submit(8, Signal::Host, |p, _| p.send_pcas(va))
        .unwrap();
    let e = f.wait(T).unwrap_err();
    assert!(e.to_string().contains("faulted"), "{e}");
    assert_eq!(
        q.queue().channel().fault().map(|f| f.info32),
        Some(XID_GRAPHICS)
    );
    let errs = sim.errors();
    assert!(
        matches!(&errs[..], [e] if matches!(&e.kind, SimErrorKind::BadQmd { violation: QmdViolation::Grid { axis: "y", .. }, .. })),
        "{errs:?}"
    );
    assert_eq!(aux.read_u64_volatile(0).unwrap(), 0);
}

#[test]
fn bad_launches_never_reach_the_model() {
    let (gpu, sim, mut q, module) = setup();
    let saxpy = module.kernel("saxpy").unwrap();
    let x = Memory::alloc(&gpu, MemoryDesc::video(4096)).unwrap();
    let args = [
        Arg::F32(1.0),
        Arg::Ptr(x.va()),
        Arg::Ptr(x.va()),
        Arg::U32(1),
    ];
    q.synchronize().unwrap();
    let methods = sim.stats_for(q.queue().channel().token()).unwrap().methods;
    let launches = sim.launches().len();
    let cases = [
        (LaunchConfig::linear(0, 32), &args[..]),
        (
            LaunchConfig::linear(1, 32).with_shared_bytes(300 << 10),
            &args[..],
        ),
        (LaunchConfig::linear(1, 32), &args[..3]),
        (LaunchConfig::linear(1, 2048), &args[..]),
    ];
    for (cfg, a) in cases {
        // SAFETY: refused before anything is submitted.
        let e = unsafe { q.launch(&saxpy, &cfg, a) }.unwrap_err();
        assert!(
            matches!(e, Error::InvalidLaunch { .. } | Error::Params(_)),
            "{e}"
        );
    }
    q.synchronize().unwrap();
    sim.run_until_idle(10);
    assert_eq!(
        sim.stats_for(q.queue().channel().token()).unwrap().methods,
        methods
    );
    assert_eq!(sim.launches().len(), launches);
    assert!(sim.errors().is_empty());
}

/// The parameters the model recorded for a `chain_step(value, mul, add)` launch.
fn chain_step_args(params: &[u8]) -> (u64, u64, u64) {
    let w = |i: usize| u64::from_le_bytes(params[i * 8..i * 8 + 8].try_into().unwrap());
    (w(0), w(1), w(2))
}

#[test]
fn a_chain_runs_every_link_in_order_and_releases_once_at_its_end() {
    let (gpu, sim, mut q, module) = setup();
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let before = sim.launches().len();
    let cfg = LaunchConfig::linear(1, 1);
    for i in 0..5u64 {
        // SAFETY: the model does not execute kernels.
        unsafe {
            q.record_launch_chained(
                &k,
                &cfg,
                &[Arg::Ptr(v.va()), Arg::U64(i), Arg::U64(100 + i)],
            )
        }
        .unwrap();
        assert_eq!(q.chain_len(), i as usize + 1);
    }
    // Nothing reaches the GPU before the chain ends.
    sim.wait_for(Duration::from_millis(50), |s| s.launches().len() > before);
    assert_eq!(sim.launches().len(), before);
    let fence = q.end_chain().unwrap();
    assert_eq!(q.chain_len(), 0);
    fence.wait(Duration::from_secs(2)).unwrap_or_else(|e| {
        panic!(
            "{e}: {:?} {} {:?} value {}",
            sim.errors(),
            sim.launches().len() - before,
            sim.channel_stats(),
            fence.value()
        )
    });
    let launches = sim.launches();
    assert_eq!(launches.len() - before, 5);
    let timeline = q.queue().timeline().va();
    for (i, l) in launches[before..].iter().enumerate() {
        assert_eq!(
            chain_step_args(&l.params),
            (v.va(), i as u64, 100 + i as u64)
        );
        let releases = if i == 4 {
            vec![(timeline, fence.value())]
        } else {
            vec![]
        };
        assert_eq!(l.releases, releases, "link {i}");
    }
    // The links sit in consecutive slots, so the next chain reuses none of them while they may run.
    let slots: Vec<u64> = launches[before..].iter().map(|l| l.qmd_va).collect();
    assert!(slots.windows(2).all(|w| w[1] > w[0]));
    assert!(matches!(q.end_chain(), Err(Error::NoChain)));
}

#[test]
fn a_chain_starts_with_a_small_part_and_doubles_its_parts() {
    // The GPU starts on a chain once FIRST_CHAIN_PART links are recorded; later parts double up to chain_part, and
    // a new chain starts small again.
    let (gpu, sim, mut q, module) = setup_with(ComputeQueueConfig::default().with_chain_part(32));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let before = sim.launches().len();
    let cfg = LaunchConfig::linear(1, 1);
    let mut parts = Vec::new();
    for round in 0..2u64 {
        let mut open = 0;
        for i in 0..100u64 {
            let args = [Arg::Ptr(v.va()), Arg::U64(round), Arg::U64(i)];
            // SAFETY: the model does not execute kernels.
            unsafe { q.record_launch_chained(&k, &cfg, &args) }.unwrap();
            if q.chain_len() == 1 && open > 0 {
                parts.push(open);
            }
            open = q.chain_len();
        }
        parts.push(open);
        q.end_chain().unwrap().wait(T).unwrap();
    }
    assert_eq!(
        parts,
        [8, 16, 32, 32, 12, 8, 16, 32, 32, 12],
        "part sizes (FIRST_CHAIN_PART = {FIRST_CHAIN_PART})"
    );
    let launches = sim.launches();
    assert_eq!(launches.len() - before, 200);
    for (n, l) in launches[before..].iter().enumerate() {
        let (round, i) = (n as u64 / 100, n as u64 % 100);
        assert_eq!(chain_step_args(&l.params), (v.va(), round, i), "launch {n}");
    }
    assert!(sim.errors().is_empty());
}

#[test]
fn a_chain_longer_than_the_slots_is_sent_in_parts_in_order() {
    let (gpu, sim, mut q, module) = setup_with(ComputeQueueConfig::default().with_slots(8));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let before = sim.launches().len();
    let cfg = LaunchConfig::linear(1, 1);
    for round in 0..3u64 {
        for i in 0..21u64 {
            let args = [Arg::Ptr(v.va()), Arg::U64(round), Arg::U64(i)];
            // SAFETY: the model does not execute kernels.
            unsafe { q.record_launch_chained(&k, &cfg, &args) }.unwrap();
            assert!(q.chain_len() <= 8);
        }
        q.end_chain().unwrap().wait(T).unwrap();
    }
    let launches = sim.launches();
    assert_eq!(launches.len() - before, 63);
    for (n, l) in launches[before..].iter().enumerate() {
        let (round, i) = (n as u64 / 21, n as u64 % 21);
        assert_eq!(chain_step_args(&l.params), (v.va(), round, i), "launch {n}");
    }
    assert!(sim.errors().is_empty());
}

#[test]
fn other_work_and_dropping_the_queue_end_an_open_chain_first() {
    let (gpu, sim, mut q, module) = setup();
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    let step = |q: &mut ComputeQueue, tag: u64| {
        // SAFETY: the model does not execute kernels.
        unsafe {
            q.record_launch_chained(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(tag), Arg::U64(0)])
        }
        .unwrap()
    };
    step(&mut q, 1);
    step(&mut q, 2);
    // An ordered launch after an open chain: the chain is sent first and the launch waits for it.
    // SAFETY: as above.
    let f = unsafe { q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(0)]) }.unwrap();
    f.wait(T).unwrap();
    step(&mut q, 4);
    q.synchronize().unwrap();
    step(&mut q, 5);
    step(&mut q, 6);
    drop(q);
    let tags: Vec<u64> = sim.launches()[before..]
        .iter()
        .map(|l| chain_step_args(&l.params).1)
        .collect();
    assert_eq!(tags, [1, 2, 3, 4, 5, 6]);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_launch_that_grows_local_memory_releases_the_value_its_fence_waits_for() {
    let (gpu, sim, mut q, module) = setup();
    let spill = module.kernel("spill").unwrap();
    let step = module.kernel("chain_step").unwrap();
    assert!(spill.info().min_stack_size + 0x240 > q.local_bytes_per_thread());
    let out = page(&gpu);
    let spill_args = [Arg::Ptr(out.va()), Arg::U32(1), Arg::U32(64)];
    let before = q.local_bytes_per_thread();
    // SAFETY: the model does not execute kernels.
    let f = unsafe { q.launch(&spill, &LaunchConfig::linear(1, 32), &spill_args) }.unwrap();
    f.wait(T).unwrap();
    assert!(q.local_bytes_per_thread() > before);

    // Inside a chain: the links recorded so far are sent before local memory changes, then the chain goes on.
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let first = sim.launches().len();
    for tag in 1..=2 {
        let args = [Arg::Ptr(out.va()), Arg::U64(tag), Arg::U64(0)];
        // SAFETY: as above.
        unsafe { q.record_launch_chained(&step, &LaunchConfig::linear(1, 1), &args) }.unwrap();
    }
    // SAFETY: as above.
    unsafe { q.record_launch_chained(&spill, &LaunchConfig::linear(1, 32), &spill_args) }.unwrap();
    assert_eq!(q.chain_len(), 1);
    q.end_chain().unwrap().wait(T).unwrap();
    let programs: Vec<u64> = sim.launches()[first..]
        .iter()
        .map(|l| l.program_va)
        .collect();
    assert_eq!(
        programs,
        [step.program_va(), step.program_va(), spill.program_va()]
    );
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_long_chain_is_sent_part_by_part_while_it_is_recorded() {
    let (gpu, sim, mut q, module) = setup_with(ComputeQueueConfig::default().with_chain_part(4));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let before = sim.launches().len();
    for i in 0..10u64 {
        let args = [Arg::Ptr(v.va()), Arg::U64(i), Arg::U64(0)];
        // SAFETY: the model does not execute kernels.
        unsafe { q.record_launch_chained(&k, &LaunchConfig::linear(1, 1), &args) }.unwrap();
    }
    // Two parts of four are on their way; the last two links wait for end_chain.
    assert_eq!(q.chain_len(), 2);
    assert!(sim.wait_for(T, |s| s.launches().len() == before + 8));
    q.end_chain().unwrap().wait(T).unwrap();
    let tags: Vec<u64> = sim.launches()[before..]
        .iter()
        .map(|l| chain_step_args(&l.params).1)
        .collect();
    assert_eq!(tags, (0..10).collect::<Vec<_>>());
}

#[test]
fn a_launch_right_after_a_wait_needs_no_acquire_of_its_own() {
    let (gpu, sim, mut q, module) = setup();
    let k = module.kernel("empty").unwrap();
    let one = LaunchConfig::linear(1, 1);
    let flag = page(&gpu);
    flag.write(0, &1u64.to_le_bytes()).unwrap();
    let token = q.queue().channel().token();
    // SAFETY: the model does not execute kernels.
    unsafe { q.launch(&k, &one, &[]) }.unwrap().wait(T).unwrap();
    sim.pause();
    // SAFETY: as above.
    let first = unsafe { q.launch(&k, &one, &[]) }.unwrap();
    let before = sim.stats_for(token).unwrap();
    q.wait_value(flag.va(), 1).unwrap();
    q.wait_value(flag.va(), 1).unwrap();
    // SAFETY: as above.
    let last = unsafe { q.launch(&k, &one, &[]) }.unwrap();
    sim.resume();
    last.wait(T).unwrap();
    assert!(first.is_done());
    let after = sim.stats_for(token).unwrap();
    // The first wait acquires the flag and the launch before it; the second only the flag (the front end released
    // the first wait's value after its acquires); the launch after them nothing.
    assert_eq!(after.acquires - before.acquires, 3);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

/// Launches `chain_step` (`k`) over `cfg` once per tag, in stream order, writing through `v`.
fn launch_tags(
    q: &mut ComputeQueue,
    k: &Kernel,
    cfg: &LaunchConfig,
    v: u64,
    tags: impl IntoIterator<Item = u64>,
) {
    for tag in tags {
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch(k, cfg, &[Arg::Ptr(v), Arg::U64(tag), Arg::U64(0)]) }.unwrap();
    }
}

/// Records `chain_step` (`k`) over `cfg` once per tag as links of the queue's open chain.
fn chain_tags(
    q: &mut ComputeQueue,
    k: &Kernel,
    cfg: &LaunchConfig,
    v: u64,
    tags: impl IntoIterator<Item = u64>,
) {
    for tag in tags {
        // SAFETY: the model does not execute kernels.
        unsafe { q.record_launch_chained(k, cfg, &[Arg::Ptr(v), Arg::U64(tag), Arg::U64(0)]) }
            .unwrap();
    }
}

/// Tags of the `chain_step` launches the model saw after `before`, in the order it ran them.
fn tags_after(sim: &Simulator, before: usize) -> Vec<u64> {
    sim.launches()[before..]
        .iter()
        .map(|l| chain_step_args(&l.params).1)
        .collect()
}

#[test]
fn a_chained_stream_holds_launches_while_busy_and_sends_them_when_the_gpu_catches_up() {
    let (gpu, sim, mut q, module) =
        setup_with(ComputeQueueConfig::default().with_chained_stream(true));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    // SAFETY (every launch below): the model does not execute kernels.
    let launch = |q: &mut ComputeQueue, tag: u64| unsafe {
        q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(tag), Arg::U64(0)])
            .unwrap()
    };
    // The queue is idle: the first launch is sent at once (a lone launch is never held).
    sim.pause();
    let first = launch(&mut q, 0);
    assert_eq!(
        q.chain_len(),
        0,
        "a launch on an idle queue is sent at once"
    );
    // The GPU has not run it: the launches after it are held as links, and ring no doorbell (the GPU reads nothing
    // of them before their part is sent).
    let doorbells = q.queue().channel().kicks();
    let mut held = Vec::new();
    for tag in 1..=5 {
        held.push(launch(&mut q, tag));
        assert_eq!(q.chain_len(), tag as usize);
    }
    assert_eq!(
        q.queue().channel().kicks(),
        doorbells,
        "a held launch rang the doorbell"
    );
    sim.resume();
    first.wait(T).unwrap();
    assert_eq!(
        sim.launches().len() - before,
        1,
        "held links were sent early"
    );
    // The GPU is done with what was sent: the next launch sends the held links with itself.
    let last = launch(&mut q, 6);
    assert_eq!(q.chain_len(), 0);
    assert_eq!(
        q.queue().channel().kicks(),
        doorbells + 1,
        "the links are sent under one doorbell"
    );
    last.wait(T).unwrap();
    for f in &held {
        assert!(f.is_done(), "a held launch's fence is the chain's");
    }
    assert_eq!(tags_after(&sim, before), [0, 1, 2, 3, 4, 5, 6]);
    // One release for the lone launch, one at the end of the chain; the links in between release nothing.
    let releases: Vec<usize> = sim.launches()[before..]
        .iter()
        .map(|l| l.releases.len())
        .collect();
    assert_eq!(releases, [1, 0, 0, 0, 0, 0, 1]);
    assert_eq!(held[0].value(), last.value());
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_chained_stream_sends_held_links_before_other_work_and_on_flush() {
    let (gpu, sim, mut q, module) =
        setup_with(ComputeQueueConfig::default().with_chained_stream(true));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    // SAFETY (every launch below): the model does not execute kernels.
    let launch = |q: &mut ComputeQueue, tag: u64| unsafe {
        q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(tag), Arg::U64(0)])
            .unwrap()
    };
    let prepared = q.prepare_launch(&k, &cfg).unwrap();
    sim.pause();
    launch(&mut q, 1);
    launch(&mut q, 2);
    // A prepared launch is held too, in its place.
    // SAFETY: as above.
    unsafe { q.launch_prepared(&prepared, &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(0)]) }.unwrap();
    assert_eq!(q.chain_len(), 2);
    // A copy is other work: the held links go first, and the copy waits for them.
    let copied = q.copy(v.va(), v.va() + 64, 8).unwrap();
    assert_eq!(q.chain_len(), 0);
    launch(&mut q, 4);
    assert_eq!(q.chain_len(), 1);
    q.flush_held().unwrap();
    assert_eq!(q.chain_len(), 0);
    sim.resume();
    copied.wait(T).unwrap();
    q.synchronize().unwrap();
    let tags: Vec<u64> = tags_after(&sim, before)
        .into_iter()
        .filter(|t| *t != 0)
        .collect();
    assert_eq!(tags, [1, 2, 3, 4], "the copy's own kernel aside");
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn a_chained_stream_sends_long_bursts_part_by_part_in_order() {
    let (gpu, sim, mut q, module) = setup_with(
        ComputeQueueConfig::default()
            .with_chained_stream(true)
            .with_chain_part(32),
    );
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    sim.pause();
    let mut longest = 0;
    // Fewer than the 256 slots: with the model paused, a launch past them would wait for a slot.
    for tag in 1..=200u64 {
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(tag), Arg::U64(0)]) }.unwrap();
        longest = longest.max(q.chain_len());
    }
    // Held links never exceed a part: full parts are sent while the GPU is still busy.
    assert_eq!(longest, 32);
    // The last part too, before the model runs anything.
    q.flush_held().unwrap();
    sim.resume();
    q.synchronize().unwrap();
    assert_eq!(tags_after(&sim, before), (1..=200).collect::<Vec<u64>>());
    // Every part's head waits for work the queue has not seen complete, so it is read ahead of that wait (and run
    // as read); the links after a head are scheduled by the link before it, and the lone first launch, sent to an
    // idle queue, waits for nothing: neither is read ahead.
    let launches = &sim.launches()[before..];
    let heads: Vec<u64> = launches
        .iter()
        .filter(|l| l.prefetched)
        .map(|l| chain_step_args(&l.params).1)
        .collect();
    // Parts of 8, 16 and 32 links after the first launch (the last, of 15, sent by flush_held).
    let sent_while_busy = [2, 10, 26, 58, 90, 122, 154, 186];
    assert_eq!(heads, sent_while_busy, "heads read ahead");
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn chain_heads_are_not_read_ahead_when_reading_ahead_is_off() {
    let (gpu, sim, mut q, module) = setup_with(
        ComputeQueueConfig::default()
            .with_chained_stream(true)
            .with_chain_part(32)
            .with_prefetch_qmds(false),
    );
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    sim.pause();
    launch_tags(&mut q, &k, &cfg, v.va(), 1..=100);
    sim.resume();
    q.synchronize().unwrap();
    assert_eq!(tags_after(&sim, before), (1..=100).collect::<Vec<u64>>());
    assert!(!sim.launches()[before..].iter().any(|l| l.prefetched));
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn fills_and_device_copies_launch_the_built_in_kernels_by_size_class_in_order() {
    let (gpu, sim, mut q, module) = setup();
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cap = gpu.info().sm_count * 8;
    let before = sim.launches().len();
    // (bytes, blocks): 16 bytes per thread of 256 per pass, rounded up to a power of two, at most 8 blocks per SM.
    let fills: [(u64, u32); 5] = [(16384, 4), (16384, 4), (20000, 8), (1, 1), (1 << 32, cap)];
    let mut values = Vec::new();
    for (i, &(bytes, _)) in fills.iter().enumerate() {
        // SAFETY (every launch below): the model does not execute kernels.
        let fence = unsafe { q.fill(v.va(), 0xa0 + i as u32, 1, bytes) }.unwrap();
        values.push(fence.value());
        // Another kernel in between: the slots the built-in launches reuse held something else.
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(1, 1),
                &[Arg::Ptr(v.va()), Arg::U64(i as u64), Arg::U64(0)],
            )
        }
        .unwrap();
    }
    // Recorded without a doorbell, then sent with the copy after it.
    let doorbells = q.queue().channel().kicks();
    let recorded = unsafe { q.record_fill_value(v.va() + 8, 7, 4, 2) }.unwrap();
    assert_eq!(
        q.queue().channel().kicks(),
        doorbells,
        "a recorded fill rang"
    );
    let copied = unsafe { q.copy_device(v.va(), v.va() + 2048, 1000) }.unwrap();
    assert!(copied.value() > recorded);
    copied.wait(T).unwrap();
    let seen = &sim.launches()[before..];
    assert_eq!(seen.len(), fills.len() * 2 + 2);
    let fill_program = seen[0].program_va;
    for (i, &(bytes, blocks)) in fills.iter().enumerate() {
        let l = &seen[i * 2];
        assert_eq!(l.program_va, fill_program);
        assert_eq!(
            (l.grid, l.block),
            ([blocks, 1, 1], [256, 1, 1]),
            "fill of {bytes} bytes"
        );
        let dst = u64::from_le_bytes(l.params[0..8].try_into().unwrap());
        let value = u32::from_le_bytes(l.params[8..12].try_into().unwrap());
        let width = u32::from_le_bytes(l.params[12..16].try_into().unwrap());
        let count = u64::from_le_bytes(l.params[16..24].try_into().unwrap());
        assert_eq!(
            (dst, value, width, count),
            (v.va(), 0xa0 + i as u32, 1, bytes)
        );
        assert_eq!(l.releases.len(), 1, "a fill completes with its own value");
        assert_eq!(l.releases[0].1, values[i]);
        assert_ne!(seen[i * 2 + 1].program_va, fill_program);
    }
    let last_fill = &seen[fills.len() * 2];
    assert_eq!(
        (last_fill.program_va, last_fill.grid),
        (fill_program, [1, 1, 1])
    );
    assert_eq!(
        &last_fill.params[8..24],
        &[7, 0, 0, 0, 4, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]
    );
    let copy = &seen[fills.len() * 2 + 1];
    assert_ne!(copy.program_va, fill_program);
    assert_eq!(copy.grid, [1, 1, 1]);
    let words: Vec<u64> = (0..3)
        .map(|i| u64::from_le_bytes(copy.params[i * 8..i * 8 + 8].try_into().unwrap()))
        .collect();
    assert_eq!(words, [v.va(), v.va() + 2048, 1000]);
    // Bad fills are refused before anything is recorded.
    let submitted = q.queue().last_submitted();
    assert!(unsafe { q.fill(v.va() + 1, 0, 4, 1) }.is_err());
    assert!(unsafe { q.fill(v.va(), 0, 3, 1) }.is_err());
    assert!(unsafe { q.fill(v.va(), 0, 4, 0) }.is_err());
    assert!(unsafe { q.copy_device(v.va(), v.va(), 0) }.is_err());
    assert_eq!(
        q.queue().last_submitted(),
        submitted,
        "a refused fill or copy was recorded"
    );
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

#[test]
fn fills_and_copies_on_a_busy_chained_queue_are_sent_not_held() {
    let (gpu, sim, mut q, module) =
        setup_with(ComputeQueueConfig::default().with_chained_stream(true));
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let cfg = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    sim.pause();
    // SAFETY (every launch below): the model does not execute kernels.
    unsafe { q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(0)]) }.unwrap();
    unsafe { q.launch(&k, &cfg, &[Arg::Ptr(v.va()), Arg::U64(2), Arg::U64(0)]) }.unwrap();
    assert_eq!(
        q.chain_len(),
        1,
        "the second launch is held while the first runs"
    );
    // The queue is still busy: a fill and a copy are sent all the same (their callers ring a plain doorbell and may
    // wait for them at once), after the link held before them.
    let filled = unsafe { q.fill(v.va() + 64, 0, 4, 4) }.unwrap();
    assert_eq!(
        q.chain_len(),
        0,
        "the held link was not sent before the fill"
    );
    let copied = unsafe { q.copy_device(v.va(), v.va() + 128, 16) }.unwrap();
    assert_eq!(q.chain_len(), 0, "a copy on a busy chained queue was held");
    sim.resume();
    // No other call: the fence completes because the copy was sent.
    copied.wait(Duration::from_secs(5)).unwrap();
    assert!(filled.is_done());
    let seen = sim.launches()[before..].to_vec();
    assert_eq!(seen.len(), 4);
    assert_eq!(chain_step_args(&seen[0].params).1, 1);
    assert_eq!(chain_step_args(&seen[1].params).1, 2);
    assert_eq!(seen[0].program_va, seen[1].program_va);
    assert_ne!(seen[2].program_va, seen[0].program_va);
    assert_ne!(seen[3].program_va, seen[2].program_va);
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

/// Chains linked with `QMD_SCHEDULE` (as libcuda's graphs link theirs) run each link's QMD as the slot holds it now,
/// never a copy the work distributor read ahead of an earlier launch from the same slot: chains of every length,
/// under each action in turn, as `gpu_chain` runs them. (With the chain heads read ahead and `QMD_SCHEDULE` links,
/// the model ran a stale head at the 255-link chain.)
#[test]
fn schedule_linked_chains_never_run_a_copy_read_ahead_before() {
    let (gpu, sim, mut q, module) = setup();
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let one = LaunchConfig::linear(1, 1);
    for action in [
        qmd::ChainAction::InvalidateCopySchedule,
        qmd::ChainAction::Schedule,
    ] {
        q.set_chain_action(action);
        for n in [1u64, 2, 3, 10, 255, 256, 257, 511, 1000] {
            let before = sim.launches().len();
            chain_tags(&mut q, &k, &one, v.va(), 0..n);
            q.end_chain().unwrap().wait(T).unwrap();
            assert!(
                sim.errors().is_empty(),
                "{action:?} n={n}: {:?}",
                sim.errors()
            );
            assert_eq!(tags_after(&sim, before), (0..n).collect::<Vec<_>>());
        }
    }
}

/// Launches read ahead on a queue, then a chain linked with `QMD_SCHEDULE` over the same slots with another grid:
/// every link runs with its own grid (a link into a slot read ahead before fetches afresh), and no QMD is read ahead
/// while chains link that way.
#[test]
fn a_schedule_linked_chain_after_read_ahead_launches_runs_its_own_qmds() {
    let (gpu, sim, mut q, module) = setup_with(
        ComputeQueueConfig::default()
            .with_slots(64)
            .with_chain_part(32),
    );
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let one = LaunchConfig::linear(1, 1);
    let before = sim.launches().len();
    sim.pause();
    launch_tags(&mut q, &k, &one, v.va(), 1..=40);
    sim.resume();
    q.synchronize().unwrap();
    assert!(
        sim.launches()[before..].iter().any(|l| l.prefetched),
        "the first launches were read ahead"
    );
    q.set_chain_action(qmd::ChainAction::Schedule);
    let two = LaunchConfig::linear(2, 1);
    let second = sim.launches().len();
    sim.pause();
    chain_tags(&mut q, &k, &two, v.va(), 41..=90);
    q.end_chain().unwrap();
    launch_tags(&mut q, &k, &one, v.va(), 91..=95);
    sim.resume();
    q.synchronize().unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    let seen = &sim.launches()[second..];
    assert_eq!(tags_after(&sim, second), (41..=95).collect::<Vec<u64>>());
    assert!(
        seen[..50].iter().all(|l| l.grid == [2, 1, 1]),
        "a stale grid ran"
    );
    assert!(
        !seen.iter().any(|l| l.prefetched),
        "read ahead under QMD_SCHEDULE"
    );
}

/// The action is fixed per link as it is recorded: links recorded under `QMD_SCHEDULE` into slots read ahead before
/// fetch afresh even when the action is switched back before the chain is sent (the chain's head is then read
/// ahead itself).
#[test]
fn links_recorded_under_schedule_stay_safe_when_the_action_changes_before_the_chain_is_sent() {
    let (gpu, sim, mut q, module) = setup_with(
        ComputeQueueConfig::default()
            .with_slots(16)
            .with_chain_part(8),
    );
    let k = module.kernel("chain_step").unwrap();
    let v = page(&gpu);
    let one = LaunchConfig::linear(1, 1);
    let two = LaunchConfig::linear(2, 1);
    for round in 0..4u64 {
        let before = sim.launches().len();
        // Every slot's last launch read ahead (each batch waits behind work the queue has not seen complete).
        for batch in 0..2u64 {
            sim.pause();
            let tags = batch * 8..batch * 8 + 8;
            launch_tags(&mut q, &k, &one, v.va(), tags.map(|t| round * 100 + t));
            sim.resume();
            q.synchronize().unwrap();
        }
        sim.pause();
        q.set_chain_action(qmd::ChainAction::Schedule);
        chain_tags(&mut q, &k, &two, v.va(), (16..24).map(|t| round * 100 + t));
        q.set_chain_action(qmd::ChainAction::InvalidateCopySchedule);
        q.end_chain().unwrap();
        sim.resume();
        q.synchronize().unwrap();
        assert!(sim.errors().is_empty(), "round {round}: {:?}", sim.errors());
        let want: Vec<u64> = (0..24).map(|t| round * 100 + t).collect();
        assert_eq!(tags_after(&sim, before), want);
        assert!(
            sim.launches()[before + 16..]
                .iter()
                .all(|l| l.grid == [2, 1, 1]),
            "round {round}: a stale QMD ran"
        );
    }
}
