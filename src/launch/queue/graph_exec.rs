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
use crate::launch::module::{Kernel, newest_generation};
use crate::launch::params::{Arg, pack};
use crate::launch::printf::PrintfFifo;
use crate::launch::qmd::{self, ChainAction, QMD_WORDS, QmdParams, QmdVersion};
use crate::launch::{Error, Result};
use crate::pushbuf::{Acquire, Fence, Push, Queue, Release, Signal};
use crate::rm::{Memory, MemoryDesc};

use super::{
    ComputeQueue, LOCAL_RESERVE, LaunchConfig, Limits, MAX_PARAM_BYTES, QMD_BYTES, cluster_shape,
    qmd_params, validate, write_changed,
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

/// What an instantiated graph looks like on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Nodes (launches and copies).
    pub nodes: usize,
    /// Edges of the reduced dependency graph.
    pub edges: usize,
    /// Nodes sent by the prebuilt methods (SEND_PCAS): the first node of each chain.
    pub heads: usize,
    /// Nodes the GPU schedules itself, as the dependent QMD of their only predecessor.
    pub links: usize,
    /// Host semaphore acquires in the prebuilt methods (waits on predecessors, then on the sinks).
    pub waits: usize,
    /// Completion semaphores: one per chain end.
    pub semaphores: usize,
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
    /// Its chain successor's QMD, when it has one.
    next: Option<(u64, ChainAction)>,
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
/// acquire on the queue's last value unless the CPU already sees it reached: the replay starts after earlier
/// work), pushes the prebuilt methods (one GPFIFO entry per 2^21 − 1 words), records the timeline release (after
/// wait-for-idle) that later work and the fence wait for, and rings the doorbell once. It writes a handful of
/// words and allocates nothing.
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
    /// (GPU address, words) of each GPFIFO entry a replay pushes.
    pieces: Vec<(u64, u64)>,
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
        let mut linked = vec![false; n];
        for (u, next) in next.iter_mut().enumerate() {
            if let [v] = deps.succs(id(u))
                && deps.preds(*v).len() == 1
            {
                *next = Some(v.index());
                linked[v.index()] = true;
            }
        }
        let mut prev: Vec<Option<usize>> = vec![None; n];
        for (u, w) in next.iter().enumerate() {
            if let Some(w) = *w {
                prev[w] = Some(u);
            }
        }
        let levels = deps.levels();
        let mut position = vec![0usize; n];
        for (p, v) in deps.order().iter().enumerate() {
            position[v.index()] = p;
        }
        let mut heads: Vec<usize> = (0..n).filter(|&v| !linked[v]).collect();
        heads.sort_unstable_by_key(|&v| (levels[v], position[v]));

        // Layout: each node's QMD and constant bank, then the semaphores of the chain ends.
        let mut offsets = Vec::with_capacity(n);
        let mut at = 0u64;
        for p in &planned {
            offsets.push(at);
            let bank = (DRIVER_BYTES as u64 + u64::from(p.kernel.info().param_cbank_size))
                .next_multiple_of(16);
            at += (QMD_BYTES + bank).next_multiple_of(NODE_ALIGN);
        }
        let ends: Vec<usize> = (0..n).filter(|&v| next[v].is_none()).collect();
        let sem_base = at;
        let size = (sem_base + ends.len() as u64 * SEMAPHORE_BYTES).max(NODE_ALIGN);
        let mem = Memory::alloc(&self.gpu, MemoryDesc::video(size).with_cpu().low())?;
        let base = mem.va();
        let mut semaphore = vec![None; n];
        for (k, &v) in ends.iter().enumerate() {
            semaphore[v] = Some(base + sem_base + k as u64 * SEMAPHORE_BYTES);
        }
        if !ends.is_empty() {
            mem.fill(sem_base, ends.len() as u64 * SEMAPHORE_BYTES, 0)?;
        }

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
            let link = next[v].map(|w| (base + offsets[w], action));
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
            if link.is_some() {
                qmd::set_chain_link(self.version, &mut q, link)?;
            }
            qmd::keep_constant_cache(self.version, &mut q)?;
            set_latches(self.version, &mut q, latch)?;
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
                latch,
                offset,
                semaphore: semaphore[v],
                qmd_shadow: q,
                driver_shadow: driver,
            });
        }

        // The methods: heads with their waits, the sinks, the resets.
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
        for &h in &heads {
            for p in deps.preds(id(h)) {
                if !known[p.index()] && wait(&mut push, &mut known, p.index()) {
                    waits += 1;
                }
            }
            push.send_pcas(base + offsets[h]);
            cuts.push(push.len());
        }
        for &s in &sinks {
            if !known[s] && wait(&mut push, &mut known, s) {
                waits += 1;
                cuts.push(push.len());
            }
        }
        for &e in &ends {
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

        let (methods_mem, pieces) = if words.is_empty() {
            (None, Vec::new())
        } else {
            let m = Memory::alloc(
                &self.gpu,
                MemoryDesc::video(words.len() as u64 * 4).with_cpu().low(),
            )?;
            m.write_words(0, &words)?;
            let pieces = split(&cuts, Queue::MAX_PREBUILT_DWORDS as usize)
                .into_iter()
                .map(|(start, len)| (m.va() + start as u64 * 4, len as u64))
                .collect();
            (Some(m), pieces)
        };
        let stats = GraphStats {
            nodes: n,
            edges: deps.edges().len(),
            heads: heads.len(),
            links: n - heads.len(),
            waits,
            semaphores: ends.len(),
            method_words: words.len(),
            entries: pieces.len(),
        };
        debug!(?stats, "graph instantiated");
        Ok(GraphExec {
            queue_id: self.id,
            mem,
            _methods_mem: methods_mem,
            methods: words,
            pieces,
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
            let prev_done = self.queue.timeline().is_reached(prev);
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
            for &(va, dwords) in &exec.pieces {
                self.queue.push_prebuilt(va, dwords)?;
            }
        }
        let fence = self.queue.record(0, Signal::Host, |_, _| {})?;
        self.queue.kick();
        exec.last = Some(fence.clone());
        Ok(fence)
    }
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
    /// What the graph looks like on the GPU: chains, waits, semaphores, method words.
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

    /// The GPU address of `node`'s QMD (what SEND_PCAS or its chain predecessor names).
    pub fn qmd_va(&self, node: NodeId) -> Option<u64> {
        self.nodes
            .get(node.index())
            .map(|n| self.mem.va() + n.offset)
    }

    /// The completion semaphore `node` releases, when it ends a chain.
    pub fn semaphore(&self, node: NodeId) -> Option<u64> {
        self.nodes.get(node.index()).and_then(|n| n.semaphore)
    }

    /// The QMD `node`'s QMD schedules when it completes (its chain successor), if any.
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
        if n.next.is_some() {
            qmd::set_chain_link(self.version, &mut q, n.next)?;
        }
        qmd::keep_constant_cache(self.version, &mut q)?;
        set_latches(self.version, &mut q, n.latch)?;
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
