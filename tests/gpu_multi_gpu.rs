//! Several GPUs on hardware, both backends, from the same test bodies (run with `--include-ignored` on a machine
//! with two NVIDIA GPUs and libcuda; a machine with one GPU reports them as ignored or skips them with a note).
//!
//! A kernel on one GPU reads and writes the other's memory over the peer link; copies between GPUs of 256 MiB
//! in both directions and both at once, every byte checked (the direct path on the source GPU's copy engines,
//! the driver backend with cuMemcpyPeerAsync), and refused on the direct path between GPUs not opened as peers;
//! a pipeline of kernels alternating between the GPUs, each waiting on the GPU for the other's fence and
//! reading what the other wrote, checked for every element; and objects of one GPU refused by the other.

use std::time::Duration;

use apex::launch::CopyEngines;
use apex::{Arg, Backend, BackendRequest, Buffer, Gpu, LaunchConfig};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(30);

fn request(b: Backend) -> BackendRequest {
    match b {
        Backend::Direct => BackendRequest::Direct,
        Backend::Driver => BackendRequest::Driver,
    }
}

/// GPUs 0 and 1 on backend `b`, or `None` (with a note) where the machine has one.
fn two(b: Backend) -> Option<(Gpu, Gpu)> {
    let n = Gpu::count().expect("count GPUs");
    if n < 2 {
        eprintln!("only {n} GPU(s): the two-GPU test does not apply here");
        return None;
    }
    let mut g = Gpu::open_peers(&[0, 1], request(b)).expect("open GPUs 0 and 1 as peers");
    let g1 = g.pop().expect("GPU 1");
    let g0 = g.pop().expect("GPU 0");
    assert_eq!((g0.backend(), g1.backend()), (b, b));
    Some((g0, g1))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn download(g: &Gpu, buf: &Buffer) -> Vec<u8> {
    let mut q = g.queue().expect("queue");
    let mut out = vec![0u8; buf.size() as usize];
    q.download(g, buf, 0, &mut out).expect("download");
    out
}

fn identity_and_uuid(b: Backend) {
    let Some((g0, g1)) = two(b) else { return };
    let (u0, u1) = (g0.uuid().expect("uuid 0"), g1.uuid().expect("uuid 1"));
    assert_ne!(u0, u1);
    assert!(u0.starts_with("GPU-") && u0.len() == 40, "{u0}");
    let again = Gpu::open_uuid(&u1).expect("open by UUID");
    assert_eq!(again.uuid().expect("uuid"), u1);
    let access = g1.peer_access(&g0).expect("the GPUs are peers");
    eprintln!("{b:?}: {u0} <-> {u1}: {:?}", access.link);
    assert!(Gpu::open_uuid("GPU-00000000-0000-0000-0000-000000000000").is_err());
}

fn kernel_on_one_gpu_uses_the_others_memory(b: Backend) {
    let Some((g0, g1)) = two(b) else { return };
    let n = 1usize << 20;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let (dx0, dy1, dy0) = (
        g0.alloc(n as u64 * 4).unwrap(),
        g1.alloc(n as u64 * 4).unwrap(),
        g0.alloc(n as u64 * 4).unwrap(),
    );
    let mut q0 = g0.queue().unwrap();
    q0.upload(&g0, &dx0, 0, &f32s(&x)).unwrap();
    q0.upload(&g0, &dy0, 0, &f32s(&y)).unwrap();
    let mut q1 = g1.queue().unwrap();
    q1.upload(&g1, &dy1, 0, &f32s(&y)).unwrap();
    assert!(!dx0.is_accessible_from(&g1) || b == Backend::Driver);
    g1.map_peer(&dx0).expect("map GPU 0's x on GPU 1");
    g1.map_peer(&dy0).expect("map GPU 0's y on GPU 1");
    assert!(dx0.is_accessible_from(&g1));
    let saxpy = g1.load_module(CUBIN).unwrap().kernel("saxpy").unwrap();
    let cfg = LaunchConfig::linear((n as u32).div_ceil(256), 256);
    // SAFETY: x is read and y written inside n elements; nothing else uses them until synchronize.
    unsafe {
        // GPU 1 reads GPU 0's x over the link into its own y ...
        q1.launch(
            &saxpy,
            &cfg,
            &[Arg::F32(2.0), dx0.arg(), dy1.arg(), Arg::U32(n as u32)],
        )
        .unwrap();
        // ... and writes GPU 0's y over the link.
        q1.launch(
            &saxpy,
            &cfg,
            &[Arg::F32(3.0), dx0.arg(), dy0.arg(), Arg::U32(n as u32)],
        )
        .unwrap();
    }
    q1.synchronize().unwrap();
    let want1: Vec<f32> = (0..n).map(|i| 2.0 * x[i] + y[i]).collect();
    let want0: Vec<f32> = (0..n).map(|i| 3.0 * x[i] + y[i]).collect();
    assert!(
        to_f32s(&download(&g1, &dy1)) == want1,
        "GPU 1's y (read over the link)"
    );
    assert!(
        to_f32s(&download(&g0, &dy0)) == want0,
        "GPU 0's y (written over the link)"
    );
}

fn copies_between_gpus(b: Backend) {
    let Some((g0, g1)) = two(b) else { return };
    let bytes: u64 = 256 << 20;
    let pattern = |seed: u32| -> Vec<u8> {
        (0..bytes / 4)
            .flat_map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed).to_le_bytes())
            .collect()
    };
    let (p0, p1) = (pattern(0x1234), pattern(0xabcd));
    let (a0, b0) = (g0.alloc(bytes).unwrap(), g0.alloc(bytes).unwrap());
    let (a1, b1) = (g1.alloc(bytes).unwrap(), g1.alloc(bytes).unwrap());
    let (mut q0, mut q1) = (g0.queue().unwrap(), g1.queue().unwrap());
    q0.upload(&g0, &a0, 0, &p0).unwrap();
    q1.upload(&g1, &a1, 0, &p1).unwrap();
    // One direction at a time on GPU 0's queue: 0 -> 1 pushed by GPU 0, then 1 -> 0 pushed by GPU 1's copy
    // engines (direct path) and ordered by GPU 0's queue.
    let t = std::time::Instant::now();
    q0.copy_device_to_device(&a0, 0, &b1, 0, bytes).unwrap();
    q0.synchronize().unwrap();
    eprintln!(
        "{b:?}: 256 MiB 0 -> 1 in {:?} (first copy: builds the copy channels)",
        t.elapsed()
    );
    assert!(download(&g1, &b1) == p0, "GPU 0 -> GPU 1");
    let t = std::time::Instant::now();
    q0.copy_device_to_device(&a1, 0, &b0, 0, bytes).unwrap();
    q0.synchronize().unwrap();
    eprintln!("{b:?}: 256 MiB 1 -> 0 in {:?}", t.elapsed());
    assert!(download(&g0, &b0) == p1, "GPU 1 -> GPU 0");
    // Both directions at once, each GPU pushing on its own queue: a1 becomes p0, b0 becomes p0 (from b1).
    let f0 = q0.copy_device_to_device(&a0, 0, &a1, 0, bytes).unwrap();
    let f1 = q1.copy_device_to_device(&b1, 0, &b0, 0, bytes).unwrap();
    f0.wait(T).unwrap();
    f1.wait(T).unwrap();
    assert!(download(&g1, &a1) == p0, "GPU 0 -> GPU 1 (both at once)");
    assert!(download(&g0, &b0) == p0, "GPU 1 -> GPU 0 (both at once)");
    // At offsets that are not page aligned, pushed by GPU 1's queue.
    q1.upload(&g1, &a1, 0, &p1).unwrap();
    let (off, len) = (4096 + 12, bytes - 8192);
    q1.copy_device_to_device(&a1, off, &a0, off, len).unwrap();
    q1.synchronize().unwrap();
    let r0 = download(&g0, &a0);
    let (o, l) = (off as usize, len as usize);
    assert!(r0[o..o + l] == p1[o..o + l], "GPU 1 -> GPU 0 (unaligned)");
    assert!(
        r0[..o] == p0[..o] && r0[o + l..] == p0[o + l..],
        "bytes outside the range untouched"
    );
    // Out of range is refused before anything is queued.
    assert!(q0.copy_device_to_device(&a0, 0, &a1, 8, bytes).is_err());
}

/// GPUs opened one by one (not with `open_peers`): the direct path refuses a copy between them with the reason
/// (each has an address space of its own); CUDA copies regardless.
fn copies_between_gpus_opened_alone(b: Backend) {
    if Gpu::count().expect("count GPUs") < 2 {
        eprintln!("only one GPU: the two-GPU test does not apply here");
        return;
    }
    let g0 = Gpu::open_with(0, request(b)).expect("GPU 0");
    let g1 = Gpu::open_with(1, request(b)).expect("GPU 1");
    let (x0, x1) = (g0.alloc(1 << 20).unwrap(), g1.alloc(1 << 20).unwrap());
    let mut q0 = g0.queue().unwrap();
    match b {
        Backend::Direct => {
            let e = q0
                .copy_device_to_device(&x0, 0, &x1, 0, 1 << 20)
                .expect_err("refused");
            assert!(matches!(e, apex::Error::NotPeers(_)), "{e}");
            assert!(e.to_string().contains("Gpu::open_peers"), "{e}");
        }
        Backend::Driver => {
            q0.upload(&g0, &x0, 0, &[0x5a; 1 << 20]).unwrap();
            q0.copy_device_to_device(&x0, 0, &x1, 0, 1 << 20).unwrap();
            q0.synchronize().unwrap();
            assert!(download(&g1, &x1).iter().all(|&v| v == 0x5a));
        }
    }
}

/// The pipeline of the issue: hop k runs on GPU k % 2, waits (on the GPU) for hop k - 1 on the other GPU, and
/// computes mine = other + step with `vector_add`, reading the other GPU's buffer over the link.
fn pipeline_alternating_between_gpus(b: Backend) {
    let Some((g0, g1)) = two(b) else { return };
    let gpus = [&g0, &g1];
    let n = 1usize << 16;
    let hops = 200usize;
    let step: [Vec<f32>; 2] = [
        (0..n).map(|i| (i % 5) as f32).collect(),
        (0..n).map(|i| (i % 3) as f32 + 1.0).collect(),
    ];
    let bufs: Vec<Buffer> = gpus
        .iter()
        .map(|g| g.alloc(n as u64 * 4).unwrap())
        .collect();
    let steps: Vec<Buffer> = gpus
        .iter()
        .map(|g| g.alloc(n as u64 * 4).unwrap())
        .collect();
    let mut queues: Vec<_> = gpus.iter().map(|g| g.queue().unwrap()).collect();
    for g in 0..2 {
        queues[g]
            .upload(gpus[g], &bufs[g], 0, &f32s(&vec![0.0; n]))
            .unwrap();
        queues[g]
            .upload(gpus[g], &steps[g], 0, &f32s(&step[g]))
            .unwrap();
        gpus[g].map_peer(&bufs[1 - g]).unwrap();
    }
    let kernels: Vec<_> = gpus
        .iter()
        .map(|g| g.load_module(CUBIN).unwrap().kernel("vector_add").unwrap())
        .collect();
    let cfg = LaunchConfig::linear((n as u32).div_ceil(256), 256);
    let mut last = None;
    for k in 0..hops {
        let g = k % 2;
        if let Some(f) = &last {
            queues[g].wait_for(f).unwrap();
        }
        // SAFETY: reads the other GPU's buffer (complete: waited for above) and writes this GPU's own.
        let f = unsafe {
            queues[g].launch(
                &kernels[g],
                &cfg,
                &[
                    bufs[1 - g].arg(),
                    steps[g].arg(),
                    bufs[g].arg(),
                    Arg::U32(n as u32),
                ],
            )
        }
        .unwrap();
        last = Some(f);
    }
    last.unwrap().wait(T).unwrap();
    // CPU reference: values stay small integers, exact in f32.
    let mut v = [vec![0f32; n], vec![0f32; n]];
    for k in 0..hops {
        let g = k % 2;
        v[g] = (0..n).map(|i| v[1 - g][i] + step[g][i]).collect();
    }
    for g in 0..2 {
        let got = to_f32s(&download(gpus[g], &bufs[g]));
        let bad = (0..n).find(|&i| got[i] != v[g][i]);
        assert!(
            bad.is_none(),
            "GPU {g} element {bad:?}: {} != {}",
            got[bad.unwrap()],
            v[g][bad.unwrap()]
        );
    }
}

fn objects_of_one_gpu_are_refused_by_the_other(b: Backend) {
    let Some((g0, g1)) = two(b) else { return };
    let k0 = g0.load_module(CUBIN).unwrap().kernel("empty").unwrap();
    let mut q1 = g1.queue().unwrap();
    // SAFETY: refused before anything reaches the GPU.
    let e = unsafe { q1.launch(&k0, &LaunchConfig::linear(1, 32), &[]) };
    assert!(
        e.is_err(),
        "a kernel of GPU 0 launched on GPU 1's queue must be refused"
    );
}

/// One GPU is enough: the copy engines a GPU takes for copies into its own memory (RM names no optimal CE for a
/// GPU with itself) are every LCE it can schedule a copy-only channel on, RM's refusals left out (on an H100:
/// LCEs 0 and 1 share the graphics runlist, 5 and up are absent); a 256 MiB copy split across them arrives
/// byte for byte.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_usable_copy_engine_of_a_gpu_copies() {
    let gpu = Gpu::open_with(0, BackendRequest::Direct).expect("GPU 0 on the direct path");
    let core = gpu.direct().expect("direct path").clone();
    let mut engines = CopyEngines::for_peer(&core, &core).expect("copy engines");
    let lces: Vec<u32> = engines.lces().collect();
    eprintln!("{}: copy-only channels on LCEs {lces:?}", gpu.info().name);
    assert!(!lces.is_empty());
    let bytes: u64 = 256 << 20;
    let p: Vec<u8> = (0..bytes / 4)
        .flat_map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ 0x77).to_le_bytes())
        .collect();
    let (a, b) = (gpu.alloc(bytes).unwrap(), gpu.alloc(bytes).unwrap());
    let mut q = gpu.queue().unwrap();
    q.upload(&gpu, &a, 0, &p).unwrap();
    let cq = q.direct().expect("direct queue");
    let reps = 4;
    let t = std::time::Instant::now();
    for _ in 0..reps {
        cq.copy_on(&mut engines, a.device_ptr(), b.device_ptr(), bytes)
            .expect("copy on the engines");
    }
    cq.synchronize().expect("copies complete");
    let gbps = (reps * bytes) as f64 / t.elapsed().as_secs_f64() / 1e9;
    eprintln!(
        "256 MiB device to device on {} engines: {gbps:.1} GB/s",
        lces.len()
    );
    assert!(download(&gpu, &b) == p, "every byte arrives");
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod direct {
            $(#[test] #[ignore = "needs two NVIDIA GPUs"] fn $name() { super::$name(apex::Backend::Direct) })*
        }
        mod driver {
            $(#[test] #[ignore = "needs two NVIDIA GPUs"] fn $name() { super::$name(apex::Backend::Driver) })*
        }
    };
}

both!(
    identity_and_uuid,
    kernel_on_one_gpu_uses_the_others_memory,
    copies_between_gpus,
    copies_between_gpus_opened_alone,
    pipeline_alternating_between_gpus,
    objects_of_one_gpu_are_refused_by_the_other,
);
