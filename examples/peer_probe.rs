//! Probes of the two-GPU direct path (issue 13), one experiment per process so that a stalled channel cannot
//! hold up the next: `peer_probe EXPERIMENT [ARGS]`, printing one `result ...` line per measurement.
//!
//! - `ce-local LCE MIB`: a copy-only channel on LCE `LCE` copying `MIB` MiB within GPU 0 (no peer involved).
//! - `ce-peer LCE MIB write|read`: the same LCE of GPU 0 copying into (write) or out of (read) GPU 1's memory
//!   mapped on GPU 0, both GPUs in one peer domain.
//! - `sm-peer MIB [contig]`: GPU 0's SMs copying into GPU 1's memory mapped on GPU 0.
//! - `sm-peer-offsets MIB`: 1 MiB SM copies at every 16 MiB of a `MIB` MiB peer mapping, each waited alone.
//! - `sm-shared-local MIB`: SMs copying within GPU 0 while GPU 0 shares its VA space with GPU 1.
//! - `queue-after-alloc MIB`: both GPUs in one domain allocate `MIB` MiB each, then open a queue and run an
//!   empty kernel.
//! - `queue-after-copies MIB ce|sm`: one GPU: two `MIB` MiB buffers, a queue that fills one and copies it to the
//!   other (on the copy engines, or the SMs), then a second queue running an empty kernel.
//! - `upload-then-queue MIB`: through the public API, a `MIB` MiB upload (staged through host memory), then more
//!   queues each running an empty kernel.
//! - `caps`: the peer capabilities RM reports, with the optimal copy engines.
//!
//! Each wait has a 10 s limit; a stall prints `result ... stalled` with the error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use apex::launch::{ComputeQueue, ComputeQueueConfig, CopyEngines, LaunchConfig};
use apex::module::Module;
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(10);
type R<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(i: usize) -> Option<String> {
    std::env::args().nth(i)
}

fn mib(i: usize, default: u64) -> u64 {
    arg(i).and_then(|s| s.parse().ok()).unwrap_or(default) << 20
}

fn pair() -> R<(Arc<GpuCore>, Arc<GpuCore>)> {
    Ok((GpuCore::open_peer(0)?, GpuCore::open_peer(1)?))
}

fn video(g: &Arc<GpuCore>, bytes: u64, contiguous: bool) -> R<Memory> {
    let mut d = MemoryDesc::video(bytes);
    d.contiguous = contiguous;
    Ok(Memory::alloc(g, d)?)
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Times `reps` runs of `f` (each returns the fence to wait on); prints the result line.
fn timed(
    what: &str,
    bytes: u64,
    reps: u32,
    mut f: impl FnMut() -> R<apex::pushbuf::Fence>,
) -> R<()> {
    let first = Instant::now();
    match f().and_then(|fence| Ok(fence.wait(T)?)) {
        Ok(()) => println!(
            "result {what} first {:.1} GB/s",
            gbps(bytes, first.elapsed())
        ),
        Err(e) => {
            println!(
                "result {what} stalled on the first copy after {:?}: {e}",
                first.elapsed()
            );
            return Ok(());
        }
    }
    let t = Instant::now();
    let mut last = None;
    for _ in 0..reps {
        last = Some(f()?);
    }
    if let Some(Err(e)) = last.map(|fence| fence.wait(T)) {
        println!("result {what} stalled in the timed runs: {e}");
        return Ok(());
    }
    println!(
        "result {what} {:.1} GB/s over {reps} runs",
        gbps(bytes * u64::from(reps), t.elapsed())
    );
    Ok(())
}

fn ce(lce: u32, bytes: u64, peer: Option<&str>) -> R<()> {
    let (g0, g1) = if peer.is_some() {
        pair()?
    } else {
        let g = GpuCore::open(0)?;
        (g.clone(), g)
    };
    let mut engines = CopyEngines::new(&g0, 1 << lce)?;
    let mut q = ComputeQueue::new(&g0, ComputeQueueConfig::default())?;
    let local = video(&g0, bytes, false)?;
    let (src, dst, name) = match peer {
        None => (
            video(&g0, bytes, false)?,
            local,
            format!("ce-local lce{lce}"),
        ),
        Some(dir) => {
            let remote = video(&g1, bytes, false)?;
            remote.map_on(&g0)?;
            if dir == "read" {
                (remote, local, format!("ce-peer-read lce{lce}"))
            } else {
                (local, remote, format!("ce-peer-write lce{lce}"))
            }
        }
    };
    let name = format!("{name} {} MiB", bytes >> 20);
    timed(&name, bytes, 5, || {
        Ok(q.copy_on(&mut engines, src.va(), dst.va(), bytes)?)
    })
}

fn sm_peer(bytes: u64, contiguous: bool) -> R<()> {
    let (g0, g1) = pair()?;
    let src = video(&g0, bytes, false)?;
    let dst = video(&g1, bytes, contiguous)?;
    dst.map_on(&g0)?;
    let mut q = ComputeQueue::new(&g0, ComputeQueueConfig::default())?;
    let name = format!(
        "sm-peer {} MiB{}",
        bytes >> 20,
        if contiguous { " contiguous" } else { "" }
    );
    // SAFETY: both ranges are `bytes` long, mapped on GPU 0, and live until the waits end.
    timed(&name, bytes, 5, || unsafe {
        Ok(q.copy_device(src.va(), dst.va(), bytes)?)
    })
}

fn sm_peer_offsets(bytes: u64) -> R<()> {
    let (g0, g1) = pair()?;
    let src = video(&g0, 1 << 20, false)?;
    let dst = video(&g1, bytes, false)?;
    dst.map_on(&g0)?;
    let mut q = ComputeQueue::new(&g0, ComputeQueueConfig::default())?;
    let mut off = 0;
    while off < bytes {
        let t = Instant::now();
        // SAFETY: 1 MiB inside both buffers, mapped on GPU 0.
        let r = unsafe { q.copy_device(src.va(), dst.va() + off, 1 << 20) }
            .map_err(|e| e.to_string())
            .and_then(|f| f.wait(Duration::from_secs(3)).map_err(|e| e.to_string()));
        match r {
            Ok(()) => println!("result offset {} MiB ok in {:?}", off >> 20, t.elapsed()),
            Err(e) => {
                println!("result offset {} MiB stalled: {e}", off >> 20);
                return Ok(());
            }
        }
        off += 16 << 20;
    }
    Ok(())
}

fn sm_shared_local(bytes: u64) -> R<()> {
    let (g0, _g1) = pair()?;
    let src = video(&g0, bytes, false)?;
    let dst = video(&g0, bytes, false)?;
    let mut q = ComputeQueue::new(&g0, ComputeQueueConfig::default())?;
    let name = format!("sm-shared-local {} MiB", bytes >> 20);
    // SAFETY: both ranges are `bytes` long on GPU 0 and live until the waits end.
    timed(&name, bytes, 5, || unsafe {
        Ok(q.copy_device(src.va(), dst.va(), bytes)?)
    })
}

fn queue_after_alloc(bytes: u64) -> R<()> {
    let (g0, g1) = pair()?;
    let _a = video(&g0, bytes, false)?;
    let _b = video(&g1, bytes, false)?;
    for (i, g) in [&g0, &g1].into_iter().enumerate() {
        let t = Instant::now();
        let mut q = ComputeQueue::new(g, ComputeQueueConfig::default())?;
        let k = Module::load(g, CUBIN)?.kernel("empty")?;
        // SAFETY: the empty kernel touches no memory.
        let r = unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[]) }
            .map_err(|e| e.to_string())
            .and_then(|f| f.wait(T).map_err(|e| e.to_string()));
        match r {
            Ok(()) => println!("result queue-after-alloc gpu{i} ok in {:?}", t.elapsed()),
            Err(e) => println!("result queue-after-alloc gpu{i} stalled: {e}"),
        }
    }
    Ok(())
}

fn queue_after_copies(bytes: u64, engines: bool) -> R<()> {
    let g = GpuCore::open(0)?;
    let (a, b) = (video(&g, bytes, false)?, video(&g, bytes, false)?);
    let mut q = ComputeQueue::new(&g, ComputeQueueConfig::default())?;
    q.copy(a.va(), b.va(), 4096)?.wait(T)?;
    let t = Instant::now();
    if engines {
        let mut e = CopyEngines::for_peer(&g, &g)?;
        for _ in 0..4 {
            q.copy_on(&mut e, a.va(), b.va(), bytes)?;
        }
        q.synchronize()?;
        println!(
            "result copies on LCEs {:?} in {:?}",
            e.lces().collect::<Vec<_>>(),
            t.elapsed()
        );
    } else {
        for _ in 0..4 {
            // SAFETY: both buffers are `bytes` long on this GPU.
            unsafe { q.copy_device(a.va(), b.va(), bytes)? };
        }
        q.synchronize()?;
        println!("result SM copies in {:?}", t.elapsed());
    }
    for i in 2..5 {
        let t = Instant::now();
        let r = ComputeQueue::new(&g, ComputeQueueConfig::default())
            .map_err(|e| e.to_string())
            .and_then(|mut q2| {
                let k = Module::load(&g, CUBIN)
                    .and_then(|m| m.kernel("empty"))
                    .map_err(|e| e.to_string())?;
                // SAFETY: the empty kernel touches no memory.
                unsafe { q2.launch(&k, &LaunchConfig::linear(1, 32), &[]) }
                    .map_err(|e| e.to_string())?
                    .wait(T)
                    .map_err(|e| e.to_string())
            });
        match r {
            Ok(()) => println!("result queue {i} ok in {:?}", t.elapsed()),
            Err(e) => println!("result queue {i} failed after {:?}: {e}", t.elapsed()),
        }
    }
    Ok(())
}

fn upload_then_queue(bytes: u64) -> R<()> {
    let gpu = apex::Gpu::open_with(0, apex::BackendRequest::Direct)?;
    let a = gpu.alloc(bytes)?;
    let mut q = gpu.queue()?;
    let t = Instant::now();
    q.upload(&gpu, &a, 0, &vec![7u8; bytes as usize])?;
    println!("result upload of {} MiB in {:?}", bytes >> 20, t.elapsed());
    let k = gpu.load_module(CUBIN)?.kernel("empty")?;
    for i in 2..5 {
        let t = Instant::now();
        let r = gpu.queue().and_then(|mut q2| {
            // SAFETY: the empty kernel touches no memory.
            unsafe { q2.launch(&k, &LaunchConfig::linear(1, 32), &[]) }?.wait(T)
        });
        match r {
            Ok(()) => println!("result queue {i} ok in {:?}", t.elapsed()),
            Err(e) => println!("result queue {i} failed after {:?}: {e}", t.elapsed()),
        }
    }
    Ok(())
}

fn caps() -> R<()> {
    let (g0, g1) = pair()?;
    println!("result caps 0->1 {:?}", g0.peer_caps(&g1)?);
    println!("result caps 1->0 {:?}", g1.peer_caps(&g0)?);
    for (i, g) in [&g0, &g1].into_iter().enumerate() {
        let present = g.copy_engines_present()?;
        for lce in (0..20).filter(|l| present & (1 << l) != 0) {
            println!(
                "result gpu {i} lce {lce} pces {:#x}",
                g.copy_engine_pces(lce)?
            );
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    if std::env::var_os("APEX_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::stderr)
            .init();
    }
    let lce = || arg(2).and_then(|s| s.parse().ok()).unwrap_or(0u32);
    let r = match arg(1).as_deref() {
        Some("ce-local") => ce(lce(), mib(3, 256), None),
        Some("ce-peer") => ce(lce(), mib(3, 256), Some(arg(4).as_deref().unwrap_or("write"))),
        Some("sm-peer") => sm_peer(mib(2, 256), arg(3).as_deref() == Some("contig")),
        Some("sm-peer-offsets") => sm_peer_offsets(mib(2, 256)),
        Some("sm-shared-local") => sm_shared_local(mib(2, 256)),
        Some("queue-after-alloc") => queue_after_alloc(mib(2, 256)),
        Some("queue-after-copies") => queue_after_copies(mib(2, 256), arg(3).as_deref() != Some("sm")),
        Some("upload-then-queue") => upload_then_queue(mib(2, 256)),
        Some("caps") => caps(),
        _ => Err("usage: peer_probe ce-local|ce-peer|sm-peer|sm-peer-offsets|sm-shared-local|queue-after-alloc|caps ...".into()),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("result error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
