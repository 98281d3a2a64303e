//! Module variables and thread block clusters without a GPU: the cubin's variable table against cuobjdump, cluster
//! shapes from `.nv.info` and their validation, and cluster launches by the real compute queue against the
//! simulator (QMD fields and cbank0 cluster words as recorded). tests/gpu_globals_clusters.rs runs them on a GPU.

use apex::launch::{
    Arg, ComputeQueue, ComputeQueueConfig, Error, LaunchConfig, Limits, cluster_shape,
    queue_validate,
};
use apex::module::Module;
use apex::module::cubin::Cubin;
use apex::rm::sim::SimConfig;
use apex::rm::{Memory, MemoryDesc};
use apex::sim::Simulator;

const MODULE_DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");
const CLUSTER: &[u8] = include_bytes!("../kernels/conformance/cluster.sm_90.cubin");

#[test]
fn module_variables_match_cuobjdump() {
    let c = Cubin::parse(MODULE_DATA).unwrap();
    // (name, section, st_value, st_size) from kernels/conformance/module_data.sm_90.elf.txt.
    let want = [
        ("table", ".nv.constant3", 0x0, 0x10),
        ("ctable_zero", ".nv.constant3", 0x10, 0x20),
        ("dev_value", ".nv.global.init", 0x20, 0x4),
        ("dev_ptr", ".nv.global.init", 0x8, 0x8),
        ("dev_zero", ".nv.global", 0x0, 0x40),
        ("dev_array", ".nv.global.init", 0x24, 0x14),
        ("dev_ptr_mid", ".nv.global.init", 0x0, 0x8),
        ("cdouble", ".nv.constant3", 0x30, 0x18),
        ("cptr", ".nv.constant3", 0x48, 0x8),
        ("ops", ".nv.global.init", 0x10, 0x10),
    ];
    let names: Vec<&str> = c.globals().iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, want.map(|w| w.0), "symbol table order");
    for (name, section, value, size) in want {
        let g = c.global(name).unwrap();
        assert_eq!(g.section, section, "{name}");
        assert_eq!(g.size, size, "{name}");
        assert_eq!(
            g.image_offset,
            c.section_offset(section).unwrap() + value,
            "{name}"
        );
        assert_eq!(g.is_constant(), section.starts_with(".nv.constant"));
    }
    assert!(c.global("nope").is_none());
    assert!(c.global("combo").is_none(), "kernels are not variables");

    // The initial values, where the linked image has them.
    let mut image = vec![0u8; c.image_size() as usize];
    c.link(0x1_0000_0000, &mut image).unwrap();
    let at = |name: &str| {
        let g = c.global(name).unwrap();
        &image[g.image_offset as usize..(g.image_offset + g.size) as usize]
    };
    let ints = |b: &[u8]| -> Vec<i32> {
        b.chunks_exact(4)
            .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
            .collect()
    };
    assert_eq!(ints(at("table")), [11, 22, 33, 44]);
    assert_eq!(ints(at("dev_value")), [1234]);
    assert_eq!(ints(at("dev_array")), [5, 4, 3, 2, 1]);
    // dev_ptr = &dev_value, relocated to the image's address.
    let dev_value = 0x1_0000_0000 + c.global("dev_value").unwrap().image_offset;
    assert_eq!(at("dev_ptr"), dev_value.to_le_bytes());
    // __constant__ data is constant bank 3 of the kernels that read it.
    let bank3 = c.kernel("combo").unwrap().const_bank(3).unwrap();
    assert_eq!(
        bank3.image_offset,
        Some(c.global("table").unwrap().image_offset)
    );
}

/// Variables placed elsewhere (another instance of the module owns them): every reference into them, from code or
/// from another variable's initializer, goes to the placed address; the rest of the image is linked as before.
#[test]
fn placed_variables_redirect_every_reference_into_them() {
    use apex::module::cubin::PlacedGlobal;
    let c = Cubin::parse(MODULE_DATA).unwrap();
    let base = 0x1_0000_0000u64;
    let mut own = vec![0u8; c.image_size() as usize];
    c.link(base, &mut own).unwrap();
    let g = |name: &str| c.global(name).unwrap().clone();
    let (value, zero) = (g("dev_value"), g("dev_zero"));
    let placed = [
        PlacedGlobal {
            image_offset: value.image_offset,
            size: value.size,
            address: 0x7_0000_1000,
        },
        PlacedGlobal {
            image_offset: zero.image_offset,
            size: zero.size,
            address: 0x7_0000_2000,
        },
    ];
    let mut shared = vec![0u8; c.image_size() as usize];
    c.link_placed(base, &mut shared, &|_| None, &placed)
        .unwrap();
    // dev_ptr = &dev_value now holds the placed address.
    let ptr = g("dev_ptr");
    let at = |img: &[u8], o: u64| {
        u64::from_le_bytes(img[o as usize..o as usize + 8].try_into().unwrap())
    };
    assert_eq!(at(&own, ptr.image_offset), base + value.image_offset);
    assert_eq!(at(&shared, ptr.image_offset), 0x7_0000_1000);
    // The references changed (in code, whose address halves are split over instruction fields; in constant bank 4,
    // which holds the addresses code loads; in initializers), nothing else did.
    let differing: Vec<usize> = (0..own.len()).filter(|&i| own[i] != shared[i]).collect();
    assert!(!differing.is_empty());
    let text: Vec<_> = c
        .image_sections()
        .filter(|s| {
            s.name.starts_with(".text.")
                || s.name.starts_with(".nv.constant4")
                || s.name == ".nv.global.init"
        })
        .map(|s| s.image_offset..s.image_offset + s.size)
        .collect();
    for i in differing {
        assert!(
            text.iter().any(|r| r.contains(&(i as u64))),
            "byte {i:#x} changed outside code, bank 4 and initialized data"
        );
    }
    // References into unplaced variables stay.
    let array = g("dev_array");
    let mid = g("dev_ptr_mid");
    assert_eq!(at(&shared, mid.image_offset), at(&own, mid.image_offset));
    // dev_ptr_mid = &dev_array[2] follows dev_array when it is placed (symbol plus addend, at the placed address).
    let mut moved = vec![0u8; c.image_size() as usize];
    let array_home = PlacedGlobal {
        image_offset: array.image_offset,
        size: array.size,
        address: 0x7_0000_3000,
    };
    c.link_placed(base, &mut moved, &|_| None, &[array_home])
        .unwrap();
    assert_eq!(at(&moved, mid.image_offset), 0x7_0000_3000 + 8);
    assert_eq!(
        at(&moved, ptr.image_offset),
        base + value.image_offset,
        "dev_ptr, into an unplaced variable, stays"
    );
}

#[test]
fn cluster_dims_come_from_nv_info() {
    let c = Cubin::parse(CLUSTER).unwrap();
    let fixed = c.kernel("cluster_fixed").unwrap();
    assert_eq!(fixed.cluster_dims, Some([2, 1, 1]));
    assert!(fixed.explicit_cluster);
    let runtime = c.kernel("cluster_runtime").unwrap();
    assert_eq!(runtime.cluster_dims, None);
    assert!(!runtime.explicit_cluster);
}

fn refused(r: Result<Option<[u32; 3]>, Error>, what: &str) -> String {
    match r {
        Err(Error::InvalidLaunch { why, .. }) => {
            assert!(why.contains(what), "{why}");
            why
        }
        other => panic!("expected a refusal ({what}), got {other:?}"),
    }
}

#[test]
fn cluster_shapes_are_validated_before_submission() {
    let c = Cubin::parse(CLUSTER).unwrap();
    let fixed = c.kernel("cluster_fixed").unwrap();
    let runtime = c.kernel("cluster_runtime").unwrap();
    let h100 = Limits::for_sm(90);
    assert_eq!(h100.max_cluster_blocks, 8);
    let lin = LaunchConfig::linear;

    // The compile-time shape applies by itself; the same shape given at launch is fine too.
    assert_eq!(
        cluster_shape(fixed, &lin(8, 32), &h100).unwrap(),
        Some([2, 1, 1])
    );
    let same = lin(8, 32).with_cluster([2, 1, 1]);
    assert_eq!(cluster_shape(fixed, &same, &h100).unwrap(), Some([2, 1, 1]));
    assert_eq!(cluster_shape(runtime, &lin(12, 64), &h100).unwrap(), None);
    let four = lin(12, 64).with_cluster([4, 1, 1]);
    assert_eq!(
        cluster_shape(runtime, &four, &h100).unwrap(),
        Some([4, 1, 1])
    );
    assert_eq!(queue_validate(runtime, &four, &h100).unwrap(), 1028);
    let cube = lin(1, 64).with_cluster([2, 2, 2]).with_grid([4, 4, 2]);
    assert_eq!(
        cluster_shape(runtime, &cube, &h100).unwrap(),
        Some([2, 2, 2])
    );

    // Refusals, through the check every launch goes through on both backends.
    let why = refused(
        queue_validate(fixed, &lin(7, 32), &h100).map(|_| None),
        "multiple",
    );
    assert!(why.contains("grid.x = 7"), "{why}");
    refused(
        cluster_shape(runtime, &lin(7, 64).with_cluster([2, 1, 1]), &h100),
        "not a multiple",
    );
    refused(
        cluster_shape(fixed, &lin(8, 32).with_cluster([4, 1, 1]), &h100),
        "__cluster_dims__",
    );
    refused(
        cluster_shape(runtime, &lin(16, 64).with_cluster([16, 1, 1]), &h100),
        "at most 8",
    );
    refused(
        cluster_shape(runtime, &lin(16, 64).with_cluster([0, 1, 1]), &h100),
        "cluster.x = 0",
    );
    refused(
        cluster_shape(
            runtime,
            &lin(4, 64).with_cluster([2, 1, 1]),
            &Limits::for_sm(80),
        ),
        "sm_90",
    );
    refused(
        cluster_shape(fixed, &lin(8, 32), &Limits::for_sm(89)),
        "sm_90",
    );
    let mut explicit = runtime.clone();
    explicit.explicit_cluster = true;
    refused(
        cluster_shape(&explicit, &lin(4, 64), &h100),
        ".explicitcluster",
    );
    // A cluster's blocks must all be resident at once: each one must fit an SM.
    let too_big = lin(8, 32)
        .with_cluster([2, 1, 1])
        .with_shared_bytes(240 << 10);
    assert!(matches!(
        queue_validate(runtime, &too_big, &h100),
        Err(Error::InvalidLaunch { .. })
    ));
}

#[test]
fn cluster_launches_reach_the_simulator_as_cluster_qmds() {
    let (gpu, sim) = Simulator::open(SimConfig::default()).unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let m = Module::load(&gpu, CLUSTER).unwrap();
    let fixed = m.kernel("cluster_fixed").unwrap();
    let runtime = m.kernel("cluster_runtime").unwrap();
    let out = Memory::alloc(&gpu, MemoryDesc::video(256).with_cpu()).unwrap();
    let args = [Arg::Ptr(out.va())];
    let before = sim.launches().len();
    let cases = [
        (&fixed, LaunchConfig::linear(8, 32), Some([2, 1, 1])),
        (
            &runtime,
            LaunchConfig::linear(12, 64).with_cluster([4, 1, 1]),
            Some([4, 1, 1]),
        ),
        // The same kernel without clusters: cluster.sync() must fall back to bar.sync, one peer.
        (&runtime, LaunchConfig::linear(12, 64), None),
        (
            &runtime,
            LaunchConfig::linear(1, 64)
                .with_cluster([2, 3, 1])
                .with_grid([4, 6, 2]),
            Some([2, 3, 1]),
        ),
    ];
    for (k, cfg, _) in &cases {
        // SAFETY: the model does not execute kernels.
        unsafe { q.launch(k, cfg, &args) }.unwrap();
    }
    // Refused before anything reaches the ring.
    // SAFETY: as above.
    let e = unsafe { q.launch(&fixed, &LaunchConfig::linear(7, 32), &args) }.unwrap_err();
    assert!(matches!(e, Error::InvalidLaunch { .. }), "{e}");
    q.synchronize().unwrap();
    assert!(sim.errors().is_empty(), "{:?}", sim.errors());
    let launches = sim.launches();
    assert_eq!(launches.len() - before, cases.len());
    for ((_, cfg, cluster), l) in cases.iter().zip(&launches[before..]) {
        assert_eq!(l.grid, cfg.grid, "the grid in blocks");
        assert_eq!(l.cluster, *cluster);
        let c = cluster.unwrap_or([1, 1, 1]);
        let w = |byte: usize| l.driver_words[byte / 4];
        assert_eq!(w(0x140), u32::from(cluster.is_some()), "cluster flag");
        assert_eq!([w(0x144), w(0x148), w(0x14c)], c, "cluster shape");
        assert_eq!(
            [w(0x15c), w(0x160), w(0x164)],
            [0, 1, 2].map(|i| cfg.grid[i] / c[i]),
            "grid in clusters"
        );
        assert_eq!(w(0x188), c.iter().product::<u32>(), "blocks per cluster");
        assert_eq!([w(0xc), w(0x10), w(0x14)], cfg.grid, "gridDim in blocks");
    }
}

#[test]
fn module_globals_have_their_image_addresses() {
    let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
    let m = Module::load(&gpu, MODULE_DATA).unwrap();
    let image = m.image_bytes().unwrap();
    let table = m.global("table").unwrap();
    assert!(table.constant);
    assert_eq!(table.size, 16);
    let off = (table.va - m.base_va()) as usize;
    let ints: Vec<i32> = image[off..off + 16]
        .chunks_exact(4)
        .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
        .collect();
    assert_eq!(ints, [11, 22, 33, 44]);
    let dev = m.global("dev_value").unwrap();
    assert!(!dev.constant);
    assert_eq!(
        dev.va,
        m.base_va() + m.cubin().global("dev_value").unwrap().image_offset
    );
    // The constant bank launches bind is the variable's memory.
    let k = m.kernel("combo").unwrap();
    let bank3 = k.info().const_bank(3).unwrap().image_offset.unwrap();
    assert_eq!(m.base_va() + bank3, table.va);
    match m.global("missing") {
        Err(e @ apex::module::Error::NoSuchGlobal { .. }) => {
            let s = e.to_string();
            assert!(
                s.contains("missing") && s.contains("dev_value") && s.contains("table"),
                "{s}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(table.check_range(8, 8).is_ok());
    assert!(matches!(
        table.check_range(12, 8),
        Err(apex::module::Error::GlobalRange { .. })
    ));
    assert!(table.check_range(u64::MAX, 2).is_err());
}
