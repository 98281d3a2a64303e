//! Chained launches on the GPU (run with `--include-ignored` on an NVIDIA GPU): each link is scheduled by the
//! compute work distributor when the one before has completed. Every test checks results that depend on the order
//! of the links and on each link seeing the previous one's writes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use apex::launch::qmd::ChainAction;
use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::{Kernel, Module};
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);

fn setup() -> (Arc<GpuCore>, ComputeQueue, Arc<Module>) {
    let gpu = GpuCore::open(0).unwrap();
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let m = Module::load(&gpu, CUBIN).unwrap();
    (gpu, q, m)
}

fn buffer(gpu: &Arc<GpuCore>, bytes: u64) -> Memory {
    Memory::alloc(gpu, MemoryDesc::video(bytes).with_cpu()).unwrap()
}

fn read_u64(m: &Memory) -> u64 {
    let mut b = [0u8; 8];
    m.read(0, &mut b).unwrap();
    u64::from_le_bytes(b)
}

fn step_args(i: u64, seed: u64) -> (u64, u64) {
    (i.wrapping_mul(0x9e37_79b9) | 1, i ^ seed)
}

/// Records `n` chained `chain_step` links on `v` and returns the value they leave there, starting from `start`.
fn record_steps(
    q: &mut ComputeQueue,
    k: &Kernel,
    v: &Memory,
    n: u64,
    seed: u64,
    start: u64,
) -> u64 {
    let mut expect = start;
    for i in 0..n {
        let (mul, add) = step_args(i, seed);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: the kernel touches the 8 bytes of `v`.
        unsafe {
            q.record_launch_chained(k, &ONE, &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)])
        }
        .unwrap();
    }
    expect
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chains_of_every_length_run_in_order() {
    let (gpu, mut q, m) = setup();
    let k = m.kernel("chain_step").unwrap();
    let v = buffer(&gpu, 8);
    for action in [ChainAction::InvalidateCopySchedule, ChainAction::Schedule] {
        q.set_chain_action(action);
        // Around the slot count (256): a chain longer than the slots is sent in parts.
        for n in [1u64, 2, 3, 10, 255, 256, 257, 511, 1000, 5000] {
            let seed = n * 7 + 1;
            v.write(0, &seed.to_le_bytes()).unwrap();
            let t = Instant::now();
            let expect = record_steps(&mut q, &k, &v, n, seed, seed);
            q.end_chain().unwrap().wait(T).unwrap();
            assert_eq!(read_u64(&v), expect, "{action:?}, chain of {n}");
            eprintln!(
                "{action:?}: chain of {n}, recorded and run in {:?}",
                t.elapsed()
            );
        }
    }
}

/// Slots are rewritten with other kernels, shapes and chain positions all the time: a stale QMD anywhere would
/// show up as a wrong count, a wrong chain value or a fence that never completes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chains_mixed_with_other_launches_reuse_slots_correctly() {
    let (gpu, mut q, m) = setup();
    let step = m.kernel("chain_step").unwrap();
    let count = m.kernel("count_threads").unwrap();
    let v = buffer(&gpu, 8);
    let counter = buffer(&gpu, 4);
    counter.write(0, &[0; 4]).unwrap();
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut value, mut threads) = (0u64, 0u64);
    v.write(0, &value.to_le_bytes()).unwrap();
    let mut links = 0u64;
    for round in 0..400u64 {
        let len = 1 + next() % 300;
        for i in 0..len {
            if next() % 3 == 0 {
                let cfg =
                    LaunchConfig::linear(1 + (next() % 64) as u32, 32 * (1 + (next() % 8) as u32));
                threads += u64::from(cfg.grid[0] * cfg.block[0]);
                // SAFETY: the kernel increments the counter once per thread.
                unsafe { q.record_launch_chained(&count, &cfg, &[Arg::Ptr(counter.va())]) }
                    .unwrap();
            } else {
                let (mul, add) = step_args(i, round);
                value = value.wrapping_mul(mul).wrapping_add(add);
                let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
                // SAFETY: the kernel touches the 8 bytes of `v`.
                unsafe { q.record_launch_chained(&step, &ONE, &args) }.unwrap();
            }
            links += 1;
        }
        let fence = if round % 5 == 0 {
            // An ordered launch ends the chain and runs after it.
            let (mul, add) = step_args(round, 99);
            value = value.wrapping_mul(mul).wrapping_add(add);
            let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
            // SAFETY: as above.
            unsafe { q.launch(&step, &ONE, &args) }.unwrap()
        } else {
            q.end_chain().unwrap()
        };
        if round % 4 == 0 {
            fence.wait(T).unwrap();
            assert_eq!(read_u64(&v), value, "round {round}");
        }
    }
    q.synchronize().unwrap();
    let mut b = [0u8; 4];
    counter.read(0, &mut b).unwrap();
    assert_eq!(read_u64(&v), value);
    assert_eq!(u64::from(u32::from_le_bytes(b)), threads);
    eprintln!("{links} chained links in 400 chains, {threads} counted threads");
}

/// Many blocks per link, each link reading what every block of the one before wrote: y += a·x over 2^20 floats.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn each_link_sees_every_write_of_the_one_before() {
    let (gpu, mut q, m) = setup();
    let saxpy = m.kernel("saxpy").unwrap();
    let n = 1u32 << 20;
    let x = buffer(&gpu, u64::from(n) * 4);
    let y = buffer(&gpu, u64::from(n) * 4);
    let xs: Vec<u8> = (0..n)
        .flat_map(|i| ((i % 7) as f32).to_le_bytes())
        .collect();
    x.write(0, &xs).unwrap();
    y.write(0, &vec![0u8; n as usize * 4]).unwrap();
    let cfg = LaunchConfig::linear(n / 256, 256);
    let links = 200u32;
    for j in 0..links {
        let a = (j % 3 + 1) as f32;
        let args = [Arg::F32(a), Arg::Ptr(x.va()), Arg::Ptr(y.va()), Arg::U32(n)];
        // SAFETY: saxpy reads x and writes y, both n floats.
        unsafe { q.record_launch_chained(&saxpy, &cfg, &args) }.unwrap();
    }
    q.end_chain().unwrap().wait(T).unwrap();
    let sum_a: f32 = (0..links).map(|j| (j % 3 + 1) as f32).sum();
    let mut out = vec![0u8; n as usize * 4];
    y.read(0, &mut out).unwrap();
    for (i, w) in out.chunks_exact(4).enumerate() {
        let got = f32::from_le_bytes(w.try_into().unwrap());
        let want = sum_a * (i % 7) as f32;
        assert_eq!(got, want, "y[{i}]");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chained_links_against_one_doorbell_and_stream_order() {
    let (gpu, mut q, m) = setup();
    let k = m.kernel("chain_step").unwrap();
    let v = buffer(&gpu, 8);
    let n = 1000u64;
    let mut best = [Duration::MAX; 3];
    for _ in 0..20 {
        v.write(0, &1u64.to_le_bytes()).unwrap();
        let t = Instant::now();
        let expect = record_steps(&mut q, &k, &v, n, 5, 1);
        q.end_chain().unwrap().wait(T).unwrap();
        best[0] = best[0].min(t.elapsed());
        assert_eq!(read_u64(&v), expect);

        v.write(0, &1u64.to_le_bytes()).unwrap();
        let t = Instant::now();
        let mut last = None;
        for i in 0..n {
            let (mul, add) = step_args(i, 5);
            let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
            // SAFETY: the kernel touches the 8 bytes of `v`.
            last = Some(unsafe { q.record_launch(&k, &ONE, &args) }.unwrap());
        }
        q.flush();
        last.take().unwrap().wait(T).unwrap();
        best[1] = best[1].min(t.elapsed());
        assert_eq!(read_u64(&v), expect);

        v.write(0, &1u64.to_le_bytes()).unwrap();
        let t = Instant::now();
        for i in 0..n {
            let (mul, add) = step_args(i, 5);
            let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
            // SAFETY: as above.
            last = Some(unsafe { q.launch(&k, &ONE, &args) }.unwrap());
        }
        last.take().unwrap().wait(T).unwrap();
        best[2] = best[2].min(t.elapsed());
        assert_eq!(read_u64(&v), expect);
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
    eprintln!(
        "1000 dependent chain_step launches, best of 20, per launch: chained {:.3} µs, one doorbell {:.3} µs, \
         doorbell each {:.3} µs",
        per(best[0]),
        per(best[1]),
        per(best[2])
    );
}
