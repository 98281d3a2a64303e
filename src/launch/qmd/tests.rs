use super::*;
use crate::hw::qmd::{v04, v05};

fn add_kernel() -> QmdParams {
    include!("../../../tests/fixtures/qmd_b_add_params.rs")
}

#[test]
fn stream_gates_and_gated_producers_carry_libcudas_fields() {
    // apex-trace of probes/pdl_stream.cu (H100, 580.159.04): every stream launch counts its slot's gate down
    // at pre-exit and arrives at a latch; the gate is a null grid counted down twice that schedules the next
    // slot's launch and re-arms itself.
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q);
    let mut producer = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut producer).unwrap();
    let mut gate = producer;
    assert!(set_gated_producer(QmdVersion::V04, &mut producer, 0x2_0000_0400, 0x80_0007).unwrap());
    assert_eq!(get(&producer, v04::ENABLE_PROGRAM_PRE_EXIT), Some(1));
    assert_eq!(get(&producer, v04::ARRIVE_AT_LATCH_VALID), Some(1));
    assert_eq!(get(&producer, v04::ARRIVE_AT_LATCH_ID), Some(0x80_0007));
    assert_eq!(get(&producer, v04::DEPENDENT_QMD_ENABLE(0)), Some(1));
    assert_eq!(
        get(&producer, v04::DEPENDENT_QMD_ACTION(0)),
        Some(u64::from(
            v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE
        ))
    );
    assert_eq!(get(&producer, v04::DEPENDENT_QMD_PREFETCH(0)), Some(1));
    assert_eq!(
        get(&producer, v04::DEPENDENT_QMD0_POINTER),
        Some(0x2_0000_0400 >> 8)
    );
    // Its completion release stays.
    assert_eq!(get(&producer, v04::RELEASE_ENABLE(0)), Some(1));

    assert!(set_gate(QmdVersion::V04, &mut gate, 0x2_0000_8a00).unwrap());
    for f in [v04::GRID_WIDTH, v04::GRID_HEIGHT, v04::GRID_DEPTH] {
        assert_eq!(get(&gate, f), Some(0), "a null grid");
    }
    assert_eq!(get(&gate, v04::DEPENDENCE_COUNTER), Some(2));
    assert_eq!(get(&gate, v04::SELF_COPY_ON_COMPLETION), Some(1));
    assert_eq!(get(&gate, v04::REQUIRE_SCHEDULING_PCAS), Some(0));
    assert_eq!(
        get(&gate, v04::DEPENDENT_QMD_ACTION(0)),
        Some(u64::from(v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE))
    );
    assert_eq!(
        get(&gate, v04::DEPENDENT_QMD0_POINTER),
        Some(0x2_0000_8a00 >> 8)
    );
    assert_eq!(
        get(&gate, v04::RELEASE_ENABLE(0)),
        Some(0),
        "a gate releases nothing"
    );
    assert_eq!(get(&gate, v04::ENABLE_PROGRAM_PRE_EXIT), Some(0));

    // A programmatic graph consumer fetches its own bank 0 before it starts (libcuda's programmatic nodes).
    let mut consumer = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut consumer).unwrap();
    assert!(prefetch_own_bank0(QmdVersion::V04, &mut consumer).unwrap());
    assert_eq!(
        get(&consumer, v04::CONSTANT_BUFFER_PREFETCH(0)),
        Some(u64::from(v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE))
    );
}

#[test]
fn programmatic_edges_carry_the_latch_fields_libcuda_sets() {
    let mut producer = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut producer).unwrap();
    let mut consumer = producer;
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q);
    // The producer and consumer of a programmatic graph edge (apex-trace of probes/pdl.cu, H100).
    assert!(set_latch_arrive(QmdVersion::V04, &mut producer, 0x40).unwrap());
    assert_eq!(get(&producer, v04::ARRIVE_AT_LATCH_VALID), Some(1));
    assert_eq!(get(&producer, v04::ARRIVE_AT_LATCH_ID), Some(0x40));
    assert_eq!(get(&producer, v04::ENABLE_PROGRAM_PRE_EXIT), Some(1));
    assert!(set_latch_wait(QmdVersion::V04, &mut consumer, 0x40).unwrap());
    assert_eq!(get(&consumer, v04::WAIT_ON_LATCH_VALID), Some(1));
    assert_eq!(get(&consumer, v04::WAIT_ON_LATCH_ID), Some(0x40));
    assert_eq!(get(&consumer, v04::REQUIRE_SCHEDULING_PCAS), Some(1));
    assert_eq!(
        get(&consumer, v04::LATCH_ACQUIRE_INVALIDATE_SHADER_DATA_CACHE),
        Some(1)
    );
    assert_eq!(get(&consumer, v04::ARRIVE_AT_LATCH_VALID), Some(0));
    assert!(!set_latch_wait(QmdVersion::V03, &mut consumer, 1).unwrap());
}

#[test]
fn release_payload_word_is_where_patch_launch_writes_the_payload() {
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut q).unwrap();
    let before = q;
    let payload = 0x1234_5678_9abc_def0u64;
    patch_launch(QmdVersion::V04, &mut q, 0, Some(payload)).unwrap();
    let w = release_payload_word(QmdVersion::V04).unwrap();
    assert_eq!(q[w], payload as u32);
    assert_eq!(q[w + 1], (payload >> 32) as u32);
    // Only those two words (and constant bank 0's address, patched to 0 here) changed.
    let cb = [
        v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(0).lo / 32,
        v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(0).lo / 32,
    ];
    for i in 0..QMD_WORDS {
        if i != w && i != w + 1 && !cb.contains(&(i as u32)) {
            assert_eq!(q[i], before[i], "word {i}");
        }
    }
    assert_eq!(release_payload_word(QmdVersion::V03), None);
}

#[test]
fn bank0_prefetch_is_bank5_at_bank0_and_moves_with_it() {
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut q).unwrap();
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q).unwrap();
    let bank = |q: &[u32; QMD_WORDS], i: u32| {
        (
            get(q, v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i)),
            get(q, v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i)),
            get(q, v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i)),
        )
    };
    assert!(prefetch_bank0(QmdVersion::V04, &mut q).unwrap());
    assert_eq!(get(&q, v04::CONSTANT_BUFFER_VALID(5)), 1);
    assert_eq!(
        get(&q, v04::CONSTANT_BUFFER_PREFETCH(5)),
        u64::from(v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE)
    );
    assert_eq!(bank(&q, 5), bank(&q, 0));
    // A launch in another slot moves both.
    patch_launch(QmdVersion::V04, &mut q, 0x7f00_1234_0040, Some(9)).unwrap();
    assert_eq!(bank(&q, 0).0, (0x7f00_1234_0040u64 >> 6) & 0xffff_ffff);
    assert_eq!(bank(&q, 5), bank(&q, 0));
    // A kernel that binds bank 5 itself keeps it, and patching leaves it where it is.
    let mut p = add_kernel();
    p.const_buffers[5] = Some(ConstBuffer {
        va: 0x7f00_0000_1000,
        size: 256,
    });
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut q).unwrap();
    let own = bank(&q, 5);
    prefetch_bank0(QmdVersion::V04, &mut q).unwrap();
    patch_launch(QmdVersion::V04, &mut q, 0x7f00_1234_0040, None).unwrap();
    assert_eq!(bank(&q, 5), own);
    assert_eq!(get(&q, v04::CONSTANT_BUFFER_PREFETCH(5)), 0);
    assert!(!prefetch_bank0(QmdVersion::V03, &mut q).unwrap());
}

#[test]
fn the_next_links_bank_is_prefetched_as_bank6_after_the_grid() {
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut q).unwrap();
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q).unwrap();
    let next = ConstBuffer {
        va: 0x7f00_5555_0200,
        size: 0x230,
    };
    assert!(prefetch_next_bank(QmdVersion::V04, &mut q, next).unwrap());
    assert_eq!(get(&q, v04::CONSTANT_BUFFER_VALID(6)), 1);
    assert_eq!(
        get(&q, v04::CONSTANT_BUFFER_PREFETCH(6)),
        u64::from(v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_POST)
    );
    assert_eq!(
        get(&q, v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(6)),
        (next.va >> 6) & 0xffff_ffff
    );
    assert_eq!(get(&q, v04::CONSTANT_BUFFER_SIZE_SHIFTED4(6)), 0x23);
    // A kernel's own bank 6 stays.
    let mut p = add_kernel();
    p.const_buffers[6] = Some(ConstBuffer {
        va: 0x7f00_0000_1000,
        size: 256,
    });
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut q).unwrap();
    let before = q;
    prefetch_next_bank(QmdVersion::V04, &mut q, next).unwrap();
    assert_eq!(q, before);
}

#[test]
fn chain_links_carry_the_fields_libcuda_graphs_set() {
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &add_kernel(), &mut q).unwrap();
    let built = q;
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q);
    // A graph node of a 4-kernel chain captured with apex-trace on the H100 (driver 580.159.04).
    let next = (0x2_04c0_0600, ChainAction::Schedule);
    assert!(set_chain_link(QmdVersion::V04, &mut q, Some(next)).unwrap());
    assert_eq!(get(&q, v04::DEPENDENT_QMD_ENABLE(0)), Some(1));
    assert_eq!(get(&q, v04::DEPENDENT_QMD_ACTION(0)), Some(1));
    assert_eq!(get(&q, v04::DEPENDENT_QMD_PREFETCH(0)), Some(1));
    assert_eq!(get(&q, v04::DEPENDENT_QMD0_POINTER), Some(0x204_c006));
    assert_eq!(get(&q, v04::CWD_MEMBAR_TYPE), Some(3));
    assert_eq!(get(&q, v04::CWD_MEMBAR_TASK_CHASING_ENABLE), Some(1));
    assert_eq!(get(&q, v04::RELEASE_ENABLE(0)), Some(0));
    // No pre-exit on a link: the next grid waits for this one's writes.
    assert_eq!(get(&q, v04::ENABLE_PROGRAM_PRE_EXIT), Some(0));
    let next = (0x2_04c0_0600, ChainAction::InvalidateCopySchedule);
    set_chain_link(QmdVersion::V04, &mut q, Some(next)).unwrap();
    assert_eq!(get(&q, v04::DEPENDENT_QMD_ACTION(0)), Some(3));
    // The chain's end is the QMD as built: release on, sysmembar, no dependent.
    set_chain_link(QmdVersion::V04, &mut q, None).unwrap();
    assert_eq!(q, built);
    assert!(!set_chain_link(QmdVersion::V03, &mut q, None).unwrap());
}

#[test]
fn sm_config_encoding_matches_libcuda() {
    assert_eq!(sm_config(228), 0x3a);
    assert_eq!(sm_config(32), 9);
    assert_eq!(sm_configs(90, 0x400), (sm_config(8), 9, 0x3a));
    assert_eq!(sm_configs(90, 0x19400).2, 0x3a);
    assert_eq!(
        sm_configs(89, 0x400).2,
        0x1a,
        "Ada's largest carveout is 100 KiB (tinygrad's 0x1a)"
    );
}

#[test]
fn v04_sizes_and_versions() {
    assert_eq!(QmdVersion::V04.size_bytes(), 384);
    assert_eq!(QmdVersion::V03.size_bytes(), 256);
    assert_eq!(QmdVersion::for_compute_class(0xcbc0), Some(QmdVersion::V04));
    assert_eq!(QmdVersion::for_compute_class(0xc9c0), Some(QmdVersion::V03));
    assert_eq!(QmdVersion::for_compute_class(0xcec0), Some(QmdVersion::V05));
    assert_eq!(QmdVersion::for_compute_class(0x1234), None);
}

#[test]
fn oversized_values_name_the_field() {
    let mut p = add_kernel();
    p.block[2] = 1 << 20;
    let mut q = [0u32; QMD_WORDS];
    let e = build(QmdVersion::V04, &p, &mut q).unwrap_err();
    assert_eq!(e.field, "CTA_THREAD_DIMENSION2");
}

#[test]
fn templates_patch_like_a_fresh_build() {
    let mut p = add_kernel();
    let mut fresh = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut fresh).unwrap();
    let mut t = [0u32; QMD_WORDS];
    let mut other = p;
    other.const_buffers[0] = Some(ConstBuffer {
        va: 0x1_0000_0040,
        size: 0x300,
    });
    other.release = Some((0x2_0463_7f24, 99));
    build(QmdVersion::V04, &other, &mut t).unwrap();
    assert!(patch_launch(QmdVersion::V04, &mut t, 0x7fee_ae2b_0000, Some(6)).unwrap());
    assert_eq!(t, fresh);
    p.release = Some((0x2_0463_7f24, 1 << 40));
    build(QmdVersion::V04, &p, &mut fresh).unwrap();
    assert!(patch_launch(QmdVersion::V04, &mut t, 0x7fee_ae2b_0000, Some(1 << 40)).unwrap());
    assert_eq!(t, fresh);
}

#[test]
fn sync_domain_and_cluster_policy_match_libcuda() {
    // apex-trace of probes/launch_attrs.cu on an H100 (driver 580.159.04): the "remote" memory sync domain
    // through the default map is SYNC_DOMAIN_ID 1, the only field that differs from the plain launch; the
    // default domain leaves it 0.
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q).unwrap();
    let mut p = add_kernel();
    let mut plain = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut plain).unwrap();
    assert_eq!(get(&plain, v04::SYNC_DOMAIN_ID), 0);
    p.sync_domain = 1;
    let mut remote = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut remote).unwrap();
    assert_eq!(get(&remote, v04::SYNC_DOMAIN_ID), 1);
    let differing: Vec<usize> = (0..QMD_WORDS).filter(|&i| plain[i] != remote[i]).collect();
    assert_eq!(differing, [1148 / 32], "only the domain's word differs");
    let mut q5 = [0u32; QMD_WORDS];
    build(QmdVersion::V05, &p, &mut q5).unwrap();
    assert_eq!(get(&q5, v05::SYNC_DOMAIN_ID), 1);
    // Two bits: domain 4 does not exist; GPUs before Hopper have no domains.
    p.sync_domain = 4;
    assert!(build(QmdVersion::V04, &p, &mut q5).is_err());
    p.sync_domain = 1;
    assert!(build(QmdVersion::V03, &p, &mut q5).is_err());
    // Clusters: multicast by default (and for "spread"), load balancing when asked.
    p.sync_domain = 0;
    p.grid = [8, 1, 1];
    p.cluster = Some([2, 1, 1]);
    let mut c = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut c).unwrap();
    assert_eq!(
        get(&c, v04::CGA_CTA_DISTRIBUTION_MODE),
        u64::from(v04::CGA_CTA_DISTRIBUTION_MODE_MULTI_CAST)
    );
    p.cluster_load_balancing = true;
    build(QmdVersion::V04, &p, &mut c).unwrap();
    assert_eq!(
        get(&c, v04::CGA_CTA_DISTRIBUTION_MODE),
        u64::from(v04::CGA_CTA_DISTRIBUTION_MODE_LOAD_BALANCING)
    );
}

#[test]
fn cluster_fields_match_libcuda() {
    // apex-trace of probes/cluster_launch.cu on an H100 (driver 580): cluster_fixed<<<8, 32>>> with
    // __cluster_dims__(2, 1, 1), cluster_runtime<<<12, 64>>> with a run-time cluster of 4.
    let get = |q: &[u32; QMD_WORDS], f: Field| f.get(q).unwrap();
    for (grid, cluster, width) in [(8, 2, 4), (12, 4, 3)] {
        let mut p = add_kernel();
        p.grid = [grid, 1, 1];
        p.cluster = Some([cluster, 1, 1]);
        let mut q = [0u32; QMD_WORDS];
        build(QmdVersion::V04, &p, &mut q).unwrap();
        assert_eq!(get(&q, v04::QMD_TYPE), 3, "GRID_GPC_CGA");
        assert_eq!(get(&q, v04::GRID_WIDTH), width, "the grid in clusters");
        assert_eq!(get(&q, v04::GRID_HEIGHT), 1);
        assert_eq!(get(&q, v04::GRID_DEPTH), 1);
        assert_eq!(get(&q, v04::GPC_CGA_WIDTH), u64::from(cluster));
        assert_eq!(get(&q, v04::GPC_CGA_HEIGHT), 1);
        assert_eq!(get(&q, v04::GPC_CGA_DEPTH), 1);
        assert_eq!(get(&q, v04::CGA_CTA_DISTRIBUTION_MODE), 1, "MULTI_CAST");
        assert_eq!(get(&q, v04::GPU_CGA_WIDTH), 0);
        // The rest is the plain launch's QMD.
        let mut plain = [0u32; QMD_WORDS];
        p.cluster = None;
        build(QmdVersion::V04, &p, &mut plain).unwrap();
        for f in [
            v04::QMD_TYPE,
            v04::GRID_WIDTH,
            v04::GPC_CGA_WIDTH,
            v04::GPC_CGA_HEIGHT,
            v04::GPC_CGA_DEPTH,
            v04::CGA_CTA_DISTRIBUTION_MODE,
        ] {
            f.set(&mut q, f.get(&plain).unwrap()).unwrap();
        }
        assert_eq!(q, plain);
        assert_eq!(get(&plain, v04::QMD_TYPE), 2, "GRID_CTA");
        assert_eq!(get(&plain, v04::GRID_WIDTH), u64::from(grid));

        let mut p5 = add_kernel();
        p5.grid = [grid, 1, 1];
        p5.cluster = Some([cluster, 1, 1]);
        build(QmdVersion::V05, &p5, &mut q).unwrap();
        assert_eq!(get(&q, v05::QMD_TYPE), 3);
        assert_eq!(get(&q, v05::GRID_WIDTH), width);
        assert_eq!(get(&q, v05::GPC_CGA_WIDTH), u64::from(cluster));
        assert_eq!(get(&q, v05::CGA_CTA_DISTRIBUTION_MODE), 1);
    }
    // 3-D: grid (4, 6, 2) in clusters of (2, 3, 1).
    let mut p = add_kernel();
    p.grid = [4, 6, 2];
    p.cluster = Some([2, 3, 1]);
    let mut q = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &p, &mut q).unwrap();
    assert_eq!(
        [v04::GRID_WIDTH, v04::GRID_HEIGHT, v04::GRID_DEPTH].map(|f| get(&q, f)),
        [2, 2, 2]
    );
    assert_eq!(
        [v04::GPC_CGA_WIDTH, v04::GPC_CGA_HEIGHT, v04::GPC_CGA_DEPTH].map(|f| get(&q, f)),
        [2, 3, 1]
    );
    // A grid that is not a multiple of the shape, a zero axis, a V03 QMD: refused.
    p.grid = [5, 6, 2];
    assert_eq!(
        build(QmdVersion::V04, &p, &mut q).unwrap_err().field,
        "GPC_CGA_WIDTH"
    );
    p.grid = [4, 6, 2];
    p.cluster = Some([2, 0, 1]);
    assert_eq!(
        build(QmdVersion::V04, &p, &mut q).unwrap_err().field,
        "GPC_CGA_HEIGHT"
    );
    p.cluster = Some([2, 3, 1]);
    assert!(build(QmdVersion::V03, &p, &mut q).is_err());
    // GPC_CGA_WIDTH has 6 bits.
    p.grid = [64, 1, 1];
    p.cluster = Some([64, 1, 1]);
    assert_eq!(
        build(QmdVersion::V04, &p, &mut q).unwrap_err().field,
        "GPC_CGA_WIDTH"
    );
}

#[test]
fn every_version_builds() {
    let mut q = [0u32; QMD_WORDS];
    for v in [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05] {
        build(v, &add_kernel(), &mut q).unwrap();
        assert!(
            q[v.size_bytes() / 4..].iter().all(|&w| w == 0),
            "{v:?} writes past its size"
        );
    }
}

#[test]
fn an_sm_version_without_a_generation_row_is_refused() {
    let mut p = add_kernel();
    p.sm_version = 75;
    let mut q = [0u32; QMD_WORDS];
    let e = build(QmdVersion::V04, &p, &mut q).unwrap_err();
    assert_eq!(e.value, 75);
    assert!(shared_carveouts_kib(75).is_empty());
    // Blackwell GB20x gets its own (Ada-sized) carveouts, not Hopper's.
    assert_eq!(shared_carveouts_kib(120).last(), Some(&100));
}
