//! What the simulator tests share: a simulated GPU with a compute queue and the test cubin, and a zeroed page of
//! CPU-cached memory the model releases into. Included with `#[path = "support/sim.rs"] mod sim;`.

#![allow(dead_code)]

use std::sync::Arc;

use std::time::Duration;

use apex::gpfifo::ChannelConfig;
use apex::launch::{ComputeQueue, ComputeQueueConfig};
use apex::module::Module;
use apex::pushbuf::{QueueConfig, Submission};
use apex::rm::sim::SimConfig;
use apex::rm::{GpuCore, Memory, MemoryDesc, Placement};
use apex::sim::Simulator;

/// The test kernels (kernels/apex_test_kernels.cu).
pub const CUBIN: &[u8] = include_bytes!("../../kernels/apex_test_kernels.sm_90.cubin");

/// A simulated GPU, a compute queue built with `config`, and the test cubin loaded.
pub fn setup_with(
    config: ComputeQueueConfig,
) -> (Arc<GpuCore>, Simulator, ComputeQueue, Arc<Module>) {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let q = ComputeQueue::new(&gpu, config).expect("compute queue");
    let module = Module::load(&gpu, CUBIN).expect("module");
    (gpu, sim, q, module)
}

/// A zeroed 4 KiB page of CPU-cached memory below 1 TiB, mapped for the CPU.
pub fn host_page(gpu: &Arc<GpuCore>) -> Memory {
    let m = Memory::alloc(
        gpu,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .unwrap();
    m.fill(0, 0x1000, 0).unwrap();
    m
}

/// A bare pushbuffer queue's configuration (no engine objects bound): `entries` GPFIFO entries, a 64 KiB
/// pushbuffer, waits of up to `timeout`, work sent as `submission` says.
pub fn bare_queue_config(entries: u32, timeout: Duration, submission: Submission) -> QueueConfig {
    QueueConfig::default()
        .with_channel(
            ChannelConfig::default()
                .with_entries(entries)
                .with_compute(false)
                .with_copy(false),
        )
        .with_push_bytes(64 << 10)
        .with_timeout(timeout)
        .with_submission(submission)
}
