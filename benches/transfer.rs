//! Transfer bandwidth, APEX's direct path (the copy engine on our channel) beside the CUDA driver (cuMemcpyAsync)
//! in one process and one run: 256 MiB host→device and device→host from pinned host memory, and
//! device→device. Needs an NVIDIA GPU; prints a note and measures nothing otherwise.

use std::time::{Duration, Instant};

use apex::{BackendRequest, Buffer, Gpu, HostBuffer, Queue};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BYTES: u64 = 256 << 20;
const T: Duration = Duration::from_secs(30);

struct Side {
    name: &'static str,
    _gpu: Gpu,
    q: Queue,
    host: HostBuffer,
    a: Buffer,
    b: Buffer,
}

fn side(name: &'static str, req: BackendRequest) -> Option<Side> {
    let gpu = match Gpu::open_with(0, req) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("transfer benchmarks skipped ({name}): {e}");
            return None;
        }
    };
    let q = gpu.queue().ok()?;
    let host = gpu.alloc_host(BYTES).ok()?;
    let (a, b) = (gpu.alloc(BYTES).ok()?, gpu.alloc(BYTES).ok()?);
    Some(Side {
        name,
        _gpu: gpu,
        q,
        host,
        a,
        b,
    })
}

fn benches(c: &mut Criterion) {
    // The driver first: libcuda places its address ranges before APEX reserves its own.
    let Some(driver) = side("cuMemcpyAsync", BackendRequest::Driver) else {
        return;
    };
    let Some(direct) = side("apex_direct", BackendRequest::Direct) else {
        return;
    };
    let mut sides = [driver, direct];
    for s in &mut sides {
        s.host.write(0, &vec![0x5a; BYTES as usize]).expect("fill");
    }
    type Op = fn(&mut Side) -> apex::Result<apex::Fence>;
    let ops: [(&str, Op); 3] = [
        ("host_to_device_256MiB", |s| {
            s.q.copy_host_to_device(&s.host, 0, &s.a, 0, BYTES)
        }),
        ("device_to_host_256MiB", |s| {
            s.q.copy_device_to_host(&s.a, 0, &s.host, 0, BYTES)
        }),
        ("device_to_device_256MiB", |s| {
            s.q.copy_device_to_device(&s.a, 0, &s.b, 0, BYTES)
        }),
    ];
    for (group, op) in ops {
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Bytes(BYTES));
        for s in &mut sides {
            g.bench_function(s.name, |b| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        op(s).expect("copy").wait(T).expect("wait");
                    }
                    t.elapsed()
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = transfer;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(transfer);
