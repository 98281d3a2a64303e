use std::io;

use super::NvStatus;

/// Errors of the RM layer. Each names the call that failed and, where RM answered, its `NV_STATUS`.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    #[error(
        "{path} does not exist: is the NVIDIA kernel module loaded (and nvidia-uvm for /dev/nvidia-uvm)?"
    )]
    NoDeviceNode { path: String },
    #[error(
        "permission denied opening {path}: the user needs read/write access to the NVIDIA device nodes"
    )]
    PermissionDenied { path: String },
    #[error("cannot open {path}: {source}")]
    Open { path: String, source: io::Error },
    #[error("ioctl {call} ({what}) failed: {source}")]
    Ioctl {
        call: &'static str,
        what: &'static str,
        source: io::Error,
    },
    #[error("{call} ({what}) failed: {status}")]
    Rm {
        call: &'static str,
        what: &'static str,
        status: NvStatus,
    },
    #[error(
        "the loaded NVIDIA driver is {found}, but APEX's RM structures come from the headers of branch {expected}; \
         the direct path needs a {expected}.x open kernel module"
    )]
    DriverBranch { found: String, expected: u32 },
    #[error("GPU index {index} is out of range: {count} NVIDIA GPU(s) present")]
    NoSuchGpu { index: usize, count: usize },
    #[error("no {what} class known to APEX among the {count} classes this GPU lists ({listed})")]
    UnsupportedClass {
        what: &'static str,
        count: usize,
        listed: String,
    },
    #[error("mmap of {what} failed: {source}")]
    Mmap {
        what: &'static str,
        source: io::Error,
    },
    #[error(
        "GPU virtual address space exhausted: no free range of {size:#x} bytes (alignment {align:#x})"
    )]
    OutOfVa { size: u64, align: u64 },
    #[error(
        "could not reserve a CPU/GPU address range below 1 TiB for the GPU's shared address space"
    )]
    NoVaReservation,
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Attaching to a CUDA context was not possible; the text says what was missing.
    #[error("cannot attach to the CUDA context: {0}")]
    Attach(String),
    #[error("offset {offset:#x} + length {len:#x} is outside the {size:#x}-byte allocation")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("memory of {size:#x} bytes has no CPU mapping")]
    NotCpuMapped { size: u64 },
    #[error("{what} does not exist on a simulated GPU")]
    Simulated { what: &'static str },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The NV_STATUS behind this error, if RM or UVM returned one.
    pub fn status(&self) -> Option<NvStatus> {
        match self {
            Error::Rm { status, .. } => Some(*status),
            _ => None,
        }
    }
}
