//! Launch-graph benchmarks: APEX's direct-path graph replays beside CUDA graphs of the same kernels, built from
//! the same description, in one process and one run. Needs an NVIDIA GPU with the 580 open kernel module and
//! libcuda; prints a note and measures nothing otherwise (on a machine without a GPU, build it with
//! `cargo bench --bench graph --no-run`).
//!
//! Groups (each measures both paths; times are per kernel for the chain, per replay otherwise):
//! - `graph_chain_1000`: 1000 dependent empty kernels, replay and wait. APEX with each `GraphSchedule` (the GPU's
//!   dependency resolution, the default, and the front end's); cuGraphLaunch of a CUDA graph built node by node
//!   from the same description, and of one captured from a stream;
//! - `graph_diamond`, `graph_fan_out_4`, `graph_fan_out_32`: one root, 2, 4 or 32 empty kernels that depend only
//!   on it, and a join after them; `graph_fan_in_32`: 32 independent empty kernels and a join; replay and wait,
//!   APEX with each `GraphSchedule`;
//! - `graph_update`: a chain of 100 `chain_step` kernels; one node's parameters changed, then replay and wait
//!   (APEX `GraphExec::update_launch` + replay vs `cuGraphExecKernelNodeSetParams` + `cuGraphLaunch`), and the CPU
//!   cost of the update call alone.

use std::hint::black_box;
use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::graph::Graph;
use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, GraphExec, GraphSchedule, LaunchConfig};
use apex::module::{Kernel, Module};
use apex::rm::{GpuCore, Memory, MemoryDesc};
use criterion::{Criterion, criterion_group, criterion_main};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(10);
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);

struct Paths {
    q: ComputeQueue,
    empty: Kernel,
    step: Kernel,
    ctx: std::sync::Arc<driver::Context>,
    stream: driver::Stream,
    cuda_empty: driver::Function,
    cuda_step: driver::Function,
    gpu: std::sync::Arc<GpuCore>,
}

fn setup() -> Option<Paths> {
    // The CUDA driver first: it places its own address ranges at fixed addresses before APEX reserves its own.
    let ctx = match driver::Context::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("graph benchmarks skipped: CUDA driver unavailable: {e}");
            return None;
        }
    };
    let gpu = match GpuCore::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("graph benchmarks skipped: direct path unavailable: {e}");
            return None;
        }
    };
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).ok()?;
    let m = Module::load(&gpu, CUBIN).ok()?;
    let cm = driver::Module::load(&ctx, CUBIN).ok()?;
    Some(Paths {
        q,
        empty: m.kernel("empty").ok()?,
        step: m.kernel("chain_step").ok()?,
        stream: driver::Stream::new(&ctx).ok()?,
        cuda_empty: cm.function("empty").ok()?,
        cuda_step: cm.function("chain_step").ok()?,
        ctx,
        gpu,
    })
}

/// The CUDA graph of `g`'s description: the same kernels (by name), shapes, parameter blocks and edges.
fn cuda_graph(p: &Paths, g: &Graph<Kernel>) -> driver::GraphExec {
    let deps = g.dependencies().expect("dependencies");
    let mut ids = deps.order().to_vec();
    ids.sort_unstable();
    let nodes: Vec<driver::GraphNode<'_>> = g
        .nodes()
        .iter()
        .map(|n| match n.op() {
            apex::launch::graph::Op::Launch {
                kernel,
                cfg,
                params,
            } => driver::GraphNode::Kernel {
                func: if kernel.name() == "empty" {
                    &p.cuda_empty
                } else {
                    &p.cuda_step
                },
                grid: cfg.grid,
                block: cfg.block,
                shared: cfg.shared_bytes,
                cluster: cfg.cluster,
                programmatic: n.is_programmatic(),
                params,
            },
            &apex::launch::graph::Op::Copy { src, dst, bytes } => {
                driver::GraphNode::Copy { src, dst, bytes }
            }
        })
        .collect();
    let preds: Vec<Vec<usize>> = ids
        .iter()
        .map(|&v| deps.preds(v).iter().map(|x| x.index()).collect())
        .collect();
    let order: Vec<usize> = deps.order().iter().map(|v| v.index()).collect();
    driver::GraphExec::build(&p.ctx, &nodes, &preds, &order).expect("CUDA graph")
}

/// 1000 empty kernels, each after the one before (explicit edges: the kernel touches no memory).
fn chain_graph(k: &Kernel) -> Graph<Kernel> {
    let mut g = Graph::new();
    let mut prev = None;
    for _ in 0..1000 {
        let n = g.launch_args(k, ONE, &[]).expect("record");
        if let Some(p) = prev {
            g.edge(p, n).expect("edge");
        }
        prev = Some(n);
    }
    g
}

/// One root, `width` kernels after it, one join after those.
fn fan_out_graph(k: &Kernel, width: usize) -> Graph<Kernel> {
    let mut g = Graph::new();
    let root = g.launch_args(k, ONE, &[]).expect("record");
    let branches: Vec<_> = (0..width)
        .map(|_| g.launch_args(k, ONE, &[]).expect("record"))
        .collect();
    let join = g.launch_args(k, ONE, &[]).expect("record");
    for b in branches {
        g.edge(root, b).expect("edge");
        g.edge(b, join).expect("edge");
    }
    g
}

/// 32 independent kernels, one join after them.
fn fan_in_graph(k: &Kernel) -> Graph<Kernel> {
    let mut g = Graph::new();
    let roots: Vec<_> = (0..32)
        .map(|_| g.launch_args(k, ONE, &[]).expect("record"))
        .collect();
    let join = g.launch_args(k, ONE, &[]).expect("record");
    for r in roots {
        g.edge(r, join).expect("edge");
    }
    g
}

fn replay(q: &mut ComputeQueue, exec: &mut GraphExec) {
    // SAFETY: the graphs' kernels are `empty` (touches nothing) and `chain_step` on the bench's own buffer.
    unsafe { q.replay_graph(exec) }
        .expect("replay")
        .wait(T)
        .expect("wait");
}

fn cuda_replay(p: &mut Paths, exec: &driver::GraphExec) {
    // SAFETY: as in `replay`.
    unsafe { exec.launch(&mut p.stream) }.expect("cuGraphLaunch");
    p.stream.synchronize().expect("sync");
}

fn benches(c: &mut Criterion) {
    let Some(mut p) = setup() else { return };

    // ---- 1000 dependent kernels ----
    let chain = chain_graph(&p.empty);
    let mut exec = p.q.instantiate_graph(&chain).expect("instantiate");
    p.q.set_graph_schedule(GraphSchedule::FrontEnd);
    let mut exec_front = p.q.instantiate_graph(&chain).expect("instantiate");
    p.q.set_graph_schedule(GraphSchedule::Gpu);
    let cuda = cuda_graph(&p, &chain);
    let captured = driver::Graph::capture(&mut p.stream, |s| {
        for _ in 0..1000 {
            // SAFETY: the empty kernel takes no parameters and touches no memory.
            unsafe { s.launch(&p.cuda_empty, [1, 1, 1], [1, 1, 1], 0, &mut [])? };
        }
        Ok(())
    })
    .expect("capturing a CUDA graph");
    let mut g = c.benchmark_group("graph_chain_1000");
    g.bench_function("apex_graph", |b| {
        b.iter_custom(|iters| per_kernel(iters, 1000, || replay(&mut p.q, &mut exec)))
    });
    g.bench_function("apex_graph_front_end", |b| {
        b.iter_custom(|iters| per_kernel(iters, 1000, || replay(&mut p.q, &mut exec_front)))
    });
    g.bench_function("cuGraphLaunch_built", |b| {
        b.iter_custom(|iters| per_kernel(iters, 1000, || cuda_replay(&mut p, &cuda)))
    });
    g.bench_function("cuGraphLaunch_captured", |b| {
        b.iter_custom(|iters| {
            per_kernel(iters, 1000, || {
                captured.launch(&mut p.stream).expect("cuGraphLaunch");
                p.stream.synchronize().expect("sync");
            })
        })
    });
    g.finish();
    drop((exec, exec_front, cuda, captured));

    // ---- fan-outs and fan-ins: each graph with both schedules beside the CUDA graph ----
    for (name, graph) in [
        ("graph_diamond", fan_out_graph(&p.empty, 2)),
        ("graph_fan_out_4", fan_out_graph(&p.empty, 4)),
        ("graph_fan_out_32", fan_out_graph(&p.empty, 32)),
        ("graph_fan_in_32", fan_in_graph(&p.empty)),
    ] {
        let mut exec = p.q.instantiate_graph(&graph).expect("instantiate");
        p.q.set_graph_schedule(GraphSchedule::FrontEnd);
        let mut exec_front = p.q.instantiate_graph(&graph).expect("instantiate");
        p.q.set_graph_schedule(GraphSchedule::Gpu);
        let cuda = cuda_graph(&p, &graph);
        let mut g = c.benchmark_group(name);
        g.bench_function("apex_graph", |b| b.iter(|| replay(&mut p.q, &mut exec)));
        g.bench_function("apex_graph_front_end", |b| {
            b.iter(|| replay(&mut p.q, &mut exec_front))
        });
        g.bench_function("cuGraphLaunch", |b| b.iter(|| cuda_replay(&mut p, &cuda)));
        g.finish();
        drop((exec, exec_front, cuda));
    }

    // ---- update one node, then replay ----
    let v = Memory::alloc(&p.gpu, MemoryDesc::video(8)).expect("buffer");
    let cv = driver::DeviceMemory::alloc(&p.ctx, 8).expect("buffer");
    let mut apex_g = Graph::new();
    let mut cuda_g = Graph::new();
    for (g, va) in [(&mut apex_g, v.va()), (&mut cuda_g, cv.ptr())] {
        let mut prev = None;
        for i in 0..100u64 {
            let n = g
                .launch_args(&p.step, ONE, &[Arg::Ptr(va), Arg::U64(3), Arg::U64(i)])
                .expect("record");
            if let Some(x) = prev {
                g.edge(x, n).expect("edge");
            }
            prev = Some(n);
        }
    }
    let node = apex_g.id(50).expect("node");
    let mut exec = p.q.instantiate_graph(&apex_g).expect("instantiate");
    let mut cuda = cuda_graph(&p, &cuda_g);
    let mut ptrs = driver::ParamPtrs::with_capacity(driver::MAX_PARAMS);
    let mut params = [0u8; 24];
    params[..8].copy_from_slice(&cv.ptr().to_le_bytes());
    params[8..16].copy_from_slice(&3u64.to_le_bytes());
    let mut add = 0u64;
    let mut g = c.benchmark_group("graph_update");
    g.bench_function("apex_update_then_replay", |b| {
        b.iter(|| {
            add += 1;
            exec.update_launch(node, &ONE, &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(add)])
                .expect("update");
            replay(&mut p.q, &mut exec);
        })
    });
    g.bench_function("cuGraphExecKernelNodeSetParams_then_cuGraphLaunch", |b| {
        b.iter(|| {
            add += 1;
            params[16..].copy_from_slice(&add.to_le_bytes());
            cuda.set_kernel(50, &p.cuda_step, ([1; 3], [1; 3], 0), &params, &mut ptrs)
                .expect("cuGraphExecKernelNodeSetParams");
            cuda_replay(&mut p, &cuda);
        })
    });
    // The update call alone (the GPU idle: the replays above completed).
    g.bench_function("apex_update_only", |b| {
        b.iter(|| {
            add += 1;
            exec.update_launch(node, &ONE, &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(add)])
                .expect("update")
        })
    });
    g.bench_function("cuGraphExecKernelNodeSetParams_only", |b| {
        b.iter(|| {
            add += 1;
            params[16..].copy_from_slice(&add.to_le_bytes());
            cuda.set_kernel(50, &p.cuda_step, ([1; 3], [1; 3], 0), &params, &mut ptrs)
                .expect("cuGraphExecKernelNodeSetParams")
        })
    });
    g.finish();
    black_box(&p.q);
}

/// Runs `batch` (a replay of `kernels` kernels, waited for) often enough for `iters` kernels and returns the total
/// time, so criterion reports the time per kernel.
fn per_kernel(iters: u64, kernels: u64, mut batch: impl FnMut()) -> Duration {
    let rounds = iters.div_ceil(kernels).max(1);
    let t = Instant::now();
    for _ in 0..rounds {
        batch();
    }
    t.elapsed()
        .mul_f64(iters as f64 / (rounds * kernels) as f64)
}

criterion_group! {
    name = graph;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(graph);
