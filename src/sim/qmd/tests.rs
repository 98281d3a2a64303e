use super::*;
use crate::launch::cbank::{
    CLUSTER_WORDS_START, param_block_words, write_cluster_words, write_driver_words,
};
use crate::launch::qmd::{ConstBuffer, QMD_WORDS, QmdParams, QmdVersion, build};

const CB: u64 = 0x10_0000;
const PROGRAM: u64 = 0x20_0000;
const SEM: u64 = 0x30_0000;

fn params() -> QmdParams {
    let mut cbs = [None; 8];
    cbs[0] = Some(ConstBuffer {
        va: CB,
        size: 0x300,
    });
    QmdParams {
        sm_version: 90,
        program_va: PROGRAM,
        program_bytes: 0x200,
        registers: 16,
        barriers: 1,
        grid: [2, 1, 1],
        block: [32, 1, 1],
        shared_bytes: 0x400,
        local_bytes_per_thread: 0,
        const_buffers: cbs,
        release: Some((SEM, 6)),
        cluster: None,
        sync_domain: 0,
        cluster_load_balancing: false,
    }
}

fn qmd(p: &QmdParams, v: QmdVersion) -> [u32; QMD_WORDS] {
    let mut q = [0u32; QMD_WORDS];
    build(v, p, &mut q).unwrap();
    q
}

#[test]
fn the_builders_qmd_passes() {
    let d = check_fields(&qmd(&params(), QmdVersion::V04), 90).unwrap();
    assert_eq!(
        (d.grid, d.block, d.shared_bytes),
        ([2, 1, 1], [32, 1, 1], 0x400)
    );
    assert_eq!(d.const_banks[0], Some((CB, 0x300)));
    assert_eq!(
        d.releases,
        vec![ReleaseDesc {
            va: SEM,
            payload: 6,
            kind: ReleaseKind::FourWords { payload64: true }
        }]
    );
    assert_eq!(major_version(&qmd(&params(), QmdVersion::V03)), 3);
}

#[test]
fn field_violations_are_named() {
    let mut q = qmd(&params(), QmdVersion::V04);
    v04::GRID_WIDTH.set(&mut q, 0).unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::Grid { axis: "x", .. })
    ));

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::CTA_THREAD_DIMENSION2.set(&mut q, 65).unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::Block { axis: "z", .. })
    ));

    let mut p = params();
    p.block = [32, 32, 2];
    assert_eq!(
        check_fields(&qmd(&p, QmdVersion::V04), 90),
        Err(QmdViolation::Threads(2048))
    );

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::QMD_TYPE.set(&mut q, 1).unwrap();
    assert_eq!(check_fields(&q, 90), Err(QmdViolation::Type(1)));

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::SHARED_MEMORY_SIZE.set(&mut q, 229 * 1024).unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::SharedMemory { .. })
    ));

    // Shared memory larger than the minimum carveout the QMD allows.
    let mut q = qmd(&params(), QmdVersion::V04);
    v04::SHARED_MEMORY_SIZE.set(&mut q, 64 * 1024).unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::SmConfig { .. })
    ));

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::CONSTANT_BUFFER_VALID(0).set(&mut q, 0).unwrap();
    assert_eq!(check_fields(&q, 90), Err(QmdViolation::NoConstantBank0));

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::CONSTANT_BUFFER_SIZE_SHIFTED4(0)
        .set(&mut q, 0x10)
        .unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::ConstantBank { bank: 0, .. })
    ));

    let mut q = qmd(&params(), QmdVersion::V04);
    v04::REGISTER_COUNT.set(&mut q, 0).unwrap();
    assert!(matches!(
        check_fields(&q, 90),
        Err(QmdViolation::Registers { .. })
    ));

    let mut p = params();
    p.release = Some((SEM + 8, 1));
    assert!(matches!(
        check_fields(&qmd(&p, QmdVersion::V04), 90),
        Err(QmdViolation::Release { index: 0, .. })
    ));
    assert_eq!(
        check_fields(&qmd(&params(), QmdVersion::V03), 90),
        Err(QmdViolation::Version(3))
    );
    assert!(check_address(0x1_0000_0100).is_ok());
    assert!(check_address(0x1_0000_0180).is_err());
    assert!(check_address(1 << 40).is_err());
}

#[test]
fn cluster_qmds_are_checked() {
    // cluster_fixed<<<8, 32>>> in clusters of 2, as libcuda sent it: GRID_WIDTH counts clusters.
    let mut p = params();
    p.grid = [8, 1, 1];
    p.cluster = Some([2, 1, 1]);
    let q = qmd(&p, QmdVersion::V04);
    let d = check_fields(&q, 90).unwrap();
    assert_eq!((d.grid, d.cluster), ([8, 1, 1], Some([2, 1, 1])));
    assert_eq!(
        check_fields(&qmd(&params(), QmdVersion::V04), 90)
            .unwrap()
            .cluster,
        None
    );

    // 17 blocks is more than Hopper runs.
    let mut bad = q;
    v04::GPC_CGA_WIDTH.set(&mut bad, 17).unwrap();
    assert!(matches!(
        check_fields(&bad, 90),
        Err(QmdViolation::Cluster(_))
    ));
    // A cluster shape on a plain grid, a GPU-wide CGA: not what APEX sends.
    let mut bad = qmd(&params(), QmdVersion::V04);
    v04::GPC_CGA_WIDTH.set(&mut bad, 2).unwrap();
    assert!(matches!(
        check_fields(&bad, 90),
        Err(QmdViolation::Cluster(_))
    ));
    let mut bad = q;
    v04::GPU_CGA_WIDTH.set(&mut bad, 2).unwrap();
    assert!(matches!(
        check_fields(&bad, 90),
        Err(QmdViolation::Cluster(_))
    ));
    let mut bad = q;
    v04::QMD_TYPE.set(&mut bad, 4).unwrap();
    assert!(matches!(check_fields(&bad, 90), Err(QmdViolation::Type(4))));

    // The cbank0 cluster words must describe the same launch.
    let st = LaunchState {
        shared_window: 0x7000_0000_0000,
        local_window: 0x7100_0000_0000,
        ..LaunchState::default()
    };
    let mut cb0 = vec![0u32; 132];
    write_driver_words(
        &mut cb0,
        [32, 1, 1],
        [8, 1, 1],
        st.shared_window,
        st.local_window,
    );
    let window = CLUSTER_WORDS_START / 4;
    write_cluster_words(&mut cb0[window..], [8, 1, 1], Some([2, 1, 1]));
    write_param_block(&mut cb0, 0x18);
    let mut mem = Fake {
        ranges: vec![(CB, 0x1000), (PROGRAM, 0x1000), (SEM, 0x1000)],
        cb0,
    };
    assert_eq!(check_environment(&d, &st, &mem), Ok(()));
    mem.cb0[0x188 / 4] = 1;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x188,
            ..
        }))
    ));
    // %clusterid is %ctaid scaled by the reciprocal of the cluster shape: without it every block is in cluster 0.
    mem.cb0[0x188 / 4] = 2;
    mem.cb0[0x150 / 4] = 0;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x150,
            ..
        }))
    ));
    mem.cb0[0x150 / 4] = 0.5f32.to_bits();
    // Without the flag, cluster.sync() in a kernel without __cluster_dims__ would be a plain bar.sync.
    mem.cb0[0x188 / 4] = 2;
    mem.cb0[0x140 / 4] = 0;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x140,
            ..
        }))
    ));
    // A plain launch must not carry the flag.
    let plain = check_fields(&qmd(&params(), QmdVersion::V04), 90).unwrap();
    write_driver_words(
        &mut mem.cb0,
        [32, 1, 1],
        [2, 1, 1],
        st.shared_window,
        st.local_window,
    );
    write_cluster_words(&mut mem.cb0[window..], [2, 1, 1], None);
    assert_eq!(check_environment(&plain, &st, &mem), Ok(()));
    mem.cb0[0x140 / 4] = 1;
    assert!(matches!(
        check_environment(&plain, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x140,
            ..
        }))
    ));
}

/// Writes the parameter block's address range for a kernel of `params` bytes of parameters in the bank at `CB`.
fn write_param_block(cb0: &mut [u32], params: u32) {
    let at = crate::launch::cbank::PARAM_BLOCK_START / 4;
    cb0[at..at + 4].copy_from_slice(&param_block_words(CB, params));
}

struct Fake {
    ranges: Vec<(u64, u64)>,
    cb0: Vec<u32>,
}

impl GpuMemory for Fake {
    fn contains(&self, va: u64, len: u64) -> bool {
        self.ranges
            .iter()
            .any(|&(b, s)| va >= b && va + len <= b + s)
    }
    fn read_words(&self, va: u64, n: usize) -> Option<Vec<u32>> {
        (va == CB).then(|| self.cb0[..n].to_vec())
    }
}

#[test]
fn environment_checks_addresses_and_cbank0() {
    let d = check_fields(&qmd(&params(), QmdVersion::V04), 90).unwrap();
    let st = LaunchState {
        shared_window: 0x7000_0000_0000,
        local_window: 0x7100_0000_0000,
        ..LaunchState::default()
    };
    let mut cb0 = vec![0u32; 132];
    write_driver_words(
        &mut cb0,
        [32, 1, 1],
        [2, 1, 1],
        st.shared_window,
        st.local_window,
    );
    write_cluster_words(&mut cb0[CLUSTER_WORDS_START / 4..], [2, 1, 1], None);
    write_param_block(&mut cb0, 0x20);
    let mut mem = Fake {
        ranges: vec![(CB, 0x1000), (PROGRAM, 0x1000), (SEM, 0x1000)],
        cb0,
    };
    assert_eq!(check_environment(&d, &st, &mem), Ok(()));

    // Code that takes a grid constant's address reads the parameter block's from c[0x0][0x198].
    let at = crate::launch::cbank::PARAM_BLOCK_START / 4;
    mem.cb0[at] = 0;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x198,
            ..
        }))
    ));
    write_param_block(&mut mem.cb0, 0x100);
    assert!(
        matches!(
            check_environment(&d, &st, &mem),
            Err(EnvFault::Violation(QmdViolation::Cbank0Word {
                offset: 0x1a0,
                ..
            }))
        ),
        "an end past the 0x300-byte bank"
    );
    write_param_block(&mut mem.cb0, 0x20);

    mem.cb0[3] = 3;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0xc,
            ..
        }))
    ));
    mem.cb0[3] = 2;
    mem.cb0[10] = 0;
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: 0x28,
            ..
        }))
    ));
    mem.cb0[10] = INITIAL_STACK;
    mem.ranges.remove(1);
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Address {
            what: "program",
            ..
        })
    ));
    mem.ranges.push((PROGRAM, 0x1000));

    let mut p = params();
    p.local_bytes_per_thread = 0x640;
    let d = check_fields(&qmd(&p, QmdVersion::V04), 90).unwrap();
    assert!(matches!(
        check_environment(&d, &st, &mem),
        Err(EnvFault::Violation(QmdViolation::LocalMemory(_)))
    ));
    let st = LaunchState {
        local_memory_va: 0x100_0000,
        local_bytes_per_tpc: 0x640 * 4096,
        local_max_sm_count: 2,
        threads_per_tpc: 4096,
        ..st
    };
    mem.ranges.push((0x100_0000, 0x640 * 4096 * 2));
    assert_eq!(check_environment(&d, &st, &mem), Ok(()));
    let small = LaunchState {
        local_bytes_per_tpc: 0x100 * 4096,
        ..st
    };
    assert!(matches!(
        check_environment(&d, &small, &mem),
        Err(EnvFault::Violation(QmdViolation::LocalMemory(_)))
    ));
}

#[test]
fn the_generation_row_decides_what_is_checked() {
    let q = qmd(&params(), QmdVersion::V04);
    assert_eq!(
        check_fields(&q, 75),
        Err(QmdViolation::Generation(UnknownGeneration {
            sm_version: 75
        }))
    );
    assert_eq!(
        check_fields(&q, 100),
        Err(QmdViolation::Layout(QmdVersion::V05))
    );
}
