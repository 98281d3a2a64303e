//! Which backend runs a GPU's work ([`Backend`]) and why the direct path was not used ([`FallbackReason`]): what
//! a [`Selection`](super::Selection) records and what [`Error`](super::Error) reports.

use std::fmt;

use crate::launch;
use crate::pushbuf;
use crate::rm;

/// Which implementation runs the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// APEX's own channel: RM ioctls, pushbuffers, QMDs, doorbell.
    Direct,
    /// The CUDA driver API (libcuda).
    Driver,
}

/// Why the direct path was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// `APEX_BACKEND=driver` (or `Backend::Driver` asked for).
    Requested,
    /// /dev/nvidiactl, /dev/nvidiaN or /dev/nvidia-uvm does not exist (no NVIDIA open kernel module loaded?).
    NoDeviceNodes(String),
    /// The device nodes exist but this user may not open them.
    PermissionDenied(String),
    /// The loaded driver is not of the branch whose RM structures APEX was built with.
    DriverBranch {
        /// The loaded driver's version.
        found: String,
        /// The branch APEX supports.
        expected: u32,
    },
    /// The GPU lists no channel/compute/usermode class in APEX's tables, or the launch recipe is not verified on it.
    UnsupportedGpu(String),
    /// The direct path failed for another reason (the error is kept).
    Failed(String),
}

impl FallbackReason {
    /// Classifies a direct-path error.
    pub fn from_direct_error(e: &launch::Error) -> FallbackReason {
        use crate::gpfifo::Error as G;
        use launch::Error as L;
        use pushbuf::Error as P;
        let rm_err = match e {
            L::Queue(P::Channel(G::Rm(r))) => Some(r),
            _ => None,
        };
        match (e, rm_err) {
            (_, Some(rm::Error::NoDeviceNode { path })) => {
                FallbackReason::NoDeviceNodes(path.clone())
            }
            (_, Some(rm::Error::PermissionDenied { path })) => {
                FallbackReason::PermissionDenied(path.clone())
            }
            (_, Some(rm::Error::DriverBranch { found, expected })) => {
                FallbackReason::DriverBranch {
                    found: found.clone(),
                    expected: *expected,
                }
            }
            (_, Some(e @ rm::Error::UnsupportedClass { .. })) => {
                FallbackReason::UnsupportedGpu(e.to_string())
            }
            (L::Unsupported(why), _) => FallbackReason::UnsupportedGpu(why.clone()),
            _ => FallbackReason::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FallbackReason::Requested => write!(f, "the CUDA driver backend was requested"),
            // The RM layer's sentences say what to do; one wording for both.
            FallbackReason::NoDeviceNodes(p) => rm::Error::NoDeviceNode { path: p.clone() }.fmt(f),
            FallbackReason::PermissionDenied(p) => {
                rm::Error::PermissionDenied { path: p.clone() }.fmt(f)
            }
            FallbackReason::DriverBranch { found, expected } => {
                write!(
                    f,
                    "the loaded NVIDIA driver is {found}, not of branch {expected}, which APEX's RM structures \
                     come from; install a {expected}.x open kernel module to use the direct path"
                )
            }
            FallbackReason::UnsupportedGpu(why) => {
                write!(f, "GPU not supported by the direct path: {why}")
            }
            FallbackReason::Failed(why) => write!(f, "the direct path failed: {why}"),
        }
    }
}
