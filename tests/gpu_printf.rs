//! printf and assert in kernels, and module data, on the GPU (run with `--include-ignored` on an NVIDIA GPU with
//! libcuda). The direct path links APEX's device runtime; its output must be what the CUDA driver prints for the
//! same kernels, byte for byte (pointers aside).

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use apex::launch::{self, ComputeQueue, ComputeQueueConfig};
use apex::module::Module;
use apex::module::printf::{DeviceRecord, PrintfFifoCell, format_printf};
use apex::rm::{GpuCore, Memory, MemoryDesc};
use apex::{Arg, Backend, Error, Gpu, LaunchConfig};

#[path = "support/gpu.rs"]
mod support_gpu;

const PRINTF: &[u8] = include_bytes!("../kernels/conformance/printf_kernels.sm_90.cubin");
const PRINTF_SRC: &str = include_str!("../kernels/conformance/printf_kernels.cu");
const DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

const I: i32 = -7;
const U: u32 = 0xdead_beef;
const LL: i64 = -1_234_567_890_123;
const D: f64 = 3.25;
const F: f32 = 2.5;
const C: u8 = b'Z';

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

/// What C prints for `printf_types` with the arguments above (`p` is the device string's address).
fn expected_types(p: u64) -> Vec<String> {
    vec![
        format!("i={I} u={U} ll={LL} d=3.250 f=2.5 s=dev-string c=Z"),
        format!("x={U:#x} o={U:o} X={U:08X} e=3.250000e+00 p={p:#x} %"),
        format!("width [{I:>8}] [{I:<8}] [{I}] [      trun]"),
        format!(
            "literal in-image and short {I} char {C} ul {U} zu {}",
            LL as u64
        ),
    ]
}

/// Launches `printf_types` and `printf_each` through the public API on `backend` and synchronizes: the lines go
/// to standard output. Returns the device string's address.
fn print_through_api(backend: Backend) -> u64 {
    let g = gpu(backend);
    let mut q = g.queue().unwrap();
    let m = g.load_module(PRINTF).unwrap();
    let s = g.alloc(64).unwrap();
    q.upload(&g, &s, 0, b"dev-string\0").unwrap();
    let types = m.kernel("printf_types").unwrap();
    let each = m.kernel("printf_each").unwrap();
    // SAFETY: `s` holds the string the kernel reads; nothing is written.
    unsafe {
        q.launch(
            &types,
            &LaunchConfig::linear(1, 32),
            &[
                Arg::I32(I),
                Arg::U32(U),
                Arg::I64(LL),
                Arg::F64(D),
                Arg::F32(F),
                s.arg(),
                Arg::U8(C),
            ],
        )
        .unwrap();
        q.launch(&each, &LaunchConfig::linear(2, 4), &[Arg::I32(5)])
            .unwrap();
    }
    q.synchronize().unwrap();
    s.device_ptr()
}

/// The child process of `printf_output_matches_the_driver` (and, run alone, a check that printing through the
/// public API works on the backend `APEX_PRINTF_CHILD` names, the direct path by default).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn printf_child_process() {
    let backend = match std::env::var("APEX_PRINTF_CHILD").as_deref() {
        Ok("driver") => Backend::Driver,
        _ => Backend::Direct,
    };
    let p = print_through_api(backend);
    eprintln!("APEX_PRINTF_PTR={p:#x}");
}

fn child_output(backend: &str) -> (Vec<String>, u64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "printf_child_process",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("APEX_PRINTF_CHILD", backend)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{backend} child failed:\n{stdout}\n{stderr}"
    );
    let ptr = stderr
        .lines()
        .find_map(|l| l.strip_prefix("APEX_PRINTF_PTR="))
        .map(|p| u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap())
        .expect("pointer line");
    // The test harness's own "test ... " may share a line with the first output line.
    let lines = stdout
        .lines()
        .filter_map(|l| {
            ["i=", "x=", "width", "literal", "tag "]
                .iter()
                .filter_map(|p| l.find(p))
                .min()
                .map(|at| l[at..].to_owned())
        })
        .collect();
    (lines, ptr)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn printf_output_matches_the_driver() {
    let (direct, dp) = child_output("direct");
    let (driver, vp) = child_output("driver");
    let mut want = expected_types(dp);
    let mut tags: Vec<String> = (0..2)
        .flat_map(|b| (0..4).map(move |t| format!("tag 5 block {b} thread {t}")))
        .collect();
    tags.sort();
    want.extend(tags.iter().cloned());
    let normalize = |lines: &[String], p: u64| -> Vec<String> {
        let (fixed, mut tags): (Vec<String>, Vec<String>) = lines
            .iter()
            .map(|l| l.replace(&format!("p={p:#x}"), "p=PTR"))
            .partition(|l| !l.starts_with("tag "));
        tags.sort();
        fixed.into_iter().chain(tags).collect()
    };
    let want_norm: Vec<String> = want
        .iter()
        .map(|l| l.replace(&format!("p={dp:#x}"), "p=PTR"))
        .collect();
    eprintln!(
        "direct:\n{}\ndriver:\n{}",
        direct.join("\n"),
        driver.join("\n")
    );
    // The direct path prints what C prints, every line.
    assert_eq!(normalize(&direct, dp), want_norm);
    // The CUDA driver agrees on every line but the one with `%hhu`, `%lu` and `%zu`, which its vprintf does not
    // handle as C does (it printed `char 239 ... zu %zu` on driver 580.159.04).
    let portable = |lines: Vec<String>| -> Vec<String> {
        lines
            .into_iter()
            .filter(|l| !l.starts_with("literal"))
            .collect()
    };
    assert_eq!(
        portable(normalize(&driver, vp)),
        portable(want_norm.clone())
    );
    assert_eq!(
        portable(normalize(&direct, dp)),
        portable(normalize(&driver, vp))
    );
}

fn direct_setup(cell: &PrintfFifoCell) -> (Arc<GpuCore>, Arc<Module>, ComputeQueue) {
    let gpu = GpuCore::open(0).unwrap();
    let m = Module::load_with(&gpu, PRINTF, cell).unwrap();
    let q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    (gpu, m, q)
}

fn texts(recs: &[DeviceRecord]) -> Vec<String> {
    recs.iter()
        .filter_map(|r| match r {
            DeviceRecord::Printf { format, args } => {
                Some(String::from_utf8(format_printf(format, args)).unwrap())
            }
            DeviceRecord::Assert(_) => None,
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn printf_records_decode_exactly() {
    let cell = PrintfFifoCell::new();
    let (gpu, m, mut q) = direct_setup(&cell);
    let s = Memory::alloc(&gpu, MemoryDesc::video(64).with_cpu()).unwrap();
    s.write(0, b"dev-string\0").unwrap();
    let k = m.kernel("printf_types").unwrap();
    // SAFETY: the kernel reads the string in `s`.
    let f = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 32),
            &[
                Arg::I32(I),
                Arg::U32(U),
                Arg::I64(LL),
                Arg::F64(D),
                Arg::F32(F),
                Arg::Ptr(s.va()),
                Arg::U8(C),
            ],
        )
    }
    .unwrap();
    let star = m.kernel("printf_star").unwrap();
    // SAFETY: the kernel only prints.
    unsafe {
        q.launch(
            &star,
            &LaunchConfig::linear(1, 1),
            &[Arg::I32(I), Arg::F64(D)],
        )
    }
    .unwrap();
    let f2 = unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(1, 1),
            &[
                Arg::I32(1),
                Arg::U32(2),
                Arg::I64(3),
                Arg::F64(4.0),
                Arg::F32(5.0),
                Arg::Ptr(0),
                Arg::U8(b'!'),
            ],
        )
    }
    .unwrap();
    f.wait(T).unwrap(); // the lower layer's fence does not drain
    f2.wait(T).unwrap();
    let (recs, dropped) = cell.get().unwrap().take().unwrap();
    let got: Vec<String> = texts(&recs)
        .iter()
        .map(|l| l.trim_end().to_owned())
        .collect();
    let mut want = expected_types(s.va());
    want.push(format!("star [{I:>6}] [{I:<5}] [3.25] [    3.250]"));
    // A null %s prints as C prints it; the other lines as before with other values.
    want.push("i=1 u=2 ll=3 d=4.000 f=5 s=(null) c=!".to_owned());
    assert_eq!(&got[..want.len()], &want[..]);
    assert_eq!(got.len(), want.len() + 3);
    assert_eq!(dropped, 0);
}

fn printf_live(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(PRINTF).unwrap();
    let k = m.kernel("printf_live").unwrap();
    let plain = m.kernel("plain_add").unwrap();
    let threads = 128u32;
    let out = g.alloc(u64::from(threads) * 40).unwrap();
    for seed in [2u32, 7] {
        // SAFETY: `out` holds 10 words per thread.
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(1, threads),
                &[out.arg(), Arg::U32(seed)],
            )
            .unwrap();
        }
        q.synchronize().unwrap();
        let mut got = vec![0u8; threads as usize * 40];
        q.download(&g, &out, 0, &mut got).unwrap();
        for t in 0..threads {
            let (a, b2, c, d) = (
                seed * 3 + t,
                seed ^ t,
                seed + 7 * t,
                seed.wrapping_mul(t) + 1,
            );
            let (e, f) = (a.wrapping_mul(b2), c.wrapping_sub(d));
            let g2 = e ^ f;
            let want = [
                a,
                b2,
                c,
                d,
                e,
                f,
                g2,
                a + b2 + c,
                d.wrapping_mul(e),
                f.wrapping_add(g2),
            ];
            for (i, w) in want.iter().enumerate() {
                let at = (t as usize * 10 + i) * 4;
                let v = u32::from_le_bytes(got[at..at + 4].try_into().unwrap());
                assert_eq!(
                    v, *w,
                    "{b:?} seed {seed} thread {t} value {i}: a register did not survive printf"
                );
            }
        }
    }
    // A kernel without printf in the same module.
    let n = 1000u32;
    let (x, y, o) = (
        g.alloc(4000).unwrap(),
        g.alloc(4000).unwrap(),
        g.alloc(4000).unwrap(),
    );
    let xs: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let ys: Vec<u8> = (0..n)
        .flat_map(|i| (2.0 * i as f32).to_le_bytes())
        .collect();
    q.upload(&g, &x, 0, &xs).unwrap();
    q.upload(&g, &y, 0, &ys).unwrap();
    // SAFETY: three buffers of n floats.
    unsafe {
        q.launch(
            &plain,
            &LaunchConfig::linear(4, 256),
            &[x.arg(), y.arg(), o.arg(), Arg::U32(n)],
        )
        .unwrap();
    }
    q.synchronize().unwrap();
    let mut got = vec![0u8; 4000];
    q.download(&g, &o, 0, &mut got).unwrap();
    for i in 0..n as usize {
        assert_eq!(
            f32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap()),
            3.0 * i as f32
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn registers_survive_printf_direct() {
    printf_live(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn registers_survive_printf_driver() {
    printf_live(Backend::Driver);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn failed_assert_is_a_typed_error_and_the_gpu_recovers() {
    let g = gpu(Backend::Direct);
    let m = g.load_module(PRINTF).unwrap();
    let k = m.kernel("assert_when").unwrap();
    let v = g.alloc(32 * 4).unwrap();
    let vals: Vec<u8> = (0..32i32)
        .flat_map(|i| if i == 3 { 77 } else { i }.to_le_bytes())
        .collect();
    let mut q = g.queue().unwrap();
    q.upload(&g, &v, 0, &vals).unwrap();
    // An assertion that holds: nothing happens.
    // SAFETY: `v` holds 32 ints.
    let f =
        unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[v.arg(), Arg::I32(-1)]) }.unwrap();
    f.wait(T).unwrap();
    // One that fails in thread 3.
    // SAFETY: as above.
    let f =
        unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[v.arg(), Arg::I32(77)]) }.unwrap();
    let e = f.wait(T).unwrap_err();
    eprintln!("assert: {e}");
    let Error::Direct(launch::Error::Assert(a)) = &e else {
        panic!("not an assertion error: {e:?}")
    };
    let failure = &a.failure;
    let line = PRINTF_SRC
        .lines()
        .position(|l| l.contains("assert(x != bad)"))
        .unwrap() as u32
        + 1;
    assert_eq!(failure.message, "x != bad");
    assert!(
        failure.file.ends_with("printf_kernels.cu"),
        "{}",
        failure.file
    );
    assert_eq!(failure.line, line);
    assert!(
        failure.function.contains("assert_when"),
        "{}",
        failure.function
    );
    assert_eq!((failure.block, failure.thread), ([0, 0, 0], [3, 0, 0]));
    drop(q);
    // A new queue on the same GPU runs the same module correctly.
    let mut q = g.queue().unwrap();
    // SAFETY: as above.
    let f =
        unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[v.arg(), Arg::I32(-1)]) }.unwrap();
    f.wait(T).unwrap();
    printf_live(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_small_fifo_drops_what_does_not_fit_and_keeps_working() {
    let cell = PrintfFifoCell::new();
    cell.set_size(4096).unwrap();
    let (_gpu, m, mut q) = direct_setup(&cell);
    assert!(
        cell.set_size(1 << 20).is_err(),
        "the size is fixed once a module uses it"
    );
    let flood = m.kernel("printf_flood").unwrap();
    let each = m.kernel("printf_each").unwrap();
    let (blocks, threads, lines) = (4u32, 32u32, 100i32);
    // SAFETY: the kernels only print.
    let f = unsafe {
        q.launch(
            &flood,
            &LaunchConfig::linear(blocks, threads),
            &[Arg::I32(lines)],
        )
    }
    .unwrap();
    f.wait(T).unwrap();
    let fifo = cell.get().unwrap().clone();
    let (recs, dropped) = fifo.take().unwrap();
    let total = u64::from(blocks * threads) * lines as u64;
    assert!(
        dropped > 0 && !recs.is_empty(),
        "{} kept, {dropped} dropped",
        recs.len()
    );
    assert_eq!(
        recs.len() as u64 + dropped,
        total,
        "every record is either kept or counted as dropped"
    );
    for l in texts(&recs) {
        assert!(l.starts_with("flood "), "{l}");
    }
    // SAFETY: as above.
    let f = unsafe { q.launch(&each, &LaunchConfig::linear(1, 8), &[Arg::I32(9)]) }.unwrap();
    f.wait(T).unwrap();
    let (recs, dropped) = fifo.take().unwrap();
    assert_eq!((recs.len(), dropped), (8, 0));
}

fn module_data(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g.load_module(DATA).unwrap();
    let out = g.alloc(64).unwrap();
    let read = |q: &mut apex::Queue, n: usize| -> Vec<i32> {
        let mut bytes = vec![0u8; n * 4];
        q.download(&g, &out, 0, &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    // SAFETY: `out` holds 16 ints.
    unsafe {
        q.launch(
            &m.kernel("combo").unwrap(),
            &LaunchConfig::linear(1, 1),
            &[out.arg()],
        )
        .unwrap();
    }
    q.synchronize().unwrap();
    assert_eq!(
        read(&mut q, 3),
        [110, 1234, 1234],
        "{b:?}: the combination from issue 10"
    );
    for sel in [0, 1] {
        // SAFETY: as above.
        unsafe {
            q.launch(
                &m.kernel("everything").unwrap(),
                &LaunchConfig::linear(1, 1),
                &[out.arg(), Arg::I32(sel)],
            )
            .unwrap();
        }
        q.synchronize().unwrap();
        let (a, b2) = if sel == 0 { (13, 42) } else { (42, 13) };
        assert_eq!(
            read(&mut q, 7),
            [110, 1234, 3, 4, 1, a, b2],
            "{b:?} sel {sel}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn module_data_direct() {
    module_data(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn module_data_driver() {
    module_data(Backend::Driver);
}

fn templates(b: Backend) {
    let g = gpu(b);
    let mut q = g.queue().unwrap();
    let m = g
        .load_module(include_bytes!(
            "../kernels/conformance/templates.sm_90.cubin"
        ))
        .unwrap();
    let k = m.kernel("scale_n<float, 256>").unwrap();
    let x = g.alloc(256 * 4).unwrap();
    let xs: Vec<u8> = (0..256).flat_map(|i| (i as f32).to_le_bytes()).collect();
    q.upload(&g, &x, 0, &xs).unwrap();
    // SAFETY: `x` holds the 256 floats the kernel scales.
    unsafe {
        q.launch(&k, &LaunchConfig::linear(1, 256), &[x.arg(), Arg::F32(0.5)])
            .unwrap();
    }
    q.synchronize().unwrap();
    let mut got = vec![0u8; 256 * 4];
    q.download(&g, &x, 0, &mut got).unwrap();
    for i in 0..256 {
        let v = f32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!(v, i as f32 * 0.5, "{b:?} element {i}");
    }
    assert!(m.kernel("apex_ns::in_namespace").is_ok());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn template_kernels_by_demangled_name_direct() {
    templates(Backend::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn template_kernels_by_demangled_name_driver() {
    templates(Backend::Driver);
}
