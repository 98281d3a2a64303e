//! Module images as nvcc 13.0 writes them (tests/fixtures/modules, built by probes/probe_session3.sh from
//! kernels/conformance/): fatbins in every compression mode, host executables and a shared library with embedded
//! fatbins, relocatable device code, PTX. Entries are checked against what `cuobjdump -lelf -lptx` listed
//! (tests/fixtures/modules/cuobjdump.txt); PTX compilation runs through a compiler double at the `jit::Compiler`
//! seam, so no CUDA toolkit is needed.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use apex::module::cubin::Cubin;
use apex::module::fatbin::{self, Compression, FatbinEntry, FatbinEntryKind, FatbinError, Origin};
use apex::module::image::{self, Code, ImageError, PtxHandling};
use apex::module::jit::{self, Cache, Compiler, InputKind, Jit, JitError};
use apex::module::select::{self, Fit};

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
const HOSTS: [(&str, &[u8]); 3] = [
    fixture!("embed_exe"),
    fixture!("embed_exe_compressed"),
    fixture!("libembed.so"),
];
const RDC: (&str, &[u8]) = fixture!("embed_exe_rdc");
const PTX: &[u8] = include_bytes!("fixtures/modules/module_data.ptx");
const LISTING: &str = include_str!("fixtures/modules/cuobjdump.txt");
/// module_data.cu's kernels, in symbol table order.
const MODULE_DATA_KERNELS: [&str; 4] = ["everything", "read_back", "combo", "bump"];

/// What cuobjdump listed for each file, as `sm_90 cubin` / `sm_90a cubin` / `compute_90 PTX`, in file order.
fn listing() -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = String::new();
    for line in LISTING.lines() {
        if let Some(name) = line.strip_prefix("== ") {
            current = name.to_owned();
            out.entry(current.clone()).or_default();
        } else if let Some((kind, file)) = line.split_once(": ") {
            // `ELF file    1: md.none.3.sm_90a.cubin`, `PTX file    1: md.none.1.sm_90.ptx`
            let arch = file.rsplit('.').nth(1).unwrap();
            let entry = if kind.starts_with("ELF") {
                format!("{arch} cubin")
            } else if kind.starts_with("PTX") {
                format!("{} PTX", arch.replace("sm_", "compute_"))
            } else {
                continue;
            };
            out.get_mut(&current).unwrap().push(entry);
        }
    }
    out
}

/// An entry without its compression, for comparison with cuobjdump's listing.
fn plain(e: &FatbinEntry) -> String {
    let kind = match e.kind {
        FatbinEntryKind::Cubin => "cubin",
        FatbinEntryKind::Ptx => "PTX",
    };
    format!("{} {kind}", e.arch_name())
}

/// A compiler double: records what it is asked, returns `output` (or `fail`).
#[derive(Debug)]
struct FakeCompiler {
    output: Vec<u8>,
    fail: Option<JitError>,
    calls: Mutex<Vec<(InputKind, String, Vec<u8>)>>,
}

impl FakeCompiler {
    fn new(output: Vec<u8>) -> Arc<FakeCompiler> {
        Arc::new(FakeCompiler {
            output,
            fail: None,
            calls: Mutex::new(Vec::new()),
        })
    }

    fn calls(&self) -> Vec<(InputKind, String, Vec<u8>)> {
        self.calls.lock().unwrap().clone()
    }
}

impl Compiler for FakeCompiler {
    fn identity(&self) -> String {
        "fake 1.0".into()
    }

    fn compile(&self, kind: InputKind, input: &[u8], arch: &str) -> Result<Vec<u8>, JitError> {
        self.calls
            .lock()
            .unwrap()
            .push((kind, arch.to_owned(), input.to_vec()));
        match &self.fail {
            Some(e) => Err(e.clone()),
            None => Ok(self.output.clone()),
        }
    }
}

/// The sm_90 cubin of module_data, the compiler double's output.
fn sm90_cubin() -> Vec<u8> {
    let (_, none) = MODES[0];
    let entries = fatbin::entries(none).unwrap();
    fatbin::payload(none, &entries[2]).unwrap()
}

fn no_compiler() -> Result<Arc<dyn Compiler>, JitError> {
    Err(JitError::LibraryNotFound {
        library: jit::LIBRARY_NAMES[0].into(),
        tried: vec!["/nowhere/libnvJitLink.so.13".into()],
    })
}

/// A JIT whose compiler cannot be loaded.
fn missing() -> Jit {
    Jit::lazy(no_compiler, Cache::disabled())
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The PTX entry of the fatbins, decompressed.
fn fatbin_ptx() -> Vec<u8> {
    let (_, none) = MODES[0];
    let entries = fatbin::entries(none).unwrap();
    select::trim_nuls(&fatbin::payload(none, &entries[1]).unwrap()).to_vec()
}

fn kernels(cubin: &[u8]) -> Vec<String> {
    Cubin::parse(cubin)
        .unwrap()
        .kernels()
        .iter()
        .map(|k| k.name.clone())
        .collect()
}

fn cubin_of(code: &Code<'_>) -> Vec<u8> {
    match code {
        Code::Cubin(c) => c.to_vec(),
        Code::Ptx(_) => panic!("PTX where a cubin was expected"),
    }
}

#[test]
fn entries_match_cuobjdump() {
    let listed = listing();
    let all = MODES
        .iter()
        .chain([&PTX_ONLY, &NO_SM90])
        .chain(HOSTS.iter())
        .chain([&RDC]);
    let mut seen = 0;
    for (name, bytes) in all {
        let entries = fatbin::entries(bytes).unwrap();
        // cuobjdump reads .nv_fatbin only.
        let ours: Vec<String> = entries
            .iter()
            .filter(|e| e.origin != Origin::NvRelFatbin)
            .map(plain)
            .collect();
        assert_eq!(&ours, &listed[*name], "{name}");
        seen += 1;
    }
    assert_eq!(seen, listed.len(), "every listed file is a fixture");
}

#[test]
fn every_compression_mode_decodes_to_the_same_code() {
    use Compression::{Lz4, Zstd};
    // What each mode compresses: PTX with zstd by default, LZ4 for speed; cubins too for size and compress-all.
    let expected: [(&str, [Option<Compression>; 4]); 6] = [
        ("md.none.fatbin", [None; 4]),
        ("md.default.fatbin", [None, Some(Zstd), None, None]),
        ("md.size.fatbin", [Some(Zstd); 4]),
        ("md.speed.fatbin", [None, Some(Lz4), None, None]),
        ("md.balance.fatbin", [None, Some(Zstd), None, None]),
        ("md.compress_all.fatbin", [Some(Zstd); 4]),
    ];
    let (_, none) = MODES[0];
    let reference: Vec<Vec<u8>> = fatbin::entries(none)
        .unwrap()
        .iter()
        .map(|e| fatbin::payload(none, e).unwrap())
        .collect();
    for ((name, bytes), (expected_name, compression)) in MODES.iter().zip(expected) {
        assert_eq!(*name, expected_name);
        let entries = fatbin::entries(bytes).unwrap();
        assert_eq!(entries.len(), 4, "{name}");
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e.compression, compression[i], "{name} entry {i}");
            assert_eq!(e.compressed, e.compression.is_some());
            let payload = fatbin::payload(bytes, e).unwrap();
            if e.compressed {
                assert_eq!(
                    payload.len() as u64,
                    e.uncompressed_size,
                    "{name} entry {i}"
                );
            }
            // Uncompressed payloads keep their zero padding.
            assert_eq!(
                select::trim_nuls(&payload),
                select::trim_nuls(&reference[i]),
                "{name} entry {i} decodes to what md.none holds"
            );
        }
        // The PTX nvcc -ptx writes, less comments and indentation.
        let ptx = fatbin::payload(bytes, &entries[1]).unwrap();
        assert!(select::looks_like_ptx(&ptx), "{name}");
        for kernel in MODULE_DATA_KERNELS {
            let entry = format!(".entry {kernel}(");
            assert!(
                contains(&ptx, &entry) && contains(PTX, &entry),
                "{name}: {kernel}"
            );
        }
        for i in [0, 2, 3] {
            let cubin = fatbin::payload(bytes, &entries[i]).unwrap();
            assert_eq!(kernels(&cubin), MODULE_DATA_KERNELS, "{name} entry {i}");
        }
    }
}

#[test]
fn arch_specific_code_is_told_apart() {
    for (name, bytes) in MODES {
        let entries = fatbin::entries(bytes).unwrap();
        let names: Vec<String> = entries.iter().map(|e| e.arch_name()).collect();
        assert_eq!(names, ["sm_80", "compute_90", "sm_90", "sm_90a"], "{name}");
        assert_eq!((entries[2].sm, entries[3].sm), (90, 90));
        assert_ne!(entries[3].flags & fatbin::flags::ARCH_SPECIFIC, 0);
        let sm90 = fatbin::payload(bytes, &entries[2]).unwrap();
        let sm90a = fatbin::payload(bytes, &entries[3]).unwrap();
        // The same e_flags: only .nv.compat (and ptxas's command line) differ.
        assert_eq!(sm90[0x30..0x34], sm90a[0x30..0x34], "{name}");
        let arch = |b: &[u8]| select::cubin_arch(b).unwrap();
        assert_eq!(arch(&sm90).name(), "sm_90");
        assert_eq!(arch(&sm90a).name(), "sm_90a");
        assert!(!arch(&sm90).relocatable);
        assert_eq!(
            arch(&fatbin::payload(bytes, &entries[0]).unwrap()).name(),
            "sm_80"
        );
    }
}

#[test]
fn selection_for_each_device() {
    let chosen = |bytes: &[u8], sm: u32| -> Option<(String, Fit)> {
        let entries = fatbin::entries(bytes).unwrap();
        select::select(&entries, sm)
            .best()
            .map(|c| (entries[c.index].arch_name(), c.fit))
    };
    let c = |arch: &str, fit: Fit| Some((arch.to_owned(), fit));
    for (name, bytes) in MODES {
        assert_eq!(
            chosen(bytes, 90),
            c("sm_90a", Fit::ArchSpecificSass),
            "{name}"
        );
        assert_eq!(chosen(bytes, 80), c("sm_80", Fit::ExactSass), "{name}");
        assert_eq!(chosen(bytes, 86), c("sm_80", Fit::CompatibleSass), "{name}");
        assert_eq!(chosen(bytes, 89), c("sm_80", Fit::CompatibleSass), "{name}");
        assert_eq!(chosen(bytes, 100), c("compute_90", Fit::Ptx), "{name}");
        assert_eq!(chosen(bytes, 120), c("compute_90", Fit::Ptx), "{name}");
        assert_eq!(chosen(bytes, 75), None, "{name}");
        // select_cubin: the SASS alone.
        let sm90a = select::select_cubin(bytes, 90).unwrap();
        assert_eq!(select::cubin_arch(&sm90a).unwrap().name(), "sm_90a");
        assert!(matches!(
            select::select_cubin(bytes, 100),
            Err(FatbinError::NoCubinForSm { device_sm: 100, .. })
        ));
    }
    let (_, ptx_only) = PTX_ONLY;
    assert_eq!(chosen(ptx_only, 90), c("compute_90", Fit::Ptx));
    assert_eq!(chosen(ptx_only, 86), None);
    let (_, no_sm90) = NO_SM90;
    assert_eq!(chosen(no_sm90, 90), None);
    assert_eq!(chosen(no_sm90, 86), c("sm_80", Fit::CompatibleSass));
    assert_eq!(chosen(no_sm90, 100), c("sm_100", Fit::ExactSass));
    assert_eq!(chosen(no_sm90, 103), c("sm_100", Fit::CompatibleSass));
}

#[test]
fn fatbins_resolve_without_a_compiler_when_sass_fits() {
    let jit = missing();
    for (name, bytes) in MODES {
        let r = image::resolve(bytes, 90, &jit, PtxHandling::Compile).unwrap();
        assert!(r.chosen.starts_with("sm_90a cubin"), "{name}: {}", r.chosen);
        let cubin = cubin_of(&r.code);
        assert!(select::cubin_arch(&cubin).unwrap().arch_specific);
        assert_eq!(kernels(&cubin), MODULE_DATA_KERNELS);
        let cubin = image::cubin_for_device(bytes, 86, &jit).unwrap();
        assert_eq!(select::cubin_arch(&cubin).unwrap().name(), "sm_80");
    }
    // Nothing fits: every entry and why.
    let (_, no_sm90) = NO_SM90;
    match image::resolve(no_sm90, 90, &jit, PtxHandling::Compile).unwrap_err() {
        e @ ImageError::NoCodeForDevice { device_sm: 90, .. } => {
            let m = e.to_string();
            assert!(
                m.contains("sm_80 cubin: SASS runs only on GPUs of the major version"),
                "{m}"
            );
            assert!(m.contains("sm_100 cubin: SASS runs only"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    // A bare cubin is used as it is; the cubin parser and check_arch judge it.
    let sm90 = sm90_cubin();
    let r = image::resolve(&sm90, 90, &jit, PtxHandling::Compile).unwrap();
    assert_eq!(r.code, Code::Cubin(Cow::Borrowed(&sm90[..])));
    assert_eq!(r.chosen, "sm_90 cubin");
    let r = image::resolve(b"\x7fELF garbage", 90, &jit, PtxHandling::Compile).unwrap();
    assert!(Cubin::parse(r.code.bytes()).is_err());
}

#[test]
fn arch_specific_cubins_run_only_on_their_sm() {
    let (_, none) = MODES[0];
    let entries = fatbin::entries(none).unwrap();
    let sm90a = fatbin::payload(none, &entries[3]).unwrap();
    let jit = missing();
    assert!(image::cubin_for_device(&sm90a, 90, &jit).is_ok());
    let e = image::cubin_for_device(&sm90a, 91, &jit).unwrap_err();
    assert_eq!(
        e,
        ImageError::ArchSpecific {
            arch: "sm_90a".into(),
            sm: 90,
            device_sm: 91
        }
    );
    assert!(e.to_string().contains("runs only on sm_90"), "{e}");
}

#[test]
fn ptx_is_compiled_for_the_device() {
    let fake = FakeCompiler::new(sm90_cubin());
    let jit = Jit::new(fake.clone(), Cache::disabled());
    // PTX text, as nvcc -ptx wrote it.
    let cubin = image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(cubin, sm90_cubin());
    // A PTX-only fatbin (zstd), on an sm_90 and an sm_100 GPU.
    let (_, ptx_only) = PTX_ONLY;
    image::cubin_for_device(ptx_only, 90, &jit).unwrap();
    image::cubin_for_device(ptx_only, 100, &jit).unwrap();
    // A fatbin whose SASS does not fit: its PTX.
    let (_, size) = MODES[2];
    image::cubin_for_device(size, 120, &jit).unwrap();
    let calls = fake.calls();
    let archs: Vec<&str> = calls.iter().map(|(_, arch, _)| arch.as_str()).collect();
    assert_eq!(archs, ["sm_90", "sm_90", "sm_100", "sm_120"]);
    for (i, (kind, _, input)) in calls.iter().enumerate() {
        assert_eq!(*kind, InputKind::Ptx);
        let expected = if i == 0 { PTX.to_vec() } else { fatbin_ptx() };
        assert!(
            select::trim_nuls(input) == expected,
            "call {i}: the compiler gets the PTX text"
        );
    }
    // PTX for a newer target than the device.
    assert_eq!(
        image::cubin_for_device(PTX, 80, &jit).unwrap_err(),
        ImageError::PtxTarget {
            target: "sm_90".into(),
            device_sm: 80
        }
    );
    assert!(matches!(
        image::cubin_for_device(ptx_only, 80, &jit),
        Err(ImageError::NoCodeForDevice { device_sm: 80, .. })
    ));
    // The driver backend keeps PTX for libcuda to compile.
    let r = image::resolve(ptx_only, 90, &jit, PtxHandling::Keep).unwrap();
    assert!(select::trim_nuls(r.code.bytes()) == fatbin_ptx());
    assert!(matches!(r.code, Code::Ptx(_)));
    assert_eq!(fake.calls().len(), 4, "Keep compiles nothing");
}

#[test]
fn compile_errors_and_a_missing_library_are_typed() {
    let (_, ptx_only) = PTX_ONLY;
    match image::cubin_for_device(ptx_only, 90, &missing()).unwrap_err() {
        ImageError::Jit(e @ JitError::LibraryNotFound { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("libnvJitLink.so.13") && m.contains("/nowhere/"),
                "{m}"
            );
            assert!(
                m.contains("CUDA toolkit") && m.contains("APEX_NVJITLINK"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    let failing = Arc::new(FakeCompiler {
        output: Vec::new(),
        fail: Some(JitError::CompileFailed {
            compiler: "fake 1.0".into(),
            input: InputKind::Ptx,
            arch: "sm_90".into(),
            code: "NVJITLINK_ERROR_PTX_COMPILE".into(),
            log: "ptxas fatal: line 12: syntax error".into(),
        }),
        calls: Mutex::new(Vec::new()),
    });
    let e = image::cubin_for_device(PTX, 90, &Jit::new(failing, Cache::disabled())).unwrap_err();
    let m = e.to_string();
    assert!(
        matches!(e, ImageError::Jit(JitError::CompileFailed { .. })),
        "{e:?}"
    );
    assert!(m.contains("syntax error") && m.contains("sm_90"), "{m}");
    // A compiler that returns something other than an executable cubin.
    let junk = FakeCompiler::new(b"not a cubin".to_vec());
    let e = image::cubin_for_device(PTX, 90, &Jit::new(junk, Cache::disabled())).unwrap_err();
    assert!(
        matches!(e, ImageError::Jit(JitError::BadOutput { size: 11, .. })),
        "{e:?}"
    );
    // The real loader, pointed at a file that is not there.
    // SAFETY: no other test in this binary reads or writes the environment.
    unsafe { std::env::set_var(jit::LIBRARY_ENV, "/nonexistent/libnvJitLink.so.13") };
    let e = jit::NvJitLink::load().unwrap_err();
    unsafe { std::env::remove_var(jit::LIBRARY_ENV) };
    assert_eq!(
        e,
        JitError::LibraryNotFound {
            library: "libnvJitLink.so.13".into(),
            tried: vec!["/nonexistent/libnvJitLink.so.13".into()],
        }
    );
}

#[test]
fn the_cache_compiles_once_and_repairs_itself() {
    let dir = std::env::temp_dir().join(format!("apex-modules-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let fake = FakeCompiler::new(sm90_cubin());
    let jit = Jit::new(fake.clone(), Cache::at(&dir));
    let first = image::cubin_for_device(PTX, 90, &jit).unwrap();
    let second = image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(first, second);
    assert_eq!(
        fake.calls().len(),
        1,
        "the second load comes from the cache"
    );
    // Another architecture is another entry.
    image::cubin_for_device(PTX, 100, &jit).unwrap();
    assert_eq!(fake.calls().len(), 2);
    let key = Cache::key("fake 1.0", InputKind::Ptx, "sm_90", PTX);
    let path = jit.cache().path(&key).unwrap();
    assert!(path.exists(), "{}", path.display());
    // A corrupt entry is ignored, compiled again and rewritten.
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(fake.calls().len(), 3);
    assert_eq!(std::fs::read(&path).unwrap(), good, "rewritten");
    image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(fake.calls().len(), 3);
    // A sound entry that is not an executable cubin is not trusted either.
    jit.cache().store(&key, b"\x7fELF but no cubin").unwrap();
    image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(fake.calls().len(), 4);
    // Only entries in the directory: temporary files are renamed into place.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(name.ends_with(".cubin") && !name.starts_with('.'), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // A cache that cannot be written costs a compile, nothing more.
    let file = std::env::temp_dir().join(format!("apex-modules-cache-file-{}", std::process::id()));
    std::fs::write(&file, b"a file, not a directory").unwrap();
    let jit = Jit::new(fake.clone(), Cache::at(&file));
    image::cubin_for_device(PTX, 90, &jit).unwrap();
    image::cubin_for_device(PTX, 90, &jit).unwrap();
    assert_eq!(fake.calls().len(), 6);
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn host_binaries_load_their_translation_unit() {
    let jit = missing();
    let mut chosen = Vec::new();
    for (name, bytes) in HOSTS {
        let entries = fatbin::entries(bytes).unwrap();
        // The device-link step's container (no kernel), then the translation unit's: SASS and PTX.
        let containers: Vec<(usize, String)> = entries
            .iter()
            .map(|e| (e.container, e.to_string()))
            .collect();
        let compressed = name.contains("compressed");
        let z = |s: &str| {
            if compressed {
                format!("{s} (zstd)")
            } else {
                s.to_owned()
            }
        };
        assert_eq!(
            containers,
            [
                (0, z("sm_90 cubin")),
                (1, z("sm_90 cubin")),
                (1, "compute_90 PTX (zstd)".into())
            ],
            "{name}"
        );
        assert!(entries.iter().all(|e| e.origin == Origin::NvFatbin));
        assert_eq!(
            kernels(&fatbin::payload(bytes, &entries[0]).unwrap()),
            Vec::<String>::new(),
            "{name}: the device-link container defines no kernel"
        );
        let r = image::resolve(bytes, 90, &jit, PtxHandling::Compile).unwrap();
        let cubin = cubin_of(&r.code);
        assert_eq!(kernels(&cubin), ["embedded_scale"], "{name}");
        let k = Cubin::parse(&cubin).unwrap();
        let params: Vec<u32> = k
            .kernel("embedded_scale")
            .unwrap()
            .params
            .iter()
            .map(|p| p.size)
            .collect();
        assert_eq!(params, [8, 4, 4], "{name}: (float *x, float a, uint32_t n)");
        chosen.push(cubin);
        // On an sm_100 GPU: the translation unit's PTX, kept for the driver.
        let r = image::resolve(bytes, 100, &jit, PtxHandling::Keep).unwrap();
        assert!(matches!(r.code, Code::Ptx(_)), "{name}");
        assert!(
            r.code
                .bytes()
                .windows(21)
                .any(|w| w == b".entry embedded_scale")
        );
    }
    assert_eq!(chosen[0], chosen[1], "compression changes nothing");
    // A host ELF without fatbins is not a module.
    let mut plain = HOSTS[0].1.to_vec();
    rename_section(&mut plain, b".nv_fatbin", b".nv_fatbiX");
    assert_eq!(fatbin::entries(&plain).unwrap_err(), FatbinError::NotFatbin);
    let r = image::resolve(&plain, 90, &jit, PtxHandling::Compile).unwrap();
    assert!(
        Cubin::parse(r.code.bytes()).is_err(),
        "refused by the cubin parser"
    );
}

/// Renames a section of a 64-bit ELF in place (`to` as long as `from`).
fn rename_section(elf: &mut [u8], from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let shoff = u64::from_le_bytes(elf[0x28..0x30].try_into().unwrap()) as usize;
    let shstrndx = usize::from(u16::from_le_bytes(elf[0x3e..0x40].try_into().unwrap()));
    let strtab = shoff + shstrndx * 64;
    let start = u64::from_le_bytes(elf[strtab + 0x18..strtab + 0x20].try_into().unwrap()) as usize;
    let size = u64::from_le_bytes(elf[strtab + 0x20..strtab + 0x28].try_into().unwrap()) as usize;
    let mut name = from.to_vec();
    name.push(0);
    let at = elf[start..start + size]
        .windows(name.len())
        .position(|w| w == name)
        .expect("section name");
    elf[start + at..start + at + to.len()].copy_from_slice(to);
}

#[test]
fn relocatable_code_is_linked_or_refused() {
    let (name, rdc) = RDC;
    let entries = fatbin::entries(rdc).unwrap();
    let listed: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        listed,
        [
            "sm_90 cubin",
            "sm_90 cubin (zstd) in __nv_relfatbin",
            "compute_90 PTX (zstd) in __nv_relfatbin",
        ],
        "{name}"
    );
    let relocatable = fatbin::payload(rdc, &entries[1]).unwrap();
    let arch = select::cubin_arch(&relocatable).unwrap();
    assert!(arch.relocatable && !arch.arch_specific && arch.sm == 90);
    // The linked code in .nv_fatbin is preferred: nothing to compile.
    let linked = image::cubin_for_device(rdc, 90, &missing()).unwrap();
    assert_eq!(kernels(&linked), ["embedded_scale"]);
    assert!(!select::cubin_arch(&linked).unwrap().relocatable);

    // Without .nv_fatbin, only relocatable code is left: refused, saying why, when it cannot be linked...
    let mut only_rel = rdc.to_vec();
    rename_section(&mut only_rel, b".nv_fatbin", b".nv_fatbiX");
    let entries = fatbin::entries(&only_rel).unwrap();
    assert!(entries.iter().all(|e| e.origin == Origin::NvRelFatbin));
    match image::cubin_for_device(&only_rel, 90, &missing()).unwrap_err() {
        e @ ImageError::Relocatable { .. } => {
            let m = e.to_string();
            assert!(
                m.contains("relocatable device code (nvcc -rdc=true, sm_90)"),
                "{m}"
            );
            assert!(
                m.contains("must be linked") && m.contains("libnvJitLink.so.13"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    // ...and linked for its own architecture when it can be.
    let fake = FakeCompiler::new(sm90_cubin());
    let jit = Jit::new(fake.clone(), Cache::disabled());
    image::cubin_for_device(&only_rel, 90, &jit).unwrap();
    let calls = fake.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].0, calls[0].1.as_str()),
        (InputKind::RelocatableCubin, "sm_90")
    );
    assert_eq!(calls[0].2, relocatable);
    // A bare relocatable cubin likewise.
    let e = image::cubin_for_device(&relocatable, 90, &missing()).unwrap_err();
    assert!(matches!(e, ImageError::Relocatable { .. }), "{e:?}");
}

#[test]
fn corrupt_payloads_are_typed_errors() {
    let (_, size) = MODES[2];
    let entries = fatbin::entries(size).unwrap();
    let sm90 = &entries[2];
    // A flipped byte in a zstd payload. nvcc writes its frames without a content checksum (frame header descriptor
    // bit 2 clear), so no decoder can promise to catch every flip: it fails to decode (a typed error) or decodes
    // to other bytes, which the cubin reader then sees. Never the original bytes, never a panic. (Frames with a
    // checksum are verified: `fatbin::tests::zstd_bounds`.)
    let stored = &size[sm90.payload_offset..sm90.payload_offset + sm90.payload_size];
    assert_eq!(stored[4] & 0x04, 0, "nvcc's frame carries no checksum");
    let mut bad = size.to_vec();
    bad[sm90.payload_offset + sm90.payload_size / 2] ^= 0x55;
    match fatbin::payload(&bad, sm90) {
        Err(FatbinError::Decompress {
            algorithm: Compression::Zstd,
            ..
        }) => {}
        Err(e) => panic!("not a decompression error: {e:?}"),
        Ok(bytes) => assert_ne!(bytes, fatbin::payload(size, sm90).unwrap()),
    }
    // A frame cut short is always caught.
    let mut cut = sm90.clone();
    cut.payload_size /= 2;
    assert!(matches!(
        fatbin::payload(size, &cut),
        Err(FatbinError::Decompress {
            algorithm: Compression::Zstd,
            ..
        })
    ));
    // A stated size the payload does not decode to.
    let mut wrong = sm90.clone();
    wrong.uncompressed_size += 1;
    let e = fatbin::payload(size, &wrong).unwrap_err();
    assert!(e.to_string().contains("the entry states"), "{e}");
    // A stated size past the limit is refused before anything is allocated.
    wrong.uncompressed_size = 1 << 40;
    assert!(matches!(
        fatbin::payload(size, &wrong),
        Err(FatbinError::TooLarge { size, .. }) if size == 1 << 40
    ));
    wrong.uncompressed_size = fatbin::MAX_PAYLOAD as u64;
    assert!(fatbin::payload(size, &wrong).is_err());
    // LZ4 likewise.
    let (_, speed) = MODES[3];
    let entries = fatbin::entries(speed).unwrap();
    let mut wrong = entries[1].clone();
    assert_eq!(wrong.compression, Some(Compression::Lz4));
    wrong.uncompressed_size -= 1;
    assert!(matches!(
        fatbin::payload(speed, &wrong),
        Err(FatbinError::Decompress {
            algorithm: Compression::Lz4,
            ..
        })
    ));
    wrong.uncompressed_size = 100 << 20;
    let e = fatbin::payload(speed, &wrong).unwrap_err();
    assert!(
        e.to_string()
            .contains("more than 2300 bytes of LZ4 can decode to"),
        "{e}"
    );
    // The resolver skips an entry that does not decode, for the next best: sm_90a, then sm_90, then the PTX. (The
    // payloads are broken in their frame's magic number, which every decoder refuses.)
    let jit = Jit::new(FakeCompiler::new(sm90_cubin()), Cache::disabled());
    let mut bad = size.to_vec();
    bad[sm90.payload_offset] ^= 0x55;
    let r = image::resolve(&bad, 90, &jit, PtxHandling::Compile).unwrap();
    assert!(r.chosen.starts_with("sm_90a cubin"), "{}", r.chosen);
    let sm90a = &fatbin::entries(size).unwrap()[3];
    let mut bad_a = size.to_vec();
    bad_a[sm90a.payload_offset] ^= 0x55;
    let r = image::resolve(&bad_a, 90, &jit, PtxHandling::Compile).unwrap();
    assert!(r.chosen.starts_with("sm_90 cubin"), "{}", r.chosen);
    let mut both_bad = bad.clone();
    both_bad[sm90a.payload_offset] ^= 0x55;
    let r = image::resolve(&both_bad, 90, &jit, PtxHandling::Compile).unwrap();
    assert!(r.chosen.starts_with("compute_90 PTX"), "{}", r.chosen);
    // With nothing left, the first failure is the answer.
    let e = image::resolve(&both_bad, 90, &missing(), PtxHandling::Compile).unwrap_err();
    assert!(
        matches!(e, ImageError::Fatbin(FatbinError::Decompress { .. })),
        "{e:?}"
    );
}

/// Deterministic pseudo-random bytes (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Everything the loader does with `bytes`: nothing may panic.
fn exercise(bytes: &[u8], jit: &Jit) {
    if let Ok(entries) = fatbin::entries(bytes) {
        for e in &entries {
            let _ = e.to_string();
            let _ = fatbin::payload(bytes, e);
        }
        let _ = select::select(&entries, 90).describe(&entries);
    }
    for sm in [86, 90, 100] {
        if let Ok(r) = image::resolve(bytes, sm, jit, PtxHandling::Compile) {
            let _ = Cubin::parse(r.code.bytes());
        }
        let _ = image::resolve(bytes, sm, jit, PtxHandling::Keep);
    }
}

#[test]
fn mutations_and_truncations_never_panic() {
    let jit = Jit::new(FakeCompiler::new(sm90_cubin()), Cache::disabled());
    let mut rng = Rng(0x5eed_f00d_1234_5678);
    let small = MODES
        .iter()
        .chain([&PTX_ONLY, &NO_SM90])
        .map(|(_, b)| *b)
        .chain([PTX]);
    for bytes in small {
        for len in (0..bytes.len()).step_by(bytes.len() / 40 + 1) {
            exercise(&bytes[..len], &jit);
        }
        for _ in 0..150 {
            let mut bad = bytes.to_vec();
            for _ in 0..1 + rng.next() % 4 {
                let at = (rng.next() % bad.len() as u64) as usize;
                bad[at] = rng.next() as u8;
            }
            exercise(&bad, &jit);
        }
    }
    // Host binaries: mutations inside their fatbin sections.
    for (_, bytes) in HOSTS.iter().chain([&RDC]) {
        let entries = fatbin::entries(bytes).unwrap();
        let start = entries[0].payload_offset - 80;
        let end = entries
            .last()
            .map(|e| e.payload_offset + e.payload_size)
            .unwrap();
        for _ in 0..60 {
            let mut bad = bytes.to_vec();
            let at = start + (rng.next() % (end - start) as u64) as usize;
            bad[at] = rng.next() as u8;
            exercise(&bad, &jit);
        }
    }
}

#[test]
fn fuzz_seeds_are_the_fixtures_fatbin_sections() {
    // fuzz/seeds/module_image: `objcopy --only-section=.nv_fatbin --only-section=__nv_relfatbin` of two fixtures.
    let seeds: [(&[u8], &[u8]); 2] = [
        (
            include_bytes!("../fuzz/seeds/module_image/embed_exe_rdc.sections.elf"),
            RDC.1,
        ),
        (
            include_bytes!("../fuzz/seeds/module_image/embed_exe_compressed.sections.elf"),
            HOSTS[1].1,
        ),
    ];
    for (seed, original) in seeds {
        let payloads = |bytes: &[u8]| -> Vec<(String, Vec<u8>)> {
            fatbin::entries(bytes)
                .unwrap()
                .iter()
                .map(|e| (e.to_string(), fatbin::payload(bytes, e).unwrap()))
                .collect()
        };
        assert_eq!(payloads(seed), payloads(original));
    }
}
