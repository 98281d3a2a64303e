//! Every GPU of the host in a ring (issue 13): GPU i adds its step to the buffer GPU i-1 wrote, reading it over
//! the peer link after waiting (on the GPU) for GPU i-1's fence; the result is checked for every element. Then,
//! on the first two GPUs, beside the CUDA driver backend in the same process: copy bandwidth between the GPUs
//! (256 MiB, each direction and both at once; APEX's copy engines vs `cuMemcpyPeerAsync`) and the latency of a
//! hop (a kernel on one GPU waiting for a kernel on the other; APEX's semaphore acquire vs `cuStreamWaitEvent`).
//! With one GPU it says that two are needed.
//!
//! `cargo run --release --example multi_gpu [rounds] [passes]`: `passes` (2 by default) measures both backends
//! that many times in turn. `APEX_COPY_MIB`: copy size, 256 by default; `APEX_LOG`: debug logs, which name the copy
//! engines chosen.

use std::time::{Duration, Instant};

use apex::{Arg, Backend, BackendRequest, Buffer, Gpu, LaunchConfig, Queue};

mod support;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(60);
const N: usize = 1 << 16;
/// Bytes per copy: `APEX_COPY_MIB` MiB (256 by default).
fn copy_bytes() -> u64 {
    std::env::var("APEX_COPY_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(256)
        << 20
}
const COPY_REPS: usize = 10;
const HOPS: usize = 2000;

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn open_all(n: usize, b: BackendRequest) -> apex::Result<Vec<Gpu>> {
    Gpu::open_peers(&(0..n).collect::<Vec<_>>(), b)
}

/// `rounds` times around the ring of `gpus`; returns the time per hop.
fn ring(gpus: &[Gpu], rounds: usize) -> Result<Duration, Box<dyn std::error::Error>> {
    let n = gpus.len();
    let step: Vec<Vec<f32>> = (0..n)
        .map(|g| (0..N).map(|i| ((i + g) % 7) as f32 + 1.0).collect())
        .collect();
    let mut queues: Vec<Queue> = gpus.iter().map(Gpu::queue).collect::<Result<_, _>>()?;
    let mut bufs = Vec::new();
    let mut steps = Vec::new();
    for (g, gpu) in gpus.iter().enumerate() {
        let (b, s) = (gpu.alloc(N as u64 * 4)?, gpu.alloc(N as u64 * 4)?);
        queues[g].upload(gpu, &b, 0, &f32s(&vec![0.0; N]))?;
        queues[g].upload(gpu, &s, 0, &f32s(&step[g]))?;
        bufs.push(b);
        steps.push(s);
    }
    for g in 0..n {
        gpus[g].map_peer(&bufs[(g + n - 1) % n])?;
    }
    let kernels = gpus
        .iter()
        .map(|g| g.load_module(CUBIN)?.kernel("vector_add"))
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = LaunchConfig::linear((N as u32).div_ceil(256), 256);
    let mut last = None;
    let t = Instant::now();
    for k in 0..rounds * n {
        let g = k % n;
        let prev = (g + n - 1) % n;
        if let Some(f) = &last {
            queues[g].wait_for(f)?;
        }
        // SAFETY: reads the previous GPU's buffer (complete: waited for above), writes this GPU's own.
        let f = unsafe {
            queues[g].launch(
                &kernels[g],
                &cfg,
                &[
                    bufs[prev].arg(),
                    steps[g].arg(),
                    bufs[g].arg(),
                    Arg::U32(N as u32),
                ],
            )?
        };
        last = Some(f);
    }
    if let Some(f) = last {
        f.wait(T)?;
    }
    let per_hop = t.elapsed() / (rounds * n) as u32;
    // Check every element of every GPU's buffer against the CPU (small integers: exact in f32).
    let mut v = vec![vec![0f32; N]; n];
    for k in 0..rounds * n {
        let g = k % n;
        let prev = (g + n - 1) % n;
        v[g] = (0..N).map(|i| v[prev][i] + step[g][i]).collect();
    }
    for (g, gpu) in gpus.iter().enumerate() {
        let mut out = vec![0u8; N * 4];
        queues[g].download(gpu, &bufs[g], 0, &mut out)?;
        if out != f32s(&v[g]) {
            return Err(format!("GPU {g}: the ring's result differs from the CPU's").into());
        }
    }
    Ok(per_hop)
}

/// GB/s of `COPY_REPS` copies of `copy_bytes()` bytes: 0 -> 1, 1 -> 0, and both at once (each GPU pushing). On
/// the direct path the source GPU's copy engines (RM's optimal write CEs) push; on the driver backend,
/// `cuMemcpyPeerAsync`.
fn bandwidth(g: &[Gpu]) -> Result<[f64; 3], Box<dyn std::error::Error>> {
    let bufs: Vec<[Buffer; 2]> = g
        .iter()
        .map(|x| Ok::<_, apex::Error>([x.alloc(copy_bytes())?, x.alloc(copy_bytes())?]))
        .collect::<Result<_, _>>()?;
    // CUDA's best: peer access enabled (without it cuMemcpyPeer stages through host memory).
    g[0].map_peer(&bufs[1][1])?;
    g[1].map_peer(&bufs[0][1])?;
    let mut q: Vec<Queue> = g.iter().map(Gpu::queue).collect::<Result<_, _>>()?;
    let gbps = |bytes: u64, t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let mut out = [0.0; 3];
    for (dir, (from, to)) in [(0usize, 1usize), (1, 0)].into_iter().enumerate() {
        // Warm: builds the copy channels and the peer mappings.
        q[from].copy_device_to_device(&bufs[from][0], 0, &bufs[to][1], 0, copy_bytes())?;
        q[from].synchronize()?;
        let t = Instant::now();
        for _ in 0..COPY_REPS {
            q[from].copy_device_to_device(&bufs[from][0], 0, &bufs[to][1], 0, copy_bytes())?;
        }
        q[from].synchronize()?;
        out[dir] = gbps(copy_bytes() * COPY_REPS as u64, t.elapsed());
    }
    let t = Instant::now();
    for _ in 0..COPY_REPS {
        q[0].copy_device_to_device(&bufs[0][0], 0, &bufs[1][1], 0, copy_bytes())?;
        q[1].copy_device_to_device(&bufs[1][0], 0, &bufs[0][1], 0, copy_bytes())?;
    }
    q[0].synchronize()?;
    q[1].synchronize()?;
    out[2] = gbps(2 * copy_bytes() * COPY_REPS as u64, t.elapsed());
    Ok(out)
}

/// Time per hop of `HOPS` empty kernels alternating between GPUs 0 and 1, each waiting for the one before.
fn hop_latency(g: &[Gpu]) -> Result<Duration, Box<dyn std::error::Error>> {
    let mut q: Vec<Queue> = g.iter().map(Gpu::queue).collect::<Result<_, _>>()?;
    let k = g
        .iter()
        .map(|x| x.load_module(CUBIN)?.kernel("empty"))
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = LaunchConfig::linear(1, 32);
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let mut last = None;
        let t = Instant::now();
        for h in 0..HOPS {
            let i = h % 2;
            if let Some(f) = &last {
                q[i].wait_for(f)?;
            }
            // SAFETY: the empty kernel touches no memory.
            last = Some(unsafe { q[i].launch(&k[i], &cfg, &[])? });
        }
        if let Some(f) = last {
            f.wait(T)?;
        }
        best = best.min(t.elapsed() / HOPS as u32);
    }
    Ok(best)
}

/// GB/s of the SMs copying 0 -> 1 over the link (APEX's built-in copy kernel on GPU 0 writing GPU 1's memory), 32
/// MiB at a time: larger peer-mapped buffers stalled in testing (issue 13).
const SM_BYTES: u64 = 32 << 20;

fn sm_bandwidth(g: &[Gpu]) -> Result<f64, Box<dyn std::error::Error>> {
    let (src, dst) = (g[0].alloc(SM_BYTES)?, g[1].alloc(SM_BYTES)?);
    g[0].map_peer(&dst)?;
    let mut q = g[0].queue()?;
    let Some(cq) = q.direct() else {
        return Ok(0.0);
    };
    let run = |cq: &mut apex::launch::ComputeQueue| -> apex::Result<()> {
        // SAFETY: both buffers are SM_BYTES long, mapped on GPU 0, and outlive the synchronize below.
        unsafe { cq.copy_device(src.device_ptr(), dst.device_ptr(), SM_BYTES)? };
        Ok(())
    };
    run(cq)?;
    cq.synchronize()?;
    let t = Instant::now();
    for _ in 0..COPY_REPS {
        run(cq)?;
    }
    cq.synchronize()?;
    Ok(SM_BYTES as f64 * COPY_REPS as f64 / t.elapsed().as_secs_f64() / 1e9)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("APEX_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::stderr)
            .init();
    }
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100);
    let passes: usize = std::env::args()
        .nth(2)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(2);
    let n = Gpu::count()?;
    let gpus = open_all(n, BackendRequest::from_env()?)?;
    for (i, g) in gpus.iter().enumerate() {
        println!(
            "GPU {i}: {} {} ({:?})",
            g.info().name,
            g.uuid()?,
            g.backend()
        );
    }
    if n < 2 {
        println!("one GPU: the ring and the peer figures need two or more");
        return Ok(());
    }
    for i in 1..n {
        let a = gpus[i].peer_access(&gpus[0])?;
        println!("GPU {i} -> GPU 0: {:?}, atomics {}", a.link, a.atomics);
    }
    let per_hop = ring(&gpus, rounds)?;
    println!(
        "ring of {n} GPUs, {rounds} rounds: every element checked; {:.2} us per hop ({:?})",
        per_hop.as_secs_f64() * 1e6,
        gpus[0].backend()
    );
    drop(gpus);

    // Each pass measures both backends in turn, so a figure that changes with time in the process (clocks, the
    // links' state) shows up as a difference between passes rather than between backends.
    let mut failed = None;
    for pass in 1..=passes {
        let mut rows = Vec::new();
        for b in [BackendRequest::Direct, BackendRequest::Driver] {
            let g = open_all(2, b)?;
            let backend = g[0].backend();
            if backend == Backend::Direct {
                println!(
                    "pass {pass}: APEX, the SMs copying 32 MiB 0 -> 1 over the link: {:.1} GB/s",
                    sm_bandwidth(&g)?
                );
            }
            let hop = hop_latency(&g)?;
            // APEX: the source GPU's copy engines; CUDA: cuMemcpyPeerAsync. A failure is reported after the
            // table, so the other backend's figures still print.
            let bw = bandwidth(&g).unwrap_or_else(|e| {
                println!("{backend:?}: copies between GPUs failed: {e}");
                failed = Some(format!("{backend:?} copies between GPUs: {e}"));
                [f64::NAN; 3]
            });
            rows.push((backend, bw, hop));
        }
        println!();
        println!(
            "| GPUs 0, 1 (pass {pass} of {passes}) | 0 -> 1 GB/s | 1 -> 0 GB/s | both at once GB/s | hop latency us |"
        );
        println!("|---|---|---|---|---|");
        for (b, bw, hop) in &rows {
            let name = match b {
                Backend::Direct => "APEX (copy engines, semaphore acquire)",
                Backend::Driver => "CUDA (cuMemcpyPeerAsync, cuStreamWaitEvent)",
            };
            println!(
                "| {name} | {:.1} | {:.1} | {:.1} | {:.2} |",
                bw[0],
                bw[1],
                bw[2],
                hop.as_secs_f64() * 1e6
            );
        }
        if let [(_, a, ah), (_, c, ch)] = rows.as_slice() {
            println!(
                "APEX / CUDA: bandwidth {:.2}x, {:.2}x, {:.2}x; hop latency {:.2}x faster",
                a[0] / c[0],
                a[1] / c[1],
                a[2] / c[2],
                ch.as_secs_f64() / ah.as_secs_f64()
            );
        }
        println!();
    }
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}
