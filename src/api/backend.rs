//! The one enum every public type keeps its backend's object in. A public method matches on it once and hands
//! the work to that backend's object: the direct path's (`rm`, `module`, `launch`) or the CUDA driver backend's
//! ([`crate::driver`]), which each hold the logic of their side.

use super::{Backend, Error, Result};

/// A public type's inside: the direct path's object or the driver backend's. Private, so that a new backend is not
/// a breaking change.
#[derive(Clone, Debug)]
pub(super) enum Backed<D, R> {
    /// The direct path's object.
    Direct(D),
    /// The CUDA driver backend's object.
    Driver(R),
}

impl<D, R> Backed<D, R> {
    /// Which backend holds it.
    pub(super) fn backend(&self) -> Backend {
        match self {
            Backed::Direct(_) => Backend::Direct,
            Backed::Driver(_) => Backend::Driver,
        }
    }

    /// The direct path's object, when that is the backend.
    pub(super) fn direct(&self) -> Option<&D> {
        match self {
            Backed::Direct(d) => Some(d),
            Backed::Driver(_) => None,
        }
    }

    /// The driver backend's object, when that is the backend.
    pub(super) fn driver(&self) -> Option<&R> {
        match self {
            Backed::Driver(r) => Some(r),
            Backed::Direct(_) => None,
        }
    }

    /// The direct path's object, mutable, when that is the backend.
    pub(super) fn direct_mut(&mut self) -> Option<&mut D> {
        match self {
            Backed::Direct(d) => Some(d),
            Backed::Driver(_) => None,
        }
    }

    /// Both sides borrowed.
    pub(super) fn as_ref(&self) -> Backed<&D, &R> {
        match self {
            Backed::Direct(d) => Backed::Direct(d),
            Backed::Driver(r) => Backed::Driver(r),
        }
    }

    /// Both sides borrowed mutably.
    pub(super) fn as_mut(&mut self) -> Backed<&mut D, &mut R> {
        match self {
            Backed::Direct(d) => Backed::Direct(d),
            Backed::Driver(r) => Backed::Driver(r),
        }
    }

    /// This object and `other`, of the same backend: [`Error::Mismatch`] when their backends differ.
    pub(super) fn with<D2, R2>(self, other: Backed<D2, R2>) -> Result<Backed<(D, D2), (R, R2)>> {
        match (self, other) {
            (Backed::Direct(a), Backed::Direct(b)) => Ok(Backed::Direct((a, b))),
            (Backed::Driver(a), Backed::Driver(b)) => Ok(Backed::Driver((a, b))),
            _ => Err(Error::Mismatch),
        }
    }
}
