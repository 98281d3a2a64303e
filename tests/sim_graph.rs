//! Launch graphs against the simulated GPU front end (CI, no GPU): the real instantiation and replay code runs
//! against the simulator, which executes the semaphores, follows the QMD chains and records every launch with the
//! parameters its constant bank holds. The model runs no kernels, so the tests run the recorded launches on the
//! CPU, in the order the simulated GPU launched them (`Host::run`), and compare with a reference; they also check
//! the schedule itself: every head sent only after each predecessor's completion was waited for, every link the
//! only successor of its only predecessor, every semaphore waited for before it is reset.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use apex::hw::compute::cbc0 as compute;
use apex::hw::host::c86f as host;
use apex::launch::graph::{Dependencies, Graph, GraphError, NodeId, Op, Range};
use apex::launch::{
    Arg, ComputeQueue, ComputeQueueConfig, Error, GraphExec, GraphSchedule, LaunchConfig,
    ParamError,
};
use apex::module::{Kernel, Module};
use apex::pushbuf::decode::{SubchannelClasses, decode};
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory, MemoryDesc};
use apex::sim::{Launch, Simulator};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

// ---- setup ---------------------------------------------------------------------------------------------------

struct Setup {
    gpu: Arc<GpuCore>,
    sim: Simulator,
    q: ComputeQueue,
    k: Kernels,
}

struct Kernels {
    chain: Kernel,
    add: Kernel,
    saxpy: Kernel,
    empty: Kernel,
}

fn setup() -> Setup {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).expect("compute queue");
    let m = Module::load(&gpu, CUBIN).expect("module");
    let k = Kernels {
        chain: m.kernel("chain_step").unwrap(),
        add: m.kernel("vector_add").unwrap(),
        saxpy: m.kernel("saxpy").unwrap(),
        empty: m.kernel("empty").unwrap(),
    };
    Setup { gpu, sim, q, k }
}

fn buffer(gpu: &Arc<GpuCore>, bytes: u64) -> Memory {
    Memory::alloc(gpu, MemoryDesc::video(bytes).with_cpu()).unwrap()
}

fn range(m: &Memory) -> Range {
    Range::new(m.va(), m.size()).unwrap()
}

fn floats(f: impl Fn(usize) -> f32, n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| f(i).to_le_bytes()).collect()
}

// ---- the CPU side: what the recorded launches compute ---------------------------------------------------------

/// Device memory as the CPU models it, and the kernels the tests use, run from the parameters the simulated GPU
/// recorded for each launch.
#[derive(Default)]
struct Host {
    bufs: Vec<(u64, Vec<u8>)>,
    programs: HashMap<u64, &'static str>,
    /// QMD address → node, for the graph's copy nodes (run by APEX's built-in copy kernel).
    copies: HashMap<u64, ()>,
}

impl Host {
    fn new(k: &Kernels) -> Host {
        let mut h = Host::default();
        for (kernel, name) in [
            (&k.chain, "chain_step"),
            (&k.add, "vector_add"),
            (&k.saxpy, "saxpy"),
            (&k.empty, "empty"),
        ] {
            h.programs.insert(kernel.program_va(), name);
        }
        h
    }

    /// Models the first `bytes.len()` bytes of `m` (allocations are rounded up to pages).
    fn add(&mut self, m: &Memory, bytes: Vec<u8>) {
        assert!(bytes.len() as u64 <= m.size());
        self.bufs.push((m.va(), bytes));
    }

    fn bytes(&mut self, va: u64, len: usize) -> &mut [u8] {
        let (base, b) = self
            .bufs
            .iter_mut()
            .find(|(base, b)| va >= *base && va + len as u64 <= *base + b.len() as u64)
            .unwrap_or_else(|| panic!("{va:#x}+{len} is in no buffer"));
        let off = (va - *base) as usize;
        &mut b[off..off + len]
    }

    fn f32(&mut self, va: u64) -> f32 {
        f32::from_le_bytes(self.bytes(va, 4).try_into().unwrap())
    }

    fn set_f32(&mut self, va: u64, v: f32) {
        self.bytes(va, 4).copy_from_slice(&v.to_le_bytes());
    }

    fn u64(&mut self, va: u64) -> u64 {
        u64::from_le_bytes(self.bytes(va, 8).try_into().unwrap())
    }

    fn floats(&mut self, m: &Memory) -> Vec<f32> {
        let len = self.bufs.iter().find(|b| b.0 == m.va()).unwrap().1.len();
        self.bytes(m.va(), len)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Runs one recorded launch: each thread of its grid, as the kernel's CUDA source does.
    fn run(&mut self, l: &Launch) {
        let p = &l.params;
        let u64_at = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().unwrap());
        let threads = u64::from(l.grid[0]) * u64::from(l.block[0]);
        if self.copies.contains_key(&l.qmd_va) {
            // apex_copy(src, dst, bytes): grid-stride, so any grid copies everything.
            let (src, dst, n) = (u64_at(0), u64_at(8), u64_at(16) as usize);
            let data = self.bytes(src, n).to_vec();
            self.bytes(dst, n).copy_from_slice(&data);
            return;
        }
        match self.programs.get(&l.program_va).copied() {
            Some("chain_step") => {
                let (v, mul, add) = (u64_at(0), u64_at(8), u64_at(16));
                // Every thread runs value[0] = value[0] * mul + add; the tests launch one thread.
                for _ in 0..threads {
                    let x = self.u64(v);
                    self.bytes(v, 8)
                        .copy_from_slice(&x.wrapping_mul(mul).wrapping_add(add).to_le_bytes());
                }
            }
            Some("vector_add") => {
                let (a, b, out, n) = (u64_at(0), u64_at(8), u64_at(16), u32_at(24));
                for i in 0..threads.min(u64::from(n)) {
                    let s = self.f32(a + 4 * i) + self.f32(b + 4 * i);
                    self.set_f32(out + 4 * i, s);
                }
            }
            Some("saxpy") => {
                let (alpha, x, y, n) = (
                    f32::from_le_bytes(p[0..4].try_into().unwrap()),
                    u64_at(8),
                    u64_at(16),
                    u32_at(24),
                );
                for i in 0..threads.min(u64::from(n)) {
                    let s = alpha * self.f32(x + 4 * i) + self.f32(y + 4 * i);
                    self.set_f32(y + 4 * i, s);
                }
            }
            Some("empty") => {}
            other => panic!(
                "launch of an unknown program {:#x} ({other:?})",
                l.program_va
            ),
        }
    }
}

/// The launches the simulator recorded from index `from` on, once `fence` is done.
fn launched(s: &Setup, from: usize, fence: &apex::pushbuf::Fence) -> Vec<Launch> {
    fence.wait(T).unwrap();
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
    s.sim.launches()[from..].to_vec()
}

// ---- the schedule, read back from the prebuilt methods ------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ev {
    Acquire(u64, u64),
    Release(u64, u64),
    Send(u64),
    /// A PCAS that counts an armed QMD down.
    Decrement(u64),
}

/// The semaphore operations and QMD launches in a run of methods.
fn events(words: &[u32]) -> Vec<Ev> {
    let (mut lo, mut hi, mut plo, mut phi, mut pcas) = (0u32, 0u32, 0u32, 0u32, 0u64);
    let mut out = Vec::new();
    for m in decode(words, &SubchannelClasses::hopper()).unwrap() {
        let v = m.value;
        match (m.subchannel, m.offset) {
            (0, host::SEM_ADDR_LO) => lo = host::SEM_ADDR_LO_OFFSET.unpack(v) << 2,
            (0, host::SEM_ADDR_HI) => hi = host::SEM_ADDR_HI_OFFSET.unpack(v),
            (0, host::SEM_PAYLOAD_LO) => plo = v,
            (0, host::SEM_PAYLOAD_HI) => phi = v,
            (0, host::SEM_EXECUTE) => {
                let va = (u64::from(hi) << 32) | u64::from(lo);
                let payload = (u64::from(phi) << 32) | u64::from(plo);
                if host::SEM_EXECUTE_OPERATION.unpack(v) == host::SEM_EXECUTE_OPERATION_RELEASE {
                    out.push(Ev::Release(va, payload));
                } else {
                    out.push(Ev::Acquire(va, payload));
                }
            }
            (1, compute::SEND_PCAS_A) => {
                pcas = u64::from(compute::SEND_PCAS_A_QMD_ADDRESS_SHIFTED8.unpack(v)) << 8
            }
            (1, compute::SEND_SIGNALING_PCAS2_B) => {
                if compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION.unpack(v)
                    == compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_DECREMENT_DEPENDENCE
                {
                    out.push(Ev::Decrement(pcas))
                } else {
                    out.push(Ev::Send(pcas))
                }
            }
            other => panic!("unexpected method {other:?} ({:?})", m.name),
        }
    }
    out
}

/// Checks the exec's schedule against the dependencies, as its [`GraphSchedule`] builds it. Returns the events of
/// the replay methods.
fn check_schedule(deps: &Dependencies, exec: &GraphExec) -> Vec<Ev> {
    match exec.schedule() {
        GraphSchedule::Gpu => check_gpu_schedule(deps, exec),
        GraphSchedule::FrontEnd => check_front_end_schedule(deps, exec),
    }
}

/// [`GraphSchedule::Gpu`]: a replay zeroes the completion words, sends every root; for each fan-out wider than
/// the work distributor takes, in topological order, waits for its word and then sends each successor with no
/// other predecessor and counts the others down; and finally waits for the completion word to reach the number of
/// sinks. Arming sends every other node and every null grid once. Every node is sent or armed exactly once. (That
/// the counters then order the nodes is what the replays check.)
fn check_gpu_schedule(deps: &Dependencies, exec: &GraphExec) -> Vec<Ev> {
    let n = deps.len();
    let all = ids(deps);
    let evs = events(exec.methods());
    let st = exec.stats();
    if n == 0 {
        assert!(evs.is_empty());
        return evs;
    }
    let node_of_qmd: HashMap<u64, NodeId> =
        all.iter().map(|&v| (exec.qmd_va(v).unwrap(), v)).collect();
    let wide: Vec<NodeId> = deps
        .order()
        .iter()
        .copied()
        .filter(|&v| deps.succs(v).len() > GraphExec::MAX_GPU_FAN_OUT)
        .collect();
    let sinks = all.iter().filter(|&&v| deps.succs(v).is_empty()).count();
    let done = exec.completion().expect("a completion word");
    // The words are zeroed last, by the front end, for the next replay: one release per word, after the final wait
    // (a reset by the compute engine would not be ordered with the front end's acquires).
    let resets = wide.len() + 1;
    assert!(evs.len() > resets);
    let (body, tail) = evs.split_at(evs.len() - resets);
    for (k, e) in tail.iter().enumerate() {
        assert_eq!(
            *e,
            Ev::Release(done + 4 * k as u64, 0),
            "word {k} zeroed after the final wait"
        );
    }
    let mut sent = vec![0u32; n];
    let mut decrements = vec![0usize; n];
    let mut waited: Vec<NodeId> = Vec::new();
    let mut next_wide = 0;
    for &ev in &body[..body.len() - 1] {
        match ev {
            Ev::Acquire(va, 1) => {
                let u = wide[next_wide];
                assert_eq!(va, done + 4 * (next_wide as u64 + 1), "the words in order");
                next_wide += 1;
                waited.push(u);
            }
            Ev::Send(q) => {
                let v = node_of_qmd[&q];
                let p = deps.preds(v);
                assert!(
                    p.is_empty() || (p.len() == 1 && waited.contains(&p[0])),
                    "node {v} sent, neither a root nor the only successor of a fan-out waited for"
                );
                sent[v.index()] += 1;
            }
            Ev::Decrement(q) => {
                let v = node_of_qmd[&q];
                assert!(deps.preds(v).len() > 1, "only fan-ins are counted down");
                assert!(
                    deps.preds(v).iter().any(|p| waited.contains(p)),
                    "node {v} counted down before any fan-out before it was waited for"
                );
                decrements[v.index()] += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(next_wide, wide.len(), "every wide fan-out waited for");
    assert_eq!(body[body.len() - 1], Ev::Acquire(done, sinks as u64));
    for &v in &all {
        let from_wide = deps.preds(v).iter().filter(|p| wide.contains(p)).count();
        if deps.preds(v).len() > 1 {
            assert_eq!(
                decrements[v.index()],
                from_wide,
                "node {v}: one count per wide predecessor"
            );
        }
    }
    let mut armed = vec![0u32; n];
    let mut nulls = 0;
    for e in events(exec.arm_methods()) {
        match e {
            Ev::Send(q) => match node_of_qmd.get(&q) {
                Some(v) => armed[v.index()] += 1,
                None => nulls += 1,
            },
            other => panic!("arming only sends: {other:?}"),
        }
    }
    for &v in &all {
        let i = v.index();
        assert_eq!(sent[i] + armed[i], 1, "node {v} sent or armed, once");
        assert!(exec.semaphore(v).is_none() && exec.chain_next(v).is_none());
    }
    let sent_total = sent.iter().sum::<u32>() as usize;
    assert_eq!(nulls, st.nulls);
    assert_eq!(
        (st.heads, st.links, st.waits, st.semaphores, st.armed),
        (
            sent_total,
            n - sent_total,
            1 + wide.len(),
            1 + wide.len(),
            n - sent_total + nulls
        )
    );
    evs
}

/// [`GraphSchedule::FrontEnd`]: each node runs once, as a head sent after every predecessor was waited for, or as
/// the chain link of its only predecessor; every sink is waited for; every semaphore is reset only after it was
/// waited for.
fn check_front_end_schedule(deps: &Dependencies, exec: &GraphExec) -> Vec<Ev> {
    let n = deps.len();
    let all = ids(deps);
    let id = |i: usize| all[i];
    let node_of_qmd: HashMap<u64, usize> =
        (0..n).map(|i| (exec.qmd_va(id(i)).unwrap(), i)).collect();
    let node_of_sem: HashMap<u64, usize> = (0..n)
        .filter_map(|i| exec.semaphore(id(i)).map(|s| (s, i)))
        .collect();
    let mut link_of = vec![None; n];
    for u in 0..n {
        if let Some(q) = exec.chain_next(id(u)) {
            let v = node_of_qmd[&q];
            assert_eq!(
                deps.succs(id(u)),
                &[id(v)],
                "a link is its predecessor's only successor"
            );
            assert_eq!(deps.preds(id(v)), &[id(u)], "a link has one predecessor");
            assert!(
                exec.semaphore(id(u)).is_none(),
                "a node inside a chain releases nothing"
            );
            assert!(link_of[v].replace(u).is_none());
        } else {
            assert!(
                exec.semaphore(id(u)).is_some(),
                "a chain end releases a semaphore"
            );
        }
    }
    let mut done = vec![false; n];
    let mut launched = vec![0u32; n];
    let evs = events(exec.methods());
    for &ev in &evs {
        match ev {
            Ev::Acquire(va, 1) => {
                let v = node_of_sem[&va];
                assert!(launched[v] == 1, "waits for node {v}, which was not sent");
                let mut stack = vec![v];
                while let Some(u) = stack.pop() {
                    if !std::mem::replace(&mut done[u], true) {
                        stack.extend(deps.preds(id(u)).iter().map(|p| p.index()));
                    }
                }
            }
            Ev::Send(q) => {
                let h = node_of_qmd[&q];
                assert!(link_of[h].is_none(), "node {h} is a link and a head");
                for p in deps.preds(id(h)) {
                    assert!(
                        done[p.index()],
                        "node {h} sent before its predecessor {p} was waited for"
                    );
                }
                let mut v = Some(h);
                while let Some(u) = v {
                    launched[u] += 1;
                    v = exec.chain_next(id(u)).map(|q| node_of_qmd[&q]);
                }
            }
            Ev::Release(va, 0) => assert!(
                done[node_of_sem[&va]],
                "semaphore reset before it was waited for"
            ),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        launched.iter().all(|&l| l == 1),
        "every node runs once: {launched:?}"
    );
    assert!(
        done.iter().all(|&d| d),
        "every node is waited for by the end"
    );
    let resets = evs.iter().filter(|e| matches!(e, Ev::Release(..))).count();
    assert_eq!(resets, node_of_sem.len(), "every semaphore is reset");
    assert_eq!(exec.stats().semaphores, node_of_sem.len());
    evs
}

/// Every node's id, by index.
fn ids(deps: &Dependencies) -> Vec<NodeId> {
    let mut all = deps.order().to_vec();
    all.sort_unstable();
    all
}

/// Positions of each node's launch in `launches` (by QMD address); every node exactly once.
fn positions(exec: &GraphExec, deps: &Dependencies, launches: &[Launch]) -> Vec<usize> {
    ids(deps)
        .iter()
        .map(|&v| {
            let q = exec.qmd_va(v).unwrap();
            let at: Vec<usize> = (0..launches.len())
                .filter(|&p| launches[p].qmd_va == q)
                .collect();
            assert_eq!(at.len(), 1, "node {v} launched {} times", at.len());
            at[0]
        })
        .collect()
}

fn assert_order(deps: &Dependencies, pos: &[usize]) {
    for e in deps.edges() {
        assert!(
            pos[e.from.index()] < pos[e.to.index()],
            "{} ran after {}",
            e.from,
            e.to
        );
    }
}

/// Replays `exec` once, waits for it, checks that every dependency of `deps` ran in order, and returns the launches
/// with each node's position among them.
fn replay_in_order(
    s: &mut Setup,
    exec: &mut GraphExec,
    deps: &Dependencies,
) -> (Vec<Launch>, Vec<usize>) {
    let start = s.sim.launches().len();
    // SAFETY: the simulated GPU runs no kernels.
    let f = unsafe { s.q.replay_graph(exec) }.unwrap();
    let ls = launched(s, start, &f);
    let pos = positions(exec, deps, &ls);
    assert_order(deps, &pos);
    (ls, pos)
}

/// A small deterministic random source: `rnd(n)` in `0..n`.
fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

// ---- the tests --------------------------------------------------------------------------------------------

#[test]
fn a_diamond_runs_in_dependency_order_and_computes_its_result() {
    for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
        diamond(schedule);
    }
}

fn diamond(schedule: GraphSchedule) {
    let mut s = setup();
    s.q.set_graph_schedule(schedule);
    let n = 64u32;
    let bytes = u64::from(n) * 4;
    let [x, y, a, b, c, d] = [(); 6].map(|_| buffer(&s.gpu, bytes));
    let mut host = Host::new(&s.k);
    host.add(&x, floats(|i| i as f32, 64));
    host.add(&y, floats(|i| 100.0 - i as f32, 64));
    host.add(&a, floats(|_| 0.0, 64));
    host.add(&b, floats(|i| 0.5 * i as f32, 64));
    host.add(&c, floats(|_| 1.0, 64));
    host.add(&d, floats(|_| -1.0, 64));

    let cfg = LaunchConfig::linear(1, 64);
    let mut g = Graph::new();
    let na = g
        .launch_args(
            &s.k.add,
            cfg,
            &[
                Arg::Ptr(x.va()),
                Arg::Ptr(y.va()),
                Arg::Ptr(a.va()),
                Arg::U32(n),
            ],
        )
        .unwrap();
    g.read(na, range(&x)).unwrap();
    g.read(na, range(&y)).unwrap();
    g.write(na, range(&a)).unwrap();
    let nb = g
        .launch_args(
            &s.k.saxpy,
            cfg,
            &[
                Arg::F32(2.0),
                Arg::Ptr(a.va()),
                Arg::Ptr(b.va()),
                Arg::U32(n),
            ],
        )
        .unwrap();
    g.read(nb, range(&a)).unwrap();
    g.read(nb, range(&b)).unwrap();
    g.write(nb, range(&b)).unwrap();
    let nc = g
        .launch_args(
            &s.k.saxpy,
            cfg,
            &[
                Arg::F32(3.0),
                Arg::Ptr(a.va()),
                Arg::Ptr(c.va()),
                Arg::U32(n),
            ],
        )
        .unwrap();
    g.read(nc, range(&a)).unwrap();
    g.read(nc, range(&c)).unwrap();
    g.write(nc, range(&c)).unwrap();
    let nd = g
        .launch_args(
            &s.k.add,
            cfg,
            &[
                Arg::Ptr(b.va()),
                Arg::Ptr(c.va()),
                Arg::Ptr(d.va()),
                Arg::U32(n),
            ],
        )
        .unwrap();
    g.read(nd, range(&b)).unwrap();
    g.read(nd, range(&c)).unwrap();
    g.write(nd, range(&d)).unwrap();

    let deps = g.dependencies().unwrap();
    let pairs: Vec<_> = deps
        .edges()
        .iter()
        .map(|e| (e.from.index(), e.to.index()))
        .collect();
    assert_eq!(pairs, vec![(0, 1), (0, 2), (1, 3), (2, 3)]);
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    assert_eq!(exec.schedule(), schedule);
    let st = exec.stats();
    let evs = check_schedule(&deps, &exec);
    let qmd = [na, nb, nc, nd].map(|v| exec.qmd_va(v).unwrap());
    if schedule == GraphSchedule::FrontEnd {
        assert_eq!((st.nodes, st.edges, st.heads, st.links), (4, 4, 4, 0));
        // B waits for A, C needs no wait of its own (A is known done), D waits for B and C, the sink D at the end.
        assert_eq!((st.waits, st.semaphores, st.entries), (4, 4, 1));
        let sem = [na, nb, nc, nd].map(|v| exec.semaphore(v).unwrap());
        assert_eq!(
            &evs[..7],
            &[
                Ev::Send(qmd[0]),
                Ev::Acquire(sem[0], 1),
                Ev::Send(qmd[1]),
                Ev::Send(qmd[2]),
                Ev::Acquire(sem[1], 1),
                Ev::Acquire(sem[2], 1),
                Ev::Send(qmd[3]),
            ],
            "B and C back to back (concurrent), D after both"
        );
    } else {
        // A sent; B and C its two dependents; D counts both down.
        assert_eq!(
            (st.nodes, st.edges, st.heads, st.links, st.nulls),
            (4, 4, 1, 3, 0)
        );
        assert_eq!((st.waits, st.semaphores, st.armed), (1, 1, 3));
    }

    let start = s.sim.launches().len();
    let before = s.sim.stats_for(s.q.queue().channel().token()).unwrap();
    // SAFETY: the simulated GPU runs no kernels.
    let fence = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    let ls = launched(&s, start, &fence);
    assert_eq!(ls.len(), 4);
    let pos = positions(&exec, &deps, &ls);
    assert_order(&deps, &pos);
    let after = s.sim.stats_for(s.q.queue().channel().token()).unwrap();
    assert_eq!(
        after.doorbells - before.doorbells,
        1,
        "one doorbell per replay"
    );
    for l in &ls {
        host.run(l);
    }
    let (xs, ys, bs0, cs0) = (
        (0..64).map(|i| i as f32).collect::<Vec<_>>(),
        (0..64).map(|i| 100.0 - i as f32).collect::<Vec<_>>(),
        (0..64).map(|i| 0.5 * i as f32).collect::<Vec<_>>(),
        vec![1.0f32; 64],
    );
    let got = host.floats(&d);
    for i in 0..64 {
        let av = xs[i] + ys[i];
        let want = (2.0 * av + bs0[i]) + (3.0 * av + cs0[i]);
        assert_eq!(got[i], want, "d[{i}]");
    }
    for k in 0..4 {
        let l = ls.iter().find(|l| l.qmd_va == qmd[k]).unwrap();
        match schedule {
            // Each chain end released its own semaphore, with payload 1.
            GraphSchedule::FrontEnd => {
                assert_eq!(
                    l.releases,
                    vec![(exec.semaphore([na, nb, nc, nd][k]).unwrap(), 1)]
                )
            }
            // Only the sink adds 1 to the completion word.
            GraphSchedule::Gpu if k == 3 => {
                assert_eq!(l.releases, vec![(exec.completion().unwrap(), 1)])
            }
            GraphSchedule::Gpu => assert!(l.releases.is_empty()),
        }
    }
}

#[test]
fn a_fan_out_of_32_runs_every_branch_after_the_root() {
    for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
        fan_out_32(schedule);
    }
}

fn fan_out_32(schedule: GraphSchedule) {
    let mut s = setup();
    s.q.set_graph_schedule(schedule);
    let src = buffer(&s.gpu, 4 * 64);
    let outs: Vec<Memory> = (0..32).map(|_| buffer(&s.gpu, 4 * 64)).collect();
    let mut host = Host::new(&s.k);
    host.add(&src, floats(|_| 0.0, 64));
    for (k, o) in outs.iter().enumerate() {
        host.add(o, floats(|i| (k * 1000 + i) as f32, 64));
    }
    let ones = buffer(&s.gpu, 4 * 64);
    host.add(&ones, floats(|_| 1.0, 64));
    let cfg = LaunchConfig::linear(1, 64);
    let mut g = Graph::new();
    // The root: src = ones + ones.
    let root = g
        .launch_args(
            &s.k.add,
            cfg,
            &[
                Arg::Ptr(ones.va()),
                Arg::Ptr(ones.va()),
                Arg::Ptr(src.va()),
                Arg::U32(64),
            ],
        )
        .unwrap();
    g.read(root, range(&ones)).unwrap();
    g.write(root, range(&src)).unwrap();
    let mut branches = Vec::new();
    for (k, o) in outs.iter().enumerate() {
        // out_k += (k + 1) * src
        let b = g
            .launch_args(
                &s.k.saxpy,
                cfg,
                &[
                    Arg::F32(k as f32 + 1.0),
                    Arg::Ptr(src.va()),
                    Arg::Ptr(o.va()),
                    Arg::U32(64),
                ],
            )
            .unwrap();
        g.read(b, range(&src)).unwrap();
        g.read(b, range(o)).unwrap();
        g.write(b, range(o)).unwrap();
        branches.push(b);
    }
    let deps = g.dependencies().unwrap();
    assert_eq!(deps.edges().len(), 32);
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let st = exec.stats();
    let evs = check_schedule(&deps, &exec);
    let start = s.sim.launches().len();
    let token = s.q.queue().channel().token();
    let before = s.sim.stats_for(token).unwrap();
    if schedule == GraphSchedule::FrontEnd {
        assert_eq!(
            (st.heads, st.links, st.waits, st.semaphores),
            (33, 0, 33, 33)
        );
        // The root, one wait for it, then the 32 branches with nothing between them: nothing serialises them.
        assert_eq!(evs[0], Ev::Send(exec.qmd_va(root).unwrap()));
        assert_eq!(evs[1], Ev::Acquire(exec.semaphore(root).unwrap(), 1));
        for (k, b) in branches.iter().enumerate() {
            assert_eq!(evs[2 + k], Ev::Send(exec.qmd_va(*b).unwrap()), "branch {k}");
        }
    } else {
        // Wider than the work distributor takes: the front end sends the 32 branches once the root has completed.
        assert_eq!(
            (st.heads, st.links, st.waits, st.semaphores, st.nulls),
            (33, 0, 2, 2, 0)
        );
    }
    // SAFETY: the simulated GPU runs no kernels.
    let fence = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    let ls = launched(&s, start, &fence);
    let after = s.sim.stats_for(token).unwrap();
    let acquires = if schedule == GraphSchedule::FrontEnd {
        33 // one wait for the root, one per sink
    } else {
        2 // the root's word, the completion word
    };
    assert_eq!(after.acquires - before.acquires, acquires);
    assert_eq!(after.doorbells - before.doorbells, 1);
    let pos = positions(&exec, &deps, &ls);
    assert_order(&deps, &pos);
    for l in &ls {
        host.run(l);
    }
    for (k, o) in outs.iter().enumerate() {
        let got = host.floats(o);
        for (i, v) in got.iter().enumerate() {
            assert_eq!(
                *v,
                (k * 1000 + i) as f32 + (k as f32 + 1.0) * 2.0,
                "out{k}[{i}]"
            );
        }
    }
}

#[test]
fn a_chain_of_1000_is_one_head_and_999_links() {
    for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
        chain_1000(schedule);
    }
}

fn chain_1000(schedule: GraphSchedule) {
    let mut s = setup();
    s.q.set_graph_schedule(schedule);
    let v = buffer(&s.gpu, 8);
    let mut host = Host::new(&s.k);
    host.add(&v, 7u64.to_le_bytes().to_vec());
    let mut g = Graph::new();
    let mut want = 7u64;
    for i in 0..1000u64 {
        let (mul, add) = (3 + (i % 5), i * 11 + 1);
        want = want.wrapping_mul(mul).wrapping_add(add);
        let n = g
            .launch_args(
                &s.k.chain,
                LaunchConfig::linear(1, 1),
                &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)],
            )
            .unwrap();
        g.read(n, range(&v)).unwrap();
        g.write(n, range(&v)).unwrap();
    }
    let deps = g.dependencies().unwrap();
    assert_eq!(deps.edges().len(), 999);
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let st = exec.stats();
    assert_eq!(
        (st.heads, st.links, st.waits, st.semaphores),
        (1, 999, 1, 1)
    );
    check_schedule(&deps, &exec);
    for round in 0..2 {
        let start = s.sim.launches().len();
        // SAFETY: the simulated GPU runs no kernels.
        let fence = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
        let ls = launched(&s, start, &fence);
        assert_eq!(ls.len(), 1000);
        let pos = positions(&exec, &deps, &ls);
        assert!(
            pos.windows(2).all(|w| w[0] + 1 == w[1]),
            "round {round}: in chain order"
        );
        host.bufs[0].1 = 7u64.to_le_bytes().to_vec();
        for l in &ls {
            host.run(l);
        }
        assert_eq!(host.u64(v.va()), want, "round {round}");
    }
}

#[test]
fn copies_are_nodes_ordered_like_launches() {
    let mut s = setup();
    let [a, b, c] = [(); 3].map(|_| buffer(&s.gpu, 256));
    let mut host = Host::new(&s.k);
    host.add(&a, floats(|i| i as f32, 64));
    host.add(&b, floats(|_| 0.0, 64));
    host.add(&c, floats(|_| 0.0, 64));
    let cfg = LaunchConfig::linear(1, 64);
    let mut g = Graph::new();
    // a = 2a (saxpy with x = y = a) → copy a to b → c = a + b → copy c into the upper half of a.
    let n0 = g
        .launch_args(
            &s.k.saxpy,
            cfg,
            &[
                Arg::F32(1.0),
                Arg::Ptr(a.va()),
                Arg::Ptr(a.va()),
                Arg::U32(64),
            ],
        )
        .unwrap();
    g.read(n0, range(&a)).unwrap();
    g.write(n0, range(&a)).unwrap();
    let n1 = g.copy(a.va(), b.va(), 256).unwrap();
    let n2 = g
        .launch_args(
            &s.k.add,
            cfg,
            &[
                Arg::Ptr(a.va()),
                Arg::Ptr(b.va()),
                Arg::Ptr(c.va()),
                Arg::U32(64),
            ],
        )
        .unwrap();
    g.read(n2, range(&a)).unwrap();
    g.read(n2, range(&b)).unwrap();
    g.write(n2, range(&c)).unwrap();
    let n3 = g.copy(c.va(), a.va() + 128, 128).unwrap();
    let deps = g.dependencies().unwrap();
    let pairs: Vec<_> = deps
        .edges()
        .iter()
        .map(|e| (e.from.index(), e.to.index()))
        .collect();
    // n3 writes the upper half of a, which n2 read (WAR) and n1 read: implied through n2.
    assert_eq!(pairs, vec![(0, 1), (1, 2), (2, 3)]);
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    assert_eq!(exec.stats().links, 3, "a chain of launches and copies");
    check_schedule(&deps, &exec);
    for v in [n1, n3] {
        host.copies.insert(exec.qmd_va(v).unwrap(), ());
    }
    let (ls, pos) = replay_in_order(&mut s, &mut exec, &deps);
    // The copies ran with the addresses and size recorded.
    let copy = &ls[pos[n3.index()]];
    assert_eq!(copy.params[0..8], c.va().to_le_bytes());
    assert_eq!(copy.params[8..16], (a.va() + 128).to_le_bytes());
    assert_eq!(copy.params[16..24], 128u64.to_le_bytes());
    for l in &ls {
        host.run(l);
    }
    let got = host.floats(&a);
    assert_eq!(got.len(), 64);
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 32 {
            2.0 * i as f32
        } else {
            4.0 * (i - 32) as f32
        };
        assert_eq!(v, want, "a[{i}]");
    }
    assert!(matches!(
        g.copy(0, 0, 0).map(|n| g.node(n).map(|x| x.op().clone())),
        Ok(Some(Op::Copy { bytes: 0, .. }))
    ));
    assert!(
        matches!(s.q.instantiate_graph(&g), Err(Error::InvalidLaunch { .. })),
        "a copy of 0 bytes is refused"
    );
}

#[test]
fn replays_keep_queue_order_with_ordinary_launches() {
    let mut s = setup();
    let v = buffer(&s.gpu, 8);
    let mut host = Host::new(&s.k);
    host.add(&v, 1u64.to_le_bytes().to_vec());
    let one = LaunchConfig::linear(1, 1);
    let step = |mul: u64, add: u64| [Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)];
    let mut g = Graph::new();
    for i in 0..4u64 {
        let n = g.launch_args(&s.k.chain, one, &step(5, i)).unwrap();
        g.read(n, range(&v)).unwrap();
        g.write(n, range(&v)).unwrap();
    }
    // A fan-in too: two independent empty nodes and one that waits for both and for the chain.
    let e1 = g.launch_args(&s.k.empty, one, &[]).unwrap();
    let e2 = g.launch_args(&s.k.empty, one, &[]).unwrap();
    let last = g.launch_args(&s.k.chain, one, &step(7, 100)).unwrap();
    g.read(last, range(&v)).unwrap();
    g.write(last, range(&v)).unwrap();
    g.edge(e1, last).unwrap();
    g.edge(e2, last).unwrap();
    let deps = g.dependencies().unwrap();
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    check_schedule(&deps, &exec);
    let token = s.q.queue().channel().token();

    // With the front end paused, nothing completes: the replay must wait for the launch before it on the GPU, and
    // the launch after it runs after the replay (the front end released the replay's value after its own waits).
    s.sim.pause();
    let before = s.sim.stats_for(token).unwrap();
    let start = s.sim.launches().len();
    // SAFETY: the simulated GPU runs no kernels.
    unsafe { s.q.launch(&s.k.chain, &one, &step(2, 3)) }.unwrap();
    // SAFETY: as above.
    let replay = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    // SAFETY: as above.
    let after_fence = unsafe { s.q.launch(&s.k.chain, &one, &step(11, 13)) }.unwrap();
    assert!(!replay.is_done());
    s.sim.resume();
    let ls = launched(&s, start, &after_fence);
    assert!(replay.is_done());
    assert_eq!(ls.len(), 1 + 7 + 1);
    let pos = positions(&exec, &deps, &ls);
    assert!(
        pos.iter().all(|&p| p > 0 && p < 8),
        "the graph runs between the two launches"
    );
    assert_order(&deps, &pos);
    let after = s.sim.stats_for(token).unwrap();
    // The replay's wait on the launch before it and the graph's own waits. The later launch does not wait for the
    // replay: the front end released the replay's value itself, after the graph's waits had passed.
    assert_eq!(
        after.acquires - before.acquires,
        1 + exec.stats().waits as u64
    );
    for l in &ls {
        host.run(l);
    }
    let mut want = 2 + 3; // the launch before: 1 * 2 + 3
    for i in 0..4 {
        want = want * 5 + i;
    }
    want = (want * 7 + 100) * 11 + 13;
    assert_eq!(host.u64(v.va()), want);

    // Unordered launches before a replay are joined first; the replay's fence covers them.
    let start = s.sim.launches().len();
    // SAFETY: as above.
    unsafe { s.q.record_launch_unordered(&s.k.empty, &one, &[]) }.unwrap();
    // SAFETY: as above.
    let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    assert_eq!(launched(&s, start, &f).len(), 8);
}

#[test]
fn updates_change_parameters_and_grid_between_replays() {
    let mut s = setup();
    let (x, y) = (buffer(&s.gpu, 4 * 256), buffer(&s.gpu, 4 * 256));
    let v = buffer(&s.gpu, 8);
    let mut g = Graph::new();
    let sx = g
        .launch_args(
            &s.k.saxpy,
            LaunchConfig::linear(1, 64),
            &[
                Arg::F32(2.0),
                Arg::Ptr(x.va()),
                Arg::Ptr(y.va()),
                Arg::U32(64),
            ],
        )
        .unwrap();
    g.read(sx, range(&x)).unwrap();
    g.write(sx, range(&y)).unwrap();
    let st = g
        .launch_args(
            &s.k.chain,
            LaunchConfig::linear(1, 1),
            &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap();
    g.read(st, range(&y)).unwrap();
    g.write(st, range(&v)).unwrap();
    let cp = g.copy(x.va(), y.va(), 16).unwrap();
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let mut host = Host::new(&s.k);
    host.add(&x, floats(|i| i as f32, 256));
    host.add(&y, floats(|_| 1.0, 256));
    host.add(&v, 0u64.to_le_bytes().to_vec());
    host.copies.insert(exec.qmd_va(cp).unwrap(), ());

    let start = s.sim.launches().len();
    // SAFETY: the simulated GPU runs no kernels.
    let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    let ls = launched(&s, start, &f);
    let first = ls
        .iter()
        .find(|l| l.qmd_va == exec.qmd_va(sx).unwrap())
        .unwrap()
        .clone();
    assert_eq!(first.grid, [1, 1, 1]);
    assert_eq!(first.params[0..4], 2.0f32.to_le_bytes());

    // Four blocks over all 256 elements with another factor; the chain step with other constants.
    let (allocs_result, allocs) = allocations(|| {
        exec.update_launch(
            sx,
            &LaunchConfig::linear(4, 64),
            &[
                Arg::F32(0.5),
                Arg::Ptr(x.va()),
                Arg::Ptr(y.va()),
                Arg::U32(256),
            ],
        )
    });
    allocs_result.unwrap();
    assert_eq!(allocs, 0, "an update allocates nothing");
    // A new shape for a node the GPU schedules (not a root): its QMD is rewritten, so the next replay arms it again.
    exec.update_launch(
        st,
        &LaunchConfig::linear(2, 1),
        &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(9)],
    )
    .unwrap();
    assert_eq!(exec.launch_config(sx).unwrap().grid, [4, 1, 1]);
    let start = s.sim.launches().len();
    // SAFETY: as above.
    let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    let ls = launched(&s, start, &f);
    let l = ls
        .iter()
        .find(|l| l.qmd_va == exec.qmd_va(sx).unwrap())
        .unwrap();
    assert_eq!(l.grid, [4, 1, 1]);
    assert_eq!(
        l.driver_words[3..6],
        [4, 1, 1],
        "gridDim in constant bank 0"
    );
    assert_eq!(l.params[0..4], 0.5f32.to_le_bytes());
    assert_eq!(l.params[24..28], 256u32.to_le_bytes());
    let step = ls
        .iter()
        .find(|l| l.qmd_va == exec.qmd_va(st).unwrap())
        .unwrap();
    assert_eq!(
        step.grid,
        [2, 1, 1],
        "the rewritten QMD ran, not the one armed before"
    );
    for l in &ls {
        host.run(l);
    }
    let got = host.floats(&y);
    assert_eq!(got.len(), 256);
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 4 {
            i as f32
        } else {
            0.5 * i as f32 + 1.0
        };
        assert_eq!(
            v, want,
            "y[{i}]: all 256 elements with the new factor, then the copy"
        );
    }
    // Two blocks of the chain step, each v = 3v + 9, from 0.
    assert_eq!(host.u64(v.va()), 36);
}

#[test]
fn refusals_are_typed() {
    let mut s = setup();
    let v = buffer(&s.gpu, 8);
    let mut g = Graph::new();
    let a = g
        .launch_args(
            &s.k.chain,
            LaunchConfig::linear(1, 1),
            &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap();
    let cp = g.copy(v.va(), v.va(), 8).unwrap();
    // Wrong argument count and size at recording.
    assert!(matches!(
        g.launch_args(&s.k.chain, LaunchConfig::linear(1, 1), &[Arg::Ptr(0)]),
        Err(ParamError::Count {
            expected: 3,
            given: 1,
            ..
        })
    ));
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let one = LaunchConfig::linear(1, 1);
    let e = exec
        .update_launch(a, &one, &[Arg::Ptr(v.va()), Arg::U32(1), Arg::U64(1)])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Params(ParamError::Size {
                index: 1,
                expected: 8,
                given: 4,
                ..
            })
        ),
        "{e}"
    );
    let e = exec
        .update_launch(
            a,
            &LaunchConfig::linear(1, 2048),
            &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidLaunch { .. }), "{e}");
    let e = exec
        .update_launch(
            a,
            &one.with_grid([1, 1 << 17, 1]),
            &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap_err();
    assert!(e.to_string().contains("grid.y"), "{e}");
    let e = exec.update_launch(cp, &one, &[]).unwrap_err();
    assert!(matches!(e, Error::GraphUpdate { node: 1, .. }), "{e}");
    let e = exec
        .update_launch(
            a,
            &one.with_cluster([1, 1, 1]),
            &[Arg::Ptr(v.va()), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap_err();
    assert!(matches!(e, Error::GraphUpdate { node: 0, .. }), "{e}");
    let mut six = Graph::new();
    for _ in 0..6 {
        six.launch_args(&s.k.empty, one, &[]).unwrap();
    }
    let e = exec
        .update_launch(six.id(5).unwrap(), &one, &[])
        .unwrap_err();
    assert!(
        matches!(e, Error::Graph(GraphError::NoSuchNode { node: 5, len: 2 })),
        "{e}"
    );
    // A refused update changed nothing: the next replay launches what was recorded.
    let start = s.sim.launches().len();
    // SAFETY: the simulated GPU runs no kernels.
    let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    let ls = launched(&s, start, &f);
    let l = ls
        .iter()
        .find(|l| l.qmd_va == exec.qmd_va(a).unwrap())
        .unwrap();
    assert_eq!((l.grid, l.block), ([1, 1, 1], [1, 1, 1]));
    assert_eq!(l.params[8..16], 1u64.to_le_bytes());

    // Another queue of the same GPU: refused, naming both.
    let mut other = ComputeQueue::new(&s.gpu, ComputeQueueConfig::default()).unwrap();
    // SAFETY: as above.
    let e = unsafe { other.replay_graph(&mut exec) }.unwrap_err();
    assert!(
        matches!(e, Error::GraphQueue { built, used } if built == s.q.id() && used == other.id()),
        "{e}"
    );
    // A cycle through explicit edges.
    let mut g2 = Graph::new();
    let x = g2.launch_args(&s.k.empty, one, &[]).unwrap();
    let y = g2.launch_args(&s.k.empty, one, &[]).unwrap();
    g2.edge(x, y).unwrap();
    g2.edge(y, x).unwrap();
    let e = s.q.instantiate_graph(&g2).unwrap_err();
    assert!(matches!(e, Error::Graph(GraphError::Cycle { .. })), "{e}");
    // A kernel of another GPU.
    let (gpu2, _sim2) = Simulator::open(SimConfig {
        uuid: *b"APEX-simulated-1",
        ..SimConfig::default()
    })
    .unwrap();
    let k2 = Module::load(&gpu2, CUBIN).unwrap().kernel("empty").unwrap();
    let mut g3 = Graph::new();
    g3.launch_args(&k2, one, &[]).unwrap();
    assert!(matches!(
        s.q.instantiate_graph(&g3),
        Err(Error::InvalidLaunch { .. })
    ));
    // A parameter block that does not match the kernel's.
    let mut g4 = Graph::new();
    g4.launch(s.k.chain.clone(), one, vec![0; 4]);
    assert!(matches!(
        s.q.instantiate_graph(&g4),
        Err(Error::InvalidLaunch { .. })
    ));
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
}

#[test]
fn back_to_back_replays_wait_only_for_their_own_nodes() {
    // Each replay ends with the front end's waits for the graph's sinks, then releases its timeline value at once: no
    // wait for idle, and the next replay needs no acquire of the one before (measured on an H100: 1.5 us less per
    // replay). Both schedules, a graph with a fan-out and a fan-in around two non-commuting steps.
    for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
        back_to_back_replays(schedule);
    }
}

fn back_to_back_replays(schedule: GraphSchedule) {
    let mut s = setup();
    s.q.set_graph_schedule(schedule);
    let v = buffer(&s.gpu, 8);
    let mut host = Host::new(&s.k);
    host.add(&v, 1u64.to_le_bytes().to_vec());
    let one = LaunchConfig::linear(1, 1);
    let mut g = Graph::new();
    let step = |g: &mut Graph<Kernel>, mul: u64, add: u64| {
        let n = g
            .launch_args(
                &s.k.chain,
                one,
                &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)],
            )
            .unwrap();
        g.read(n, range(&v)).unwrap();
        g.write(n, range(&v)).unwrap();
        n
    };
    let first = step(&mut g, 3, 1);
    let last = step(&mut g, 5, 2);
    for _ in 0..3 {
        let e = g.launch_args(&s.k.empty, one, &[]).unwrap();
        g.edge(first, e).unwrap();
        g.edge(e, last).unwrap();
    }
    let deps = g.dependencies().unwrap();
    let nodes = 5;
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let token = s.q.queue().channel().token();
    // SAFETY: the simulated GPU runs no kernels.
    unsafe { s.q.replay_graph(&mut exec) }
        .unwrap()
        .wait(T)
        .unwrap();
    s.sim.pause();
    let before = s.sim.stats_for(token).unwrap();
    let start = s.sim.launches().len();
    let replays = 5;
    let mut last_fence = None;
    for _ in 0..replays {
        // SAFETY: as above.
        last_fence = Some(unsafe { s.q.replay_graph(&mut exec) }.unwrap());
    }
    s.sim.resume();
    let ls = launched(&s, start, &last_fence.unwrap());
    let after = s.sim.stats_for(token).unwrap();
    assert_eq!(ls.len(), nodes * replays, "{schedule:?}");
    for r in ls.chunks(nodes) {
        // Each node once per replay, in dependency order: no replay overlaps the next.
        assert_order(&deps, &positions(&exec, &deps, r));
    }
    assert_eq!(
        after.acquires - before.acquires,
        replays as u64 * exec.stats().waits as u64,
        "{schedule:?}: only the graph's own waits"
    );
    assert_eq!(
        after.wfis, before.wfis,
        "{schedule:?}: no replay waits for idle"
    );
    let mut want = 1u64;
    for _ in 0..=replays {
        want = want
            .wrapping_mul(3)
            .wrapping_add(1)
            .wrapping_mul(5)
            .wrapping_add(2);
    }
    for l in &s.sim.launches() {
        host.run(l);
    }
    assert_eq!(host.u64(v.va()), want, "{schedule:?}");
}

#[test]
fn an_empty_graph_replays_as_a_point_in_queue_order() {
    let mut s = setup();
    let mut exec = s.q.instantiate_graph(&Graph::new()).unwrap();
    assert!(exec.is_empty());
    assert!(exec.methods().is_empty());
    // SAFETY: the simulated GPU runs no kernels.
    let before = unsafe { s.q.launch(&s.k.empty, &LaunchConfig::linear(1, 1), &[]) }.unwrap();
    // SAFETY: as above.
    let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
    f.wait(T).unwrap();
    assert!(before.is_done() && f.value() > before.value());
}

#[test]
fn replays_allocate_nothing() {
    let mut s = setup();
    let v = buffer(&s.gpu, 8);
    let mut g = Graph::new();
    for i in 0..16u64 {
        let n = g
            .launch_args(
                &s.k.chain,
                LaunchConfig::linear(1, 1),
                &[Arg::Ptr(v.va()), Arg::U64(2), Arg::U64(i)],
            )
            .unwrap();
        g.read(n, range(&v)).unwrap();
        g.write(n, range(&v)).unwrap();
    }
    // A fan-out and fan-in beside the chain.
    let r = g
        .launch_args(&s.k.empty, LaunchConfig::linear(1, 1), &[])
        .unwrap();
    let j = g
        .launch_args(&s.k.empty, LaunchConfig::linear(1, 1), &[])
        .unwrap();
    for _ in 0..4 {
        let b = g
            .launch_args(&s.k.empty, LaunchConfig::linear(1, 1), &[])
            .unwrap();
        g.edge(r, b).unwrap();
        g.edge(b, j).unwrap();
    }
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    // Warm up: the first replay invalidates the instruction cache for the new module.
    // SAFETY: the simulated GPU runs no kernels.
    unsafe { s.q.replay_graph(&mut exec) }
        .unwrap()
        .wait(T)
        .unwrap();
    let mut fences = Vec::with_capacity(100);
    let (r, allocs) = allocations(|| {
        for _ in 0..100 {
            // SAFETY: as above.
            match unsafe { s.q.replay_graph(&mut exec) } {
                Ok(f) => fences.push(f),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    });
    r.unwrap();
    assert_eq!(allocs, 0, "heap allocations during 100 replays");
    fences.last().unwrap().wait(T).unwrap();
    assert!(s.sim.errors().is_empty());
}

#[test]
fn random_graphs_are_scheduled_correctly() {
    let mut s = setup();
    let cells = buffer(&s.gpu, 8 * 8);
    let mut rnd = xorshift(0x2545_f491_4f6c_dd1du64);
    for round in 0..40 {
        let n = 1 + rnd(24) as usize;
        let mut g = Graph::new();
        let mut want = [0u64; 8];
        for k in 0..n {
            // Each node steps one cell (RAW/WAW on it), and may read another (a read-only dependency).
            let cell = rnd(8);
            let (mul, add) = (1 + rnd(5), rnd(100));
            want[cell as usize] = want[cell as usize].wrapping_mul(mul).wrapping_add(add);
            let va = cells.va() + 8 * cell;
            let id = g
                .launch_args(
                    &s.k.chain,
                    LaunchConfig::linear(1, 1),
                    &[Arg::Ptr(va), Arg::U64(mul), Arg::U64(add)],
                )
                .unwrap();
            g.read(id, Range::new(va, 8).unwrap()).unwrap();
            g.write(id, Range::new(va, 8).unwrap()).unwrap();
            if rnd(3) == 0 {
                let other = cells.va() + 8 * rnd(8);
                g.read(id, Range::new(other, 8).unwrap()).unwrap();
            }
            if k > 0 && rnd(4) == 0 {
                let from = rnd(k as u64) as usize;
                g.edge(g.id(from).unwrap(), id).unwrap();
            }
        }
        let deps = g.dependencies().unwrap();
        // Both schedules, and the GPU's twice: the second replay runs on QMDs that re-armed themselves.
        let schedule = [GraphSchedule::Gpu, GraphSchedule::FrontEnd][round % 2];
        s.q.set_graph_schedule(schedule);
        let mut exec = s.q.instantiate_graph(&g).unwrap();
        assert_eq!(exec.schedule(), schedule);
        check_schedule(&deps, &exec);
        for replay in 0..2 {
            let mut host = Host::new(&s.k);
            host.add(&cells, vec![0; 64]);
            let (ls, _) = replay_in_order(&mut s, &mut exec, &deps);
            for l in &ls {
                host.run(l);
            }
            for (c, w) in want.iter().enumerate() {
                assert_eq!(
                    host.u64(cells.va() + 8 * c as u64),
                    *w,
                    "round {round} ({schedule:?}), replay {replay}, cell {c}"
                );
            }
        }
    }
}

#[test]
fn wide_fan_outs_and_fan_ins_are_resolved_by_the_gpu() {
    // A root, 2..=70 branches (null grids spread those beyond two, up to the work distributor's limit; wider ones
    // are sent by the front end), a join counting them all down, three replays.
    let mut s = setup();
    let cells = buffer(&s.gpu, 8 * 80);
    for width in [2usize, 3, 5, 8, 9, 17, 70] {
        let one = LaunchConfig::linear(1, 1);
        let mut g = Graph::new();
        let root = g.launch_args(&s.k.empty, one, &[]).unwrap();
        let mut branches = Vec::new();
        for b in 0..width {
            let va = cells.va() + 8 * b as u64;
            let n = g
                .launch_args(&s.k.chain, one, &[Arg::Ptr(va), Arg::U64(1), Arg::U64(1)])
                .unwrap();
            g.edge(root, n).unwrap();
            branches.push(n);
        }
        let join = g.launch_args(&s.k.empty, one, &[]).unwrap();
        for &b in &branches {
            g.edge(b, join).unwrap();
        }
        // A fan-in of the root and another root: the front end counts the root's edge down when the fan-out is
        // wide, the other root's completion the other.
        let other = g.launch_args(&s.k.empty, one, &[]).unwrap();
        let mixed = g.launch_args(&s.k.empty, one, &[]).unwrap();
        g.edge(root, mixed).unwrap();
        g.edge(other, mixed).unwrap();
        let deps = g.dependencies().unwrap();
        let mut exec = s.q.instantiate_graph(&g).unwrap();
        check_schedule(&deps, &exec);
        // The root's successors: the branches and `mixed`.
        let fan = width + 1;
        let nulls = if fan <= GraphExec::MAX_GPU_FAN_OUT {
            fan - 2
        } else {
            0
        };
        assert_eq!(exec.stats().nulls, nulls, "width {width}");
        let token = s.q.queue().channel().token();
        for replay in 0..3 {
            let start = s.sim.launches().len();
            let before = s.sim.stats_for(token).unwrap();
            // SAFETY: the simulated GPU runs no kernels.
            let f = unsafe { s.q.replay_graph(&mut exec) }.unwrap();
            let ls = launched(&s, start, &f);
            let after = s.sim.stats_for(token).unwrap();
            assert_eq!(
                after.null_grids - before.null_grids,
                nulls as u64,
                "every null grid once"
            );
            // The join counts every branch down; `mixed` its two predecessors.
            assert_eq!(after.decrements - before.decrements, width as u64 + 2);
            assert_eq!(
                ls.len(),
                width + 4,
                "width {width}, replay {replay}: null grids launch nothing"
            );
            let pos = positions(&exec, &deps, &ls);
            assert_order(&deps, &pos);
        }
    }
}

// ---- the public API over the simulated GPU ------------------------------------------------------------------

#[test]
fn the_public_graph_builder_derives_and_replays_in_order() {
    use apex::{Gpu, Graph as ApiGraph};
    let (gpu, sim) = Gpu::open_simulated(SimConfig::default()).unwrap();
    assert_eq!(gpu.backend(), apex::Backend::Direct);
    let m = gpu.load_module(CUBIN).unwrap();
    let (add, saxpy, step) = (
        m.kernel("vector_add").unwrap(),
        m.kernel("saxpy").unwrap(),
        m.kernel("chain_step").unwrap(),
    );
    let n = 256u32;
    let bytes = u64::from(n) * 4;
    let [x, y, z, w] = [(); 4].map(|_| gpu.alloc(bytes).unwrap());
    let v = gpu.alloc(8).unwrap();
    let cfg = LaunchConfig::linear(1, 256);
    let mut g = ApiGraph::new();
    let sum = g
        .launch(&add, cfg, &[x.arg(), y.arg(), z.arg(), Arg::U32(n)])
        .unwrap()
        .reads(&x)
        .reads(&y)
        .writes(&z)
        .id();
    let ax = g
        .launch(&saxpy, cfg, &[Arg::F32(2.0), z.arg(), w.arg(), Arg::U32(n)])
        .unwrap()
        .reads(&z)
        .reads(&w)
        .writes(&w)
        .id();
    let cp = g.copy(&z, &y).unwrap();
    // Only the first 8 bytes of v: declared as a range.
    let st = g
        .launch(
            &step,
            LaunchConfig::linear(1, 1),
            &[v.arg(), Arg::U64(3), Arg::U64(4)],
        )
        .unwrap()
        .reads_range(&v, 0, 8)
        .unwrap()
        .writes_range(&v, 0, 8)
        .unwrap()
        .id();
    g.edge(ax, st).unwrap();
    assert_eq!(g.len(), 4);
    let deps = g.dependencies().unwrap();
    let pairs: Vec<_> = deps.edges().iter().map(|e| (e.from, e.to)).collect();
    // The sum before the saxpy (RAW on z) and before the copy (WAR on y, RAW on z); the explicit edge.
    assert_eq!(pairs, vec![(sum, ax), (sum, cp), (ax, st)]);

    let mut q = gpu.queue().unwrap();
    let mut exec = q.instantiate(&g).unwrap();
    assert_eq!(exec.backend(), apex::Backend::Direct);
    assert_eq!(exec.len(), 4);
    let stats = exec.direct().unwrap().stats();
    assert_eq!(
        (stats.heads, stats.links),
        (1, 3),
        "only the root is sent; the GPU schedules the rest"
    );
    let start = sim.launches().len();
    // SAFETY: the simulated GPU runs no kernels.
    let f = unsafe { q.replay(&mut exec) }.unwrap();
    f.wait(T).unwrap();
    let ls = sim.launches()[start..].to_vec();
    assert_eq!(ls.len(), 4);
    let d = exec.direct().unwrap();
    let at = |node| {
        ls.iter()
            .position(|l| l.qmd_va == d.qmd_va(node).unwrap())
            .unwrap()
    };
    assert!(at(sum) < at(ax) && at(sum) < at(cp) && at(ax) < at(st));
    assert_eq!(ls[at(st)].params[8..16], 3u64.to_le_bytes());

    // An update between replays; a refused one is typed and changes nothing.
    exec.update(
        st,
        &LaunchConfig::linear(2, 1),
        &[v.arg(), Arg::U64(5), Arg::U64(6)],
    )
    .unwrap();
    assert!(matches!(
        exec.update(st, &LaunchConfig::linear(1, 1), &[v.arg()]),
        Err(apex::Error::Direct(Error::Params(ParamError::Count { .. })))
    ));
    assert!(matches!(
        exec.update(cp, &LaunchConfig::linear(1, 1), &[]),
        Err(apex::Error::Direct(Error::GraphUpdate { .. }))
    ));
    let start = sim.launches().len();
    // SAFETY: as above.
    unsafe { q.replay(&mut exec) }.unwrap().wait(T).unwrap();
    let ls = sim.launches()[start..].to_vec();
    let l = ls.iter().find(|l| l.qmd_va == d_qmd(&exec, st)).unwrap();
    assert_eq!(l.grid, [2, 1, 1]);
    assert_eq!(
        l.params[8..24],
        [5u64.to_le_bytes(), 6u64.to_le_bytes()].concat()[..]
    );

    // Ranges outside their buffers, copies that do not fit, another queue's exec: typed refusals.
    let mut g2 = ApiGraph::new();
    let e = g2
        .launch(
            &step,
            LaunchConfig::linear(1, 1),
            &[v.arg(), Arg::U64(1), Arg::U64(1)],
        )
        .unwrap()
        .writes_range(&v, 4, 8)
        .unwrap_err();
    assert!(matches!(e, apex::Error::InvalidArgument(_)), "{e}");
    assert!(matches!(
        g2.copy(&x, &v),
        Err(apex::Error::InvalidArgument(_))
    ));
    assert!(
        g2.launch(&step, LaunchConfig::linear(1, 1), &[Arg::U32(1)])
            .is_err()
    );
    let mut q2 = gpu.queue().unwrap();
    // SAFETY: as above.
    let e = unsafe { q2.replay(&mut exec) }.unwrap_err();
    assert!(matches!(e, apex::Error::GraphQueue), "{e}");
    assert!(e.to_string().contains("instantiate"));
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
}

fn d_qmd(exec: &apex::GraphExec, node: NodeId) -> u64 {
    exec.direct().unwrap().qmd_va(node).unwrap()
}

#[test]
fn wide_fan_outs_recorded_out_of_order_are_waited_for_in_dependency_order() {
    // Two fan-outs wider than the work distributor takes, the one recorded first depending (explicit edge) on the
    // one recorded second: the front end must wait for the second's word first, or it waits forever.
    let mut s = setup();
    let one = LaunchConfig::linear(1, 1);
    let mut g = Graph::new();
    let late = |g: &mut Graph<Kernel>| g.launch_args(&s.k.empty, one, &[]).unwrap();
    let first = late(&mut g);
    let a: Vec<NodeId> = (0..9).map(|_| late(&mut g)).collect();
    let second = late(&mut g);
    let b: Vec<NodeId> = (0..9).map(|_| late(&mut g)).collect();
    for &x in &a {
        g.edge(first, x).unwrap();
    }
    for &x in &b {
        g.edge(second, x).unwrap();
    }
    g.edge(b[0], first).unwrap();
    let deps = g.dependencies().unwrap();
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    check_schedule(&deps, &exec);
    assert_eq!(
        exec.stats().waits,
        3,
        "two wide fan-outs and the completion word"
    );
    for _ in 0..2 {
        replay_in_order(&mut s, &mut exec, &deps);
    }
}

#[test]
fn random_dags_with_wide_fan_outs_and_backward_edges_run_in_order() {
    // Layered DAGs (every edge from one layer to the next, so none is implied by another path and fan-outs stay
    // wide), recorded in a shuffled order so explicit edges point backwards in recording order: both schedules,
    // two replays each (the GPU's second on QMDs that re-armed themselves).
    let mut s = setup();
    let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15u64);
    let one = LaunchConfig::linear(1, 1);
    let (mut wide_seen, mut nulls_seen) = (0, 0);
    for _ in 0..80 {
        let layers: Vec<usize> = (0..2 + rnd(4)).map(|_| 1 + rnd(20) as usize).collect();
        let n: usize = layers.iter().sum();
        let mut recorded: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            recorded.swap(i, rnd(i as u64 + 1) as usize);
        }
        let mut g = Graph::new();
        let mut ids = vec![None; n];
        for &v in &recorded {
            ids[v] = Some(g.launch_args(&s.k.empty, one, &[]).unwrap());
        }
        let ids: Vec<NodeId> = ids.into_iter().map(Option::unwrap).collect();
        let mut first = 0;
        for w in layers.windows(2) {
            let (this, next) = (first..first + w[0], first + w[0]..first + w[0] + w[1]);
            for v in next {
                // One or two predecessors in the layer before, often the same one: wide fan-outs.
                let a = this.start
                    + if rnd(2) == 0 {
                        0
                    } else {
                        rnd(w[0] as u64) as usize
                    };
                g.edge(ids[a], ids[v]).unwrap();
                if rnd(3) == 0 {
                    let b = this.start + rnd(w[0] as u64) as usize;
                    if b != a {
                        g.edge(ids[b], ids[v]).unwrap();
                    }
                }
            }
            first += w[0];
        }
        let deps = g.dependencies().unwrap();
        for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
            s.q.set_graph_schedule(schedule);
            let mut exec = s.q.instantiate_graph(&g).unwrap();
            check_schedule(&deps, &exec);
            for _ in 0..2 {
                replay_in_order(&mut s, &mut exec, &deps);
            }
            if schedule == GraphSchedule::Gpu {
                wide_seen += exec.stats().waits - 1;
                nulls_seen += exec.stats().nulls;
            }
        }
    }
    assert!(
        wide_seen > 10 && nulls_seen > 10,
        "{wide_seen} wide fan-outs, {nulls_seen} null grids"
    );
}

#[test]
fn a_programmatic_chain_waits_on_each_producers_latch_in_every_replay() {
    let mut s = setup();
    let one = LaunchConfig::linear(1, 32);
    let mut g = Graph::new();
    let nodes: Vec<NodeId> = (0..6)
        .map(|_| g.launch_args(&s.k.empty, one, &[]).unwrap())
        .collect();
    for w in nodes.windows(2) {
        g.edge(w[0], w[1]).unwrap();
        g.set_programmatic(w[1]).unwrap();
    }
    let mut exec = s.q.instantiate_graph(&g).unwrap();
    let before = s.sim.launches().len();
    for _ in 0..2 {
        // SAFETY: the model runs no kernels.
        unsafe { s.q.replay_graph(&mut exec) }
            .unwrap()
            .wait(T)
            .unwrap();
    }
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
    let launches = &s.sim.launches()[before..];
    assert_eq!(launches.len(), 12);
    for replay in launches.chunks(6) {
        let order: Vec<u64> = replay.iter().map(|l| l.qmd_va).collect();
        let want: Vec<u64> = nodes.iter().map(|&v| exec.qmd_va(v).unwrap()).collect();
        assert_eq!(order, want, "the chain in order");
        assert_eq!(replay[0].latch_wait, None);
        assert_eq!(
            replay[5].latch_arrive, None,
            "the sink has no programmatic consumer"
        );
        for pair in replay.windows(2) {
            assert!(pair[0].latch_arrive.is_some());
            assert_eq!(pair[1].latch_wait, pair[0].latch_arrive);
        }
    }
}

/// A graph whose kernel binds a constant bank another instance of its module writes (`Module::shares_constants`:
/// CUDA's `cudaMemcpyToSymbol` lands there, unseen by APEX) invalidates the SMs' constant caches at every replay; one
/// whose module binds its own bank invalidates them only at its first replay, as its nodes keep the caches.
#[test]
fn replays_invalidate_constant_caches_when_a_node_shares_its_bank() {
    const MODULE_DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");
    let mut s = setup();
    let bank = buffer(&s.gpu, 0x1000);
    let section = apex::module::cubin::Cubin::parse(MODULE_DATA)
        .unwrap()
        .image_sections()
        .find(|x| x.name == ".nv.constant3")
        .map(|x| x.image_offset)
        .unwrap();
    let out = buffer(&s.gpu, 64);
    let token = s.q.queue().channel().token();
    let invalidations = |sim: &Simulator| sim.stats_for(token).unwrap().cache_invalidations;
    for shared in [false, true] {
        let home = |g: &apex::module::cubin::GlobalSymbol| {
            (shared && g.is_constant()).then(|| apex::VariableHome {
                address: bank.va() + (g.image_offset - section),
                size: g.size,
            })
        };
        let m = Module::load_placed(
            &s.gpu,
            MODULE_DATA,
            &apex::module::printf::PrintfFifoCell::new(),
            &home,
        )
        .unwrap();
        assert_eq!(m.shares_constants(), shared);
        let combo = m.kernel("combo").unwrap();
        let mut g = Graph::new();
        g.launch_args(&combo, LaunchConfig::linear(1, 1), &[Arg::Ptr(out.va())])
            .unwrap();
        let mut exec = s.q.instantiate_graph(&g).unwrap();
        // SAFETY: the simulated GPU runs no kernels.
        unsafe { s.q.replay_graph(&mut exec) }
            .unwrap()
            .wait(T)
            .unwrap();
        let before = invalidations(&s.sim);
        for _ in 0..3 {
            // SAFETY: as above.
            unsafe { s.q.replay_graph(&mut exec) }
                .unwrap()
                .wait(T)
                .unwrap();
        }
        let added = invalidations(&s.sim) - before;
        if shared {
            assert!(added >= 3, "{added} invalidations over 3 replays");
        } else {
            assert_eq!(added, 0, "the nodes keep the constant caches");
        }
    }
    assert!(s.sim.errors().is_empty());
}
