//! The direct path's copy engines for copies from one GPU into another's memory, which a queue builds on first use
//! and keeps.

use std::sync::{Arc, Weak};

use super::Error;
use super::Result;
use crate::launch::CopyEngines;
use crate::rm::{self, GpuCore};

/// A queue's copy engines for copies from one GPU into another's memory (direct path).
#[derive(Debug)]
pub(super) struct PeerEngines {
    /// The destination GPU (the source is the engines' own); dead once that GPU is closed.
    dst: Weak<GpuCore>,
    engines: CopyEngines,
}

/// The engines of `cache` for copies from `src` into `dst`, built on first use.
pub(super) fn peer_engines<'a>(
    cache: &'a mut Vec<PeerEngines>,
    src: &Arc<GpuCore>,
    dst: &Arc<GpuCore>,
) -> Result<&'a mut CopyEngines> {
    // Engines whose destination GPU is gone are not used again (a new GpuCore may reuse its address).
    cache.retain(|p| p.dst.strong_count() > 0);
    let found = cache.iter().position(|p| {
        Arc::ptr_eq(p.engines.gpu(), src) && std::ptr::eq(p.dst.as_ptr(), Arc::as_ptr(dst))
    });
    let i = match found {
        Some(i) => i,
        None => {
            let engines = CopyEngines::for_peer(src, dst).map_err(peer_error)?;
            tracing::debug!(src = %src.info().uuid, dst = %dst.info().uuid,
                lces = ?engines.lces().collect::<Vec<_>>(), "copy engines for copies between GPUs");
            cache.push(PeerEngines {
                dst: Arc::downgrade(dst),
                engines,
            });
            cache.len() - 1
        }
    };
    Ok(&mut cache[i].engines)
}

/// [`Error::NotPeers`] for RM's refusals of a pair of GPUs, the error as it is otherwise.
pub(super) fn peer_error(e: impl Into<Error>) -> Error {
    match e.into() {
        Error::Direct(crate::launch::Error::Queue(crate::pushbuf::Error::Channel(
            crate::gpfifo::Error::Rm(
                e @ (rm::Error::NotPeers { .. } | rm::Error::NoPeerPath { .. }),
            ),
        ))) => Error::NotPeers(e),
        e => e,
    }
}
