//! The CUDA driver API backend, on cudarc's raw `driver::sys` layer with libcuda loaded at run time.
//!
//! This is the fallback behind the same public API when the direct path cannot run, and the reference the
//! benchmarks measure against. Like `rm/` for the direct path, it is the one place where this backend's FFI
//! `unsafe` lives; everything it hands out is safe to use.
//!
//! Beside the driver's objects (contexts, memory, modules, functions, streams, graphs, pools) it holds this
//! backend's side of every public type, as `launch`, `module` and `rm` hold the direct path's: [`Queue`] (every
//! launch kind, copies, fills, waits, graph replays), [`Prepared`], [`StreamFence`], [`QueueGraph`],
//! [`LoadedModule`] and [`Kernel`]. They check launches with the launch layer's own checks and report failures as
//! [`BackendError`].
//!
//! This file holds the backend's errors; the driver's objects live by concern in `context` (devices, primary
//! contexts), `memory`, `module` (modules and functions), `stream` (streams, launches, captured graphs, stream
//! ordering), `attach` (an attached CUDA context and its sync words), `graph` (graphs built node by node) and `pool`.

use std::ffi::CStr;

use cudarc::driver::sys as cu;

mod attach;
mod context;
mod graph;
mod loaded;
mod memory;
mod module;
mod pool;
mod queue;
mod stream;
pub use attach::{CudaContext, SyncWords};
pub use context::{Context, device_count, device_uuids, is_available};
pub use graph::{GraphExec, GraphNode};
pub use loaded::{Kernel, LoadedModule};
pub use memory::{DeviceMemory, HostMemory};
pub use module::{Function, Module};
pub use pool::{MemPool, PoolAttribute, free_async_unordered};
pub use queue::{CudaOrder, LaunchMode, MAX_PARAM_BYTES, Prepared, Queue, QueueGraph, StreamFence};
pub use stream::{
    Graph, LaunchAttributes, LaunchKind, MAX_PARAMS, ParamPtrs, Stream, StreamRef, order_streams,
    order_streams_across,
};

/// A failed CUDA driver call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded.
    #[error(
        "libcuda.so.1 (the CUDA driver library) could not be loaded, so the CUDA driver backend cannot run; install \
         the NVIDIA driver's user-space libraries (e.g. `libnvidia-compute-580`) or add their directory to \
         LD_LIBRARY_PATH"
    )]
    NoLibrary,
    /// A CUDA driver call returned an error.
    #[error("{call} failed with {name} ({code}){}", call_hint(*code))]
    Call {
        /// The driver function.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Attaching needs a CUDA context current on the calling thread.
    #[error(
        "no CUDA context is current on this thread: create or make one current (cuCtxSetCurrent, or any CUDA \
         runtime call) before attaching APEX to it"
    )]
    NoCurrentContext,
    /// A sticky error: a kernel faulted, trapped or timed out, and the CUDA context is dead. Every later call on
    /// it fails the same way; the objects made from it must be dropped and the GPU opened again.
    #[error(
        "{call} failed: {name} ({code}); the CUDA context is unusable after this error (a kernel faulted, trapped \
         or ran too long): drop this Gpu and everything made from it (queues, buffers, modules, fences), then open \
         the GPU again (on the direct path, or in a new process if libcuda refuses this one a new context)"
    )]
    ContextLost {
        /// The call that reported it.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
    /// libcuda refuses this process any new context after a sticky error: measured on driver 580.159.04 after
    /// CUDA_ERROR_LAUNCH_FAILED, where `cuDevicePrimaryCtxReset` succeeds but the next retain and `cuCtxCreate`
    /// fail with the same error (the CUDA documentation: "the process must be terminated and relaunched").
    #[error(
        "{call} failed: {name} ({code}): libcuda refuses this process a new CUDA context after an earlier kernel \
         fault, even after resetting the device's primary context; the CUDA driver backend can be used again only \
         in a new process (the direct path, APEX_BACKEND=direct, does not depend on libcuda and still works)"
    )]
    ProcessLost {
        /// The call that reported it.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
}

/// What to do about the CUresults a user meets first on a machine that is not set up.
fn call_hint(code: u32) -> &'static str {
    match code {
        100 => "; no CUDA-capable GPU is visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
        101 => "; the GPU index is out of range: `nvidia-smi -L` lists the GPUs",
        2 => "; the GPU is out of memory: free memory or use a smaller allocation",
        35 | 803 | 804 => {
            "; the CUDA driver library does not match the loaded kernel module: reinstall the NVIDIA driver \
             (user-space and kernel parts of one version)"
        }
        999 => "; the CUDA driver failed to initialise: check `dmesg` and `nvidia-smi`",
        _ => "",
    }
}

impl Error {
    /// Whether the CUDA context is dead ([`Error::ContextLost`]): the GPU must be opened again.
    pub fn is_context_lost(&self) -> bool {
        matches!(self, Error::ContextLost { .. })
    }

    /// Whether libcuda refuses this process any new context ([`Error::ProcessLost`]).
    pub fn is_process_lost(&self) -> bool {
        matches!(self, Error::ProcessLost { .. })
    }
}

/// The driver backend's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of the driver backend's queues, modules and graphs: a driver call, a check of the launch layer's,
/// or an argument the caller passed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] Error),
    /// A launch, its arguments, a chain or a graph failed the launch layer's checks (the same checks as on the
    /// direct path).
    #[error(transparent)]
    Launch(#[from] crate::launch::Error),
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A graph instantiated on one queue was replayed on another.
    #[error("this graph was instantiated on another queue")]
    OtherQueue,
}

impl From<crate::module::Error> for BackendError {
    fn from(e: crate::module::Error) -> BackendError {
        BackendError::Launch(e.into())
    }
}

/// The driver backend's result type for queues, modules and graphs.
pub type BackendResult<T, E = BackendError> = std::result::Result<T, E>;

/// Errors after which the context is unusable (the CUDA documentation: "the process is left in an inconsistent
/// state and any further CUDA work will return the same error").
fn is_sticky(r: cu::CUresult) -> bool {
    use cu::CUresult as R;
    matches!(
        r,
        R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_LAUNCH_FAILED
    )
}

fn check(call: &'static str, r: cu::CUresult) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null for unknown codes).
    let name = unsafe {
        cu::cuGetErrorName(r, &mut p);
        if p.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if is_sticky(r) {
        tracing::warn!(call, error = %name, "CUDA context lost");
        return Err(Error::ContextLost {
            call,
            code: r as u32,
            name,
        });
    }
    Err(Error::Call {
        call,
        code: r as u32,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_are_the_ones_that_kill_the_context() {
        use cu::CUresult as R;
        for r in [
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_ILLEGAL_INSTRUCTION,
            R::CUDA_ERROR_ASSERT,
            R::CUDA_ERROR_LAUNCH_TIMEOUT,
        ] {
            assert!(is_sticky(r), "{r:?}");
        }
        for r in [
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_NOT_FOUND,
            R::CUDA_ERROR_NOT_READY,
        ] {
            assert!(!is_sticky(r), "{r:?}");
        }
        let e = Error::ContextLost {
            call: "cuStreamQuery",
            code: 719,
            name: "CUDA_ERROR_LAUNCH_FAILED".into(),
        };
        assert!(e.is_context_lost());
        assert!(e.to_string().contains("open the GPU again"), "{e}");
    }
}
