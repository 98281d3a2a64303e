//! Cubins, modules, QMDs and kernel launches on our own channel, rung by doorbell.

pub mod cbank;
pub mod cubin;
pub mod fatbin;
mod module;
pub mod occupancy;
pub mod params;
pub mod qmd;
mod queue;

pub use module::{Kernel, Module};
pub use params::{Arg, ParamError};
pub use queue::{
    ComputeQueue, ComputeQueueConfig, LaunchConfig, Limits, validate as queue_validate,
};

/// Errors of the launch layer. Everything about a launch is checked before anything reaches the ring.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Queue(#[from] crate::pushbuf::Error),
    #[error(transparent)]
    Cubin(#[from] cubin::CubinError),
    #[error(transparent)]
    Fatbin(#[from] fatbin::FatbinError),
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error(transparent)]
    Qmd(#[from] qmd::QmdError),
    #[error("no kernel `{name}` in the module (it has: {})", available.join(", "))]
    NoSuchKernel {
        name: String,
        available: Vec<String>,
    },
    #[error("invalid launch of `{kernel}`: {why}")]
    InvalidLaunch { kernel: String, why: String },
    #[error("the direct launch path does not support this GPU: {0}")]
    Unsupported(String),
    #[error("end_chain without a chained launch recorded")]
    NoChain,
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

pub type Result<T, E = Error> = std::result::Result<T, E>;
