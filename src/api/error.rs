//! The public API's error and result types.

use std::fmt;

use super::{Backend, FallbackReason};
use crate::driver;
use crate::launch;
use crate::module;
use crate::pushbuf;
use crate::rm;

/// Errors of the public API.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The direct path failed.
    #[error(transparent)]
    Direct(#[from] launch::Error),
    /// The CUDA driver backend failed.
    #[error(transparent)]
    Driver(#[from] driver::Error),
    /// `APEX_BACKEND` holds something else than `direct`, `driver` or `auto`.
    #[error(
        "APEX_BACKEND={0:?} is not a backend APEX knows; set it to direct, driver or auto (or unset it)"
    )]
    BadBackendVar(String),
    /// The direct path was asked for (`APEX_BACKEND=direct`) and cannot run.
    #[error(
        "the direct path was requested (APEX_BACKEND=direct) but cannot run: {0}; or unset APEX_BACKEND to fall \
         back to the CUDA driver"
    )]
    DirectUnavailable(FallbackReason),
    /// Neither backend could open the GPU.
    #[error(
        "cannot open GPU {index} with either backend. The direct path cannot run: {direct}. The CUDA driver \
         backend cannot run either: {driver}."
    )]
    NoBackend {
        /// The GPU index asked for.
        index: usize,
        /// Why the direct path cannot run.
        direct: FallbackReason,
        /// Why the CUDA driver backend cannot run.
        driver: driver::Error,
    },
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Objects of different GPUs or backends were used together.
    #[error(
        "the objects belong to different backends or GPUs; use buffers, modules and queues of the same Gpu together"
    )]
    Mismatch,
    /// A graph instantiated on one queue was replayed on another.
    #[error(
        "this graph was instantiated on another queue: its prebuilt work belongs to that queue; instantiate the \
         graph again (Queue::instantiate) on the queue that replays it"
    )]
    GraphQueue,
    /// Two GPUs that cannot reach each other's memory were used together (a copy between them, a peer mapping):
    /// they have no peer link, or were not opened together.
    #[error(
        "{0}; open the GPUs together with Gpu::open_peers (GPUs opened one by one each get an address space of \
         their own), on GPUs with a peer link (`nvidia-smi topo -m`)"
    )]
    NotPeers(#[source] rm::Error),
    /// A memory pool found no room for an allocation ([`Queue::alloc_async`](super::Queue::alloc_async)): the
    /// device's memory or the pool's reserve limit ran out. Says what the pool holds and which queues hold it.
    #[error(transparent)]
    PoolOutOfMemory(Box<PoolOutOfMemory>),
    /// A module file could not be read.
    #[error("cannot read the module file {}: {source}", path.display())]
    ReadModule {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<module::Error> for Error {
    /// As the launch layer reports it ([`LaunchError::Module`](crate::errors::LaunchError::Module), or
    /// [`LaunchError::Queue`](crate::errors::LaunchError::Queue) for RM errors).
    fn from(e: module::Error) -> Error {
        Error::Direct(e.into())
    }
}

impl From<rm::Error> for Error {
    fn from(e: rm::Error) -> Error {
        Error::Direct(e.into())
    }
}

impl From<pushbuf::Error> for Error {
    fn from(e: pushbuf::Error) -> Error {
        Error::Direct(e.into())
    }
}

impl From<driver::BackendError> for Error {
    /// As the public API reported the same failures before the driver backend's objects held that logic.
    fn from(e: driver::BackendError) -> Error {
        match e {
            driver::BackendError::Driver(e) => Error::Driver(e),
            driver::BackendError::Launch(e) => Error::Direct(e),
            driver::BackendError::InvalidArgument(why) => Error::InvalidArgument(why),
            driver::BackendError::OtherQueue => Error::GraphQueue,
        }
    }
}

/// Why a pool allocation found no memory ([`Error::PoolOutOfMemory`]): what was asked, what the pool holds and
/// which queues hold it.
#[derive(Debug)]
#[non_exhaustive]
pub struct PoolOutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// The backend of the pool.
    pub backend: Backend,
    /// Bytes of device memory the pool holds.
    pub reserved_bytes: u64,
    /// Bytes of those handed out and not freed.
    pub used_bytes: u64,
    /// Blocks handed out and not freed (direct path).
    pub blocks: u64,
    /// Bytes in use per queue that allocated them ([`Queue::id`](super::Queue::id), bytes), largest first (direct path).
    pub held_by: Vec<(u64, u64)>,
    /// The pool's reserve limit, when it was what refused ([`PoolOptions::reserve_limit`](super::PoolOptions::reserve_limit)).
    pub limit: Option<u64>,
    /// The driver's answer, when device memory itself ran out.
    pub source: Option<Error>,
}

impl fmt::Display for PoolOutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory: a pool allocation of {} bytes failed (",
            self.requested
        )?;
        match (&self.limit, &self.source) {
            (Some(limit), _) => write!(f, "the pool's reserve limit is {limit} bytes")?,
            (None, Some(e)) => write!(f, "the device has no more memory: {e}")?,
            (None, None) => write!(f, "the device does not have that much memory")?,
        }
        write!(
            f,
            "). The {:?} pool holds {} bytes reserved, {} bytes in use",
            self.backend, self.reserved_bytes, self.used_bytes
        )?;
        if self.blocks > 0 {
            write!(f, " in {} blocks", self.blocks)?;
        }
        if !self.held_by.is_empty() {
            write!(f, " (")?;
            for (i, (queue, bytes)) in self.held_by.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                write!(f, "{sep}queue {queue}: {bytes} bytes")?;
            }
            write!(f, ")")?;
        }
        write!(
            f,
            "; free blocks (Queue::free_async), synchronize the queues that freed them and trim the pool \
             (MemoryPool::trim), trim other pools, or raise PoolOptions::reserve_limit"
        )
    }
}

impl std::error::Error for PoolOutOfMemory {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The public API's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
