//! Stream-ordered allocation: the CPU cost of one alloc + free that the pool serves from memory it holds, APEX's
//! direct pool beside CUDA's in one process and one run. Needs an NVIDIA GPU; prints a note and measures nothing
//! otherwise.
//!
//! Group `alloc_free/<size>` (256 B, a small class; 64 KiB, a larger class; 4 MiB, the large-block path), each
//! measuring:
//! - `apex_direct`: `Queue::alloc_async` + `Queue::free_async` on the direct path's pool;
//! - `apex_driver`: the same calls on the driver backend (`cuMemAllocFromPoolAsync` + `cuMemFreeAsync` on a pool
//!   of APEX's, plus the API's own work);
//! - `cuMemAllocAsync`: `cuMemAllocAsync` + `cuMemFreeAsync` on the device's default pool (release threshold
//!   raised to keep its memory), called directly.
//!
//! Group `alloc_free_across_queues/64KiB`: the direct pool with the block allocated on one queue and freed on
//! another, so every allocation takes a block another queue freed (checking that queue's timeline).

use std::hint::black_box;
use std::time::{Duration, Instant};

use apex::{BackendRequest, Gpu, MemoryPool, PoolOptions, Queue, driver};
use criterion::{Criterion, criterion_group, criterion_main};

const SIZES: [(&str, u64); 3] = [("256B", 256), ("64KiB", 64 << 10), ("4MiB", 4 << 20)];

struct Side {
    gpu: Gpu,
    q: Queue,
    pool: MemoryPool,
}

fn side(name: &str, req: BackendRequest) -> Option<Side> {
    let gpu = match Gpu::open_with(0, req) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("pool benchmarks skipped ({name}): {e}");
            return None;
        }
    };
    let q = gpu.queue().ok()?;
    let pool = gpu.pool(PoolOptions::default()).ok()?;
    Some(Side { gpu, q, pool })
}

fn alloc_free(s: &mut Side, bytes: u64, iters: u64) -> Duration {
    // Warm: the pool holds the memory before the timed part.
    let b = s.q.alloc_async(&s.pool, bytes).expect("alloc");
    s.q.free_async(b).expect("free");
    let t = Instant::now();
    for _ in 0..iters {
        let b = s.q.alloc_async(&s.pool, black_box(bytes)).expect("alloc");
        s.q.free_async(black_box(b)).expect("free");
    }
    t.elapsed()
}

fn benches(c: &mut Criterion) {
    // The driver first: libcuda places its address ranges before APEX reserves its own.
    let Some(mut on_driver) = side("driver backend", BackendRequest::Driver) else {
        return;
    };
    let Some(mut direct) = side("direct path", BackendRequest::Direct) else {
        return;
    };
    let Some(ctx) = on_driver.gpu.driver().cloned() else {
        return;
    };
    // cuMemAllocAsync's pool keeps its memory, as APEX's pools do by default.
    match driver::MemPool::device_default(&ctx) {
        Ok(p) => {
            if let Err(e) = p.set_release_threshold(u64::MAX) {
                eprintln!("pool benchmarks skipped: the default pool's release threshold: {e}");
                return;
            }
        }
        Err(e) => {
            eprintln!("pool benchmarks skipped: no default memory pool: {e}");
            return;
        }
    }
    let Ok(stream) = driver::Stream::new(&ctx) else {
        return;
    };

    for (label, bytes) in SIZES {
        let mut g = c.benchmark_group(format!("alloc_free/{label}"));
        g.bench_function("apex_direct", |b| {
            b.iter_custom(|iters| alloc_free(&mut direct, bytes, iters))
        });
        g.bench_function("apex_driver", |b| {
            b.iter_custom(|iters| alloc_free(&mut on_driver, bytes, iters))
        });
        g.bench_function("cuMemAllocAsync", |b| {
            b.iter_custom(|iters| {
                let p = stream.alloc_async(bytes).expect("cuMemAllocAsync");
                // SAFETY: just allocated on this stream, used by nothing.
                unsafe { stream.free_async(p) }.expect("cuMemFreeAsync");
                let t = Instant::now();
                for _ in 0..iters {
                    let p = stream
                        .alloc_async(black_box(bytes))
                        .expect("cuMemAllocAsync");
                    // SAFETY: as above.
                    unsafe { stream.free_async(black_box(p)) }.expect("cuMemFreeAsync");
                }
                t.elapsed()
            })
        });
        g.finish();
    }

    let Ok(mut other) = direct.gpu.queue() else {
        return;
    };
    let mut g = c.benchmark_group("alloc_free_across_queues/64KiB");
    g.bench_function("apex_direct", |b| {
        b.iter_custom(|iters| {
            let bytes = 64 << 10;
            let t = Instant::now();
            for _ in 0..iters {
                let b = direct
                    .q
                    .alloc_async(&direct.pool, black_box(bytes))
                    .expect("alloc");
                other.free_async(black_box(b)).expect("free");
            }
            t.elapsed()
        })
    });
    g.finish();
    stream.synchronize().ok();
    direct.q.synchronize().ok();
    other.synchronize().ok();
    if let Ok(s) = direct.pool.stats() {
        eprintln!("direct pool after the benchmarks: {s}");
    }
}

criterion_group! {
    name = pool;
    config = Criterion::default().sample_size(50).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(pool);
