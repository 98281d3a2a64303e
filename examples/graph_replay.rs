//! What a graph replay costs beyond its nodes (issue 11), beside CUDA in one process: chains of 1 to 136 empty
//! kernels (`pdl_empty`, one block of 32) built as an `apex::Graph` and replayed
//!
//! - back to back: `APEX_REPLAYS` (400) replays, then one wait; µs per replay. What a decoder that never looks at
//!   its output pays per step, and the gap between one replay's last node and the next replay's first;
//! - one at a time: replay, then wait for its fence; µs from the call to the CPU seeing completion. What a decoder
//!   that samples each token on the CPU pays per step.
//!
//! The driver backend builds a CUDA graph of the same description (`cuGraphLaunch`, `cuStreamSynchronize`).
//! Each figure is the best of 6 rounds (back to back) or 50 replays (one at a time). `APEX_NODES=1,17` picks the
//! chain lengths.
//!
//! `cargo run --release --example graph_replay`

mod support;

use std::time::{Duration, Instant};

use apex::{BackendRequest, Gpu, Graph, LaunchConfig};

const PDL: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

fn main() -> std::process::ExitCode {
    support::report(run())
}

/// (µs per replay back to back, µs from replay to completion seen) for a chain of `nodes` on `gpu`.
fn measure(
    gpu: &Gpu,
    nodes: usize,
    replays: usize,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let m = gpu.load_module(PDL)?;
    let k = m.kernel("pdl_empty")?;
    let mut q = gpu.queue()?;
    let mut g = Graph::new();
    let mut prev = None;
    for _ in 0..nodes {
        let id = g.launch(&k, LaunchConfig::linear(1, 32), &[])?.id();
        if let Some(p) = prev {
            g.edge(p, id)?;
        }
        prev = Some(id);
    }
    let mut exec = q.instantiate(&g)?;
    let mut back_to_back = f64::MAX;
    for _ in 0..6 {
        q.synchronize()?;
        let t = Instant::now();
        // SAFETY: pdl_empty touches no memory.
        let mut f = unsafe { q.replay(&mut exec)? };
        for _ in 1..replays {
            // SAFETY: as above.
            f = unsafe { q.replay(&mut exec)? };
        }
        f.wait(T)?;
        back_to_back = back_to_back.min(t.elapsed().as_secs_f64() * 1e6 / replays as f64);
    }
    let mut one = f64::MAX;
    for _ in 0..50 {
        q.synchronize()?;
        let t = Instant::now();
        // SAFETY: as above.
        unsafe { q.replay(&mut exec)? }.wait(T)?;
        one = one.min(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok((back_to_back, one))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let replays: usize = std::env::var("APEX_REPLAYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400usize)
        .max(2);
    let nodes: Vec<usize> = match std::env::var("APEX_NODES") {
        Ok(v) => v
            .split(',')
            .map(|n| n.trim().parse::<usize>())
            .collect::<Result<_, _>>()?,
        Err(_) => vec![1, 2, 8, 17, 136],
    };
    // The CUDA driver first: libcuda places its address ranges before APEX reserves its own.
    let cuda = Gpu::open_with(0, BackendRequest::Driver)?;
    let apex = Gpu::open_with(0, BackendRequest::Direct)?;
    println!(
        "{}, driver {}: chains of empty kernels as graphs; µs per replay",
        apex.info().name,
        apex.direct()
            .map_or_else(|| "?".into(), |g| g.info().driver_version.clone()),
    );
    println!(
        "| nodes | back to back: APEX | cuGraphLaunch | CUDA ÷ APEX | replay + wait: APEX | cuGraphLaunch + sync | CUDA ÷ APEX |"
    );
    println!("|---|---|---|---|---|---|---|");
    for n in nodes.into_iter().filter(|&n| n > 0) {
        let (ab, aw) = measure(&apex, n, replays)?;
        let (cb, cw) = measure(&cuda, n, replays)?;
        println!(
            "| {n} | {ab:.3} | {cb:.3} | {:.2}× | {aw:.3} | {cw:.3} | {:.2}× |",
            cb / ab,
            cw / aw
        );
    }
    Ok(())
}
