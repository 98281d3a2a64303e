//! The pushbuffer layer's error and result types.

use super::encode::Overflow;

/// Errors of the pushbuffer layer.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The channel (or RM below it) failed.
    #[error(transparent)]
    Channel(#[from] crate::gpfifo::Error),
    /// What was recorded did not fit the pushbuffer.
    #[error(transparent)]
    Overflow(#[from] Overflow),
}

impl From<crate::rm::Error> for Error {
    fn from(e: crate::rm::Error) -> Error {
        Error::Channel(e.into())
    }
}

/// The pushbuffer layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
