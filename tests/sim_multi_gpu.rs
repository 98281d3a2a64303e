//! Several GPUs against the simulator (CI, no GPU): two simulated GPUs of one process are peers; memory of one
//! is reachable by the other only once mapped on it; copy channels schedule only as RM schedules them (on their
//! own engine, not a graphics-runlist CE); copies between them run on the source GPU's optimal write CEs, split
//! across engines, in queue order, through the launch layer and the public API, both ways and both at once; a
//! queue of one GPU waits for a fence of the other on the GPU; and objects of one GPU, and GPUs that are not
//! peers, are refused with a reason.

use std::sync::Arc;
use std::time::Duration;

use apex::gpfifo::{Channel, ChannelConfig};
use apex::launch::{ComputeQueue, ComputeQueueConfig, CopyEngines, Error, LaunchConfig};
use apex::module::Module;
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory, MemoryDesc, NvStatus, PeerLink, Placement, sys};
use apex::sim::Simulator;
use apex::{Buffer, Gpu};

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
    // Copy engines of a GPU outside the queue's peer domain: refused before anything is mapped or queued.
    let (alone, _s) = gpu_alone();
    let mut engines = CopyEngines::new(&alone, 0b100).expect("engines of the lone GPU");
    let e = q1
        .copy_on(&mut engines, 0x1000, 0x2000, 16)
        .expect_err("refused");
    assert!(
        e.to_string().contains("cannot map each other's memory"),
        "{e}"
    );
}

/// A simulated GPU opened alone: an address space of its own, no peer path to the others.
fn gpu_alone() -> (Arc<GpuCore>, Simulator) {
    Simulator::open(SimConfig {
        uuid: *b"APEX-sim-alone-0",
        peer: false,
        ..SimConfig::default()
    })
    .expect("simulated GPU alone")
}

#[test]
fn engines_for_a_pair_are_rms_optimal_write_ces_or_every_usable_one() {
    let ((g0, _s0), (g1, _s1)) = two_gpus();
    // SimConfig's default names LCEs 2 and 3 optimal for writing a peer (and LCE 4 for reading).
    let e = CopyEngines::for_peer(&g0, &g1).expect("engines 0 -> 1");
    assert_eq!(e.lces().collect::<Vec<_>>(), vec![2, 3]);
    let e = CopyEngines::for_peer(&g0, &g0).expect("within GPU 0");
    assert_eq!(
        e.lces().collect::<Vec<_>>(),
        vec![2, 3, 4],
        "every usable LCE"
    );
    for (uuid, optimal) in [(*b"APEX-sim-no-ces0", 0), (*b"APEX-sim-grce-01", 0b1)] {
        // RM names none, or only a graphics-runlist CE: every usable LCE instead.
        let (g, _s) = Simulator::open(SimConfig {
            uuid,
            peer_write_ces: optimal,
            ..SimConfig::default()
        })
        .expect("simulated GPU");
        let e = CopyEngines::for_peer(&g, &g0).expect("fallback engines");
        assert_eq!(e.lces().collect::<Vec<_>>(), vec![2, 3, 4], "{optimal:#x}");
    }
    let (alone, _s) = gpu_alone();
    for (a, b) in [(&g0, &alone), (&alone, &g0)] {
        let e = CopyEngines::for_peer(a, b).expect_err("not peers");
        let text = e.to_string();
        assert!(
            text.contains("cannot map each other's memory") || text.contains("no NVLink"),
            "{text}"
        );
    }
}

#[test]
fn a_copy_on_the_source_gpus_engines_is_ordered_by_a_queue_of_the_destination() {
    let ((g0, _s0), (g1, s1)) = two_gpus();
    let bytes: u64 = 16 << 20;
    let src = filled(&g0, bytes, 0x0dd5);
    let dst = Memory::alloc(&g1, MemoryDesc::video(bytes).with_cpu()).expect("dst");
    dst.fill(0, bytes, 0).expect("clear");
    dst.map_on(&g0)
        .expect("dst on GPU 0, whose engines write it");
    let mut engines = CopyEngines::for_peer(&g0, &g1).expect("GPU 0's write CEs");
    let mut q1 = ComputeQueue::new(&g1, ComputeQueueConfig::default()).expect("queue on GPU 1");
    let flag = Memory::alloc(
        &g1,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .expect("flag");
    // GPU 1's front end is held: the queue's earlier work cannot complete, so GPU 0's engines must wait.
    s1.pause();
    q1.release_value(flag.va(), 5)
        .expect("earlier work on GPU 1");
    let f = q1
        .copy_on(&mut engines, src.va(), dst.va(), bytes)
        .expect("copy on GPU 0's engines");
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        read_all(&dst, 4096).iter().all(|&b| b == 0),
        "GPU 0's engines ran before GPU 1's earlier work"
    );
    assert!(!f.is_done());
    s1.resume();
    f.wait(T)
        .expect("the copy completes, then the queue's fence");
    assert_eq!(flag.read_u64_volatile(0).expect("flag"), 5);
    assert!(
        read_all(&dst, bytes) == read_all(&src, bytes),
        "every byte arrives"
    );
}

/// Two simulated peers through the public API.
fn two_api_gpus() -> [(Gpu, Simulator); 2] {
    [*b"APEX-simulated-0", *b"APEX-simulated-1"].map(|uuid| {
        Gpu::open_simulated(SimConfig {
            uuid,
            ..SimConfig::default()
        })
        .expect("simulated GPU")
    })
}

fn pattern(bytes: u64, seed: u32) -> Vec<u8> {
    (0..bytes / 4)
        .flat_map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed).to_le_bytes())
        .collect()
}

fn download(g: &Gpu, buf: &Buffer) -> Vec<u8> {
    let mut q = g.queue().expect("queue");
    let mut out = vec![0u8; buf.size() as usize];
    q.download(g, buf, 0, &mut out).expect("download");
    out
}

/// LAUNCH_DMAs on each LCE's channels of a simulated GPU, over LCEs 0-9.
fn copies_by_lce(sim: &Simulator) -> [u64; 10] {
    let mut out = [0; 10];
    for stats in sim.channel_stats() {
        if let Some(lce) = apex::rm::lce_of_engine_type(stats.engine) {
            out[lce as usize] += stats.copies;
        }
    }
    out
}

/// Copy-engine channels a simulated GPU has seen.
fn copy_channels(sim: &Simulator) -> usize {
    sim.channel_stats()
        .iter()
        .filter(|s| apex::rm::lce_of_engine_type(s.engine).is_some())
        .count()
}

#[test]
fn the_public_api_copies_between_gpus_both_ways_and_both_at_once_on_copy_engines() {
    let [(g0, s0), (g1, s1)] = two_api_gpus();
    let bytes: u64 = 24 << 20; // split across the engines
    let (p0, p1) = (pattern(bytes, 0x1234), pattern(bytes, 0xabcd));
    let (a0, b0) = (g0.alloc(bytes).unwrap(), g0.alloc(bytes).unwrap());
    let (a1, b1) = (g1.alloc(bytes).unwrap(), g1.alloc(bytes).unwrap());
    let (mut q0, mut q1) = (g0.queue().unwrap(), g1.queue().unwrap());
    q0.upload(&g0, &a0, 0, &p0).unwrap();
    q1.upload(&g1, &a1, 0, &p1).unwrap();

    // 0 -> 1 pushed by GPU 0's queue: GPU 0's optimal write CEs (LCEs 2 and 3) write GPU 1's memory.
    q0.copy_device_to_device(&a0, 0, &b1, 0, bytes).unwrap();
    q0.synchronize().unwrap();
    assert!(download(&g1, &b1) == p0, "GPU 0 -> GPU 1");
    let by_lce = copies_by_lce(&s0);
    assert!(
        by_lce[2] > 0 && by_lce[3] > 0,
        "split over LCEs 2 and 3: {by_lce:?}"
    );
    assert_eq!(by_lce[4], 0, "LCE 4 is not an optimal write CE: {by_lce:?}");
    let channels = copy_channels(&s0);

    // 1 -> 0 on GPU 0's queue: GPU 1's engines push, GPU 0's queue orders them.
    q0.copy_device_to_device(&a1, 0, &b0, 0, bytes).unwrap();
    q0.synchronize().unwrap();
    assert!(download(&g0, &b0) == p1, "GPU 1 -> GPU 0");
    assert!(copies_by_lce(&s1)[2] > 0, "on GPU 1's engines");

    // Both at once, each GPU pushing, at offsets that are not page aligned.
    let (off, len) = (4096 + 12, bytes - 8192);
    let f0 = q0.copy_device_to_device(&a0, off, &a1, off, len).unwrap();
    let f1 = q1.copy_device_to_device(&b1, off, &b0, off, len).unwrap();
    f0.wait(T).unwrap();
    f1.wait(T).unwrap();
    let (r1, r0) = (download(&g1, &a1), download(&g0, &b0));
    let (o, l) = (off as usize, len as usize);
    assert!(
        r1[o..o + l] == p0[o..o + l],
        "GPU 0 -> GPU 1 (both at once)"
    );
    assert!(
        r1[..o] == p1[..o] && r1[o + l..] == p1[o + l..],
        "bytes outside the range untouched"
    );
    assert!(
        r0[o..o + l] == p0[o..o + l],
        "GPU 1 -> GPU 0 (both at once)"
    );
    assert!(r0[..o] == p1[..o], "bytes before the range untouched");
    // The engines were built once per pair and queue: GPU 0 has no new channel for the later 0 -> 1 copy.
    assert_eq!(copy_channels(&s0), channels, "no new channel on GPU 0");

    // Refused before anything is queued: out of range, empty.
    assert!(q0.copy_device_to_device(&a0, 0, &a1, 8, bytes).is_err());
    assert!(q0.copy_device_to_device(&a0, 0, &a1, 0, 0).is_err());
}

#[test]
fn a_copy_to_a_gpu_that_is_not_a_peer_is_refused_with_the_reason() {
    let [(g0, _s0), _] = two_api_gpus();
    let (alone, _s) = Gpu::open_simulated(SimConfig {
        uuid: *b"APEX-sim-alone-1",
        peer: false,
        ..SimConfig::default()
    })
    .expect("simulated GPU alone");
    let (a0, x) = (g0.alloc(1 << 20).unwrap(), alone.alloc(1 << 20).unwrap());
    let mut q0 = g0.queue().unwrap();
    for e in [
        q0.copy_device_to_device(&a0, 0, &x, 0, 1 << 20)
            .expect_err("push refused"),
        q0.copy_device_to_device(&x, 0, &a0, 0, 1 << 20)
            .expect_err("pull refused"),
        g0.map_peer(&x).expect_err("no peer mapping"),
    ] {
        assert!(matches!(e, apex::Error::NotPeers(_)), "{e}");
        assert!(e.to_string().contains("Gpu::open_peers"), "{e}");
    }
}
