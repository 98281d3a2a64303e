//! Modules as real programs ship them, loaded through `apex::Gpu` on both backends and run, results checked:
//! fatbins in every nvcc 13 compression mode, PTX-only fatbins and PTX text (compiled by nvJitLink on the direct
//! path, by libcuda on the driver backend), host executables and a shared library with embedded fatbins, and
//! relocatable device code. Needs an sm_90 GPU (H100/H200), libcuda, and the CUDA 13 toolkit's nvJitLink
//! (/usr/local/cuda/..., or APEX_NVJITLINK). Run with `--include-ignored --test-threads=1`.

use std::time::Duration;

use apex::module::fatbin;
use apex::module::jit::{self, Compiler, InputKind};
use apex::module::select;
use apex::{Arg, Backend, Gpu, LaunchConfig, Module};

#[path = "support/gpu.rs"]
mod support_gpu;

macro_rules! fixture {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("fixtures/modules/", $name)) as &[u8],
        )
    };
}

const MODES: [(&str, &[u8]); 6] = [
    fixture!("md.none.fatbin"),
    fixture!("md.default.fatbin"),
    fixture!("md.size.fatbin"),
    fixture!("md.speed.fatbin"),
    fixture!("md.balance.fatbin"),
    fixture!("md.compress_all.fatbin"),
];
const PTX_ONLY: (&str, &[u8]) = fixture!("md.ptxonly.fatbin");
const NO_SM90: (&str, &[u8]) = fixture!("md.nosm90.fatbin");
const PTX: (&str, &[u8]) = fixture!("module_data.ptx");
const HOSTS: [(&str, &[u8]); 4] = [
    fixture!("embed_exe"),
    fixture!("embed_exe_compressed"),
    fixture!("libembed.so"),
    fixture!("embed_exe_rdc"),
];
const T: Duration = Duration::from_secs(20);

fn gpu(b: Backend) -> Gpu {
    let g = support_gpu::open(b);
    assert_eq!(g.info().sm_version, 90, "these tests expect an sm_90 GPU");
    g
}

fn ints(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

/// Runs module_data's `combo` and `everything` (sel 0 and 1), checking what they read from the module's data.
fn run_module_data(g: &Gpu, m: &Module, what: &str) {
    let mut q = g.queue().unwrap();
    let out = g.alloc(64).unwrap();
    let combo = m.kernel("combo").unwrap();
    q.upload(g, &out, 0, &[0xff; 64]).unwrap();
    // SAFETY: `combo` writes 3 ints of a 64-byte buffer.
    unsafe { q.launch(&combo, &LaunchConfig::linear(1, 1), &[out.arg()]) }
        .unwrap()
        .wait(T)
        .unwrap();
    let mut back = [0u8; 12];
    q.download(g, &out, 0, &mut back).unwrap();
    assert_eq!(
        ints(&back),
        [11 + 22 + 33 + 44, 1234, 1234],
        "{what}: combo"
    );
    let everything = m.kernel("everything").unwrap();
    for (sel, ops) in [(0, [13, 42]), (1, [42, 13])] {
        // SAFETY: `everything` writes 7 ints of a 64-byte buffer.
        unsafe {
            q.launch(
                &everything,
                &LaunchConfig::linear(1, 1),
                &[out.arg(), Arg::I32(sel)],
            )
        }
        .unwrap()
        .wait(T)
        .unwrap();
        let mut back = [0u8; 28];
        q.download(g, &out, 0, &mut back).unwrap();
        // table sum, *dev_ptr + dev_zero[3], dev_array[2], (int)(0.5 + 1.5 + 2.5), dev_array[4], ops[sel](6, 7),
        // ops[sel + 1](6, 7).
        assert_eq!(
            ints(&back),
            [110, 1234, 3, 4, 1, ops[0], ops[1]],
            "{what}: everything({sel})"
        );
    }
}

/// Runs `embedded_scale(x, a, n)` over 1000 floats.
fn run_embedded_scale(g: &Gpu, m: &Module, what: &str) {
    let mut q = g.queue().unwrap();
    let k = m.kernel("embedded_scale").unwrap();
    let n = 1000u32;
    let x: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let buf = g.alloc(u64::from(n) * 4).unwrap();
    q.upload(g, &buf, 0, &x).unwrap();
    // SAFETY: n floats in a buffer of n floats.
    unsafe {
        q.launch(
            &k,
            &LaunchConfig::linear(n.div_ceil(128), 128),
            &[buf.arg(), Arg::F32(2.5), Arg::U32(n)],
        )
    }
    .unwrap()
    .wait(T)
    .unwrap();
    let mut back = vec![0u8; x.len()];
    q.download(g, &buf, 0, &mut back).unwrap();
    for (i, w) in back.chunks_exact(4).enumerate() {
        assert_eq!(
            f32::from_le_bytes(w.try_into().unwrap()),
            i as f32 * 2.5,
            "{what}: element {i}"
        );
    }
}

fn fatbins_in_every_compression_mode(b: Backend) {
    let g = gpu(b);
    for (name, bytes) in MODES {
        let m = g
            .load_module(bytes)
            .unwrap_or_else(|e| panic!("{b:?} {name}: {e}"));
        run_module_data(&g, &m, &format!("{b:?} {name}"));
    }
}

fn ptx_only_fatbin(b: Backend) {
    let g = gpu(b);
    let (name, bytes) = PTX_ONLY;
    // Twice: on the direct path the second load comes from the JIT cache.
    for round in 0..2 {
        let m = g
            .load_module(bytes)
            .unwrap_or_else(|e| panic!("{b:?} {name}: {e}"));
        run_module_data(&g, &m, &format!("{b:?} {name} (load {round})"));
    }
}

fn ptx_text(b: Backend) {
    let g = gpu(b);
    let (name, bytes) = PTX;
    let m = g
        .load_module(bytes)
        .unwrap_or_else(|e| panic!("{b:?} {name}: {e}"));
    run_module_data(&g, &m, &format!("{b:?} {name}"));
}

fn no_code_for_the_device(b: Backend) {
    let g = gpu(b);
    let (name, bytes) = NO_SM90;
    let e = g
        .load_module(bytes)
        .err()
        .unwrap_or_else(|| panic!("{b:?} {name} loaded"));
    let m = e.to_string();
    if b == Backend::Direct {
        assert!(
            m.contains("nothing in the image runs on an sm_90 GPU"),
            "{m}"
        );
        assert!(
            m.contains("sm_80 cubin") && m.contains("sm_100 cubin"),
            "{m}"
        );
    }
}

fn host_binaries(b: Backend) {
    let g = gpu(b);
    for (name, bytes) in HOSTS {
        let m = g
            .load_module(bytes)
            .unwrap_or_else(|e| panic!("{b:?} {name}: {e}"));
        run_embedded_scale(&g, &m, &format!("{b:?} {name}"));
    }
    // From the file, as a program would name it.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/modules/libembed.so"
    );
    let m = g.load_module_file(path).unwrap();
    run_embedded_scale(&g, &m, &format!("{b:?} {path}"));
    let missing = g
        .load_module_file("/nonexistent/libnothing.so")
        .err()
        .unwrap();
    assert!(
        matches!(missing, apex::Error::ReadModule { .. }),
        "{missing}"
    );
}

/// embed_exe_rdc with its linked `.nv_fatbin` hidden: only `__nv_relfatbin`'s relocatable code is left, which
/// nvJitLink links (on both backends: libcuda does not load relocatable cubins).
fn relocatable_only(b: Backend) {
    let g = gpu(b);
    let (_, rdc) = HOSTS[3];
    let mut only_rel = rdc.to_vec();
    let at = only_rel
        .windows(11)
        .position(|w| w == b".nv_fatbin\0")
        .unwrap();
    only_rel[at + 9] = b'X';
    assert!(
        fatbin::entries(&only_rel)
            .unwrap()
            .iter()
            .all(|e| e.origin == fatbin::Origin::NvRelFatbin)
    );
    let m = g
        .load_module(&only_rel)
        .unwrap_or_else(|e| panic!("{b:?}: {e}"));
    run_embedded_scale(&g, &m, &format!("{b:?} __nv_relfatbin only"));
}

/// A module nvlink made of two objects, each with its own `__unnamed_1` and `$str` (same names, same size of
/// `__unnamed_1`) and its own `static` counter: each kernel reads its own object's constants and counts on its own
/// counter, twice.
fn linked_objects_keep_their_own_variables(b: Backend) {
    const LINKED: &[u8] = include_bytes!("../kernels/conformance/linked_locals.sm_90.cubin");
    let g = gpu(b);
    let m = g.load_module(LINKED).unwrap();
    let mut q = g.queue().unwrap();
    let out = g.alloc(256).unwrap();
    let text = |bytes: &[u8]| {
        let end = bytes.iter().position(|&c| c == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    };
    for round in 1..=2 {
        for (x, literal, start) in [
            ("a", "a string literal of object a", 100),
            ("b", "object b's literal, which is longer than a's", 200),
        ] {
            let k = m.kernel(&format!("fill_{x}")).unwrap();
            q.upload(&g, &out, 0, &[0xff; 256]).unwrap();
            let args = [
                out.arg(),
                Arg::Ptr(out.device_ptr() + 64),
                Arg::Ptr(out.device_ptr() + 128),
            ];
            // SAFETY: fill_x writes 64 bytes at each of its first two pointers and one int at the third, all inside
            // the 256-byte buffer.
            unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &args) }
                .unwrap()
                .wait(T)
                .unwrap();
            let mut back = [0u8; 132];
            q.download(&g, &out, 0, &mut back).unwrap();
            assert_eq!(
                text(&back[..64]),
                format!("void fill_{x}(char *, char *, int *)"),
                "{b:?}"
            );
            assert_eq!(text(&back[64..128]), literal, "{b:?}");
            assert_eq!(
                ints(&back[128..132]),
                [start + round],
                "{b:?}: fill_{x}'s counter"
            );
        }
    }
}

macro_rules! both {
    ($($name:ident),*) => {
        mod direct { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Direct) } )* }
        mod driver { $( #[test] #[ignore = "needs an NVIDIA GPU"] fn $name() { super::$name(apex::Backend::Driver) } )* }
    };
}
both!(
    fatbins_in_every_compression_mode,
    ptx_only_fatbin,
    ptx_text,
    no_code_for_the_device,
    host_binaries,
    relocatable_only,
    linked_objects_keep_their_own_variables
);

/// nvJitLink itself, as the direct path calls it: its symbols and enum values, PTX and a relocatable cubin.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nvjitlink_compiles_ptx_and_links_relocatable_code() {
    let linker = jit::NvJitLink::load().expect("nvJitLink (CUDA 13 toolkit)");
    assert_eq!(linker.version().0, 13, "{}", linker.path());
    assert!(linker.identity().starts_with("nvJitLink 13."));
    let (_, ptx) = PTX;
    for arch in ["sm_90", "sm_90a", "sm_100"] {
        let cubin = linker.compile(InputKind::Ptx, ptx, arch).unwrap();
        let a = select::cubin_arch(&cubin).unwrap();
        assert_eq!(a.name(), arch);
        assert!(!a.relocatable);
        let parsed = apex::module::cubin::Cubin::parse(&cubin).unwrap();
        assert_eq!(parsed.kernels().len(), 4, "{arch}");
    }
    let e = linker
        .compile(
            InputKind::Ptx,
            b".version 9.0\n.target sm_90\nnot ptx at all\n",
            "sm_90",
        )
        .unwrap_err();
    match &e {
        jit::JitError::CompileFailed { code, log, .. } => {
            assert_eq!(code, "NVJITLINK_ERROR_PTX_COMPILE", "{e}");
            assert!(!log.is_empty(), "{e}");
        }
        other => panic!("{other:?}"),
    }
    let (_, rdc) = HOSTS[3];
    let entries = fatbin::entries(rdc).unwrap();
    let rel = entries
        .iter()
        .find(|e| {
            e.origin == fatbin::Origin::NvRelFatbin && e.kind == fatbin::FatbinEntryKind::Cubin
        })
        .unwrap();
    let relocatable = fatbin::payload(rdc, rel).unwrap();
    let linked = linker
        .compile(InputKind::RelocatableCubin, &relocatable, "sm_90")
        .unwrap();
    let parsed = apex::module::cubin::Cubin::parse(&linked).unwrap();
    assert!(parsed.kernel("embedded_scale").is_ok());
}
