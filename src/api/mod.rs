//! The public API: one set of types over two backends. The direct path (our own channel, launches by
//! doorbell) is chosen when it can run; otherwise the CUDA driver API, with the reason available and logged.
//!
//! `APEX_BACKEND=direct|driver|auto` forces a choice (auto is the default).

mod backend;
mod cuda_attach;
mod error;
mod fallback;
mod fence;
mod gpu;
mod graph;
mod keep;
mod launch_spec;
mod memory;
mod module;
mod multi_gpu;
mod peer;
mod pool;
mod queue;
mod selection;
mod sim_gpu;

pub use crate::rm::PeerLink;
pub use cuda_attach::CudaRelease;
pub use error::{Error, PoolOutOfMemory, Result};
pub use fallback::{Backend, FallbackReason};
pub use fence::Fence;
pub use gpu::{DeviceInfo, Gpu, QueueOptions};
pub use graph::{Graph, GraphExec, GraphLaunch, GraphNode};
pub use launch_spec::{Launch, PreparedLaunch};
pub use memory::{Buffer, HostBuffer};
pub use module::{Global, Kernel, Module};
pub use multi_gpu::PeerAccess;
pub use pool::{MemoryPool, PoolBuffer, PoolOptions, PoolStats};
pub use queue::{Queue, Ticket};
pub use selection::{BackendRequest, Selection, choose};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_that_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Gpu>();
        send_sync::<Buffer>();
        send_sync::<HostBuffer>();
        send_sync::<Module>();
        send_sync::<Kernel>();
        send_sync::<Fence>();
        send_sync::<MemoryPool>();
        send_sync::<PoolBuffer>();
        send_sync::<Error>();
        send::<Queue>();
        send_sync::<crate::rm::GpuCore>();
        send_sync::<crate::rm::Memory>();
        send_sync::<crate::module::Module>();
        send_sync::<crate::module::Kernel>();
        send::<crate::launch::ComputeQueue>();
        send::<crate::gpfifo::Channel>();
    }
}
