//! The driver backend's side of [`crate::Queue`], [`crate::Fence`] and [`crate::GraphExec`]: a stream that
//! launches every kind of launch the public API has (plain, cooperative, cluster, programmatic, chained, with the
//! launch configuration's attributes) through the matching driver call, copies, fills, waits on other streams,
//! and replays CUDA graphs built from a launch graph's description.

use std::sync::Arc;
use std::time::Duration;

use super::{
    BackendError, BackendResult, Context, CudaContext, DeviceMemory, Error, GraphExec, GraphNode,
    Kernel, LaunchAttributes, LaunchKind, MAX_PARAMS, ParamPtrs, Result, Stream, StreamRef,
    SyncWords, cu,
};
use crate::launch::graph::{self as lgraph, Op};
use crate::launch::{self, Arg, ClusterPolicy, LaunchConfig, Limits};

/// How a launch is ordered and which driver call makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchMode {
    /// An ordinary launch in stream order.
    Plain,
    /// Every block resident at once, for the grid barrier (`cuLaunchCooperativeKernel`).
    Cooperative,
    /// A programmatic dependent of the launch before it (programmatic stream serialization).
    Programmatic,
    /// The next link of a chain: launched on the stream at once, which orders it after the link before.
    Chained,
    /// The next link of a chain, a programmatic dependent of the link before it.
    ChainedProgrammatic,
}

impl LaunchMode {
    /// Whether it is a link of a chain.
    pub fn is_chained(self) -> bool {
        matches!(self, LaunchMode::Chained | LaunchMode::ChainedProgrammatic)
    }

    fn is_programmatic(self) -> bool {
        matches!(
            self,
            LaunchMode::Programmatic | LaunchMode::ChainedProgrammatic
        )
    }

    /// The driver call for a launch over `cfg` in this mode.
    fn kind(self, cfg: &LaunchConfig) -> BackendResult<LaunchKind> {
        let scheduled = cfg.sync_domain != 0 || cfg.cluster_policy != ClusterPolicy::Default;
        Ok(match (self, cfg.cluster) {
            // A memory sync domain or a cluster policy: every attribute through one cuLaunchKernelEx.
            _ if scheduled => LaunchKind::Attributed(LaunchAttributes {
                cluster: cfg.cluster,
                programmatic: self.is_programmatic(),
                cooperative: self == LaunchMode::Cooperative,
                sync_domain: cfg.sync_domain,
                cluster_policy: match cfg.cluster_policy {
                    ClusterPolicy::Default => 0,
                    ClusterPolicy::Spread => 1,
                    ClusterPolicy::LoadBalancing => 2,
                },
            }),
            (LaunchMode::Cooperative, Some(_)) => {
                return Err(BackendError::InvalidArgument(
                    "a run-time cluster shape on a cooperative launch (the driver backend launches \
                     cooperative kernels with cuLaunchCooperativeKernel, which takes none)"
                        .into(),
                ));
            }
            (LaunchMode::Cooperative, None) => LaunchKind::Cooperative,
            (LaunchMode::Programmatic | LaunchMode::ChainedProgrammatic, cluster) => {
                LaunchKind::Programmatic(cluster)
            }
            // A run-time cluster shape goes through cuLaunchKernelEx; a compile-time one needs nothing.
            (_, Some(cluster)) => LaunchKind::Cluster(cluster),
            (_, None) => LaunchKind::Plain,
        })
    }
}

/// A completion point on a driver-backend queue: it completes with its stream (a conservative wait), and waits
/// without borrowing the queue.
#[derive(Debug)]
pub struct StreamFence {
    ctx: Arc<Context>,
    stream: StreamRef,
}

impl StreamFence {
    /// The fence of everything submitted to `stream` so far.
    pub fn of(stream: &Stream) -> StreamFence {
        StreamFence {
            ctx: stream.context().clone(),
            stream: stream.handle(),
        }
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The stream.
    pub fn stream(&self) -> StreamRef {
        self.stream
    }

    /// Whether the stream has done everything (no waiting); a failed query counts as not done.
    pub fn is_done(&self) -> bool {
        self.stream.is_idle(&self.ctx).unwrap_or(false)
    }

    /// Waits until the stream has done everything, at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            if self.stream.is_idle(&self.ctx)? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::Call {
                    call: "fence wait",
                    code: 0,
                    name: format!("timed out after {timeout:?}"),
                });
            }
            std::thread::yield_now();
        }
    }
}

/// A launch checked once by [`Queue::prepare`], launched again with new arguments.
#[derive(Clone, Debug)]
pub struct Prepared {
    kernel: Kernel,
    cfg: LaunchConfig,
}

impl Prepared {
    /// The launch configuration.
    pub fn config(&self) -> &LaunchConfig {
        &self.cfg
    }
}

/// The driver backend's queue: a non-blocking stream, the scratch its launches pass parameter pointers in, the
/// limits launches are checked against, and the chain being recorded.
#[derive(Debug)]
pub struct Queue {
    stream: Stream,
    ptrs: ParamPtrs,
    limits: Limits,
    /// Chained launches made since the chain last ended.
    chain: usize,
}

impl Queue {
    /// A queue on a new stream of `ctx`, its launches checked against `limits`.
    pub fn new(ctx: &Arc<Context>, limits: Limits) -> Result<Queue> {
        Ok(Queue {
            stream: Stream::new(ctx)?,
            ptrs: ParamPtrs::with_capacity(MAX_PARAMS),
            limits,
            chain: 0,
        })
    }

    /// The stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        self.stream.context()
    }

    /// A fence of everything submitted so far.
    pub fn fence(&self) -> StreamFence {
        StreamFence::of(&self.stream)
    }

    /// Ends the chain being recorded without a fence: any work but a chained launch does.
    pub fn end_chain_silently(&mut self) {
        self.chain = 0;
    }

    /// Checks a launch of `kernel` over `cfg` once (the launch shape against the limits, the cluster shape).
    pub fn prepare(&self, kernel: &Kernel, cfg: &LaunchConfig) -> BackendResult<Prepared> {
        if let Some(info) = kernel.info() {
            launch::queue_validate(info, cfg, &self.limits)?;
            launch::cluster_shape(info, cfg, &self.limits)?;
        }
        Ok(Prepared {
            kernel: kernel.clone(),
            cfg: *cfg,
        })
    }

    /// Checks and launches `kernel` with `args` in `mode`. A chained link is counted for
    /// [`end_chain`](Self::end_chain); any other launch ends the chain.
    ///
    /// # Safety
    /// The kernel may read and write any memory its arguments lead it to; the caller guarantees those buffers
    /// are not in use elsewhere until the stream has done the launch. A programmatic launch's kernel must run
    /// `griddepcontrol.wait` before it touches memory the launch before it writes.
    pub unsafe fn launch(
        &mut self,
        mode: LaunchMode,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> BackendResult<()> {
        let chained = mode.is_chained();
        if !chained {
            self.chain = 0;
        }
        let kind = mode.kind(cfg)?;
        if let Some(info) = kernel.info() {
            launch::queue_validate(info, cfg, &self.limits)?;
        }
        kernel.check_args(args)?;
        self.ptrs.clear();
        for a in args {
            self.ptrs.push(arg_ptr(a));
        }
        // SAFETY: each pointer refers into `args`, alive for the call, with the size the kernel declares (checked
        // above); the rest is the caller's contract.
        unsafe {
            self.stream.launch_as(
                kind,
                kernel.function(),
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                self.ptrs.as_mut_slice(),
            )?
        };
        if chained {
            self.chain += 1;
        }
        Ok(())
    }

    /// Launches a [`prepare`](Self::prepare)d launch with `args` in `mode`.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    #[inline]
    pub unsafe fn launch_prepared(
        &mut self,
        prepared: &Prepared,
        mode: LaunchMode,
        args: &[Arg<'_>],
    ) -> BackendResult<()> {
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(mode, &prepared.kernel, &prepared.cfg, args) }
    }

    /// Ends the chain: its links are on the stream already, so the fence is the stream's. An error if no chained
    /// launch was made since the chain last ended.
    pub fn end_chain(&mut self) -> BackendResult<StreamFence> {
        if std::mem::take(&mut self.chain) == 0 {
            return Err(launch::Error::NoChain.into());
        }
        Ok(self.fence())
    }

    /// Waits until everything submitted so far is done.
    pub fn synchronize(&mut self) -> Result<()> {
        self.chain = 0;
        self.stream.synchronize()
    }

    /// Copies `bytes` from `src` to `dst` in stream order (`cuMemcpyAsync`).
    ///
    /// # Safety
    /// Both ranges must be memory the context reaches, alive until the copy is done.
    pub unsafe fn copy(&mut self, src: u64, dst: u64, bytes: u64) -> Result<StreamFence> {
        self.chain = 0;
        // SAFETY: forwarded to the caller.
        unsafe { self.stream.copy(dst, src, bytes)? };
        Ok(self.fence())
    }

    /// Sets `count` elements of `width` bytes at `dst` to `value` in stream order (`cuMemsetD8/16/32Async`).
    ///
    /// # Safety
    /// `dst` must be memory the context reaches for `count * width` bytes, aligned to `width`, alive until done.
    pub unsafe fn fill(
        &mut self,
        dst: u64,
        value: u32,
        width: u32,
        count: u64,
    ) -> Result<StreamFence> {
        self.chain = 0;
        // SAFETY: forwarded to the caller.
        unsafe { self.stream.fill(dst, value, width, count)? };
        Ok(self.fence())
    }

    /// Copies pageable host memory to `dst` in stream order; returns when the copy is done.
    pub fn upload(&mut self, dst: u64, data: &[u8]) -> Result<()> {
        self.stream.upload(dst, data)
    }

    /// Copies from `src` into pageable host memory in stream order; returns when the copy is done.
    pub fn download(&mut self, src: u64, out: &mut [u8]) -> Result<()> {
        self.stream.download(src, out)
    }

    /// Whether `memory` belongs to this queue's context.
    pub fn owns(&self, memory: &DeviceMemory) -> bool {
        Arc::ptr_eq(memory.context(), self.stream.context())
    }

    /// Copies `bytes` from `src` at `src_offset` to `dst` at `dst_offset`, memory of two contexts
    /// (`cuMemcpyPeerAsync`), in stream order.
    ///
    /// # Safety
    /// Both ranges must lie inside their allocations (checked by the caller), which stay alive until the copy is
    /// done.
    pub unsafe fn copy_peer(
        &mut self,
        src: &DeviceMemory,
        src_offset: u64,
        dst: &DeviceMemory,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<StreamFence> {
        // SAFETY: forwarded to the caller.
        unsafe {
            self.stream.copy_peer(
                dst.ptr() + dst_offset,
                dst.context(),
                src.ptr() + src_offset,
                src.context(),
                bytes,
            )?
        };
        Ok(self.fence())
    }

    /// Makes this queue's later work wait, on the GPU, until `fence` completes (an event; the fence's stream may
    /// belong to another context).
    pub fn wait_for(&mut self, fence: &StreamFence) -> Result<()> {
        self.chain = 0;
        // SAFETY: both are live streams of their (retained) contexts.
        unsafe {
            super::order_streams_across(
                self.stream.context(),
                self.stream.raw(),
                fence.context(),
                fence.stream().raw(),
            )
        }
    }

    /// Makes this queue's later work wait for everything submitted to the CUDA stream `other` so far.
    ///
    /// # Safety
    /// `other` must be a valid CUDA stream of this queue's context, or null.
    pub unsafe fn wait_for_cuda_stream(&mut self, other: cu::CUstream) -> Result<()> {
        let ctx = self.stream.context().clone();
        // SAFETY: our own stream, and the caller's promise for `other`.
        unsafe { super::order_streams(&ctx, self.stream.raw(), other) }
    }

    /// Makes the CUDA stream `other` wait for everything submitted to this queue so far.
    ///
    /// # Safety
    /// `other` must be a valid CUDA stream of this queue's context, or null.
    pub unsafe fn make_cuda_stream_wait(&mut self, other: cu::CUstream) -> Result<()> {
        let ctx = self.stream.context().clone();
        // SAFETY: our own stream, and the caller's promise for `other`.
        unsafe { super::order_streams(&ctx, other, self.stream.raw()) }
    }

    /// Builds `graph` into a CUDA graph of this queue's context, node by node, every launch checked against the
    /// limits; refused: a cycle.
    pub fn instantiate(&self, graph: &lgraph::Graph<Kernel>) -> BackendResult<QueueGraph> {
        let deps = graph.dependencies().map_err(launch::Error::from)?;
        let mut nodes = Vec::with_capacity(graph.len());
        let mut clusters = Vec::with_capacity(graph.len());
        let mut kernels = Vec::with_capacity(graph.len());
        for n in graph.nodes() {
            nodes.push(match n.op() {
                Op::Launch {
                    kernel,
                    cfg,
                    params,
                } => {
                    if let Some(info) = kernel.info() {
                        launch::queue_validate(info, cfg, &self.limits)?;
                    }
                    clusters.push(cfg.cluster);
                    kernels.push(Some(kernel.clone()));
                    GraphNode::Kernel {
                        func: kernel.function(),
                        grid: cfg.grid,
                        block: cfg.block,
                        shared: cfg.shared_bytes,
                        cluster: cfg.cluster,
                        params,
                        programmatic: n.is_programmatic(),
                    }
                }
                &Op::Copy { src, dst, bytes } => {
                    clusters.push(None);
                    kernels.push(None);
                    GraphNode::Copy { src, dst, bytes }
                }
            });
        }
        let mut ids = deps.order().to_vec();
        ids.sort_unstable();
        let preds: Vec<Vec<usize>> = ids
            .iter()
            .map(|&v| deps.preds(v).iter().map(|p| p.index()).collect())
            .collect();
        let order: Vec<usize> = deps.order().iter().map(|v| v.index()).collect();
        let exec = GraphExec::build(self.stream.context(), &nodes, &preds, &order)?;
        Ok(QueueGraph {
            exec,
            owner: self.stream.raw() as u64,
            limits: self.limits,
            kernels,
            clusters,
            ptrs: ParamPtrs::with_capacity(MAX_PARAMS),
            params: vec![0; MAX_PARAM_BYTES],
        })
    }

    /// Launches `graph` (`cuGraphLaunch`) after everything submitted before. Refused: a graph instantiated on
    /// another queue.
    ///
    /// # Safety
    /// Every kernel runs with the arguments it was recorded (or last updated) with; the caller guarantees the
    /// memory they lead to is not in use elsewhere until the fence completes.
    pub unsafe fn replay(&mut self, graph: &QueueGraph) -> BackendResult<StreamFence> {
        self.chain = 0;
        if graph.owner != self.stream.raw() as u64 {
            return Err(BackendError::OtherQueue);
        }
        // SAFETY: forwarded to the caller.
        unsafe { graph.exec.launch(&mut self.stream)? };
        Ok(self.fence())
    }
}

/// Most bytes a parameter block takes (sm_90 kernels take up to 32764).
pub const MAX_PARAM_BYTES: usize = 32 * 1024;

/// A launch graph built into a CUDA graph on one [`Queue`] ([`Queue::instantiate`]), with what updates check.
#[derive(Debug)]
pub struct QueueGraph {
    exec: GraphExec,
    /// The stream it belongs to.
    owner: u64,
    limits: Limits,
    /// Each node's kernel (`None` for copies).
    kernels: Vec<Option<Kernel>>,
    /// Each node's cluster shape, which an update may not change (as on the direct path).
    clusters: Vec<Option<[u32; 3]>>,
    /// Scratch for updates: parameter pointers and the packed block.
    ptrs: ParamPtrs,
    params: Vec<u8>,
}

impl QueueGraph {
    /// Gives launch `node` new arguments and shape for later launches (`cuGraphExecKernelNodeSetParams`), checked
    /// as a launch is. Refused: a copy node, a node past the last, a different cluster shape.
    pub fn update(
        &mut self,
        node: usize,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> BackendResult<()> {
        let len = self.kernels.len();
        let kernel = match self.kernels.get(node) {
            Some(Some(k)) => k,
            Some(None) => {
                return Err(launch::Error::GraphUpdate {
                    node,
                    why: "it is a copy; only kernel launches take new arguments (record a new graph to change a \
                          copy)"
                        .into(),
                }
                .into());
            }
            None => {
                return Err(
                    launch::Error::Graph(lgraph::GraphError::NoSuchNode { node, len }).into(),
                );
            }
        };
        if let Some(info) = kernel.info() {
            launch::queue_validate(info, cfg, &self.limits)?;
        }
        let was = self.clusters.get(node).copied().flatten();
        if cfg.cluster != was {
            return Err(launch::Error::GraphUpdate {
                node,
                why: format!(
                    "its cluster shape would change from {was:?} to {:?}; the cluster shape is fixed when the \
                     graph is instantiated (record a new graph to change it)",
                    cfg.cluster
                ),
            }
            .into());
        }
        let n = kernel.pack(args, &mut self.params)?;
        Ok(self.exec.set_kernel(
            node,
            kernel.function(),
            (cfg.grid, cfg.block, cfg.shared_bytes),
            &self.params[..n],
            &mut self.ptrs,
        )?)
    }
}

/// A pointer to an argument's value, as `cuLaunchKernel` takes each parameter.
fn arg_ptr(a: &Arg<'_>) -> *mut std::ffi::c_void {
    match a {
        Arg::I8(v) => v as *const i8 as *mut _,
        Arg::U8(v) => v as *const u8 as *mut _,
        Arg::I16(v) => v as *const i16 as *mut _,
        Arg::U16(v) => v as *const u16 as *mut _,
        Arg::I32(v) => v as *const i32 as *mut _,
        Arg::U32(v) => v as *const u32 as *mut _,
        Arg::I64(v) => v as *const i64 as *mut _,
        Arg::U64(v) | Arg::Ptr(v) => v as *const u64 as *mut _,
        Arg::F32(v) => v as *const f32 as *mut _,
        Arg::F64(v) => v as *const f64 as *mut _,
        Arg::Bytes(b) => b.as_ptr() as *mut _,
    }
}

/// A direct-path queue's counters for ordering with the streams of the CUDA context its GPU is attached to: word
/// 0 of the sync words counts CUDA → queue signals, word 1 queue → CUDA.
#[derive(Debug)]
pub struct CudaOrder {
    ctx: Arc<CudaContext>,
    words: Option<SyncWords>,
    to_queue: u64,
    to_cuda: u64,
}

impl CudaOrder {
    /// Counters for a queue of a GPU attached to `ctx`; the sync words are allocated on first use.
    pub fn new(ctx: Arc<CudaContext>) -> CudaOrder {
        CudaOrder {
            ctx,
            words: None,
            to_queue: 0,
            to_cuda: 0,
        }
    }

    fn words(&mut self) -> Result<&SyncWords> {
        match &mut self.words {
            Some(w) => Ok(w),
            slot @ None => Ok(slot.insert(self.ctx.sync_words(64)?)),
        }
    }

    /// Has the CUDA stream `stream` write the next CUDA → queue value once its work so far is done; returns the
    /// word's address and the value, for the queue to wait on.
    ///
    /// # Safety
    /// `stream` must be a valid CUDA stream of the attached context, or null.
    pub unsafe fn signal_queue(&mut self, stream: cu::CUstream) -> Result<(u64, u64)> {
        self.to_queue += 1;
        let value = self.to_queue;
        let words = self.words()?;
        let va = words.ptr();
        // SAFETY: the caller's promise for `stream`.
        unsafe { words.write_after(stream, 0, value) }?;
        Ok((va, value))
    }

    /// The next queue → CUDA value and the word's address, for the queue to release once its work so far is done.
    pub fn next_for_cuda(&mut self) -> Result<(u64, u64)> {
        self.to_cuda += 1;
        let value = self.to_cuda;
        let va = self.words()?.ptr() + 8;
        Ok((va, value))
    }

    /// The last value [`next_for_cuda`](Self::next_for_cuda) handed out (0: none yet).
    pub fn released_for_cuda(&self) -> u64 {
        self.to_cuda
    }

    /// Makes the CUDA stream `stream` wait until the queue released `value` ([`next_for_cuda`](Self::next_for_cuda)).
    ///
    /// # Safety
    /// `stream` must be a valid CUDA stream of the attached context, or null.
    pub unsafe fn cuda_waits(&mut self, stream: cu::CUstream, value: u64) -> Result<()> {
        // SAFETY: the caller's promise for `stream`.
        unsafe { self.words()?.wait_on(stream, 8, value) }
    }
}
