//! Launch graphs: kernel launches and copies, each declaring the device ranges it reads and writes, plus explicit
//! edges; the dependencies between them are derived here, once, as a minimal DAG.
//!
//! Two nodes recorded in the order `i` then `j` conflict when a range `i` writes overlaps one `j` reads
//! (read-after-write), one `i` reads overlaps one `j` writes (write-after-read) or both write overlapping ranges
//! (write-after-write); `i` must then complete before `j` starts. Ranges are half-open, `[va, va + len)`:
//! adjacent ranges do not overlap, and two reads never conflict. Explicit edges add orderings ranges cannot
//! express (a kernel that signals another through memory it does not declare, say); they may point backwards in
//! recording order, and a cycle among them is [`GraphError::Cycle`].
//!
//! The derived relation is then reduced: an edge `u → v` is dropped when another path from `u` to `v` exists, so
//! what a backend schedules is the transitive reduction (unique for a DAG) — the fewest waits that give the same
//! order. Derivation costs O(n²) bit tests and two n×n bit matrices (n = nodes): 25 MB at 10⁴ nodes, once per
//! instantiation, never per replay. This module is pure logic: no GPU, no allocation after it returns.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::LaunchConfig;
use super::params::{Arg, ParamError, pack};
use crate::module::Kernel;

/// A half-open range of device addresses, `[va, va + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Range {
    /// First byte.
    pub va: u64,
    /// Bytes; an empty range conflicts with nothing.
    pub len: u64,
}

impl Range {
    /// `[va, va + len)`; an error if it wraps past the end of the address space.
    pub fn new(va: u64, len: u64) -> Result<Range, GraphError> {
        if va.checked_add(len).is_none() {
            return Err(GraphError::RangeOverflow { va, len });
        }
        Ok(Range { va, len })
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.va.saturating_add(self.len)
    }

    /// Whether the two ranges share a byte (adjacent ranges do not).
    pub fn overlaps(&self, other: &Range) -> bool {
        self.len > 0 && other.len > 0 && self.va < other.end() && other.va < self.end()
    }
}

/// A node of a [`Graph`]: its position in recording order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(usize);

impl NodeId {
    /// The node's position in recording order (0 for the first node recorded).
    pub fn index(self) -> usize {
        self.0
    }

    /// The id of the node at `index` (within this crate, where the index comes from a graph of the same length).
    pub(crate) fn at(index: usize) -> NodeId {
        NodeId(index)
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a node does.
#[derive(Clone, Debug, PartialEq)]
pub enum Op<K> {
    /// A kernel launch with its packed parameter block (laid out by the kernel's parameter table).
    Launch {
        /// The kernel.
        kernel: K,
        /// Grid, block, shared memory and cluster shape.
        cfg: LaunchConfig,
        /// The parameter block, as `params::pack` lays it out.
        params: Vec<u8>,
    },
    /// A device-to-device copy of `bytes` bytes.
    Copy {
        /// Source address.
        src: u64,
        /// Destination address.
        dst: u64,
        /// Bytes copied.
        bytes: u64,
    },
}

/// One recorded node: what it does and the ranges it declares.
#[derive(Clone, Debug, PartialEq)]
pub struct Node<K> {
    op: Op<K>,
    reads: Vec<Range>,
    writes: Vec<Range>,
    programmatic: bool,
}

impl<K> Node<K> {
    /// What the node does.
    pub fn op(&self) -> &Op<K> {
        &self.op
    }

    /// The ranges it reads.
    pub fn reads(&self) -> &[Range] {
        &self.reads
    }

    /// The ranges it writes.
    pub fn writes(&self) -> &[Range] {
        &self.writes
    }

    /// Whether the node's kernel waits for the grids it depends on itself (`griddepcontrol.wait`,
    /// `cudaGridDependencySynchronize`) before it reads what they wrote, so that a predecessor may let it start
    /// before the predecessor has completed (programmatic dependent launch); see [`Graph::set_programmatic`].
    pub fn is_programmatic(&self) -> bool {
        self.programmatic
    }
}

/// Why one node must complete before another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hazard {
    /// The later node reads what the earlier one writes.
    ReadAfterWrite,
    /// The later node writes what the earlier one reads.
    WriteAfterRead,
    /// Both write the same bytes; the later write must win.
    WriteAfterWrite,
    /// An edge recorded with [`Graph::edge`].
    Explicit,
}

impl Hazard {
    fn bit(self) -> u8 {
        match self {
            Hazard::ReadAfterWrite => 1,
            Hazard::WriteAfterRead => 2,
            Hazard::WriteAfterWrite => 4,
            Hazard::Explicit => 8,
        }
    }
}

/// The reasons behind one edge (an edge may have several).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hazards(u8);

impl Hazards {
    /// Whether `h` is among the reasons.
    pub fn contains(self, h: Hazard) -> bool {
        self.0 & h.bit() != 0
    }

    fn with(self, h: Hazard) -> Hazards {
        Hazards(self.0 | h.bit())
    }

    fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// An edge of the reduced graph: `from` completes before `to` starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Edge {
    /// The earlier node.
    pub from: NodeId,
    /// The later node.
    pub to: NodeId,
    /// Why (the hazards between the two nodes themselves, and whether an explicit edge joins them).
    pub why: Hazards,
}

/// A graph description refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// A node id from another graph, or past this one's end.
    #[error(
        "node #{node} is not in this graph (it has {len} nodes); use the ids this graph's launch and copy calls returned"
    )]
    NoSuchNode {
        /// The index given.
        node: usize,
        /// Nodes in the graph.
        len: usize,
    },
    /// The explicit edges, with the dependencies the ranges imply, form a cycle: no order can satisfy them.
    #[error(
        "the graph's edges form a cycle through nodes {}: no order runs every node after the ones it depends on; \
         remove one of the explicit edges on it",
        cycle_text(nodes)
    )]
    Cycle {
        /// The nodes on the cycle, each depending on the one before (the first on the last).
        nodes: Vec<usize>,
    },
    /// Only launches can be programmatic consumers ([`Graph::set_programmatic`]).
    #[error(
        "node #{0} is a copy, not a launch: only a kernel can wait for its producer itself (griddepcontrol.wait), so \
         only launches can be marked programmatic"
    )]
    NotALaunch(usize),
    /// A range that wraps past the end of the 64-bit address space.
    #[error(
        "the range {va:#x}+{len:#x} wraps past the end of the address space; give the buffer's own address and size"
    )]
    RangeOverflow {
        /// Its start.
        va: u64,
        /// Its length.
        len: u64,
    },
}

fn cycle_text(nodes: &[usize]) -> String {
    let mut s = String::new();
    for n in nodes.iter().chain(nodes.first()) {
        if !s.is_empty() {
            s.push_str(" → ");
        }
        s.push_str(&format!("#{n}"));
    }
    s
}

/// Kernel launches and copies with the ranges they read and write, and explicit edges. `K` is the kernel type of
/// the backend that will run it (the direct path's [`Kernel`], or the public API's).
#[derive(Clone, Debug)]
pub struct Graph<K> {
    nodes: Vec<Node<K>>,
    edges: Vec<(NodeId, NodeId)>,
}

impl<K> Default for Graph<K> {
    fn default() -> Graph<K> {
        Graph {
            nodes: Vec::new(),
            edges: Vec::new(),
        }
    }
}

impl<K> Graph<K> {
    /// An empty graph.
    pub fn new() -> Graph<K> {
        Graph::default()
    }

    /// Records a launch of `kernel` with the packed parameter block `params`; declare its ranges with
    /// [`read`](Self::read) and [`write`](Self::write).
    pub fn launch(&mut self, kernel: K, cfg: LaunchConfig, params: Vec<u8>) -> NodeId {
        self.push(Op::Launch {
            kernel,
            cfg,
            params,
        })
    }

    /// Records a copy of `bytes` bytes from `src` to `dst`; it reads `[src, src + bytes)` and writes
    /// `[dst, dst + bytes)`.
    pub fn copy(&mut self, src: u64, dst: u64, bytes: u64) -> Result<NodeId, GraphError> {
        let (r, w) = (Range::new(src, bytes)?, Range::new(dst, bytes)?);
        let id = self.push(Op::Copy { src, dst, bytes });
        self.nodes[id.0].reads.push(r);
        self.nodes[id.0].writes.push(w);
        Ok(id)
    }

    fn push(&mut self, op: Op<K>) -> NodeId {
        self.nodes.push(Node {
            op,
            reads: Vec::new(),
            writes: Vec::new(),
            programmatic: false,
        });
        NodeId(self.nodes.len() - 1)
    }

    fn check(&self, node: NodeId) -> Result<(), GraphError> {
        if node.0 < self.nodes.len() {
            Ok(())
        } else {
            Err(GraphError::NoSuchNode {
                node: node.0,
                len: self.nodes.len(),
            })
        }
    }

    /// Declares that `node` reads `range`.
    pub fn read(&mut self, node: NodeId, range: Range) -> Result<(), GraphError> {
        self.check(node)?;
        self.nodes[node.0].reads.push(range);
        Ok(())
    }

    /// Declares that `node` writes `range` (a node that reads and writes a range declares both).
    pub fn write(&mut self, node: NodeId, range: Range) -> Result<(), GraphError> {
        self.check(node)?;
        self.nodes[node.0].writes.push(range);
        Ok(())
    }

    /// Orders `from` before `to`, whatever their ranges. An edge from a node to itself is a cycle.
    pub fn edge(&mut self, from: NodeId, to: NodeId) -> Result<(), GraphError> {
        self.check(from)?;
        self.check(to)?;
        if from == to {
            return Err(GraphError::Cycle {
                nodes: vec![from.0],
            });
        }
        self.edges.push((from, to));
        Ok(())
    }

    /// Marks launch `node` as a programmatic consumer: its kernel itself waits for the grids it depends on
    /// (`griddepcontrol.wait`, `cudaGridDependencySynchronize`) before reading what they wrote. A predecessor that
    /// schedules it directly may then let it start once every block of the predecessor has exited or run
    /// `griddepcontrol.launch_dependents`, before the predecessor's writes are known to be visible — as CUDA's
    /// programmatic dependent launch does. A kernel that does not wait would race; copies cannot be marked.
    pub fn set_programmatic(&mut self, node: NodeId) -> Result<(), GraphError> {
        self.check(node)?;
        if !matches!(self.nodes[node.0].op, Op::Launch { .. }) {
            return Err(GraphError::NotALaunch(node.0));
        }
        self.nodes[node.0].programmatic = true;
        Ok(())
    }

    /// Nodes recorded.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The nodes, in recording order (`NodeId::index` is the position).
    pub fn nodes(&self) -> &[Node<K>] {
        &self.nodes
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> Option<&Node<K>> {
        self.nodes.get(id.0)
    }

    /// The id of the node at `index` in recording order.
    pub fn id(&self, index: usize) -> Result<NodeId, GraphError> {
        let id = NodeId(index);
        self.check(id)?;
        Ok(id)
    }

    /// The explicit edges, as recorded.
    pub fn explicit_edges(&self) -> &[(NodeId, NodeId)] {
        &self.edges
    }

    /// The same graph over another kernel type (how a backend takes the public API's graph).
    pub fn map_kernels<L, E>(&self, mut f: impl FnMut(&K) -> Result<L, E>) -> Result<Graph<L>, E> {
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for n in &self.nodes {
            let op = match &n.op {
                Op::Launch {
                    kernel,
                    cfg,
                    params,
                } => Op::Launch {
                    kernel: f(kernel)?,
                    cfg: *cfg,
                    params: params.clone(),
                },
                Op::Copy { src, dst, bytes } => Op::Copy {
                    src: *src,
                    dst: *dst,
                    bytes: *bytes,
                },
            };
            nodes.push(Node {
                op,
                reads: n.reads.clone(),
                writes: n.writes.clone(),
                programmatic: n.programmatic,
            });
        }
        Ok(Graph {
            nodes,
            edges: self.edges.clone(),
        })
    }

    /// The hazards between `i` (recorded first) and `j`.
    fn hazards(&self, i: usize, j: usize) -> Hazards {
        let (a, b) = (&self.nodes[i], &self.nodes[j]);
        let any = |x: &[Range], y: &[Range]| x.iter().any(|r| y.iter().any(|s| r.overlaps(s)));
        let mut h = Hazards::default();
        if any(&a.writes, &b.reads) {
            h = h.with(Hazard::ReadAfterWrite);
        }
        if any(&a.reads, &b.writes) {
            h = h.with(Hazard::WriteAfterRead);
        }
        if any(&a.writes, &b.writes) {
            h = h.with(Hazard::WriteAfterWrite);
        }
        h
    }

    /// Derives the dependencies: hazards in recording order and the explicit edges, transitively reduced.
    pub fn dependencies(&self) -> Result<Dependencies, GraphError> {
        let n = self.nodes.len();
        // Hazard edges, each later node against the earlier ones from the nearest back: a pair already ordered
        // through the edges found so far needs no edge of its own (and no range test).
        let mut reasons: BTreeMap<(usize, usize), Hazards> = BTreeMap::new();
        let mut anc = BitMatrix::new(n);
        for j in 0..n {
            for i in (0..j).rev() {
                if anc.get(j, i) {
                    continue;
                }
                let h = self.hazards(i, j);
                if !h.is_empty() {
                    reasons.insert((i, j), h);
                    anc.or_row_into(i, j);
                    anc.set(j, i);
                }
            }
        }
        drop(anc);
        for &(from, to) in &self.edges {
            let e = reasons.entry((from.0, to.0)).or_default();
            *e = e.with(Hazard::Explicit);
        }
        let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut preds: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &(i, j) in reasons.keys() {
            succs[i].push(j);
            preds[j].push(i);
        }

        // Kahn's algorithm, taking the earliest-recorded ready node first: recording order where nothing forces
        // another.
        let mut indegree: Vec<usize> = preds.iter().map(Vec::len).collect();
        let mut ready: BinaryHeap<Reverse<usize>> =
            (0..n).filter(|&v| indegree[v] == 0).map(Reverse).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(Reverse(v)) = ready.pop() {
            order.push(v);
            for &s in &succs[v] {
                indegree[s] -= 1;
                if indegree[s] == 0 {
                    ready.push(Reverse(s));
                }
            }
        }
        if order.len() < n {
            return Err(GraphError::Cycle {
                nodes: find_cycle(&preds, &indegree),
            });
        }
        let mut pos = vec![0usize; n];
        for (p, &v) in order.iter().enumerate() {
            pos[v] = p;
        }

        // Transitive reduction: in reverse topological order, keep an edge u → s only if s is not reachable
        // through a successor of u that comes earlier in topological order (the only ones that can reach it).
        let mut reach = BitMatrix::new(n);
        let mut kept: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &u in order.iter().rev() {
            let mut s = std::mem::take(&mut succs[u]);
            s.sort_unstable_by_key(|&v| pos[v]);
            for &v in &s {
                if reach.get(u, v) {
                    continue;
                }
                kept[u].push(v);
                reach.or_row_into(v, u);
                reach.set(u, v);
            }
        }
        let mut edges = Vec::new();
        let mut rpreds: Vec<Vec<NodeId>> = vec![Vec::new(); n];
        let mut rsuccs: Vec<Vec<NodeId>> = vec![Vec::new(); n];
        for (u, vs) in kept.iter_mut().enumerate() {
            vs.sort_unstable();
            for &v in vs.iter() {
                edges.push(Edge {
                    from: NodeId(u),
                    to: NodeId(v),
                    why: reasons[&(u, v)],
                });
                rsuccs[u].push(NodeId(v));
                rpreds[v].push(NodeId(u));
            }
        }
        Ok(Dependencies {
            preds: rpreds,
            succs: rsuccs,
            edges,
            order: order.into_iter().map(NodeId).collect(),
        })
    }
}

impl Graph<Kernel> {
    /// Records a launch of a direct-path `kernel` with `args`, packed by the kernel's parameter table (checked as
    /// a launch's are: count and sizes).
    pub fn launch_args(
        &mut self,
        kernel: &Kernel,
        cfg: LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<NodeId, ParamError> {
        let mut params = vec![0u8; kernel.info().param_cbank_size as usize];
        pack(kernel.info(), args, &mut params)?;
        Ok(self.launch(kernel.clone(), cfg, params))
    }
}

/// A cycle among the nodes Kahn's algorithm could not order (each has a predecessor in the same set).
fn find_cycle(preds: &[Vec<usize>], indegree: &[usize]) -> Vec<usize> {
    let stuck = |v: usize| indegree[v] > 0;
    let Some(start) = (0..preds.len()).find(|&v| stuck(v)) else {
        return Vec::new();
    };
    // Walk predecessors inside the stuck set until a node repeats: the walk from its first visit is a cycle.
    let mut seen = vec![usize::MAX; preds.len()];
    let mut path = Vec::new();
    let mut v = start;
    while seen[v] == usize::MAX {
        seen[v] = path.len();
        path.push(v);
        v = match preds[v].iter().copied().find(|&p| stuck(p)) {
            Some(p) => p,
            None => return path,
        };
    }
    let mut cycle = path[seen[v]..].to_vec();
    // The walk went against the edges: reverse it so each node depends on the one before.
    cycle.reverse();
    cycle
}

/// The derived, transitively reduced dependencies of a [`Graph`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dependencies {
    preds: Vec<Vec<NodeId>>,
    succs: Vec<Vec<NodeId>>,
    edges: Vec<Edge>,
    order: Vec<NodeId>,
}

impl Dependencies {
    /// Nodes.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The nodes `node` waits for directly, in recording order.
    pub fn preds(&self, node: NodeId) -> &[NodeId] {
        self.preds.get(node.0).map_or(&[], Vec::as_slice)
    }

    /// The nodes that wait for `node` directly, in recording order.
    pub fn succs(&self, node: NodeId) -> &[NodeId] {
        self.succs.get(node.0).map_or(&[], Vec::as_slice)
    }

    /// Every edge of the reduced graph, sorted by (from, to).
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// The edge `from → to`, if the reduced graph has it.
    pub fn edge(&self, from: NodeId, to: NodeId) -> Option<&Edge> {
        self.edges
            .binary_search_by_key(&(from, to), |e| (e.from, e.to))
            .ok()
            .map(|i| &self.edges[i])
    }

    /// A topological order: every node after the ones it depends on, and in recording order where nothing
    /// forces another.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// Each node's level: 0 for nodes that wait for nothing, else one more than the highest level among the
    /// nodes it waits for (the longest path to it).
    pub fn levels(&self) -> Vec<usize> {
        let mut level = vec![0usize; self.len()];
        for &v in &self.order {
            level[v.0] = self.preds[v.0]
                .iter()
                .map(|p| level[p.0] + 1)
                .max()
                .unwrap_or(0);
        }
        level
    }
}

/// n×n bits, row-major: `get(r, c)`.
struct BitMatrix {
    words: Vec<u64>,
    stride: usize,
}

impl BitMatrix {
    fn new(n: usize) -> BitMatrix {
        let stride = n.div_ceil(64);
        BitMatrix {
            words: vec![0; stride * n],
            stride,
        }
    }

    fn get(&self, r: usize, c: usize) -> bool {
        self.words[r * self.stride + c / 64] & (1 << (c % 64)) != 0
    }

    fn set(&mut self, r: usize, c: usize) {
        self.words[r * self.stride + c / 64] |= 1 << (c % 64);
    }

    /// Row `dst` |= row `src`.
    fn or_row_into(&mut self, src: usize, dst: usize) {
        if src == dst {
            return;
        }
        let s = self.stride;
        for k in 0..s {
            let w = self.words[src * s + k];
            self.words[dst * s + k] |= w;
        }
    }
}

#[cfg(test)]
mod tests;
