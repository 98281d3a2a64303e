//! The launch-latency benchmark: APEX's direct path beside cuLaunchKernel and CUDA graphs, measured in one
//! process, with the table, CSV and SVG that `apex bench` and the `launch_latency` example write.
//!
//! Each path runs its samples as one phase: switching the GPU between APEX's channel group and CUDA's costs a
//! context switch (~150 µs on the H200), which per-sample interleaving would measure instead.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::driver;
use crate::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig};
use crate::module::Module;
use crate::rm::GpuCore;
use crate::{Error, Result};

const WAIT: Duration = Duration::from_secs(10);
const ONE: LaunchConfig = LaunchConfig {
    grid: [1, 1, 1],
    block: [1, 1, 1],
    shared_bytes: 0,
    cluster: None,
    sync_domain: 0,
    cluster_policy: crate::launch::ClusterPolicy::Default,
};

/// What to measure, and how much.
#[derive(Clone, Debug)]
pub struct LatencyOptions {
    /// The GPU index.
    pub gpu: usize,
    /// Samples of the submit and launch-to-completion measures, per path.
    pub samples: usize,
    /// Rounds of 1000 dependent launches, per path.
    pub rounds: usize,
    /// Launches of warm-up per path before measuring.
    pub warmup: usize,
    /// Open the direct path before libcuda (the second one finds the address space as the first left it).
    pub direct_first: bool,
}

impl Default for LatencyOptions {
    fn default() -> Self {
        LatencyOptions {
            gpu: 0,
            samples: 20_000,
            rounds: 200,
            warmup: 2000,
            direct_first: false,
        }
    }
}

/// One path's samples of one measure, in nanoseconds.
#[derive(Clone, Debug)]
pub struct Series {
    /// `submit`, `launch_to_completion` or `dependent_1000_per_launch`.
    pub measure: &'static str,
    /// `apex_direct`, `apex_direct_one_doorbell`, `cuLaunchKernel`, `cuLaunchKernel+sync` or `cuGraphLaunch`.
    pub path: &'static str,
    /// Every sample, in the order taken.
    pub ns: Vec<f64>,
}

impl Series {
    /// Minimum, median and 99th percentile.
    pub fn stats(&self) -> (f64, f64, f64) {
        let mut s = self.ns.clone();
        s.sort_by(f64::total_cmp);
        match s.len() {
            0 => (f64::NAN, f64::NAN, f64::NAN),
            n => (s[0], s[n / 2], s[n * 99 / 100]),
        }
    }
}

/// The result of [`launch_latency`].
#[derive(Clone, Debug)]
pub struct LatencyReport {
    /// The GPU, its UUID, the kernel driver's and the CUDA driver API's versions.
    pub device: String,
    /// Every measure on every path.
    pub series: Vec<Series>,
}

/// The measures, in the order they are taken and plotted.
pub const MEASURES: [&str; 3] = [
    "submit",
    "launch_to_completion",
    "dependent_1000_per_launch",
];

/// Runs the benchmark with an empty kernel `kernel` of `cubin` (1 block of 1 thread, no parameters) on both
/// the direct path and libcuda. `progress` is told what is being measured, for a long run's display.
pub fn launch_latency(
    cubin: &[u8],
    kernel: &str,
    opts: &LatencyOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<LatencyReport> {
    if opts.samples == 0 || opts.rounds == 0 {
        return Err(Error::InvalidArgument(
            "the benchmark needs at least one sample and one round".into(),
        ));
    }
    progress("opening the GPU on both paths");
    let (ctx, gpu) = if opts.direct_first {
        let gpu = GpuCore::open(opts.gpu)?;
        (driver::Context::new(opts.gpu)?, gpu)
    } else {
        let ctx = driver::Context::new(opts.gpu)?;
        (ctx, GpuCore::open(opts.gpu)?)
    };
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
    let k = Module::load(&gpu, cubin)?.kernel(kernel)?;
    let mut stream = driver::Stream::new(&ctx)?;
    let f = driver::Module::load(&ctx, cubin)?.function(kernel)?;
    let i = gpu.info();
    let device = format!(
        "{} ({}), driver {}, CUDA driver API {}",
        i.name,
        i.uuid,
        i.driver_version,
        ctx.driver_version()?
    );

    let direct = |q: &mut ComputeQueue| -> Result<crate::pushbuf::Fence> {
        // SAFETY: the caller's kernel is empty: it touches no memory.
        Ok(unsafe { q.launch(&k, &ONE, &[]) }?)
    };
    let cuda = |s: &mut driver::Stream| -> driver::Result<()> {
        // SAFETY: the empty kernel takes no parameters and touches no memory.
        unsafe { s.launch(&f, [1, 1, 1], [1, 1, 1], 0, &mut []) }
    };
    progress("warming up");
    for _ in 0..opts.warmup {
        direct(&mut q)?.wait(Duration::from_secs(2))?;
    }
    for _ in 0..opts.warmup {
        cuda(&mut stream)?;
        stream.synchronize()?;
    }

    let n = opts.samples;
    let mut series = Vec::new();
    progress("submit: CPU time of one launch");
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for r in 0..n {
        let t = Instant::now();
        let fence = direct(&mut q)?;
        a.push(t.elapsed().as_nanos() as f64);
        if r % 256 == 255 {
            fence.wait(WAIT)?;
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
    series.push(series_of("submit", "apex_direct", a));
    series.push(series_of("submit", "cuLaunchKernel", b));

    progress("launch to completion seen by the CPU");
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        direct(&mut q)?.wait(WAIT)?;
        a.push(t.elapsed().as_nanos() as f64);
    }
    for _ in 0..n {
        let t = Instant::now();
        cuda(&mut stream)?;
        stream.synchronize()?;
        b.push(t.elapsed().as_nanos() as f64);
    }
    series.push(series_of("launch_to_completion", "apex_direct", a));
    series.push(series_of("launch_to_completion", "cuLaunchKernel+sync", b));

    progress(
        "1000 dependent launches: one doorbell each, one doorbell, cuLaunchKernel, CUDA graph",
    );
    let graph = driver::Graph::capture(&mut stream, |s| {
        for _ in 0..1000 {
            cuda(s)?;
        }
        Ok(())
    })?;
    let rounds = opts.rounds;
    let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let mut last = direct(&mut q)?;
        for _ in 1..1000 {
            last = direct(&mut q)?;
        }
        last.wait(WAIT)?;
        a.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    for _ in 0..rounds {
        let t = Instant::now();
        // SAFETY: the empty kernel touches no memory.
        let mut last = unsafe { q.record_launch(&k, &ONE, &[]) }?;
        for _ in 1..1000 {
            // SAFETY: as above.
            last = unsafe { q.record_launch(&k, &ONE, &[]) }?;
        }
        q.flush();
        last.wait(WAIT)?;
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
    let m = "dependent_1000_per_launch";
    series.push(series_of(m, "apex_direct", a));
    series.push(series_of(m, "cuLaunchKernel", b));
    series.push(series_of(m, "cuGraphLaunch", c));
    series.push(series_of(m, "apex_direct_one_doorbell", d));
    Ok(LatencyReport { device, series })
}

fn series_of(measure: &'static str, path: &'static str, ns: Vec<f64>) -> Series {
    Series { measure, path, ns }
}

impl LatencyReport {
    /// The median of the cuLaunchKernel path of `measure`, which the table's ratios compare against.
    fn cuda_median(&self, measure: &str) -> Option<f64> {
        self.series
            .iter()
            .find(|b| b.measure == measure && b.path.starts_with("cuLaunchKernel"))
            .map(|b| b.stats().1)
    }

    /// How many times faster than cuLaunchKernel (median against median) `s` is.
    pub fn speedup(&self, s: &Series) -> Option<f64> {
        self.cuda_median(s.measure).map(|b| b / s.stats().1)
    }

    /// The plain table: min, median, p99 and the ratio to cuLaunchKernel's median, one row per series.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:<28} {:<26} {:>10} {:>10} {:>10} {:>12}",
            "measure", "path", "min ns", "median ns", "p99 ns", "vs CUDA"
        );
        for s in &self.series {
            let (min, med, p99) = s.stats();
            let ratio = self
                .speedup(s)
                .map_or(String::new(), |r| format!("{r:.2}x"));
            let _ = writeln!(
                t,
                "{:<28} {:<26} {:>10.0} {:>10.0} {:>10.0} {:>12}",
                s.measure, s.path, min, med, p99, ratio
            );
        }
        t
    }

    /// Every sample: `measure,path,sample,ns`.
    pub fn csv(&self) -> String {
        let mut csv = String::from("measure,path,sample,ns\n");
        for s in &self.series {
            for (j, v) in s.ns.iter().enumerate() {
                let _ = writeln!(csv, "{},{},{j},{v:.1}", s.measure, s.path);
            }
        }
        csv
    }

    /// One panel per measure: each path's cumulative distribution, up to 1.2 × the largest p99.
    pub fn svg(&self) -> String {
        const W: f64 = 1200.0;
        const PANEL: f64 = 400.0;
        const COLORS: [&str; 5] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#17becf"];
        let (left, right, top, bottom) = (60.0, 20.0, 40.0, 40.0);
        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{}" font-family="sans-serif" font-size="12">"#,
            PANEL * MEASURES.len() as f64
        );
        let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
        for (p, m) in MEASURES.iter().enumerate() {
            let y0 = p as f64 * PANEL;
            let group: Vec<&Series> = self.series.iter().filter(|s| s.measure == *m).collect();
            let max = group.iter().map(|s| s.stats().2).fold(0.0, f64::max) * 1.2;
            let (pw, ph) = (W - left - right, PANEL - top - bottom);
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{}" font-size="16" text-anchor="middle">{m} (ns, CDF up to p99 x1.2)</text>"#,
                W / 2.0,
                y0 + 24.0
            );
            let _ = writeln!(
                out,
                r#"<rect x="{left}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#,
                y0 + top
            );
            for tick in 0..=4 {
                let fx = f64::from(tick) / 4.0;
                let _ = writeln!(
                    out,
                    r#"<text x="{}" y="{}" text-anchor="middle">{:.0}</text><text x="{}" y="{}" text-anchor="end">{fx:.2}</text>"#,
                    left + fx * pw,
                    y0 + top + ph + 16.0,
                    fx * max,
                    left - 6.0,
                    y0 + top + ph - fx * ph + 4.0
                );
            }
            // No samples (or NaN): an empty panel.
            if max.is_nan() || max <= 0.0 {
                continue;
            }
            for (j, (s, color)) in group.iter().zip(COLORS).enumerate() {
                let mut v = s.ns.clone();
                v.sort_by(f64::total_cmp);
                let n = v.len() as f64;
                // At most ~2000 points per line keeps the file small; the shape does not change.
                let step = (v.len() / 2000).max(1);
                let points: Vec<String> = v
                    .iter()
                    .enumerate()
                    .step_by(step)
                    .filter(|(_, x)| **x <= max)
                    .map(|(i, &x)| {
                        format!(
                            "{:.1},{:.1}",
                            left + x / max * pw,
                            y0 + top + ph - (i + 1) as f64 / n * ph
                        )
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                    points.join(" ")
                );
                let ly = y0 + top + 16.0 + j as f64 * 16.0;
                let _ = writeln!(
                    out,
                    r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
                    W - right - 220.0,
                    W - right - 200.0,
                    W - right - 195.0,
                    ly + 4.0,
                    s.path
                );
            }
        }
        out.push_str("</svg>\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> LatencyReport {
        let s = |measure, path, ns: Vec<f64>| Series { measure, path, ns };
        LatencyReport {
            device: "test".into(),
            series: vec![
                s("submit", "apex_direct", vec![600.0, 650.0, 700.0]),
                s("submit", "cuLaunchKernel", vec![3000.0, 3200.0, 3500.0]),
            ],
        }
    }

    #[test]
    fn table_csv_and_svg() {
        let r = report();
        let t = r.table();
        assert!(t.contains("apex_direct") && t.contains("4.92x"), "{t}");
        assert_eq!(r.csv().lines().count(), 7);
        let svg = r.svg();
        assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.ends_with("</svg>\n"));
    }
}
