//! Launch graphs on the direct path: a [`Graph`] instantiated once into QMDs, constant banks, completion
//! semaphores and methods in memory of its own, then replayed with one doorbell and no allocation.
//!
//! How a graph is scheduled and replayed is documented on [`GraphExec`] (and in docs/graphs.md).
//!
//! The code is split by concern: `instantiate` (`ComputeQueue::instantiate_graph`: the plan, the layout, the QMDs
//! and constant banks), `methods` (the prebuilt methods of either schedule, and their cut into GPFIFO entries),
//! `replay` (`ComputeQueue::replay_graph`) and `node` (a node's QMD and driver words, as instantiated and as
//! `GraphExec::update_launch` rewrites them). This file holds the instantiated graph: its types and accessors.
//!
//! [`Graph`]: crate::launch::graph::Graph

mod instantiate;
mod methods;
mod node;
mod replay;

use std::sync::Arc;
use std::time::Duration;

use crate::launch::cbank::DRIVER_BYTES;
use crate::launch::graph::NodeId;
use crate::launch::qmd::{self, ChainAction, QMD_WORDS, QmdParams, QmdVersion};
use crate::module::Kernel;
use crate::module::printf::PrintfFifo;
use crate::pushbuf::Fence;
use crate::rm::Memory;

use super::{ComputeQueue, LaunchConfig, Limits};

/// Words of constant bank 0 before the parameters.
const DRIVER_WORDS: usize = DRIVER_BYTES / 4;

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
    ///
    /// [`QMD_BYTES`]: super::QMD_BYTES
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
///
/// [`Graph`]: crate::launch::graph::Graph
/// [`Graph::dependencies`]: crate::launch::graph::Graph::dependencies
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
    /// A node's module binds a constant bank another instance writes ([`crate::module::Module::shares_constants`]):
    /// every replay invalidates the constant caches, since writes to it are not seen here.
    shared_banks: bool,
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
