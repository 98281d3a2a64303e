//! The compute queue that proves the direct path when a GPU is opened is the GPU's first default queue: no second
//! channel is built for it (building one costs milliseconds on a GPU), a queue asked for with other options gets a
//! channel of its own, and the kept queue launches like any other.

use std::time::Duration;

use apex::rm::sim::SimConfig;
use apex::{Gpu, LaunchConfig, LaunchMemory, QueueOptions};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

#[test]
fn the_first_default_queue_is_the_one_that_proved_the_direct_path() {
    let (gpu, sim) = Gpu::open_simulated(SimConfig::default()).expect("simulated GPU");
    let opened = sim.channel_stats().len();
    assert!(opened >= 1, "opening builds the proving queue's channel");

    let mut first = gpu.queue().expect("first queue");
    assert_eq!(
        sim.channel_stats().len(),
        opened,
        "the first default queue is the proving one"
    );
    let second = gpu.queue().expect("second queue");
    assert_eq!(
        sim.channel_stats().len(),
        opened + 1,
        "later queues are built"
    );
    let host = gpu
        .queue_with(QueueOptions::default().launch_memory(LaunchMemory::Host))
        .expect("a host-memory queue");
    assert_eq!(
        sim.channel_stats().len(),
        opened + 2,
        "other launch memory: a queue of its own"
    );

    // The kept queue launches as any queue does.
    let empty = gpu.load_module(CUBIN).unwrap().kernel("empty").unwrap();
    let before = sim.launches().len();
    // SAFETY: the empty kernel touches no memory.
    unsafe { first.launch(&empty, &LaunchConfig::linear(1, 32), &[]) }
        .expect("launch")
        .wait(Duration::from_secs(30))
        .expect("completes");
    assert_eq!(sim.launches().len(), before + 1);
    drop((second, host));
}

#[test]
fn a_chained_first_queue_reuses_the_proving_queue_too() {
    let (gpu, sim) = Gpu::open_simulated(SimConfig::default()).expect("simulated GPU");
    let opened = sim.channel_stats().len();
    let _q = gpu
        .queue_with(QueueOptions::default().chained(true))
        .expect("a chained queue");
    assert_eq!(
        sim.channel_stats().len(),
        opened,
        "chaining is a setting of a built queue"
    );
}
