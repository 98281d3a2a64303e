//! apex-preload: an `LD_PRELOAD` library that makes an unmodified CUDA program's kernel launches go through APEX.
//!
//! Preloaded into a program (the CUDA runtime, the driver API, PyTorch), it records every module and library the
//! program loads (`cuModuleLoad*`, `cuLibraryLoad*`) and the functions and kernels it takes from them, attaches APEX
//! to the program's CUDA context at the first launch ([`apex::Gpu::attach_cuda`]), and sends each `cuLaunchKernel`
//! (and `cuLaunchKernelEx` whose attributes it can honour) on a stream it has taken over through an APEX queue of
//! its own in that context. Everything else — and every launch it refuses, with a typed [`Refusal`] — goes to
//! libcuda, after a sync point: the CUDA stream waits on the GPU for the queue's work first, and the queue waits for
//! the stream's work before its next launch ([`order`]), so the program sees the order it asked for.
//!
//! ```sh
//! APEX_PRELOAD_STATS=stats.json LD_PRELOAD=target/release/libapex_preload.so ./program
//! ```
//!
//! Environment: `APEX_PRELOAD=off` forwards everything (and still counts); `APEX_PRELOAD_STATS=FILE` writes a JSON
//! summary at exit (launches through APEX, fallbacks per reason, ordering hops); `APEX_PRELOAD_QUEUES=N` (default 8)
//! bounds the streams taken over; `APEX_PRELOAD_LOG=LEVEL` (`info`, `debug`, ...) sends the library's `tracing`
//! events to stderr. How it works and what it refuses: docs/attach-cuda.md, step 5.

pub mod attrs;
pub mod check;
mod engine;
mod exit_safe;
mod hooks;
pub mod image;
pub mod order;
pub mod refusal;
pub mod registry;
pub mod stats;
mod watchdog;

pub use refusal::Refusal;
