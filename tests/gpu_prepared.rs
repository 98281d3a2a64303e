//! Prepared launches on the GPU, on both backends and in both launch memories: thousands of launches with
//! arguments that change every time, interleaved with ordinary launches of the same kernel, compute exactly what
//! the CPU computes in the same order (run with `--include-ignored` on an NVIDIA GPU with libcuda).

use std::time::Duration;

use apex::{Arg, Backend, Gpu, Launch, LaunchConfig, LaunchMemory, QueueOptions};

#[path = "support/gpu.rs"]
mod support_gpu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

/// `APEX_LOG=1`: the library's debug log on stderr (what RM and the queues did), for a failure's report.
fn log() {
    if std::env::var_os("APEX_LOG").is_some() {
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::fmt()
                .with_max_level(tracing::Level::DEBUG)
                .with_writer(std::io::stderr)
                .finish(),
        );
    }
}

fn gpu(b: Backend) -> Gpu {
    log();
    support_gpu::open(b)
}

fn run(b: Backend, memory: LaunchMemory) {
    run_with(b, QueueOptions::default().launch_memory(memory));
}

fn run_with(b: Backend, options: QueueOptions) {
    let memory = options.launch_memory;
    let polled = options.polled;
    let g = gpu(b);
    let mut q = g.queue_with(options).unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let step = m.kernel("chain_step").unwrap();
    let saxpy = m.kernel("saxpy").unwrap();
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let (dv, dx, dy) = (
        g.alloc(8).unwrap(),
        g.alloc(4 * n as u64).unwrap(),
        g.alloc(4 * n as u64).unwrap(),
    );
    q.upload(&g, &dv, 0, &3u64.to_le_bytes()).unwrap();
    q.upload(
        &g,
        &dx,
        0,
        &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    q.upload(
        &g,
        &dy,
        0,
        &y.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();

    let one = LaunchConfig::linear(1, 1);
    let p_step = q.prepare(&step, &one).unwrap();
    let p_saxpy = q.prepare(&saxpy, &LaunchConfig::linear(4, 256)).unwrap();
    assert_eq!(p_saxpy.config().grid, [4, 1, 1]);
    let mut value = 3u64;
    let mut last = None;
    for i in 0..6000u64 {
        // Not commutative: a lost, repeated or reordered launch changes the result.
        let (mul, add) = (i % 3 + 1, i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        value = value.wrapping_mul(mul).wrapping_add(add);
        let args = [dv.arg(), Arg::U64(mul), Arg::U64(add)];
        // SAFETY: chain_step reads and writes the 8 bytes of dv; saxpy reads n floats of dx and updates n of dy.
        last = Some(unsafe {
            match i % 7 {
                3 => q.launch(&step, &one, &args).unwrap(),
                5 => {
                    let a = 1.0 / (i as f32 + 1.0);
                    for (yy, xx) in y.iter_mut().zip(&x) {
                        *yy = a.mul_add(*xx, *yy);
                    }
                    let saxpy_args = [Arg::F32(a), dx.arg(), dy.arg(), Arg::U32(n as u32)];
                    q.submit_fenced(&Launch::prepared(&p_saxpy, &saxpy_args))
                        .unwrap();
                    q.submit_fenced(&Launch::prepared(&p_step, &args)).unwrap()
                }
                6 => {
                    let t = q.submit(&Launch::prepared(&p_step, &args)).unwrap();
                    q.fence(t).unwrap()
                }
                0 => {
                    // A ticket alone; the launches after it order it.
                    q.submit(&Launch::prepared(&p_step, &args)).unwrap();
                    continue;
                }
                _ => q.submit_fenced(&Launch::prepared(&p_step, &args)).unwrap(),
            }
        });
    }
    last.unwrap().wait(T).unwrap();
    let mut out = [0u8; 8];
    q.download(&g, &dv, 0, &mut out).unwrap();
    assert_eq!(
        u64::from_le_bytes(out),
        value,
        "{b:?} {memory:?} polled {polled}: chain_step's value"
    );
    let mut out = vec![0u8; 4 * n];
    q.download(&g, &dy, 0, &mut out).unwrap();
    for (i, w) in out.chunks_exact(4).enumerate() {
        assert_eq!(
            f32::from_le_bytes(w.try_into().unwrap()).to_bits(),
            y[i].to_bits(),
            "{b:?} {memory:?} polled {polled}: y[{i}]"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_launches_compute_in_order_direct_video_memory() {
    run(Backend::Direct, LaunchMemory::Video);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_launches_compute_in_order_direct_host_memory() {
    run(Backend::Direct, LaunchMemory::Host);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_launches_compute_in_order_polled_in_both_memories() {
    for memory in [LaunchMemory::Host, LaunchMemory::Video] {
        run_with(
            Backend::Direct,
            QueueOptions::default().launch_memory(memory).polled(true),
        );
    }
    // The driver backend has nothing to poll and ignores the option.
    run_with(Backend::Driver, QueueOptions::default().polled(true));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn idle_polled_queues_let_other_queues_run() {
    // A polled queue parks its channel at a gate while idle; its channel group yields, so another queue's launches
    // still complete at their usual pace, and both queues keep their work in order.
    let g = gpu(Backend::Direct);
    let m = g.load_module(CUBIN).unwrap();
    let empty = m.kernel("empty").unwrap();
    let step = m.kernel("chain_step").unwrap();
    let one = LaunchConfig::linear(1, 1);
    let median = |q: &mut apex::Queue| {
        let p = q.prepare(&empty, &one).unwrap();
        let mut t: Vec<Duration> = (0..2000)
            .map(|_| {
                let s = std::time::Instant::now();
                // SAFETY: the empty kernel touches no memory.
                unsafe { q.submit_fenced(&Launch::prepared(&p, &[])) }
                    .unwrap()
                    .wait(T)
                    .unwrap();
                s.elapsed()
            })
            .collect();
        t.sort();
        t[t.len() / 2]
    };
    let mut other = g.queue().unwrap();
    let alone = median(&mut other);
    let mut polled: Vec<apex::Queue> = (0..2)
        .map(|_| g.queue_with(QueueOptions::default().polled(true)).unwrap())
        .collect();
    for q in &mut polled {
        // Armed and parked: the first doorbell arms the slots.
        q.synchronize().unwrap();
        median(q);
    }
    let beside = median(&mut other);
    eprintln!(
        "launch → completion on a doorbell queue: {alone:?} alone, {beside:?} beside two idle polled queues"
    );
    assert!(
        beside < alone * 3,
        "{beside:?} beside idle polled queues against {alone:?} alone"
    );
    // Work on all three, interleaved, stays in order on each.
    let v: Vec<_> = (0..3).map(|_| g.alloc(8).unwrap()).collect();
    let mut want = [1u64; 3];
    for (i, b) in v.iter().enumerate() {
        let q = if i == 0 {
            &mut other
        } else {
            &mut polled[i - 1]
        };
        q.upload(&g, b, 0, &1u64.to_le_bytes()).unwrap();
    }
    for r in 0..3000u64 {
        let i = (r % 3) as usize;
        let (mul, add) = (r % 5 + 1, r);
        want[i] = want[i].wrapping_mul(mul).wrapping_add(add);
        let q = if i == 0 {
            &mut other
        } else {
            &mut polled[i - 1]
        };
        // SAFETY: chain_step reads and writes the 8 bytes of v[i], used by queue i alone.
        unsafe { q.launch(&step, &one, &[v[i].arg(), Arg::U64(mul), Arg::U64(add)]) }.unwrap();
    }
    for (i, b) in v.iter().enumerate() {
        let q = if i == 0 {
            &mut other
        } else {
            &mut polled[i - 1]
        };
        q.synchronize().unwrap();
        let mut out = [0u8; 8];
        q.download(&g, b, 0, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), want[i], "queue {i}");
    }
    drop(polled);
    let after = median(&mut other);
    eprintln!("once the polled queues are dropped: {after:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_ticket_is_refused_by_another_queue() {
    let g = gpu(Backend::Direct);
    let m = g.load_module(CUBIN).unwrap();
    let step = m.kernel("chain_step").unwrap();
    let v = g.alloc(8).unwrap();
    let mut q = g.queue().unwrap();
    let other = g.queue().unwrap();
    let p = q.prepare(&step, &LaunchConfig::linear(1, 1)).unwrap();
    // SAFETY: chain_step reads and writes the 8 bytes of v.
    let args = [v.arg(), Arg::U64(1), Arg::U64(1)];
    let t = unsafe { q.submit(&Launch::prepared(&p, &args)) }.unwrap();
    let e = other.fence(t).unwrap_err().to_string();
    assert!(e.contains("ticket"), "{e}");
    q.fence(t).unwrap().wait(T).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_launches_compute_in_order_driver() {
    run(Backend::Driver, LaunchMemory::Video);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_prepared_launch_is_refused_on_another_queue() {
    let g = gpu(Backend::Direct);
    let m = g.load_module(CUBIN).unwrap();
    let empty = m.kernel("empty").unwrap();
    let mut a = g.queue().unwrap();
    let mut b = g.queue().unwrap();
    let p = a.prepare(&empty, &LaunchConfig::linear(1, 1)).unwrap();
    // SAFETY: the empty kernel touches no memory.
    let e = unsafe { b.submit(&Launch::prepared(&p, &[])) }.unwrap_err();
    assert!(e.to_string().contains("prepare it on this queue"), "{e}");
    // A chained link of it too.
    // SAFETY: as above.
    let e = unsafe { b.submit(&Launch::prepared(&p, &[]).chained()) }.unwrap_err();
    assert!(e.to_string().contains("prepare it on this queue"), "{e}");
    // SAFETY: as above.
    unsafe { a.submit_fenced(&Launch::prepared(&p, &[])) }
        .unwrap()
        .wait(T)
        .unwrap();
}

/// The lower layer with inline QMDs (`ComputeQueueConfig::inline_qmd`) in both launch memories: ordinary,
/// prepared and chained launches of one non-commutative kernel, every result in order.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn inline_qmd_launches_compute_in_order() {
    use apex::launch::{ComputeQueue, ComputeQueueConfig};
    use apex::module::Module;
    use apex::rm::{GpuCore, Memory, MemoryDesc};
    log();
    let gpu = GpuCore::open(0).unwrap();
    for memory in [LaunchMemory::Video, LaunchMemory::Host] {
        let mut q = ComputeQueue::new(
            &gpu,
            ComputeQueueConfig::default()
                .with_memory(memory)
                .with_inline_qmd(true),
        )
        .unwrap();
        let step = Module::load(&gpu, CUBIN)
            .unwrap()
            .kernel("chain_step")
            .unwrap();
        let v = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu()).unwrap();
        v.write_u64_volatile(0, 5).unwrap();
        let one = LaunchConfig::linear(1, 1);
        let p = q.prepare_launch(&step, &one).unwrap();
        let mut want = 5u64;
        for i in 0..3000u64 {
            let (mul, add) = (i % 5 + 1, i.wrapping_mul(0x2545_f491_4f6c_dd1d));
            want = want.wrapping_mul(mul).wrapping_add(add);
            let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
            // SAFETY: chain_step reads and writes the first 8 bytes of v, which nothing else uses.
            unsafe {
                match i % 4 {
                    0 => q.launch(&step, &one, &args).map(drop).unwrap(),
                    1 | 2 => q.record_launch_chained(&step, &one, &args).unwrap(),
                    _ => q.launch_prepared(&p, &args).map(drop).unwrap(),
                }
            }
        }
        q.synchronize().unwrap();
        assert_eq!(v.read_u64_volatile(0).unwrap(), want, "{memory:?}");
    }
}

/// Stream order by waiting for idle (`StreamOrder::WaitForIdle`) instead of the front end's acquire keeps every
/// launch after the one before: a non-commutative read-modify-write chain, and a many-block kernel reading what
/// the launch before wrote, both checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wait_for_idle_stream_order_keeps_launches_in_order() {
    use apex::launch::{ComputeQueue, ComputeQueueConfig, StreamOrder};
    use apex::module::Module;
    use apex::rm::{GpuCore, Memory, MemoryDesc};
    log();
    let gpu = GpuCore::open(0).unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    q.set_stream_order(StreamOrder::WaitForIdle);
    let m = Module::load(&gpu, CUBIN).unwrap();
    let step = m.kernel("chain_step").unwrap();
    let saxpy = m.kernel("saxpy").unwrap();
    let n = 1 << 16;
    let v = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu()).unwrap();
    let x = Memory::alloc(&gpu, MemoryDesc::video(4 * n as u64).with_cpu()).unwrap();
    let y = Memory::alloc(&gpu, MemoryDesc::video(4 * n as u64).with_cpu()).unwrap();
    v.write_u64_volatile(0, 9).unwrap();
    let xs: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.25).collect();
    x.write(
        0,
        &xs.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    y.fill(0, 4 * n as u64, 0).unwrap();
    let mut ys = vec![0f32; n];
    let one = LaunchConfig::linear(1, 1);
    let p = q.prepare_launch(&step, &one).unwrap();
    let mut want = 9u64;
    for i in 0..4000u64 {
        let (mul, add) = (i % 3 + 2, i ^ 0x5bd1_e995);
        want = want.wrapping_mul(mul).wrapping_add(add);
        let args = [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
        // SAFETY: chain_step reads and writes v's first 8 bytes; saxpy reads x and updates y (n floats each).
        unsafe {
            if i % 2 == 0 {
                q.launch_prepared(&p, &args).map(drop).unwrap();
            } else {
                q.launch(&step, &one, &args).map(drop).unwrap();
            }
            if i % 100 == 0 {
                // y = a*x + y over 256 blocks: a launch that overlapped the one before would lose updates.
                let a = (i / 100) as f32 + 1.0;
                for (yy, xx) in ys.iter_mut().zip(&xs) {
                    *yy = a.mul_add(*xx, *yy);
                }
                let args = [
                    Arg::F32(a),
                    Arg::Ptr(x.va()),
                    Arg::Ptr(y.va()),
                    Arg::U32(n as u32),
                ];
                q.launch(&saxpy, &LaunchConfig::linear((n / 256) as u32, 256), &args)
                    .map(drop)
                    .unwrap();
            }
        }
    }
    q.synchronize().unwrap();
    assert_eq!(v.read_u64_volatile(0).unwrap(), want);
    let mut out = vec![0u8; 4 * n];
    y.read(0, &mut out).unwrap();
    for (i, w) in out.chunks_exact(4).enumerate() {
        assert_eq!(
            f32::from_le_bytes(w.try_into().unwrap()).to_bits(),
            ys[i].to_bits(),
            "y[{i}]"
        );
    }
}
