use std::io;

use super::NvStatus;

/// Errors of the RM layer. Each names the call that failed and, where RM answered, its `NV_STATUS`.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// A device node is missing: the kernel module (or nvidia-uvm) is not loaded, or there is no GPU.
    #[error("{}", no_node_message(path))]
    NoDeviceNode {
        /// The node that does not exist (`/dev/nvidiactl`, `/dev/nvidiaN` or `/dev/nvidia-uvm`).
        path: String,
    },
    /// A device node exists but this user may not open it read-write.
    #[error(
        "cannot open {path}: permission denied; give this user read/write access to the NVIDIA device nodes \
         (add it to the group that owns {path}, usually `video`, or check NVreg_DeviceFileMode) and run again"
    )]
    PermissionDenied {
        /// The node that was refused.
        path: String,
    },
    /// Opening a device node failed for another reason.
    #[error(
        "cannot open the NVIDIA device node {path}: {source}; check that the NVIDIA kernel module is loaded and \
         working (`dmesg`, `nvidia-smi`)"
    )]
    Open {
        /// The node.
        path: String,
        /// What the kernel answered.
        source: io::Error,
    },
    /// The ioctl system call itself failed (the driver did not get as far as an `NV_STATUS`).
    #[error(
        "the NVIDIA driver rejected the {call} ioctl ({what}): {source}; the loaded kernel module may not \
         match the 580 branch APEX was built for (see /proc/driver/nvidia/version)"
    )]
    Ioctl {
        /// The ioctl or RM escape.
        call: &'static str,
        /// The object or parameter block it was for.
        what: &'static str,
        /// The system call's error.
        source: io::Error,
    },
    /// RM (or UVM) answered a call with a failing `NV_STATUS`.
    #[error(
        "RM call {call} ({what}) failed with {status}; the GPU may be in use, out of memory or in a bad state \
         (see `nvidia-smi` and `dmesg`)"
    )]
    Rm {
        /// The RM or UVM call.
        call: &'static str,
        /// The object or parameter block it was for.
        what: &'static str,
        /// RM's answer.
        status: NvStatus,
    },
    /// The loaded driver is of another branch than the headers APEX's RM structures come from.
    #[error(
        "the loaded NVIDIA driver is {found}, but APEX's RM structures come from the headers of branch {expected}; \
         install a {expected}.x open kernel module for the direct path, or use the CUDA driver backend \
         (APEX_BACKEND=driver)"
    )]
    DriverBranch {
        /// The version in /proc/driver/nvidia/version.
        found: String,
        /// The branch APEX supports.
        expected: u32,
    },
    /// The GPU index asked for is not present.
    #[error(
        "GPU index {index} is out of range: {count} NVIDIA GPU(s) present; open an index below {count} \
         (`nvidia-smi -L` lists them)"
    )]
    NoSuchGpu {
        /// The index asked for.
        index: usize,
        /// How many GPUs RM reports.
        count: usize,
    },
    /// The GPU lists none of the classes of a kind that APEX knows how to drive.
    #[error(
        "this GPU lists no {what} class APEX knows among its {count} classes ({listed}); the direct path \
         does not support it: use the CUDA driver backend (APEX_BACKEND=driver)"
    )]
    UnsupportedClass {
        /// The kind of class (channel, compute, copy, usermode).
        what: &'static str,
        /// How many classes the GPU lists.
        count: usize,
        /// The classes it lists, in hex.
        listed: String,
    },
    /// Mapping GPU memory or registers into the process failed.
    #[error(
        "mapping {what} into this process failed: {source}; check the process's address-space and locked-memory \
         limits (`ulimit -v`, `ulimit -l`)"
    )]
    Mmap {
        /// What was being mapped.
        what: &'static str,
        /// The system call's error.
        source: io::Error,
    },
    /// No free range of GPU virtual addresses is left in APEX's address space.
    #[error(
        "GPU virtual address space exhausted: no free range of {size:#x} bytes (alignment {align:#x}); free \
         buffers or modules that are no longer needed"
    )]
    OutOfVa {
        /// The size asked for.
        size: u64,
        /// The alignment asked for.
        align: u64,
    },
    /// The shared CPU/GPU address window could not be reserved.
    #[error(
        "could not reserve a CPU/GPU address range below 1 TiB for the GPU's shared address space; another \
         mapping occupies it: open the GPU earlier in the process, before large mappings are made"
    )]
    NoVaReservation,
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Attaching to a CUDA context was not possible; the text says what was missing.
    #[error("cannot attach to the CUDA context: {0}")]
    Attach(String),
    /// A copy would leave the allocation.
    #[error(
        "offset {offset:#x} + length {len:#x} is outside the {size:#x}-byte allocation; keep copies inside the \
         buffer"
    )]
    OutOfBounds {
        /// Where the access starts.
        offset: u64,
        /// Its length.
        len: u64,
        /// The allocation's size.
        size: u64,
    },
    /// CPU access was asked of memory that has no CPU mapping.
    #[error(
        "memory of {size:#x} bytes has no CPU mapping; allocate it with a CPU mapping (MemoryDesc::with_cpu) to read or \
         write it from the CPU"
    )]
    NotCpuMapped {
        /// The allocation's size.
        size: u64,
    },
    /// Two GPUs have no peer path (no NVLink, no PCIe peer-to-peer).
    #[error(
        "{from} cannot reach the memory of {to}: {why}; copy through host memory instead (or check the GPUs' \
         topology with `nvidia-smi topo -m`)"
    )]
    NoPeerPath {
        /// The GPU that would access.
        from: String,
        /// The GPU whose memory it would access.
        to: String,
        /// Why, from RM's peer capability status.
        why: String,
    },
    /// Two GPUs do not share an address space, so neither can map the other's memory.
    #[error("{a} and {b} cannot map each other's memory: {why}")]
    NotPeers {
        /// One GPU.
        a: String,
        /// The other.
        b: String,
        /// Why they do not share an address space.
        why: &'static str,
    },
    /// The simulator was asked for something only real hardware has.
    #[error("{what} does not exist on a simulated GPU; this needs a real NVIDIA GPU")]
    Simulated {
        /// What was asked for.
        what: &'static str,
    },
}

/// The sentence for a missing device node: which module to load depends on the node.
fn no_node_message(path: &str) -> String {
    if path.ends_with("nvidia-uvm") {
        format!(
            "the NVIDIA UVM driver is not loaded: {path} does not exist; load it (`modprobe nvidia-uvm`, or run \
             `nvidia-modprobe -u -c 0`) and run again"
        )
    } else if path.ends_with("nvidiactl") {
        format!(
            "no NVIDIA kernel driver found: {path} does not exist; load the NVIDIA open kernel module (branch \
             580) or run on a machine with an NVIDIA GPU"
        )
    } else {
        format!(
            "the NVIDIA GPU node {path} does not exist although the driver is loaded; create it \
             (`nvidia-modprobe -c N`) or check that the GPU is visible in this container"
        )
    }
}

/// `Ok` for `NV_OK`; otherwise [`Error::Rm`] naming the call, what it was for and the status.
pub(crate) fn check(call: &'static str, what: &'static str, status: u32) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Rm {
            call,
            what,
            status: NvStatus(status),
        })
    }
}

/// The RM layer's result type.
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
