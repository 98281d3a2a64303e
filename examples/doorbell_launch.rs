//! APEX's showcase: open the GPU through RM, build our own channel, and launch a real kernel by doorbell.
//!
//! Prints the GPU and the classes chosen, verifies 10^4 semaphore round trips, runs saxpy over 2^20 elements
//! and checks every element against the CPU, prints the launch-to-completion latency distribution of an empty
//! kernel, and runs 10^4 dependent launches one doorbell each and as one GPU-scheduled chain (result checked).

mod support;

use std::time::{Duration, Instant};

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::pushbuf::Signal;
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let n = v.len();
    format!(
        "min {:.2?}  median {:.2?}  p99 {:.2?}  max {:.2?}",
        v[0],
        v[n / 2],
        v[n * 99 / 100],
        v[n - 1]
    )
}

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let gpu = GpuCore::open(0)?;
    let opened = t.elapsed();
    let i = gpu.info();
    println!(
        "GPU {}: {} ({}), PCI {}",
        i.index, i.name, i.uuid, i.pci_bus_id
    );
    println!(
        "  sm_{}, {} SMs ({} GPCs, {} TPCs, {} SMs/TPC, {} warps/SM), {} GiB, driver {}",
        i.sm_version,
        i.sm_count,
        i.gpc_count,
        i.tpc_count,
        i.sms_per_tpc,
        i.max_warps_per_sm,
        i.memory_bytes >> 30,
        i.driver_version
    );
    let t = Instant::now();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
    let c = q.queue().channel().classes();
    println!(
        "  channel {:#06x}, compute {:#06x}, copy {:#06x}, token {:#x} (RM open {:.1?}, queue {:.1?})",
        c.gpfifo,
        c.compute.unwrap_or(0),
        c.copy.unwrap_or(0),
        q.queue().channel().token(),
        opened,
        t.elapsed()
    );

    // 1. Semaphore round trips through the doorbell, every payload verified.
    let n = 10_000;
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let f = q.queue_mut().submit(0, Signal::Host, |_, _| {})?;
        f.wait(Duration::from_secs(5))?;
        lat.push(t.elapsed());
        assert_eq!(
            q.queue().timeline().completed(),
            f.value(),
            "semaphore payload"
        );
    }
    println!("semaphore round trips: {n} verified; {}", percentiles(lat));

    // 2. saxpy over 2^20 elements, checked against the CPU.
    let module = Module::load(&gpu, CUBIN)?;
    let saxpy = module.kernel("saxpy")?;
    let n = 1usize << 20;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 777) as f32 - 300.0).collect();
    let dx = Memory::alloc(&gpu, MemoryDesc::video(n as u64 * 4).with_cpu())?;
    let dy = Memory::alloc(&gpu, MemoryDesc::video(n as u64 * 4).with_cpu())?;
    dx.write(
        0,
        &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )?;
    dy.write(
        0,
        &y.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )?;
    let a = 2.5f32;
    let t = Instant::now();
    // SAFETY: x and y are live buffers of n floats; the kernel touches nothing else.
    let f = unsafe {
        q.launch(
            &saxpy,
            &LaunchConfig::linear((n / 256) as u32, 256),
            &[
                Arg::F32(a),
                Arg::Ptr(dx.va()),
                Arg::Ptr(dy.va()),
                Arg::U32(n as u32),
            ],
        )?
    };
    f.wait(Duration::from_secs(5))?;
    let took = t.elapsed();
    let mut out = vec![0u8; n * 4];
    dy.read(0, &mut out)?;
    let bad = out
        .chunks_exact(4)
        .enumerate()
        .filter(|(i, c)| f32::from_le_bytes((*c).try_into().unwrap()) != a * x[*i] + y[*i])
        .count();
    println!(
        "saxpy over {n} elements: {} ({took:.1?} launch to completion)",
        if bad == 0 {
            "all verified".to_string()
        } else {
            format!("{bad} WRONG")
        }
    );
    if bad != 0 {
        return Err("saxpy results differ from the CPU".into());
    }

    // 3. Launch-to-completion latency of an empty kernel, one launch at a time.
    let empty = module.kernel("empty")?;
    let cfg = LaunchConfig::linear(1, 1);
    for _ in 0..1000 {
        // SAFETY: the empty kernel touches no memory.
        unsafe { q.launch(&empty, &cfg, &[])? }.wait(Duration::from_secs(5))?;
    }
    let (mut lat, mut submit) = (Vec::with_capacity(10_000), Vec::with_capacity(10_000));
    for _ in 0..10_000 {
        let t = Instant::now();
        // SAFETY: as above.
        let f = unsafe { q.launch(&empty, &cfg, &[])? };
        submit.push(t.elapsed());
        f.wait(Duration::from_secs(5))?;
        lat.push(t.elapsed());
    }
    println!(
        "empty kernel, launch -> completion seen by the CPU: {}",
        percentiles(lat)
    );
    println!(
        "empty kernel, CPU cost of the launch call:       {}",
        percentiles(submit)
    );

    // 4. Back-to-back dependent launches, one doorbell each.
    let t = Instant::now();
    let n = 10_000;
    let mut last = None;
    for _ in 0..n {
        // SAFETY: as above.
        last = Some(unsafe { q.launch(&empty, &cfg, &[])? });
    }
    last.expect("launched").wait(Duration::from_secs(10))?;
    println!(
        "{n} back-to-back launches: {:.2?} per launch",
        t.elapsed() / n
    );

    // 5. The same number of dependent launches as a chain the GPU schedules itself, each one updating a value the
    //    next one reads; the result is checked.
    let step = module.kernel("chain_step")?;
    let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu())?;
    v.write(0, &7u64.to_le_bytes())?;
    let mut expect = 7u64;
    let t = Instant::now();
    for i in 0..u64::from(n) {
        let (mul, add) = (i.wrapping_mul(0x9e37_79b9) | 1, i);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: chain_step reads and writes the 8 bytes of `v`.
        unsafe {
            q.record_launch_chained(
                &step,
                &cfg,
                &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)],
            )?
        };
    }
    q.end_chain()?.wait(Duration::from_secs(10))?;
    let per = t.elapsed() / n;
    let mut b = [0u8; 8];
    v.read(0, &mut b)?;
    if u64::from_le_bytes(b) != expect {
        return Err(format!(
            "chained launches: got {:#x}, expected {expect:#x}",
            u64::from_le_bytes(b)
        )
        .into());
    }
    println!("{n} chained dependent launches, result verified: {per:.2?} per launch");
    Ok(())
}
