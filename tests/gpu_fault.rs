//! GPU faults (run with `--include-ignored` on an NVIDIA GPU): a kernel that writes to an unmapped address,
//! one that traps, one that never ends. The waiting call returns a typed error, the queue is rebuilt, and the
//! next launch in the same process gives a correct result.

use std::sync::Arc;
use std::time::{Duration, Instant};

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn check_recovery(gpu: &Arc<GpuCore>, m: &Arc<Module>) {
    let mut q =
        ComputeQueue::new(gpu, ComputeQueueConfig::default()).expect("a new queue after the fault");
    let k = m.kernel("chain_step").unwrap();
    let v = Memory::alloc(gpu, MemoryDesc::video(8).with_cpu()).unwrap();
    v.write(0, &10u64.to_le_bytes()).unwrap();
    // SAFETY: `v` is the 8 bytes the kernel touches.
    let f = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 1),
            &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(4)],
        )
    }
    .unwrap();
    f.wait(Duration::from_secs(5)).unwrap();
    let mut b = [0u8; 8];
    v.read(0, &mut b).unwrap();
    assert_eq!(
        u64::from_le_bytes(b),
        34,
        "the launch after recovery computes the right value"
    );
}

fn setup() -> (Arc<GpuCore>, Arc<Module>) {
    let gpu = GpuCore::open(0).unwrap();
    let m = Module::load(&gpu, CUBIN).unwrap();
    (gpu, m)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn unmapped_store_is_reported_and_recovered() {
    let (gpu, m) = setup();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let k = m.kernel("fault_store").unwrap();
    let t = Instant::now();
    // SAFETY: the kernel writes to an unmapped address on purpose; only our channel is affected.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[Arg::Ptr(0xdead_0000)]) }.unwrap();
    let e = f.wait(Duration::from_secs(5)).unwrap_err();
    let took = t.elapsed();
    eprintln!("unmapped store: reported after {took:?}: {e}");
    assert!(e.to_string().contains("error code 31"), "{e}");
    assert!(
        e.to_string().contains("faulting address 0xdead0000"),
        "the fault names the address: {e}"
    );
    match q.queue().channel().mmu_fault() {
        Ok(Some(f)) => {
            eprintln!(
                "MMU fault info: address {:#x}, type {} ({}), compute program {:#x}",
                f.address, f.fault_type, f.kind, f.shader_program_va[6]
            );
            assert_eq!(f.address & !0xfff, 0xdead_0000, "the faulting address");
        }
        Ok(None) => eprintln!("MMU fault info: RM recorded none for the channel"),
        Err(e) => eprintln!("MMU fault info: not available: {e}"),
    }
    drop(q);
    check_recovery(&gpu, &m);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn trap_is_reported_and_recovered() {
    let (gpu, m) = setup();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let k = m.kernel("trap").unwrap();
    let t = Instant::now();
    // SAFETY: the kernel only traps.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[]) }.unwrap();
    let e = f.wait(Duration::from_secs(5)).unwrap_err();
    eprintln!("trap: reported after {:?}: {e}", t.elapsed());
    assert!(
        matches!(
            e,
            apex::pushbuf::Error::Channel(apex::gpfifo::Error::Fault(_))
        ),
        "{e}"
    );
    drop(q);
    check_recovery(&gpu, &m);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fault_on_a_polled_queue_is_reported_and_recovered() {
    // The front end waits at a gate in host memory instead of for a doorbell: a faulting launch sent through a
    // slot is reported as on any queue, and freeing the channel with armed slots left leaves the GPU usable.
    let (gpu, m) = setup();
    let config = ComputeQueueConfig::default()
        .with_memory(apex::LaunchMemory::Host)
        .with_polling(true);
    let mut q = ComputeQueue::new(&gpu, config).unwrap();
    let k = m.kernel("fault_store").unwrap();
    let empty = m.kernel("empty").unwrap();
    // SAFETY: the empty kernel touches no memory.
    unsafe { q.launch(&empty, &LaunchConfig::linear(1, 1), &[]) }
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    // SAFETY: the kernel writes to an unmapped address on purpose; only our channel is affected.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[Arg::Ptr(0xdead_0000)]) }.unwrap();
    let e = f.wait(Duration::from_secs(5)).unwrap_err();
    eprintln!("unmapped store on a polled queue: {e}");
    // The MMU fault, with its code: the notifier's status can be set before its error code, and a reader in
    // between once reported "error code 0" here.
    assert!(e.to_string().contains("error code 31"), "{e}");
    drop(q);
    check_recovery(&gpu, &m);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn endless_kernel_times_out_and_the_channel_is_torn_down() {
    let (gpu, m) = setup();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let k = m.kernel("spin").unwrap();
    let stop = Memory::alloc(&gpu, MemoryDesc::video(4).with_cpu()).unwrap();
    stop.write(0, &[0; 4]).unwrap();
    // SAFETY: the kernel only reads `stop`.
    let f =
        unsafe { q.launch(&k, &LaunchConfig::linear(132, 128), &[Arg::Ptr(stop.va())]) }.unwrap();
    let t = Instant::now();
    let e = f.wait(Duration::from_millis(500)).unwrap_err();
    eprintln!("endless kernel: wait ended after {:?}: {e}", t.elapsed());
    assert!(
        matches!(
            e,
            apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })
        ),
        "{e}"
    );
    let t = Instant::now();
    drop(q); // frees the channel: RM preempts the grid and tears the channel down
    eprintln!("channel torn down in {:?}", t.elapsed());
    drop(stop);
    check_recovery(&gpu, &m);
}
