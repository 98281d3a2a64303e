//! The stream-ordered memory pool through the public API against the simulated GPU (CI, no GPU): the real queue,
//! timeline and RM memory code run, and pausing the simulator's front end keeps a queue's work incomplete, so the
//! tests see which block each queue gets while another's free is still pending. Kernels do not run here; what they
//! compute in pool blocks is tested on a GPU (tests/gpu_pool.rs).

use std::time::Duration;

use apex::rm::sim::SimConfig;
use apex::sim::Simulator;
use apex::{Error, Gpu, LaunchConfig, MemoryPool, PoolOptions, Queue};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;

struct Setup {
    gpu: Gpu,
    sim: Simulator,
    empty: apex::Kernel,
}

fn setup() -> Setup {
    let (gpu, sim) = Gpu::open_simulated(SimConfig::default()).expect("simulated GPU");
    let empty = gpu
        .load_module(CUBIN)
        .expect("module")
        .kernel("empty")
        .expect("kernel");
    Setup { gpu, sim, empty }
}

/// Submits a launch to `q` (incomplete while the simulator is paused).
fn busy(q: &mut Queue, empty: &apex::Kernel) {
    // SAFETY: the empty kernel touches no memory (and the simulator runs no kernel).
    unsafe { q.launch(empty, &LaunchConfig::linear(1, 32), &[]) }.expect("launch");
}

fn stats(pool: &MemoryPool) -> apex::PoolStats {
    pool.stats().expect("stats")
}

#[test]
fn a_block_freed_on_one_queue_goes_to_another_only_after_the_fence() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let (mut qa, mut qb) = (s.gpu.queue().unwrap(), s.gpu.queue().unwrap());
    let x = qa.alloc_async(&pool, 4000).unwrap();
    let xp = x.device_ptr();
    assert_eq!(xp % 256, 0);
    assert_eq!(x.size(), 4000);

    s.sim.pause();
    busy(&mut qa, &s.empty);
    qa.free_async(x).unwrap();
    // Queue B gets another block while A's launch before the free is incomplete.
    let y = qb.alloc_async(&pool, 4000).unwrap();
    assert_ne!(y.device_ptr(), xp);
    // Queue A gets it back at once: its later work runs after the launch.
    let x2 = qa.alloc_async(&pool, 4000).unwrap();
    assert_eq!(x2.device_ptr(), xp);
    busy(&mut qa, &s.empty);
    qa.free_async(x2).unwrap();
    let z = qb.alloc_async(&pool, 4000).unwrap();
    assert_ne!(z.device_ptr(), xp);

    s.sim.resume();
    qa.synchronize().unwrap();
    let w = qb.alloc_async(&pool, 4000).unwrap();
    assert_eq!(
        w.device_ptr(),
        xp,
        "A's work is complete: B reuses the block"
    );
    let st = stats(&pool);
    assert_eq!((st.misses, st.hits, st.chunks), (1, 4, 1));
    assert_eq!(st.blocks, 3);
    assert_eq!(st.used_bytes, 3 * 4096);
    assert_eq!(st.reserved_bytes, 2 * MIB);
    for b in [y, z, w] {
        qb.free_async(b).unwrap();
    }
    qb.synchronize().unwrap();
    assert_eq!(pool.trim(0).unwrap(), 0);
    assert_eq!(stats(&pool).chunks, 0);
}

#[test]
fn size_classes_share_chunks_and_large_requests_get_their_own() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let mut q = s.gpu.queue().unwrap();
    // 100 small blocks of one class: one chunk; their addresses are distinct and 256-aligned.
    let small: Vec<_> = (0..100)
        .map(|_| q.alloc_async(&pool, 300).unwrap())
        .collect();
    let mut addrs: Vec<u64> = small.iter().map(|b| b.device_ptr()).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 100);
    assert!(addrs.iter().all(|a| a % 256 == 0));
    assert!(addrs.windows(2).all(|w| w[1] - w[0] >= 512));
    assert_eq!(stats(&pool).chunks, 1);
    // Another class: another chunk; a large request: memory of its own.
    let mid = q.alloc_async(&pool, 100_000).unwrap();
    let big = q.alloc_async(&pool, 3 * MIB).unwrap();
    let st = stats(&pool);
    assert_eq!(st.chunks, 3);
    assert_eq!(st.reserved_bytes, 4 * MIB + 3 * MIB);
    // 300 bytes: the 512-byte class; 100 000 bytes: the 112 KiB class (64 KiB + 3 × 16 KiB).
    assert_eq!(st.used_bytes, 100 * 512 + 114_688 + 3 * MIB);
    // The large block comes back for a request up to a quarter smaller, on the same queue, at once.
    let big_ptr = big.device_ptr();
    q.free_async(big).unwrap();
    let again = q.alloc_async(&pool, 3 * MIB - 300_000).unwrap();
    assert_eq!(again.device_ptr(), big_ptr);
    assert_eq!(stats(&pool).chunks, 3);
    for b in small.into_iter().chain([mid, again]) {
        q.free_async(b).unwrap();
    }
    q.synchronize().unwrap();
    pool.trim(0).unwrap();
    assert_eq!(stats(&pool).reserved_bytes, 0);
}

#[test]
fn trim_waits_for_nothing_and_keeps_what_pending_frees_need() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let mut q = s.gpu.queue().unwrap();
    let a = q.alloc_async(&pool, 1024).unwrap();
    let b = q.alloc_async(&pool, 64 << 10).unwrap();
    s.sim.pause();
    busy(&mut q, &s.empty);
    q.free_async(a).unwrap();
    q.free_async(b).unwrap();
    assert_eq!(
        pool.trim(0).unwrap(),
        4 * MIB,
        "both chunks wait for the launch"
    );
    s.sim.resume();
    q.synchronize().unwrap();
    assert_eq!(pool.trim(2 * MIB).unwrap(), 2 * MIB);
    assert_eq!(pool.trim(0).unwrap(), 0);
    let st = stats(&pool);
    assert_eq!((st.chunks, st.blocks, st.used_bytes), (0, 0, 0));
    assert_eq!(st.reserved_high_bytes, 4 * MIB);
    assert_eq!((st.hits, st.misses, st.allocations), (0, 2, 2));
}

#[test]
fn the_release_threshold_gives_idle_chunks_back() {
    let s = setup();
    let pool = s
        .gpu
        .pool(PoolOptions::default().release_threshold(2 * MIB))
        .unwrap();
    let mut q = s.gpu.queue().unwrap();
    let a = q.alloc_async(&pool, 1024).unwrap();
    let b = q.alloc_async(&pool, 8192).unwrap();
    assert_eq!(stats(&pool).reserved_bytes, 4 * MIB);
    // Dropped (its work is complete): the chunk is idle and over the threshold, so it goes.
    drop(a);
    assert_eq!(stats(&pool).reserved_bytes, 2 * MIB);
    q.free_async(b).unwrap();
    q.synchronize().unwrap();
    pool.set_release_threshold(0).unwrap();
    assert_eq!(stats(&pool).reserved_bytes, 0);
    assert_eq!(pool.options().release_threshold, 0);
}

#[test]
fn out_of_memory_names_what_the_pool_holds_and_who_holds_it() {
    let s = setup();
    let pool = s
        .gpu
        .pool(PoolOptions::default().reserve_limit(Some(6 * MIB)))
        .unwrap();
    let (mut qa, mut qb) = (s.gpu.queue().unwrap(), s.gpu.queue().unwrap());
    // 3 MiB of its own, and a 2 MiB chunk for the small block: 5 MiB of the 6 allowed.
    let a = qa.alloc_async(&pool, 3 * MIB).unwrap();
    let b = qb.alloc_async(&pool, 1000).unwrap();
    let err = qb.alloc_async(&pool, 2 * MIB).unwrap_err();
    let Error::PoolOutOfMemory(oom) = &err else {
        panic!("not an out-of-memory error: {err}");
    };
    assert_eq!(oom.requested, 2 * MIB);
    assert_eq!(oom.limit, Some(6 * MIB));
    assert_eq!(oom.reserved_bytes, 5 * MIB);
    assert_eq!(oom.used_bytes, 3 * MIB + 1024);
    assert_eq!(oom.blocks, 2);
    assert_eq!(oom.held_by, vec![(qa.id(), 3 * MIB), (qb.id(), 1024)]);
    let text = err.to_string();
    assert!(text.contains("reserve limit"), "{text}");
    assert!(text.contains(&format!("queue {}", qa.id())), "{text}");
    // Freeing the large block on A makes room once A's work is complete (3 MiB is too large to serve 2 MiB, so
    // it is given back and 2 MiB allocated).
    qa.free_async(a).unwrap();
    qa.synchronize().unwrap();
    let c = qb.alloc_async(&pool, 2 * MIB).unwrap();
    assert_eq!(stats(&pool).reserved_bytes, 4 * MIB);
    drop((b, c));
}

#[test]
fn bad_requests_are_errors() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let mut q = s.gpu.queue().unwrap();
    assert!(matches!(
        q.alloc_async(&pool, 0),
        Err(Error::InvalidArgument(_))
    ));
    for bad in [
        PoolOptions::default().chunk_bytes(1000),
        PoolOptions::default().chunk_bytes(0),
        PoolOptions::default().large_threshold(0),
        PoolOptions::default().chunk_bytes(MIB).large_threshold(MIB),
    ] {
        assert!(matches!(s.gpu.pool(bad), Err(Error::InvalidArgument(_))));
    }
    // A pool of another GPU.
    let (other, _sim) = Gpu::open_simulated(SimConfig {
        uuid: *b"APEX-simulated-1",
        ..SimConfig::default()
    })
    .unwrap();
    let theirs = other.pool(PoolOptions::default()).unwrap();
    assert!(matches!(q.alloc_async(&theirs, 64), Err(Error::Mismatch)));
    let mut q2 = other.queue().unwrap();
    let b = q2.alloc_async(&theirs, 64).unwrap();
    assert!(matches!(q.free_async(b), Err(Error::Mismatch)));
    assert_eq!(stats(&theirs).blocks, 0, "the refused buffer was dropped");
}

#[test]
fn hits_allocate_nothing_on_the_heap() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let (mut qa, mut qb) = (s.gpu.queue().unwrap(), s.gpu.queue().unwrap());
    // Warm up: the chunks of the classes used, both queues known to the pool.
    for bytes in [256, 4096, 65536, MIB] {
        let b = qa.alloc_async(&pool, bytes).unwrap();
        qa.free_async(b).unwrap();
        let b = qb.alloc_async(&pool, bytes).unwrap();
        qb.free_async(b).unwrap();
    }
    qa.synchronize().unwrap();
    qb.synchronize().unwrap();
    let before = stats(&pool);
    let ((), n) = allocations(|| {
        for i in 0..10_000u64 {
            let bytes = [256, 4096, 65536, MIB][(i % 4) as usize];
            // Across queues: A allocates, B frees; A then takes B's frees, whose values B's timeline has reached.
            let b = qa.alloc_async(&pool, bytes).unwrap();
            qb.free_async(b).unwrap();
            // The same queue.
            let b = qb.alloc_async(&pool, bytes).unwrap();
            qb.free_async(b).unwrap();
        }
    });
    assert_eq!(n, 0, "heap allocations in 20 000 pool hits");
    let after = stats(&pool);
    assert_eq!(after.misses, before.misses);
    assert_eq!(after.hits - before.hits, 20_000);
}

#[test]
fn a_million_cycles_leave_the_pool_at_its_baseline_after_trim() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let (mut qa, mut qb) = (s.gpu.queue().unwrap(), s.gpu.queue().unwrap());
    assert_eq!(stats(&pool).reserved_bytes, 0);
    let mut held = Vec::new();
    for i in 0..1_000_000u64 {
        let q = if i % 3 == 0 { &mut qb } else { &mut qa };
        let bytes = 1 + (i * 7919) % (if i % 1000 == 0 { 4 * MIB } else { 20_000 });
        let b = q.alloc_async(&pool, bytes).unwrap();
        if i % 17 == 0 {
            held.push(b);
        } else {
            q.free_async(b).unwrap();
        }
        if held.len() > 32 {
            qa.free_async(held.remove(0)).unwrap();
        }
    }
    for b in held.drain(..) {
        qb.free_async(b).unwrap();
    }
    qa.synchronize().unwrap();
    qb.synchronize().unwrap();
    let st = stats(&pool);
    assert_eq!(st.allocations, 1_000_000);
    assert!(st.misses < 200, "{st}");
    assert_eq!((st.blocks, st.used_bytes), (0, 0));
    assert_eq!(pool.trim(0).unwrap(), 0);
    assert_eq!(stats(&pool).chunks, 0);
}

#[test]
fn dropping_the_pool_waits_for_pending_frees() {
    let s = setup();
    let pool = s.gpu.pool(PoolOptions::default()).unwrap();
    let mut q = s.gpu.queue().unwrap();
    let b = q.alloc_async(&pool, 4096).unwrap();
    s.sim.pause();
    busy(&mut q, &s.empty);
    q.free_async(b).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            s.sim.resume();
        });
        let t = std::time::Instant::now();
        drop(pool);
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(250) && waited < T,
            "the drop waited {waited:?}"
        );
    });
    q.synchronize().unwrap();
}
