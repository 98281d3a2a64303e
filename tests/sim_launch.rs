//! Real ComputeQueue launches of the test cubin against the simulated GPU front end: what the model records must
//! be what was asked, V03 QMDs are dropped like Hopper drops them, and bad launches never reach the ring.

use std::sync::Arc;
use std::time::Duration;

use apex::launch::qmd::{self, ConstBuffer, QMD_WORDS, QmdParams, QmdVersion};
use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, Error, LaunchConfig, Module};
use apex::pushbuf::Signal;
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory, MemoryDesc, Placement};
use apex::sim::{QmdViolation, SimErrorKind, Simulator, XID_GRAPHICS};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

fn setup() -> (Arc<GpuCore>, Simulator, ComputeQueue, Arc<Module>) {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).expect("compute queue");
    let module = Module::load(&gpu, CUBIN).expect("module");
    (gpu, sim, q, module)
}

fn page(gpu: &Arc<GpuCore>) -> Memory {
    let m = Memory::alloc(
        gpu,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .unwrap();
    m.fill(0, 0x1000, 0).unwrap();
    m
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
    let mut cbs = [None; 8];
    cbs[0] = Some(ConstBuffer {
        va: cb,
        size: 0x300,
    });
    let p = QmdParams {
        sm_version: 90,
        program_va: k.program_va(),
        registers: k.info().registers,
        barriers: 1,
        grid: [1, 1, 1],
        block: [32, 1, 1],
        shared_bytes: 0x400,
        local_bytes_per_thread: q.local_bytes_per_thread(),
        const_buffers: cbs,
        release: Some(release),
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
            LaunchConfig {
                shared_bytes: 300 << 10,
                ..LaunchConfig::linear(1, 32)
            },
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
