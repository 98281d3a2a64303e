//! The hot path allocates nothing: a counting global allocator sees zero allocations across prepared direct
//! launches (run with `--include-ignored` on an NVIDIA GPU).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::rm::{GpuCore, Memory, MemoryDesc};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_launches_allocate_nothing() {
    let gpu = GpuCore::open(0).unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let m = Module::load(
        &gpu,
        include_bytes!("../kernels/apex_test_kernels.sm_90.cubin"),
    )
    .unwrap();
    let (empty, chain) = (m.kernel("empty").unwrap(), m.kernel("chain_step").unwrap());
    let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu()).unwrap();
    let cfg = LaunchConfig::linear(1, 1);
    // Warm up: first launches invalidate caches and size local memory.
    for _ in 0..10 {
        // SAFETY: kernels touch only `v`.
        unsafe { q.launch(&empty, &cfg, &[]) }.unwrap();
        unsafe { q.launch(&chain, &cfg, &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)]) }.unwrap();
    }
    q.synchronize().unwrap();
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut last = None;
    for i in 0..5000u64 {
        // SAFETY: as above.
        unsafe { q.launch(&empty, &cfg, &[]) }.unwrap();
        last = Some(
            unsafe { q.launch(&chain, &cfg, &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(i)]) }
                .unwrap(),
        );
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    last.unwrap().wait(Duration::from_secs(10)).unwrap();
    assert_eq!(after - before, 0, "heap allocations during 10^4 launches");

    // Chained launches, sent part by part, and their ends.
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut last = None;
    for round in 0..10u64 {
        for i in 0..1000u64 {
            let args = [Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(i ^ round)];
            // SAFETY: as above.
            unsafe { q.record_launch_chained(&chain, &cfg, &args) }.unwrap();
        }
        last = Some(q.end_chain().unwrap());
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    last.unwrap().wait(Duration::from_secs(10)).unwrap();
    assert_eq!(
        after - before,
        0,
        "heap allocations during 10^4 chained launches"
    );
}
