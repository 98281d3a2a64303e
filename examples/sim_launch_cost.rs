//! CPU cost of recording a launch, measured against the simulated GPU (no accelerator needed): what APEX's
//! own code costs per launch, apart from write-combining and the doorbell on real hardware (the simulated front end
//! is paused while the launches are recorded, so nothing else touches their memory): an ordinary launch and a
//! prepared one, and a prepared one that returns its timeline value instead of a fence. `APEX_ARMED=1` sends them
//! through armed slots.

mod support;

use std::time::{Duration, Instant};

use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::pushbuf::{Armed, Submission};
use apex::rm::sim::SimConfig;
use apex::sim::Simulator;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (gpu, sim) = Simulator::open(SimConfig::default())?;
    let mut config = ComputeQueueConfig::default();
    if let Some(b) = std::env::var("APEX_PUSH_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.queue.push_bytes = b;
    }
    // APEX_ARMED=1: submissions through armed slots (`Submission::Armed`).
    if std::env::var("APEX_ARMED").is_ok_and(|v| v == "1") {
        config.queue.submission = Submission::Armed(Armed::default());
    }
    let mut q = ComputeQueue::new(&gpu, config)?;
    let k = Module::load(&gpu, CUBIN)?.kernel("empty")?;
    let cfg = LaunchConfig::linear(1, 1);
    // APEX_ROUNDS: more rounds of 200 launches, for profiling.
    let rounds: usize = std::env::var("APEX_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let prepared = q.prepare_launch(&k, &cfg)?;
    let only = std::env::var("APEX_ONLY").ok();
    for name in ["record_launch", "record_prepared", "launch_prepared_value"] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let mut samples = Vec::new();
        for _ in 0..rounds {
            // The model stands still while the launches are recorded: its reads of the same memory from another
            // core would make the CPU's stores contend for the lines, which is not the software's cost.
            sim.pause();
            let t = Instant::now();
            let mut last = 0;
            for _ in 0..200 {
                // SAFETY: the empty kernel touches no memory (and the simulator runs no kernels).
                last = unsafe {
                    match name {
                        "record_launch" => q.record_launch(&k, &cfg, &[])?.value(),
                        "record_prepared" => q.record_prepared(&prepared, &[])?.value(),
                        _ => q.launch_prepared_value(&prepared, &[])?,
                    }
                };
            }
            samples.push(t.elapsed() / 200);
            sim.resume();
            q.flush();
            q.fence_for(last).wait(Duration::from_secs(10))?;
        }
        samples.sort();
        println!(
            "{name} against the simulator: median {:?} per launch, min {:?}",
            samples[samples.len() / 2],
            samples[0]
        );
    }
    Ok(())
}
