//! Launch benchmarks: APEX's direct path beside cuLaunchKernel (and CUDA graphs), in one process and one run.
//! Needs an NVIDIA GPU with the 580 open kernel module and libcuda; prints a note and measures nothing
//! otherwise.
//!
//! Groups (each measures both paths):
//! - `submit`: CPU cost of one launch call (the queue is drained outside the timed part every 256 launches), also
//!   for prepared launches with the launch memory in video and in host memory;
//! - `submit_isolated`: one prepared call at a time (returning its timeline value), each after a full fence and
//!   2 µs of other work, so that the previous call's doorbell no longer holds up its stores; cuLaunchKernel alike;
//! - `launch_to_completion`: one launch, then wait until the CPU sees it complete;
//! - `dependent_1000`: 1000 launches in stream order and one wait, per launch (also on a chained queue,
//!   `ComputeQueueConfig::chained_stream`, whose launches made while it is busy become GPU-scheduled links);
//! - `batched_1000`: the same 1000 launches under one doorbell (direct), as one chain of QMDs (direct) and as a
//!   CUDA graph replay (cuGraphLaunch);
//! - `independent_1000`: 1000 launches that may run concurrently (direct) vs. one stream, per launch.

use std::hint::black_box;
use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig, LaunchMemory};
use apex::module::{Kernel, Module};
use apex::rm::GpuCore;
use criterion::{Criterion, criterion_group, criterion_main};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(10);

struct Paths {
    q: ComputeQueue,
    q_host: ComputeQueue,
    /// A queue with `chained_stream` on.
    q_chained: ComputeQueue,
    /// The same with its launch memory in host memory.
    q_chained_host: ComputeQueue,
    k: Kernel,
    stream: driver::Stream,
    f: driver::Function,
    _gpu: std::sync::Arc<GpuCore>,
}

fn setup() -> Option<Paths> {
    // The CUDA driver first: it places its own address ranges at fixed addresses before APEX reserves its own.
    let ctx = match driver::Context::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("launch benchmarks skipped: CUDA driver unavailable: {e}");
            return None;
        }
    };
    let gpu = match GpuCore::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("launch benchmarks skipped: direct path unavailable: {e}");
            return None;
        }
    };
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).ok()?;
    let q_host = ComputeQueue::new(
        &gpu,
        ComputeQueueConfig::default().with_memory(LaunchMemory::Host),
    )
    .ok()?;
    let q_chained = ComputeQueue::new(
        &gpu,
        ComputeQueueConfig::default().with_chained_stream(true),
    )
    .ok()?;
    let q_chained_host = ComputeQueue::new(
        &gpu,
        ComputeQueueConfig::default()
            .with_chained_stream(true)
            .with_memory(LaunchMemory::Host),
    )
    .ok()?;
    let k = Module::load(&gpu, CUBIN).ok()?.kernel("empty").ok()?;
    let stream = driver::Stream::new(&ctx).ok()?;
    let f = driver::Module::load(&ctx, CUBIN)
        .ok()?
        .function("empty")
        .ok()?;
    Some(Paths {
        q,
        q_host,
        q_chained,
        q_chained_host,
        k,
        stream,
        f,
        _gpu: gpu,
    })
}

const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);

impl Paths {
    fn direct(&mut self) -> apex::pushbuf::Fence {
        // SAFETY: the empty kernel touches no memory.
        unsafe { self.q.launch(&self.k, &ONE, &[]) }.expect("direct launch")
    }
    fn cuda(&mut self) {
        // SAFETY: the empty kernel takes no parameters and touches no memory.
        unsafe {
            self.stream
                .launch(&self.f, [1, 1, 1], [1, 1, 1], 0, &mut [])
        }
        .expect("cuLaunchKernel");
    }
}

fn benches(c: &mut Criterion) {
    let Some(mut p) = setup() else { return };

    let mut g = c.benchmark_group("submit");
    g.bench_function("apex_direct", |b| {
        b.iter_custom(|iters| in_bursts(iters, &mut p, Paths::direct, |_, f| drain(f)))
    });
    // The same launches recorded without ringing the doorbell (one doorbell per 256, outside the timed part):
    // what building and writing a launch costs, apart from the store fence and the doorbell write.
    g.bench_function("apex_direct_record_only", |b| {
        b.iter_custom(|iters| {
            in_bursts(
                iters,
                &mut p,
                // SAFETY: the empty kernel touches no memory.
                |p| unsafe { p.q.record_launch(&p.k, &ONE, &[]) }.expect("record"),
                |p, f| {
                    p.q.flush();
                    drain(f)
                },
            )
        })
    });
    // Prepared launches (`ComputeQueue::prepare_launch`), with the launch memory in video memory (the default) and
    // in CPU-cached host memory.
    for (name, q) in [
        ("apex_prepared", &mut p.q),
        ("apex_prepared_host", &mut p.q_host),
    ] {
        let prepared = q.prepare_launch(&p.k, &ONE).expect("prepare");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                in_bursts(
                    iters,
                    q,
                    // SAFETY: the empty kernel touches no memory.
                    |q| unsafe { q.launch_prepared(&prepared, &[]) }.expect("launch"),
                    |_, f| drain(f),
                )
            })
        });
    }
    g.bench_function("cuLaunchKernel", |b| {
        b.iter_custom(|iters| {
            in_bursts(iters, &mut p, Paths::cuda, |p, ()| {
                p.stream.synchronize().expect("drain")
            })
        })
    });
    g.finish();

    // One call at a time, isolated: each timed call starts after a full fence and 2 µs of spinning, so that the
    // previous call's stores and uncached doorbell have left the CPU (a caller doing other work between launches).
    // The calls return the timeline value, not a fence (no reference count).
    let mut g = c.benchmark_group("submit_isolated");
    for (name, q) in [
        ("apex_prepared_value", &mut p.q),
        ("apex_prepared_value_host", &mut p.q_host),
    ] {
        let prepared = q.prepare_launch(&p.k, &ONE).expect("prepare");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                isolated(
                    iters,
                    q,
                    // SAFETY: the empty kernel touches no memory.
                    |q| unsafe { q.launch_prepared_value(&prepared, &[]) }.expect("launch"),
                    |q| q.synchronize().expect("drain"),
                )
            })
        });
    }
    g.bench_function("cuLaunchKernel", |b| {
        b.iter_custom(|iters| {
            isolated(iters, &mut p, Paths::cuda, |p| {
                p.stream.synchronize().expect("drain")
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("launch_to_completion");
    g.bench_function("apex_direct", |b| {
        b.iter(|| p.direct().wait(T).expect("wait"))
    });
    // A lone launch on an idle chained queue is sent at once: launch → completion as on any queue.
    g.bench_function("apex_chained_stream", |b| {
        b.iter(|| {
            // SAFETY: the empty kernel touches no memory.
            unsafe { p.q_chained.launch(&p.k, &ONE, &[]) }
                .expect("launch")
                .wait(T)
                .expect("wait")
        })
    });
    g.bench_function("cuLaunchKernel", |b| {
        b.iter(|| {
            p.cuda();
            p.stream.synchronize().expect("sync")
        })
    });
    g.finish();

    let mut g = c.benchmark_group("dependent_1000");
    g.bench_function("apex_direct", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                let mut last = None;
                for _ in 0..1000 {
                    last = Some(p.direct());
                }
                last.expect("launched").wait(T).expect("wait");
            })
        })
    });
    // The same plain launch calls on a chained queue: those made while it is busy are held as links.
    g.bench_function("apex_chained_stream", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                let mut last = None;
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    last = Some(unsafe { p.q_chained.launch(&p.k, &ONE, &[]) }.expect("launch"));
                }
                p.q_chained.flush_held().expect("flush");
                last.expect("launched").wait(T).expect("wait");
            })
        })
    });
    // The same with the chained queue's launch memory in host memory (QMD writes are cached stores, not
    // write-combined ones through BAR1; the GPU reads them over PCIe).
    g.bench_function("apex_chained_stream_host", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                let mut last = None;
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    last =
                        Some(unsafe { p.q_chained_host.launch(&p.k, &ONE, &[]) }.expect("launch"));
                }
                p.q_chained_host.flush_held().expect("flush");
                last.expect("launched").wait(T).expect("wait");
            })
        })
    });
    // The same on the chained queue through the call `apex::Queue::submit` makes (a timeline value, no fence): a
    // fence's reference count is a locked instruction, which waits for the launch's stores and doorbell.
    g.bench_function("apex_chained_stream_ticket", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                let mut last = 0;
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    last = unsafe { p.q_chained.launch_value(&p.k, &ONE, &[]) }.expect("launch");
                }
                p.q_chained.flush_held().expect("flush");
                p.q_chained.fence_for(last).wait(T).expect("wait");
            })
        })
    });
    g.bench_function("cuLaunchKernel", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                for _ in 0..1000 {
                    p.cuda();
                }
                p.stream.synchronize().expect("sync");
            })
        })
    });
    g.finish();

    let graph = driver::Graph::capture(&mut p.stream, |s| {
        for _ in 0..1000 {
            // SAFETY: as in `Paths::cuda`.
            unsafe { s.launch(&p.f, [1, 1, 1], [1, 1, 1], 0, &mut [])? };
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("capturing a CUDA graph: {e}"));
    let mut g = c.benchmark_group("batched_1000");
    g.bench_function("apex_direct_one_doorbell", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                let mut last = None;
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    last = Some(unsafe { p.q.record_launch(&p.k, &ONE, &[]) }.expect("record"));
                }
                p.q.flush();
                last.expect("launched").wait(T).expect("wait");
            })
        })
    });
    g.bench_function("apex_direct_chained", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    unsafe { p.q.record_launch_chained(&p.k, &ONE, &[]) }.expect("record");
                }
                p.q.end_chain().expect("end chain").wait(T).expect("wait");
            })
        })
    });
    p.q.set_chain_action(apex::launch::qmd::ChainAction::Schedule);
    g.bench_function("apex_direct_chained_schedule", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    unsafe { p.q.record_launch_chained(&p.k, &ONE, &[]) }.expect("record");
                }
                p.q.end_chain().expect("end chain").wait(T).expect("wait");
            })
        })
    });
    p.q.set_chain_action(apex::launch::qmd::ChainAction::InvalidateCopySchedule);
    g.bench_function("cuGraphLaunch", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                graph.launch(&mut p.stream).expect("cuGraphLaunch");
                p.stream.synchronize().expect("sync");
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("independent_1000");
    g.bench_function("apex_direct_concurrent", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    unsafe { p.q.record_launch_unordered(&p.k, &ONE, &[]) }.expect("record");
                }
                p.q.join().expect("join").wait(T).expect("wait");
            })
        })
    });
    g.bench_function("cuLaunchKernel", |b| {
        b.iter_custom(|iters| {
            per_launch(iters, || {
                for _ in 0..1000 {
                    p.cuda();
                }
                p.stream.synchronize().expect("sync");
            })
        })
    });
    g.finish();
    black_box(&p.q);
}

/// The time of `iters` calls of `launch` on `state`, one at a time, in bursts of 256: after each burst, outside the
/// timed part, `drain` waits for the burst (given the last call's result), so the GPU's pace is never what is timed.
fn in_bursts<S: ?Sized, F>(
    iters: u64,
    state: &mut S,
    launch: impl Fn(&mut S) -> F,
    drain: impl Fn(&mut S, F),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(256);
        let t = Instant::now();
        let mut last = launch(state);
        for _ in 1..n {
            last = launch(state);
        }
        total += t.elapsed();
        drain(state, last);
        left -= n;
    }
    total
}

/// Times `iters` calls of `launch` one at a time, each after a full fence and 2 µs of spinning (untimed), draining
/// every 64 calls.
fn isolated<S: ?Sized, F>(
    iters: u64,
    state: &mut S,
    launch: impl Fn(&mut S) -> F,
    drain: impl Fn(&mut S),
) -> Duration {
    let mut total = Duration::ZERO;
    for i in 0..iters {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let gap = Instant::now();
        while gap.elapsed() < Duration::from_micros(2) {
            std::hint::spin_loop();
        }
        let t = Instant::now();
        black_box(launch(state));
        total += t.elapsed();
        if i % 64 == 63 {
            drain(state);
        }
    }
    drain(state);
    total
}

fn drain(f: apex::pushbuf::Fence) {
    f.wait(T).expect("drain");
}

/// Runs `batch` (1000 launches) often enough for `iters` launches and returns the total time, so criterion
/// reports the time per launch.
fn per_launch(iters: u64, mut batch: impl FnMut()) -> Duration {
    let rounds = iters.div_ceil(1000).max(1);
    let t = Instant::now();
    for _ in 0..rounds {
        batch();
    }
    t.elapsed().mul_f64(iters as f64 / (rounds * 1000) as f64)
}

criterion_group! {
    name = launch;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(launch);
