//! Cubins, modules, QMDs and kernel launches on our own channel, rung by doorbell.

pub mod cbank;
mod copies;
pub mod cubin;
pub mod fatbin;
pub mod graph;
pub mod image;
pub mod jit;
mod module;
pub mod occupancy;
pub mod params;
pub mod printf;
pub mod qmd;
mod queue;
pub mod select;

pub use copies::{ALL_LCES, CopyEngines, MAX_COPY_ENGINES};
pub use module::{Global, Kernel, Module, VariableHome};
pub use params::{Arg, ParamError};
pub use queue::{
    ClusterPolicy, ComputeQueue, ComputeQueueConfig, FIRST_CHAIN_PART, GraphExec, GraphSchedule,
    GraphStats, LaunchConfig, LaunchMemory, Limits, MAX_CLUSTER_BLOCKS, PreparedLaunch,
    StreamOrder, cluster_shape, settle, validate as queue_validate,
};

/// Errors of the launch layer. Everything about a launch is checked before anything reaches the ring.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The queue (channel, pushbuffer, RM) under the launch failed.
    #[error(transparent)]
    Queue(#[from] crate::pushbuf::Error),
    /// The cubin could not be parsed or loaded.
    #[error(transparent)]
    Cubin(#[from] cubin::CubinError),
    /// The fatbin could not be parsed.
    #[error(transparent)]
    Fatbin(#[from] fatbin::FatbinError),
    /// No cubin for the device could be had from a module's bytes (nothing fits, PTX did not compile, ...).
    /// Boxed: compiler logs make it the largest error, and launches return this type.
    #[error(transparent)]
    Image(Box<image::ImageError>),
    /// The arguments do not match the kernel's parameter table.
    #[error(transparent)]
    Params(#[from] ParamError),
    /// A launch value does not fit its QMD field.
    #[error(transparent)]
    Qmd(#[from] qmd::QmdError),
    /// The kernel calls an external device function the direct path does not provide (`malloc`, dynamic
    /// parallelism); the module's other kernels run.
    #[error("kernel `{kernel}` cannot run on the direct path: {reason}")]
    KernelRefused {
        /// The kernel.
        kernel: String,
        /// What it calls.
        reason: cubin::CubinError,
    },
    /// [`Module::kernel`] found no kernel of that name.
    #[error(
        "no kernel `{name}` in the module (it has: {}); use one of those names (mangled or demangled)",
        available.join(", ")
    )]
    NoSuchKernel {
        /// The name asked for.
        name: String,
        /// The module's kernels.
        available: Vec<String>,
    },
    /// [`Module::global`] found no variable of that name.
    #[error(
        "no global variable `{name}` in the module ({})",
        globals_list(available)
    )]
    NoSuchGlobal {
        /// The name asked for.
        name: String,
        /// The module's `__device__` and `__constant__` variables.
        available: Vec<String>,
    },
    /// A copy to or from a module variable outside it.
    #[error(
        "{bytes} bytes at offset {offset} of the global `{name}`, which has {size} bytes: the copy would leave the variable"
    )]
    GlobalRange {
        /// The variable.
        name: String,
        /// Its size.
        size: u64,
        /// Where the copy starts inside it.
        offset: u64,
        /// Bytes copied.
        bytes: u64,
    },
    /// A launch the kernel or the device cannot run (grid, block, shared memory, cluster, ...).
    #[error("invalid launch of `{kernel}`: {why}")]
    InvalidLaunch {
        /// The kernel.
        kernel: String,
        /// Which limit, and how to stay inside it.
        why: String,
    },
    /// The direct path cannot launch on this GPU.
    #[error(
        "the direct launch path does not support this GPU: {0}; use the CUDA driver backend (APEX_BACKEND=driver)"
    )]
    Unsupported(String),
    /// A launch graph's description was refused (a cycle, a node of another graph, a range that wraps).
    #[error(transparent)]
    Graph(#[from] graph::GraphError),
    /// A graph instantiated on one queue was replayed on another.
    #[error(
        "this graph was instantiated on compute queue {built} and cannot run on queue {used}: its QMDs, semaphores \
         and methods belong to the queue it was built on; instantiate the graph again on this queue"
    )]
    GraphQueue {
        /// The queue it was instantiated on.
        built: u64,
        /// The queue it was given to.
        used: u64,
    },
    /// A graph node cannot take the update asked for.
    #[error("graph node #{node} cannot be updated: {why}")]
    GraphUpdate {
        /// The node.
        node: usize,
        /// What it cannot take, and what to do instead.
        why: String,
    },
    /// `end_chain` was called with no chained launch recorded since the last one.
    #[error(
        "end_chain was called without a chained launch recorded; record one with record_launch_chained first"
    )]
    NoChain,
    /// A kernel's `assert` failed: the GPU trapped, and the queue's channel is faulted (make a new queue).
    #[error(transparent)]
    Assert(Box<printf::AssertError>),
    /// The printf FIFO's size was set after it had been allocated.
    #[error(
        "the printf FIFO is already {current} bytes: set its size before loading a module that uses printf or assert"
    )]
    PrintfFifoFixed {
        /// The size in use.
        current: u64,
    },
}

/// The variable list of [`Error::NoSuchGlobal`].
fn globals_list(available: &[String]) -> String {
    if available.is_empty() {
        "it has no `__device__` or `__constant__` variables".into()
    } else {
        format!("it has: {}", available.join(", "))
    }
}

impl From<image::ImageError> for Error {
    fn from(e: image::ImageError) -> Error {
        Error::Image(Box::new(e))
    }
}

impl From<crate::rm::Error> for Error {
    fn from(e: crate::rm::Error) -> Error {
        Error::Queue(e.into())
    }
}

impl From<crate::gpfifo::Error> for Error {
    fn from(e: crate::gpfifo::Error) -> Error {
        Error::Queue(e.into())
    }
}

/// The launch layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
