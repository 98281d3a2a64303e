//! Module variables, thread block clusters and driver-backend parity on a GPU, on both backends (run with
//! `--include-ignored` on an NVIDIA GPU with libcuda):
//!
//! - `__device__` and `__constant__` variables read with their initial values, written through a queue and seen by
//!   later launches (on the same queue and on another one), written by a kernel and read back;
//! - `__cluster_dims__` and run-time cluster shapes running as real clusters (distributed shared memory and
//!   `cluster.sync()` give every block a value only a real cluster produces), refusals before submission;
//! - the driver backend: 200 KiB of dynamic shared memory, parameter errors that name the kernel, a trap that
//!   kills the context reported as such, and the GPU opened again in the same process.

use std::time::Duration;

use apex::{Arg, Backend, BackendRequest, Buffer, Gpu, LaunchConfig, Queue};

#[path = "support/gpu.rs"]
mod support_gpu;

const MODULE_DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");
const CLUSTER: &[u8] = include_bytes!("../kernels/conformance/cluster.sm_90.cubin");
const TEST_CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const TEST_PTX: &[u8] = include_bytes!("../kernels/apex_test_kernels.ptx");
const T: Duration = Duration::from_secs(20);

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn ints(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

fn int_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read(q: &mut Queue, g: &Gpu, buf: &Buffer, n: usize) -> Vec<i32> {
    let mut out = vec![0u8; n * 4];
    q.download(g, buf, 0, &mut out).unwrap();
    ints(&out)
}

/// Runs `combo` (out = [sum of table, dev_value, *dev_ptr]) and returns its output.
fn combo(q: &mut Queue, g: &Gpu, k: &apex::Kernel, out: &Buffer) -> Vec<i32> {
    q.upload(g, out, 0, &[0xff; 12]).unwrap();
    // SAFETY: `out` holds the 3 ints the kernel writes.
    let f = unsafe { q.launch(k, &LaunchConfig::linear(1, 1), &[out.arg()]) }.unwrap();
    f.wait(T).unwrap();
    read(q, g, out, 3)
}

fn globals_read_initialized(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(MODULE_DATA).unwrap();
    let out = g.alloc(64).unwrap();
    let k = m.kernel("combo").unwrap();
    assert_eq!(combo(&mut q, &g, &k, &out), [110, 1234, 1234]);

    let table = m.global("table").unwrap();
    assert_eq!((table.name(), table.size()), ("table", 16));
    let mut b16 = [0u8; 16];
    q.copy_from_global(&g, &table, 0, &mut b16).unwrap();
    assert_eq!(ints(&b16), [11, 22, 33, 44]);
    let mut b4 = [0u8; 4];
    q.copy_from_global(&g, &table, 8, &mut b4).unwrap();
    assert_eq!(ints(&b4), [33], "at an offset");
    let dev_value = m.global("dev_value").unwrap();
    q.copy_from_global(&g, &dev_value, 0, &mut b4).unwrap();
    assert_eq!(ints(&b4), [1234]);
    let dev_array = m.global("dev_array").unwrap();
    let mut b20 = [0u8; 20];
    q.copy_from_global(&g, &dev_array, 0, &mut b20).unwrap();
    assert_eq!(ints(&b20), [5, 4, 3, 2, 1]);
    // dev_ptr holds dev_value's address: the address the module reports is the one its code uses.
    let dev_ptr = m.global("dev_ptr").unwrap();
    let mut b8 = [0u8; 8];
    q.copy_from_global(&g, &dev_ptr, 0, &mut b8).unwrap();
    assert_eq!(u64::from_le_bytes(b8), dev_value.device_ptr());

    // Pinned, asynchronous form.
    let host = g.alloc_host(64).unwrap();
    let f = q.copy_global_to_host(&dev_array, 4, &host, 0, 8).unwrap();
    f.wait(T).unwrap();
    let mut b = [0u8; 8];
    host.read(0, &mut b).unwrap();
    assert_eq!(ints(&b), [4, 3]);
}

fn constant_writes_reach_later_launches(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(MODULE_DATA).unwrap();
    let k = m.kernel("combo").unwrap();
    let out = g.alloc(64).unwrap();
    let table = m.global("table").unwrap();
    assert_eq!(combo(&mut q, &g, &k, &out)[0], 110, "cached once");

    // A write after a launch that read the table: the next launch reads the new values.
    q.copy_to_global(&g, &table, 0, &int_bytes(&[1, 2, 3, 4]))
        .unwrap();
    assert_eq!(combo(&mut q, &g, &k, &out)[0], 10);
    q.copy_to_global(&g, &table, 8, &int_bytes(&[100])).unwrap();
    assert_eq!(combo(&mut q, &g, &k, &out)[0], 107, "a write at an offset");

    // In stream order without waiting: launch, copy (pinned, asynchronous), launch, all queued before any wait.
    let host = g.alloc_host(16).unwrap();
    host.write(0, &int_bytes(&[1000, 0, 0, 0])).unwrap();
    let (a, c) = (g.alloc(16).unwrap(), g.alloc(16).unwrap());
    // SAFETY: each output buffer holds the 3 ints combo writes.
    unsafe {
        q.launch(&k, &LaunchConfig::linear(1, 1), &[a.arg()])
            .unwrap();
        q.copy_host_to_global(&host, 0, &table, 0, 16).unwrap();
        q.launch(&k, &LaunchConfig::linear(1, 1), &[c.arg()])
            .unwrap();
    }
    q.synchronize().unwrap();
    assert_eq!(read(&mut q, &g, &a, 1), [107], "the launch before the copy");
    assert_eq!(read(&mut q, &g, &c, 1), [1000], "the launch after the copy");

    // Another queue sees a write once it has completed.
    q.copy_to_global(&g, &table, 0, &int_bytes(&[7, 7, 7, 7]))
        .unwrap();
    let mut q2 = g.queue().unwrap();
    assert_eq!(combo(&mut q2, &g, &k, &out)[0], 28);

    // A __device__ variable written by a kernel, read back through the queue.
    let bump = m.kernel("bump").unwrap();
    let dev_value = m.global("dev_value").unwrap();
    // SAFETY: bump writes only the module's own variables.
    unsafe { q.launch(&bump, &LaunchConfig::linear(1, 1), &[Arg::I32(5)]) }.unwrap();
    let mut b4 = [0u8; 4];
    q.copy_from_global(&g, &dev_value, 0, &mut b4).unwrap();
    assert_eq!(ints(&b4), [1239]);
    q.copy_to_global(&g, &dev_value, 0, &int_bytes(&[-1]))
        .unwrap();
    assert_eq!(combo(&mut q, &g, &k, &out)[1..], [-1, -1]);

    // Refusals: outside the variable, a name the module does not have.
    let e = q
        .copy_to_global(&g, &table, 12, &[0u8; 8])
        .unwrap_err()
        .to_string();
    assert!(e.contains("table") && e.contains("16"), "{e}");
    let e = m.global("no_such_variable").unwrap_err().to_string();
    assert!(
        e.contains("no_such_variable") && e.contains("dev_value"),
        "{e}"
    );
}

/// What cluster_body writes for block (x, y, z) of `grid` in clusters of `c`.
fn cluster_expected(grid: [u32; 3], c: [u32; 3]) -> Vec<i32> {
    let mut out = vec![0; (grid[0] * grid[1] * grid[2]) as usize];
    for z in 0..grid[2] {
        for y in 0..grid[1] {
            for x in 0..grid[0] {
                let rank = x % c[0] + (y % c[1]) * c[0] + (z % c[2]) * c[0] * c[1];
                let size = c[0] * c[1] * c[2];
                let lin = x + grid[0] * (y + grid[1] * z);
                out[lin as usize] = (size * 1000 + size * (size + 1) / 2 + 100 * rank) as i32;
            }
        }
    }
    out
}

fn clusters(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CLUSTER).unwrap();
    let fixed = m.kernel("cluster_fixed").unwrap();
    let runtime = m.kernel("cluster_runtime").unwrap();
    let out = g.alloc(4096).unwrap();
    let run = |q: &mut Queue, k: &apex::Kernel, cfg: LaunchConfig| -> Vec<i32> {
        let n = (cfg.grid[0] * cfg.grid[1] * cfg.grid[2]) as usize;
        q.upload(&g, &out, 0, &vec![0u8; n * 4]).unwrap();
        // SAFETY: `out` holds one int per block.
        let f = unsafe { q.launch(k, &cfg, &[out.arg()]) }.unwrap();
        f.wait(T).unwrap();
        read(q, &g, &out, n)
    };
    // The CUDA run of probes/cluster_launch.cu printed these.
    let got = run(&mut q, &fixed, LaunchConfig::linear(8, 32));
    assert_eq!(
        got,
        [2003, 2103, 2003, 2103, 2003, 2103, 2003, 2103],
        "{b:?}"
    );
    let got = run(
        &mut q,
        &runtime,
        LaunchConfig::linear(12, 64).with_cluster([4, 1, 1]),
    );
    assert_eq!(
        got,
        [
            4010, 4110, 4210, 4310, 4010, 4110, 4210, 4310, 4010, 4110, 4210, 4310
        ],
        "{b:?}"
    );
    // Without a cluster, cluster.sync() is a block barrier and each block is its own cluster.
    assert_eq!(
        run(&mut q, &runtime, LaunchConfig::linear(6, 64)),
        [1001; 6],
        "{b:?}"
    );
    // The compile-time shape given again at launch, larger grids, 3-D shapes, 8 blocks.
    let cfg = LaunchConfig::linear(64, 32).with_cluster([2, 1, 1]);
    assert_eq!(
        run(&mut q, &fixed, cfg),
        cluster_expected(cfg.grid, [2, 1, 1])
    );
    for (grid, c) in [
        ([4, 6, 2], [2, 3, 1]),
        ([8, 4, 4], [2, 2, 2]),
        ([264, 1, 1], [8, 1, 1]),
        ([2, 8, 3], [1, 8, 1]),
    ] {
        let cfg = LaunchConfig::linear(1, 128).with_cluster(c).with_grid(grid);
        assert_eq!(
            run(&mut q, &runtime, cfg),
            cluster_expected(grid, c),
            "{b:?} {grid:?} in {c:?}"
        );
    }
    // Every cluster scheduling policy and memory sync domain runs the same clusters (NCCL launches "spread" in
    // domain 1); the policy places them, the domain scopes fences.
    for policy in [
        apex::ClusterPolicy::Default,
        apex::ClusterPolicy::Spread,
        apex::ClusterPolicy::LoadBalancing,
    ] {
        for domain in 0..4 {
            let cfg = LaunchConfig::linear(24, 64)
                .with_cluster([4, 1, 1])
                .with_cluster_policy(policy)
                .with_sync_domain(domain);
            assert_eq!(
                run(&mut q, &runtime, cfg),
                cluster_expected(cfg.grid, [4, 1, 1]),
                "{b:?} {policy:?} domain {domain}"
            );
        }
    }

    // Refused with a typed error before anything is submitted; the queue keeps working.
    for (k, cfg) in [
        (&fixed, LaunchConfig::linear(7, 32)),
        (
            &runtime,
            LaunchConfig::linear(7, 32).with_cluster([2, 1, 1]),
        ),
        (&fixed, LaunchConfig::linear(8, 32).with_cluster([4, 1, 1])),
        (
            &runtime,
            LaunchConfig::linear(16, 32).with_cluster([16, 1, 1]),
        ),
    ] {
        // SAFETY: refused before launch.
        let e = unsafe { q.launch(k, &cfg, &[out.arg()]) }.unwrap_err();
        assert!(
            matches!(
                e,
                apex::Error::Direct(apex::launch::Error::InvalidLaunch { .. })
            ),
            "{b:?} {cfg:?}: {e}"
        );
    }
    assert_eq!(
        run(&mut q, &fixed, LaunchConfig::linear(8, 32))[..2],
        [2003, 2103]
    );
    q.synchronize().unwrap();
}

fn dynamic_shared_200k(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let k = g
        .load_module(TEST_CUBIN)
        .unwrap()
        .kernel("dyn_shared")
        .unwrap();
    let out = g.alloc(4).unwrap();
    for dynamic in [200u32 << 10, 4 << 10, 200 << 10, 210 << 10] {
        let words = dynamic / 4;
        q.upload(&g, &out, 0, &[0; 4]).unwrap();
        let cfg = LaunchConfig::linear(4, 256).with_shared_bytes(dynamic);
        // SAFETY: `out` is the one word the kernel adds to.
        let f = unsafe { q.launch(&k, &cfg, &[out.arg(), Arg::U32(words)]) }.unwrap();
        f.wait(T).unwrap();
        let per_block =
            (0..words).fold(0u32, |s, i| s.wrapping_add(i.wrapping_mul(2654435761) ^ i));
        assert_eq!(
            read(&mut q, &g, &out, 1)[0] as u32,
            per_block.wrapping_mul(4),
            "{b:?}: {dynamic} bytes of dynamic shared memory"
        );
    }
}

macro_rules! both {
    ($($name:ident),*) => {
        mod direct { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Direct) } )* }
        mod driver { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Driver) } )* }
    };
}
both!(
    globals_read_initialized,
    constant_writes_reach_later_launches,
    clusters,
    dynamic_shared_200k
);

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn driver_parameter_errors_name_the_kernel() {
    let g = gpu(Backend::Driver);
    let mut q = g.queue().unwrap();
    // PTX: the driver compiles it, APEX has no cubin attributes, the name comes from the lookup.
    let k = g
        .load_module(TEST_PTX)
        .unwrap()
        .kernel("dyn_shared")
        .unwrap();
    assert!(k.info().is_none());
    // SAFETY: refused before launch (one argument of two).
    let e = unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[Arg::U32(1)]) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("dyn_shared"), "{e}");
    // SAFETY: refused before launch (a 4-byte pointer).
    let e = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 32),
            &[Arg::U32(0), Arg::U32(1)],
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("dyn_shared"), "{e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn driver_trap_kills_the_context_and_the_gpu_stays_usable() {
    let lost = |e: &apex::Error| matches!(e, apex::Error::Driver(d) if d.is_context_lost());
    {
        let g = gpu(Backend::Driver);
        let mut q = g.queue().unwrap();
        let k = g.load_module(TEST_CUBIN).unwrap().kernel("trap").unwrap();
        // SAFETY: the kernel only traps.
        let waited =
            unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[]) }.and_then(|f| f.wait(T));
        let e = waited.unwrap_err();
        eprintln!("trap on the driver backend: {e}");
        assert!(lost(&e), "a typed context-lost error: {e}");
        assert!(e.to_string().contains("open the GPU again"), "{e}");
        let e = q.synchronize().unwrap_err();
        assert!(lost(&e), "{e}");
        let e = g.queue().unwrap_err();
        assert!(lost(&e), "a new queue on the dead context: {e}");
        // Everything made from the dead GPU is dropped here.
    }
    // libcuda refuses this process a new context after CUDA_ERROR_LAUNCH_FAILED (measured on 580.159.04, see
    // probes/sticky_reset.cu): opening the driver backend again is a typed error that says so.
    match Gpu::open_with(0, BackendRequest::Driver) {
        Err(apex::Error::NoBackend { driver, .. }) => {
            eprintln!("driver backend reopened: {driver}");
            assert!(driver.is_process_lost(), "{driver}");
            assert!(driver.to_string().contains("new process"), "{driver}");
        }
        Err(e) => panic!("unexpected error reopening the driver backend: {e}"),
        // A libcuda that allows it: the reopened GPU must work.
        Ok(g) => run_chain_step(&g),
    }
    // The direct path does not depend on libcuda: the same process keeps using the GPU.
    for _ in 0..2 {
        run_chain_step(&gpu(Backend::Direct));
    }
}

fn run_chain_step(g: &Gpu) {
    let mut q = g.queue().expect("a queue on the reopened GPU");
    let k = g
        .load_module(TEST_CUBIN)
        .unwrap()
        .kernel("chain_step")
        .unwrap();
    let v = g.alloc(8).unwrap();
    q.upload(g, &v, 0, &10u64.to_le_bytes()).unwrap();
    // SAFETY: the 8 bytes the kernel touches.
    let f = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 1),
            &[v.arg(), Arg::U64(3), Arg::U64(4)],
        )
    }
    .unwrap();
    f.wait(T).unwrap();
    let mut b = [0u8; 8];
    q.download(g, &v, 0, &mut b).unwrap();
    assert_eq!(
        u64::from_le_bytes(b),
        34,
        "{:?} after the trap",
        g.backend()
    );
}
