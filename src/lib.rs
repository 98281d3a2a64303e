//! APEX: launch work on NVIDIA GPUs by talking to the kernel driver directly.
//!
//! Layers, lowest first: [`rm`] (RM client over ioctls) → [`gpfifo`] (our own channel, ring and doorbell)
//! → [`pushbuf`] (method encoding and decoding) → [`launch`] (parameters, QMDs, kernel launches). Beside them,
//! [`module`] (cubins, fatbins, PTX, modules loaded into GPU memory) sits on [`rm`] alone and [`launch`] uses it.
//! [`hw`] holds the class tables generated from NVIDIA's headers and the GPU-generation table
//! ([`hw::generation`]: classes, QMD layout, limits and carveouts per SM version); it is data, not a layer.
//! The public API ([`Gpu`], [`Queue`], [`Module`], [`Buffer`], [`Fence`]) sits on top and runs on the direct
//! path when it can, else on the CUDA driver ([`driver`]); [`sim`] is a software GPU front end for tests.
//! `docs/architecture.md` in the repository follows a launch from [`Queue::launch`] to the doorbell.
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
pub mod bench;
pub mod driver;
pub mod gpfifo;
pub mod hw;
pub mod launch;
pub mod module;
pub mod pushbuf;
mod report;
pub mod rm;
pub mod sim;

pub use api::{
    Backend, BackendRequest, Buffer, DeviceInfo, Error, FallbackReason, Fence, Global, Gpu,
    HostBuffer, Kernel, Launch, MemoryPool, Module, PeerAccess, PeerLink, PoolBuffer, PoolOptions,
    PoolOutOfMemory, PoolStats, PreparedLaunch, Queue, QueueOptions, Result, Selection, Ticket,
    choose,
};
pub use api::{Graph, GraphExec, GraphLaunch, GraphNode};
pub use launch::{Arg, ClusterPolicy, DevicePtr, LaunchConfig, LaunchMemory};
pub use module::VariableHome;
pub use module::printf::{AssertAction, AssertFailure};
pub use report::error_report;
