//! Where a launch's CPU time and its time to completion go, for each place the direct path can keep its launch
//! memory (video memory through BAR1, or CPU-cached host memory), beside cuLaunchKernel, all in one process:
//!
//! - `call`: the CPU time of one launch call, doorbell included, one call at a time (the queue is drained outside
//!   the timed calls every 64 launches, so the GPU's pace is never what is timed): ordinary `launch`,
//!   `launch_prepared` without and with parameters;
//! - `record` / `doorbell`: the prepared call split into recording the launch and ringing the doorbell; the same
//!   back to back (64 per sample), where store buffers and write-combining fill;
//! - each of these also with inline QMDs (`ComputeQueueConfig::inline_qmd`);
//! - `completion`: a prepared launch, then a wait until the CPU sees it complete; `completion_fe` is the same
//!   launch signalled by the front end (a semaphore release after wait-for-idle) instead of the QMD's release;
//! - `round_trip`: a bare semaphore release after wait-for-idle, submitted and waited for (no kernel), on the
//!   same queue: the floor the launch → completion target is measured against;
//! - `launch_prepared_value`: the prepared call returning its timeline value instead of a fence (no reference
//!   count taken or dropped);
//! - `..., isolated`: the call timed after a full fence and `APEX_GAP_NS` (default 2000) of spinning, so that the
//!   previous call's stores and uncached doorbell have left the CPU (as for a caller that does other work between
//!   launches; back to back, each call also waits behind the previous one's doorbell); cuLaunchKernel the same way;
//! - `api ...`: the same prepared call through the public `apex::Queue`, returning a fence and returning a ticket, per
//!   queue option (and on the driver backend).
//!
//! Prints min / median / p99 in nanoseconds. `APEX_SAMPLES` sets the samples per series (default 20 000);
//! `APEX_CONFIGS` (comma-separated: video, video+inline, host, host+inline, video+armed, host+armed,
//! host+armed+fetch, video+armed+inline, and host, host+inline, host+armed+fetch, host+armed with "+pf") the
//! configurations measured ("armed" is polled submission, `Submission::Armed`; "+pf" prefetches the next launch's
//! lines for writing, `ComputeQueueConfig::prefetch_next`, which the host configurations without it turn off);
//! with it, `APEX_PUBLIC=1` adds the public-API series, `APEX_AB=1` the interleaved prefetch A/B and `APEX_QMD_AB=1`
//! the interleaved QMD read-ahead A/B (`ComputeQueueConfig::prefetch_qmds`); `APEX_REVERSE=1` runs the configurations in reverse order;
//! `APEX_OWN_GROUP=1` builds each configuration's queue in a channel group of its own (`ChannelConfig::own_group`)
//! instead of the group the GPU's channels share; `APEX_ARMED=slots,words` sets the armed shape; `APEX_PUSH_BYTES` and `APEX_SLOTS` the pushbuffer size and
//! launch slots.

mod support;

use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::{
    Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig, LaunchMemory, StreamOrder,
};
use apex::module::Module;
use apex::pushbuf::{Acquire, Armed, Submission};
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const WAIT: Duration = Duration::from_secs(10);
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);
/// Launches between drains in the per-call series.
const BURST: usize = 64;

fn main() -> std::process::ExitCode {
    support::report(run())
}

struct Row {
    name: String,
    ns: Vec<f64>,
}

fn stats(ns: &[f64]) -> (f64, f64, f64) {
    let mut s = ns.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    (s[0], s[n / 2], s[n * 99 / 100])
}

/// Lets the previous call's stores leave the CPU (a full fence), then spins for `gap`: the next timed call starts
/// with empty store buffers and with the GPU having fetched what it was sent.
fn settle(gap: Duration) {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    let t = Instant::now();
    while t.elapsed() < gap {
        std::hint::spin_loop();
    }
}

/// Times `samples` calls of `call`, one at a time, each after [`settle`] when `isolate` gives a gap; `drain` runs
/// outside the timed part every [`BURST`] calls and at the end, so the GPU's pace is never what is timed.
fn time_calls<Q, E>(
    samples: usize,
    isolate: Option<Duration>,
    q: &mut Q,
    mut call: impl FnMut(&mut Q) -> Result<(), E>,
    mut drain: impl FnMut(&mut Q) -> Result<(), E>,
) -> Result<Vec<f64>, E> {
    let mut v = Vec::with_capacity(samples);
    for r in 0..samples {
        if let Some(gap) = isolate {
            settle(gap);
        }
        let t = Instant::now();
        call(q)?;
        v.push(ns(t));
        if r % BURST == BURST - 1 {
            drain(q)?;
        }
    }
    drain(q)?;
    Ok(v)
}

fn ns(t: Instant) -> f64 {
    t.elapsed().as_nanos() as f64
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let samples: usize = std::env::var("APEX_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    // APEX_GAP_NS: the time between isolated calls (default 2000 ns).
    let gap = Duration::from_nanos(
        std::env::var("APEX_GAP_NS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000),
    );
    // The CUDA driver first: it places its own address ranges before APEX reserves its own.
    let ctx = driver::Context::new(0)?;
    let gpu = GpuCore::open(0)?;
    let i = gpu.info();
    println!(
        "{} ({}), driver {}, CUDA driver API {}, {samples} samples per series",
        i.name,
        i.uuid,
        i.driver_version,
        ctx.driver_version()?
    );
    let mut rows = Vec::new();

    // The timer itself, to read the figures below against.
    let mut t0 = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        t0.push(ns(t));
    }
    rows.push(Row {
        name: "timer (Instant::now pair)".into(),
        ns: t0,
    });

    let mut configs = vec![
        ("video", LaunchMemory::Video, false, false),
        ("video+inline", LaunchMemory::Video, true, false),
        ("host", LaunchMemory::Host, false, false),
        ("host+inline", LaunchMemory::Host, true, false),
        ("video+armed", LaunchMemory::Video, false, true),
        ("host+armed", LaunchMemory::Host, true, true),
        ("host+armed+fetch", LaunchMemory::Host, false, true),
        ("video+armed+inline", LaunchMemory::Video, true, true),
        ("host+pf", LaunchMemory::Host, false, false),
        ("host+inline+pf", LaunchMemory::Host, true, false),
        ("host+armed+fetch+pf", LaunchMemory::Host, false, true),
        ("host+armed+pf", LaunchMemory::Host, true, true),
    ];
    // APEX_REVERSE=1: the configurations in the opposite order (to rule out an order effect between pairs).
    if std::env::var("APEX_REVERSE").is_ok_and(|v| v == "1") {
        configs.reverse();
    }
    for (tag, memory, inline_qmd, armed) in configs {
        // APEX_CONFIGS=host,video+inline: only those (for profiling one configuration).
        if let Ok(only) = std::env::var("APEX_CONFIGS")
            && !only.split(',').any(|c| c == tag)
        {
            continue;
        }
        // Set after `with_memory`, which picks inline QMDs for host memory.
        let mut config = ComputeQueueConfig::default().with_memory(memory);
        config.inline_qmd = inline_qmd;
        // APEX_OWN_GROUP=1: each configuration's queue in a channel group of its own instead of the shared one.
        config.queue.channel.own_group = std::env::var_os("APEX_OWN_GROUP").is_some();
        // APEX_PUSH_BYTES / APEX_SLOTS: pushbuffer size and launch slots (how much memory a launch's writes cycle
        // through, and so how warm the CPU's caches stay).
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
        };
        if let Some(b) = env("APEX_PUSH_BYTES") {
            config.queue.push_bytes = b as u64;
        }
        if let Some(n) = env("APEX_SLOTS") {
            config.slots = n;
            config.chain_part = config.chain_part.min(n);
        }
        // "+pf": the lines the next launch writes are prefetched for writing after each one (the default; the
        // other host configurations here turn it off, to measure what it does).
        config.prefetch_next = tag.ends_with("+pf");
        if armed {
            // APEX_ARMED=slots,words: the armed submission's shape.
            let mut a = Armed::default();
            if let Ok(v) = std::env::var("APEX_ARMED") {
                let f: Vec<&str> = v.split(',').collect();
                if let [slots, words] = f[..] {
                    a.slots = slots.parse()?;
                    a.slot_words = words.parse()?;
                }
            }
            config.queue.submission = Submission::Armed(a);
        }
        let mut q = ComputeQueue::new(&gpu, config)?;
        let module = Module::load(&gpu, CUBIN)?;
        let empty = module.kernel("empty")?;
        let step = module.kernel("chain_step")?;
        let value = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu())?;
        value.fill(0, 4096, 0)?;
        let pe = q.prepare_launch(&empty, &ONE)?;
        let ps = q.prepare_launch(&step, &ONE)?;
        let step_args = [Arg::Ptr(value.va()), Arg::U64(1), Arg::U64(1)];
        // Warm up every slot and both shapes.
        for _ in 0..2000 {
            // SAFETY: the empty kernel touches no memory; chain_step writes only `value`, which nothing else uses.
            unsafe {
                q.launch(&empty, &ONE, &[])?;
                q.launch_prepared(&pe, &[])?;
                q.launch_prepared(&ps, &step_args)?;
            }
        }
        q.synchronize()?;

        // One launch call at a time; drained outside the timed calls.
        // `isolated`: each call after `settle`, so the previous call's stores (and its uncached doorbell) have left
        // the CPU and the GPU has fetched them before the timed call starts, as for a caller doing other work between
        // launches. Otherwise back to back, where each call also waits behind the one before's doorbell.
        let series = |name: &str,
                      isolated: bool,
                      q: &mut ComputeQueue,
                      call: &mut dyn FnMut(&mut ComputeQueue) -> apex::launch::Result<()>|
         -> apex::launch::Result<Row> {
            let v = time_calls(samples, isolated.then_some(gap), q, call, |q| {
                q.synchronize()
            })?;
            let suffix = if isolated { ", isolated" } else { "" };
            Ok(Row {
                name: format!("{tag}: {name}{suffix}"),
                ns: v,
            })
        };
        let per_call =
            |name: &str,
             q: &mut ComputeQueue,
             call: &mut dyn FnMut(&mut ComputeQueue) -> apex::launch::Result<()>| {
                series(name, false, q, call)
            };
        let isolated =
            |name: &str,
             q: &mut ComputeQueue,
             call: &mut dyn FnMut(&mut ComputeQueue) -> apex::launch::Result<()>| {
                series(name, true, q, call)
            };
        // APEX_PROFILE_CALLS=N: only N prepared calls, one at a time as below, for a profiler.
        if let Some(n) = env("APEX_PROFILE_CALLS") {
            let t = Instant::now();
            for r in 0..n {
                // SAFETY: as in the warm-up.
                unsafe { q.launch_prepared(&pe, &[]) }?;
                if r % BURST == BURST - 1 {
                    q.synchronize()?;
                }
            }
            println!("{tag}: {n} profiled calls in {:?}", t.elapsed());
            continue;
        }
        // SAFETY (all calls below): as in the warm-up.
        rows.push(per_call("call, launch (empty)", &mut q, &mut |q| {
            unsafe { q.launch(&empty, &ONE, &[]) }.map(drop)
        })?);
        rows.push(per_call(
            "call, launch_prepared (empty)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared(&pe, &[]) }.map(drop),
        )?);
        rows.push(per_call(
            "call, launch_prepared_value (empty)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared_value(&pe, &[]) }.map(drop),
        )?);
        rows.push(isolated(
            "call, launch_prepared_value (empty)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared_value(&pe, &[]) }.map(drop),
        )?);
        rows.push(isolated(
            "call, launch_prepared (empty)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared(&pe, &[]) }.map(drop),
        )?);
        rows.push(isolated(
            "call, launch_prepared_value (3 parameters)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared_value(&ps, &step_args) }.map(drop),
        )?);
        rows.push(per_call(
            "call, launch_prepared (3 parameters)",
            &mut q,
            &mut |q| unsafe { q.launch_prepared(&ps, &step_args) }.map(drop),
        )?);

        // The prepared call split in two.
        let (mut rec, mut bell) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
        for r in 0..samples {
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { q.record_prepared(&pe, &[]) }?;
            rec.push(ns(t));
            let t = Instant::now();
            q.flush();
            bell.push(ns(t));
            if r % BURST == BURST - 1 {
                q.synchronize()?;
            }
        }
        q.synchronize()?;
        rows.push(Row {
            name: format!("{tag}: record (prepared, empty)"),
            ns: rec,
        });
        rows.push(Row {
            name: format!("{tag}: doorbell (store fence if needed + doorbell)"),
            ns: bell,
        });

        // Back to back, per launch: what the CPU sustains once store buffers and write-combining fill
        // (64 per sample, drained outside the timed part).
        let mut burst_unfenced = Vec::with_capacity(samples / 64);
        let (mut burst, mut bells, mut records) = (
            Vec::with_capacity(samples / 64),
            Vec::with_capacity(samples / 64),
            Vec::with_capacity(samples / 64),
        );
        for _ in 0..samples / 64 {
            let t = Instant::now();
            for _ in 0..64 {
                // SAFETY: as above.
                unsafe { q.record_prepared(&pe, &[]) }?;
            }
            records.push(ns(t) / 64.0);
            q.synchronize()?;
            let t = Instant::now();
            for _ in 0..64 {
                // SAFETY: as above.
                unsafe { q.launch_prepared(&pe, &[]) }?;
            }
            burst.push(ns(t) / 64.0);
            q.synchronize()?;
            let t = Instant::now();
            for _ in 0..64 {
                // SAFETY: as above.
                unsafe { q.launch_prepared_value(&pe, &[]) }?;
            }
            burst_unfenced.push(ns(t) / 64.0);
            q.synchronize()?;
            let t = Instant::now();
            for _ in 0..64 {
                q.flush();
            }
            bells.push(ns(t) / 64.0);
        }
        rows.push(Row {
            name: format!("{tag}: record_prepared x64 back to back (one doorbell after), per call"),
            ns: records,
        });
        rows.push(Row {
            name: format!("{tag}: call, launch_prepared x64 back to back, per call"),
            ns: burst,
        });
        rows.push(Row {
            name: format!("{tag}: call, launch_prepared_value x64 back to back, per call"),
            ns: burst_unfenced,
        });
        rows.push(Row {
            name: format!("{tag}: doorbell x64 back to back (nothing new), per doorbell"),
            ns: bells,
        });

        // Launch -> completion, and the bare round trip, interleaved so both see the same conditions.
        let (mut comp, mut fe, mut rt) = (
            Vec::with_capacity(samples),
            Vec::with_capacity(samples),
            Vec::with_capacity(samples),
        );
        for _ in 0..samples {
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { q.launch_prepared(&pe, &[]) }?.wait(WAIT)?;
            comp.push(ns(t));
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { q.record_launch_unordered(&empty, &ONE, &[]) }?;
            q.join()?.wait(WAIT)?;
            fe.push(ns(t));
            let t = Instant::now();
            q.join()?.wait(WAIT)?;
            rt.push(ns(t));
        }
        rows.push(Row {
            name: format!("{tag}: completion (prepared launch + wait)"),
            ns: comp,
        });
        rows.push(Row {
            name: format!("{tag}: completion_fe (launch, front-end release after idle)"),
            ns: fe,
        });
        rows.push(Row {
            name: format!("{tag}: round_trip (semaphore release after idle, no kernel)"),
            ns: rt,
        });
        // Every chain_step launch added one, in order.
        let got = value.read_u64_volatile(0)?;
        let want = 2000 + 2 * samples as u64;
        if got != want {
            return Err(format!(
                "chain_step left {got}, expected {want}: a launch was lost or repeated"
            )
            .into());
        }
    }

    // Dependent launches in stream order: the front end's acquire (libcuda's way) against a wait for idle.
    if std::env::var("APEX_CONFIGS").is_err() {
        let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
        let empty = Module::load(&gpu, CUBIN)?.kernel("empty")?;
        let pe = q.prepare_launch(&empty, &ONE)?;
        let rounds = (samples / 200).max(10);
        for (name, order) in [
            (
                "acquire",
                StreamOrder::Acquire {
                    cmp: Acquire::CircularGeq,
                    switch_tsg: false,
                },
            ),
            ("wait-for-idle", StreamOrder::WaitForIdle),
        ] {
            q.set_stream_order(order);
            let (mut each, mut one) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
            for _ in 0..rounds {
                let t = Instant::now();
                for _ in 0..1000 {
                    // SAFETY: the empty kernel touches no memory.
                    unsafe { q.launch_prepared(&pe, &[]) }?;
                }
                q.synchronize()?;
                each.push(ns(t) / 1000.0);
                let t = Instant::now();
                for _ in 0..1000 {
                    // SAFETY: as above.
                    unsafe { q.record_prepared(&pe, &[]) }?;
                }
                q.synchronize()?;
                one.push(ns(t) / 1000.0);
            }
            rows.push(Row {
                name: format!("video: dependent x1000 ({name}), doorbell each, per launch"),
                ns: each,
            });
            rows.push(Row {
                name: format!("video: dependent x1000 ({name}), one doorbell, per launch"),
                ns: one,
            });
        }
    }

    // The write prefetch A/B, interleaved: two queues alike but for `prefetch_next`, taking turns every 64 calls in
    // one process, so that neither warm-up nor drift favours one (the per-configuration series above run one after
    // the other).
    if std::env::var("APEX_CONFIGS").is_err() || std::env::var("APEX_AB").is_ok() {
        for (tag, inline_qmd) in [("host", false), ("host+inline", true)] {
            let mut pair = Vec::new();
            for prefetch in [false, true] {
                let mut config = ComputeQueueConfig::default().with_memory(LaunchMemory::Host);
                config.inline_qmd = inline_qmd;
                config.prefetch_next = prefetch;
                let mut q = ComputeQueue::new(&gpu, config)?;
                let k = Module::load(&gpu, CUBIN)?.kernel("empty")?;
                let p = q.prepare_launch(&k, &ONE)?;
                for _ in 0..2000 {
                    // SAFETY: the empty kernel touches no memory.
                    unsafe { q.launch_prepared_value(&p, &[]) }?;
                }
                q.synchronize()?;
                pair.push((q, p, Vec::with_capacity(samples)));
            }
            for r in 0..samples / BURST {
                // Which goes first alternates too.
                let first = r % 2;
                for i in [first, 1 - first] {
                    let (q, p, v) = &mut pair[i];
                    for _ in 0..BURST {
                        let t = Instant::now();
                        // SAFETY: as above.
                        unsafe { q.launch_prepared_value(p, &[]) }?;
                        v.push(ns(t));
                    }
                    q.synchronize()?;
                }
            }
            for ((_, _, v), name) in pair.into_iter().zip(["without", "with"]) {
                rows.push(Row {
                    name: format!(
                        "{tag}: call, launch_prepared_value, interleaved, {name} the write prefetch"
                    ),
                    ns: v,
                });
            }
        }
    }

    // The QMD read-ahead A/B (`ComputeQueueConfig::prefetch_qmds`), interleaved as above: video launch memory, two
    // queues alike but for it. What the five more pushbuffer words cost an isolated call, and what reading the QMD
    // ahead of the wait saves a dependent launch.
    if std::env::var("APEX_CONFIGS").is_err() || std::env::var("APEX_QMD_AB").is_ok() {
        let mut pair = Vec::new();
        for read_ahead in [false, true] {
            let config = ComputeQueueConfig::default().with_prefetch_qmds(read_ahead);
            let mut q = ComputeQueue::new(&gpu, config)?;
            let k = Module::load(&gpu, CUBIN)?.kernel("empty")?;
            let p = q.prepare_launch(&k, &ONE)?;
            for _ in 0..2000 {
                // SAFETY: the empty kernel touches no memory.
                unsafe { q.launch_prepared_value(&p, &[]) }?;
            }
            q.synchronize()?;
            pair.push((q, p, Vec::with_capacity(samples), Vec::new()));
        }
        for r in 0..samples / BURST {
            let first = r % 2;
            for i in [first, 1 - first] {
                let (q, p, v, _) = &mut pair[i];
                for _ in 0..BURST {
                    settle(gap);
                    let t = Instant::now();
                    // SAFETY: as above.
                    unsafe { q.launch_prepared_value(p, &[]) }?;
                    v.push(ns(t));
                }
                q.synchronize()?;
            }
        }
        for r in 0..(samples / 200).max(10) {
            let first = r % 2;
            for i in [first, 1 - first] {
                let (q, p, _, dep) = &mut pair[i];
                let t = Instant::now();
                for _ in 0..1000 {
                    // SAFETY: as above.
                    unsafe { q.launch_prepared_value(p, &[]) }?;
                }
                q.synchronize()?;
                dep.push(ns(t) / 1000.0);
            }
        }
        for ((_, _, v, dep), name) in pair.into_iter().zip(["without", "with"]) {
            rows.push(Row {
                name: format!(
                    "video: call, launch_prepared_value, interleaved, {name} the QMD read-ahead, isolated"
                ),
                ns: v,
            });
            rows.push(Row {
                name: format!(
                    "video: dependent x1000, interleaved, {name} the QMD read-ahead, per launch"
                ),
                ns: dep,
            });
        }
    }

    // The public API (`apex::Queue`), as a user calls it: a prepared launch returning a fence, and returning a
    // ticket, per queue option.
    if std::env::var("APEX_CONFIGS").is_err() || std::env::var("APEX_PUBLIC").is_ok() {
        let direct = apex::Gpu::open_with(0, apex::BackendRequest::Direct)?;
        let driver_gpu = apex::Gpu::open_with(0, apex::BackendRequest::Driver)?;
        for (tag, gpu, options) in [
            ("api video", &direct, apex::QueueOptions::default()),
            (
                "api host",
                &direct,
                apex::QueueOptions::default().launch_memory(LaunchMemory::Host),
            ),
            (
                "api video polled",
                &direct,
                apex::QueueOptions::default().polled(true),
            ),
            (
                "api host polled",
                &direct,
                apex::QueueOptions::default()
                    .launch_memory(LaunchMemory::Host)
                    .polled(true),
            ),
            (
                "api driver backend",
                &driver_gpu,
                apex::QueueOptions::default(),
            ),
        ] {
            let mut q = gpu.queue_with(options)?;
            let k = gpu.load_module(CUBIN)?.kernel("empty")?;
            let p = q.prepare(&k, &ONE)?;
            for _ in 0..2000 {
                // SAFETY: the empty kernel touches no memory.
                unsafe { q.submit(&apex::Launch::prepared(&p, &[])) }?;
            }
            q.synchronize()?;
            let sync = |q: &mut apex::Queue| q.synchronize();
            // SAFETY (the three series): as above.
            let fenced = time_calls(
                samples,
                None,
                &mut q,
                |q| unsafe { q.submit_fenced(&apex::Launch::prepared(&p, &[])) }.map(drop),
                sync,
            )?;
            let ticket = time_calls(
                samples,
                None,
                &mut q,
                |q| unsafe { q.submit(&apex::Launch::prepared(&p, &[])) }.map(drop),
                sync,
            )?;
            let ticket_isolated = time_calls(
                samples,
                Some(gap),
                &mut q,
                |q| unsafe { q.submit(&apex::Launch::prepared(&p, &[])) }.map(drop),
                sync,
            )?;
            rows.push(Row {
                name: format!("{tag}: call, Queue::submit prepared (empty), isolated"),
                ns: ticket_isolated,
            });
            rows.push(Row {
                name: format!("{tag}: call, Queue::submit_fenced prepared (empty)"),
                ns: fenced,
            });
            rows.push(Row {
                name: format!("{tag}: call, Queue::submit prepared (empty)"),
                ns: ticket,
            });
        }
    }

    // CUDA in the same process.
    let mut stream = driver::Stream::new(&ctx)?;
    let f = driver::Module::load(&ctx, CUBIN)?.function("empty")?;
    // SAFETY: the empty kernel takes no parameters and touches no memory.
    let cuda = |s: &mut driver::Stream| unsafe { s.launch(&f, [1, 1, 1], [1, 1, 1], 0, &mut []) };
    for _ in 0..2000 {
        cuda(&mut stream)?;
    }
    stream.synchronize()?;
    let sync = |s: &mut driver::Stream| s.synchronize();
    let call = time_calls(samples, None, &mut stream, cuda, sync)?;
    let call_isolated = time_calls(samples, Some(gap), &mut stream, cuda, sync)?;
    let mut comp = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        cuda(&mut stream)?;
        stream.synchronize()?;
        comp.push(ns(t));
    }
    rows.push(Row {
        name: "cuda: call, cuLaunchKernel (empty)".into(),
        ns: call,
    });
    rows.push(Row {
        name: "cuda: call, cuLaunchKernel (empty), isolated".into(),
        ns: call_isolated,
    });
    rows.push(Row {
        name: "cuda: completion (cuLaunchKernel + cuStreamSynchronize)".into(),
        ns: comp,
    });
    if std::env::var("APEX_CONFIGS").is_err() {
        let graph = driver::Graph::capture(&mut stream, |s| {
            for _ in 0..1000 {
                cuda(s)?;
            }
            Ok(())
        })?;
        let (mut each, mut g) = (Vec::new(), Vec::new());
        for _ in 0..(samples / 200).max(10) {
            let t = Instant::now();
            for _ in 0..1000 {
                cuda(&mut stream)?;
            }
            stream.synchronize()?;
            each.push(ns(t) / 1000.0);
            let t = Instant::now();
            graph.launch(&mut stream)?;
            stream.synchronize()?;
            g.push(ns(t) / 1000.0);
        }
        rows.push(Row {
            name: "cuda: dependent x1000, cuLaunchKernel, per launch".into(),
            ns: each,
        });
        rows.push(Row {
            name: "cuda: dependent x1000, cuGraphLaunch, per launch".into(),
            ns: g,
        });
    }

    let cuda_call = rows
        .iter()
        .find(|r| r.name == "cuda: call, cuLaunchKernel (empty)")
        .map_or(f64::NAN, |r| stats(&r.ns).1);
    let cuda_isolated = rows
        .iter()
        .find(|r| r.name == "cuda: call, cuLaunchKernel (empty), isolated")
        .map_or(f64::NAN, |r| stats(&r.ns).1);
    println!(
        "{:<72} {:>9} {:>9} {:>9} {:>9}",
        "series", "min ns", "median", "p99", "cuLK/x"
    );
    for r in &rows {
        let (min, med, p99) = stats(&r.ns);
        // Isolated calls against cuLaunchKernel isolated the same way.
        let ratio = if r.name.contains("call") && r.name.ends_with(", isolated") {
            format!("{:.2}", cuda_isolated / med)
        } else if r.name.contains("call") {
            format!("{:.2}", cuda_call / med)
        } else {
            String::new()
        };
        println!(
            "{:<72} {:>9.0} {:>9.0} {:>9.0} {:>9}",
            r.name, min, med, p99, ratio
        );
    }
    Ok(())
}
