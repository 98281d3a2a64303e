//! Semaphore round trips through our own channel: a host semaphore release submitted by doorbell, polled
//! by the CPU. Prints the latency distribution.

mod support;

use std::time::{Duration, Instant};

use apex::pushbuf::{Queue, QueueConfig, Signal};
use apex::rm::GpuCore;

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = GpuCore::open(0)?;
    let info = gpu.info();
    println!(
        "{} ({}), sm_{}, {} SMs, driver {}",
        info.name, info.uuid, info.sm_version, info.sm_count, info.driver_version
    );
    for placement in [
        apex::rm::Placement::SystemWriteCombined,
        apex::rm::Placement::Video,
    ] {
        for ring in [
            apex::rm::Placement::Video,
            apex::rm::Placement::SystemWriteCombined,
        ] {
            let mut cfg = QueueConfig::default().with_push_placement(placement);
            cfg.channel.ring_placement = ring;
            let mut q = Queue::new(&gpu, cfg)?;
            let n = 20_000;
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let f = q.submit(0, Signal::Host, |_, _| {})?;
                f.wait(Duration::from_secs(5))?;
                lat.push(t.elapsed());
                assert_eq!(q.timeline().completed(), f.value());
            }
            lat.sort();
            println!(
                "pushbuffer {placement:?}, ring {ring:?}: {n} verified round trips, min {:?} median {:?} p99 {:?}",
                lat[0],
                lat[n / 2],
                lat[n * 99 / 100]
            );
        }
    }
    Ok(())
}
