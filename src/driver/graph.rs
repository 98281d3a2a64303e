//! CUDA graphs built node by node from a launch graph's description, without stream capture: kernel nodes with
//! their parameters (`cuGraphAddKernelNode`), memcpy nodes (`cuGraphAddMemcpyNode`) and the edges the
//! description's dependencies give, instantiated once (`cuGraphInstantiate`), launched with `cuGraphLaunch` and
//! updated with `cuGraphExecKernelNodeSetParams`.

use std::ffi::c_void;
use std::sync::Arc;

use super::{Context, Error, Function, ParamPtrs, Result, Stream, check, cu};

/// One node of a graph to build.
#[derive(Clone, Copy, Debug)]
pub enum GraphNode<'a> {
    /// A kernel launch. `params` is the parameter block laid out at the offsets the function declares
    /// ([`Function::params`]); the driver copies the values when the node is made.
    Kernel {
        /// The kernel.
        func: &'a Function,
        /// Blocks per axis.
        grid: [u32; 3],
        /// Threads per block per axis.
        block: [u32; 3],
        /// Dynamic shared memory per block.
        shared: u32,
        /// A run-time thread block cluster shape (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` on the node).
        cluster: Option<[u32; 3]>,
        /// The packed parameter block.
        params: &'a [u8],
        /// The kernel waits for its producers itself (`griddepcontrol.wait`): its edges from kernel nodes are
        /// programmatic (`CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`), so it may start before they complete.
        programmatic: bool,
    },
    /// A device-to-device copy of `bytes` bytes.
    Copy {
        /// Source address.
        src: u64,
        /// Destination address.
        dst: u64,
        /// Bytes.
        bytes: u64,
    },
}

/// An instantiated CUDA graph with a handle on each of its nodes, for launches and kernel-node updates.
#[derive(Debug)]
pub struct GraphExec {
    ctx: Arc<Context>,
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
    /// The graph's nodes, in the description's order.
    nodes: Vec<cu::CUgraphNode>,
}

// SAFETY: graph handles are usable from any thread with the context current; `&mut self` serialises updates.
unsafe impl Send for GraphExec {}

/// Fills `ptrs` with one pointer per parameter of `func`, into `params` at the parameter's offset.
fn param_ptrs(func: &Function, params: &[u8], ptrs: &mut ParamPtrs) -> Result<()> {
    ptrs.clear();
    for (i, &(off, size)) in func.params().iter().enumerate() {
        if off as usize + size as usize > params.len() {
            return Err(Error::InvalidArgument(format!(
                "parameter {i} of `{}` lies at {off}+{size}, past the {}-byte parameter block given",
                func.name(),
                params.len()
            )));
        }
        // The driver only reads through these pointers, during the call that takes them.
        ptrs.push(params[off as usize..].as_ptr() as *mut c_void);
    }
    Ok(())
}

fn kernel_params(
    func: &Function,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    ptrs: &mut ParamPtrs,
) -> cu::CUDA_KERNEL_NODE_PARAMS {
    cu::CUDA_KERNEL_NODE_PARAMS {
        func: func.func,
        gridDimX: grid[0],
        gridDimY: grid[1],
        gridDimZ: grid[2],
        blockDimX: block[0],
        blockDimY: block[1],
        blockDimZ: block[2],
        sharedMemBytes: shared,
        kernelParams: ptrs.as_mut_slice().as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

impl GraphExec {
    /// Builds and instantiates a graph of `nodes`, node `i` depending on the nodes `preds[i]`. `order` lists every
    /// node after its predecessors (the driver needs a node's dependencies to exist when it is added). Nothing
    /// runs until [`launch`](Self::launch).
    pub fn build(
        ctx: &Arc<Context>,
        nodes: &[GraphNode<'_>],
        preds: &[Vec<usize>],
        order: &[usize],
    ) -> Result<GraphExec> {
        if preds.len() != nodes.len() || order.len() != nodes.len() {
            return Err(Error::InvalidArgument(format!(
                "{} nodes, {} dependency lists and an order of {}",
                nodes.len(),
                preds.len(),
                order.len()
            )));
        }
        ctx.bind()?;
        let mut graph = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuGraphCreate", unsafe { cu::cuGraphCreate(&mut graph, 0) })?;
        // From here on the graph is owned by `g`, destroyed on every error path.
        let mut g = GraphExec {
            ctx: ctx.clone(),
            graph,
            exec: std::ptr::null_mut(),
            nodes: vec![std::ptr::null_mut(); nodes.len()],
        };
        let mut ptrs = ParamPtrs::with_capacity(super::MAX_PARAMS);
        let mut deps: Vec<cu::CUgraphNode> = Vec::new();
        for &i in order {
            let node = nodes.get(i).ok_or_else(|| {
                Error::InvalidArgument(format!("node {i} in the order is not a node"))
            })?;
            deps.clear();
            for &p in &preds[i] {
                let h = g.nodes.get(p).copied().unwrap_or(std::ptr::null_mut());
                if h.is_null() {
                    return Err(Error::InvalidArgument(format!(
                        "node {i} depends on node {p}, which the order does not add before it"
                    )));
                }
                deps.push(h);
            }
            let mut handle = std::ptr::null_mut();
            match *node {
                GraphNode::Kernel {
                    func,
                    grid,
                    block,
                    shared,
                    cluster,
                    params,
                    programmatic,
                } => {
                    if func.module.ctx.ctx != ctx.ctx {
                        return Err(Error::InvalidArgument(format!(
                            "kernel `{}` belongs to a module of another context (another GPU) than the graph's; \
                             load the module on the queue's GPU",
                            func.name()
                        )));
                    }
                    func.ensure_dynamic_shared(shared)?;
                    param_ptrs(func, params, &mut ptrs)?;
                    let p = kernel_params(func, grid, block, shared, &mut ptrs);
                    // A programmatic node is added alone, then given its edges one by one with their types.
                    let direct_deps: &[cu::CUgraphNode] = if programmatic { &[] } else { &deps };
                    // SAFETY: `p` and the parameter pointers (into `params`) are alive for the call, which copies
                    // the values; `direct_deps` holds nodes of this graph.
                    check("cuGraphAddKernelNode", unsafe {
                        cu::cuGraphAddKernelNode_v2(
                            &mut handle,
                            g.graph,
                            direct_deps.as_ptr(),
                            direct_deps.len(),
                            &p,
                        )
                    })?;
                    if programmatic {
                        for (&from, &pi) in deps.iter().zip(&preds[i]) {
                            let kernel_pred =
                                matches!(nodes.get(pi), Some(GraphNode::Kernel { .. }));
                            let edge = cu::CUgraphEdgeData {
                                from_port: if kernel_pred {
                                    cu::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8
                                } else {
                                    0
                                },
                                to_port: 0,
                                type_: if kernel_pred {
                                    cu::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
                                        as u8
                                } else {
                                    0
                                },
                                reserved: [0; 5],
                            };
                            // SAFETY: both nodes belong to this graph; `edge` lives for the call.
                            check("cuGraphAddDependencies_v2", unsafe {
                                cu::cuGraphAddDependencies_v2(g.graph, &from, &handle, &edge, 1)
                            })?;
                        }
                    }
                    if let Some(c) = cluster {
                        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
                        value.clusterDim = cu::CUlaunchAttributeValue_union__bindgen_ty_1 {
                            x: c[0],
                            y: c[1],
                            z: c[2],
                        };
                        // SAFETY: a live kernel node of this graph; `value` is alive for the call.
                        check("cuGraphKernelNodeSetAttribute", unsafe {
                            cu::cuGraphKernelNodeSetAttribute(
                                handle,
                                cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                                &value,
                            )
                        })?;
                    }
                }
                GraphNode::Copy { src, dst, bytes } => {
                    if bytes == 0 {
                        return Err(Error::InvalidArgument(format!(
                            "node {i} is a copy of 0 bytes"
                        )));
                    }
                    let copy = cu::CUDA_MEMCPY3D {
                        srcXInBytes: 0,
                        srcY: 0,
                        srcZ: 0,
                        srcLOD: 0,
                        srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: src,
                        srcArray: std::ptr::null_mut(),
                        reserved0: std::ptr::null_mut(),
                        srcPitch: 0,
                        srcHeight: 0,
                        dstXInBytes: 0,
                        dstY: 0,
                        dstZ: 0,
                        dstLOD: 0,
                        dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        dstHost: std::ptr::null_mut(),
                        dstDevice: dst,
                        dstArray: std::ptr::null_mut(),
                        reserved1: std::ptr::null_mut(),
                        dstPitch: 0,
                        dstHeight: 0,
                        WidthInBytes: bytes as usize,
                        Height: 1,
                        Depth: 1,
                    };
                    // SAFETY: `copy` is alive for the call; `deps` holds nodes of this graph; the caller vouches
                    // for the ranges.
                    check("cuGraphAddMemcpyNode", unsafe {
                        cu::cuGraphAddMemcpyNode(
                            &mut handle,
                            g.graph,
                            deps.as_ptr(),
                            deps.len(),
                            &copy,
                            ctx.ctx,
                        )
                    })?;
                }
            }
            g.nodes[i] = handle;
        }
        // SAFETY: instantiates the graph just built; out-pointer into `g`.
        check("cuGraphInstantiate", unsafe {
            cu::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0)
        })?;
        Ok(g)
    }

    /// Launches the graph on `stream` (cuGraphLaunch), after the stream's earlier work.
    ///
    /// # Safety
    /// The graph's kernels run and may read and write any memory their parameters lead them to, and its copies
    /// the ranges they name: the caller guarantees that memory is alive and not in use elsewhere until the stream
    /// has run the graph.
    pub unsafe fn launch(&self, stream: &mut Stream) -> Result<()> {
        if stream.ctx.ctx != self.ctx.ctx {
            return Err(Error::InvalidArgument(
                "a graph built in another context (another GPU) than the stream's".into(),
            ));
        }
        self.ctx.bind()?;
        // SAFETY: our instantiated graph on a live stream of its context.
        check("cuGraphLaunch", unsafe {
            cu::cuGraphLaunch(self.exec, stream.stream)
        })
    }

    /// Gives kernel node `node` a new shape and parameters for later launches (cuGraphExecKernelNodeSetParams),
    /// through `ptrs` (no allocation when it has room for one pointer per parameter). `func` must be the node's
    /// kernel. Launches already made run with what they had.
    pub fn set_kernel(
        &mut self,
        node: usize,
        func: &Function,
        (grid, block, shared): ([u32; 3], [u32; 3], u32),
        params: &[u8],
        ptrs: &mut ParamPtrs,
    ) -> Result<()> {
        let handle = *self.nodes.get(node).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "node {node} of a graph of {} nodes",
                self.nodes.len()
            ))
        })?;
        self.ctx.bind()?;
        func.ensure_dynamic_shared(shared)?;
        param_ptrs(func, params, ptrs)?;
        let p = kernel_params(func, grid, block, shared, ptrs);
        // SAFETY: a kernel node of this graph; `p` and the parameter pointers are alive for the call, which copies
        // the values.
        check("cuGraphExecKernelNodeSetParams", unsafe {
            cu::cuGraphExecKernelNodeSetParams_v2(self.exec, handle, &p)
        })
    }

    /// The context the graph lives in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys our own objects once (the executable only if instantiation got that far); the driver
        // lets launched work finish first.
        unsafe {
            if !self.exec.is_null() {
                cu::cuGraphExecDestroy(self.exec);
            }
            cu::cuGraphDestroy(self.graph);
        }
    }
}
