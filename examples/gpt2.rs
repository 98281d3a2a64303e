//! A launch-bound workload (issue 11): GPT-2-small decoding one token at a time (batch 1, fp32, 136 launches per
//! token, KV cache of up to 1024 positions) on random weights, timed per token on every way APEX and CUDA can
//! run it, in one process:
//!
//! - APEX eager: the direct path, one doorbell per launch;
//! - APEX eager, programmatic: the same with every launch a programmatic dependent launch of the one before
//!   (`Launch::programmatic`; the kernels wait for their producer themselves);
//! - APEX chained: the direct path, the step's launches as one GPU-scheduled chain;
//! - APEX chained, programmatic: the same with every link after the first a programmatic dependent of the one
//!   before (`Launch::chained().programmatic()`);
//! - APEX graph: the step recorded once as an `apex::Graph`, one replay (one doorbell) per token;
//! - APEX graph, programmatic: the same with every launch after the first a programmatic dependent launch (the
//!   kernels wait for their producer themselves);
//! - CUDA eager: APEX's driver backend, `cuLaunchKernel` per launch;
//! - CUDA eager, programmatic: `cuLaunchKernelEx` with programmatic stream serialization per launch;
//! - CUDA graph: the same step captured once into a CUDA graph, one `cuGraphLaunch` per token;
//! - CUDA graph, programmatic: the step as a CUDA graph with programmatic edges (APEX's driver backend builds it
//!   node by node from the same description).
//!
//! Every variant first decodes from position 0 and its logits are compared with the eager direct path's
//! (which `tests/gpu_gpt2.rs` checks against the CPU). `APEX_STEPS` tokens are timed in each window.
//!
//! `cargo run --release --example gpt2 [dir]` also writes `gpt2.svg` into `dir` (default: the current directory),
//! a bar chart of the table.

#[path = "support/gpt2.rs"]
mod gpt2;
mod support;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use apex::driver;
use apex::{Arg, BackendRequest, Gpu, LaunchMemory, Queue, QueueOptions};
use gpt2::{GPT2_SMALL, GpuModel, Kernels, StepLaunch, max_rel_diff};

/// First positions of the timed windows: short, middling and nearly full KV cache.
const WINDOWS: [usize; 3] = [0, 480, 960];

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn steps() -> usize {
    std::env::var("APEX_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
        .clamp(1, 64)
}

/// Per-token time of `steps` tokens from `start`, best of three.
fn time_window(
    gpu: &Gpu,
    q: &mut Queue,
    m: &GpuModel,
    start: usize,
    steps: usize,
    step: impl FnMut(&mut Queue) -> apex::Result<()>,
) -> apex::Result<Duration> {
    time_window_as(gpu, q, m, (start, steps), false, step)
}

/// As [`time_window`]; with `wait_each`, the CPU waits for every token before it sends the next, as a decoder that
/// samples each token on the CPU must.
fn time_window_as(
    gpu: &Gpu,
    q: &mut Queue,
    m: &GpuModel,
    (start, steps): (usize, usize),
    wait_each: bool,
    mut step: impl FnMut(&mut Queue) -> apex::Result<()>,
) -> apex::Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        m.set_position(gpu, q, start)?;
        q.synchronize()?;
        let t = Instant::now();
        for _ in 0..steps {
            step(q)?;
            if wait_each {
                q.synchronize()?;
            }
        }
        q.synchronize()?;
        best = best.min(t.elapsed() / steps as u32);
    }
    Ok(best)
}

/// As [`time_window_as`] for the step captured as a CUDA graph, which runs on a stream of its own: `q` (the model's
/// queue, synchronized before the stream starts) only sets the position.
fn time_captured(
    gpu: &Gpu,
    q: &mut Queue,
    m: &GpuModel,
    (graph, stream): (&driver::Graph, &mut driver::Stream),
    (start, steps): (usize, usize),
    wait_each: bool,
) -> Result<Duration, Box<dyn std::error::Error>> {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        m.set_position(gpu, q, start)?;
        q.synchronize()?;
        let t = Instant::now();
        for _ in 0..steps {
            graph.launch(stream)?;
            if wait_each {
                stream.synchronize()?;
            }
        }
        stream.synchronize()?;
        best = best.min(t.elapsed() / steps as u32);
    }
    Ok(best)
}

/// Argument storage and pointer arrays for `cuLaunchKernel`, one per launch of the step.
struct DriverArgs {
    _values: Vec<Vec<u64>>,
    ptrs: Vec<Vec<*mut c_void>>,
}

fn driver_args(m: &GpuModel) -> DriverArgs {
    let mut values: Vec<Vec<u64>> = m
        .step
        .iter()
        .map(|l| {
            l.args
                .iter()
                .map(|a| match *a {
                    Arg::Ptr(v) | Arg::U64(v) => v,
                    Arg::I32(v) => v as u32 as u64,
                    other => unreachable!("the decoder passes pointers and ints, not {other:?}"),
                })
                .collect()
        })
        .collect();
    let ptrs = values
        .iter_mut()
        .map(|v| {
            v.iter_mut()
                .map(|x| (x as *mut u64).cast::<c_void>())
                .collect()
        })
        .collect();
    DriverArgs {
        _values: values,
        ptrs,
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let s = GPT2_SMALL;
    let steps = steps();
    eprintln!(
        "random weights for GPT-2 small ({} parameters)...",
        s.floats()
    );
    let w = gpt2::random_weights(&s, 7);
    let toks = gpt2::tokens(&s, 11);

    let direct = Gpu::open_with(0, BackendRequest::Direct)?;
    let cuda = Gpu::open_with(0, BackendRequest::Driver)?;
    let mut qd = direct.queue()?;
    // Programmatic launches on a queue of their own; plain launches on it are timed too, to show they carry no gates.
    let mut qdp = direct.queue()?;
    // APEX_POLLED=1: eager steps also on polled queues (the front end polls instead of a doorbell), in video and
    // host launch memory.
    let polled = std::env::var("APEX_POLLED").is_ok_and(|v| v == "1");
    let mut qpv = direct.queue_with(QueueOptions::default().polled(true))?;
    let mut qph = direct.queue_with(
        QueueOptions::default()
            .launch_memory(LaunchMemory::Host)
            .polled(true),
    )?;
    // Plain (and programmatic) launch calls on a chained queue: launches made while it is busy become links the GPU
    // schedules itself.
    let mut qdc = direct.queue_with(QueueOptions::default().chained(true))?;
    let kd = Kernels::load(&direct)?;
    let md = GpuModel::new(&direct, &mut qd, s, &w, &toks)?;
    let mut qc = cuda.queue()?;
    let kc = Kernels::load(&cuda)?;
    let mc = GpuModel::new(&cuda, &mut qc, s, &w, &toks)?;
    println!(
        "GPT-2 small, batch 1, fp32, {} launches per token, on {} ({} SMs); per-token time, best of 3 runs of \
         {steps} tokens from each start",
        md.step.len(),
        direct.info().name,
        direct.info().sm_count
    );

    // The same logits everywhere (eager direct is the reference; the test checks it against the CPU).
    let first = |gpu: &Gpu,
                 q: &mut Queue,
                 m: &GpuModel,
                 f: &mut dyn FnMut(&mut Queue) -> apex::Result<()>| {
        m.set_position(gpu, q, 0)?;
        f(q)?;
        m.logits(gpu, q)
    };
    // SAFETY (every launch_step below): the model's own kernels and buffers, used by its queue alone.
    let reference = first(&direct, &mut qd, &md, &mut |q| unsafe {
        md.launch_step(q, &kd, StepLaunch::Eager)
    })?;
    let check = |name: &str, got: Vec<f32>| -> Result<(), Box<dyn std::error::Error>> {
        let d = max_rel_diff(&got, &reference);
        if d > 1e-4 {
            return Err(format!(
                "{name}: logits differ from the eager direct path by {d} (relative)"
            )
            .into());
        }
        Ok(())
    };
    check(
        "APEX chained",
        first(&direct, &mut qd, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Chained)
        })?,
    )?;
    check(
        "APEX chained, programmatic",
        first(&direct, &mut qd, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::ChainedProgrammatic)
        })?,
    )?;
    let mut exec = qd.instantiate(&md.graph(&kd, false)?)?;
    let mut exec_p = qd.instantiate(&md.graph(&kd, true)?)?;
    let mut cuda_p = qc.instantiate(&mc.graph(&kc, true)?)?;
    // SAFETY (every replay below): the graph's nodes declare the model's buffers, used by this queue alone.
    check(
        "APEX graph",
        first(&direct, &mut qd, &md, &mut |q| unsafe {
            q.replay(&mut exec).map(drop)
        })?,
    )?;
    check(
        "APEX graph, programmatic",
        first(&direct, &mut qd, &md, &mut |q| unsafe {
            q.replay(&mut exec_p).map(drop)
        })?,
    )?;
    check(
        "CUDA graph, programmatic",
        first(&cuda, &mut qc, &mc, &mut |q| unsafe {
            q.replay(&mut cuda_p).map(drop)
        })?,
    )?;
    check(
        "APEX eager, programmatic",
        first(&direct, &mut qdp, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Programmatic)
        })?,
    )?;
    check(
        "CUDA eager, programmatic",
        first(&cuda, &mut qc, &mc, &mut |q| unsafe {
            mc.launch_step(q, &kc, StepLaunch::Programmatic)
        })?,
    )?;
    check(
        "APEX eager, polled",
        first(&direct, &mut qpv, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?,
    )?;
    check(
        "APEX eager, polled, host launch memory",
        first(&direct, &mut qph, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?,
    )?;
    check(
        "APEX eager, chained queue",
        first(&direct, &mut qdc, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?,
    )?;
    check(
        "APEX eager programmatic, chained queue",
        first(&direct, &mut qdc, &md, &mut |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Programmatic)
        })?,
    )?;
    check(
        "CUDA eager",
        first(&cuda, &mut qc, &mc, &mut |q| unsafe {
            mc.launch_step(q, &kc, StepLaunch::Eager)
        })?,
    )?;

    // The CUDA graph: one step captured on a stream of the driver backend's context.
    let ctx = cuda
        .driver()
        .ok_or("the driver backend has no CUDA context")?
        .clone();
    let mut stream = driver::Stream::new(&ctx)?;
    let mut args = driver_args(&mc);
    let graph = driver::Graph::capture(&mut stream, |st| {
        for (l, p) in mc.step.iter().zip(args.ptrs.iter_mut()) {
            let f = kc.get(l.kernel).driver().ok_or_else(|| {
                driver::Error::InvalidArgument("a kernel without a CUDA function".into())
            })?;
            // SAFETY: the argument values outlive the capture and match the kernel's parameters.
            unsafe { st.launch(f, l.cfg.grid, l.cfg.block, l.cfg.shared_bytes, p)? };
        }
        Ok(())
    })?;
    // The graph runs on its own stream: the queue that sets the position is synchronized before it starts.
    mc.set_position(&cuda, &mut qc, 0)?;
    qc.synchronize()?;
    graph.launch(&mut stream)?;
    stream.synchronize()?;
    check("CUDA graph", mc.logits(&cuda, &mut qc)?)?;

    println!(
        "| KV positions | APEX eager | APEX eager, programmatic | APEX chained | APEX chained, programmatic | APEX graph | APEX graph, programmatic | CUDA eager | CUDA eager, programmatic | CUDA graph | CUDA graph, programmatic | APEX graph ÷ CUDA graph | programmatic graphs: APEX ÷ CUDA | APEX eager programmatic ÷ CUDA graph | APEX chained programmatic ÷ CUDA graph |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut rows: Vec<(String, [f64; 10])> = Vec::new();
    let mut notes = Vec::new();
    for start in WINDOWS {
        let n = steps.min(s.ctx - start);
        // SAFETY: as above.
        let ae = time_window(&direct, &mut qd, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?;
        let aep = time_window(&direct, &mut qdp, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Programmatic)
        })?;
        // Plain launches on the queue that launched programmatically (they carry no gates: same time as `ae`).
        let aeg = time_window(&direct, &mut qdp, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?;
        let cep = time_window(&cuda, &mut qc, &mc, start, n, |q| unsafe {
            mc.launch_step(q, &kc, StepLaunch::Programmatic)
        })?;
        let ac = time_window(&direct, &mut qd, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Chained)
        })?;
        let acp = time_window(&direct, &mut qd, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::ChainedProgrammatic)
        })?;
        let ag = time_window(&direct, &mut qd, &md, start, n, |q| unsafe {
            q.replay(&mut exec).map(drop)
        })?;
        let agp = time_window(&direct, &mut qd, &md, start, n, |q| unsafe {
            q.replay(&mut exec_p).map(drop)
        })?;
        let cgp = time_window(&cuda, &mut qc, &mc, start, n, |q| unsafe {
            q.replay(&mut cuda_p).map(drop)
        })?;
        let ce = time_window(&cuda, &mut qc, &mc, start, n, |q| unsafe {
            mc.launch_step(q, &kc, StepLaunch::Eager)
        })?;
        let cg = time_captured(
            &cuda,
            &mut qc,
            &mc,
            (&graph, &mut stream),
            (start, n),
            false,
        )?;
        println!(
            "| {}–{} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.2} | {:.2} | {:.2} | {:.3} |",
            start + 1,
            start + n,
            us(ae),
            us(aep),
            us(ac),
            us(acp),
            us(ag),
            us(agp),
            us(ce),
            us(cep),
            us(cg),
            us(cgp),
            us(ag) / us(cg),
            us(agp) / us(cgp),
            us(aep) / us(cg),
            us(acp) / us(cg)
        );
        if polled {
            let pv = time_window(&direct, &mut qpv, &md, start, n, |q| unsafe {
                md.launch_step(q, &kd, StepLaunch::Eager)
            })?;
            let pvp = time_window(&direct, &mut qpv, &md, start, n, |q| unsafe {
                md.launch_step(q, &kd, StepLaunch::Programmatic)
            })?;
            let ph = time_window(&direct, &mut qph, &md, start, n, |q| unsafe {
                md.launch_step(q, &kd, StepLaunch::Eager)
            })?;
            notes.push(format!(
                "positions {}–{}: polled APEX eager {:.1} µs ({:.3}× the CUDA graph, {:.3}× eager by doorbell), \
                 polled eager programmatic {:.1} µs ({:.3}× the CUDA graph), polled eager in host launch memory \
                 {:.1} µs ({:.3}× the CUDA graph)",
                start + 1,
                start + n,
                us(pv),
                us(pv) / us(cg),
                us(pv) / us(ae),
                us(pvp),
                us(pvp) / us(cg),
                us(ph),
                us(ph) / us(cg)
            ));
        }
        let aec = time_window(&direct, &mut qdc, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Eager)
        })?;
        let aecp = time_window(&direct, &mut qdc, &md, start, n, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Programmatic)
        })?;
        notes.push(format!(
            "positions {}–{}: APEX eager on a chained queue (plain launch calls) {:.1} µs, {:.3}× the CUDA graph, \
             {:.3}× eager on a plain queue; eager programmatic on a chained queue {:.1} µs, {:.3}× the CUDA graph",
            start + 1,
            start + n,
            us(aec),
            us(aec) / us(cg),
            us(aec) / us(ae),
            us(aecp),
            us(aecp) / us(cg)
        ));
        notes.push(format!(
            "positions {}–{}: APEX eager on the queue that launched programmatically {:.1} µs, {:.3}× the other queue's",
            start + 1,
            start + n,
            us(aeg),
            us(aeg) / us(ae)
        ));
        rows.push((
            format!("{}–{}", start + 1, start + n),
            [ae, aep, ac, acp, ag, agp, ce, cep, cg, cgp].map(us),
        ));
    }
    for n in notes {
        println!("{n}");
    }

    // Decoding that waits for each token before sending the next (the CPU samples it): the launch → completion
    // latency of every step adds to its time.
    println!();
    println!("waiting for every token before the next (as a decoder that samples on the CPU):");
    println!(
        "| KV positions | APEX graph | CUDA graph | CUDA ÷ APEX | APEX graph, programmatic | CUDA graph, programmatic | CUDA ÷ APEX | APEX eager, programmatic | CUDA eager, programmatic | APEX chained, programmatic |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for start in WINDOWS {
        let n = steps.min(s.ctx - start);
        // SAFETY: as above.
        let ag = time_window_as(&direct, &mut qd, &md, (start, n), true, |q| unsafe {
            q.replay(&mut exec).map(drop)
        })?;
        let agp = time_window_as(&direct, &mut qd, &md, (start, n), true, |q| unsafe {
            q.replay(&mut exec_p).map(drop)
        })?;
        let cgp = time_window_as(&cuda, &mut qc, &mc, (start, n), true, |q| unsafe {
            q.replay(&mut cuda_p).map(drop)
        })?;
        let aep = time_window_as(&direct, &mut qdp, &md, (start, n), true, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::Programmatic)
        })?;
        let acp = time_window_as(&direct, &mut qd, &md, (start, n), true, |q| unsafe {
            md.launch_step(q, &kd, StepLaunch::ChainedProgrammatic)
        })?;
        let cep = time_window_as(&cuda, &mut qc, &mc, (start, n), true, |q| unsafe {
            mc.launch_step(q, &kc, StepLaunch::Programmatic)
        })?;
        let cg = time_captured(&cuda, &mut qc, &mc, (&graph, &mut stream), (start, n), true)?;
        println!(
            "| {}–{} | {:.1} µs | {:.1} µs | {:.3} | {:.1} µs | {:.1} µs | {:.3} | {:.1} µs | {:.1} µs | {:.1} µs |",
            start + 1,
            start + n,
            us(ag),
            us(cg),
            us(cg) / us(ag),
            us(agp),
            us(cgp),
            us(cgp) / us(agp),
            us(aep),
            us(cep),
            us(acp)
        );
    }
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    let svg = dir.join("gpt2.svg");
    plot(&svg, &direct.info().name, steps, &rows)?;
    println!("wrote {}", svg.display());
    Ok(())
}

/// The per-token times of `rows` (one group of bars per KV window, in the table's column order) as an SVG bar chart.
fn plot(
    path: &std::path::Path,
    gpu: &str,
    steps: usize,
    rows: &[(String, [f64; 10])],
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    const NAMES: [&str; 10] = [
        "APEX eager",
        "APEX eager, programmatic",
        "APEX chained",
        "APEX chained, programmatic",
        "APEX graph",
        "APEX graph, programmatic",
        "CUDA eager",
        "CUDA eager, programmatic",
        "CUDA graph",
        "CUDA graph, programmatic",
    ];
    // APEX in warm colours, CUDA in cool ones.
    let colors = [
        RGBColor(214, 39, 40),
        RGBColor(255, 127, 14),
        RGBColor(188, 189, 34),
        RGBColor(219, 219, 141),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(31, 119, 180),
        RGBColor(23, 190, 207),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
    ];
    let top = rows.iter().flat_map(|r| r.1).fold(0.0, f64::max).max(1.0) * 1.6; // room above the bars for the legend
    let root = SVGBackend::new(path, (1100, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("GPT-2 small, batch 1, one token per step: µs per token on {gpu} (best of 3 runs of {steps} tokens)"),
            ("sans-serif", 17),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..rows.len() as f64, 0f64..top)?;
    let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 && i < labels.len() {
                format!("KV positions {}", labels[i])
            } else {
                String::new()
            }
        })
        .y_desc("µs per token")
        .draw()?;
    let width = 0.9 / NAMES.len() as f64;
    for (k, (name, color)) in NAMES.iter().zip(colors).enumerate() {
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let x0 = i as f64 + 0.05 + k as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, r.1[k])], color.filled())
            }))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
