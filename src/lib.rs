//! APEX: launch work on NVIDIA GPUs by talking to the kernel driver directly.
//!
//! The API: [`Gpu`] (open a device, allocate, load modules), [`Queue`] (launches, copies, waits), [`Launch`] and
//! [`LaunchConfig`], [`Buffer`] and [`HostBuffer`], [`Fence`] and [`Ticket`], [`Module`], [`Kernel`] and
//! [`Global`], [`QueueOptions`], [`Graph`] and [`GraphExec`], [`MemoryPool`], [`ModuleCache`] (decompressed
//! module code kept on disk between processes), and [`Error`] with what it wraps in [`errors`]. It runs on the
//! direct path (our own RM client, channel, pushbuffers and QMDs, launching by doorbell) when it can, else on the
//! CUDA driver; [`Gpu::selection`] says which and why. [`occupancy`] is the launch advisor; [`backend`] documents
//! what the escape hatches (`direct()`, `driver()`) return and the simulated GPU of [`Gpu::open_simulated`].
//!
//! The layers under the API (`rm`, `gpfifo`, `pushbuf`, `launch`, `module`, `hw`, `driver`, `sim`, `bench`) are
//! internal: they are `pub` only because the workspace's own tools (apex-trace, the CLI, preload, interpose), its
//! fuzzers, tests, examples and benches use them, are `#[doc(hidden)]`, and carry no stability promise. The types
//! of theirs that the API hands out are re-exported, documented, at the crate root, in [`errors`] and in
//! [`backend`]. `docs/architecture.md` and `docs/development.md` ("Layers") in the repository describe the layers
//! and follow a launch from [`Queue::launch`] to the doorbell.
//!
//! ```no_run
//! use apex::{Arg, Gpu, LaunchConfig};
//! use std::time::Duration;
//!
//! # fn main() -> apex::Result<()> {
//! let gpu = Gpu::open(0)?; // the direct path if it can run here, else the CUDA driver
//! println!("{}", gpu.selection()); // which backend, and why
//! let module = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
//! let add = module.kernel("vector_add")?;
//! let n: u32 = 1 << 20;
//! let (a, b, c) = (gpu.alloc(u64::from(n) * 4)?, gpu.alloc(u64::from(n) * 4)?, gpu.alloc(u64::from(n) * 4)?);
//! let mut q = gpu.queue()?;
//! let ones: Vec<u8> = std::iter::repeat(1.0f32.to_le_bytes()).take(n as usize).flatten().collect();
//! q.upload(&gpu, &a, 0, &ones)?;
//! q.upload(&gpu, &b, 0, &ones)?;
//! // SAFETY: vector_add(a, b, c, n) writes c[0..n], which the buffers hold.
//! let done = unsafe {
//!     q.launch(&add, &LaunchConfig::linear(n / 256, 256), &[a.arg(), b.arg(), c.arg(), Arg::U32(n)])?
//! };
//! done.wait(Duration::from_secs(1))?;
//! let mut out = vec![0u8; n as usize * 4];
//! q.download(&gpu, &c, 0, &mut out)?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod api;
pub mod backend;
pub mod errors;
mod report;

// The layers under the API. They stay `pub` because the workspace's own tools (apex-trace, the CLI, preload,
// interpose), fuzzers, tests, examples and benches use them; hidden from the docs and not covered by semver.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod driver;
#[doc(hidden)]
pub mod gpfifo;
#[doc(hidden)]
pub mod hw;
#[doc(hidden)]
pub mod launch;
#[doc(hidden)]
pub mod module;
#[doc(hidden)]
pub mod pushbuf;
#[doc(hidden)]
pub mod rm;
#[doc(hidden)]
pub mod sim;

pub use api::{
    Backend, BackendRequest, Buffer, CudaRelease, DeviceInfo, Error, FallbackReason, Fence, Global,
    Gpu, HostBuffer, Kernel, Launch, MemoryPool, Module, PeerAccess, PeerLink, PoolBuffer,
    PoolOptions, PoolOutOfMemory, PoolStats, PreparedLaunch, Queue, QueueOptions, Result,
    Selection, Ticket, choose,
};
pub use api::{Graph, GraphExec, GraphLaunch, GraphNode};
/// The launch advisor: occupancy of a kernel and block size, what limits it, and advice on launch shapes.
#[doc(inline)]
pub use launch::occupancy;
pub use launch::{Arg, ClusterPolicy, DevicePtr, LaunchConfig, LaunchMemory, Limits};
pub use module::VariableHome;
pub use module::cache::{ModuleCache, ModuleCacheStats, module_cache, set_module_cache};
pub use module::cubin::KernelInfo;
pub use module::printf::{AssertAction, AssertFailure};
pub use report::error_report;
