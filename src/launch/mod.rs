//! Kernel launches on our own channel, rung by doorbell: parameters, constant banks, QMDs, the compute queue
//! (slots, stream order, chains, copies), graphs and the occupancy calculator.
//!
//! The kernels come from the module layer ([`module`](crate::module)), which this layer uses and which uses
//! nothing of it; the queue drains the printf FIFO ([`settle`]) and reports a failed device `assert` as
//! [`Error::Assert`].

pub mod cbank;
mod copies;
pub mod graph;
pub mod occupancy;
pub mod params;
pub mod qmd;
mod queue;

use std::fmt;

use crate::module::printf::AssertFailure;

pub use copies::{ALL_LCES, CopyEngines, MAX_COPY_ENGINES};
pub use params::{Arg, DevicePtr, ParamError};
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
    /// Loading a module or looking up its kernels and variables failed (a cubin, fatbin or image that cannot be
    /// had, no kernel or variable of that name, a refused kernel, a copy outside a variable). RM errors of the
    /// module layer come as [`Error::Queue`], as the launch layer's own do.
    #[error(transparent)]
    Module(crate::module::Error),
    /// The arguments do not match the kernel's parameter table.
    #[error(transparent)]
    Params(#[from] ParamError),
    /// A launch value does not fit its QMD field.
    #[error(transparent)]
    Qmd(#[from] qmd::QmdError),
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
    Assert(Box<AssertError>),
    /// The printf FIFO's size was set after it had been allocated.
    #[error(
        "the printf FIFO is already {current} bytes: set its size before loading a module that uses printf or assert"
    )]
    PrintfFifoFixed {
        /// The size in use.
        current: u64,
    },
}

impl From<crate::module::Error> for Error {
    fn from(e: crate::module::Error) -> Error {
        match e {
            crate::module::Error::Rm(e) => Error::Queue(e.into()),
            e => Error::Module(e),
        }
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

/// A failed device `assert`, and the channel fault its trap caused (none when it ended its thread:
/// [`AssertAction::EndThread`](crate::module::printf::AssertAction::EndThread)).
#[derive(Debug)]
pub struct AssertError {
    /// What the `assert` reported.
    pub failure: AssertFailure,
    /// The fault the assert's trap raised on the queue's channel; `None` when the failing thread ended without
    /// one ([`AssertAction::EndThread`](crate::module::printf::AssertAction::EndThread)) and the queue can go on.
    pub fault: Option<crate::pushbuf::Error>,
}

impl fmt::Display for AssertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.fault {
            Some(fault) => write!(
                f,
                "device assertion failed: {} The queue's channel faulted on the trap ({fault}); make a new queue to \
                 go on",
                self.failure
            ),
            None => write!(
                f,
                "device assertion failed: {} The failing thread ended; the rest of its grid ran on, so the results \
                 of that launch cannot be trusted",
                self.failure
            ),
        }
    }
}

impl std::error::Error for AssertError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.fault.as_ref().map(|e| e as _)
    }
}
