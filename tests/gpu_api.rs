//! The launch correctness tests against both backends, from the same test bodies (run with
//! `--include-ignored` on an NVIDIA GPU with libcuda).

use std::time::{Duration, Instant};

use apex::{Arg, Backend, DevicePtr, Gpu, Launch, LaunchConfig};

#[path = "support/gpu.rs"]
mod support_gpu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const PTX: &[u8] = include_bytes!("../kernels/apex_test_kernels.ptx");
const T: Duration = Duration::from_secs(20);

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn vector_add(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(CUBIN).unwrap();
    let k = m.kernel("vector_add").unwrap();
    let n = 1usize << 20;
    let a: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 100.0).collect();
    let c: Vec<f32> = (0..n).map(|i| (i as f32).cos() * 7.0).collect();
    let (da, dc, dout) = (
        g.alloc(n as u64 * 4).unwrap(),
        g.alloc(n as u64 * 4).unwrap(),
        g.alloc(n as u64 * 4).unwrap(),
    );
    q.upload(&g, &da, 0, &f32s(&a)).unwrap();
    q.upload(&g, &dc, 0, &f32s(&c)).unwrap();
    q.upload(&g, &dout, 0, &vec![0xffu8; n * 4]).unwrap();
    // SAFETY: three live buffers of n floats.
    let f = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear((n / 256) as u32, 256),
            &[da.arg(), dc.arg(), dout.arg(), Arg::U32(n as u32)],
        )
    }
    .unwrap();
    f.wait(T).unwrap();
    let mut out = vec![0u8; n * 4];
    q.download(&g, &dout, 0, &mut out).unwrap();
    for (i, w) in out.chunks_exact(4).enumerate() {
        assert_eq!(
            f32::from_le_bytes(w.try_into().unwrap()),
            a[i] + c[i],
            "{b:?} element {i}"
        );
    }
}

fn chain(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("chain_step").unwrap();
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &5u64.to_le_bytes()).unwrap();
    let mut expect = 5u64;
    for i in 0..10_000u64 {
        let (mul, add) = (i * 2 + 3, i ^ 0x5555);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: an 8-byte buffer, all the kernel touches.
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(1, 1),
                &[v.arg(), Arg::U64(mul), Arg::U64(add)],
            )
        }
        .unwrap();
    }
    q.synchronize().unwrap();
    let mut out = [0u8; 8];
    q.download(&g, &v, 0, &mut out).unwrap();
    assert_eq!(u64::from_le_bytes(out), expect, "{b:?}");
}

/// The same chain as `chain`, as chained launches: ended by `end_chain`, by a launch, and by a copy.
fn chained(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("chain_step").unwrap();
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &5u64.to_le_bytes()).unwrap();
    assert!(q.end_chain().is_err(), "{b:?}: nothing chained yet");
    let mut expect = 5u64;
    let cfg = LaunchConfig::linear(1, 1);
    for i in 0..10_000u64 {
        let (mul, add) = (i * 2 + 3, i ^ 0x5555);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        let args = [v.arg(), Arg::U64(mul), Arg::U64(add)];
        // SAFETY: an 8-byte buffer, all the kernel touches.
        match i % 1000 {
            999 => unsafe { q.launch(&k, &cfg, &args) }.map(drop).unwrap(),
            500 => {
                unsafe { q.submit(&Launch::new(&k, &cfg, &args).chained()) }.unwrap();
                q.end_chain().unwrap();
            }
            _ => unsafe { q.submit(&Launch::new(&k, &cfg, &args).chained()) }
                .map(drop)
                .unwrap(),
        }
    }
    // A download is a copy: it ends nothing left open here, and it sees the last launch's result.
    let mut out = [0u8; 8];
    q.download(&g, &v, 0, &mut out).unwrap();
    assert_eq!(u64::from_le_bytes(out), expect, "{b:?}");
    assert!(
        q.end_chain().is_err(),
        "{b:?}: the chain ended with the last launch"
    );
}

/// Deferred launches (`Launch::deferred`): on the direct path the GPU hears of none before a doorbell (a second
/// queue reads the value unchanged), then one flush sends them all in order; later, plain launches among deferred
/// ones send those before them. Prepared and not.
fn deferred(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let mut other = g.queue().unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("chain_step").unwrap();
    let cfg = LaunchConfig::linear(1, 1);
    let prepared = q.prepare(&k, &cfg).unwrap();
    let v = g.alloc(8).unwrap();
    q.upload(&g, &v, 0, &5u64.to_le_bytes()).unwrap();
    q.synchronize().unwrap();
    let read = |q: &mut apex::Queue| {
        let mut out = [0u8; 8];
        q.download(&g, &v, 0, &mut out).unwrap();
        u64::from_le_bytes(out)
    };
    let mut expect = 5u64;
    let step = |q: &mut apex::Queue, expect: &mut u64, i: u64, plain: bool| {
        let (mul, add) = (i * 2 + 3, i ^ 0x5555);
        *expect = expect.wrapping_mul(mul).wrapping_add(add);
        let args = [v.arg(), Arg::U64(mul), Arg::U64(add)];
        let launch = if i.is_multiple_of(2) {
            Launch::prepared(&prepared, &args)
        } else {
            Launch::new(&k, &cfg, &args)
        };
        let launch = if plain { launch } else { launch.deferred() };
        // SAFETY: an 8-byte buffer, all the kernel touches.
        unsafe { q.submit(&launch) }.unwrap()
    };
    for i in 0..100 {
        step(&mut q, &mut expect, i, false);
    }
    if b == Backend::Direct {
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            read(&mut other),
            5,
            "a deferred launch ran before any doorbell"
        );
    }
    q.flush().unwrap();
    q.synchronize().unwrap();
    assert_eq!(read(&mut other), expect, "{b:?}");
    let mut last = None;
    for i in 100..2000 {
        last = Some(step(&mut q, &mut expect, i, i % 100 == 99));
    }
    // The last launch is a plain one: its doorbell sent the deferred ones before it, and it completes after them.
    q.fence(last.unwrap()).unwrap().wait(T).unwrap();
    assert_eq!(read(&mut other), expect, "{b:?}");
}

fn transfers(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    // Odd sizes and offsets, pageable and pinned, device to device.
    for (size, off) in [
        (1u64, 0u64),
        (7, 3),
        (4093, 1),
        (1 << 20, 5),
        ((33 << 20) + 17, 11),
    ] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 + size) as u8).collect();
        let d1 = g.alloc(size + off + 64).unwrap();
        let d2 = g.alloc(size + 2 * off + 64).unwrap();
        q.upload(&g, &d1, off, &data).unwrap();
        q.copy_device_to_device(&d1, off, &d2, 2 * off, size)
            .unwrap();
        let host = g.alloc_host(size + off).unwrap();
        q.copy_device_to_host(&d2, 2 * off, &host, off, size)
            .unwrap()
            .wait(T)
            .unwrap();
        let mut back = vec![0u8; size as usize];
        host.read(off, &mut back).unwrap();
        assert!(
            back == data,
            "{b:?} {size} bytes at offset {off} via pinned memory"
        );
        let mut back2 = vec![0u8; size as usize];
        q.download(&g, &d2, 2 * off, &mut back2).unwrap();
        assert!(
            back2 == data,
            "{b:?} {size} bytes at offset {off} via pageable memory"
        );
        assert!(
            q.copy_device_to_device(&d1, size + off, &d2, 0, 65)
                .is_err(),
            "out of range is refused"
        );
    }
}

fn bad_input(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("saxpy").unwrap();
    let buf = g.alloc(64).unwrap();
    let args = [Arg::F32(1.0), buf.arg(), buf.arg(), Arg::U32(1)];
    for cfg in [
        LaunchConfig::new([0, 1, 1], [1, 1, 1]),
        LaunchConfig::new([1, 1, 1], [2048, 1, 1]),
        LaunchConfig::new([1, 1, 1], [1, 1, 1]).with_shared_bytes(1 << 20),
    ] {
        // SAFETY: refused before launch.
        assert!(
            unsafe { q.launch(&k, &cfg, &args) }.is_err(),
            "{b:?} {cfg:?}"
        );
    }
    // SAFETY: refused before launch.
    assert!(unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &args[..2]) }.is_err());
    // SAFETY: refused before launch.
    assert!(
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(1, 1),
                &[Arg::F64(1.0), buf.arg(), buf.arg(), Arg::U32(1)],
            )
        }
        .is_err()
    );
    assert!(
        g.load_module(CUBIN)
            .unwrap()
            .kernel("no_such_kernel")
            .is_err()
    );
    assert!(g.load_module(b"\x7fELF garbage").is_err());
    q.synchronize().unwrap();
}

/// Two queues of one GPU run kernels at the same time, as two CUDA streams of a context do: while a kernel on one
/// queue spins until the CPU stops it, launches on the other complete, each within the time of a launch.
fn queues_run_kernels_at_the_same_time(b: Backend) {
    let g = gpu(b);
    let m = g.load_module(CUBIN).unwrap();
    let (spin, empty) = (m.kernel("spin").unwrap(), m.kernel("empty").unwrap());
    let stop = g.alloc_host(4).unwrap();
    stop.write(0, &[0; 4]).unwrap();
    let (mut spinner, mut other) = (g.queue().unwrap(), g.queue().unwrap());
    // SAFETY: `spin` only reads `stop`, which lives until the kernel is stopped and waited for.
    let spinning = unsafe {
        spinner.launch(
            &spin,
            &LaunchConfig::linear(1, 1),
            &[Arg::Ptr(stop.device_ptr())],
        )
    }
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut took = Vec::new();
    let mut failed = None;
    for _ in 0..200 {
        let t = Instant::now();
        // SAFETY: `empty` touches no memory.
        let done = unsafe { other.launch(&empty, &LaunchConfig::linear(1, 1), &[]) }
            .and_then(|f| f.wait(Duration::from_secs(2)));
        match done {
            Ok(()) => took.push(t.elapsed()),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let still_spinning = !spinning.is_done();
    stop.write(0, &1u32.to_le_bytes()).unwrap();
    spinning.wait(T).unwrap();
    if let Some(e) = failed {
        panic!(
            "a launch on the second queue did not complete while the first queue's kernel spun: {e}"
        );
    }
    assert!(
        still_spinning,
        "the spinning kernel ended before it was stopped"
    );
    took.sort();
    let (median, max) = (took[took.len() / 2], took[took.len() - 1]);
    eprintln!("{b:?}: launch + wait beside a spinning kernel: median {median:?}, max {max:?}");
    assert!(
        median < Duration::from_micros(100),
        "launches on the second queue took {median:?} (median): the queues take turns instead of running together"
    );
}

/// Fills and copies as launches (`Launch::fill`, `Launch::copy`): grid size classes of the built-in kernels from one
/// block to the cap,
/// odd widths, offsets and sizes, plain and deferred, among kernel launches on the same queue, checked byte by byte;
/// the modifiers that mean nothing for them refused.
fn fills_and_copies_as_launches(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let k = g.load_module(CUBIN).unwrap().kernel("chain_step").unwrap();
    let size = (40u64 << 20) + 64;
    let a = g.alloc(size).unwrap();
    let c = g.alloc(size).unwrap();
    let v = g.alloc(8).unwrap();
    let mut expect = vec![0u8; size as usize];
    q.upload(&g, &a, 0, &expect).unwrap();
    q.upload(&g, &v, 0, &1u64.to_le_bytes()).unwrap();
    let mut step = 1u64;
    // (offset, elements, width, value): 1 byte to 40 MiB, grids from 1 block to the cap.
    let fills = [
        (0u64, 1u64, 1u32, 0x5au32),
        (3, 5, 1, 0x1234),
        (2, 4093, 2, 0xbeef),
        (8, 1 << 12, 4, 0xdead_beef),
        (4, (1 << 20) + 3, 4, 0x0102_0304),
        (1, (40 << 20) - 1, 1, 0x77),
        (16, 100_000, 2, 0xa5c3),
    ];
    for (i, &(off, count, width, value)) in fills.iter().enumerate() {
        let bytes = (count * u64::from(width)) as usize;
        let pattern: Vec<u8> = match width {
            1 => vec![value as u8],
            2 => (value as u16).to_le_bytes().to_vec(),
            _ => value.to_le_bytes().to_vec(),
        };
        for (j, byte) in expect[off as usize..off as usize + bytes]
            .iter_mut()
            .enumerate()
        {
            *byte = pattern[j % pattern.len()];
        }
        let fill = Launch::fill(DevicePtr(a.device_ptr() + off), value, width, count);
        let fill = if i % 2 == 1 { fill.deferred() } else { fill };
        // SAFETY: inside `a`, aligned to the width.
        unsafe { q.submit(&fill) }.unwrap();
        // A kernel in between, ordered after the fill.
        let (mul, add) = (i as u64 + 3, i as u64);
        step = step.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: an 8-byte buffer, all the kernel touches.
        unsafe {
            q.submit(&Launch::new(
                &k,
                &LaunchConfig::linear(1, 1),
                &[v.arg(), Arg::U64(mul), Arg::U64(add)],
            ))
        }
        .unwrap();
    }
    // Copies of odd sizes and offsets, each after the fills, one deferred.
    for (i, &(from, to, bytes)) in [
        (0u64, 5u64, 1u64),
        (7, 1, 4099),
        (64, 4096, 1 << 20),
        (3, 9, (40 << 20) - 9),
    ]
    .iter()
    .enumerate()
    {
        let copy = Launch::copy(
            DevicePtr(a.device_ptr() + from),
            DevicePtr(c.device_ptr() + to),
            bytes,
        );
        let copy = if i == 2 { copy.deferred() } else { copy };
        // SAFETY: inside `a` and `c`, which nothing else writes.
        unsafe { q.submit(&copy) }.unwrap();
        let mut back = vec![0u8; bytes as usize];
        q.flush().unwrap();
        q.synchronize().unwrap();
        q.download(&g, &c, to, &mut back).unwrap();
        assert!(
            back == expect[from as usize..(from + bytes) as usize],
            "{b:?}: copy of {bytes} bytes from {from} to {to}"
        );
    }
    let mut got = vec![0u8; size as usize];
    q.download(&g, &a, 0, &mut got).unwrap();
    let first_bad = got.iter().zip(&expect).position(|(x, y)| x != y);
    assert_eq!(first_bad, None, "{b:?}: filled bytes differ");
    let mut out = [0u8; 8];
    q.download(&g, &v, 0, &mut out).unwrap();
    assert_eq!(
        u64::from_le_bytes(out),
        step,
        "{b:?}: the kernels between the fills"
    );
    // Only plain stream order.
    let fill = Launch::fill(DevicePtr(a.device_ptr()), 0, 4, 1);
    for refused in [fill.programmatic(), fill.chained(), fill.cooperative()] {
        // SAFETY: refused before anything is submitted.
        let e = unsafe { q.submit(&refused) }.unwrap_err();
        assert!(matches!(e, apex::Error::InvalidArgument(_)), "{e}");
    }
    // A bad width, alignment or size is an error, not a launch, on both backends.
    // SAFETY: refused before anything is submitted.
    assert!(unsafe { q.submit(&Launch::fill(DevicePtr(a.device_ptr()), 0, 4, 0)) }.is_err());
    // SAFETY: as above.
    assert!(unsafe { q.submit(&Launch::copy(a.ptr(), c.ptr(), 0)) }.is_err());
    // SAFETY: refused before anything is submitted.
    assert!(unsafe { q.submit(&Launch::fill(DevicePtr(a.device_ptr()), 0, 3, 1)) }.is_err());
    if b == Backend::Direct {
        // SAFETY: as above.
        assert!(
            unsafe { q.submit(&Launch::fill(DevicePtr(a.device_ptr() + 1), 0, 4, 1)) }.is_err()
        );
    }
    q.synchronize().unwrap();
}

macro_rules! both {
    ($($name:ident),*) => {
        mod direct { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Direct) } )* }
        mod driver { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Driver) } )* }
    };
}
both!(
    vector_add,
    chain,
    chained,
    deferred,
    fills_and_copies_as_launches,
    transfers,
    bad_input,
    queues_run_kernels_at_the_same_time
);

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ptx_loads_on_the_driver_backend() {
    let g = gpu(Backend::Driver);
    let k = g.load_module(PTX).unwrap().kernel("saxpy").unwrap();
    assert!(k.info().is_none(), "PTX has no cubin attributes");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn apex_backend_forcing() {
    // SAFETY of env mutation: this test binary runs its tests on one thread (--test-threads=1 on the device).
    unsafe { std::env::set_var("APEX_BACKEND", "driver") };
    let g = Gpu::open(0).unwrap();
    assert_eq!(g.backend(), Backend::Driver);
    assert!(g.selection().to_string().contains("requested"));
    unsafe { std::env::set_var("APEX_BACKEND", "direct") };
    assert_eq!(Gpu::open(0).unwrap().backend(), Backend::Direct);
    unsafe { std::env::set_var("APEX_BACKEND", "auto") };
    assert_eq!(
        Gpu::open(0).unwrap().backend(),
        Backend::Direct,
        "auto picks the direct path on an H200"
    );
    unsafe { std::env::set_var("APEX_BACKEND", "bogus") };
    assert!(Gpu::open(0).is_err());
    unsafe { std::env::remove_var("APEX_BACKEND") };
}
