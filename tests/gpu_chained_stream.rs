//! Chained queues on the GPU (`QueueOptions::chained`; run with `--include-ignored` on an NVIDIA GPU): launches
//! made while the queue is busy are held as GPU-scheduled links and sent later, launches made while it is idle are
//! sent at once. Every test checks a result that depends on the order of the launches, on both backends (the
//! driver backend ignores the option: the same bodies check it runs the same programs).

use std::time::{Duration, Instant};

use apex::{Arg, Backend, Gpu, HostBuffer, Launch, LaunchConfig, Queue, QueueOptions};

#[path = "support/gpu.rs"]
mod support_gpu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const PDL_CUBIN: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");
const T: Duration = Duration::from_secs(20);
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn chained(g: &Gpu) -> Queue {
    g.queue_with(QueueOptions::default().chained(true))
        .expect("chained queue")
}

fn step_args(i: u64, seed: u64) -> (u64, u64) {
    (i.wrapping_mul(0x9e37_79b9) | 1, i ^ seed)
}

fn read_u64(h: &HostBuffer) -> u64 {
    let mut b = [0u8; 8];
    h.read(0, &mut b).unwrap();
    u64::from_le_bytes(b)
}

/// Launches one `chain_step` (`v = v * mul + add`) on `v` through plain `Queue::launch`.
fn step_once(q: &mut Queue, k: &apex::Kernel, v: &HostBuffer, mul: u64, add: u64) -> apex::Fence {
    // SAFETY: chain_step reads and writes the 8 bytes of `v`, used by this queue alone.
    unsafe {
        q.launch(
            k,
            &ONE,
            &[Arg::Ptr(v.device_ptr()), Arg::U64(mul), Arg::U64(add)],
        )
    }
    .unwrap()
}

/// Launches `n` order-dependent `chain_step`s on `v` through plain `Queue::launch`; returns the value expected.
fn steps(q: &mut Queue, k: &apex::Kernel, v: &HostBuffer, n: u64, seed: u64, start: u64) -> u64 {
    let mut expect = start;
    for i in 0..n {
        let (mul, add) = step_args(i, seed);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        step_once(q, k, v, mul, add);
    }
    expect
}

/// A kernel that spins until the CPU writes a non-zero word to `stop`: keeps the queue busy, so that the launches
/// after it are held.
fn hold_busy(q: &mut Queue, spin: &apex::Kernel, stop: &HostBuffer) -> apex::Fence {
    stop.write(0, &0u32.to_le_bytes()).unwrap();
    // SAFETY: spin reads the 4 bytes of `stop` until the CPU writes them.
    unsafe { q.launch(spin, &ONE, &[Arg::Ptr(stop.device_ptr())]) }.unwrap()
}

fn runs_in_order_behind_busy_work(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let (k, spin) = (m.kernel("chain_step").unwrap(), m.kernel("spin").unwrap());
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    let stop = g.alloc_host(4).unwrap();
    // Around the part sizes (8, doubling to 128) and the slot count (256).
    for n in [1u64, 2, 7, 8, 9, 100, 255, 256, 257, 1000, 5000] {
        let seed = n * 13 + 5;
        v.write(0, &seed.to_le_bytes()).unwrap();
        let busy = hold_busy(&mut q, &spin, &stop);
        // At most 200 launches behind the spinning kernel: past the queue's 256 launch slots (and CUDA's own
        // queue) a launch waits for an earlier one to complete, as on any queue. Then the GPU is let go and the
        // rest are launched while it works through the first ones.
        let first = n.min(200);
        let mut expect = steps(&mut q, &k, &v, first, seed, seed);
        assert!(!busy.is_done(), "{b:?}: the spinning kernel ended early");
        stop.write(0, &1u32.to_le_bytes()).unwrap();
        for i in first..n {
            let (mul, add) = step_args(i, seed);
            expect = expect.wrapping_mul(mul).wrapping_add(add);
            step_once(&mut q, &k, &v, mul, add);
        }
        q.synchronize().unwrap();
        assert_eq!(read_u64(&v), expect, "{b:?}: {n} launches behind busy work");
    }
}

fn held_launches_are_sent_once_the_gpu_catches_up(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let (k, spin) = (m.kernel("chain_step").unwrap(), m.kernel("spin").unwrap());
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    let stop = g.alloc_host(4).unwrap();
    v.write(0, &3u64.to_le_bytes()).unwrap();
    let busy = hold_busy(&mut q, &spin, &stop);
    let mut expect = steps(&mut q, &k, &v, 3, 1, 3);
    stop.write(0, &1u32.to_le_bytes()).unwrap();
    busy.wait(T).unwrap();
    // The GPU has finished what was sent: the next launch finds it idle and sends the held ones with itself.
    let (mul, add) = step_args(99, 1);
    expect = expect.wrapping_mul(mul).wrapping_add(add);
    let last = step_once(&mut q, &k, &v, mul, add);
    last.wait(T)
        .expect("the held launches and the last one were sent without a flush");
    assert_eq!(read_u64(&v), expect, "{b:?}");
}

fn a_flush_sends_what_is_held(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let (k, spin) = (m.kernel("chain_step").unwrap(), m.kernel("spin").unwrap());
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    let stop = g.alloc_host(4).unwrap();
    v.write(0, &11u64.to_le_bytes()).unwrap();
    let _busy = hold_busy(&mut q, &spin, &stop);
    let (mul, add) = step_args(5, 2);
    let held = step_once(&mut q, &k, &v, mul, add);
    q.flush().unwrap();
    stop.write(0, &1u32.to_le_bytes()).unwrap();
    // Waited on with no other call on the queue: the flush sent it.
    held.wait(T).unwrap();
    assert_eq!(
        read_u64(&v),
        11u64.wrapping_mul(mul).wrapping_add(add),
        "{b:?}"
    );
}

fn a_lone_launch_is_sent_at_once(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let k = m.kernel("chain_step").unwrap();
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    let mut x = 7u64;
    v.write(0, &x.to_le_bytes()).unwrap();
    for i in 0..200 {
        let (mul, add) = step_args(i, 9);
        x = x.wrapping_mul(mul).wrapping_add(add);
        let f = step_once(&mut q, &k, &v, mul, add);
        // The queue was idle: the launch went out at once, no flush or other call needed.
        f.wait(T).unwrap();
        assert_eq!(read_u64(&v), x, "{b:?}: launch {i}");
    }
}

fn copies_and_prepared_launches_keep_their_place(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let (k, spin) = (m.kernel("chain_step").unwrap(), m.kernel("spin").unwrap());
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    let dev = g.alloc(8).unwrap();
    let stop = g.alloc_host(4).unwrap();
    let prepared = q.prepare(&k, &ONE).unwrap();
    for round in 0..20u64 {
        v.write(0, &round.to_le_bytes()).unwrap();
        let _busy = hold_busy(&mut q, &spin, &stop);
        let mut expect = steps(&mut q, &k, &v, 10 + round, round, round);
        for i in 0..10 {
            let (mul, add) = step_args(i, round + 100);
            expect = expect.wrapping_mul(mul).wrapping_add(add);
            let args = [Arg::Ptr(v.device_ptr()), Arg::U64(mul), Arg::U64(add)];
            // SAFETY: as in `steps`.
            unsafe {
                if i % 2 == 0 {
                    q.submit_fenced(&Launch::prepared(&prepared, &args))
                        .map(drop)
                } else {
                    q.submit(&Launch::prepared(&prepared, &args)).map(drop)
                }
            }
            .unwrap();
        }
        // A copy after the held launches sees their result: it sends them first.
        // SAFETY: both addresses are live buffers of 8 bytes.
        unsafe { q.copy_addresses(v.device_ptr(), dev.device_ptr(), 8) }.unwrap();
        stop.write(0, &1u32.to_le_bytes()).unwrap();
        let mut out = [0u8; 8];
        q.download(&g, &dev, 0, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), expect, "{b:?}: round {round}");
    }
}

fn programmatic_launches_chain_too(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(PDL_CUBIN).unwrap();
    let step = m.kernel("pdl_step").unwrap();
    let spin_m = g.load_module(CUBIN).unwrap();
    let spin = spin_m.kernel("spin").unwrap();
    let mut q = chained(&g);
    let n = 1u32 << 16;
    let buf = g.alloc(u64::from(n) * 4).unwrap();
    q.upload(&g, &buf, 0, &vec![0u8; n as usize * 4]).unwrap();
    let stop = g.alloc_host(4).unwrap();
    let cfg = LaunchConfig::linear(n / 256, 256);
    let _busy = hold_busy(&mut q, &spin, &stop);
    // Fewer than the queue's launch slots behind the spinning kernel (see runs_in_order_behind_busy_work).
    for v in 0..200u32 {
        // SAFETY: pdl_step runs griddepcontrol.wait before it touches `buf`, used by this queue alone.
        let args = [buf.arg(), Arg::U32(n), Arg::U32(v)];
        unsafe { q.submit(&Launch::new(&step, &cfg, &args).programmatic()) }.unwrap();
    }
    stop.write(0, &1u32.to_le_bytes()).unwrap();
    q.synchronize().unwrap();
    let mut out = vec![0u8; n as usize * 4];
    q.download(&g, &buf, 0, &mut out).unwrap();
    // Reference: the same launches on a plain queue.
    let mut plain = g.queue().unwrap();
    let buf2 = g.alloc(u64::from(n) * 4).unwrap();
    plain
        .upload(&g, &buf2, 0, &vec![0u8; n as usize * 4])
        .unwrap();
    for v in 0..200u32 {
        // SAFETY: as above.
        let args = [buf2.arg(), Arg::U32(n), Arg::U32(v)];
        unsafe { plain.submit(&Launch::new(&step, &cfg, &args).programmatic()) }.unwrap();
    }
    plain.synchronize().unwrap();
    let mut want = vec![0u8; n as usize * 4];
    plain.download(&g, &buf2, 0, &mut want).unwrap();
    assert!(
        out == want,
        "{b:?}: programmatic launches on a chained queue differ"
    );
}

fn a_million_launches_stay_in_order(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let k = m.kernel("chain_step").unwrap();
    let mut q = chained(&g);
    let v = g.alloc_host(8).unwrap();
    v.write(0, &1u64.to_le_bytes()).unwrap();
    let t = Instant::now();
    let expect = steps(&mut q, &k, &v, 1_000_000, 77, 1);
    q.synchronize().unwrap();
    eprintln!(
        "{b:?}: 10^6 dependent launches on a chained queue in {:?}",
        t.elapsed()
    );
    assert_eq!(read_u64(&v), expect, "{b:?}");
}

macro_rules! both {
    ($($name:ident),*) => {
        mod direct {
            $(#[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Direct) })*
        }
        mod driver {
            $(#[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Driver) })*
        }
    };
}

both!(
    runs_in_order_behind_busy_work,
    held_launches_are_sent_once_the_gpu_catches_up,
    a_flush_sends_what_is_held,
    a_lone_launch_is_sent_at_once,
    copies_and_prepared_launches_keep_their_place,
    programmatic_launches_chain_too,
    a_million_launches_stay_in_order
);
