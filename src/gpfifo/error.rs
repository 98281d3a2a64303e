use std::time::Duration;

use super::ChannelFault;

/// Errors of the channel layer.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Rm(#[from] crate::rm::Error),
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        what: &'static str,
        waited: Duration,
    },
    #[error("the channel faulted: {0}")]
    Fault(ChannelFault),
    #[error(
        "pushbuffer segment at {va:#x} of {dwords} dwords cannot be referenced by a GPFIFO entry ({why})"
    )]
    BadSegment {
        va: u64,
        dwords: u64,
        why: &'static str,
    },
    #[error("invalid channel configuration: {0}")]
    InvalidConfig(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
