//! Launch graphs recorded from the public types, instantiated on a queue and replayed, on both backends.

use std::collections::HashSet;

use super::backend::Backed;
use super::queue::check_range;
use super::{Backend, Buffer, Error, Fence, Kernel, Queue, Result};
use crate::driver::{self, MAX_PARAM_BYTES};
use crate::launch::graph::{self, NodeId, Op, Range};
use crate::launch::params::{Arg, pack};
use crate::launch::{self, LaunchConfig};

/// A node of a [`Graph`]: what [`Graph::launch`] and [`Graph::copy`] return, and what edges and updates name.
pub type GraphNode = NodeId;

/// Packs `args` for `kernel` into `out`: by the cubin's parameter table when APEX read it, else by the one libcuda
/// reports. Checked as a launch's arguments are (count, sizes).
fn pack_args(kernel: &Kernel, args: &[Arg<'_>], out: &mut [u8]) -> Result<usize> {
    match kernel.inner() {
        Backed::Direct(k) => Ok(pack(k.info(), args, out).map_err(launch::Error::from)?),
        Backed::Driver(k) => Ok(k.pack(args, out)?),
    }
}

/// Kernel launches and copies, each with the device ranges it reads and writes, and explicit edges: recorded once,
/// then instantiated on a queue ([`Queue::instantiate`]) and replayed as a whole ([`Queue::replay`]).
///
/// No capture: APEX derives the dependencies from the declared ranges, in recording order — read-after-write,
/// write-after-read and write-after-write on overlapping bytes — adds the explicit edges ([`Graph::edge`]) and
/// keeps the fewest that give the same order. Work with no path between it runs concurrently. On the direct path a
/// replay is one doorbell: dependent launches run as chains the GPU schedules itself, fan-ins wait on semaphores
/// (docs/graphs.md); on the driver backend the same description becomes a CUDA graph, built node by node.
///
/// A node's declared ranges must cover what its kernel reads and writes: the graph orders nothing else. Buffers a
/// node names are kept alive by the graph and by every exec made from it.
///
/// ```no_run
/// use apex::{Arg, Gpu, Graph, LaunchConfig};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let m = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
/// let (add, saxpy) = (m.kernel("vector_add")?, m.kernel("saxpy")?);
/// let n: u32 = 1 << 20;
/// let bytes = u64::from(n) * 4;
/// let (x, y, z, w) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?, gpu.alloc(bytes)?, gpu.alloc(bytes)?);
/// let cfg = LaunchConfig::linear(n / 256, 256);
///
/// let mut g = Graph::new();
/// // z = x + y
/// let sum = g
///     .launch(&add, cfg, &[x.arg(), y.arg(), z.arg(), Arg::U32(n)])?
///     .reads(&x)
///     .reads(&y)
///     .writes(&z)
///     .id();
/// // w = 2z + w: after the sum (read-after-write on z)
/// g.launch(&saxpy, cfg, &[Arg::F32(2.0), z.arg(), w.arg(), Arg::U32(n)])?
///     .reads(&z)
///     .reads(&w)
///     .writes(&w);
/// // y = z: after the sum read y (write-after-read), beside the saxpy
/// g.copy(&z, &y)?;
///
/// let mut q = gpu.queue()?;
/// let mut exec = q.instantiate(&g)?;
/// for _ in 0..100 {
///     // SAFETY: each node's declared buffers cover what its kernel touches with these arguments.
///     unsafe { q.replay(&mut exec)? };
/// }
/// // The sum over the first half only, from the next replay on: no rebuild.
/// exec.update(sum, &LaunchConfig::linear(n / 512, 256), &[x.arg(), y.arg(), z.arg(), Arg::U32(n / 2)])?;
/// // SAFETY: as above.
/// unsafe { q.replay(&mut exec)? }.wait(std::time::Duration::from_secs(1))?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default)]
pub struct Graph {
    inner: graph::Graph<Kernel>,
    /// The buffers the nodes name (one clone each), kept alive with the graph and its execs.
    keep: Vec<Buffer>,
    kept: HashSet<u64>,
}

/// A launch being recorded into a [`Graph`]: declare the buffers it reads and writes, then take its
/// [`id`](GraphLaunch::id).
#[derive(Debug)]
pub struct GraphLaunch<'g> {
    graph: &'g mut Graph,
    node: NodeId,
}

impl GraphLaunch<'_> {
    /// The kernel reads all of `buffer`.
    pub fn reads(self, buffer: &Buffer) -> Self {
        self.whole(buffer, false)
    }

    /// The kernel writes (some of) `buffer`; a kernel that reads and writes it declares both.
    pub fn writes(self, buffer: &Buffer) -> Self {
        self.whole(buffer, true)
    }

    /// The kernel reads `len` bytes of `buffer` from `offset`; an error outside the buffer.
    pub fn reads_range(self, buffer: &Buffer, offset: u64, len: u64) -> Result<Self> {
        self.declare(buffer, offset, len, false)
    }

    /// The kernel writes `len` bytes of `buffer` from `offset`; an error outside the buffer.
    pub fn writes_range(self, buffer: &Buffer, offset: u64, len: u64) -> Result<Self> {
        self.declare(buffer, offset, len, true)
    }

    /// The kernel reads `[ptr, ptr + len)` of device memory APEX did not allocate (a CUDA allocation of the
    /// context APEX is attached to, say); the caller keeps it alive.
    pub fn reads_device(self, ptr: impl Into<crate::DevicePtr>, len: u64) -> Result<Self> {
        let r = Range::new(ptr.into().0, len).map_err(launch::Error::from)?;
        self.graph
            .inner
            .read(self.node, r)
            .map_err(launch::Error::from)?;
        Ok(self)
    }

    /// The kernel writes `[ptr, ptr + len)` of device memory APEX did not allocate; the caller keeps it alive.
    pub fn writes_device(self, ptr: impl Into<crate::DevicePtr>, len: u64) -> Result<Self> {
        let r = Range::new(ptr.into().0, len).map_err(launch::Error::from)?;
        self.graph
            .inner
            .write(self.node, r)
            .map_err(launch::Error::from)?;
        Ok(self)
    }

    /// The kernel waits for the grids it depends on itself before reading what they wrote (it runs
    /// `griddepcontrol.wait`, CUDA's `cudaGridDependencySynchronize`), so a predecessor may let it start early —
    /// programmatic dependent launch. On the direct path, when the node is its predecessor's only successor (a
    /// chain link), the predecessor lets it be scheduled at pre-exit and arrives at a latch its `griddepcontrol.wait`
    /// waits on, as libcuda builds a programmatic graph edge; a node with several predecessors waits for all of them
    /// to complete. On the driver backend its edges from kernels are programmatic edges of the CUDA graph. A kernel
    /// that does not wait would race with its producers: mark only kernels built for it.
    pub fn programmatic(self) -> Self {
        // Cannot fail: the node is a launch just recorded in this graph.
        let _ = self.graph.inner.set_programmatic(self.node);
        self
    }

    /// The node, for edges ([`Graph::edge`]) and updates ([`GraphExec::update`]).
    pub fn id(&self) -> GraphNode {
        self.node
    }

    fn whole(self, buffer: &Buffer, write: bool) -> Self {
        // Cannot fail: the node was just recorded in this graph (which this launch borrows), and an allocated
        // buffer's range does not wrap.
        let r = Range {
            va: buffer.device_ptr(),
            len: buffer.size(),
        };
        let g = &mut *self.graph;
        let recorded = if write {
            g.inner.write(self.node, r)
        } else {
            g.inner.read(self.node, r)
        };
        debug_assert!(recorded.is_ok(), "{recorded:?}");
        g.keep_alive(buffer);
        self
    }

    fn declare(self, buffer: &Buffer, offset: u64, len: u64, write: bool) -> Result<Self> {
        check_range(buffer.size(), offset, len)?;
        let r = Range::new(buffer.device_ptr() + offset, len).map_err(launch::Error::from)?;
        let g = &mut *self.graph;
        if write {
            g.inner.write(self.node, r)
        } else {
            g.inner.read(self.node, r)
        }
        .map_err(launch::Error::from)?;
        g.keep_alive(buffer);
        Ok(self)
    }
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    fn keep_alive(&mut self, buffer: &Buffer) {
        if self.kept.insert(buffer.device_ptr()) {
            self.keep.push(buffer.clone());
        }
    }

    /// Records a launch of `kernel` over `cfg` with `args`, checked against the kernel's parameter table as a
    /// launch is (the shape is checked against the device when the graph is instantiated). Declare what it reads
    /// and writes on the returned [`GraphLaunch`].
    pub fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<GraphLaunch<'_>> {
        // The cubin's block size when APEX read the cubin; the driver's table is sized as it is packed.
        let room = kernel
            .info()
            .map_or(MAX_PARAM_BYTES, |i| i.param_cbank_size as usize);
        let mut params = vec![0u8; room];
        let n = pack_args(kernel, args, &mut params)?;
        params.truncate(n);
        let node = self.inner.launch(kernel.clone(), cfg, params);
        Ok(GraphLaunch { graph: self, node })
    }

    /// Records a copy of all of `src` into the start of `dst` (which must be at least as large): it reads `src`
    /// and writes that much of `dst`.
    pub fn copy(&mut self, src: &Buffer, dst: &Buffer) -> Result<GraphNode> {
        self.copy_range(src, 0, dst, 0, src.size())
    }

    /// Records a copy of `bytes` bytes from `src` at `src_offset` to `dst` at `dst_offset`, both checked against
    /// their buffers.
    pub fn copy_range(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<GraphNode> {
        check_range(src.size(), src_offset, bytes)?;
        check_range(dst.size(), dst_offset, bytes)?;
        if bytes == 0 {
            return Err(Error::InvalidArgument("a copy of 0 bytes".into()));
        }
        let node = self
            .inner
            .copy(
                src.device_ptr() + src_offset,
                dst.device_ptr() + dst_offset,
                bytes,
            )
            .map_err(launch::Error::from)?;
        self.keep_alive(src);
        self.keep_alive(dst);
        Ok(node)
    }

    /// Orders `from` before `to`, whatever they read and write (for dependencies memory ranges cannot express).
    /// An edge from a node to itself, or one that closes a cycle, is refused (the cycle when the graph is
    /// instantiated).
    pub fn edge(&mut self, from: GraphNode, to: GraphNode) -> Result<()> {
        Ok(self.inner.edge(from, to).map_err(launch::Error::from)?)
    }

    /// Nodes recorded.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The dependencies APEX derives: the reduced edges, with the hazard behind each, and a topological order.
    pub fn dependencies(&self) -> Result<graph::Dependencies> {
        Ok(self.inner.dependencies().map_err(launch::Error::from)?)
    }

    /// The description as the launch layer holds it (kernels, shapes, packed parameters, ranges, edges).
    pub fn description(&self) -> &graph::Graph<Kernel> {
        &self.inner
    }
}

/// A [`Graph`] instantiated on one [`Queue`]: replay it with [`Queue::replay`], update a launch with
/// [`GraphExec::update`]. Keeps the graph's buffers alive.
#[derive(Debug)]
pub struct GraphExec {
    /// The direct path's exec, or the driver backend's CUDA graph (which knows its queue itself).
    inner: Backed<Box<launch::GraphExec>, driver::QueueGraph>,
    /// The direct-path queue it belongs to (the compute queue's id).
    owner: u64,
    /// Each node's kernel (`None` for copies).
    kernels: Vec<Option<Kernel>>,
    _keep: Vec<Buffer>,
}

impl GraphExec {
    /// The backend it runs on.
    pub fn backend(&self) -> Backend {
        self.inner.backend()
    }

    /// The direct path's exec (its schedule: [`GraphExec::stats`](crate::backend::direct::GraphExec::stats)), when that is the backend.
    pub fn direct(&self) -> Option<&launch::GraphExec> {
        self.inner.direct().map(|e| &**e)
    }

    /// Nodes.
    pub fn len(&self) -> usize {
        self.kernels.len()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.kernels.is_empty()
    }

    /// Gives launch `node` new arguments and shape for the replays after this call, without rebuilding anything
    /// (direct path: the node's QMD and constant bank, rewritten in place once the previous replay is done; driver:
    /// `cuGraphExecKernelNodeSetParams`). Checked as a launch is: the arguments against the kernel's parameter
    /// table, the shape against the device limits. Refused with a typed error: a copy node, a node of another
    /// graph, a different cluster shape. No allocation on the direct path.
    pub fn update(&mut self, node: GraphNode, cfg: &LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
        match &mut self.inner {
            Backed::Direct(e) => Ok(e.update_launch(node, cfg, args)?),
            Backed::Driver(e) => Ok(e.update(node.index(), cfg, args)?),
        }
    }
}

impl Queue {
    /// Instantiates `graph` on this queue, once: every launch checked against the device, the dependencies derived
    /// and reduced, and the work prebuilt (direct path: QMDs, constant banks and the methods that send them;
    /// driver: a CUDA graph built node by node). Refused: kernels of another backend or GPU, a cycle.
    pub fn instantiate(&mut self, graph: &Graph) -> Result<GraphExec> {
        let kernels: Vec<Option<Kernel>> = graph
            .inner
            .nodes()
            .iter()
            .map(|n| match n.op() {
                Op::Launch { kernel, .. } => Some(kernel.clone()),
                Op::Copy { .. } => None,
            })
            .collect();
        let (inner, owner) = match &mut self.inner {
            Backed::Direct(q) => {
                let g = graph
                    .inner
                    .map_kernels(|k| k.direct().cloned().ok_or(Error::Mismatch))?;
                (Backed::Direct(Box::new(q.instantiate_graph(&g)?)), q.id())
            }
            Backed::Driver(q) => {
                let g = graph
                    .inner
                    .map_kernels(|k| k.driver_kernel().cloned().ok_or(Error::Mismatch))?;
                (Backed::Driver(q.instantiate(&g)?), 0)
            }
        };
        Ok(GraphExec {
            inner,
            owner,
            kernels,
            _keep: graph.keep.clone(),
        })
    }

    /// Runs `exec` once, after everything submitted to this queue before; what is submitted after runs after it.
    /// Direct path: one doorbell, no allocation, no system call. Driver: `cuGraphLaunch`. Refused: an exec
    /// instantiated on another queue.
    ///
    /// # Safety
    /// Every kernel runs with the arguments it was recorded (or last updated) with and may read and write any memory
    /// they lead it to. The caller guarantees that each node's declared reads and writes cover what it accesses
    /// (the graph orders nothing else) and that memory the graph writes is not in use elsewhere until the fence
    /// completes.
    pub unsafe fn replay(&mut self, exec: &mut GraphExec) -> Result<Fence> {
        self.other_work();
        match self.inner.as_mut().with(exec.inner.as_mut())? {
            Backed::Direct((q, e)) => {
                if exec.owner != q.id() {
                    return Err(Error::GraphQueue);
                }
                // SAFETY: forwarded to the caller.
                let f = unsafe { q.replay_graph(e)? };
                Ok(Fence::from_direct(f, q))
            }
            // SAFETY: forwarded to the caller.
            Backed::Driver((q, e)) => Ok(Fence::from_driver(unsafe { q.replay(e)? })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_cross_threads_like_queues() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Graph>();
        send::<GraphExec>();
    }
}
