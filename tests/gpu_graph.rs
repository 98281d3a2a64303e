//! Launch graphs on a real GPU, both backends from the same test bodies, results checked element by element
//! against the CPU; and replays (and updates) on the direct path that allocate nothing. Run with
//! `--include-ignored --test-threads=1` on an NVIDIA GPU with libcuda.

use std::time::Duration;

use apex::{Arg, Backend, Buffer, Gpu, Graph, LaunchConfig, LaunchMemory, Queue, QueueOptions};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

#[path = "support/gpu.rs"]
mod support_gpu;

// ---- helpers ----------------------------------------------------------------------------------------------

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn upload(g: &Gpu, q: &mut Queue, v: &[f32]) -> Buffer {
    let b = g.alloc(v.len() as u64 * 4).unwrap();
    q.upload(g, &b, 0, &f32s(v)).unwrap();
    b
}

fn download(g: &Gpu, q: &mut Queue, b: &Buffer) -> Vec<f32> {
    let mut out = vec![0u8; b.size() as usize];
    q.download(g, b, 0, &mut out).unwrap();
    out.chunks_exact(4)
        .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

fn read_u64(g: &Gpu, q: &mut Queue, b: &Buffer) -> u64 {
    let mut out = [0u8; 8];
    q.download(g, b, 0, &mut out).unwrap();
    u64::from_le_bytes(out)
}

fn check(b: Backend, what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{b:?} {what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{b:?} {what}[{i}]");
    }
}

fn noise(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
        .map(|v| v as f32 * 0.25 - 100.0)
        .collect()
}

// ---- test bodies ------------------------------------------------------------------------------------------

/// z = x + y; w += 2z; u += 3z; out = w + u; zc = copy of z. Replayed three times: w and u accumulate.
fn diamond(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (add, saxpy) = (m.kernel("vector_add").unwrap(), m.kernel("saxpy").unwrap());
    let n = 1usize << 20;
    let (xs, ys) = (noise(n, 1), noise(n, 2));
    let (mut ws, mut us) = (noise(n, 3), noise(n, 4));
    let x = upload(&g, &mut q, &xs);
    let y = upload(&g, &mut q, &ys);
    let z = upload(&g, &mut q, &vec![0.0; n]);
    let w = upload(&g, &mut q, &ws);
    let u = upload(&g, &mut q, &us);
    let out = upload(&g, &mut q, &vec![-1.0; n]);
    let zc = upload(&g, &mut q, &vec![-1.0; n]);
    let cfg = LaunchConfig::linear((n / 256) as u32, 256);
    let nn = Arg::U32(n as u32);
    let mut gr = Graph::new();
    gr.launch(&add, cfg, &[x.arg(), y.arg(), z.arg(), nn])
        .unwrap()
        .reads(&x)
        .reads(&y)
        .writes(&z);
    gr.launch(&saxpy, cfg, &[Arg::F32(2.0), z.arg(), w.arg(), nn])
        .unwrap()
        .reads(&z)
        .reads(&w)
        .writes(&w);
    gr.launch(&saxpy, cfg, &[Arg::F32(3.0), z.arg(), u.arg(), nn])
        .unwrap()
        .reads(&z)
        .reads(&u)
        .writes(&u);
    gr.launch(&add, cfg, &[w.arg(), u.arg(), out.arg(), nn])
        .unwrap()
        .reads(&w)
        .reads(&u)
        .writes(&out);
    gr.copy(&z, &zc).unwrap();
    let mut exec = q.instantiate(&gr).unwrap();
    let zs: Vec<f32> = xs.iter().zip(&ys).map(|(a, c)| a + c).collect();
    for round in 0..3 {
        // SAFETY: every node's buffers are declared and hold n floats.
        unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
        for i in 0..n {
            // saxpy compiles to one fused multiply-add (FFMA in the cubin's SASS).
            ws[i] = 2.0f32.mul_add(zs[i], ws[i]);
            us[i] = 3.0f32.mul_add(zs[i], us[i]);
        }
        let outs: Vec<f32> = ws.iter().zip(&us).map(|(a, c)| a + c).collect();
        check(
            b,
            &format!("round {round} out"),
            &download(&g, &mut q, &out),
            &outs,
        );
        check(
            b,
            &format!("round {round} w"),
            &download(&g, &mut q, &w),
            &ws,
        );
        check(
            b,
            &format!("round {round} copy"),
            &download(&g, &mut q, &zc),
            &zs,
        );
    }
}

/// A root, `width` (a power of two) branches after it, and a tree of pairwise sums joining them.
fn fan_out(b: Backend, width: usize) {
    const REPLAYS: usize = 3;
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (add, saxpy) = (m.kernel("vector_add").unwrap(), m.kernel("saxpy").unwrap());
    let n = 1usize << 16;
    let cfg = LaunchConfig::linear((n / 256) as u32, 256);
    let nn = Arg::U32(n as u32);
    let xs = noise(n, 9);
    let x = upload(&g, &mut q, &xs);
    let src = upload(&g, &mut q, &vec![0.0; n]);
    let mut gr = Graph::new();
    // The root accumulates: src = x + src, a new value every replay, so a branch that ran before its replay's root
    // (an early send or schedule) would read the previous replay's src and be caught.
    gr.launch(&saxpy, cfg, &[Arg::F32(1.0), x.arg(), src.arg(), nn])
        .unwrap()
        .reads(&x)
        .reads(&src)
        .writes(&src);
    let mut level: Vec<(Buffer, Vec<f32>)> = Vec::new();
    // src after each replay.
    let srcs: Vec<Vec<f32>> = (1..=REPLAYS)
        .scan(vec![0.0f32; n], |s, _| {
            for (v, x) in s.iter_mut().zip(&xs) {
                *v = 1.0f32.mul_add(*x, *v);
            }
            Some(s.clone())
        })
        .collect();
    for k in 0..width as u32 {
        let init = noise(n, 100 + k);
        let o = upload(&g, &mut q, &init);
        let f = k as f32 + 1.0;
        gr.launch(&saxpy, cfg, &[Arg::F32(f), src.arg(), o.arg(), nn])
            .unwrap()
            .reads(&src)
            .reads(&o)
            .writes(&o);
        // Every replay adds f · (that replay's src).
        let want: Vec<f32> = (0..n)
            .map(|e| srcs.iter().fold(init[e], |o, s| f.mul_add(s[e], o)))
            .collect();
        level.push((o, want));
    }
    while level.len() > 1 {
        let mut next = Vec::new();
        for pair in level.chunks(2) {
            let (l, r) = (&pair[0], &pair[1]);
            let s = upload(&g, &mut q, &vec![0.0; n]);
            gr.launch(&add, cfg, &[l.0.arg(), r.0.arg(), s.arg(), nn])
                .unwrap()
                .reads(&l.0)
                .reads(&r.0)
                .writes(&s);
            let want: Vec<f32> = l.1.iter().zip(&r.1).map(|(a, c)| a + c).collect();
            next.push((s, want));
        }
        level = next;
    }
    let deps = gr.dependencies().unwrap();
    assert_eq!(
        deps.edges().len(),
        width + 2 * (width - 1),
        "root → branches, and the join tree"
    );
    let mut exec = q.instantiate(&gr).unwrap();
    if let Some(d) = exec.direct() {
        let st = d.stats();
        if width <= apex::launch::GraphExec::MAX_GPU_FAN_OUT {
            // Only the root is sent: null grids spread it to the branches, the join tree counts down.
            assert_eq!(
                (st.heads, st.links, st.nulls),
                (1, 2 * width - 1, width - 2)
            );
        } else {
            // The root and, once it has completed, its branches are sent (wider than the work distributor
            // takes); the join tree counts down on the GPU.
            assert_eq!((st.heads, st.links, st.nulls), (1 + width, width - 1, 0));
        }
    }
    // Replayed several times: after the first, every QMD runs as it re-armed itself.
    for _ in 0..REPLAYS {
        // SAFETY: every node's buffers are declared and hold n floats.
        unsafe { q.replay(&mut exec) }.unwrap();
    }
    q.synchronize().unwrap();
    let (total, want) = &level[0];
    check(b, "sum of the branches", &download(&g, &mut q, total), want);
}

/// 1000 chain steps on one value, replayed five times; with ordinary launches before, between and after.
fn chain_1000(b: Backend) {
    chain_1000_with(b, QueueOptions::default());
}

fn chain_1000_with(b: Backend, options: QueueOptions) {
    let g = gpu(b);
    let mut q = g.queue_with(options).unwrap();
    let step = g.load_module(CUBIN).unwrap().kernel("chain_step").unwrap();
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &3u64.to_le_bytes()).unwrap();
    let one = LaunchConfig::linear(1, 1);
    let mut gr = Graph::new();
    let mut steps = Vec::new();
    for i in 0..1000u64 {
        let (mul, add) = (3 + i % 7, i * 13 + 1);
        steps.push((mul, add));
        gr.launch(&step, one, &[v.arg(), Arg::U64(mul), Arg::U64(add)])
            .unwrap()
            .reads(&v)
            .writes(&v);
    }
    let mut exec = q.instantiate(&gr).unwrap();
    if let Some(d) = exec.direct() {
        assert_eq!((d.stats().heads, d.stats().links), (1, 999));
    }
    let mut want = 3u64;
    let run = |want: &mut u64| {
        for &(mul, add) in &steps {
            *want = want.wrapping_mul(mul).wrapping_add(add);
        }
    };
    for round in 0..5u64 {
        // An ordinary launch before each replay, not waited for: the replay must start after it.
        // SAFETY: an 8-byte buffer, all the kernel touches.
        unsafe { q.launch(&step, &one, &[v.arg(), Arg::U64(5), Arg::U64(round)]) }.unwrap();
        want = want.wrapping_mul(5).wrapping_add(round);
        // SAFETY: as above.
        unsafe { q.replay(&mut exec) }.unwrap();
        run(&mut want);
    }
    // And one after, which must wait for the last replay.
    // SAFETY: as above.
    let f = unsafe { q.launch(&step, &one, &[v.arg(), Arg::U64(7), Arg::U64(1)]) }.unwrap();
    want = want.wrapping_mul(7).wrapping_add(1);
    f.wait(T).unwrap();
    assert_eq!(read_u64(&g, &mut q, &v), want, "{b:?}");
}

/// Updates between replays: a new factor and grid for a saxpy, new constants for a chain step.
fn update(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (saxpy, step) = (m.kernel("saxpy").unwrap(), m.kernel("chain_step").unwrap());
    let n = 1usize << 16;
    let xs = noise(n, 5);
    let mut ys = noise(n, 6);
    let x = upload(&g, &mut q, &xs);
    let y = upload(&g, &mut q, &ys);
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &0u64.to_le_bytes()).unwrap();
    let mut gr = Graph::new();
    // Half the elements first.
    let half = LaunchConfig::linear((n / 512) as u32, 256);
    let ax = gr
        .launch(
            &saxpy,
            half,
            &[Arg::F32(2.0), x.arg(), y.arg(), Arg::U32(n as u32)],
        )
        .unwrap()
        .reads(&x)
        .reads(&y)
        .writes(&y)
        .id();
    let st = gr
        .launch(
            &step,
            LaunchConfig::linear(1, 1),
            &[v.arg(), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap()
        .reads(&y)
        .reads(&v)
        .writes(&v)
        .id();
    let cp = gr.copy_range(&x, 0, &y, 0, 64).unwrap();
    let mut exec = q.instantiate(&gr).unwrap();
    // SAFETY: every node's buffers are declared.
    unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
    for i in 0..n / 2 {
        ys[i] = 2.0f32.mul_add(xs[i], ys[i]);
    }
    ys[..16].copy_from_slice(&xs[..16]);
    check(
        b,
        "y after the first replay",
        &download(&g, &mut q, &y),
        &ys,
    );
    assert_eq!(read_u64(&g, &mut q, &v), 1);

    exec.update(
        ax,
        &LaunchConfig::linear((n / 256) as u32, 256),
        &[Arg::F32(-0.5), x.arg(), y.arg(), Arg::U32(n as u32)],
    )
    .unwrap();
    exec.update(
        st,
        &LaunchConfig::linear(1, 1),
        &[v.arg(), Arg::U64(10), Arg::U64(7)],
    )
    .unwrap();
    // Refused updates leave the node as it was.
    assert!(
        exec.update(
            st,
            &LaunchConfig::linear(1, 1),
            &[v.arg(), Arg::U32(10), Arg::U64(7)]
        )
        .is_err()
    );
    assert!(
        exec.update(
            ax,
            &LaunchConfig::linear(1 << 31, 256),
            &[Arg::F32(1.0), x.arg(), y.arg(), Arg::U32(1)]
        )
        .is_err()
    );
    assert!(exec.update(cp, &LaunchConfig::linear(1, 1), &[]).is_err());
    // SAFETY: as above.
    unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
    for i in 0..n {
        ys[i] = (-0.5f32).mul_add(xs[i], ys[i]);
    }
    ys[..16].copy_from_slice(&xs[..16]);
    check(b, "y after the update", &download(&g, &mut q, &y), &ys);
    assert_eq!(read_u64(&g, &mut q, &v), 17, "{b:?}: 1 * 10 + 7");

    // Another queue's exec is refused.
    let mut q2 = g.queue().unwrap();
    // SAFETY: as above (nothing runs).
    let e = unsafe { q2.replay(&mut exec) }.unwrap_err();
    assert!(matches!(e, apex::Error::GraphQueue), "{b:?}: {e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn diamond_direct() {
    diamond(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn diamond_driver() {
    diamond(Backend::Driver);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fan_out_32_direct() {
    fan_out(Backend::Direct, 32);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fan_out_8_over_null_grids_direct() {
    fan_out(Backend::Direct, 8);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fan_out_32_driver() {
    fan_out(Backend::Driver, 32);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chain_1000_direct() {
    chain_1000(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chain_1000_polled_direct() {
    // Replays go through the ring (prebuilt methods), the launches around them through polled slots.
    for memory in [LaunchMemory::Host, LaunchMemory::Video] {
        chain_1000_with(
            Backend::Direct,
            QueueOptions::default().launch_memory(memory).polled(true),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chain_1000_driver() {
    chain_1000(Backend::Driver);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn update_direct() {
    update(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn update_driver() {
    update(Backend::Driver);
}

/// Replays and updates on the direct path allocate nothing (the counting allocator watches this thread).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn direct_replays_and_updates_allocate_nothing() {
    let g = gpu(Backend::Direct);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (step, empty) = (m.kernel("chain_step").unwrap(), m.kernel("empty").unwrap());
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &0u64.to_le_bytes()).unwrap();
    let one = LaunchConfig::linear(1, 1);
    let mut gr = Graph::new();
    let mut last = None;
    for i in 0..100u64 {
        last = Some(
            gr.launch(&step, one, &[v.arg(), Arg::U64(1), Arg::U64(i)])
                .unwrap()
                .reads(&v)
                .writes(&v)
                .id(),
        );
    }
    // A fan-out of 8 and its fan-in beside the chain.
    let root = gr.launch(&empty, one, &[]).unwrap().id();
    let join = gr.launch(&empty, one, &[]).unwrap().id();
    for _ in 0..8 {
        let b = gr.launch(&empty, one, &[]).unwrap().id();
        gr.edge(root, b).unwrap();
        gr.edge(b, join).unwrap();
    }
    let mut exec = q.instantiate(&gr).unwrap();
    // Warm-up: the first replay invalidates the instruction cache for the module.
    // SAFETY: the chain touches only `v`, the empty kernels nothing.
    unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
    let mut fences = Vec::with_capacity(1000);
    let (r, n) = allocations(|| -> apex::Result<()> {
        for _ in 0..1000 {
            // SAFETY: as above.
            fences.push(unsafe { q.replay(&mut exec) }?);
        }
        Ok(())
    });
    r.unwrap();
    assert_eq!(n, 0, "heap allocations during 1000 replays");
    fences.last().unwrap().wait(T).unwrap();
    let mut want = 0u64;
    for _ in 0..1001 {
        for i in 0..100u64 {
            want = want.wrapping_add(i);
        }
    }
    assert_eq!(read_u64(&g, &mut q, &v), want);

    let last = last.unwrap();
    let (r, n) =
        allocations(|| exec.update(last, &one, &[v.arg(), Arg::U64(1), Arg::U64(1_000_000)]));
    r.unwrap();
    assert_eq!(n, 0, "heap allocations during an update");
    // SAFETY: as above.
    unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
    want = want.wrapping_add((0..99u64).sum::<u64>() + 1_000_000);
    assert_eq!(read_u64(&g, &mut q, &v), want);
}

/// Back-to-back replays keep their order without a wait for idle between them: a graph with a fan-out and a
/// fan-in around two non-commuting steps, replayed 300 times without waiting; then graphs dropped right after
/// their replay's fence (the GPU must be done with their memory by then), 500 times, leave the queue working.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn back_to_back_replays_keep_order_and_dropped_graphs_leave_the_queue_working() {
    let g = gpu(Backend::Direct);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let (step, empty) = (m.kernel("chain_step").unwrap(), m.kernel("empty").unwrap());
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &1u64.to_le_bytes()).unwrap();
    let one = LaunchConfig::linear(1, 1);
    let mut gr = Graph::new();
    let first = gr
        .launch(&step, one, &[v.arg(), Arg::U64(3), Arg::U64(1)])
        .unwrap()
        .reads(&v)
        .writes(&v)
        .id();
    let last = gr
        .launch(&step, one, &[v.arg(), Arg::U64(5), Arg::U64(2)])
        .unwrap()
        .reads(&v)
        .writes(&v)
        .id();
    for _ in 0..4 {
        let b = gr.launch(&empty, one, &[]).unwrap().id();
        gr.edge(first, b).unwrap();
        gr.edge(b, last).unwrap();
    }
    let mut exec = q.instantiate(&gr).unwrap();
    let mut want = 1u64;
    let mut fence = None;
    for _ in 0..300 {
        // SAFETY: the steps touch only `v`, the empty kernels nothing.
        fence = Some(unsafe { q.replay(&mut exec) }.unwrap());
        want = want
            .wrapping_mul(3)
            .wrapping_add(1)
            .wrapping_mul(5)
            .wrapping_add(2);
    }
    fence.unwrap().wait(T).unwrap();
    assert_eq!(read_u64(&g, &mut q, &v), want, "300 back-to-back replays");
    drop(exec);

    for i in 0..500u64 {
        let mut gr = Graph::new();
        let a = gr
            .launch(&step, one, &[v.arg(), Arg::U64(1), Arg::U64(i)])
            .unwrap()
            .reads(&v)
            .writes(&v)
            .id();
        let b = gr.launch(&empty, one, &[]).unwrap().id();
        gr.edge(a, b).unwrap();
        let mut exec = q.instantiate(&gr).unwrap();
        // SAFETY: as above.
        unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
        drop(exec);
        want = want.wrapping_add(i);
    }
    // SAFETY: as above.
    unsafe { q.launch(&step, &one, &[v.arg(), Arg::U64(7), Arg::U64(0)]) }
        .unwrap()
        .wait(T)
        .unwrap();
    want = want.wrapping_mul(7);
    assert_eq!(read_u64(&g, &mut q, &v), want, "after 500 dropped graphs");
}
