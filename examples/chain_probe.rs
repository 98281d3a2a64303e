//! Where the time of 1000 dependent launches on a chained queue goes, beside cuGraphLaunch, in one process.
//!
//! Each round runs every series once, in turn (so drift hits all alike); per series it prints the median over the
//! rounds of: the CPU time of the 1000 launch calls (`calls`), the time until the last one has completed
//! (`total`), both per launch, and the parts (timeline values) the 1000 launches were sent as. Series:
//!
//! - `chained fence` / `chained value`: plain `launch` / `launch_value` on a chained queue
//!   (`ComputeQueueConfig::chained_stream`), as `cargo bench --bench launch` group `dependent_1000` does;
//! - `recorded chain`: `record_launch_chained` and `end_chain` on a plain queue;
//! - `... gpu held`: the same calls while the GPU waits for a word the CPU writes after the last call: `calls` is
//!   the CPU's cost alone, and `total - calls` (shown as `gpu`) the GPU's time for the links once let go;
//! - `cuGraphLaunch`: a captured graph of the same 1000 launches, replayed.
//!
//! `APEX_ROUNDS` sets the rounds (default 200), `APEX_CHAIN_PART` the chained queues' part size.

mod support;

use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::{Kernel, Module};
use apex::rm::{GpuCore, Memory, MemoryDesc, Placement};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const WAIT: Duration = Duration::from_secs(10);
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);
const N: usize = 1000;

fn main() -> std::process::ExitCode {
    support::report(run())
}

#[derive(Default)]
struct Series {
    calls: Vec<f64>,
    total: Vec<f64>,
    parts: Vec<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

struct Held {
    word: Memory,
    next: u64,
}

impl Held {
    /// Makes `q`'s later work wait until the CPU writes the next value to the word.
    fn hold(&mut self, q: &mut ComputeQueue) -> Result<(), Box<dyn std::error::Error>> {
        self.next += 1;
        q.wait_value(self.word.va(), self.next)?;
        q.flush();
        Ok(())
    }
    fn release(&self) -> Result<(), Box<dyn std::error::Error>> {
        self.word.write_u64_volatile(0, self.next)?;
        Ok(())
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = driver::Context::new(0)?;
    let gpu = GpuCore::open(0)?;
    let rounds: usize = std::env::var("APEX_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let mut chained_cfg = ComputeQueueConfig::default().with_chained_stream(true);
    if let Some(p) = std::env::var("APEX_CHAIN_PART")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        chained_cfg = chained_cfg.with_chain_part(p);
    }
    let mut qc = ComputeQueue::new(&gpu, chained_cfg)?;
    let mut qp = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
    // A held GPU frees no slot: the held series need a slot per launch.
    let mut qc_held = ComputeQueue::new(&gpu, chained_cfg.with_slots(N + 24))?;
    let mut qp_held = ComputeQueue::new(&gpu, ComputeQueueConfig::default().with_slots(N + 24))?;
    let k: Kernel = Module::load(&gpu, CUBIN)?.kernel("empty")?;
    let mut stream = driver::Stream::new(&ctx)?;
    let f = driver::Module::load(&ctx, CUBIN)?.function("empty")?;
    let graph = driver::Graph::capture(&mut stream, |s| {
        for _ in 0..N {
            // SAFETY: the empty kernel takes no parameters and touches no memory.
            unsafe { s.launch(&f, [1, 1, 1], [1, 1, 1], 0, &mut [])? };
        }
        Ok(())
    })?;
    let word = Memory::alloc(
        &gpu,
        MemoryDesc::video(4096)
            .placement(Placement::SystemCached)
            .with_cpu(),
    )?;
    word.write_u64_volatile(0, 0)?;
    let mut held = Held { word, next: 0 };

    let names = [
        "chained fence",
        "chained value",
        "chained value, gpu held",
        "recorded chain",
        "recorded chain, gpu held",
        "cuGraphLaunch",
    ];
    let mut out: Vec<Series> = names.iter().map(|_| Series::default()).collect();
    for round in 0..rounds + 5 {
        for (i, s) in out.iter_mut().enumerate() {
            let gated = names[i].ends_with("gpu held");
            let (calls, total, parts);
            if names[i] == "cuGraphLaunch" {
                let t0 = Instant::now();
                graph.launch(&mut stream)?;
                calls = t0.elapsed();
                stream.synchronize()?;
                total = t0.elapsed();
                parts = 1;
            } else {
                let q = match (names[i].starts_with("chained"), gated) {
                    (true, false) => &mut qc,
                    (false, false) => &mut qp,
                    (true, true) => &mut qc_held,
                    (false, true) => &mut qp_held,
                };
                if gated {
                    held.hold(q)?;
                }
                let v0 = q.queue().last_submitted();
                let t0 = Instant::now();
                let fence = match names[i] {
                    "chained fence" => {
                        let mut last = None;
                        for _ in 0..N {
                            // SAFETY: the empty kernel touches no memory.
                            last = Some(unsafe { q.launch(&k, &ONE, &[]) }?);
                        }
                        q.flush_held()?;
                        last.ok_or("no launch")?
                    }
                    "chained value" | "chained value, gpu held" => {
                        let mut last = 0;
                        for _ in 0..N {
                            // SAFETY: as above.
                            last = unsafe { q.launch_value(&k, &ONE, &[]) }?;
                        }
                        q.flush_held()?;
                        q.fence_for(last)
                    }
                    _ => {
                        for _ in 0..N {
                            // SAFETY: as above.
                            unsafe { q.record_launch_chained(&k, &ONE, &[]) }?;
                        }
                        q.end_chain()?
                    }
                };
                let t1 = Instant::now();
                let (t0, t1) = if gated {
                    held.release()?;
                    (t0, Instant::now().max(t1))
                } else {
                    (t0, t1)
                };
                fence.wait(WAIT)?;
                let t2 = Instant::now();
                calls = t1 - t0;
                total = t2 - t0;
                parts = q.queue().last_submitted() - v0;
            }
            if round >= 5 {
                s.calls.push(calls.as_nanos() as f64 / N as f64);
                s.total.push(total.as_nanos() as f64 / N as f64);
                s.parts.push(parts as f64);
            }
        }
    }
    println!(
        "{} rounds of {N} dependent empty launches; medians per launch (ns)",
        rounds
    );
    println!(
        "{:<28} {:>8} {:>8} {:>8} {:>6}",
        "series", "calls", "total", "gpu", "parts"
    );
    for (name, s) in names.iter().zip(out.iter_mut()) {
        let c = median(&mut s.calls);
        let t = median(&mut s.total);
        let p = median(&mut s.parts);
        println!("{name:<28} {c:>8.0} {t:>8.0} {:>8.0} {p:>6.0}", t - c);
    }
    Ok(())
}
