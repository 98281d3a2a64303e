//! Completion points on a queue.

use std::sync::Arc;
use std::time::Duration;

use super::backend::Backed;
use super::{Backend, Result};
use crate::driver;
use crate::launch::{self, ComputeQueue};
use crate::module::printf::PrintfFifo;
use crate::pushbuf;

/// A completion point on a queue. Waiting on it also prints what the queue's kernels `printf`ed so far, and
/// reports a failed device `assert` as [`LaunchError::Assert`](crate::errors::LaunchError::Assert).
#[derive(Clone, Debug)]
pub struct Fence(Backed<DirectFence, Arc<driver::StreamFence>>);

/// The direct path's fence, with the printf FIFO its queue's kernels print through.
#[derive(Clone, Debug)]
pub(super) struct DirectFence {
    fence: pushbuf::Fence,
    printf: Option<Arc<PrintfFifo>>,
}

impl Fence {
    pub(super) fn from_direct(fence: pushbuf::Fence, q: &ComputeQueue) -> Fence {
        Fence(Backed::Direct(DirectFence {
            fence,
            printf: q.printf_fifo().cloned(),
        }))
    }

    /// The driver backend's fences complete with their stream (a conservative wait).
    pub(super) fn from_driver(fence: driver::StreamFence) -> Fence {
        Fence(Backed::Driver(Arc::new(fence)))
    }

    /// The backend whose queue made this fence.
    pub fn backend(&self) -> Backend {
        self.0.backend()
    }

    /// The direct path's fence (a timeline semaphore value), when a direct-path queue made this one.
    pub fn direct(&self) -> Option<&pushbuf::Fence> {
        self.0.direct().map(|d| &d.fence)
    }

    /// The driver backend's fence.
    pub(super) fn driver_part(&self) -> Option<&driver::StreamFence> {
        self.0.driver().map(|w| &**w)
    }

    /// Waits until the work before the fence is complete (at most `timeout`), then prints kernel `printf` output.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        match &self.0 {
            Backed::Direct(d) => Ok(launch::settle(d.printf.as_ref(), d.fence.wait(timeout))?),
            Backed::Driver(w) => Ok(w.wait(timeout)?),
        }
    }

    /// Whether the work before the fence is complete (no waiting, no printing).
    pub fn is_done(&self) -> bool {
        match &self.0 {
            Backed::Direct(d) => d.fence.is_done(),
            Backed::Driver(w) => w.is_done(),
        }
    }
}
