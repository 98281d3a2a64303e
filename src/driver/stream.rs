//! Streams and what runs on them: kernel launches (`cuLaunchKernel`, `cuLaunchKernelEx`), copies, fills, graphs
//! captured from a stream, and the ordering of one stream after another.

use std::ffi::c_void;
use std::sync::Arc;

use super::{Context, Error, Function, Result, check, cu};

/// Which driver call launches a kernel on a [`Stream`] ([`Stream::launch_as`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    /// `cuLaunchKernel`. A kernel's compile-time `__cluster_dims__` needs nothing more.
    Plain,
    /// `cuLaunchCooperativeKernel`: every block resident at once, for the grid barrier (`grid.sync()`).
    Cooperative,
    /// `cuLaunchKernelEx` with this run-time thread block cluster shape (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`),
    /// in blocks; the grid is in blocks too.
    Cluster([u32; 3]),
    /// `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` set (programmatic dependent
    /// launch after the stream's previous kernel), and a run-time cluster shape if one is given.
    Programmatic(Option<[u32; 3]>),
    /// `cuLaunchKernelEx` with every attribute APEX's launch configuration can ask for.
    Attributed(LaunchAttributes),
}

/// What a [`LaunchKind::Attributed`] launch asks `cuLaunchKernelEx` for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchAttributes {
    /// A run-time cluster shape, in blocks.
    pub cluster: Option<[u32; 3]>,
    /// Programmatic stream serialization.
    pub programmatic: bool,
    /// Every block resident at once (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`).
    pub cooperative: bool,
    /// The memory sync domain the kernel runs in (0 to 3): sent as the default domain mapped to it.
    pub sync_domain: u8,
    /// `CUclusterSchedulingPolicy` (0: default, 1: spread, 2: load balancing).
    pub cluster_policy: u32,
}

/// `cuLaunchKernelEx` with the attributes `a` asks for.
///
/// # Safety
/// `func` is a live function of the current context, `stream` a live stream of it, and `args` the kernel's
/// parameter pointers, valid for the call.
unsafe fn launch_ex(
    func: cu::CUfunction,
    [gx, gy, gz]: [u32; 3],
    [bx, by, bz]: [u32; 3],
    shared: u32,
    stream: cu::CUstream,
    args: *mut *mut c_void,
    a: LaunchAttributes,
) -> Result<()> {
    use cu::CUlaunchAttributeID as Id;
    let none = cu::CUlaunchAttribute {
        id: Id::CU_LAUNCH_ATTRIBUTE_IGNORE,
        pad: [0; 4],
        value: cu::CUlaunchAttributeValue { pad: [0; 64] },
    };
    let mut attrs = [none; 6];
    let mut n = 0;
    let mut push = |id: Id, value: cu::CUlaunchAttributeValue| {
        attrs[n] = cu::CUlaunchAttribute {
            id,
            pad: [0; 4],
            value,
        };
        n += 1;
    };
    if let Some([x, y, z]) = a.cluster {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.clusterDim = cu::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
        push(Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, value);
    }
    if a.programmatic {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.programmaticStreamSerializationAllowed = 1;
        push(
            Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            value,
        );
    }
    if a.cooperative {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.cooperative = 1;
        push(Id::CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value);
    }
    if a.sync_domain != 0 {
        // The launch's own map sends the default domain to the physical one asked for.
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.memSyncDomainMap = cu::CUlaunchMemSyncDomainMap {
            default_: a.sync_domain,
            remote: a.sync_domain,
        };
        push(Id::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP, value);
    }
    if a.cluster_policy != 0 {
        use cu::CUclusterSchedulingPolicy as P;
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.clusterSchedulingPolicyPreference = match a.cluster_policy {
            1 => P::CU_CLUSTER_SCHEDULING_POLICY_SPREAD,
            2 => P::CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
            _ => P::CU_CLUSTER_SCHEDULING_POLICY_DEFAULT,
        };
        push(
            Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
            value,
        );
    }
    let config = cu::CUlaunchConfig {
        gridDimX: gx,
        gridDimY: gy,
        gridDimZ: gz,
        blockDimX: bx,
        blockDimY: by,
        blockDimZ: bz,
        sharedMemBytes: shared,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    // SAFETY: `config` and the attributes it points to live for the call; the caller guarantees the rest.
    check("cuLaunchKernelEx", unsafe {
        cu::cuLaunchKernelEx(&config, func, args, std::ptr::null_mut())
    })
}

/// A non-blocking stream.
#[derive(Debug)]
pub struct Stream {
    pub(super) ctx: Arc<Context>,
    pub(super) stream: cu::CUstream,
}

// SAFETY: streams are usable from any thread with the context current; `&mut self` serialises our use.
unsafe impl Send for Stream {}

/// Most parameters a launch passes through the driver (cuLaunchKernel takes an array of pointers).
pub const MAX_PARAMS: usize = 512;

/// The reusable array of parameter pointers a launch hands to cuLaunchKernel (allocated once per queue).
#[derive(Debug, Default)]
pub struct ParamPtrs(Vec<*mut c_void>);

// SAFETY: the pointers are only meaningful during one launch call on the thread making it; between calls the
// array holds stale addresses that are never dereferenced.
unsafe impl Send for ParamPtrs {}

impl ParamPtrs {
    /// An empty array with room for `n` pointers.
    pub fn with_capacity(n: usize) -> ParamPtrs {
        ParamPtrs(Vec::with_capacity(n))
    }

    /// Empties the array (keeping its allocation).
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Appends the pointer to the next parameter's value.
    pub fn push(&mut self, p: *mut c_void) {
        self.0.push(p);
    }

    /// The pointers, as the launch call takes them.
    pub fn as_mut_slice(&mut self) -> &mut [*mut c_void] {
        &mut self.0
    }
}

impl Stream {
    /// A non-blocking stream in `ctx` (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`).
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local. CU_STREAM_NON_BLOCKING = 1.
        check("cuStreamCreate", unsafe { cu::cuStreamCreate(&mut s, 1) })?;
        Ok(Stream {
            ctx: ctx.clone(),
            stream: s,
        })
    }

    /// libcuda's handle, for calls APEX does not wrap.
    pub fn raw(&self) -> cu::CUstream {
        self.stream
    }

    /// A copyable reference to the stream, for waiting on it without borrowing it.
    pub fn handle(&self) -> StreamRef {
        StreamRef(self.stream)
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// A kernel of another context (another device's) cannot run on this stream: refused before the driver sees it.
    fn check_context(&self, f: &Function) -> Result<()> {
        if f.module.ctx.ctx == self.ctx.ctx {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "kernel `{}` belongs to a module loaded in another context (another GPU) than the queue's stream; load \
             the module on the queue's GPU",
            f.name
        )))
    }

    /// cuLaunchKernel with one pointer per parameter.
    ///
    /// # Safety
    /// `params[i]` must point to a value of the size the kernel's parameter `i` has, alive for the call; the
    /// kernel may access any memory its arguments lead it to.
    pub unsafe fn launch(
        &mut self,
        f: &Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded to the caller.
        unsafe { self.launch_as(LaunchKind::Plain, f, grid, block, shared, params) }
    }

    /// Launches `f` on this stream with the driver call `kind` names: the one place the checks every launch
    /// needs (the kernel's context, the current context, the dynamic shared memory limit) are made.
    ///
    /// # Safety
    /// As for [`Stream::launch`].
    pub unsafe fn launch_as(
        &mut self,
        kind: LaunchKind,
        f: &Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.check_context(f)?;
        self.ctx.bind()?;
        f.ensure_dynamic_shared(shared)?;
        let [gx, gy, gz] = grid;
        let [bx, by, bz] = block;
        let (stream, args) = (self.stream, params.as_mut_ptr());
        match kind {
            // SAFETY: the caller guarantees the parameter pointers.
            LaunchKind::Plain => check("cuLaunchKernel", unsafe {
                cu::cuLaunchKernel(
                    f.func,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    shared,
                    stream,
                    args,
                    std::ptr::null_mut(),
                )
            }),
            // SAFETY: as above.
            LaunchKind::Cooperative => check("cuLaunchCooperativeKernel", unsafe {
                cu::cuLaunchCooperativeKernel(f.func, gx, gy, gz, bx, by, bz, shared, stream, args)
            }),
            LaunchKind::Cluster(cluster) => {
                let a = LaunchAttributes {
                    cluster: Some(cluster),
                    ..LaunchAttributes::default()
                };
                // SAFETY: forwarded.
                unsafe { launch_ex(f.func, grid, block, shared, stream, args, a) }
            }
            LaunchKind::Programmatic(cluster) => {
                let a = LaunchAttributes {
                    cluster,
                    programmatic: true,
                    ..LaunchAttributes::default()
                };
                // SAFETY: forwarded.
                unsafe { launch_ex(f.func, grid, block, shared, stream, args, a) }
            }
            // SAFETY: forwarded.
            LaunchKind::Attributed(a) => unsafe {
                launch_ex(f.func, grid, block, shared, stream, args, a)
            },
        }
    }

    /// Waits until everything submitted to the stream is complete (`cuStreamSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.stream)
        })
    }

    /// Whether everything submitted so far is complete.
    pub fn is_idle(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: a live stream.
        let r = unsafe { cu::cuStreamQuery(self.stream) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|_| true)
    }

    /// Asynchronous copy between device addresses (or host memory mapped for the device).
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream has executed the copy.
    pub unsafe fn copy(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: forwarded to the caller; cuMemcpyAsync works out the direction from unified addresses.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, bytes as usize, self.stream)
        })
    }

    /// Asynchronous memset of `count` elements of `width` bytes (1, 2 or 4) at `dst` to `value`'s low bytes
    /// (`cuMemsetD8Async`, `cuMemsetD16Async`, `cuMemsetD32Async`).
    ///
    /// # Safety
    /// The range must stay valid until the stream has executed the memset.
    pub unsafe fn fill(&mut self, dst: u64, value: u32, width: u32, count: u64) -> Result<()> {
        self.ctx.bind()?;
        let n = count as usize;
        // SAFETY: forwarded to the caller.
        unsafe {
            match width {
                1 => check(
                    "cuMemsetD8Async",
                    cu::cuMemsetD8Async(dst, value as u8, n, self.stream),
                ),
                2 => check(
                    "cuMemsetD16Async",
                    cu::cuMemsetD16Async(dst, value as u16, n, self.stream),
                ),
                4 => check(
                    "cuMemsetD32Async",
                    cu::cuMemsetD32Async(dst, value, n, self.stream),
                ),
                _ => Err(Error::Call {
                    call: "cuMemsetD*Async",
                    code: 1,
                    name: format!("an element width of {width} bytes (1, 2 or 4)"),
                }),
            }
        }
    }

    /// Asynchronous copy from `src` in `src_ctx`'s device memory to `dst` in `dst_ctx`'s (`cuMemcpyPeerAsync`):
    /// over the peer link where there is one, staged by the driver where not.
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream has executed the copy.
    pub unsafe fn copy_peer(
        &mut self,
        dst: u64,
        dst_ctx: &Context,
        src: u64,
        src_ctx: &Context,
        bytes: u64,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: forwarded to the caller; both contexts are retained.
        check("cuMemcpyPeerAsync", unsafe {
            cu::cuMemcpyPeerAsync(
                dst,
                dst_ctx.ctx,
                src,
                src_ctx.ctx,
                bytes as usize,
                self.stream,
            )
        })
    }

    /// Synchronous copy of pageable host memory to the device.
    pub fn upload(&mut self, dst: u64, data: &[u8]) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: `data` is alive for the call; the copy completes before returning (stream-ordered, then synced).
        unsafe {
            check(
                "cuMemcpyHtoDAsync",
                cu::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), self.stream),
            )?;
        }
        self.synchronize()
    }

    /// Synchronous copy of device memory to pageable host memory.
    pub fn download(&mut self, src: u64, out: &mut [u8]) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: as in `upload`.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                cu::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), self.stream),
            )?;
        }
        self.synchronize()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys our own stream once (pending work completes first, as the driver specifies).
        unsafe { cu::cuStreamDestroy_v2(self.stream) };
    }
}

/// A stream's handle, for fences that outlive a borrow of the stream's queue.
#[derive(Clone, Copy, Debug)]
pub struct StreamRef(cu::CUstream);

// SAFETY: a stream handle may be queried from any thread with its context current.
unsafe impl Send for StreamRef {}
// SAFETY: as above.
unsafe impl Sync for StreamRef {}

impl StreamRef {
    /// The raw stream handle.
    pub fn raw(self) -> cu::CUstream {
        self.0
    }

    /// Whether everything submitted to the stream so far is complete.
    pub fn is_idle(self, ctx: &Context) -> Result<bool> {
        ctx.bind()?;
        // SAFETY: the handle came from a live `Stream`; a stream destroyed since makes the driver return an
        // error code (handles are validated), not undefined behaviour.
        let r = unsafe { cu::cuStreamQuery(self.0) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|_| true)
    }
}

/// A CUDA graph captured from a stream and instantiated, for replay with cuGraphLaunch.
#[derive(Debug)]
pub struct Graph {
    ctx: Arc<Context>,
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
}

// SAFETY: graph handles are usable from any thread with the context current.
unsafe impl Send for Graph {}

impl Graph {
    /// Records what `record` submits to `stream` into a graph.
    pub fn capture(
        stream: &mut Stream,
        record: impl FnOnce(&mut Stream) -> Result<()>,
    ) -> Result<Graph> {
        stream.ctx.bind()?;
        // SAFETY: begins capture on a live stream; CU_STREAM_CAPTURE_MODE_THREAD_LOCAL.
        check("cuStreamBeginCapture", unsafe {
            cu::cuStreamBeginCapture_v2(
                stream.stream,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let recorded = record(stream);
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, so the stream is usable again).
        let ended = check("cuStreamEndCapture", unsafe {
            cu::cuStreamEndCapture(stream.stream, &mut graph)
        });
        recorded?;
        ended?;
        let mut exec = std::ptr::null_mut();
        // SAFETY: instantiates the graph just captured.
        check("cuGraphInstantiate", unsafe {
            cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        })?;
        Ok(Graph {
            ctx: stream.ctx.clone(),
            graph,
            exec,
        })
    }

    /// Replays the graph on `stream` (`cuGraphLaunch`).
    pub fn launch(&self, stream: &mut Stream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: launches our instantiated graph on a live stream.
        check("cuGraphLaunch", unsafe {
            cu::cuGraphLaunch(self.exec, stream.stream)
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys our own objects once.
        unsafe {
            cu::cuGraphExecDestroy(self.exec);
            cu::cuGraphDestroy(self.graph);
        }
    }
}

/// Makes `waiter` wait, on the GPU, for everything submitted to `signaler` so far (an event recorded on one and
/// waited for by the other), both streams of `ctx`.
///
/// # Safety
/// Both must be valid streams of `ctx` (null: its legacy default stream).
pub unsafe fn order_streams(
    ctx: &Context,
    waiter: cu::CUstream,
    signaler: cu::CUstream,
) -> Result<()> {
    // SAFETY: forwarded: both are streams of `ctx`.
    unsafe { order_streams_across(ctx, waiter, ctx, signaler) }
}

/// Makes `waiter` (a stream of `waiter_ctx`) wait, on the GPU, for everything submitted so far to `signaler` (a
/// stream of `signaler_ctx`, possibly another device's): an event recorded on one and waited for by the other.
///
/// # Safety
/// Both must be valid streams of their contexts (null: the context's legacy default stream).
pub unsafe fn order_streams_across(
    waiter_ctx: &Context,
    waiter: cu::CUstream,
    signaler_ctx: &Context,
    signaler: cu::CUstream,
) -> Result<()> {
    signaler_ctx.bind()?;
    let mut ev = std::ptr::null_mut();
    // SAFETY: the signaler's context is current for the event's creation and record; the waiter's for the wait
    // (CUDA allows waiting on another device's event); CUDA keeps the event until its record completes.
    unsafe {
        check(
            "cuEventCreate",
            cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
        )?;
        let r = check("cuEventRecord", cu::cuEventRecord(ev, signaler))
            .and_then(|()| waiter_ctx.bind())
            .and_then(|()| check("cuStreamWaitEvent", cu::cuStreamWaitEvent(waiter, ev, 0)));
        cu::cuEventDestroy_v2(ev);
        r
    }
}
