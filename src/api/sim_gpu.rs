//! A simulated GPU behind the public API: the entry point for tests and CI machines without a GPU.

use super::backend::Backed;
use super::gpu::SpareQueue;
use super::{Backend, BackendRequest, DeviceInfo, Gpu, Result, Selection};
use crate::launch::{ComputeQueue, ComputeQueueConfig, Limits};
use crate::module::printf::PrintfFifoCell;
use crate::rm::sim::SimConfig;
use crate::sim::Simulator;

impl Gpu {
    /// Opens a simulated Hopper GPU on the direct path: the real RM client, channel, pushbuffer, QMD and queue code
    /// run against an in-process RM (configured by [`SimConfig`](crate::backend::sim::SimConfig)) and GPU front end
    /// ([`Simulator`](crate::backend::sim::Simulator)), which executes semaphores and copies, follows QMD chains and
    /// records every launch, but runs no kernel. The way to test code written against the public API (queues,
    /// graphs, fences) in CI without a GPU: what the simulated GPU launched, with which parameters and in which
    /// order, is read back from the returned [`Simulator`](crate::backend::sim::Simulator). Kernel results are not
    /// computed; buffers hold what copies and the CPU put there.
    pub fn open_simulated(config: SimConfig) -> Result<(Gpu, Simulator)> {
        let (core, sim) = Simulator::open(config)?;
        let i = core.info();
        let info = DeviceInfo {
            name: i.name.clone(),
            sm_version: i.sm_version,
            sm_count: i.sm_count,
            memory_bytes: i.memory_bytes,
        };
        let limits = Limits::for_sm(info.sm_version);
        // As `Gpu::open` does: a compute queue proves the launch path and is kept for the first default queue.
        let proof = ComputeQueue::new(&core, ComputeQueueConfig::default())?;
        let gpu = Gpu {
            inner: Backed::Direct(core),
            selection: Selection {
                backend: Backend::Direct,
                requested: BackendRequest::Direct,
                fallback: None,
            },
            info,
            limits,
            printf: PrintfFifoCell::new(),
            cuda: None,
            spare: SpareQueue::new(Some(proof)),
        };
        Ok((gpu, sim))
    }
}
