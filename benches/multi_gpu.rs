//! Two GPUs: APEX's direct path beside the CUDA driver (through APEX's driver backend), in one process and one
//! run. Needs two NVIDIA GPUs; with fewer it prints a line saying so and measures nothing.
//!
//! Groups (each measures both paths):
//! - `peer_copy_256mib`: 256 MiB copies between GPUs 0 and 1 (0 -> 1, 1 -> 0, and both at once, each GPU pushing
//!   on its own queue): APEX's copies on the source GPU's copy engines vs `cuMemcpyPeerAsync` with peer access
//!   enabled (CUDA's best path);
//! - `cross_gpu_hop`: an empty kernel on one GPU waiting for the other GPU's last kernel, alternating, per hop:
//!   APEX's semaphore acquire on the other GPU's timeline vs CUDA events (`cuStreamWaitEvent` across devices).

use std::time::{Duration, Instant};

use apex::{BackendRequest, Buffer, Fence, Gpu, Kernel, LaunchConfig, Queue};
use criterion::{Criterion, Throughput};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const BYTES: u64 = 256 << 20;
const T: Duration = Duration::from_secs(60);

/// Two GPUs on one backend: a queue, a source and a destination buffer, and the empty kernel on each.
struct Pair {
    name: &'static str,
    _gpus: [Gpu; 2],
    queues: [Queue; 2],
    src: [Buffer; 2],
    dst: [Buffer; 2],
    empty: [Kernel; 2],
}

fn pair(name: &'static str, request: BackendRequest) -> apex::Result<Pair> {
    let gpus: [Gpu; 2] = Gpu::open_peers(&[0, 1], request)?
        .try_into()
        .map_err(|_| apex::Error::InvalidArgument("open_peers did not open two GPUs".into()))?;
    let src = [gpus[0].alloc(BYTES)?, gpus[1].alloc(BYTES)?];
    let dst = [gpus[0].alloc(BYTES)?, gpus[1].alloc(BYTES)?];
    // Peer access both ways (CUDA's best path: without it cuMemcpyPeer stages through host memory); on the
    // direct path the copies map what they need themselves, so this only does it ahead of time.
    gpus[0].map_peer(&dst[1])?;
    gpus[1].map_peer(&dst[0])?;
    let queues = [gpus[0].queue()?, gpus[1].queue()?];
    let empty = [
        gpus[0].load_module(CUBIN)?.kernel("empty")?,
        gpus[1].load_module(CUBIN)?.kernel("empty")?,
    ];
    let mut p = Pair {
        name,
        _gpus: gpus,
        queues,
        src,
        dst,
        empty,
    };
    // Warm: the first copy each way builds the copy channels (direct path).
    for from in 0..2 {
        p.copy(from)?;
        p.queues[from].synchronize()?;
    }
    Ok(p)
}

impl Pair {
    /// 256 MiB from GPU `from`'s source buffer into the other GPU's destination, on GPU `from`'s queue.
    fn copy(&mut self, from: usize) -> apex::Result<Fence> {
        let to = 1 - from;
        self.queues[from].copy_device_to_device(&self.src[from], 0, &self.dst[to], 0, BYTES)
    }

    fn sync(&mut self) -> apex::Result<()> {
        for q in &mut self.queues {
            q.synchronize()?;
        }
        Ok(())
    }

    /// `iters` copies in the direction(s) of `dirs`, then a wait for all of them.
    fn copies(&mut self, dirs: &[usize], iters: u64) -> Duration {
        let t = Instant::now();
        for _ in 0..iters {
            for &from in dirs {
                self.copy(from).expect("copy between GPUs");
            }
        }
        self.sync().expect("copies complete");
        t.elapsed()
    }

    /// `iters` hops: an empty kernel on GPU `h % 2` waiting, on the GPU, for the previous hop's kernel on the
    /// other GPU; then a wait for the last.
    fn hops(&mut self, iters: u64) -> Duration {
        let cfg = LaunchConfig::linear(1, 32);
        let t = Instant::now();
        let mut last: Option<Fence> = None;
        for h in 0..iters {
            let g = (h % 2) as usize;
            if let Some(f) = &last {
                self.queues[g].wait_for(f).expect("wait for the other GPU");
            }
            // SAFETY: the empty kernel touches no memory.
            last =
                Some(unsafe { self.queues[g].launch(&self.empty[g], &cfg, &[]) }.expect("launch"));
        }
        if let Some(f) = last {
            f.wait(T).expect("last hop completes");
        }
        t.elapsed()
    }
}

fn benches(c: &mut Criterion, pairs: &mut [Pair]) {
    let mut g = c.benchmark_group("peer_copy_256mib");
    for (dir, dirs) in [
        ("0_to_1", &[0usize][..]),
        ("1_to_0", &[1]),
        ("both", &[0, 1]),
    ] {
        g.throughput(Throughput::Bytes(BYTES * dirs.len() as u64));
        for p in pairs.iter_mut() {
            g.bench_function(format!("{}/{dir}", p.name), |b| {
                b.iter_custom(|iters| p.copies(dirs, iters))
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("cross_gpu_hop");
    for p in pairs.iter_mut() {
        g.bench_function(p.name, |b| b.iter_custom(|iters| p.hops(iters)));
    }
    g.finish();
}

fn main() {
    let n = match Gpu::count() {
        Ok(n) => n,
        Err(e) => {
            println!("multi_gpu benchmarks skipped: no NVIDIA GPU or driver: {e}");
            return;
        }
    };
    if n < 2 {
        println!("multi_gpu benchmarks skipped: they need two GPUs and this machine has {n}");
        return;
    }
    // The CUDA driver first: libcuda places its address ranges before APEX reserves its own.
    let mut pairs = Vec::new();
    for (name, request) in [
        ("cuda", BackendRequest::Driver),
        ("apex", BackendRequest::Direct),
    ] {
        match pair(name, request) {
            Ok(p) => pairs.push(p),
            Err(e) => println!("multi_gpu benchmarks: {name} skipped: {e}"),
        }
    }
    if pairs.is_empty() {
        return;
    }
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    benches(&mut c, &mut pairs);
    c.final_summary();
}
