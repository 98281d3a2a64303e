//! The types behind the public API's escape hatches: what `direct()` and `driver()` on [`Gpu`](crate::Gpu),
//! [`Queue`](crate::Queue), [`Buffer`](crate::Buffer), [`Module`](crate::Module), [`Kernel`](crate::Kernel),
//! [`Fence`](crate::Fence), [`PreparedLaunch`](crate::PreparedLaunch), [`GraphExec`](crate::GraphExec) and
//! [`MemoryPool`](crate::MemoryPool) return, what [`Graph`](crate::Graph) describes itself with, and the simulated
//! GPU of [`Gpu::open_simulated`](crate::Gpu::open_simulated).
//!
//! These come from APEX's internal layers. They are documented here because the API hands them out, but they are
//! the backends' own objects: reaching for them ties code to one backend, and they change with the layers.

/// The direct path's objects (our own RM client, channel and launch queue).
pub mod direct {
    #[doc(inline)]
    pub use crate::launch::{ComputeQueue, ComputeQueueConfig, GraphExec, PreparedLaunch};
    #[doc(inline)]
    pub use crate::module::cubin;
    #[doc(inline)]
    pub use crate::module::cubin::Cubin;
    #[doc(inline)]
    pub use crate::module::{Kernel, Module};
    #[doc(inline)]
    pub use crate::pushbuf::Fence;
    #[doc(inline)]
    pub use crate::rm::{GpuCore, Memory};
}

/// The CUDA driver backend's objects (wrappers of CUDA driver API handles).
pub mod driver {
    #[doc(inline)]
    pub use crate::driver::{Context, DeviceMemory, Function, HostMemory, MemPool, Module, Stream};
}

/// A launch graph's description, as [`Graph::description`](crate::Graph::description) and
/// [`Graph::dependencies`](crate::Graph::dependencies) return it.
#[doc(inline)]
pub use crate::launch::graph;

/// The simulated GPU of [`Gpu::open_simulated`](crate::Gpu::open_simulated): its configuration and what it
/// recorded.
pub mod sim {
    #[doc(inline)]
    pub use crate::rm::sim::SimConfig;
    #[doc(inline)]
    pub use crate::sim::{
        ChannelStats, DroppedQmd, Launch, QmdViolation, SimError, SimErrorKind, Simulator,
        XID_GRAPHICS, XID_MMU,
    };
}
