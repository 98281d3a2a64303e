use std::time::Duration;

use super::ChannelFault;

/// Errors of the channel layer.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// An RM call under the channel failed.
    #[error(transparent)]
    Rm(#[from] crate::rm::Error),
    /// The GPU did not reach a point in time.
    #[error(
        "timed out after {waited:?} waiting for {what}; the GPU is still busy or hung: wait longer, or check \
         `nvidia-smi` and `dmesg` for a stuck GPU"
    )]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// The channel faulted (an MMU fault, a trap, a bad method); work after the fault did not run.
    #[error("the channel faulted: {0}; make a new queue to go on")]
    Fault(ChannelFault),
    /// A pushbuffer segment a GPFIFO entry cannot describe (a bug in the caller of the ring).
    #[error(
        "pushbuffer segment at {va:#x} of {dwords} dwords cannot be referenced by a GPFIFO entry ({why}); \
         split it or place it below 2^40"
    )]
    BadSegment {
        /// The segment's GPU address.
        va: u64,
        /// Its length in 32-bit words.
        dwords: u64,
        /// Which limit it breaks.
        why: &'static str,
    },
    /// The GPU's SM version has no row in the GPU-generation table ([`crate::hw::generation`]).
    #[error(transparent)]
    UnknownGeneration(#[from] crate::hw::UnknownGeneration),
    /// The GPU's generation has no RM classes APEX knows (its GPU is not driven through RM's ioctls).
    #[error("APEX knows no RM channel classes for {generation}; use the CUDA driver backend")]
    NoClasses {
        /// The chips of the generation's row.
        generation: &'static str,
    },
    /// A channel configuration value is out of range; the text says which.
    #[error("invalid channel configuration: {0}")]
    InvalidConfig(String),
}

/// The channel layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
