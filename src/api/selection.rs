//! Which backend runs a GPU's work: the request ([`BackendRequest`], `APEX_BACKEND`) and the choice ([`Selection`],
//! [`choose`]); the backend and the reason for a fallback are in `fallback`.

use std::fmt;

use super::{Backend, Error, FallbackReason, Result};
use crate::launch;

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
    use crate::rm;

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
