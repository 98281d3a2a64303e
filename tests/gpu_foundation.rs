//! GPU tests of the foundation layers (RM client, channel, doorbell, semaphores). They need an NVIDIA GPU
//! with the 580 open kernel module: run with `--include-ignored` on such a machine.

use std::time::{Duration, Instant};

use apex::pushbuf::{Acquire, Queue, QueueConfig, Release, Signal};
use apex::rm::GpuCore;

const TIMEOUT: Duration = Duration::from_secs(10);

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0)
}

fn nvidia_smi(query: &str) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            format!("--query-gpu={query}").as_str(),
            "--format=csv,noheader",
            "-i",
            "0",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_info_matches_nvidia_smi() {
    let gpu = GpuCore::open(0).expect("open GPU 0");
    let info = gpu.info();
    eprintln!("{info:#?}");
    assert_eq!(Some(info.name.clone()), nvidia_smi("name"));
    assert_eq!(Some(info.uuid.clone()), nvidia_smi("uuid"));
    assert_eq!(
        Some(info.driver_version.clone()),
        nvidia_smi("driver_version")
    );
    assert!(
        info.sm_count > 0
            && info.sm_count <= info.gpc_count * info.tpcs_per_gpc_max * info.sms_per_tpc
    );
    assert!(info.memory_bytes > 1 << 30);
    assert!(gpu.has_class(0xc86f) || gpu.has_class(0xc56f) || gpu.has_class(0xc96f));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_index_out_of_range_is_a_typed_error() {
    match GpuCore::open(31) {
        Err(apex::rm::Error::NoSuchGpu { index: 31, count }) => assert!(count >= 1),
        other => panic!("expected NoSuchGpu, got {other:?}"),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn semaphore_round_trips_across_ring_wraps() {
    let gpu = GpuCore::open(0).unwrap();
    let mut cfg = QueueConfig::default();
    cfg.channel.entries = 1024;
    let mut q = Queue::new(&gpu, cfg).unwrap();
    let n = 100_000u64;
    let start = Instant::now();
    for _ in 0..n {
        let fence = q.submit(0, Signal::Host, |_, _| {}).unwrap();
        fence.wait(TIMEOUT).unwrap();
        // The value the GPU wrote is exactly the submission's value: nothing lost, nothing reordered.
        assert_eq!(q.timeline().completed(), fence.value());
    }
    let wraps = q.last_submitted() / 1024;
    eprintln!(
        "{n} round trips in {:?} ({} ring wraps)",
        start.elapsed(),
        wraps
    );
    assert!(wraps >= 2);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn two_channels_ordered_by_acquire_and_release() {
    let gpu = GpuCore::open(0).unwrap();
    // In a channel group of its own: A's acquire yields its group while it waits (ACQUIRE_SWITCH_TSG), which in the
    // group the GPU's channels share would yield B's too.
    let mut own = QueueConfig::default();
    own.channel.own_group = true;
    let mut a = Queue::new(&gpu, own).unwrap();
    let mut b = Queue::new(&gpu, QueueConfig::default()).unwrap();
    // A waits on a semaphore that only B releases, then releases its own value.
    let gate = b.timeline().va() + 8 * 16; // a spare slot of B's semaphore page
    let fa = a
        .submit(8, Signal::Host, |p, _| {
            p.sem_acquire(gate, 0x1234, Acquire::StrictGeq, true, true)
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !fa.is_done(),
        "A ran past its acquire before B released the gate"
    );
    let fb = b
        .submit(8, Signal::Host, |p, _| {
            p.sem_release(gate, 0x1234, Release::AFTER_IDLE_64)
        })
        .unwrap();
    fb.wait(TIMEOUT).unwrap();
    fa.wait(TIMEOUT).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn create_destroy_cycles_return_to_baseline() {
    // Warm up once so lazily created process state (libc, tracing) is not counted as a leak.
    drop(Queue::new(&GpuCore::open(0).unwrap(), QueueConfig::default()).unwrap());
    let (fds, maps, objects) = (open_fds(), mappings(), apex::rm::live_objects());
    let start = Instant::now();
    for i in 0..1000 {
        let gpu = GpuCore::open(0).unwrap();
        let mut q = Queue::new(&gpu, QueueConfig::default()).unwrap();
        q.submit(0, Signal::Host, |_, _| {})
            .unwrap()
            .wait(TIMEOUT)
            .unwrap();
        drop(q);
        drop(gpu);
        if i == 0 {
            assert_eq!(
                (open_fds(), mappings()),
                (fds, maps),
                "after the first cycle"
            );
        }
    }
    eprintln!("1000 GPU+queue cycles in {:?}", start.elapsed());
    assert_eq!(open_fds(), fds, "file descriptors leaked");
    assert_eq!(mappings(), maps, "mappings leaked");
    assert_eq!(apex::rm::live_objects(), objects, "RM objects leaked");
}
