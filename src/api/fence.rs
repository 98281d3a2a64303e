//! Completion points on a queue.

use std::sync::Arc;
use std::time::Duration;

use super::{Backend, Error, Result};
use crate::driver;
use crate::launch::{self, ComputeQueue};
use crate::module::printf::PrintfFifo;
use crate::pushbuf;

/// A completion point on a queue. Waiting on it also prints what the queue's kernels `printf`ed so far, and
/// reports a failed device `assert` as [`launch::Error::Assert`].
#[derive(Clone, Debug)]
pub struct Fence(FenceInner);

#[derive(Clone, Debug)]
enum FenceInner {
    Direct {
        fence: pushbuf::Fence,
        printf: Option<Arc<PrintfFifo>>,
    },
    /// The driver backend's fences complete with their stream (a conservative wait).
    Driver(Arc<StreamWatch>),
}

/// Lets a driver-backend fence wait on its stream without borrowing the queue.
#[derive(Debug)]
pub(super) struct StreamWatch {
    ctx: Arc<driver::Context>,
    stream: driver::StreamRef,
}

impl Fence {
    pub(super) fn from_direct(fence: pushbuf::Fence, q: &ComputeQueue) -> Fence {
        Fence(FenceInner::Direct {
            fence,
            printf: q.printf_fifo().cloned(),
        })
    }

    pub(super) fn from_driver(stream: &driver::Stream) -> Fence {
        Fence(FenceInner::Driver(Arc::new(StreamWatch {
            ctx: stream.context().clone(),
            stream: stream.handle(),
        })))
    }

    /// The backend whose queue made this fence.
    pub fn backend(&self) -> Backend {
        match self.0 {
            FenceInner::Direct { .. } => Backend::Direct,
            FenceInner::Driver(_) => Backend::Driver,
        }
    }

    /// The direct path's fence (a timeline semaphore value), when a direct-path queue made this one.
    pub fn direct(&self) -> Option<&pushbuf::Fence> {
        match &self.0 {
            FenceInner::Direct { fence, .. } => Some(fence),
            FenceInner::Driver(_) => None,
        }
    }

    /// The driver backend's stream.
    pub(super) fn driver_part(&self) -> Option<&StreamWatch> {
        match &self.0 {
            FenceInner::Driver(w) => Some(w),
            FenceInner::Direct { .. } => None,
        }
    }

    /// Waits until the work before the fence is complete (at most `timeout`), then prints kernel `printf` output.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        match &self.0 {
            FenceInner::Direct { fence, printf } => {
                Ok(launch::settle(printf.as_ref(), fence.wait(timeout))?)
            }
            FenceInner::Driver(w) => w.wait(timeout),
        }
    }

    /// Whether the work before the fence is complete (no waiting, no printing).
    pub fn is_done(&self) -> bool {
        match &self.0 {
            FenceInner::Direct { fence, .. } => fence.is_done(),
            FenceInner::Driver(w) => w.is_idle(),
        }
    }
}

impl StreamWatch {
    /// The stream's context.
    pub(super) fn context(&self) -> &Arc<driver::Context> {
        &self.ctx
    }

    /// The stream.
    pub(super) fn stream(&self) -> driver::StreamRef {
        self.stream
    }

    fn is_idle(&self) -> bool {
        self.stream.is_idle(&self.ctx).unwrap_or(false)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            if self.stream.is_idle(&self.ctx)? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::Driver(driver::Error::Call {
                    call: "fence wait",
                    code: 0,
                    name: format!("timed out after {timeout:?}"),
                }));
            }
            std::thread::yield_now();
        }
    }
}
