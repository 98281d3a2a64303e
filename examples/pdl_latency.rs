//! Programmatic dependent launch (issue 11), beside CUDA in one process: the time per launch of 1000 dependent
//! launches, each kernel starting with `griddepcontrol.wait` and `griddepcontrol.launch_dependents`
//! (kernels/apex_pdl.cu), sent every way APEX and CUDA can send them:
//!
//! - eager, one launch at a time: `Queue::launch` (cuLaunchKernel on the driver backend), and
//!   `Launch::programmatic` (cuLaunchKernelEx with programmatic stream serialization);
//! - chained, one call per launch and one chain: `Launch::chained` and `Launch::chained().programmatic()`
//!   (on the driver backend the same stream launches as eager);
//! - as a graph of 1000 nodes in a chain, replayed once: plain edges, and programmatic edges (on the driver backend
//!   a CUDA graph built node by node, `cuGraphLaunch`).
//!
//! Two kernels: `pdl_empty` (one block, nothing to do: the cost of the launch itself), and `pdl_busy` (two blocks
//! per SM spinning for `APEX_SPINS` iterations, a few microseconds: how much of a launch's latency overlaps the
//! kernel before it). Each figure is the best of `APEX_ROUNDS` (5) rounds of `APEX_LAUNCHES` (1000) launches.
//!
//! `cargo run --release --example pdl_latency`

mod support;

use std::time::{Duration, Instant};

use apex::{Arg, BackendRequest, Buffer, Gpu, Graph, Kernel, Launch, LaunchConfig, Queue};

const PDL: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");
const T: Duration = Duration::from_secs(60);

fn env(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Dependent launches per round: `APEX_LAUNCHES` (1000 by default; a few when tracing the QMDs).
fn launches() -> usize {
    env("APEX_LAUNCHES", 1000).max(2) as usize
}

fn main() -> std::process::ExitCode {
    support::report(run())
}

/// How the 1000 launches are sent.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    Eager,
    EagerProgrammatic,
    Chained,
    ChainedProgrammatic,
    Graph,
    GraphProgrammatic,
}

const WAYS: [(Way, &str); 6] = [
    (Way::Eager, "eager"),
    (Way::EagerProgrammatic, "eager, programmatic"),
    (Way::Chained, "chained"),
    (Way::ChainedProgrammatic, "chained, programmatic"),
    (Way::Graph, "graph"),
    (Way::GraphProgrammatic, "graph, programmatic"),
];

struct Side {
    gpu: Gpu,
    q: Queue,
    kernels: [Kernel; 2],
    out: Buffer,
}

/// Microseconds per launch, best of `rounds`.
fn time(
    s: &mut Side,
    way: Way,
    which: usize,
    cfg: LaunchConfig,
    spins: u32,
    rounds: u32,
) -> Result<f64, Box<dyn std::error::Error>> {
    let k = s.kernels[which].clone();
    let out = s.out.clone();
    let args_of = |which: usize| -> Vec<Arg<'static>> {
        if which == 0 {
            vec![]
        } else {
            vec![Arg::Ptr(out.device_ptr()), Arg::U32(spins)]
        }
    };
    let args = args_of(which);
    let mut exec = match way {
        Way::Graph | Way::GraphProgrammatic => {
            let mut g = Graph::new();
            let mut prev = None;
            for i in 0..launches() {
                let mut node = g.launch(&k, cfg, &args)?;
                if way == Way::GraphProgrammatic && i > 0 {
                    node = node.programmatic();
                }
                let id = node.id();
                if let Some(p) = prev {
                    g.edge(p, id)?;
                }
                prev = Some(id);
            }
            Some(s.q.instantiate(&g)?)
        }
        _ => None,
    };
    let mut best = f64::MAX;
    // One untimed round first (graph upload, queue growth, caches).
    for round in 0..=rounds {
        s.q.synchronize()?;
        let t = Instant::now();
        // SAFETY: pdl_empty touches no memory; pdl_busy writes at most one word per block of `out`, which this side
        // alone uses; both wait for their producer before that.
        let last = unsafe {
            match (way, &mut exec) {
                (Way::Eager, _) => {
                    let mut f = s.q.launch(&k, &cfg, &args)?;
                    for _ in 1..launches() {
                        f = s.q.launch(&k, &cfg, &args)?;
                    }
                    f
                }
                (Way::EagerProgrammatic, _) => {
                    let launch = Launch::new(&k, &cfg, &args).programmatic();
                    let mut f = s.q.submit_fenced(&launch)?;
                    for _ in 1..launches() {
                        f = s.q.submit_fenced(&launch)?;
                    }
                    f
                }
                (Way::Chained | Way::ChainedProgrammatic, _) => {
                    let link = Launch::new(&k, &cfg, &args).chained();
                    s.q.submit(&link)?;
                    let link = if way == Way::Chained {
                        link
                    } else {
                        link.programmatic()
                    };
                    for _ in 1..launches() {
                        s.q.submit(&link)?;
                    }
                    s.q.end_chain()?
                }
                (_, Some(e)) => s.q.replay(e)?,
                (_, None) => return Err("a graph way without its graph".into()),
            }
        };
        last.wait(T)?;
        let us = t.elapsed().as_secs_f64() * 1e6 / launches() as f64;
        if round > 0 {
            best = best.min(us);
        }
    }
    Ok(best)
}

fn side(request: BackendRequest) -> Result<Side, Box<dyn std::error::Error>> {
    let gpu = Gpu::open_with(0, request)?;
    let m = gpu.load_module(PDL)?;
    let kernels = [m.kernel("pdl_empty")?, m.kernel("pdl_busy")?];
    let out = gpu.alloc(4096)?;
    let q = gpu.queue()?;
    Ok(Side {
        gpu,
        q,
        kernels,
        out,
    })
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let rounds = env("APEX_ROUNDS", 5);
    let spins = env("APEX_SPINS", 2000);
    // The CUDA driver first: libcuda places its address ranges before APEX reserves its own.
    let mut cuda = side(BackendRequest::Driver)?;
    let mut apex = side(BackendRequest::Direct)?;
    let sms = apex.gpu.info().sm_count;
    println!(
        "{}, driver {}: {} dependent launches, µs per launch, best of {rounds} rounds",
        apex.gpu.info().name,
        apex.gpu
            .direct()
            .map_or_else(|| "?".into(), |g| g.info().driver_version.clone()),
        launches()
    );
    let shapes = [
        ("pdl_empty, 1 block of 32", 0, LaunchConfig::linear(1, 32)),
        (
            "pdl_busy, 2 blocks per SM of 128, spinning",
            1,
            LaunchConfig::linear(2 * sms, 128),
        ),
    ];
    for (name, which, cfg) in shapes {
        println!();
        println!(
            "{name}{}",
            if which == 1 {
                format!(" {spins} times")
            } else {
                String::new()
            }
        );
        println!("| way | APEX µs | CUDA µs | CUDA ÷ APEX |");
        println!("|---|---|---|---|");
        let mut rows = Vec::new();
        for (way, label) in WAYS {
            let c = time(&mut cuda, way, which, cfg, spins, rounds)?;
            let a = time(&mut apex, way, which, cfg, spins, rounds)?;
            println!("| {label} | {a:.3} | {c:.3} | {:.2}× |", c / a);
            rows.push((way, a, c));
        }
        let get = |w: Way, apex: bool| {
            rows.iter()
                .find(|r| r.0 == w)
                .map_or(f64::NAN, |r| if apex { r.1 } else { r.2 })
        };
        println!(
            "APEX eager programmatic: {:.2}× the CUDA graph's time, {:.2}× the programmatic CUDA graph's, {:.2}× APEX \
             eager's",
            get(Way::EagerProgrammatic, true) / get(Way::Graph, false),
            get(Way::EagerProgrammatic, true) / get(Way::GraphProgrammatic, false),
            get(Way::EagerProgrammatic, true) / get(Way::Eager, true),
        );
    }
    Ok(())
}
