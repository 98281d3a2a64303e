//! Launch graphs on the direct path: a [`Graph`] instantiated once into QMDs, constant banks, completion
//! semaphores and methods in memory of its own, then replayed with one doorbell and no allocation.
//!
//! How a graph is scheduled and replayed is documented on [`GraphExec`] (and in docs/graphs.md).

use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use crate::launch::cbank::{
    CLUSTER_WORDS, CLUSTER_WORDS_START, DRIVER_BYTES, write_cluster_words, write_driver_words,
};
use crate::launch::graph::{Graph, GraphError, NodeId, Op};
use crate::launch::params::{Arg, pack};
use crate::launch::qmd::{
    self, ChainAction, DependentAction, GraphNodeForm, QMD_WORDS, QmdParams, QmdVersion,
};
use crate::launch::{Error, Result};
use crate::module::printf::PrintfFifo;
use crate::module::{Kernel, newest_generation};
use crate::pushbuf::{Acquire, Fence, Push, Queue, Release, Signal};
use crate::rm::{Memory, MemoryDesc};

use super::slots::{bank0_size, qmd_params, write_changed};
use super::{
    ComputeQueue, LOCAL_RESERVE, LaunchConfig, Limits, MAX_PARAM_BYTES, QMD_BYTES, cluster_shape,
    validate,
};

/// Words of constant bank 0 before the parameters.
const DRIVER_WORDS: usize = DRIVER_BYTES / 4;
/// A completion semaphore: the QMD's four-word release (64-bit payload, then a timestamp).
const SEMAPHORE_BYTES: u64 = 16;
/// QMDs are addressed in 256-byte units (SEND_PCAS_A, DEPENDENT_QMD0_POINTER).
const NODE_ALIGN: u64 = 256;
/// Words of one host semaphore method group (header + address, payload, execute).
const SEMAPHORE_WORDS: usize = 6;
/// Words of SEND_PCAS_A + SEND_SIGNALING_PCAS2_B.
const PCAS_WORDS: usize = 4;
/// The widest fan-out the work distributor resolves itself ([`GraphSchedule::Gpu`]): at most two levels of null
/// grids. Measured on an H100 (empty kernels, replay + wait): a fan-out of 4 over nulls 8.61 µs against 8.79 µs
/// sent by the front end; of 32, 16.38 µs over four levels against 14.95 µs.
const MAX_SPREAD: usize = GraphExec::MAX_GPU_FAN_OUT;

/// How an instantiated graph's dependencies are resolved on the GPU ([`ComputeQueue::set_graph_schedule`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphSchedule {
    /// The compute work distributor resolves every dependency itself, as libcuda's graphs do on Hopper: each node
    /// names up to two dependents in its QMD (wider fan-outs spread over null grids), fan-ins count their
    /// predecessors down in a dependence counter, and a replay sends only the roots. The default; V04 QMDs only
    /// (other layouts use `FrontEnd`).
    #[default]
    Gpu,
    /// Chains of single dependencies are resolved by the work distributor; every other node is sent by the
    /// channel's front end after semaphore acquires on its predecessors' chains (see [`GraphExec`]).
    FrontEnd,
}

/// What an instantiated graph looks like on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphStats {
    /// Nodes (launches and copies).
    pub nodes: usize,
    /// Edges of the reduced dependency graph.
    pub edges: usize,
    /// Nodes sent by the prebuilt methods (SEND_PCAS): the roots ([`GraphSchedule::Gpu`]), or the first node of
    /// each chain ([`GraphSchedule::FrontEnd`]).
    pub heads: usize,
    /// Nodes the GPU schedules itself: every other node (`Gpu`), or the dependent QMD of their only predecessor
    /// (`FrontEnd`).
    pub links: usize,
    /// Host semaphore acquires in the prebuilt methods: one on the completion word (`Gpu`), or waits on
    /// predecessors, then on the sinks (`FrontEnd`).
    pub waits: usize,
    /// Completion semaphores: the one word every sink adds to (`Gpu`), or one per chain end (`FrontEnd`).
    pub semaphores: usize,
    /// Null grids that spread fan-outs wider than the two dependents a QMD names (`Gpu`).
    pub nulls: usize,
    /// QMDs a replay arms before it sends the roots, after instantiation or an update that rewrote a QMD (`Gpu`).
    pub armed: usize,
    /// Words of prebuilt methods.
    pub method_words: usize,
    /// GPFIFO entries the prebuilt methods take per replay (besides the ring's prefix and release).
    pub entries: usize,
}

/// One node as instantiated.
struct ExecNode {
    kernel: Kernel,
    /// A copy (the built-in copy kernel), which [`GraphExec::update_launch`] refuses.
    copy: bool,
    cfg: LaunchConfig,
    /// What its QMD was built from (the release included).
    qmd: QmdParams,
    /// Its chain successor's QMD, when it has one ([`GraphSchedule::FrontEnd`]).
    next: Option<(u64, ChainAction)>,
    /// Its dependents, counter and completion ([`GraphSchedule::Gpu`]).
    form: Option<qmd::GraphNodeForm>,
    /// Programmatic edges: the latch this grid arrives at for its chain successor, and the one it waits on for its
    /// chain predecessor.
    latch: (Option<u32>, Option<u32>),
    /// Offset of its QMD in the exec's memory; constant bank 0 follows at [`QMD_BYTES`].
    offset: u64,
    /// Its completion semaphore (chain ends only).
    semaphore: Option<u64>,
    /// What the QMD and the driver words of its constant bank hold now (the memory is write-only).
    qmd_shadow: [u32; QMD_WORDS],
    driver_shadow: [u32; DRIVER_WORDS],
}

/// A [`Graph`] instantiated on one [`ComputeQueue`]: prebuilt QMDs, constant banks and methods, replayed by
/// [`ComputeQueue::replay_graph`] with one doorbell.
///
/// # How a graph is scheduled
///
/// The graph's reduced dependencies ([`Graph::dependencies`]) are cut into **chains**: `u → v` is a chain link
/// when `v` is `u`'s only successor and `u` is `v`'s only predecessor. A link is the QMD dependent mechanism of
/// [`record_launch_chained`](ComputeQueue::record_launch_chained): `u`'s QMD names `v`'s as DEPENDENT_QMD0, and the
/// compute work distributor schedules `v` when `u` has completed, with no front-end round trip. Every other node
/// is a **head**, sent by the prebuilt methods with SEND_PCAS. Every chain's last node (its **end**) releases a
/// completion semaphore of its own from its QMD (payload 1, after a system-scope membar); nodes inside a chain
/// release nothing, since only their chain successor waits for them.
///
/// The prebuilt methods are, in order:
/// 1. each head, by level (longest path from a node without predecessors), then topological order: a host
///    semaphore acquire on each predecessor's semaphore whose completion is not already implied by an earlier
///    acquire (a predecessor is an end, since it has a head as successor), then SEND_PCAS of the head's QMD. Heads
///    with nothing between them start back to back and run concurrently: the roots of the graph, a fan-out's
///    branches after one acquire.
/// 2. an acquire on each sink's semaphore (every node is done once every sink is);
/// 3. a release of 0 to every semaphore, ready for the next replay. Every semaphore was acquired in 1 or 2 (the
///    first successor of an end in the method order always waits for it explicitly: an earlier acquire that
///    implied it would need that successor sent earlier still), so no release of this replay can land after its
///    reset.
///
/// This is correct for any DAG: a head starts only after each predecessor has completed and made its writes
/// visible, a link only after its chain predecessor; and it cannot deadlock, since every node a head waits for
/// belongs to a chain whose head has a lower level and so was sent earlier in the same in-order method stream.
/// The price of the in-order front end: a head held by an acquire holds the heads after it too, also unrelated
/// ones of the same or a higher level (sorting by level keeps every head behind only waits of lower levels).
/// Copies are nodes like launches: the built-in SM copy kernel (`apex_copy`, as
/// [`copy_device`](ComputeQueue::copy_device)), so they chain, wait and release the same way.
///
/// # A replay
///
/// [`replay_graph`](ComputeQueue::replay_graph) ends an open chain and joins pending unordered launches, then
/// records in the queue's ring a prefix when needed (an instruction-cache invalidate after a module load, an
/// acquire on the queue's last value unless the CPU already sees it reached or the front end released it itself:
/// the replay starts after earlier work), pushes the prebuilt methods (one GPFIFO entry per 2^21 − 1 words),
/// records the timeline release that later work and the fence wait for, and rings the doorbell once. The methods
/// end with acquires that pass only once every node has completed (each sink after its system-scope membar), so
/// that release needs no wait for idle, and what follows needs no acquire of it (libcuda's `cuGraphLaunch` does
/// the same). It writes a handful of words and allocates nothing.
///
/// [`GraphExec::update_launch`] rewrites one launch's parameters and shape in place (the QMD words that change,
/// the driver words, the parameters), after waiting for the exec's previous replay: nothing else is rebuilt.
pub struct GraphExec {
    queue_id: u64,
    /// QMDs with their constant banks, then the completion semaphores.
    mem: Memory,
    /// The prebuilt methods (absent for an empty graph); held for the GPU, which reads them at every replay.
    _methods_mem: Option<Memory>,
    /// The same methods, for inspection ([`GraphExec::methods`]).
    methods: Vec<u32>,
    /// The arming methods, for inspection ([`GraphExec::arm_methods`]).
    arm_methods: Vec<u32>,
    schedule: GraphSchedule,
    /// The word every sink adds 1 to ([`GraphSchedule::Gpu`]).
    completion: Option<u64>,
    /// (GPU address, words) of each GPFIFO entry a replay pushes.
    pieces: Vec<(u64, u64)>,
    /// The same for the methods that arm every node the GPU schedules ([`GraphSchedule::Gpu`]).
    arm_pieces: Vec<(u64, u64)>,
    /// Whether those QMDs are armed: after a replay, each re-arms itself when it completes.
    armed: bool,
    nodes: Vec<ExecNode>,
    version: QmdVersion,
    limits: Limits,
    /// The queue's shared and local memory windows (constant bank driver words).
    windows: (u64, u64),
    /// The newest module generation among the graph's kernels: a replay invalidates the instruction cache when the
    /// queue has not yet seen it.
    generation: u64,
    /// The nodes' QMDs keep the constant cache (as libcuda's graph nodes do): set when their banks were written
    /// (instantiation, an update), so that the next replay invalidates it once, before any node runs.
    banks_written: bool,
    printf: Option<Arc<PrintfFifo>>,
    last: Option<Fence>,
    timeout: Duration,
    /// Parameters packed by an update before they are written.
    scratch: Vec<u8>,
    stats: GraphStats,
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphExec")
            .field("queue", &self.queue_id)
            .field("stats", &self.stats)
            .finish()
    }
}

/// A node as planned from the graph: the kernel that runs it and its checked launch.
struct Planned {
    kernel: Kernel,
    copy: bool,
    cfg: LaunchConfig,
    params: Vec<u8>,
    shape: (u32, Option<[u32; 3]>),
}

impl ComputeQueue {
    /// Builds `graph` for this queue, once: every launch checked as [`launch`](Self::launch) checks it, the
    /// dependencies derived and reduced, QMDs, constant banks and the methods that send them written to memory of
    /// the graph's own (see [`GraphExec`] for the schedule). Chain links use the chain action set now
    /// ([`set_chain_action`](Self::set_chain_action)). Local memory grows here if a kernel needs more stack, so no
    /// replay has to. Nothing runs until [`replay_graph`](Self::replay_graph).
    pub fn instantiate_graph(&mut self, graph: &Graph<Kernel>) -> Result<GraphExec> {
        let deps = graph.dependencies()?;
        let n = graph.len();
        let mut planned = Vec::with_capacity(n);
        for node in graph.nodes() {
            planned.push(match node.op() {
                Op::Launch {
                    kernel,
                    cfg,
                    params,
                } => {
                    let shape = self.check(kernel, cfg)?;
                    let k = kernel.info();
                    if params.len() != k.param_cbank_size as usize {
                        return Err(Error::InvalidLaunch {
                            kernel: k.name.clone(),
                            why: format!(
                                "a {}-byte parameter block, the kernel takes {} bytes; pack the arguments with \
                                 Graph::launch_args",
                                params.len(),
                                k.param_cbank_size
                            ),
                        });
                    }
                    Planned {
                        kernel: kernel.clone(),
                        copy: false,
                        cfg: *cfg,
                        params: params.clone(),
                        shape,
                    }
                }
                &Op::Copy { src, dst, bytes } => {
                    if bytes == 0 {
                        return Err(Error::InvalidLaunch {
                            kernel: "apex_copy".into(),
                            why: "a copy of 0 bytes in a graph".into(),
                        });
                    }
                    let (kernel, cfg) = self.copy_launch(bytes)?;
                    let mut params = vec![0u8; kernel.info().param_cbank_size as usize];
                    pack(
                        kernel.info(),
                        &[Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(bytes)],
                        &mut params,
                    )?;
                    let shape = self.check(&kernel, &cfg)?;
                    Planned {
                        kernel,
                        copy: true,
                        cfg,
                        params,
                        shape,
                    }
                }
            });
        }

        // Stack and printf for every kernel now, so a replay never changes the queue's state.
        let stack = planned
            .iter()
            .map(|p| p.kernel.info().min_stack_size)
            .max()
            .unwrap_or(0);
        if stack + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(stack)?;
        }
        let printf = planned
            .iter()
            .find_map(|p| p.kernel.module().printf_fifo().cloned());
        let generation = planned
            .iter()
            .map(|p| p.kernel.module().generation())
            .max()
            .unwrap_or(0);

        // Chains: u → v when v is u's only successor and u is v's only predecessor.
        let id = NodeId::at;
        let mut next: Vec<Option<usize>> = vec![None; n];
        for (u, next) in next.iter_mut().enumerate() {
            if let [v] = deps.succs(id(u))
                && deps.preds(*v).len() == 1
            {
                *next = Some(v.index());
            }
        }
        let mut prev: Vec<Option<usize>> = vec![None; n];
        for (u, w) in next.iter().enumerate() {
            if let Some(w) = *w {
                prev[w] = Some(u);
            }
        }

        // The work distributor's counters hold 16 bits: a wider fan-in is left to the front end.
        let indeg: Vec<usize> = (0..n).map(|v| deps.preds(id(v)).len()).collect();
        let gpu = self.graph_schedule == GraphSchedule::Gpu
            && self.version == QmdVersion::V04
            && indeg.iter().all(|&d| d <= usize::from(u16::MAX));

        // Layout: each node's QMD and constant bank, the null grids, then the semaphores (the chain ends', or the
        // one completion word).
        let mut offsets = Vec::with_capacity(n);
        let mut at = 0u64;
        for p in &planned {
            offsets.push(at);
            let bank = (DRIVER_BYTES as u64 + u64::from(p.kernel.info().param_cbank_size))
                .next_multiple_of(16);
            at += (QMD_BYTES + bank).next_multiple_of(NODE_ALIGN);
        }
        // A fan-out wider than MAX_SPREAD is sent by the front end once the node has completed; narrower ones are
        // the work distributor's, over null grids beyond two.
        // In topological order: the front end waits for them one after another, so a wide node must never be waited
        // for before one it depends on (explicit edges may point backwards in recording order).
        let wide: Vec<usize> = if gpu {
            deps.order()
                .iter()
                .map(|v| v.index())
                .filter(|&u| deps.succs(id(u)).len() > MAX_SPREAD)
                .collect()
        } else {
            Vec::new()
        };
        let mut signal_of = vec![None; n];
        for (k, &u) in wide.iter().enumerate() {
            signal_of[u] = Some(k);
        }
        // Nodes the front end sends: the only successor of a wide fan-out.
        let host_sent: Vec<bool> = (0..n)
            .map(|v| matches!(deps.preds(id(v)), [p] if signal_of[p.index()].is_some()))
            .collect();
        let mut nulls: Vec<[Option<Target>; 2]> = Vec::new();
        let mut dependents: Vec<[Option<Target>; 2]> = vec![[None, None]; n];
        if gpu {
            for (u, d) in dependents.iter_mut().enumerate() {
                if signal_of[u].is_none() {
                    let succs: Vec<usize> = deps.succs(id(u)).iter().map(|v| v.index()).collect();
                    *d = spread(&succs, &mut nulls);
                }
            }
        }
        let null_base = at;
        let null_bytes = QMD_BYTES.next_multiple_of(NODE_ALIGN);
        at += nulls.len() as u64 * null_bytes;
        let ends: Vec<usize> = if gpu {
            Vec::new()
        } else {
            (0..n).filter(|&v| next[v].is_none()).collect()
        };
        let sem_base = at;
        // Gpu: the completion word, then one word per wide fan-out, 32 bits each.
        let sem_count = if gpu {
            if n > 0 { 1 + wide.len() as u64 } else { 0 }
        } else {
            ends.len() as u64
        };
        let sem_bytes = if gpu {
            (sem_count * 4).next_multiple_of(SEMAPHORE_BYTES)
        } else {
            sem_count * SEMAPHORE_BYTES
        };
        let size = (sem_base + sem_bytes).max(NODE_ALIGN);
        let mem = Memory::alloc(&self.gpu, MemoryDesc::video(size).with_cpu().low())?;
        let base = mem.va();
        let mut semaphore = vec![None; n];
        for (k, &v) in ends.iter().enumerate() {
            semaphore[v] = Some(base + sem_base + k as u64 * SEMAPHORE_BYTES);
        }
        if sem_bytes > 0 {
            mem.fill(sem_base, sem_bytes, 0)?;
        }
        let done = base + sem_base;
        let signal = |k: usize| done + 4 * (k as u64 + 1);
        let target = |t: Target| match t {
            Target::Node(w) if indeg[w] > 1 => (base + offsets[w], DependentAction::Decrement),
            Target::Node(w) => (base + offsets[w], DependentAction::Schedule),
            Target::Null(k) => (
                base + null_base + k as u64 * null_bytes,
                DependentAction::Schedule,
            ),
        };
        // Each node's constant bank 0 as its QMD binds it, for its predecessor to prefetch.
        let banks: Vec<qmd::ConstBuffer> = offsets
            .iter()
            .zip(&planned)
            .map(|(&o, p)| qmd::ConstBuffer {
                va: base + o + QMD_BYTES,
                size: bank0_size(&p.kernel),
            })
            .collect();
        let prefetch = |d: [Option<Target>; 2]| {
            d.map(|t| match t {
                Some(Target::Node(w)) => Some(banks[w]),
                _ => None,
            })
        };
        // A programmatic consumer is scheduled at its producer's pre-exit, before a POST prefetch by the producer
        // could land: it prefetches its own bank 0 instead (PRE), as libcuda's programmatic graph nodes do
        // (apex-trace of examples/pdl_latency, H100, 580.159.04).
        let programmatic_edge =
            |v: usize, w: usize| next[v] == Some(w) && graph.nodes()[w].is_programmatic();
        let form = |v: usize| GraphNodeForm {
            dependents: dependents[v].map(|t| t.map(target)),
            prefetch: prefetch(dependents[v].map(|t| match t {
                Some(Target::Node(w)) if programmatic_edge(v, w) => None,
                t => t,
            })),
            counter: if indeg[v] > 1 { indeg[v] as u16 } else { 0 },
            armed: indeg[v] > 0 && !host_sent[v],
            done: match signal_of[v] {
                Some(k) => Some(signal(k)),
                None => deps.succs(id(v)).is_empty().then_some(done),
            },
        };

        // QMDs and constant banks, written once.
        let action = self.chain_action;
        let qmd_words = self.version.size_bytes() / 4;
        let windows = (self.shared_window(), self.local_window());
        let mut nodes = Vec::with_capacity(n);
        for (v, p) in planned.into_iter().enumerate() {
            let offset = offsets[v];
            let cb_va = base + offset + QMD_BYTES;
            let params = qmd_params(
                &p.kernel,
                &p.cfg,
                p.shape,
                cb_va,
                self.local_per_thread,
                semaphore[v].map(|s| (s, 1)),
            )?;
            let link = if gpu {
                None
            } else {
                next[v].map(|w| (base + offsets[w], action))
            };
            let form = gpu.then(|| form(v));
            // A programmatic edge (a chain link into a node whose kernel waits for its producer itself): the producer
            // arrives at a latch of its own, numbered by node, and lets the consumer be scheduled at pre-exit.
            let arrive = next[v]
                .filter(|&w| graph.nodes()[w].is_programmatic())
                .map(|_| latch_id(v));
            let wait = prev[v]
                .filter(|_| graph.nodes()[v].is_programmatic())
                .map(latch_id);
            let latch = (arrive, wait);
            let mut q = [0u32; QMD_WORDS];
            qmd::build(self.version, &params, &mut q)?;
            finish_node(self.version, &mut q, form.as_ref(), link, latch)?;
            mem.write_words(offset, &q[..qmd_words])?;
            let mut driver = [0u32; DRIVER_WORDS];
            driver_words(&mut driver, &p.cfg, p.shape.1, windows);
            mem.write_words(offset + QMD_BYTES, &driver)?;
            let bank = (DRIVER_BYTES + p.params.len()).next_multiple_of(16);
            let params_at = offset + QMD_BYTES + DRIVER_BYTES as u64;
            mem.write(params_at, &p.params)?;
            let pad = (bank - DRIVER_BYTES - p.params.len()) as u64;
            if pad > 0 {
                mem.fill(params_at + p.params.len() as u64, pad, 0)?;
            }
            nodes.push(ExecNode {
                kernel: p.kernel,
                copy: p.copy,
                cfg: p.cfg,
                qmd: params,
                next: link,
                form,
                latch,
                offset,
                semaphore: semaphore[v],
                qmd_shadow: q,
                driver_shadow: driver,
            });
        }
        // Null grids: any node's QMD with no blocks (only its scheduling fields matter).
        for (k, deps_of) in nulls.iter().enumerate() {
            let mut q = [0u32; QMD_WORDS];
            // Any node's parameters but a cluster shape: a null grid is a plain GRID_CTA QMD.
            let p = QmdParams {
                cluster: None,
                ..nodes[0].qmd
            };
            qmd::build(self.version, &p, &mut q)?;
            qmd::set_null_grid(self.version, &mut q)?;
            let f = GraphNodeForm {
                dependents: deps_of.map(|t| t.map(target)),
                prefetch: prefetch(*deps_of),
                counter: 0,
                armed: true,
                done: None,
            };
            qmd::set_graph_node(self.version, &mut q, &f)?;
            qmd::keep_constant_cache(self.version, &mut q)?;
            mem.write_words(null_base + k as u64 * null_bytes, &q[..qmd_words])?;
        }

        let (words, cuts, arm_words, arm_cuts, heads_sent, waits) = if gpu {
            gpu_methods(&GpuPlan {
                deps: &deps,
                indeg: &indeg,
                wide: &wide,
                host_sent: &host_sent,
                qmd_va: &|v| base + offsets[v],
                null_va: &|k| base + null_base + k as u64 * null_bytes,
                nulls: nulls.len(),
                done,
            })?
        } else {
            front_end_methods(&deps, &prev, &ends, &semaphore, |v| base + offsets[v])?
        };
        debug_assert!(
            ends.iter().all(|&e| semaphore[e].is_some()),
            "every chain end has a semaphore"
        );

        let all = words.len() + arm_words.len();
        let (methods_mem, pieces, arm_pieces) = if all == 0 {
            (None, Vec::new(), Vec::new())
        } else {
            let m = Memory::alloc(
                &self.gpu,
                MemoryDesc::video(all as u64 * 4).with_cpu().low(),
            )?;
            m.write_words(0, &words)?;
            m.write_words(words.len() as u64 * 4, &arm_words)?;
            let at = |start: usize, (s, len): (usize, usize)| {
                (m.va() + (start + s) as u64 * 4, len as u64)
            };
            let max = Queue::MAX_PREBUILT_DWORDS as usize;
            let pieces = split(&cuts, max).into_iter().map(|p| at(0, p)).collect();
            let arm_pieces = split(&arm_cuts, max)
                .into_iter()
                .map(|p| at(words.len(), p))
                .collect();
            (Some(m), pieces, arm_pieces)
        };
        let stats = GraphStats {
            nodes: n,
            edges: deps.edges().len(),
            heads: heads_sent,
            links: n - heads_sent,
            waits,
            semaphores: sem_count as usize,
            method_words: words.len(),
            entries: pieces.len(),
            nulls: nulls.len(),
            armed: arm_cuts.len(),
        };
        debug!(?stats, "graph instantiated");
        Ok(GraphExec {
            queue_id: self.id,
            mem,
            _methods_mem: methods_mem,
            methods: words,
            arm_methods: arm_words,
            schedule: if gpu {
                GraphSchedule::Gpu
            } else {
                GraphSchedule::FrontEnd
            },
            completion: (gpu && n > 0).then_some(done),
            pieces,
            arm_pieces,
            armed: false,
            nodes,
            version: self.version,
            limits: self.limits,
            windows,
            generation,
            banks_written: true,
            printf,
            last: None,
            timeout: self.timeout,
            scratch: vec![0; MAX_PARAM_BYTES],
            stats,
        })
    }

    /// Runs `exec` once, after every earlier launch and copy of this queue; later ones run after it. One doorbell;
    /// no allocation and no system call (once the queue has seen the graph's modules, and unless the ring or the
    /// pushbuffer is full). The fence completes when every node has completed and its writes are visible to the CPU.
    /// An error if `exec` was instantiated on another queue.
    ///
    /// # Safety
    /// Every kernel of the graph runs with the arguments it was recorded (or last updated) with, and may read and
    /// write any memory they lead it to. The caller guarantees that each node's declared reads and writes cover
    /// what it accesses (the graph orders nothing else), that this memory is alive, and that memory the graph
    /// writes is not in use elsewhere until the fence completes.
    pub unsafe fn replay_graph(&mut self, exec: &mut GraphExec) -> Result<Fence> {
        if exec.queue_id != self.id {
            return Err(Error::GraphQueue {
                built: exec.queue_id,
                used: self.id,
            });
        }
        self.end_open_chain()?;
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        if let Some(fifo) = &exec.printf
            && !self.printf.as_ref().is_some_and(|f| Arc::ptr_eq(f, fifo))
            && let Some(old) = self.printf.replace(fifo.clone())
        {
            // As a launch of a module with a FIFO of its own does: drain the one held so far.
            let _ = old.drain();
        }
        if !exec.pieces.is_empty() {
            let prev = self.queue.last_submitted();
            let prev_done = self.settled_now(prev);
            let new_code = self.seen_generation < exec.generation;
            let invalidate = new_code || exec.banks_written;
            if !prev_done || invalidate {
                let timeline_va = self.queue.timeline().va();
                let order = self.ordering;
                // Released by nothing: the replay's own release below covers this value too.
                self.queue.record(16, Signal::Recorded, |p, _| {
                    if invalidate {
                        p.invalidate_shader_caches_no_wfi();
                    }
                    if !prev_done {
                        order.wait(p, timeline_va, prev);
                    }
                })?;
                if new_code {
                    self.seen_generation = newest_generation();
                }
                exec.banks_written = false;
            }
            if !exec.armed {
                for &(va, dwords) in &exec.arm_pieces {
                    self.queue.push_prebuilt(va, dwords)?;
                }
                exec.armed = true;
            }
            for &(va, dwords) in &exec.pieces {
                self.queue.push_prebuilt(va, dwords)?;
            }
        }
        let fence = if exec.pieces.is_empty() {
            self.queue.record(0, Signal::Host, |_, _| {})?
        } else {
            // The pieces end with acquires that pass only once every node has completed, each sink after its
            // system-scope membar: release at once instead of waiting for the engine to idle (~1.5 us per replay,
            // which back-to-back replays pay between each other). The front end then released the value itself,
            // so what follows needs no acquire of it.
            let timeline_va = self.queue.timeline().va();
            let fence = self.queue.record(8, Signal::Recorded, |p, own| {
                p.sem_release(timeline_va, own, Release::NOW_64)
            })?;
            self.front_settled = fence.value();
            fence
        };
        self.queue.kick();
        exec.last = Some(fence.clone());
        Ok(fence)
    }
}

/// Prebuilt methods: (replay words, their cut points, arming words, their cut points, nodes sent, acquires).
type Methods = (Vec<u32>, Vec<usize>, Vec<u32>, Vec<usize>, usize, usize);

/// Where a node's dependent action goes: another node, or a null grid that spreads it further.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Node(usize),
    Null(usize),
}

/// The (at most two) dependents that reach every node of `succs`: the nodes themselves when there are at most
/// two, else two balanced halves, each a node or a null grid (appended to `nulls`) spreading it further, so no
/// successor is more than log2(len) null grids away.
fn spread(succs: &[usize], nulls: &mut Vec<[Option<Target>; 2]>) -> [Option<Target>; 2] {
    fn half(part: &[usize], nulls: &mut Vec<[Option<Target>; 2]>) -> Target {
        if let [v] = part {
            return Target::Node(*v);
        }
        let d = spread(part, nulls);
        nulls.push(d);
        Target::Null(nulls.len() - 1)
    }
    match succs {
        [] => [None, None],
        [a] => [Some(Target::Node(*a)), None],
        [a, b] => [Some(Target::Node(*a)), Some(Target::Node(*b))],
        _ => {
            let (l, r) = succs.split_at(succs.len() / 2);
            [Some(half(l, nulls)), Some(half(r, nulls))]
        }
    }
}

/// What [`gpu_methods`] needs of an instantiation.
struct GpuPlan<'a> {
    deps: &'a crate::launch::graph::Dependencies,
    indeg: &'a [usize],
    /// Nodes whose successors the front end sends, in topological order; the k-th adds 1 to the word `4(k + 1)`
    /// bytes past `done`.
    wide: &'a [usize],
    /// Nodes the front end schedules (a wide fan-out's successors with no other predecessor).
    host_sent: &'a [bool],
    qmd_va: &'a dyn Fn(usize) -> u64,
    null_va: &'a dyn Fn(usize) -> u64,
    nulls: usize,
    /// The completion word; the wide fan-outs' words follow it.
    done: u64,
}

/// The methods of [`GraphSchedule::Gpu`]: send every root; for each wide fan-out in topological order, wait for its
/// word, then send its successors that have no other predecessor and count the others down (PCAS
/// DECREMENT_DEPENDENCE); acquire the completion word at the number of sinks (each adds 1 when it has completed);
/// finally zero the words for the next replay (they start zeroed at instantiation). Arming, pushed before
/// the first replay and after an update rewrote a QMD: a copying PCAS for every node the work distributor
/// schedules, sinks first, which records its counter and requirement without running it.
fn gpu_methods(plan: &GpuPlan<'_>) -> Result<Methods> {
    let GpuPlan {
        deps,
        indeg,
        wide,
        host_sent,
        qmd_va,
        null_va,
        nulls,
        done,
    } = *plan;
    let n = indeg.len();
    if n == 0 {
        return Ok((Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0, 0));
    }
    let id = NodeId::at;
    let roots: Vec<usize> = deps
        .order()
        .iter()
        .map(|v| v.index())
        .filter(|&v| indeg[v] == 0)
        .collect();
    let sinks = (0..n).filter(|&v| deps.succs(id(v)).is_empty()).count();
    let fan_edges: usize = wide.iter().map(|&u| deps.succs(id(u)).len()).sum();
    let reset = wide.len() + 1;
    let mut words = vec![
        0u32;
        PCAS_WORDS * (roots.len() + fan_edges)
            + SEMAPHORE_WORDS * (wide.len() + 1 + reset)
    ];
    let mut push = Push::new(&mut words);
    let mut cuts = Vec::with_capacity(roots.len() + fan_edges + wide.len() + 1 + reset);
    for &r in &roots {
        push.send_pcas(qmd_va(r));
        cuts.push(push.len());
    }
    for (k, &u) in wide.iter().enumerate() {
        push.sem_acquire(
            done + 4 * (k as u64 + 1),
            1,
            Acquire::CircularGeq,
            false,
            false,
        );
        for v in deps.succs(id(u)).iter().map(|v| v.index()) {
            if host_sent[v] {
                push.send_pcas(qmd_va(v));
            } else {
                push.send_pcas_decrement(qmd_va(v));
            }
            // Entries may end between the sends: the acquire before them stays first.
            cuts.push(push.len());
        }
    }
    push.sem_acquire(done, sinks as u64, Acquire::CircularGeq, false, false);
    cuts.push(push.len());
    // Zero the words for the next replay with the front end's own releases, in order with its acquires (a reset by
    // the compute engine could land after the next replay's acquire had read a stale 1). Every add of this replay
    // has landed: each wide node's before its acquire passed, every sink's before the last one did.
    for k in 0..reset {
        push.sem_release(
            done + 4 * k as u64,
            0,
            Release {
                wfi: false,
                wide: false,
                timestamp: false,
            },
        );
        cuts.push(push.len());
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    words.truncate(len);

    let armed: Vec<usize> = deps
        .order()
        .iter()
        .rev()
        .map(|v| v.index())
        .filter(|&v| indeg[v] > 0 && !host_sent[v])
        .collect();
    let mut arm = vec![0u32; PCAS_WORDS * (armed.len() + nulls)];
    let mut push = Push::new(&mut arm);
    let mut arm_cuts = Vec::with_capacity(armed.len() + nulls);
    for v in armed {
        push.send_pcas(qmd_va(v));
        arm_cuts.push(push.len());
    }
    for k in (0..nulls).rev() {
        push.send_pcas(null_va(k));
        arm_cuts.push(push.len());
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    arm.truncate(len);
    let sent = roots.len() + host_sent.iter().filter(|&&h| h).count();
    Ok((words, cuts, arm, arm_cuts, sent, 1 + wide.len()))
}

/// The methods of [`GraphSchedule::FrontEnd`] (see [`GraphExec`]): heads with their waits, the sinks, the resets.
fn front_end_methods(
    deps: &crate::launch::graph::Dependencies,
    prev: &[Option<usize>],
    ends: &[usize],
    semaphore: &[Option<u64>],
    qmd_va: impl Fn(usize) -> u64,
) -> Result<Methods> {
    let id = NodeId::at;
    let n = semaphore.len();
    // The heads (every node that is no chain link), by level, then topological order.
    let levels = deps.levels();
    let mut position = vec![0usize; n];
    for (p, v) in deps.order().iter().enumerate() {
        position[v.index()] = p;
    }
    let mut heads: Vec<usize> = (0..n).filter(|&v| prev[v].is_none()).collect();
    heads.sort_unstable_by_key(|&v| (levels[v], position[v]));
    let heads = &heads[..];
    let preds_total: usize = heads.iter().map(|&h| deps.preds(id(h)).len()).sum();
    let sinks: Vec<usize> = deps
        .order()
        .iter()
        .map(|v| v.index())
        .filter(|&v| deps.succs(id(v)).is_empty())
        .collect();
    let capacity =
        SEMAPHORE_WORDS * (preds_total + sinks.len() + ends.len()) + PCAS_WORDS * heads.len();
    let mut words = vec![0u32; capacity];
    let mut push = Push::new(&mut words);
    // Where the methods may be cut into GPFIFO entries: between groups, never inside one.
    let mut cuts = Vec::new();
    let mut known = vec![false; n];
    let mut waits = 0;
    let wait = |push: &mut Push<'_>, known: &mut Vec<bool>, v: usize| {
        let Some(sem) = semaphore[v] else {
            return false;
        };
        push.sem_acquire(sem, 1, Acquire::CircularGeq, true, false);
        // Its completion implies its ancestors' (it started after them).
        let mut stack = vec![v];
        while let Some(u) = stack.pop() {
            if !std::mem::replace(&mut known[u], true) {
                stack.extend(deps.preds(id(u)).iter().map(|p| p.index()));
            }
        }
        true
    };
    for &h in heads {
        for p in deps.preds(id(h)) {
            if !known[p.index()] && wait(&mut push, &mut known, p.index()) {
                waits += 1;
            }
        }
        push.send_pcas(qmd_va(h));
        cuts.push(push.len());
    }
    for &s in &sinks {
        if !known[s] && wait(&mut push, &mut known, s) {
            waits += 1;
            cuts.push(push.len());
        }
    }
    for &e in ends {
        if let Some(sem) = semaphore[e] {
            push.sem_release(
                sem,
                0,
                Release {
                    wfi: false,
                    wide: true,
                    timestamp: false,
                },
            );
            cuts.push(push.len());
        }
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    words.truncate(len);
    debug_assert!(
        ends.iter().all(|&e| known[e]),
        "every semaphore is acquired before it is reset"
    );
    Ok((words, cuts, Vec::new(), Vec::new(), heads.len(), waits))
}

/// The driver words of a node's constant bank 0: launch shape, windows, stack, and the cluster words.
fn driver_words(
    out: &mut [u32; DRIVER_WORDS],
    cfg: &LaunchConfig,
    cluster: Option<[u32; 3]>,
    (shared, local): (u64, u64),
) {
    write_driver_words(out, cfg.block, cfg.grid, shared, local);
    write_cluster_words(
        &mut out[CLUSTER_WORDS_START / 4..][..CLUSTER_WORDS],
        cfg.grid,
        cluster,
    );
}

/// Cuts `[0, last cut)` into runs of at most `max` words, at the cut points (each group is far shorter than
/// `max`). Returns (start, words) pairs.
fn split(cuts: &[usize], max: usize) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let (mut start, mut last) = (0, 0);
    for &c in cuts {
        if c - start > max && last > start {
            pieces.push((start, last - start));
            start = last;
        }
        last = c;
    }
    if last > start {
        pieces.push((start, last - start));
    }
    pieces
}

impl GraphExec {
    /// The widest fan-out [`GraphSchedule::Gpu`] leaves to the compute work distributor (over at most two levels
    /// of null grids); the successors of a wider one are sent by the front end once the node has completed.
    pub const MAX_GPU_FAN_OUT: usize = 8;

    /// What the graph looks like on the GPU: heads, links, waits, semaphores, null grids, method words.
    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the graph has no nodes (a replay then only orders the queue).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The queue this exec was instantiated on ([`ComputeQueue::id`]).
    pub fn queue_id(&self) -> u64 {
        self.queue_id
    }

    /// The prebuilt methods a replay pushes (decode them with [`crate::pushbuf::decode`]).
    pub fn methods(&self) -> &[u32] {
        &self.methods
    }

    /// The prebuilt methods that arm the nodes the GPU schedules, pushed before the first replay and after an
    /// update that rewrote a QMD (empty for [`GraphSchedule::FrontEnd`]).
    pub fn arm_methods(&self) -> &[u32] {
        &self.arm_methods
    }

    /// How this exec's dependencies are resolved: the queue's [`GraphSchedule`] at instantiation, or `FrontEnd`
    /// where the QMD layout or a fan-in too wide for the work distributor's counter ruled `Gpu` out.
    pub fn schedule(&self) -> GraphSchedule {
        self.schedule
    }

    /// The 32-bit word every sink adds 1 to when it completes ([`GraphSchedule::Gpu`]; a replay zeroes it first).
    pub fn completion(&self) -> Option<u64> {
        self.completion
    }

    /// The GPU address of `node`'s QMD (what SEND_PCAS or its chain predecessor names).
    pub fn qmd_va(&self, node: NodeId) -> Option<u64> {
        self.nodes
            .get(node.index())
            .map(|n| self.mem.va() + n.offset)
    }

    /// The completion semaphore `node` releases, when it ends a chain ([`GraphSchedule::FrontEnd`]).
    pub fn semaphore(&self, node: NodeId) -> Option<u64> {
        self.nodes.get(node.index()).and_then(|n| n.semaphore)
    }

    /// The QMD `node`'s QMD schedules when it completes (its chain successor), if any ([`GraphSchedule::FrontEnd`]).
    pub fn chain_next(&self, node: NodeId) -> Option<u64> {
        self.nodes
            .get(node.index())
            .and_then(|n| n.next.map(|(va, _)| va))
    }

    /// The fence of the last replay, if any.
    pub fn last_replay(&self) -> Option<&Fence> {
        self.last.as_ref()
    }

    /// Gives launch `node` new arguments and a new shape (grid, block, dynamic shared memory) for later replays,
    /// checked as a launch is: the arguments against the kernel's parameter table, the shape against the device
    /// limits. Refused: a copy node, a different cluster shape. Waits for the previous replay to complete, then
    /// rewrites only this node's QMD words that change, its driver words and its parameters; nothing allocates.
    /// Chain links use the queue's [`ChainAction`] of instantiation time: the default fetches each linked QMD
    /// afresh; `ChainAction::Schedule` is meant for QMDs that never change, so instantiate a graph whose nodes will
    /// be updated with the default.
    pub fn update_launch(
        &mut self,
        node: NodeId,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        let len = self.nodes.len();
        let n = self
            .nodes
            .get_mut(node.index())
            .ok_or(Error::Graph(GraphError::NoSuchNode {
                node: node.index(),
                len,
            }))?;
        if n.copy {
            return Err(Error::GraphUpdate {
                node: node.index(),
                why: "it is a copy; only kernel launches take new arguments (record a new graph to change a copy)"
                    .into(),
            });
        }
        let k = n.kernel.info();
        if *cfg == n.cfg {
            // Same shape: the QMD and driver words stay as they are; only the parameter block changes.
            let bytes = pack(k, args, &mut self.scratch)?;
            if let Some(f) = &self.last
                && !f.is_done()
            {
                // The GPU may still be reading this node's constant bank.
                f.wait(self.timeout)?;
            }
            self.mem.write(
                n.offset + QMD_BYTES + DRIVER_BYTES as u64,
                &self.scratch[..bytes],
            )?;
            self.banks_written = true;
            return Ok(());
        }
        let shared = validate(k, cfg, &self.limits)?;
        let cluster = cluster_shape(k, cfg, &self.limits)?;
        if cluster != n.qmd.cluster {
            return Err(Error::GraphUpdate {
                node: node.index(),
                why: format!(
                    "its cluster shape would change from {:?} to {cluster:?}; the cluster shape is fixed when the \
                     graph is instantiated (record a new graph to change it)",
                    n.qmd.cluster
                ),
            });
        }
        let bytes = pack(k, args, &mut self.scratch)?;
        if let Some(f) = &self.last
            && !f.is_done()
        {
            // The GPU may still be reading this node's QMD and constant bank.
            f.wait(self.timeout)?;
        }
        let mut p = n.qmd;
        p.grid = cfg.grid;
        p.block = cfg.block;
        p.shared_bytes = shared.max(1024).next_multiple_of(256);
        let mut q = [0u32; QMD_WORDS];
        qmd::build(self.version, &p, &mut q)?;
        finish_node(self.version, &mut q, n.form.as_ref(), n.next, n.latch)?;
        if n.form.is_some() {
            // The work distributor may hold the old QMD: the next replay arms every node again, which
            // invalidates it.
            self.armed = false;
        }
        let qmd_words = self.version.size_bytes() / 4;
        write_changed(
            &self.mem,
            n.offset,
            &mut n.qmd_shadow[..qmd_words],
            &q[..qmd_words],
        )?;
        let mut driver = n.driver_shadow;
        driver_words(&mut driver, cfg, cluster, self.windows);
        write_changed(
            &self.mem,
            n.offset + QMD_BYTES,
            &mut n.driver_shadow,
            &driver,
        )?;
        self.mem.write(
            n.offset + QMD_BYTES + DRIVER_BYTES as u64,
            &self.scratch[..bytes],
        )?;
        n.qmd = p;
        n.cfg = *cfg;
        self.banks_written = true;
        Ok(())
    }

    /// The shape `node` launches with now (as recorded or last updated).
    pub fn launch_config(&self, node: NodeId) -> Option<&LaunchConfig> {
        self.nodes.get(node.index()).map(|n| &n.cfg)
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // The GPU may still read the QMDs, banks and methods of the last replay: let it finish (briefly; a hung
        // queue is torn down with its channel anyway).
        if let Some(f) = &self.last
            && let Err(e) = f.wait(Duration::from_secs(2))
        {
            tracing::warn!(error = %e, "a graph's last replay did not complete before the graph was dropped");
        }
    }
}

/// The latch a programmatic producer arrives at: one per producing node, so every edge of a graph has its own;
/// replays run one after another on the queue, so reusing them across replays is safe (as libcuda's graphs do).
fn latch_id(node: usize) -> u32 {
    // libcuda numbers its latches from small values upwards; these stay in the 24 bits a latch id keeps.
    (node as u32 & 0x00ff_ffff) + 1
}

/// Makes a node's QMD, built by [`qmd::build`], what the graph needs: its dependents, counter and completion
/// (`form`, GPU-resolved) or its chain link (`link`, front-end schedule), the constant cache kept, its programmatic
/// edges (`latch`: a consumer also prefetches its own bank 0, since it starts at its producer's pre-exit, before a
/// POST prefetch by the producer would land, as libcuda's programmatic nodes do). Used when a graph is instantiated
/// and when a node is updated.
fn finish_node(
    version: QmdVersion,
    q: &mut [u32; QMD_WORDS],
    form: Option<&qmd::GraphNodeForm>,
    link: Option<(u64, ChainAction)>,
    latch: (Option<u32>, Option<u32>),
) -> Result<()> {
    if let Some(f) = form {
        qmd::set_graph_node(version, q, f)?;
        if latch.1.is_some() {
            qmd::prefetch_own_bank0(version, q)?;
        }
    } else if link.is_some() {
        qmd::set_chain_link(version, q, link)?;
    }
    qmd::keep_constant_cache(version, q)?;
    set_latches(version, q, latch)?;
    Ok(())
}

/// Applies a node's programmatic edges to its QMD.
fn set_latches(
    version: QmdVersion,
    q: &mut [u32; QMD_WORDS],
    (arrive, wait): (Option<u32>, Option<u32>),
) -> Result<()> {
    if let Some(l) = arrive {
        qmd::set_latch_arrive(version, q, l)?;
    }
    if let Some(l) = wait {
        qmd::set_latch_wait(version, q, l)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn methods_are_cut_between_groups() {
        assert_eq!(split(&[], 10), vec![]);
        assert_eq!(split(&[4, 8, 12], 100), vec![(0, 12)]);
        assert_eq!(split(&[4, 8, 12], 10), vec![(0, 8), (8, 4)]);
        assert_eq!(split(&[6, 12, 18, 24], 12), vec![(0, 12), (12, 12)]);
        // Every piece within the limit, together covering everything.
        let cuts: Vec<usize> = (1..=100).map(|i| i * 7).collect();
        let pieces = split(&cuts, 50);
        assert!(pieces.iter().all(|&(_, l)| l <= 50));
        assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), 700);
        for w in pieces.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0);
        }
    }
}
