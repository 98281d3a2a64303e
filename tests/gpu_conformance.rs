//! Conformance: kernels from compilers APEX did not write, run on both backends with every output byte compared
//! (run with `--include-ignored` on the GPU machine, which has nvcc and Triton). Triton's kernels are compiled and
//! run by Triton itself at test time; APEX then runs the same cubins with the same inputs and must produce the same
//! bytes. nvcc's are built at test time with several option sets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use apex::{Arg, Backend, Gpu, Launch, LaunchConfig};

#[path = "support/gpu.rs"]
mod support_gpu;

const TRITON_GEN: &str = include_str!("../kernels/conformance/triton_gen.py");
const NVCC_SRC: &str = include_str!("../kernels/conformance/nvcc_variants.cu");
const NVRTC_GEN: &str = include_str!("../kernels/conformance/nvrtc_gen.py");
const T: Duration = Duration::from_secs(30);

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("apex-conformance-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{}", String::from_utf8_lossy(&out.stdout));
}

#[derive(Debug)]
enum ManifestArg {
    In(Vec<u8>),
    Out { init: Vec<u8>, expect: Vec<u8> },
    I32(i32),
    F32(f32),
}

#[derive(Debug)]
struct TritonKernel {
    name: String,
    cubin: Vec<u8>,
    warps: u32,
    shared: u32,
    grid: [u32; 3],
    scratch: (u64, u64),
    args: Vec<ManifestArg>,
}

fn parse_manifest(dir: &Path) -> Vec<TritonKernel> {
    let text = std::fs::read_to_string(dir.join("manifest.txt")).unwrap();
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let mut out = Vec::new();
    let mut cur: Option<TritonKernel> = None;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first().copied() {
            Some("kernel") => {
                let kv: BTreeMap<&str, &str> =
                    f[2..].iter().filter_map(|s| s.split_once('=')).collect();
                let nums = |k: &str| -> Vec<u64> {
                    kv[k].split(',').map(|v| v.parse().unwrap()).collect()
                };
                let g = nums("grid");
                let s = nums("scratch");
                cur = Some(TritonKernel {
                    name: f[1].to_owned(),
                    cubin: read(kv["cubin"]),
                    warps: kv["warps"].parse().unwrap(),
                    shared: kv["shared"].parse().unwrap(),
                    grid: [g[0] as u32, g[1] as u32, g[2] as u32],
                    scratch: (s[0], s[1]),
                    args: Vec::new(),
                });
            }
            Some("arg") => {
                let k = cur.as_mut().unwrap();
                k.args.push(match f[1] {
                    "ptr" => ManifestArg::In(read(f[2])),
                    "out" => ManifestArg::Out {
                        init: read(f[2]),
                        expect: read(f[3]),
                    },
                    "i32" => ManifestArg::I32(f[2].parse().unwrap()),
                    "f32" => ManifestArg::F32(f[2].parse().unwrap()),
                    other => panic!("manifest arg {other}"),
                });
            }
            Some("end") => out.push(cur.take().unwrap()),
            _ => {}
        }
    }
    out
}

/// Runs one Triton kernel on `g` and returns each output buffer's bytes.
fn run_triton(g: &Gpu, k: &TritonKernel) -> Vec<Vec<u8>> {
    let m = g.load_module(&k.cubin).unwrap();
    let kernel = m.kernel(&k.name).unwrap();
    let mut q = g.queue().unwrap();
    // Triton makes integer arguments equal to 1 compile-time constants: they are not kernel parameters.
    let user: Vec<&ManifestArg> = k
        .args
        .iter()
        .filter(|a| !matches!(a, ManifestArg::I32(1)))
        .collect();
    let mut buffers = Vec::new();
    let mut args: Vec<Arg> = Vec::new();
    let mut outs = Vec::new();
    for a in &user {
        match a {
            ManifestArg::In(bytes) | ManifestArg::Out { init: bytes, .. } => {
                let b = g.alloc(bytes.len().max(4) as u64).unwrap();
                q.upload(g, &b, 0, bytes).unwrap();
                if let ManifestArg::Out { .. } = a {
                    outs.push(buffers.len());
                }
                buffers.push(b);
            }
            _ => {}
        }
    }
    let mut bi = 0;
    for a in &user {
        args.push(match a {
            ManifestArg::In(_) | ManifestArg::Out { .. } => {
                bi += 1;
                buffers[bi - 1].arg()
            }
            ManifestArg::I32(v) => Arg::I32(*v),
            ManifestArg::F32(v) => Arg::F32(*v),
        });
    }
    // Triton appends its scratch pointers (global, then profile); null when it needs none.
    let programs = u64::from(k.grid[0]) * u64::from(k.grid[1]) * u64::from(k.grid[2]);
    let mut scratch = Vec::new();
    for size in [k.scratch.0, k.scratch.1] {
        if size > 0 {
            scratch.push(g.alloc(size * programs).unwrap());
        }
    }
    if let Some(info) = kernel.info() {
        let extra = info.params.len().saturating_sub(args.len());
        assert!(
            extra <= 2,
            "{}: {} parameters, {} arguments",
            k.name,
            info.params.len(),
            args.len()
        );
        let mut sizes = [k.scratch.0, k.scratch.1].into_iter();
        let mut si = scratch.iter();
        for _ in 0..extra {
            let ptr = match sizes.next() {
                Some(s) if s > 0 => si.next().unwrap().device_ptr(),
                _ => 0,
            };
            args.push(Arg::Ptr(ptr));
        }
    }
    let mut cfg = LaunchConfig::linear(1, 1);
    cfg.grid = k.grid;
    cfg.block = [k.warps * 32, 1, 1];
    cfg.shared_bytes = k.shared;
    // SAFETY: every pointer argument is a live buffer of the size Triton's own run used.
    let f = unsafe { q.launch(&kernel, &cfg, &args) }.unwrap_or_else(|e| panic!("{}: {e}", k.name));
    f.wait(T).unwrap_or_else(|e| panic!("{}: {e}", k.name));
    outs.iter()
        .map(|&i| {
            let mut v = vec![0u8; buffers[i].size() as usize];
            q.download(g, &buffers[i], 0, &mut v).unwrap();
            v
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU, Triton and PyTorch"]
fn triton_kernels_match_triton_on_both_backends() {
    let dir = scratch_dir("triton");
    std::fs::write(dir.join("triton_gen.py"), TRITON_GEN).unwrap();
    run(Command::new("python3")
        .arg(dir.join("triton_gen.py"))
        .arg(&dir));
    let kernels = parse_manifest(&dir);
    assert!(kernels.len() >= 7, "{} kernels", kernels.len());
    for b in [Backend::Direct, Backend::Driver] {
        let g = gpu(b);
        for k in &kernels {
            let got = run_triton(&g, k);
            let expect: Vec<&Vec<u8>> = k
                .args
                .iter()
                .filter_map(|a| match a {
                    ManifestArg::Out { expect, .. } => Some(expect),
                    _ => None,
                })
                .collect();
            assert_eq!(got.len(), expect.len());
            for (g2, e) in got.iter().zip(&expect) {
                assert_eq!(
                    &g2[..e.len()],
                    &e[..],
                    "{b:?} {}: output differs from Triton's own run",
                    k.name
                );
            }
            eprintln!(
                "{b:?} {}: {} output bytes equal Triton's",
                k.name,
                expect.iter().map(|e| e.len()).sum::<usize>()
            );
        }
    }
}

struct NvccVariant {
    tag: &'static str,
    args: &'static [&'static str],
}

const VARIANTS: &[NvccVariant] = &[
    NvccVariant {
        tag: "O3",
        args: &["-O3", "-arch=sm_90"],
    },
    NvccVariant {
        tag: "G",
        args: &["-G", "-arch=sm_90"],
    },
    NvccVariant {
        tag: "lineinfo",
        args: &["-O3", "-lineinfo", "-arch=sm_90"],
    },
    NvccVariant {
        tag: "fast_math",
        args: &["-O3", "--use_fast_math", "-arch=sm_90"],
    },
    NvccVariant {
        tag: "sm_90a",
        args: &["-O3", "-arch=sm_90a"],
    },
];

fn nvcc_cubins(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let src = dir.join("nvcc_variants.cu");
    std::fs::write(&src, NVCC_SRC).unwrap();
    let mut out = Vec::new();
    for v in VARIANTS {
        let cubin = dir.join(format!("{}.cubin", v.tag));
        run(Command::new("nvcc")
            .arg("-cubin")
            .args(v.args)
            .arg("-o")
            .arg(&cubin)
            .arg(&src));
        out.push((v.tag.to_owned(), std::fs::read(&cubin).unwrap()));
    }
    // Relocatable device code, then the device link: the executable cubin nvlink writes.
    let obj = dir.join("rdc.o");
    run(Command::new("nvcc")
        .args(["-O3", "-arch=sm_90", "-rdc=true", "-dc", "-o"])
        .arg(&obj)
        .arg(&src));
    let linked = dir.join("rdc.cubin");
    run(Command::new("nvlink")
        .args(["-arch=sm_90", "-o"])
        .arg(&linked)
        .arg(&obj));
    out.push(("rdc_nvlink".to_owned(), std::fs::read(&linked).unwrap()));
    // PTX, compiled for the device when loaded: nvcc's, and NVRTC's as a runtime would produce it.
    let ptx = dir.join("nvcc.ptx");
    run(Command::new("nvcc")
        .args(["-O3", "-arch=compute_90", "-ptx", "-o"])
        .arg(&ptx)
        .arg(&src));
    out.push(("ptx_nvcc".to_owned(), std::fs::read(&ptx).unwrap()));
    let script = dir.join("nvrtc_gen.py");
    std::fs::write(&script, NVRTC_GEN).unwrap();
    let ptx = dir.join("nvrtc.ptx");
    run(Command::new("python3").arg(&script).arg(&src).arg(&ptx));
    out.push(("ptx_nvrtc".to_owned(), std::fs::read(&ptx).unwrap()));
    out
}

fn run_nvcc_kernels(g: &Gpu, cubin: &[u8]) -> Vec<Vec<u8>> {
    let m = g.load_module(cubin).unwrap();
    let mut q = g.queue().unwrap();
    let n = 10_000i32;
    let xf: Vec<u8> = (0..n)
        .flat_map(|i| ((i as f32) * 0.01 - 40.0).to_le_bytes())
        .collect();
    let xi: Vec<u8> = (0..n)
        .flat_map(|i| (i * 37 % 1001 - 500).to_le_bytes())
        .collect();
    let (bx, bi) = (
        g.alloc(xf.len() as u64).unwrap(),
        g.alloc(xi.len() as u64).unwrap(),
    );
    q.upload(g, &bx, 0, &xf).unwrap();
    q.upload(g, &bi, 0, &xi).unwrap();
    let (o1, o2, o3) = (
        g.alloc(n as u64 * 4).unwrap(),
        g.alloc(8).unwrap(),
        g.alloc(n as u64 * 4).unwrap(),
    );
    q.upload(g, &o2, 0, &[0; 8]).unwrap();
    let cfg = LaunchConfig::linear((n as u32).div_ceil(256), 256);
    // SAFETY: inputs and outputs of n elements (one u64 total).
    unsafe {
        q.launch(
            &m.kernel("math_mix").unwrap(),
            &cfg,
            &[bx.arg(), o1.arg(), Arg::I32(n)],
        )
        .unwrap();
        q.launch(
            &m.kernel("block_sum").unwrap(),
            &cfg,
            &[bi.arg(), o2.arg(), Arg::I32(n)],
        )
        .unwrap();
        q.launch(
            &m.kernel("warp_local").unwrap(),
            &cfg,
            &[bi.arg(), o3.arg(), Arg::I32(n)],
        )
        .unwrap();
    }
    q.synchronize().unwrap();
    [(&o1, n as usize * 4), (&o2, 8), (&o3, n as usize * 4)]
        .iter()
        .map(|(b, len)| {
            let mut v = vec![0u8; *len];
            q.download(g, b, 0, &mut v).unwrap();
            v
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU and nvcc"]
fn nvcc_variants_match_between_backends() {
    let dir = scratch_dir("nvcc");
    let cubins = nvcc_cubins(&dir);
    let (direct, driver) = (gpu(Backend::Direct), gpu(Backend::Driver));
    let want_sum: i64 = (0..10_000i64).map(|i| i * 37 % 1001 - 500).sum();
    for (tag, cubin) in &cubins {
        let a = run_nvcc_kernels(&direct, cubin);
        let b = run_nvcc_kernels(&driver, cubin);
        assert_eq!(
            i64::from_le_bytes(a[1][..8].try_into().unwrap()),
            want_sum,
            "{tag}"
        );
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x == y,
                "{tag}: output {i} differs between the direct path and the CUDA driver"
            );
        }
        eprintln!(
            "nvcc {tag}: {} bytes equal on both backends",
            a.iter().map(Vec::len).sum::<usize>()
        );
    }
}

fn cooperative(b: Backend) {
    let g = gpu(b);
    let m = g
        .load_module(include_bytes!("../kernels/conformance/coop.sm_90.cubin"))
        .unwrap();
    let k = m.kernel("grid_sum").unwrap();
    let mut q = g.queue().unwrap();
    let n = 1_000_000i32;
    let xs: Vec<u8> = (0..n)
        .flat_map(|i| (i % 1000 - 300).to_le_bytes())
        .collect();
    let want: i64 = (0..n as i64).map(|i| i % 1000 - 300).sum();
    let blocks = g.info().sm_count * 2;
    let (x, partial, out) = (
        g.alloc(xs.len() as u64).unwrap(),
        g.alloc(u64::from(blocks) * 4).unwrap(),
        g.alloc(4).unwrap(),
    );
    q.upload(&g, &x, 0, &xs).unwrap();
    // Several launches in a row: the barrier resets itself between them.
    for round in 0..3 {
        q.upload(&g, &partial, 0, &vec![0; blocks as usize * 4])
            .unwrap();
        q.upload(&g, &out, 0, &[0xff; 4]).unwrap();
        // SAFETY: the buffers hold what the kernel reads and writes.
        let args = [x.arg(), partial.arg(), out.arg(), Arg::I32(n)];
        let cfg = LaunchConfig::linear(blocks, 256);
        unsafe { q.submit(&Launch::new(&k, &cfg, &args).cooperative()) }.unwrap();
        q.synchronize().unwrap();
        let mut got = [0u8; 4];
        q.download(&g, &out, 0, &mut got).unwrap();
        assert_eq!(
            i64::from(i32::from_le_bytes(got)),
            want,
            "{b:?} round {round}"
        );
    }
    // A grid that cannot be resident at once is refused before anything runs (CUDA: too large).
    // SAFETY: refused before launch.
    let args = [x.arg(), partial.arg(), out.arg(), Arg::I32(n)];
    let cfg = LaunchConfig::linear(blocks * 1000, 1024);
    let e = unsafe { q.submit(&Launch::new(&k, &cfg, &args).cooperative()) };
    assert!(
        e.is_err(),
        "{b:?}: an oversized cooperative grid was accepted"
    );
    eprintln!("{b:?}: {}", e.unwrap_err());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cooperative_grid_sync_direct() {
    cooperative(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cooperative_grid_sync_driver() {
    cooperative(Backend::Driver);
}

/// Runs `name` (out[t] for 32 threads) and returns the 32 ints it wrote.
fn run_extern_kernel(g: &Gpu, m: &apex::Module, name: &str, arg: i32) -> Vec<i32> {
    let k = m.kernel(name).unwrap();
    let mut q = g.queue().unwrap();
    let out = g.alloc(128).unwrap();
    q.upload(g, &out, 0, &[0; 128]).unwrap();
    // SAFETY: 32 ints, one per thread.
    unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 32),
            &[out.arg(), Arg::I32(arg)],
        )
    }
    .unwrap();
    q.synchronize().unwrap();
    let mut b = [0u8; 128];
    q.download(g, &out, 0, &mut b).unwrap();
    b.chunks_exact(4)
        .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

/// A module where one kernel calls device-side `malloc`: on the direct path that kernel is refused by name
/// before anything is submitted and the others (printf, plain) run; the driver runs all three.
#[test]
#[ignore = "needs an NVIDIA GPU and nvcc"]
fn unsupported_externals_refuse_only_their_kernels() {
    let dir = scratch_dir("externs");
    let src = dir.join("externs.cu");
    std::fs::write(&src, include_str!("../kernels/conformance/externs.cu")).unwrap();
    let cubin = dir.join("externs.cubin");
    run(Command::new("nvcc")
        .args(["-cubin", "-O3", "-arch=sm_90", "-o"])
        .arg(&cubin)
        .arg(&src));
    let bytes = std::fs::read(&cubin).unwrap();
    let (direct, driver) = (gpu(Backend::Direct), gpu(Backend::Driver));
    let (md, mv) = (
        direct.load_module(&bytes).unwrap(),
        driver.load_module(&bytes).unwrap(),
    );
    let e = md.kernel("uses_malloc").unwrap_err();
    eprintln!("direct: {e}");
    assert!(e.to_string().contains("malloc"), "{e}");
    let want_malloc: i32 = (0..10).map(|i| i * i).sum();
    assert_eq!(
        run_extern_kernel(&driver, &mv, "uses_malloc", 10)[5],
        want_malloc
    );
    for (name, base) in [("plain", 14), ("uses_printf", 7)] {
        let a = run_extern_kernel(&direct, &md, name, 7);
        let b = run_extern_kernel(&driver, &mv, name, 7);
        assert_eq!(
            a,
            (0..32).map(|t| base + t).collect::<Vec<_>>(),
            "{name} direct"
        );
        assert_eq!(a, b, "{name}: backends differ");
    }
}

/// Parameters beyond 4 KiB (kernels/conformance/big_params.cu: a 5000-byte and a 32000-byte struct by value, with
/// a pointer and an int after them), described by nvcc 13.0's `EIATTR_KPARAM_INFO_V2`: on both backends, every
/// value as the host computes it. Before those records were read, the direct path saw no parameters.
fn big_parameters(b: Backend) {
    let g = gpu(b);
    let m = g
        .load_module(include_bytes!(
            "../kernels/conformance/big_params.sm_90.cubin"
        ))
        .unwrap();
    let mut q = g.queue().unwrap();
    let (o5, o32) = (g.alloc(1250 * 4).unwrap(), g.alloc(8000 * 4).unwrap());
    q.upload(&g, &o5, 0, &[0; 1250 * 4]).unwrap();
    q.upload(&g, &o32, 0, &[0; 8000 * 4]).unwrap();
    let (mut want5, mut want32) = (vec![0i32; 1250], vec![0i32; 8000]);
    for round in 0..3i32 {
        let p5: Vec<i32> = (0..1250).map(|i| i * 3 + round).collect();
        let p32: Vec<i32> = (0..8000).map(|i| i ^ round).collect();
        let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (b5, b32) = (bytes(&p5), bytes(&p32));
        // SAFETY: the kernels write 1250 and 8000 ints of the buffers given, which hold that many.
        unsafe {
            q.launch(
                &m.kernel("_Z2k53P5KPii").unwrap(),
                &LaunchConfig::linear(5, 256),
                &[Arg::Bytes(&b5), o5.arg(), Arg::I32(round)],
            )
            .unwrap();
            q.launch(
                &m.kernel("_Z3k32Pi4P32Ki").unwrap(),
                &LaunchConfig::linear(32, 256),
                &[o32.arg(), Arg::Bytes(&b32), Arg::I32(round)],
            )
            .unwrap();
        }
        for (i, w) in want5.iter_mut().enumerate() {
            *w = w.wrapping_mul(3).wrapping_add(p5[i]).wrapping_add(round);
        }
        for (i, w) in want32.iter_mut().enumerate() {
            *w = w
                .wrapping_mul(5)
                .wrapping_add(p32[(i * 7) % 8000])
                .wrapping_sub(round);
        }
    }
    q.synchronize().unwrap();
    let ints = |buf: &apex::Buffer, n: usize, q: &mut apex::Queue| {
        let mut v = vec![0u8; n * 4];
        q.download(&g, buf, 0, &mut v).unwrap();
        v.chunks_exact(4)
            .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
            .collect::<Vec<i32>>()
    };
    assert_eq!(ints(&o5, 1250, &mut q), want5);
    assert_eq!(ints(&o32, 8000, &mut q), want32);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn parameters_beyond_4_kib_direct() {
    big_parameters(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn parameters_beyond_4_kib_driver() {
    big_parameters(Backend::Driver);
}
