//! Launch latency, APEX's direct path beside cuLaunchKernel and CUDA graphs, measured in one process:
//! a plain table (min, median, p99, ratio to cuLaunchKernel), a CSV of every sample and an SVG plot of the
//! distributions, written to the directory given as the first argument (default: the current directory).

mod support;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig, Module};
use apex::rm::GpuCore;
use plotters::prelude::*;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(10);
const ONE: LaunchConfig = LaunchConfig {
    grid: [1, 1, 1],
    block: [1, 1, 1],
    shared_bytes: 0,
    cluster: None,
};

struct Series {
    measure: &'static str,
    path: &'static str,
    ns: Vec<f64>,
}

fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[0], s[s.len() / 2], s[s.len() * 99 / 100])
}

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&out)?;
    // Which path opens first (the other one then finds the address space as the first left it).
    let direct_first = std::env::var("APEX_DIRECT_FIRST").is_ok_and(|v| v == "1");
    let (ctx, gpu) = if direct_first {
        let gpu = GpuCore::open(0)?;
        (driver::Context::new(0)?, gpu)
    } else {
        let ctx = driver::Context::new(0)?;
        (ctx, GpuCore::open(0)?)
    };
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
    let k = Module::load(&gpu, CUBIN)?.kernel("empty")?;
    let mut stream = driver::Stream::new(&ctx)?;
    let f = driver::Module::load(&ctx, CUBIN)?.function("empty")?;
    let i = gpu.info();
    println!(
        "{} ({}), driver {}, CUDA driver API {}",
        i.name,
        i.uuid,
        i.driver_version,
        ctx.driver_version()?
    );

    let n = 20_000;
    let mut series = Vec::new();
    let direct = |q: &mut ComputeQueue| -> Result<apex::pushbuf::Fence, apex::launch::Error> {
        // SAFETY: the empty kernel touches no memory.
        unsafe { q.launch(&k, &ONE, &[]) }
    };
    let cuda = |s: &mut driver::Stream| -> driver::Result<()> {
        // SAFETY: the empty kernel takes no parameters and touches no memory.
        unsafe { s.launch(&f, [1, 1, 1], [1, 1, 1], 0, &mut []) }
    };
    for i in 0..2000 {
        let fence = direct(&mut q)?;
        if let Err(e) = fence.wait(Duration::from_secs(2)) {
            let ch = q.queue().channel();
            eprintln!(
                "warm-up launch {i} did not complete: {e}; GP_GET {} GP_PUT {}, timeline {} of {}, fault {:?}",
                ch.read_gp_get(),
                ch.ring_state().put(),
                q.queue().timeline().completed(),
                fence.value(),
                ch.fault()
            );
            return Err(e.into());
        }
    }
    for _ in 0..2000 {
        cuda(&mut stream)?;
        stream.synchronize()?;
    }

    // Each path runs its samples as one phase: switching the GPU between APEX's channel group and CUDA's
    // costs a context switch (~150 µs on the H200), which per-sample interleaving would measure instead.
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for r in 0..n {
        let t = Instant::now();
        let fence = direct(&mut q)?;
        a.push(t.elapsed().as_nanos() as f64);
        if r % 256 == 255 {
            fence.wait(T)?;
        }
    }
    q.synchronize()?;
    for r in 0..n {
        let t = Instant::now();
        cuda(&mut stream)?;
        b.push(t.elapsed().as_nanos() as f64);
        if r % 256 == 255 {
            stream.synchronize()?;
        }
    }
    stream.synchronize()?;
    series.push(Series {
        measure: "submit",
        path: "apex_direct",
        ns: a,
    });
    series.push(Series {
        measure: "submit",
        path: "cuLaunchKernel",
        ns: b,
    });

    // Launch to completion.
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        direct(&mut q)?.wait(T)?;
        a.push(t.elapsed().as_nanos() as f64);
    }
    for _ in 0..n {
        let t = Instant::now();
        cuda(&mut stream)?;
        stream.synchronize()?;
        b.push(t.elapsed().as_nanos() as f64);
    }
    series.push(Series {
        measure: "launch_to_completion",
        path: "apex_direct",
        ns: a,
    });
    series.push(Series {
        measure: "launch_to_completion",
        path: "cuLaunchKernel+sync",
        ns: b,
    });

    // 1000 dependent launches, per launch; and a CUDA graph of the same 1000.
    let graph = driver::Graph::capture(&mut stream, |s| {
        for _ in 0..1000 {
            cuda(s)?;
        }
        Ok(())
    })?;
    let rounds = 200;
    let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let mut last = None;
        for _ in 0..1000 {
            last = Some(direct(&mut q)?);
        }
        last.ok_or("no launch")?.wait(T)?;
        a.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    for _ in 0..rounds {
        let t = Instant::now();
        let mut last = None;
        for _ in 0..1000 {
            // SAFETY: the empty kernel touches no memory.
            last = Some(unsafe { q.record_launch(&k, &ONE, &[]) }?);
        }
        q.flush();
        last.ok_or("no launch")?.wait(T)?;
        d.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..1000 {
            cuda(&mut stream)?;
        }
        stream.synchronize()?;
        b.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    for _ in 0..rounds {
        let t = Instant::now();
        graph.launch(&mut stream)?;
        stream.synchronize()?;
        c.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    series.push(Series {
        measure: "dependent_1000_per_launch",
        path: "apex_direct",
        ns: a,
    });
    series.push(Series {
        measure: "dependent_1000_per_launch",
        path: "cuLaunchKernel",
        ns: b,
    });
    series.push(Series {
        measure: "dependent_1000_per_launch",
        path: "cuGraphLaunch",
        ns: c,
    });
    series.push(Series {
        measure: "dependent_1000_per_launch",
        path: "apex_direct_one_doorbell",
        ns: d,
    });

    // Table with ratios to the CUDA figure of the same measure.
    let mut table = String::new();
    writeln!(
        table,
        "{:<28} {:<26} {:>10} {:>10} {:>10} {:>12}",
        "measure", "path", "min ns", "median ns", "p99 ns", "vs CUDA"
    )?;
    for s in &series {
        let (min, med, p99) = stats(&s.ns);
        let base = series
            .iter()
            .find(|b| b.measure == s.measure && b.path.starts_with("cuLaunchKernel"))
            .map(|b| stats(&b.ns).1);
        let ratio = base.map_or("".to_string(), |b| format!("{:.2}x", b / med));
        writeln!(
            table,
            "{:<28} {:<26} {:>10.0} {:>10.0} {:>10.0} {:>12}",
            s.measure, s.path, min, med, p99, ratio
        )?;
    }
    print!("{table}");
    std::fs::write(out.join("launch_latency.txt"), &table)?;

    let mut csv = String::from("measure,path,sample,ns\n");
    for s in &series {
        for (j, v) in s.ns.iter().enumerate() {
            writeln!(csv, "{},{},{j},{v:.1}", s.measure, s.path)?;
        }
    }
    std::fs::write(out.join("launch_latency.csv"), csv)?;
    plot(&series, &out.join("launch_latency.svg"))?;
    println!("wrote {}/launch_latency.{{txt,csv,svg}}", out.display());
    Ok(())
}

/// One panel per measure: the cumulative distribution of each path's samples.
fn plot(series: &[Series], path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let measures = [
        "submit",
        "launch_to_completion",
        "dependent_1000_per_launch",
    ];
    let root = SVGBackend::new(path, (1200, 1200)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((measures.len(), 1));
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN];
    for (panel, m) in panels.iter().zip(measures) {
        let group: Vec<&Series> = series.iter().filter(|s| s.measure == m).collect();
        let max = group.iter().map(|s| stats(&s.ns).2).fold(0.0, f64::max) * 1.2;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{m} (ns, CDF up to p99 x1.2)"), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..max, 0.0..1.0)?;
        chart.configure_mesh().draw()?;
        for (s, color) in group.iter().zip(colors) {
            let mut v = s.ns.clone();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(j, &x)| (x, (j + 1) as f64 / n)),
                    color,
                ))?
                .label(s.path)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
