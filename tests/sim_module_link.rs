//! What the loader lays out and links, checked without a GPU (the simulated GPU holds the memory): modules that
//! call `printf`/`assert` get APEX's device runtime appended and their references pointed at it, kernels that call
//! it get its registers and stack, constant banks sit where the QMD can address them, and module data is
//! relocated as `cuobjdump` describes it.

use std::time::Duration;

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::module::cubin::{CONST_BANK_ALIGN, Cubin};
use apex::module::printf::DeviceRuntime;
use apex::rm::sim::SimConfig;
use apex::rm::{Memory, MemoryDesc};
use apex::sim::Simulator;

const PRINTF: &[u8] = include_bytes!("../kernels/conformance/printf_kernels.sm_90.cubin");
const PRESSURE: &[u8] = include_bytes!("../kernels/conformance/printf_pressure.sm_90.cubin");
const DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");
const DATA_ELF: &str = include_str!("../kernels/conformance/module_data.sm_90.elf.txt");
const PRINTF_ELF: &str = include_str!("../kernels/conformance/printf_kernels.sm_90.elf.txt");

fn u64_at(b: &[u8], at: u64) -> u64 {
    u64::from_le_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

fn u32_at(b: &[u8], at: u64) -> u32 {
    u32::from_le_bytes(b[at as usize..at as usize + 4].try_into().unwrap())
}

#[test]
fn printf_modules_link_apex_runtime() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let parsed = Cubin::parse(PRINTF).unwrap();
    assert_eq!(parsed.externals(), ["__assertfail", "vprintf"]);
    // Plain linking still refuses them, naming the symbol.
    let mut scratch = vec![0u8; parsed.image_size() as usize];
    let e = parsed.link(0x10_0000, &mut scratch).unwrap_err();
    assert!(
        e.to_string().contains("vprintf") || e.to_string().contains("__assertfail"),
        "{e}"
    );

    let m = Module::load(&gpu, PRINTF).unwrap();
    let fifo = m
        .printf_fifo()
        .expect("a module with printf has a FIFO")
        .clone();
    let rt = DeviceRuntime::for_sm(90).unwrap();
    let vprintf = rt.function("vprintf").unwrap();
    let before = |name: &str| parsed.kernel(name).unwrap().clone();
    let after = |name: &str| m.kernel(name).unwrap().info().clone();
    for name in [
        "printf_types",
        "printf_each",
        "printf_live",
        "printf_flood",
        "assert_when",
    ] {
        let (b, a) = (before(name), after(name));
        assert_eq!(a.registers, b.registers.max(vprintf.registers), "{name}");
        // The callee's stack is added below the kernel's frame (apex_assertfail, which ends the thread or traps,
        // needs none).
        let callee = rt.function(&b.externs[0]).unwrap();
        assert!(
            a.min_stack_size >= b.min_stack_size + callee.stack
                && (callee.stack == 0 || a.min_stack_size > b.min_stack_size),
            "{name}: the runtime's stack is added"
        );
        assert_eq!(a.externs.len(), 1, "{name}");
    }
    // A kernel that calls nothing keeps what ptxas gave it.
    assert_eq!(after("plain_add"), before("plain_add"));

    let image = m.image_bytes().unwrap();
    let base = m.base_va();
    // Bank 4 holds each callee's address at the slot cuobjdump lists for its relocation.
    let slot = |sym: &str| {
        elf_relocs(PRINTF_ELF, ".rela.nv.constant4")
            .into_iter()
            .find(|(_, s, _)| s == sym)
            .unwrap()
            .0
    };
    let c4 = after("printf_each")
        .const_bank(4)
        .unwrap()
        .image_offset
        .unwrap();
    let target = u64_at(&image, c4 + slot("vprintf"));
    let code_at = target - base;
    assert!(
        code_at >= parsed.image_size() && code_at.is_multiple_of(128),
        "{code_at:#x}"
    );
    assert_eq!(
        &image[code_at as usize..code_at as usize + 16],
        &vprintf.code()[..16]
    );
    // The runtime's code refers to the FIFO's header through 32-bit immediate halves.
    let code = &image[code_at as usize..(code_at + vprintf.code_size()) as usize];
    let imms: Vec<u32> = (0..code.len() / 16)
        .map(|i| u32_at(code, i as u64 * 16 + 4))
        .collect();
    assert!(imms.contains(&(fifo.va() as u32)) && imms.contains(&((fifo.va() >> 32) as u32)));
    // Both functions are appended; __assertfail's slot points at the other one.
    let assertfail = rt.function("__assertfail").unwrap();
    let c4_assert = after("assert_when")
        .const_bank(4)
        .unwrap()
        .image_offset
        .unwrap();
    let assert_target = u64_at(&image, c4_assert + slot("__assertfail")) - base;
    assert_eq!(
        &image[assert_target as usize..assert_target as usize + 16],
        &assertfail.code()[..16]
    );

    // A second module of the same GPU shares nothing unless given the same cell; a kernel with more registers
    // than the runtime keeps its own count.
    let p = Module::load(&gpu, PRESSURE).unwrap();
    assert_eq!(p.kernel("printf_pressure").unwrap().info().registers, 72);
    assert!(!std::sync::Arc::ptr_eq(p.printf_fifo().unwrap(), &fifo));

    // The launch carries the raised register count to the QMD, and the queue picks up the FIFO.
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let before_launches = _sim.launches().len();
    let k = m.kernel("printf_each").unwrap();
    // SAFETY: the simulator runs no kernel code.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 32), &[Arg::I32(1)]) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    let l = &_sim.launches()[before_launches];
    assert_eq!(l.registers, 32);
    assert!(std::sync::Arc::ptr_eq(q.printf_fifo().unwrap(), &fifo));
    // Nothing was written by the (simulated) kernel: a drain finds nothing and prints nothing.
    let d = q.drain_printf().unwrap();
    assert_eq!((d.printed, d.asserts.len(), d.dropped), (0, 0, 0));
}

/// The relocations `cuobjdump -elf` lists for a section: (offset, symbol, type).
fn elf_relocs(elf: &str, section: &str) -> Vec<(u64, String, String)> {
    let mut out = Vec::new();
    let mut on = false;
    for line in elf.lines() {
        if line.starts_with(".section") {
            on = line.contains(section);
            continue;
        }
        if !on {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 3 && f[0].starts_with("0x") && f[2].starts_with("R_CUDA") {
            out.push((
                u64::from_str_radix(&f[0][2..], 16).unwrap(),
                f[1].to_owned(),
                f[2].to_owned(),
            ));
        }
    }
    out
}

#[test]
fn module_data_is_laid_out_and_relocated_as_cuobjdump_says() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let cubin = Cubin::parse(DATA).unwrap();
    // Constant banks start where the QMD can address them: the original fault bound bank 4 at a 64-byte
    // boundary below its real place, and the kernel read bank 3's table as pointers.
    for s in cubin
        .image_sections()
        .filter(|s| s.name.starts_with(".nv.constant"))
    {
        assert_eq!(s.image_offset % CONST_BANK_ALIGN, 0, "{}", s.name);
    }
    let m = Module::load(&gpu, DATA).unwrap();
    assert!(m.printf_fifo().is_none());
    let image = m.image_bytes().unwrap();
    let base = m.base_va();
    let sec = |name: &str| cubin.section_offset(name).unwrap();
    let (c3, c4, init) = (
        sec(".nv.constant3"),
        sec(".nv.constant4"),
        sec(".nv.global.init"),
    );
    // Initial values: __constant__ int table[4] = {11, 22, 33, 44} at the start of bank 3.
    let table: Vec<u32> = (0..4).map(|i| u32_at(&image, c3 + 4 * i)).collect();
    assert_eq!(table, [11, 22, 33, 44]);
    // Every bank 4 slot and every pointer in the initialized data points into the image, at what cuobjdump says.
    let c4_relocs = elf_relocs(DATA_ELF, ".rela.nv.constant4");
    let init_relocs = elf_relocs(DATA_ELF, ".rela.nv.global.init");
    let c3_relocs = elf_relocs(DATA_ELF, ".rela.nv.constant3");
    assert!(!c4_relocs.is_empty() && !init_relocs.is_empty() && !c3_relocs.is_empty());
    for (section_at, relocs) in [(c4, &c4_relocs), (init, &init_relocs), (c3, &c3_relocs)] {
        for (off, sym, kind) in relocs.iter() {
            assert!(kind == "R_CUDA_64" || kind == "R_CUDA_G64", "{sym}: {kind}");
            let v = u64_at(&image, section_at + off);
            assert!(
                v >= base && v < base + image.len() as u64,
                "{sym} -> {v:#x}"
            );
        }
    }
    // dev_ptr = &dev_value (1234); dev_ptr_mid = &dev_array[2] (3); cptr = &dev_array[4] (1).
    let deref = |va: u64| u32_at(&image, va - base);
    let ptrs: Vec<u32> = init_relocs
        .iter()
        .filter(|(_, s, _)| s.contains("dev_") || s == ".nv.global.init")
        .map(|(off, _, _)| deref(u64_at(&image, init + off)))
        .collect();
    assert!(ptrs.contains(&1234) && ptrs.contains(&3), "{ptrs:?}");
    let cptr = deref(u64_at(&image, c3 + c3_relocs[0].0));
    assert_eq!(cptr, 1);

    // The QMD binds each bank at its section: a launch of `combo` on the simulator checks addresses and sizes.
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let out = Memory::alloc(&gpu, MemoryDesc::video(64).with_cpu()).unwrap();
    let k = m.kernel("combo").unwrap();
    // SAFETY: the simulator runs no kernel code.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(1, 1), &[Arg::Ptr(out.va())]) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
}

#[test]
fn kernels_are_found_by_mangled_and_demangled_names() {
    let c = Cubin::parse(include_bytes!(
        "../kernels/conformance/templates.sm_90.cubin"
    ))
    .unwrap();
    let mangled = "_Z7scale_nIfLi256EEvPT_S0_";
    for name in [
        mangled,
        "void scale_n<float, 256>(float*, float)",
        "scale_n<float, 256>",
        "scale_n<float,256>",
    ] {
        assert_eq!(c.kernel(name).unwrap().name, mangled, "{name}");
    }
    assert_eq!(
        c.kernel("apex_ns::in_namespace").unwrap().name,
        "_ZN7apex_ns12in_namespaceEPi"
    );
    assert_eq!(
        c.kernel("scale_n<int, 128>").unwrap().name,
        "_Z7scale_nIiLi128EEvPT_S0_"
    );
    assert!(matches!(
        c.kernel("scale_n"),
        Err(apex::module::cubin::CubinError::NoSuchKernel(_))
    ));
}

#[test]
fn cooperative_launches_bind_a_grid_barrier_and_check_residency() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let m = Module::load(
        &gpu,
        include_bytes!("../kernels/conformance/coop.sm_90.cubin"),
    )
    .unwrap();
    let k = m.kernel("grid_sum").unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let args = [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)];
    let before = sim.launches().len();
    // SAFETY: refused before anything is submitted.
    let e = unsafe { q.launch_cooperative(&k, &LaunchConfig::linear(1 << 20, 1024), &args) }
        .unwrap_err();
    assert!(e.to_string().contains("resident"), "{e}");
    assert_eq!(sim.launches().len(), before);
    // SAFETY: the simulator runs no kernel code.
    let f = unsafe { q.launch_cooperative(&k, &LaunchConfig::linear(4, 128), &args) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    // SAFETY: as above.
    let f = unsafe { q.launch(&k, &LaunchConfig::linear(4, 128), &args) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    let launches = sim.launches();
    let (coop, plain) = (&launches[before], &launches[before + 1]);
    // The barrier's address sits in the driver words the kernel reads (high word at 0x44, low at 0x48); an
    // ordinary launch leaves them zero, as libcuda does, and the kernel traps at its grid sync.
    let barrier =
        (u64::from(coop.driver_words[0x44 / 4]) << 32) | u64::from(coop.driver_words[0x48 / 4]);
    assert_ne!(barrier, 0);
    assert_eq!(barrier % 8, 0);
    assert_eq!(
        (plain.driver_words[0x44 / 4], plain.driver_words[0x48 / 4]),
        (0, 0)
    );
    // The rest of the driver words are what any launch gets.
    assert_eq!(&coop.driver_words[..6], &[128, 1, 1, 4, 1, 1]);
}

/// A kernel that calls device-side `malloc` is refused by name when looked up; the module's other kernels load
/// and link (`printf` against APEX's runtime).
#[test]
fn unsupported_externals_refuse_only_the_kernels_that_call_them() {
    const EXTERNS: &[u8] = include_bytes!("../kernels/conformance/externs.sm_90.cubin");
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let parsed = Cubin::parse(EXTERNS).unwrap();
    assert!(parsed.externals().iter().any(|s| s == "malloc"));
    let m = Module::load(&gpu, EXTERNS).unwrap();
    let e = m.kernel("uses_malloc").unwrap_err();
    assert!(
        matches!(&e, apex::module::Error::KernelRefused { kernel, .. } if kernel == "uses_malloc"),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("malloc") && text.contains("APEX_BACKEND=driver"),
        "{text}"
    );
    assert!(m.kernel("plain").is_ok());
    assert!(m.kernel("uses_printf").is_ok());
    assert!(
        m.printf_fifo().is_some(),
        "printf is linked for uses_printf"
    );
}

/// Modules load lazily, as CUDA's do by default: data at load, each kernel's code at its first lookup. Linked
/// section by section, the image is byte for byte what linking the whole cubin at once gives, and a queue that
/// launched the module's kernels before another one's code went up invalidates its instruction caches before
/// launching that one.
#[test]
fn kernel_code_goes_up_at_its_first_lookup() {
    const TEMPLATES: &[u8] = include_bytes!("../kernels/conformance/templates.sm_90.cubin");
    let eager = std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v.eq_ignore_ascii_case("eager"));
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let cubin = Cubin::parse(TEMPLATES).unwrap();
    let m = Module::load(&gpu, TEMPLATES).unwrap();
    let names = m.kernel_names();
    assert!(names.len() >= 3, "{names:?}");
    for n in &names {
        assert_eq!(
            m.kernel_is_loaded(n).unwrap(),
            eager,
            "{n} before its lookup"
        );
    }
    assert!(matches!(
        m.kernel_is_loaded("no_such_kernel"),
        Err(apex::module::Error::NoSuchKernel { .. })
    ));

    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let out = Memory::alloc(&gpu, MemoryDesc::video(4096).with_cpu()).unwrap();
    let first = m.kernel(&names[0]).unwrap();
    assert!(m.kernel_is_loaded(&names[0]).unwrap());
    if !eager {
        assert!(
            !m.kernel_is_loaded(&names[1]).unwrap(),
            "only the kernel looked up"
        );
    }
    let args = |k: &apex::module::Kernel| -> Vec<Arg> {
        k.info()
            .params
            .iter()
            .map(|p| {
                if p.size == 8 {
                    Arg::Ptr(out.va())
                } else {
                    Arg::U32(1)
                }
            })
            .collect()
    };
    let invalidations = || {
        sim.channel_stats()
            .iter()
            .map(|c| c.cache_invalidations)
            .sum::<u64>()
    };
    // SAFETY: the simulator runs no kernel code.
    let f = unsafe { q.launch(&first, &LaunchConfig::linear(1, 32), &args(&first)) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    let after_first = invalidations();
    // SAFETY: as above.
    let f = unsafe { q.launch(&first, &LaunchConfig::linear(1, 32), &args(&first)) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(invalidations(), after_first, "nothing new went up");
    let second = m.kernel(&names[1]).unwrap();
    // SAFETY: as above.
    let f = unsafe { q.launch(&second, &LaunchConfig::linear(1, 32), &args(&second)) }.unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    if !eager {
        assert_eq!(
            invalidations(),
            after_first + 1,
            "new code: the caches are invalidated first"
        );
    }

    m.load_all_kernels().unwrap();
    for n in &names {
        assert!(m.kernel_is_loaded(n).unwrap(), "{n}");
    }
    let mut whole = vec![0u8; cubin.image_size() as usize];
    cubin.link(m.base_va(), &mut whole).unwrap();
    let image = m.image_bytes().unwrap();
    assert!(
        image[..whole.len()] == whole[..],
        "section by section = the whole cubin at once"
    );
}

/// A module nvlink made of two objects (`kernels/conformance/linked_a.cu`, `linked_b.cu`): each object's compiler
/// constants — its `__PRETTY_FUNCTION__` (`__unnamed_1`, both 35 bytes) and a string literal (`$str`) — keep their
/// names, so the module has two of each, each laid out apart and holding its own object's bytes; its `static`
/// counters were renamed apart by nvlink. A module shared with CUDA's instance gives homes by name only to the
/// counters: the constants are never asked for (CUDA's one `__unnamed_1` would be the other object's string).
#[test]
fn a_linked_modules_same_named_constants_stay_apart() {
    const LINKED: &[u8] = include_bytes!("../kernels/conformance/linked_locals.sm_90.cubin");
    let parsed = Cubin::parse(LINKED).unwrap();
    let mut image = vec![0u8; parsed.image_size() as usize];
    parsed.link(0x10_0000, &mut image).unwrap();
    let text = |name: &str| {
        let mut found: Vec<String> = parsed
            .globals()
            .iter()
            .filter(|g| g.name == name)
            .map(|g| {
                assert!(g.local && g.is_compiler_constant(), "{g:?}");
                let at = g.image_offset as usize;
                let bytes = &image[at..at + g.size as usize];
                String::from_utf8(bytes.strip_suffix(&[0]).unwrap().to_vec()).unwrap()
            })
            .collect();
        found.sort();
        found
    };
    assert_eq!(
        text("__unnamed_1"),
        [
            "void fill_a(char *, char *, int *)",
            "void fill_b(char *, char *, int *)"
        ]
    );
    assert_eq!(
        text("$str"),
        [
            "a string literal of object a",
            "object b's literal, which is longer than a's"
        ]
    );
    let counters: Vec<&str> = parsed
        .globals()
        .iter()
        .filter(|g| !g.is_compiler_constant())
        .map(|g| g.name.as_str())
        .collect();
    assert_eq!(counters.len(), 2, "{counters:?}");
    assert!(
        counters.iter().all(|n| n.contains("counter")),
        "{counters:?}"
    );

    let (gpu, _sim) = apex::Gpu::open_simulated(SimConfig::default()).unwrap();
    let asked = std::cell::RefCell::new(Vec::new());
    gpu.load_module_sharing(LINKED, &|name, _| {
        asked.borrow_mut().push(name.to_string());
        None
    })
    .unwrap();
    let mut asked = asked.into_inner();
    asked.sort();
    let mut expected: Vec<String> = counters.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(asked, expected);
}
