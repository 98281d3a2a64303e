//! Which backend runs a GPU's work, and why: the request, the fallback reason, the choice.

use std::fmt;

use super::{Error, Result};
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

/// What the caller (or `APEX_BACKEND`) asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendRequest {
    /// Use the direct path when it can run here, else the CUDA driver.
    Auto,
    /// Only the direct path: opening fails with the reason when it cannot run.
    Direct,
    /// Only the CUDA driver (libcuda), even where the direct path could run.
    Driver,
}

impl BackendRequest {
    /// Reads `APEX_BACKEND` (unset or empty = auto).
    pub fn from_env() -> Result<BackendRequest> {
        match std::env::var("APEX_BACKEND") {
            Err(_) => Ok(BackendRequest::Auto),
            Ok(v) => BackendRequest::parse(&v),
        }
    }

    /// Parses a request as `APEX_BACKEND` spells it (`direct`, `driver` or `cuda`, `auto` or empty), ignoring case.
    pub fn parse(v: &str) -> Result<BackendRequest> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendRequest::Auto),
            "direct" => Ok(BackendRequest::Direct),
            "driver" | "cuda" => Ok(BackendRequest::Driver),
            _ => Err(Error::BadBackendVar(v.to_string())),
        }
    }
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

/// The backend chosen for a GPU and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The backend that runs this GPU's work.
    pub backend: Backend,
    /// What was asked for (`APEX_BACKEND` or [`Gpu::open_with`](super::Gpu::open_with)).
    pub requested: BackendRequest,
    /// Set when the driver backend runs instead of the direct path.
    pub fallback: Option<FallbackReason>,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.backend, &self.fallback) {
            (Backend::Direct, _) => write!(f, "direct (own channel, doorbell launches)"),
            (Backend::Driver, Some(r)) => write!(f, "CUDA driver: {r}"),
            (Backend::Driver, None) => write!(f, "CUDA driver"),
        }
    }
}

/// Decides the backend from the request and what opening the direct path gave. Pure, so every case is tested.
pub fn choose<T>(
    request: BackendRequest,
    direct: impl FnOnce() -> std::result::Result<T, launch::Error>,
) -> (Option<T>, Selection) {
    match request {
        BackendRequest::Driver => (
            None,
            Selection {
                backend: Backend::Driver,
                requested: request,
                fallback: Some(FallbackReason::Requested),
            },
        ),
        BackendRequest::Direct | BackendRequest::Auto => match direct() {
            Ok(t) => (
                Some(t),
                Selection {
                    backend: Backend::Direct,
                    requested: request,
                    fallback: None,
                },
            ),
            Err(e) => (
                None,
                Selection {
                    backend: Backend::Driver,
                    requested: request,
                    fallback: Some(FallbackReason::from_direct_error(&e)),
                },
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rm_err(e: rm::Error) -> launch::Error {
        launch::Error::from(e)
    }

    #[test]
    fn apex_backend_variable() {
        assert_eq!(BackendRequest::parse("").unwrap(), BackendRequest::Auto);
        assert_eq!(
            BackendRequest::parse("Direct").unwrap(),
            BackendRequest::Direct
        );
        assert_eq!(
            BackendRequest::parse(" driver ").unwrap(),
            BackendRequest::Driver
        );
        assert!(matches!(
            BackendRequest::parse("fast"),
            Err(Error::BadBackendVar(_))
        ));
    }

    #[test]
    fn auto_prefers_the_direct_path() {
        let (t, s) = choose(BackendRequest::Auto, || Ok(7));
        assert_eq!((t, s.backend, s.fallback), (Some(7), Backend::Direct, None));
    }

    #[test]
    fn forcing_the_driver_skips_the_direct_path() {
        let (t, s) = choose::<()>(BackendRequest::Driver, || {
            panic!("must not open the direct path")
        });
        assert_eq!(
            (t, s.backend, s.fallback),
            (None, Backend::Driver, Some(FallbackReason::Requested))
        );
    }

    #[test]
    fn each_reason_is_classified() {
        let cases: Vec<(launch::Error, FallbackReason)> = vec![
            (
                rm_err(rm::Error::NoDeviceNode {
                    path: "/dev/nvidiactl".into(),
                }),
                FallbackReason::NoDeviceNodes("/dev/nvidiactl".into()),
            ),
            (
                rm_err(rm::Error::PermissionDenied {
                    path: "/dev/nvidia0".into(),
                }),
                FallbackReason::PermissionDenied("/dev/nvidia0".into()),
            ),
            (
                rm_err(rm::Error::DriverBranch {
                    found: "570.86.15".into(),
                    expected: 580,
                }),
                FallbackReason::DriverBranch {
                    found: "570.86.15".into(),
                    expected: 580,
                },
            ),
            (
                rm_err(rm::Error::UnsupportedClass {
                    what: "GPFIFO channel",
                    count: 2,
                    listed: "0x0080 0x2080".into(),
                }),
                FallbackReason::UnsupportedGpu(
                    rm::Error::UnsupportedClass {
                        what: "GPFIFO channel",
                        count: 2,
                        listed: "0x0080 0x2080".into(),
                    }
                    .to_string(),
                ),
            ),
            (
                launch::Error::Unsupported("sm_80".into()),
                FallbackReason::UnsupportedGpu("sm_80".into()),
            ),
        ];
        for (err, want) in cases {
            let (t, s) = choose::<()>(BackendRequest::Auto, || Err(err));
            assert!(t.is_none());
            assert_eq!(s.backend, Backend::Driver);
            assert_eq!(s.fallback, Some(want.clone()), "{want}");
            assert!(!s.to_string().is_empty());
        }
        let (_, s) = choose::<()>(BackendRequest::Auto, || {
            Err(rm_err(rm::Error::NoSuchGpu { index: 3, count: 1 }))
        });
        assert!(
            matches!(s.fallback, Some(FallbackReason::Failed(m)) if m.contains("out of range"))
        );
    }
}
