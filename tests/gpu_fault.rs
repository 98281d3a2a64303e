//! A kernel that faults must not hang the caller: the wait ends with an error.

use std::time::{Duration, Instant};

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig, Module};
use apex::rm::GpuCore;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn faulting_kernel_ends_the_wait_with_an_error() {
    let gpu = GpuCore::open(0).unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let m = Module::load(
        &gpu,
        include_bytes!("../kernels/apex_test_kernels.sm_90.cubin"),
    )
    .unwrap();
    let k = m.kernel("fault_store").unwrap();
    let t = Instant::now();
    // SAFETY: the kernel writes to an unmapped address on purpose; only our channel is affected.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[Arg::Ptr(0xdead_0000)]) }.unwrap();
    let e = f.wait(Duration::from_secs(5)).unwrap_err();
    eprintln!("fault reported after {:?}: {e}", t.elapsed());
}
