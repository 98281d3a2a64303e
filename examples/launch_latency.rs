//! Launch latency, APEX's direct path beside cuLaunchKernel and CUDA graphs, measured in one process:
//! a plain table (min, median, p99, ratio to cuLaunchKernel), a CSV of every sample and an SVG plot of the
//! distributions, written to the directory given as the first argument (default: the current directory).
//! The measurement is [`apex::bench::launch_latency`], shared with `apex bench`.

mod support;

use std::path::PathBuf;

use apex::bench::{LatencyOptions, launch_latency};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&out)?;
    let opts = LatencyOptions {
        // Which path opens first (the other one then finds the address space as the first left it).
        direct_first: std::env::var("APEX_DIRECT_FIRST").is_ok_and(|v| v == "1"),
        ..LatencyOptions::default()
    };
    let report = launch_latency(CUBIN, "empty", &opts, &mut |what| eprintln!("... {what}"))?;
    println!("{}", report.device);
    let table = report.table();
    print!("{table}");
    std::fs::write(out.join("launch_latency.txt"), &table)?;
    std::fs::write(out.join("launch_latency.csv"), report.csv())?;
    std::fs::write(out.join("launch_latency.svg"), report.svg())?;
    println!("wrote {}/launch_latency.{{txt,csv,svg}}", out.display());
    Ok(())
}
