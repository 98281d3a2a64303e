//! Several GPUs against the simulator (CI, no GPU): two simulated GPUs of one process are peers; memory of one
//! is reachable by the other only once mapped on it; copies between them run on copy-engine channels, split
//! across engines, in queue order; a queue of one GPU waits for a fence of the other on the GPU; and objects
//! of one GPU are refused by the other with a reason.

use std::sync::Arc;
use std::time::Duration;

use apex::gpfifo::{Channel, ChannelConfig};
use apex::launch::{ComputeQueue, ComputeQueueConfig, CopyEngines, Error, LaunchConfig, Module};
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory, MemoryDesc, NvStatus, PeerLink, Placement, sys};
use apex::sim::Simulator;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

fn two_gpus() -> ((Arc<GpuCore>, Simulator), (Arc<GpuCore>, Simulator)) {
    let a = Simulator::open(SimConfig::default()).expect("simulated GPU 0");
    let b = Simulator::open(SimConfig {
        uuid: *b"APEX-simulated-1",
        ..SimConfig::default()
    })
    .expect("simulated GPU 1");
    (a, b)
}

fn filled(gpu: &Arc<GpuCore>, bytes: u64, seed: u32) -> Memory {
    let m = Memory::alloc(gpu, MemoryDesc::video(bytes).with_cpu()).expect("buffer");
    let words: Vec<u32> = (0..bytes / 4)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ seed)
        .collect();
    m.write_words(0, &words).expect("fill");
    m
}

fn read_all(m: &Memory, bytes: u64) -> Vec<u8> {
    let mut out = vec![0u8; bytes as usize];
    m.read(0, &mut out).expect("read back");
    out
}

#[test]
fn simulated_gpus_are_nvlink_peers_and_map_each_others_memory_once() {
    let ((g0, _s0), (g1, _s1)) = two_gpus();
    assert_ne!(g0.info().uuid, g1.info().uuid);
    let caps = g1.peer_caps(&g0).expect("peer caps");
    assert_eq!(caps.link, PeerLink::NvLink);
    assert!(caps.reads && caps.writes);
    assert_eq!(g0.peer_caps(&g0).expect("self").link, PeerLink::Same);
    assert_eq!(g0.peer_domain(), g1.peer_domain());

    let m = filled(&g0, 1 << 20, 7);
    assert!(m.is_mapped_on(&g0));
    assert!(!m.is_mapped_on(&g1), "not mapped on the peer before map_on");
    m.map_on(&g1).expect("map on the peer");
    assert!(m.is_mapped_on(&g1));
    m.map_on(&g1).expect("mapping twice is a no-op");
    m.map_on(&g0).expect("mapping on the owner is a no-op");
}

/// The NV_STATUS behind a channel that could not be built.
fn status(e: apex::gpfifo::Error) -> Option<NvStatus> {
    match e {
        apex::gpfifo::Error::Rm(e) => e.status(),
        other => panic!("not an RM refusal: {other}"),
    }
}

#[test]
fn copy_channels_schedule_on_their_own_engine_and_refused_engines_are_left_out() {
    // As on an H100: LCEs 0 and 1 share the graphics runlist, 2-4 are copy engines of their own, 5+ absent.
    let (g, _s) = Simulator::open(SimConfig::default()).expect("simulated GPU");
    let ch =
        Channel::new(&g, ChannelConfig::copy_engine(2)).expect("a copy channel on LCE 2 schedules");
    assert_eq!(ch.classes().compute, None);
    assert!(ch.classes().copy.is_some());
    let e = Channel::new(&g, ChannelConfig::copy_engine(0)).expect_err("LCE 0 is a graphics CE");
    assert_eq!(status(e), Some(NvStatus(sys::NV_ERR_INVALID_STATE)));
    let e = Channel::new(&g, ChannelConfig::copy_engine(7)).expect_err("LCE 7 is absent");
    assert_eq!(status(e), Some(NvStatus(sys::NV_ERR_INVALID_ARGUMENT)));
    let e = Channel::new(&g, ChannelConfig::copy_engine(20)).expect_err("no LCE 20 in RM's names");
    assert!(matches!(e, apex::gpfifo::Error::InvalidConfig(_)), "{e}");

    let engines = CopyEngines::new(&g, 0x3ff).expect("the usable engines of ten");
    assert_eq!(engines.lces().collect::<Vec<_>>(), vec![2, 3, 4]);
    let e = CopyEngines::new(&g, 0b11).expect_err("only graphics CEs");
    assert!(e.to_string().contains("NV_ERR_INVALID_STATE"), "{e}");

    // Another GPU's engines: whatever SimConfig says it has.
    let (g2, _s2) = Simulator::open(SimConfig {
        uuid: *b"APEX-simulated-9",
        copy_engines: 0b1111_0001,
        graphics_copy_engines: 0b1,
        ..SimConfig::default()
    })
    .expect("simulated GPU with LCEs 4-7");
    let engines = CopyEngines::new(&g2, 0x3ff).expect("engines");
    assert_eq!(engines.lces().collect::<Vec<_>>(), vec![4, 5, 6, 7]);
}

#[test]
fn copies_between_gpus_run_on_copy_engines_split_and_in_order() {
    let ((g0, _s0), (g1, s1)) = two_gpus();
    let bytes: u64 = 24 << 20; // above the split threshold: three 8 MiB parts on two engines
    let src = filled(&g0, bytes, 0x5eed);
    let dst = Memory::alloc(&g1, MemoryDesc::video(bytes).with_cpu()).expect("dst");
    dst.fill(0, bytes, 0).expect("clear");
    src.map_on(&g1).expect("src on GPU 1");

    let mut q = ComputeQueue::new(&g1, ComputeQueueConfig::default()).expect("queue on GPU 1");
    let mut engines = CopyEngines::new(&g1, 0b1100).expect("two copy engines");
    assert_eq!(engines.lces().collect::<Vec<_>>(), vec![2, 3]);
    let f = q
        .copy_on(&mut engines, src.va(), dst.va(), bytes)
        .expect("copy");
    f.wait(T).expect("copy completes");
    assert!(
        read_all(&dst, bytes) == read_all(&src, bytes),
        "every byte arrives"
    );
    let copies: u64 = s1.channel_stats().iter().map(|c| c.copies).sum();
    assert!(
        copies >= 2,
        "the copy was split across engines ({copies} LAUNCH_DMAs)"
    );

    // Work queued after the copy sees its result: a second copy of the destination back onto itself shifted
    // by a page only completes after the first (queue order through the engines' semaphores).
    let src2 = filled(&g0, bytes, 0xbeef);
    src2.map_on(&g1).expect("map");
    q.copy_on(&mut engines, src2.va(), dst.va(), bytes)
        .expect("second copy");
    q.synchronize().expect("queue idle");
    assert!(read_all(&dst, bytes) == read_all(&src2, bytes));
}

#[test]
fn a_queue_waits_on_the_gpu_for_a_fence_of_another_gpu() {
    let ((g0, s0), (g1, _s1)) = two_gpus();
    let mut q0 = ComputeQueue::new(&g0, ComputeQueueConfig::default()).expect("queue 0");
    let mut q1 = ComputeQueue::new(&g1, ComputeQueueConfig::default()).expect("queue 1");
    let flag = Memory::alloc(
        &g1,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .expect("flag page");
    flag.fill(0, 0x1000, 0).expect("clear");

    // GPU 0's front end is held: its fence cannot complete, so GPU 1 must not pass the wait.
    s0.pause();
    let own = Memory::alloc(
        &g0,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .expect("GPU 0's page");
    let f0 = q0.release_value(own.va(), 1).expect("GPU 0 work");
    q1.wait_fence(&f0).expect("GPU 1 waits for GPU 0's fence");
    let f1 = q1
        .release_value(flag.va(), 42)
        .expect("GPU 1 work after the wait");
    std::thread::sleep(Duration::from_millis(50));
    assert!(!f1.is_done(), "GPU 1 ran ahead of GPU 0's fence");
    assert_eq!(flag.read_u64_volatile(0).expect("flag"), 0);
    s0.resume();
    f1.wait(T)
        .expect("GPU 1 continues once GPU 0's fence completes");
    assert_eq!(flag.read_u64_volatile(0).expect("flag"), 42);
}

#[test]
fn objects_of_one_gpu_are_refused_by_another() {
    let ((g0, _s0), (g1, _s1)) = two_gpus();
    let module = Module::load(&g0, CUBIN).expect("module on GPU 0");
    let empty = module.kernel("empty").expect("kernel");
    let mut q1 = ComputeQueue::new(&g1, ComputeQueueConfig::default()).expect("queue 1");
    // SAFETY: refused before anything reaches the GPU.
    let e = unsafe { q1.launch(&empty, &LaunchConfig::linear(1, 32), &[]) }.expect_err("refused");
    assert!(matches!(e, Error::InvalidLaunch { .. }), "{e}");
    assert!(
        e.to_string().contains("load the module on the queue's GPU"),
        "{e}"
    );
    let mut e0 = CopyEngines::new(&g0, 0b100).expect("engines of GPU 0");
    let e = q1
        .copy_on(&mut e0, 0x1000, 0x2000, 16)
        .expect_err("refused");
    assert!(e.to_string().contains("another GPU"), "{e}");
}
