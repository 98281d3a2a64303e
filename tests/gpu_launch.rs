//! GPU tests of kernel launches through our own channel (run with `--include-ignored` on an NVIDIA GPU).
//! Outputs are poisoned before each run, inputs are fresh random values, results are compared with the CPU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::{Kernel, Module};
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

struct Rng(u64);
impl Rng {
    fn new() -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 200.0 - 100.0
    }
}

struct Ctx {
    gpu: Arc<GpuCore>,
    q: ComputeQueue,
    module: Arc<Module>,
}

impl Ctx {
    fn new() -> Ctx {
        let gpu = GpuCore::open(0).expect("open GPU");
        let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).expect("compute queue");
        let module = Module::load(&gpu, CUBIN).expect("load module");
        Ctx { gpu, q, module }
    }
    fn kernel(&self, name: &str) -> Kernel {
        self.module.kernel(name).unwrap()
    }
    /// A device buffer filled with 0xff (poison).
    fn buffer(&self, bytes: u64) -> Memory {
        let m = Memory::alloc(&self.gpu, MemoryDesc::video(bytes).with_cpu()).unwrap();
        m.fill(0, bytes, 0xff).unwrap();
        m
    }
    fn run(&mut self, k: &Kernel, cfg: LaunchConfig, args: &[Arg<'_>]) {
        // SAFETY: every pointer argument is a live buffer of the size the kernel touches.
        let f = unsafe { self.q.launch(k, &cfg, args) }
            .unwrap_or_else(|e| panic!("launch {}: {e}", k.name()));
        f.wait(T).unwrap_or_else(|e| panic!("{}: {e}", k.name()));
    }
}

fn read_u32s(m: &Memory, n: usize) -> Vec<u32> {
    let mut b = vec![0u8; n * 4];
    m.read(0, &mut b).unwrap();
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn read_u64s(m: &Memory, n: usize) -> Vec<u64> {
    let mut b = vec![0u8; n * 8];
    m.read(0, &mut b).unwrap();
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn write_f32s(m: &Memory, v: &[f32]) {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    m.write(0, &b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn vector_add_2_pow_20() {
    let mut c = Ctx::new();
    let n = 1usize << 20;
    let mut rng = Rng::new();
    let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let (da, db, dout) = (
        c.buffer(n as u64 * 4),
        c.buffer(n as u64 * 4),
        c.buffer(n as u64 * 4),
    );
    write_f32s(&da, &a);
    write_f32s(&db, &b);
    let k = c.kernel("vector_add");
    c.run(
        &k,
        LaunchConfig::linear((n / 256) as u32, 256),
        &[
            Arg::Ptr(da.va()),
            Arg::Ptr(db.va()),
            Arg::Ptr(dout.va()),
            Arg::U32(n as u32),
        ],
    );
    let out = read_u32s(&dout, n);
    for i in 0..n {
        assert_eq!(f32::from_bits(out[i]), a[i] + b[i], "element {i}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn saxpy_and_scalar_parameters_of_every_size() {
    let mut c = Ctx::new();
    let out = c.buffer(64);
    let mut rng = Rng::new();
    let (a, b, cc, d) = (
        rng.next() as i8,
        rng.next() as i16,
        rng.next() as i32,
        rng.next() as i64,
    );
    let (e, f, g, h) = (
        rng.f32(),
        rng.f32() as f64 * 1.5,
        rng.next() as u8,
        rng.next(),
    );
    let k = c.kernel("scalar_params");
    c.run(
        &k,
        LaunchConfig::linear(1, 1),
        &[
            Arg::Ptr(out.va()),
            Arg::I8(a),
            Arg::I16(b),
            Arg::I32(cc),
            Arg::I64(d),
            Arg::F32(e),
            Arg::F64(f),
            Arg::U8(g),
            Arg::U64(h),
        ],
    );
    let got = read_u64s(&out, 8);
    assert_eq!(
        got,
        vec![
            a as i64 as u64,
            b as i64 as u64,
            cc as i64 as u64,
            d as u64,
            e.to_bits() as u64,
            f.to_bits(),
            g as u64,
            h
        ]
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn by_value_struct_and_4k_parameter_block() {
    let mut c = Ctx::new();
    let mut rng = Rng::new();
    // struct Triple { uint32_t x; uint64_t y; uint8_t z; } : x@0, y@8, z@16, 24 bytes.
    let (x, y, z) = (rng.next() as u32, rng.next(), rng.next() as u8);
    let mut triple = [0u8; 24];
    triple[0..4].copy_from_slice(&x.to_le_bytes());
    triple[8..16].copy_from_slice(&y.to_le_bytes());
    triple[16] = z;
    let input = c.buffer(4);
    let w = rng.next() as u32;
    input.write(0, &w.to_le_bytes()).unwrap();
    let out = c.buffer(32);
    let k = c.kernel("struct_param");
    c.run(
        &k,
        LaunchConfig::linear(1, 1),
        &[
            Arg::Ptr(out.va()),
            Arg::Bytes(&triple),
            Arg::Ptr(input.va()),
        ],
    );
    assert_eq!(read_u64s(&out, 4), vec![x as u64, y, z as u64, w as u64]);

    let words: Vec<u32> = (0..1024).map(|_| rng.next() as u32).collect();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let out = c.buffer(4096);
    let k = c.kernel("big_param");
    assert!(k.info().param_cbank_size >= 4096 + 8);
    c.run(
        &k,
        LaunchConfig::linear(4, 256),
        &[Arg::Ptr(out.va()), Arg::Bytes(&bytes)],
    );
    assert_eq!(read_u32s(&out, 1024), words);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn block_and_grid_dimensions_read_back() {
    let mut c = Ctx::new();
    let k = c.kernel("dims");
    let out = c.buffer(64);
    let shapes: [([u32; 3], [u32; 3]); 7] = [
        ([4, 3, 2], [8, 4, 2]),
        ([1, 1, 1], [1024, 1, 1]),
        ([3, 1, 1], [32, 32, 1]),
        ([2, 2, 1], [1, 1, 64]),
        ([1, 65535, 1], [1, 1, 1]),
        ([1, 1, 65535], [2, 1, 1]),
        ([i32::MAX as u32, 1, 1], [1, 1, 1]),
    ];
    for (grid, block) in shapes {
        out.fill(0, 64, 0).unwrap();
        let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
        let probe = blocks - 1;
        let start = Instant::now();
        c.run(
            &k,
            LaunchConfig::new(grid, block),
            &[Arg::Ptr(out.va()), Arg::U64(probe)],
        );
        let got = read_u32s(&out, 10);
        let idx = [
            (probe % grid[0] as u64) as u32,
            ((probe / grid[0] as u64) % grid[1] as u64) as u32,
            (probe / (grid[0] as u64 * grid[1] as u64)) as u32,
        ];
        assert_eq!(&got[0..3], &block, "blockDim for {grid:?}x{block:?}");
        assert_eq!(&got[3..6], &grid, "gridDim for {grid:?}x{block:?}");
        assert_eq!(
            &got[6..9],
            &idx,
            "blockIdx of the last block for {grid:?}x{block:?}"
        );
        assert_eq!(
            got[9],
            block.iter().product::<u32>(),
            "threads of the probed block"
        );
        eprintln!("grid {grid:?} block {block:?}: {:?}", start.elapsed());
    }
    let counter = c.buffer(4);
    let k = c.kernel("count_threads");
    for (grid, block) in [
        ([7u32, 5, 3], [8u32, 4, 2]),
        ([1000, 1, 1], [1024, 1, 1]),
        ([2, 3, 4], [1, 1, 64]),
    ] {
        counter.fill(0, 4, 0).unwrap();
        c.run(
            &k,
            LaunchConfig::new(grid, block),
            &[Arg::Ptr(counter.va())],
        );
        let total: u32 = grid.iter().chain(block.iter()).product();
        assert_eq!(read_u32s(&counter, 1)[0], total);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dynamic_shared_memory_up_to_the_device_maximum() {
    let mut c = Ctx::new();
    let k = c.kernel("dyn_shared");
    let max_dynamic = c.q.limits().max_shared_per_block - k.info().static_shared as u32;
    let out = c.buffer(4);
    for dynamic in [4u32, 1024, 48 * 1024, 100 * 1024, max_dynamic] {
        let words = dynamic / 4;
        out.fill(0, 4, 0).unwrap();
        let blocks = 8u32;
        c.run(
            &k,
            LaunchConfig::new([blocks, 1, 1], [256, 1, 1]).with_shared_bytes(dynamic),
            &[Arg::Ptr(out.va()), Arg::U32(words)],
        );
        let per_block =
            (0..words).fold(0u32, |s, i| s.wrapping_add(i.wrapping_mul(2654435761) ^ i));
        assert_eq!(
            read_u32s(&out, 1)[0],
            per_block.wrapping_mul(blocks),
            "{dynamic} bytes of dynamic shared memory"
        );
    }
    let too_much = LaunchConfig::new([1, 1, 1], [32, 1, 1]).with_shared_bytes(max_dynamic + 1);
    // SAFETY: rejected before launch.
    assert!(
        unsafe {
            c.q.launch(&k, &too_much, &[Arg::Ptr(out.va()), Arg::U32(1)])
        }
        .is_err()
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn kernel_that_spills_to_local_memory() {
    let mut c = Ctx::new();
    let k = c.kernel("spill");
    assert!(k.info().min_stack_size >= 4096);
    let before = c.q.local_bytes_per_thread();
    let threads = 132 * 2 * 1024;
    let out = c.buffer(threads as u64 * 4);
    let (seed, n) = (Rng::new().next() as u32 | 1, 3000u32);
    c.run(
        &k,
        LaunchConfig::linear(threads / 256, 256),
        &[Arg::Ptr(out.va()), Arg::U32(seed), Arg::U32(n)],
    );
    assert!(
        c.q.local_bytes_per_thread() > before,
        "local memory grew for the kernel's stack"
    );
    let local: Vec<u32> = (0..1024u32).map(|i| seed.wrapping_mul(i + 1)).collect();
    let expect = (0..n).fold(0u32, |a, i| {
        a.wrapping_add(local[(seed.wrapping_add(i * 7) & 1023) as usize])
    });
    assert!(
        read_u32s(&out, threads as usize)
            .iter()
            .all(|&v| v == expect)
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn atomics_across_blocks() {
    let mut c = Ctx::new();
    let k = c.kernel("histogram");
    let (n, nbins) = (1_000_003u32, 97u32);
    let bins = c.buffer(nbins as u64 * 4);
    bins.fill(0, nbins as u64 * 4, 0).unwrap();
    c.run(
        &k,
        LaunchConfig::linear(n.div_ceil(128), 128),
        &[Arg::Ptr(bins.va()), Arg::U32(nbins), Arg::U32(n)],
    );
    let got = read_u32s(&bins, nbins as usize);
    for (b, &count) in got.iter().enumerate() {
        assert_eq!(
            count,
            n / nbins + u32::from((b as u32) < n % nbins),
            "bin {b}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ten_thousand_dependent_launches_build_a_checked_chain() {
    let mut c = Ctx::new();
    let k = c.kernel("chain_step");
    let v = c.buffer(8);
    let mut rng = Rng::new();
    let start = rng.next();
    v.write(0, &start.to_le_bytes()).unwrap();
    let mut expect = start;
    let t = Instant::now();
    let mut last = None;
    for i in 0..10_000u64 {
        let (mul, add) = (rng.next() | 1, rng.next());
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: `v` is an 8-byte buffer, the only thing the kernel touches.
        last = Some(
            unsafe {
                c.q.launch(
                    &k,
                    &LaunchConfig::linear(1, 1),
                    &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)],
                )
            }
            .unwrap(),
        );
        if i % 4096 == 4095 {
            // Reading mid-chain would race; just make sure the queue keeps up.
            assert!(c.q.queue().last_submitted() > i);
        }
    }
    last.unwrap().wait(T).unwrap();
    eprintln!("10^4 dependent launches in {:?}", t.elapsed());
    assert_eq!(read_u64s(&v, 1)[0], expect);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_launches_are_refused_before_the_ring() {
    let mut c = Ctx::new();
    let k = c.kernel("saxpy");
    let buf = c.buffer(16);
    let args = [
        Arg::F32(1.0),
        Arg::Ptr(buf.va()),
        Arg::Ptr(buf.va()),
        Arg::U32(1),
    ];
    let before = c.q.queue().last_submitted();
    let bad = [
        LaunchConfig::new([0, 1, 1], [1, 1, 1]),
        LaunchConfig::new([1, 65536, 1], [1, 1, 1]),
        LaunchConfig::new([1, 1, 1], [1025, 1, 1]),
        LaunchConfig::new([1, 1, 1], [32, 32, 2]),
        LaunchConfig::new([1, 1, 1], [1, 1, 65]),
        LaunchConfig::new([1, 1, 1], [1, 1, 1]).with_shared_bytes(1 << 20),
    ];
    for cfg in bad {
        // SAFETY: refused before launch.
        let e = unsafe { c.q.launch(&k, &cfg, &args) }.unwrap_err();
        assert!(
            matches!(e, apex::launch::Error::InvalidLaunch { .. }),
            "{cfg:?}: {e}"
        );
    }
    // SAFETY: refused before launch.
    let e = unsafe { c.q.launch(&k, &LaunchConfig::linear(1, 1), &args[..3]) }.unwrap_err();
    assert!(matches!(e, apex::launch::Error::Params(_)), "{e}");
    assert_eq!(
        c.q.queue().last_submitted(),
        before,
        "nothing reached the ring"
    );
    assert!(matches!(
        c.module.kernel("nope"),
        Err(apex::module::Error::NoSuchKernel { .. })
    ));
    let sm80 = include_bytes!("../kernels/apex_test_kernels.sm_80.cubin");
    assert!(matches!(
        Module::load(&c.gpu, sm80),
        Err(apex::module::Error::Cubin(_))
    ));
    assert!(Module::load(&c.gpu, &CUBIN[..CUBIN.len() / 3]).is_err());
    // A fatbin gives the sm_90 cubin.
    let fat = Module::load(
        &c.gpu,
        include_bytes!("../kernels/apex_test_kernels.fatbin"),
    )
    .unwrap();
    assert!(fat.kernel("saxpy").is_ok());
}

/// A launch's completion, once the CPU sees it, covers the kernel's writes to host memory: the grid's system
/// membar before the release. Built with `CWD_MEMBAR_TYPE` none instead, this test failed in each of three runs
/// within the first six launches (H100), with a value still the previous launch's. Each launch
/// adds 1 to every element of a 4 MiB host buffer; the CPU reads the last CTAs' elements and random ones as soon as
/// the fence completes. Ordinary, prepared, and chained launches (the chain's end carries the release), 1000 each.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn completion_covers_the_kernels_writes_to_host_memory() {
    use apex::rm::Placement;
    let mut c = Ctx::new();
    let saxpy = c.kernel("saxpy");
    let n: u32 = 1 << 20;
    let bytes = 4 * u64::from(n);
    let x = c.buffer(bytes);
    write_f32s(&x, &vec![1.0; n as usize]);
    let y = Memory::alloc(
        &c.gpu,
        MemoryDesc::video(bytes)
            .with_cpu()
            .placement(Placement::SystemCached),
    )
    .unwrap();
    y.fill(0, bytes, 0).unwrap();
    let cfg = LaunchConfig::new([n / 256, 1, 1], [256, 1, 1]);
    let args = [
        Arg::F32(1.0),
        Arg::Ptr(x.va()),
        Arg::Ptr(y.va()),
        Arg::U32(n),
    ];
    let prepared = c.q.prepare_launch(&saxpy, &cfg).unwrap();
    let mut rng = Rng::new();
    let (mut stale, mut first) = (0u64, None);
    let rounds = 1000u32;
    let mut want = 0.0f32;
    for how in 0..3 {
        for round in 0..rounds {
            // SAFETY: x and y hold n floats; nothing else touches them while the queue runs.
            let fence = unsafe {
                match how {
                    0 => c.q.launch(&saxpy, &cfg, &args),
                    1 => c.q.launch_prepared(&prepared, &args),
                    _ => {
                        c.q.record_launch_chained(&saxpy, &cfg, &args).unwrap();
                        c.q.record_launch_chained(&saxpy, &cfg, &args).unwrap();
                        c.q.end_chain()
                    }
                }
            }
            .unwrap();
            fence.wait(T).unwrap();
            want += if how == 2 { 2.0 } else { 1.0 };
            let mut check = |i: u32| {
                let v = f32::from_bits(y.read_u32_volatile(4 * u64::from(i)).unwrap());
                if v != want {
                    stale += 1;
                    first.get_or_insert((round, how, i, v, want));
                }
            };
            for i in n - 512..n {
                check(i);
            }
            for _ in 0..64 {
                check((rng.next() % u64::from(n)) as u32);
            }
        }
    }
    assert_eq!(
        stale, 0,
        "values not yet visible when completion was seen; first (round, launch kind, index, read, expected): {first:?}"
    );
    // Everything landed in the end.
    let all = read_u32s(&y, n as usize);
    assert!(all.iter().all(|&b| f32::from_bits(b) == want));
}
