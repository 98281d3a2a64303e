//! The QMD APEX builds for a known launch against the one libcuda built for the same launch on the H200
//! (`add<<<2,32>>>`, research/hopper-launch.md §5), field by field wherever the fields mean the same thing.

use apex::launch::qmd::{ConstBuffer, QMD_WORDS, QmdParams, QmdVersion, build, prefetch_bank0};
use apex::pushbuf::decode::decode_qmd;

/// QMD B as libcuda uploaded it (comment lines start with #).
const LIBCUDA_QMD: &str = include_str!("fixtures/qmd_b_add.txt");

/// Fields where APEX differs on purpose, and why.
const DIFFERENT_BY_DESIGN: &[(&str, &str)] = &[
    (
        "RELEASE_STRUCTURE_SIZE(0)",
        "libcuda releases a 32-bit flag; APEX a 64-bit timeline value plus timestamp",
    ),
    ("RELEASE_PAYLOAD64B(0)", "the 64-bit timeline payload"),
    (
        "MIN_SM_CONFIG_SHARED_MEM_SIZE",
        "APEX asks for the smallest carveout that holds the block",
    ),
    (
        "ARRIVE_AT_LATCH_VALID",
        "libcuda's latch chain (graph support), not needed for a launch",
    ),
    ("ARRIVE_AT_LATCH_ID", "as above"),
    (
        "DEPENDENT_QMD_ENABLE(0)",
        "libcuda's null-QMD dependency chain",
    ),
    ("DEPENDENT_QMD_ACTION(0)", "as above"),
    ("DEPENDENT_QMD_PREFETCH(0)", "as above"),
    ("DEPENDENT_QMD0_POINTER", "as above"),
];

/// libcuda also binds its driver banks 1 and 7; APEX binds bank 0 (and the module's own banks), and bank 0 again as
/// bank 5 to be prefetched, as libcuda does.
fn libcuda_only_bank(name: &str) -> bool {
    ["(1)", "(7)"]
        .iter()
        .any(|b| name.starts_with("CONSTANT_BUFFER_") && name.ends_with(b))
}

#[test]
fn apex_qmd_matches_libcudas_field_by_field() {
    let mut words: Vec<u32> = LIBCUDA_QMD
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(str::split_whitespace)
        .map(|w| u32::from_str_radix(w, 16).unwrap())
        .collect();
    words.resize(QMD_WORDS, 0);
    let theirs: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();

    let params: QmdParams = include!("fixtures/qmd_b_add_params.rs");
    let mut ours = [0u32; QMD_WORDS];
    build(QmdVersion::V04, &params, &mut ours).unwrap();
    // What a stream-order launch adds to the built QMD.
    prefetch_bank0(QmdVersion::V04, &mut ours).unwrap();
    let ours: Vec<u8> = ours.iter().flat_map(|w| w.to_le_bytes()).collect();

    let a = decode_qmd(4, &theirs).unwrap();
    let b = decode_qmd(4, &ours).unwrap();
    let get = |f: &[(&'static str, u64)], n: &str| f.iter().find(|x| x.0 == n).map(|x| x.1);
    let mut names: Vec<&str> = a.iter().chain(b.iter()).map(|f| f.0).collect();
    names.sort_unstable();
    names.dedup();
    let mut compared = 0;
    for n in names {
        if DIFFERENT_BY_DESIGN.iter().any(|d| d.0 == n) || libcuda_only_bank(n) {
            continue;
        }
        assert_eq!(get(&b, n), get(&a, n), "field {n}: APEX vs libcuda");
        compared += 1;
    }
    // The launch-defining fields are all among them.
    for n in [
        "QMD_TYPE",
        "QMD_MAJOR_VERSION",
        "GRID_WIDTH",
        "CTA_THREAD_DIMENSION0",
        "REGISTER_COUNT",
        "SHARED_MEMORY_SIZE",
        "PROGRAM_ADDRESS_LOWER",
        "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(0)",
        "CONSTANT_BUFFER_SIZE_SHIFTED4(0)",
        "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(5)",
        "CONSTANT_BUFFER_PREFETCH(5)",
        "SHADER_LOCAL_MEMORY_HIGH_SIZE",
        "RELEASE_SEMAPHORE0_ADDR_LOWER",
        "RELEASE_SEMAPHORE0_PAYLOAD_LOWER",
        "MAX_SM_CONFIG_SHARED_MEM_SIZE",
        "TARGET_SM_CONFIG_SHARED_MEM_SIZE",
    ] {
        assert!(get(&a, n).is_some(), "{n} is set by libcuda");
    }
    assert!(compared >= 25, "compared {compared} fields");
}
