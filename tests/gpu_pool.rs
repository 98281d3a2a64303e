//! The stream-ordered memory pool on a GPU, both backends from the same test bodies (run with `--include-ignored
//! --test-threads=1` on an NVIDIA GPU with libcuda): kernels compute correctly in pool blocks, reuse on one queue
//! keeps stream order, a queue never gets a block another queue's running work freed, a million alloc/free cycles
//! leave the pool at its baseline after a trim, and running out of memory is a typed error.

use std::time::Duration;

use apex::{Arg, Backend, Error, Gpu, HostBuffer, LaunchConfig, PoolOptions, Queue};

#[path = "support/gpu.rs"]
mod support_gpu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

/// Sets `n` floats at `ptr` to `v` on `q`.
fn fill(q: &mut Queue, ptr: u64, v: f32, n: u64) -> apex::Fence {
    // SAFETY: the callers pass pool blocks of at least `n` floats, alive until the queue is synchronized or the
    // block freed on this queue.
    unsafe { q.fill_addresses(ptr, v.to_bits(), 4, n) }.expect("fill")
}

/// `out[i] = a[i] + b[i]` for `n` floats, on `q`.
fn add(q: &mut Queue, k: &apex::Kernel, a: u64, b: u64, out: u64, n: u32) {
    // SAFETY: three ranges of at least `n` floats (pool blocks or buffers) that live until the queue is synchronized
    // or the blocks are freed on this queue.
    unsafe {
        q.launch(
            k,
            &LaunchConfig::linear(n.div_ceil(256), 256),
            &[Arg::Ptr(a), Arg::Ptr(b), Arg::Ptr(out), Arg::U32(n)],
        )
    }
    .expect("vector_add");
}

/// The `n` floats at `ptr`, read through `host` once `q`'s work so far is complete.
fn read(q: &mut Queue, host: &HostBuffer, ptr: u64, n: u64) -> Vec<f32> {
    // SAFETY: `ptr` holds `n` floats and `host` at least as many bytes.
    unsafe { q.copy_addresses(ptr, host.device_ptr(), n * 4) }
        .expect("copy")
        .wait(T)
        .expect("wait");
    let mut bytes = vec![0u8; (n * 4) as usize];
    host.read(0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

fn kernels_compute_in_pool_blocks(b: Backend) {
    let g = gpu(b);
    let pool = g.pool(PoolOptions::default()).unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("vector_add").unwrap();
    let mut q = g.queue().unwrap();
    let host = g.alloc_host(4 * MIB).unwrap();
    for round in 0..4u32 {
        // Small and class blocks, and one of the large path (4 MiB).
        for n in [60u32, 1000, 30_000, 1 << 20] {
            let bytes = u64::from(n) * 4;
            let (x, y, out) = (
                q.alloc_async(&pool, bytes).unwrap(),
                q.alloc_async(&pool, bytes).unwrap(),
                q.alloc_async(&pool, bytes).unwrap(),
            );
            for p in [&x, &y, &out] {
                assert_eq!(p.device_ptr() % 256, 0, "{b:?}: alignment");
            }
            let (vx, vy) = (round as f32 + 1.0, n as f32 * 0.5);
            fill(&mut q, x.device_ptr(), vx, n.into());
            fill(&mut q, y.device_ptr(), vy, n.into());
            add(
                &mut q,
                &k,
                x.device_ptr(),
                y.device_ptr(),
                out.device_ptr(),
                n,
            );
            let got = read(&mut q, &host, out.device_ptr(), n.into());
            assert!(
                got.iter().all(|&v| v == vx + vy),
                "{b:?}: round {round}, {n} floats: {:?}",
                &got[..4]
            );
            for p in [x, y, out] {
                q.free_async(p).unwrap();
            }
        }
    }
    q.synchronize().unwrap();
    let s = pool.stats().unwrap();
    assert_eq!(s.allocations, 48);
    assert_eq!(s.used_bytes, 0, "{b:?}: {s}");
    if b == Backend::Direct {
        assert!(s.hits >= 36, "{s}");
    }
    pool.trim(0).unwrap();
    assert_eq!(pool.stats().unwrap().reserved_bytes, 0);
}

fn reuse_on_one_queue_keeps_stream_order(b: Backend) {
    let g = gpu(b);
    let pool = g.pool(PoolOptions::default()).unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("vector_add").unwrap();
    let mut q = g.queue().unwrap();
    // A class block (256 KiB) and a large one (4 MiB), each reused every iteration: iteration i fills the block
    // with i and doubles it into its own stretch of `out`. A block handed out again before the previous
    // iteration's kernel read it would show up as a wrong stretch.
    for (n, iters) in [(1u64 << 16, 64u64), (1 << 20, 16)] {
        let out = g.alloc(n * 4 * iters).unwrap();
        let mut addrs = Vec::new();
        for i in 0..iters {
            let x = q.alloc_async(&pool, n * 4).unwrap();
            addrs.push(x.device_ptr());
            fill(&mut q, x.device_ptr(), i as f32, n);
            let dst = out.device_ptr() + i * n * 4;
            add(&mut q, &k, x.device_ptr(), x.device_ptr(), dst, n as u32);
            q.free_async(x).unwrap();
        }
        if b == Backend::Direct {
            addrs.dedup();
            assert_eq!(addrs.len(), 1, "the same block every iteration");
        }
        q.synchronize().unwrap();
        let mut bytes = vec![0u8; (n * 4 * iters) as usize];
        q.download(&g, &out, 0, &mut bytes).unwrap();
        for (i, stretch) in bytes.chunks_exact((n * 4) as usize).enumerate() {
            let want = 2.0 * i as f32;
            assert!(
                stretch
                    .chunks_exact(4)
                    .all(|w| f32::from_le_bytes(w.try_into().unwrap()) == want),
                "{b:?}: iteration {i} of {n} floats"
            );
        }
    }
}

fn another_queue_never_gets_a_block_in_use(b: Backend) {
    let g = gpu(b);
    let pool = g.pool(PoolOptions::default()).unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (k, spin) = (m.kernel("vector_add").unwrap(), m.kernel("spin").unwrap());
    let stop = g.alloc_host(4).unwrap();
    stop.write(0, &[0; 4]).unwrap();
    let host = g.alloc_host(4 * MIB).unwrap();
    let (mut qa, mut qb) = (g.queue().unwrap(), g.queue().unwrap());
    let out = g.alloc(4 * MIB).unwrap();
    for n in [1u64 << 16, 1 << 20] {
        stop.write(0, &[0; 4]).unwrap();
        let x = qa.alloc_async(&pool, n * 4).unwrap();
        let xp = x.device_ptr();
        // A: spin until told, then write 7 into x, then free x (in A's order).
        // SAFETY: `spin` only reads `stop`, which lives until the kernel is stopped and waited for.
        unsafe {
            qa.launch(
                &spin,
                &LaunchConfig::linear(1, 1),
                &[Arg::Ptr(stop.device_ptr())],
            )
        }
        .unwrap();
        let a_done = fill(&mut qa, xp, 7.0, n);
        qa.free_async(x).unwrap();
        // B, while A spins: its block is another one, and its work completes without waiting for A.
        let y = qb.alloc_async(&pool, n * 4).unwrap();
        assert_ne!(
            y.device_ptr(),
            xp,
            "{b:?}: B got a block A's running work still writes"
        );
        fill(&mut qb, y.device_ptr(), 3.0, n);
        add(
            &mut qb,
            &k,
            y.device_ptr(),
            y.device_ptr(),
            out.device_ptr(),
            n as u32,
        );
        let got = read(&mut qb, &host, out.device_ptr(), n);
        assert!(got.iter().all(|&v| v == 6.0), "{b:?}: {:?}", &got[..4]);
        assert!(!a_done.is_done(), "{b:?}: A still spins");
        // A finishes: now B may get x, and sees what A wrote last.
        stop.write(0, &1u32.to_le_bytes()).unwrap();
        qa.synchronize().unwrap();
        let z = qb.alloc_async(&pool, n * 4).unwrap();
        if b == Backend::Direct {
            assert_eq!(
                z.device_ptr(),
                xp,
                "A's free is complete: B reuses the block"
            );
        }
        if z.device_ptr() == xp {
            let seen = read(&mut qb, &host, xp, n);
            assert!(seen.iter().all(|&v| v == 7.0), "{b:?}: {:?}", &seen[..4]);
        }
        qb.free_async(y).unwrap();
        qb.free_async(z).unwrap();
        qb.synchronize().unwrap();
    }
}

fn a_million_cycles_return_to_the_baseline(b: Backend) {
    let g = gpu(b);
    let pool = g.pool(PoolOptions::default()).unwrap();
    let count = g
        .load_module(CUBIN)
        .unwrap()
        .kernel("count_threads")
        .unwrap();
    let (mut qa, mut qb) = (g.queue().unwrap(), g.queue().unwrap());
    let baseline = pool.stats().unwrap().reserved_bytes;
    assert_eq!(baseline, 0);
    for i in 0..1_000_000u64 {
        let q = if i % 3 == 0 { &mut qb } else { &mut qa };
        let bytes = 4 + (i * 7919) % if i % 5000 == 0 { 8 * MIB } else { 40_000 };
        let buf = q.alloc_async(&pool, bytes).unwrap();
        let used = (i % 1000 == 0).then(|| {
            // SAFETY: count_threads adds one per thread to the u32 at the block's start (at least 4 bytes).
            unsafe { q.launch(&count, &LaunchConfig::linear(1, 32), &[buf.arg()]) }.unwrap()
        });
        // A block a kernel used is freed on the other queue, once that queue waits for the kernel (stream order
        // from the allocation, the use and the free, as cuMemFreeAsync on another stream needs).
        if let Some(f) = &used {
            let other = if i % 3 == 0 { &mut qa } else { &mut qb };
            other.wait_for(f).unwrap();
            other.free_async(buf).unwrap();
        } else {
            q.free_async(buf).unwrap();
        }
    }
    qa.synchronize().unwrap();
    qb.synchronize().unwrap();
    let s = pool.stats().unwrap();
    assert_eq!(s.allocations, 1_000_000);
    assert_eq!(s.used_bytes, 0, "{b:?}: {s}");
    if b == Backend::Direct {
        assert_eq!(s.blocks, 0);
        assert!(s.misses < 500, "{s}");
    }
    assert_eq!(pool.trim(0).unwrap(), baseline, "{b:?}: {s}");
    let s = pool.stats().unwrap();
    assert_eq!(s.reserved_bytes, baseline, "{b:?}: {s}");
}

fn running_out_of_memory_is_a_typed_error(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    // The pool's reserve limit.
    let pool = g
        .pool(PoolOptions::default().reserve_limit(Some(64 * MIB)))
        .unwrap();
    let first = q.alloc_async(&pool, 40 * MIB).unwrap();
    let e = q.alloc_async(&pool, 40 * MIB).unwrap_err();
    let Error::PoolOutOfMemory(oom) = &e else {
        panic!("{b:?}: not an out-of-memory error: {e}");
    };
    assert_eq!(oom.requested, 40 * MIB);
    assert!(oom.used_bytes >= 40 * MIB, "{e}");
    if b == Backend::Direct {
        assert_eq!(oom.limit, Some(64 * MIB));
        assert_eq!(oom.held_by, vec![(q.id(), 40 * MIB)]);
    }
    q.free_async(first).unwrap();
    // The device's memory.
    let whole = g.pool(PoolOptions::default()).unwrap();
    let too_much = g.info().memory_bytes * 2;
    let e = q.alloc_async(&whole, too_much).unwrap_err();
    let Error::PoolOutOfMemory(oom) = &e else {
        panic!("{b:?}: not an out-of-memory error: {e}");
    };
    assert_eq!(oom.requested, too_much);
    assert_eq!(oom.limit, None);
    if b == Backend::Driver {
        assert!(oom.source.is_some(), "{e}");
    }
    // The pool still works.
    let ok = q.alloc_async(&whole, MIB).unwrap();
    q.free_async(ok).unwrap();
    q.synchronize().unwrap();
}

macro_rules! both {
    ($($name:ident),*) => {
        mod direct { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Direct) } )* }
        mod driver { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Driver) } )* }
    };
}
both!(
    kernels_compute_in_pool_blocks,
    reuse_on_one_queue_keeps_stream_order,
    another_queue_never_gets_a_block_in_use,
    a_million_cycles_return_to_the_baseline,
    running_out_of_memory_is_a_typed_error
);
