//! QMD checks as Hopper's compute front end applies them. Split in two: [`check_fields`] looks only at the QMD's
//! own words (pure, unit-tested), [`check_environment`] at what it points to (memory, cbank0, channel state).
//! The limits and shared-memory carveouts a QMD is checked against are the GPU's row of the generation table
//! ([`crate::hw::generation`]); the model reads V04 QMDs only.

use super::headers::qmd_v04 as v04;
use crate::hw::{Generation, QmdVersion, UnknownGeneration};
use crate::launch::cbank::{DRIVER_BYTES, INITIAL_STACK, PARAM_BLOCK_START, PARAM_BLOCK_WORDS};
use crate::launch::qmd::sm_config;

/// Words of a V04 QMD.
pub const QMD_WORDS_V04: usize = v04::SIZE_BYTES / 4;
/// Release semaphores a V04 QMD carries.
const RELEASES: u32 = 3;

/// What a QMD violates.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QmdViolation {
    /// A QMD layout version other than the one the GPU runs.
    #[error("QMD_MAJOR_VERSION {0} (Hopper runs version 4)")]
    Version(u64),
    /// The simulated GPU's SM version has no row in the GPU-generation table.
    #[error(transparent)]
    Generation(#[from] UnknownGeneration),
    /// The simulated GPU's generation runs a QMD layout the model does not read (it reads V04, Hopper's).
    #[error("the GPU runs QMD {0:?}; the simulator models V04 (Hopper) QMDs only")]
    Layout(QmdVersion),
    /// A QMD type that is not a grid launch.
    #[error("QMD_TYPE {0} (only GRID_CTA and GRID_GPC_CGA are launched)")]
    Type(u64),
    /// A thread block cluster (GPC CGA) field out of what Hopper runs.
    #[error("cluster: {0}")]
    Cluster(String),
    /// The QMD's own address, which the front end reaches with 40 bits in 256-byte units.
    #[error("QMD address {0:#x} is not 256-byte aligned below 2^40")]
    Address(u64),
    /// A grid dimension out of range.
    #[error("grid.{axis} = {value} (must be 1..={max})")]
    Grid {
        /// `x`, `y` or `z`.
        axis: &'static str,
        /// Blocks asked for on that axis.
        value: u64,
        /// The most allowed.
        max: u64,
    },
    /// A block dimension out of range.
    #[error("block.{axis} = {value} (must be 1..={max})")]
    Block {
        /// `x`, `y` or `z`.
        axis: &'static str,
        /// Threads asked for on that axis.
        value: u64,
        /// The most allowed.
        max: u64,
    },
    /// More threads per block than an SM runs.
    #[error("{0} threads per block (at most 1024)")]
    Threads(u64),
    /// A register count no thread or no SM can hold.
    #[error("REGISTER_COUNT {registers} for {threads} threads (1..=255 per thread, 65536 per SM)")]
    Registers {
        /// Registers per thread.
        registers: u64,
        /// Threads per block.
        threads: u64,
    },
    /// More named barriers than an SM has.
    #[error("BARRIER_COUNT {0} (at most 16)")]
    Barriers(u64),
    /// More shared memory than a block may have.
    #[error("SHARED_MEMORY_SIZE {bytes} bytes (at most {max})")]
    SharedMemory {
        /// Shared memory asked for, bytes.
        bytes: u64,
        /// The most allowed, bytes.
        max: u64,
    },
    /// A shared-memory carveout field (`MIN_`, `MAX_` or `TARGET_SM_CONFIG_SHARED_MEM_SIZE`) the SM cannot honour.
    #[error("{field} = {value:#x}: {why}")]
    SmConfig {
        /// The QMD field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Code compiled for another SM than the GPU's.
    #[error("SASS_VERSION {found:#x}, the GPU is {expected:#x}")]
    SassVersion {
        /// The version in the QMD.
        found: u64,
        /// The GPU's.
        expected: u64,
    },
    /// Constant bank 0 is not bound.
    #[error("constant bank 0 is not valid (kernels read their parameters from it)")]
    NoConstantBank0,
    /// A constant bank with a bad address or size.
    #[error("constant bank {bank}: {why} (address {va:#x}, {size:#x} bytes)")]
    ConstantBank {
        /// The bank's index.
        bank: u32,
        /// Its GPU address.
        va: u64,
        /// Its size, bytes.
        size: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A release semaphore with a bad address, size or operation.
    #[error("release semaphore {index}: {why}")]
    Release {
        /// Which of the QMD's releases.
        index: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A driver word of constant bank 0 that does not match the channel's state (a window, local memory).
    #[error("cbank0 word at {offset:#x} is {found:#x}, expected {expected:#x} ({what})")]
    Cbank0Word {
        /// Byte offset of the word in the bank.
        offset: u64,
        /// What the bank holds.
        found: u64,
        /// What the channel's state says it must hold.
        expected: u64,
        /// What the word is.
        what: &'static str,
    },
    /// Launch state the model refuses: set-up the launch needs never happened (the shader windows, a QMD for
    /// SEND_SIGNALING_PCAS2_B), or a dependent-QMD form the simulator does not model; the text says which.
    #[error("{0}")]
    State(&'static str),
    /// The local memory the launch needs is missing or too small.
    #[error("local memory: {0}")]
    LocalMemory(String),
}

/// How a release semaphore is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseKind {
    /// Payload (32 or 64 bits) then a 64-bit timestamp at +8.
    FourWords {
        /// Whether the payload is 64 bits (else 32).
        payload64: bool,
    },
    /// A 32-bit payload alone.
    OneWord,
    /// A 32-bit payload added (unsigned, wrapping) to the word there.
    AddOneWord,
    /// A 64-bit payload alone.
    TwoWords,
}

/// One release semaphore a QMD performs when its grid completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseDesc {
    /// GPU address of the semaphore.
    pub va: u64,
    /// The value written.
    pub payload: u64,
    /// How it is written.
    pub kind: ReleaseKind,
}

/// What a well-formed V04 QMD asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QmdDesc {
    /// Blocks per axis (for a cluster launch: the QMD's grid in clusters times the cluster shape).
    pub grid: [u32; 3],
    /// The thread block cluster shape of a GRID_GPC_CGA QMD.
    pub cluster: Option<[u32; 3]>,
    /// Threads per block axis.
    pub block: [u32; 3],
    /// Shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers the kernel uses.
    pub barriers: u32,
    /// GPU address of the kernel's first instruction.
    pub program_va: u64,
    /// Local memory (stack) per thread, bytes.
    pub local_bytes_per_thread: u32,
    /// (address, size) of each valid constant bank.
    pub const_banks: [Option<(u64, u64)>; 8],
    /// The semaphores released when the grid completes, in the QMD's order.
    pub releases: Vec<ReleaseDesc>,
    /// What the compute work distributor does once this grid has completed, in order (DEPENDENT_QMD0, then 1).
    pub dependents: Vec<(u64, DependentKind)>,
    /// DEPENDENCE_COUNTER: the decrements it waits for once armed.
    pub counter: u32,
    /// REQUIRE_SCHEDULING_PCAS: once armed, a PCAS from the host does not schedule it; a predecessor must.
    pub require: bool,
    /// SELF_COPY_ON_COMPLETION: it re-arms itself (counter and requirement) when it completes.
    pub self_copy: bool,
    /// A grid of no blocks: it completes as soon as it is scheduled and only performs its dependent actions.
    pub null: bool,
    /// ARRIVE_AT_LATCH: the latch the grid arrives at when it completes (programmatic dependent launch).
    pub arrive_latch: Option<u32>,
    /// WAIT_ON_LATCH: the latch the grid's `griddepcontrol.wait` waits for.
    pub wait_latch: Option<u32>,
}

impl QmdDesc {
    /// A description with nothing in it: no launch, no dependents, nothing armed.
    pub fn null() -> QmdDesc {
        QmdDesc {
            grid: [0; 3],
            cluster: None,
            block: [0; 3],
            shared_bytes: 0,
            registers: 0,
            barriers: 0,
            program_va: 0,
            local_bytes_per_thread: 0,
            const_banks: [None; 8],
            releases: Vec::new(),
            dependents: Vec::new(),
            counter: 0,
            require: false,
            self_copy: false,
            null: true,
            arrive_latch: None,
            wait_latch: None,
        }
    }
}

/// A dependent QMD action the model performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DependentKind {
    /// QMD_SCHEDULE.
    Schedule,
    /// QMD_INVALIDATE_COPY_SCHEDULE: arm from memory, then schedule.
    CopySchedule,
    /// QMD_DECREMENT_DEPENDENCE.
    Decrement,
}

fn get(words: &[u32], f: crate::hw::Field) -> u64 {
    f.get(words).unwrap_or(0)
}

/// The QMD's major version (same bits in V03, V04 and V05).
pub fn major_version(words: &[u32]) -> u64 {
    get(words, v04::QMD_MAJOR_VERSION)
}

/// A QMD address from SEND_PCAS_A: 256-byte aligned (by construction) and below 2^40.
pub fn check_address(qmd_va: u64) -> Result<(), QmdViolation> {
    if !qmd_va.is_multiple_of(256) || qmd_va >= 1 << 40 {
        return Err(QmdViolation::Address(qmd_va));
    }
    Ok(())
}

/// Checks everything a V04 QMD says about itself against the limits of the GPU's generation. `sm_version` is the
/// GPU's (90).
pub fn check_fields(words: &[u32], sm_version: u32) -> Result<QmdDesc, QmdViolation> {
    let generation = Generation::lookup(sm_version)?;
    if generation.qmd != QmdVersion::V04 {
        return Err(QmdViolation::Layout(generation.qmd));
    }
    let limits = &generation.limits;
    let major = major_version(words);
    if major != u64::from(generation.qmd.major()) {
        return Err(QmdViolation::Version(major));
    }
    let ty = get(words, v04::QMD_TYPE);
    let cluster = check_cluster(words, ty, u64::from(limits.max_cluster_blocks))?;
    let expected_sass = u64::from(generation.sass_version());
    let sass = get(words, v04::SASS_VERSION);
    if sass != expected_sass {
        return Err(QmdViolation::SassVersion {
            found: sass,
            expected: expected_sass,
        });
    }
    let raw_grid = [
        get(words, v04::GRID_WIDTH),
        get(words, v04::GRID_HEIGHT),
        get(words, v04::GRID_DEPTH),
    ];
    if raw_grid == [0; 3] {
        // A null grid (libcuda's fan-out helpers): nothing runs, so nothing about a launch is checked.
        let mut releases = Vec::new();
        for i in 0..RELEASES {
            if get(words, v04::RELEASE_ENABLE(i)) != 0 {
                releases.push(check_release(words, i)?);
            }
        }
        return Ok(QmdDesc {
            releases,
            null: true,
            ..scheduling(words)?
        });
    }
    let axes = ["x", "y", "z"];
    // A cluster launch counts its grid in clusters (libcuda: GRID_WIDTH 4 for 8 blocks in clusters of 2).
    let per = cluster.map_or([1; 3], |c| c.map(u64::from));
    let grid = [
        get(words, v04::GRID_WIDTH) * per[0],
        get(words, v04::GRID_HEIGHT) * per[1],
        get(words, v04::GRID_DEPTH) * per[2],
    ];
    let block = [
        get(words, v04::CTA_THREAD_DIMENSION0),
        get(words, v04::CTA_THREAD_DIMENSION1),
        get(words, v04::CTA_THREAD_DIMENSION2),
    ];
    let max_grid = limits.max_grid.map(u64::from);
    let max_block = limits.max_block.map(u64::from);
    for i in 0..3 {
        if grid[i] == 0 || grid[i] > max_grid[i] {
            return Err(QmdViolation::Grid {
                axis: axes[i],
                value: grid[i],
                max: max_grid[i],
            });
        }
        if block[i] == 0 || block[i] > max_block[i] {
            return Err(QmdViolation::Block {
                axis: axes[i],
                value: block[i],
                max: max_block[i],
            });
        }
    }
    let threads: u64 = block.iter().product();
    if threads > u64::from(limits.max_threads_per_block) {
        return Err(QmdViolation::Threads(threads));
    }
    let registers = get(words, v04::REGISTER_COUNT);
    // Registers are allocated per warp in units of 256.
    let per_warp = (registers * 32).next_multiple_of(256);
    if registers == 0
        || registers > u64::from(limits.max_regs_per_thread)
        || per_warp * threads.div_ceil(32) > u64::from(limits.regs_per_sm)
    {
        return Err(QmdViolation::Registers { registers, threads });
    }
    let barriers = get(words, v04::BARRIER_COUNT);
    if barriers > u64::from(limits.max_barriers) {
        return Err(QmdViolation::Barriers(barriers));
    }
    let shared = check_shared(words, generation.carveouts_kib)?;

    let mut const_banks = [None; 8];
    for (i, slot) in const_banks.iter_mut().enumerate() {
        let i = i as u32;
        if get(words, v04::CONSTANT_BUFFER_VALID(i)) == 0 {
            continue;
        }
        let va = (get(words, v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i))
            | (get(words, v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i)) << 32))
            << 6;
        let size = get(words, v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i)) * 16;
        if size == 0 || size > 0x1_0000 {
            return Err(QmdViolation::ConstantBank {
                bank: i,
                va,
                size,
                why: "size must be 16 bytes to 64 KiB",
            });
        }
        *slot = Some((va, size));
    }
    match const_banks[0] {
        None => return Err(QmdViolation::NoConstantBank0),
        Some((va, size)) if size < DRIVER_BYTES as u64 => {
            return Err(QmdViolation::ConstantBank {
                bank: 0,
                va,
                size,
                why: "smaller than the 0x210 bytes of driver words",
            });
        }
        Some(_) => {}
    }

    let mut releases = Vec::new();
    for i in 0..RELEASES {
        if get(words, v04::RELEASE_ENABLE(i)) == 0 {
            continue;
        }
        releases.push(check_release(words, i)?);
    }
    Ok(QmdDesc {
        cluster,
        grid: grid.map(|g| g as u32),
        block: block.map(|b| b as u32),
        shared_bytes: shared as u32,
        registers: registers as u32,
        barriers: barriers as u32,
        program_va: get(words, v04::PROGRAM_ADDRESS_LOWER)
            | (get(words, v04::PROGRAM_ADDRESS_UPPER) << 32),
        local_bytes_per_thread: get(words, v04::SHADER_LOCAL_MEMORY_HIGH_SIZE) as u32,
        const_banks,
        releases,
        null: false,
        ..scheduling(words)?
    })
}

/// The scheduling half of a QMD's description: dependents, counter, requirement, self-copy (the launch fields
/// empty).
fn scheduling(words: &[u32]) -> Result<QmdDesc, QmdViolation> {
    let mut dependents = Vec::new();
    let pointers = [v04::DEPENDENT_QMD0_POINTER, v04::DEPENDENT_QMD1_POINTER];
    for (i, pointer) in (0u32..).zip(pointers) {
        if get(words, v04::DEPENDENT_QMD_ENABLE(i)) == 0 {
            continue;
        }
        let kind = match get(words, v04::DEPENDENT_QMD_ACTION(i)) as u32 {
            v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE => DependentKind::Schedule,
            v04::DEPENDENT_QMD_ACTION_QMD_INVALIDATE_COPY_SCHEDULE => DependentKind::CopySchedule,
            v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE => DependentKind::Decrement,
            _ => {
                return Err(QmdViolation::State(
                    "a dependent QMD action other than SCHEDULE, INVALIDATE_COPY_SCHEDULE or DECREMENT_DEPENDENCE \
                     (not modelled)",
                ));
            }
        };
        let va = get(words, pointer) << 8;
        check_address(va)?;
        dependents.push((va, kind));
    }
    let latch = |valid, id| (get(words, valid) != 0).then(|| get(words, id) as u32);
    Ok(QmdDesc {
        dependents,
        counter: get(words, v04::DEPENDENCE_COUNTER) as u32,
        require: get(words, v04::REQUIRE_SCHEDULING_PCAS) != 0,
        self_copy: get(words, v04::SELF_COPY_ON_COMPLETION) != 0,
        null: false,
        arrive_latch: latch(v04::ARRIVE_AT_LATCH_VALID, v04::ARRIVE_AT_LATCH_ID),
        wait_latch: latch(v04::WAIT_ON_LATCH_VALID, v04::WAIT_ON_LATCH_ID),
        ..QmdDesc::null()
    })
}

/// What arming a QMD (a PCAS or dependent action that copies it) records from its memory: the counter and the
/// requirement, without checking the rest of it.
pub fn arming(words: &[u32]) -> (u32, bool) {
    (
        get(words, v04::DEPENDENCE_COUNTER) as u32,
        get(words, v04::REQUIRE_SCHEDULING_PCAS) != 0,
    )
}

/// The QMD type and its cluster fields: GRID_CTA with no cluster shape, or GRID_GPC_CGA with a shape of 1 to
/// `max_blocks` blocks (the generation's most, non-portable sizes included: 16 on Hopper; GPU-wide CGAs are not
/// modelled).
fn check_cluster(
    words: &[u32],
    ty: u64,
    max_blocks: u64,
) -> Result<Option<[u32; 3]>, QmdViolation> {
    let shape = [
        get(words, v04::GPC_CGA_WIDTH),
        get(words, v04::GPC_CGA_HEIGHT),
        get(words, v04::GPC_CGA_DEPTH),
    ];
    let gpu_cga = [
        get(words, v04::GPU_CGA_WIDTH),
        get(words, v04::GPU_CGA_HEIGHT),
        get(words, v04::GPU_CGA_DEPTH),
    ];
    if gpu_cga.iter().any(|&v| v != 0) {
        return Err(QmdViolation::Cluster(format!(
            "GPU_CGA shape {gpu_cga:?} (GPU-wide CGAs are not modelled)"
        )));
    }
    if ty == u64::from(v04::QMD_TYPE_GRID_CTA) {
        if shape.iter().any(|&v| v != 0) {
            return Err(QmdViolation::Cluster(format!(
                "GPC_CGA shape {shape:?} on a GRID_CTA QMD"
            )));
        }
        return Ok(None);
    }
    if ty != u64::from(v04::QMD_TYPE_GRID_GPC_CGA) {
        return Err(QmdViolation::Type(ty));
    }
    let blocks: u64 = shape.iter().product();
    if blocks == 0 || blocks > max_blocks {
        return Err(QmdViolation::Cluster(format!(
            "GPC_CGA shape {shape:?} ({blocks} blocks; 1..={max_blocks})"
        )));
    }
    Ok(Some(shape.map(|v| v as u32)))
}

/// Shared memory size against the SM configuration fields: valid carveout encodings, min <= target <= max,
/// and a block that fits the smallest carveout it allows.
fn check_shared(words: &[u32], carveouts: &[u32]) -> Result<u64, QmdViolation> {
    let max_kib = u64::from(carveouts.last().copied().unwrap_or(0));
    let shared = get(words, v04::SHARED_MEMORY_SIZE);
    if shared > max_kib * 1024 {
        return Err(QmdViolation::SharedMemory {
            bytes: shared,
            max: max_kib * 1024,
        });
    }
    let mut kib = [0u64; 3];
    let fields = [
        (
            "MIN_SM_CONFIG_SHARED_MEM_SIZE",
            v04::MIN_SM_CONFIG_SHARED_MEM_SIZE,
        ),
        (
            "TARGET_SM_CONFIG_SHARED_MEM_SIZE",
            v04::TARGET_SM_CONFIG_SHARED_MEM_SIZE,
        ),
        (
            "MAX_SM_CONFIG_SHARED_MEM_SIZE",
            v04::MAX_SM_CONFIG_SHARED_MEM_SIZE,
        ),
    ];
    for (k, (field, f)) in kib.iter_mut().zip(fields) {
        let value = get(words, f);
        let found = carveouts
            .iter()
            .find(|&&c| u64::from(sm_config(c)) == value)
            .ok_or(QmdViolation::SmConfig {
                field,
                value,
                why: "not a carveout this SM has",
            })?;
        *k = u64::from(*found);
    }
    if !(kib[0] <= kib[1] && kib[1] <= kib[2]) {
        return Err(QmdViolation::SmConfig {
            field: "TARGET_SM_CONFIG_SHARED_MEM_SIZE",
            value: get(words, v04::TARGET_SM_CONFIG_SHARED_MEM_SIZE),
            why: "min <= target <= max does not hold",
        });
    }
    if shared > kib[0] * 1024 {
        return Err(QmdViolation::SmConfig {
            field: "MIN_SM_CONFIG_SHARED_MEM_SIZE",
            value: get(words, v04::MIN_SM_CONFIG_SHARED_MEM_SIZE),
            why: "the carveout is smaller than the block's shared memory",
        });
    }
    Ok(shared)
}

fn check_release(words: &[u32], i: u32) -> Result<ReleaseDesc, QmdViolation> {
    let (addr_lo, addr_hi, pay_lo, pay_hi) = match i {
        0 => (
            v04::RELEASE_SEMAPHORE0_ADDR_LOWER,
            v04::RELEASE_SEMAPHORE0_ADDR_UPPER,
            v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
            v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER,
        ),
        1 => (
            v04::RELEASE_SEMAPHORE1_ADDR_LOWER,
            v04::RELEASE_SEMAPHORE1_ADDR_UPPER,
            v04::RELEASE_SEMAPHORE1_PAYLOAD_LOWER,
            v04::RELEASE_SEMAPHORE1_PAYLOAD_UPPER,
        ),
        _ => (
            v04::RELEASE_SEMAPHORE2_ADDR_LOWER,
            v04::RELEASE_SEMAPHORE2_ADDR_UPPER,
            v04::RELEASE_SEMAPHORE2_PAYLOAD_LOWER,
            v04::RELEASE_SEMAPHORE2_PAYLOAD_UPPER,
        ),
    };
    let reduction = get(words, v04::RELEASE_REDUCTION_ENABLE(i)) != 0;
    if reduction
        && (get(words, v04::RELEASE_REDUCTION_OP(i))
            != u64::from(v04::RELEASE_REDUCTION_OP_RED_ADD)
            || get(words, v04::RELEASE_REDUCTION_FORMAT(i))
                != u64::from(v04::RELEASE_REDUCTION_FORMAT_UNSIGNED)
            || get(words, v04::RELEASE_STRUCTURE_SIZE(i))
                != u64::from(v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD))
    {
        return Err(QmdViolation::Release {
            index: i,
            why: "reductions other than an unsigned one-word add are not modelled",
        });
    }
    let va = get(words, addr_lo) | (get(words, addr_hi) << 32);
    let payload = get(words, pay_lo) | (get(words, pay_hi) << 32);
    let payload64 = get(words, v04::RELEASE_PAYLOAD64B(i)) != 0;
    let (kind, align) = match get(words, v04::RELEASE_STRUCTURE_SIZE(i)) as u32 {
        v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS => {
            (ReleaseKind::FourWords { payload64 }, 16)
        }
        v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD if reduction => (ReleaseKind::AddOneWord, 4),
        v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD => (ReleaseKind::OneWord, 4),
        v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_TWO_WORDS => (ReleaseKind::TwoWords, 8),
        _ => {
            return Err(QmdViolation::Release {
                index: i,
                why: "reserved RELEASE_STRUCTURE_SIZE",
            });
        }
    };
    if !va.is_multiple_of(align) {
        return Err(QmdViolation::Release {
            index: i,
            why: "address not aligned to the structure size",
        });
    }
    Ok(ReleaseDesc { va, payload, kind })
}

/// The compute engine state a launch depends on (set by methods before SEND_PCAS).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchState {
    /// The shared-memory window (`SET_SHADER_SHARED_MEMORY_WINDOW_A/B`).
    pub shared_window: u64,
    /// The local-memory window (`SET_SHADER_LOCAL_MEMORY_WINDOW_A/B`).
    pub local_window: u64,
    /// GPU address of the local-memory buffer (`SET_SHADER_LOCAL_MEMORY_A/B`).
    pub local_memory_va: u64,
    /// Local memory per TPC, bytes (`SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A/B`).
    pub local_bytes_per_tpc: u64,
    /// SMs the local-memory buffer is sized for (`..._NON_THROTTLED_C_MAX_SM_COUNT`).
    pub local_max_sm_count: u32,
    /// Threads one TPC holds (warps per SM × 32 × SMs per TPC): what local memory is sized for.
    pub threads_per_tpc: u64,
}

/// Memory the environment check reads.
pub trait GpuMemory {
    /// Whether `[va, va + len)` lies inside one live allocation.
    fn contains(&self, va: u64, len: u64) -> bool;
    /// `n` 32-bit words at `va`, or `None` where they are not all mapped.
    fn read_words(&self, va: u64, n: usize) -> Option<Vec<u32>>;
}

/// Checks a QMD's pointers against live allocations and its cbank0 driver words against the channel state.
pub fn check_environment(
    d: &QmdDesc,
    st: &LaunchState,
    mem: &dyn GpuMemory,
) -> Result<(), EnvFault> {
    let fault = |what, va, len| EnvFault::Address { what, va, len };
    if !mem.contains(d.program_va, 16) {
        return Err(fault("program", d.program_va, 16));
    }
    for (bank, cb) in d.const_banks.iter().enumerate() {
        if let Some((va, size)) = *cb
            && !mem.contains(va, size)
        {
            return Err(if bank == 0 {
                fault("constant bank 0", va, size)
            } else {
                fault("constant bank", va, size)
            });
        }
    }
    for r in &d.releases {
        let len = match r.kind {
            ReleaseKind::FourWords { .. } => 16,
            ReleaseKind::OneWord | ReleaseKind::AddOneWord => 4,
            ReleaseKind::TwoWords => 8,
        };
        if !mem.contains(r.va, len) {
            return Err(fault("release semaphore", r.va, len));
        }
    }
    if st.shared_window == 0 || st.local_window == 0 {
        return Err(EnvFault::Violation(QmdViolation::State(
            "shared/local memory windows were never set (SET_SHADER_*_MEMORY_WINDOW)",
        )));
    }
    let (cb0, cb0_size) =
        d.const_banks[0].ok_or(EnvFault::Violation(QmdViolation::NoConstantBank0))?;
    let n = PARAM_BLOCK_START / 4 + PARAM_BLOCK_WORDS;
    let w = mem
        .read_words(cb0, n)
        .ok_or_else(|| fault("constant bank 0", cb0, n as u64 * 4))?;
    check_cluster_words(d, &w)?;
    check_param_block(cb0, cb0_size, &w)?;
    let w64 = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
    let checks: [(u64, u64, u64, &'static str); 9] = [
        (0x0, w[0].into(), d.block[0].into(), "blockDim.x"),
        (0x4, w[1].into(), d.block[1].into(), "blockDim.y"),
        (0x8, w[2].into(), d.block[2].into(), "blockDim.z"),
        (0xc, w[3].into(), d.grid[0].into(), "gridDim.x"),
        (0x10, w[4].into(), d.grid[1].into(), "gridDim.y"),
        (0x14, w[5].into(), d.grid[2].into(), "gridDim.z"),
        (0x18, w64(6), st.shared_window, "shared window"),
        (0x20, w64(8), st.local_window, "local window"),
        (0x28, w[10].into(), INITIAL_STACK.into(), "initial stack"),
    ];
    for (offset, found, expected, what) in checks {
        if found != expected {
            return Err(EnvFault::Violation(QmdViolation::Cbank0Word {
                offset,
                found,
                expected,
                what,
            }));
        }
    }
    if d.local_bytes_per_thread > 0 {
        let local = |why: String| EnvFault::Violation(QmdViolation::LocalMemory(why));
        if st.local_memory_va == 0 || st.local_bytes_per_tpc == 0 || st.local_max_sm_count == 0 {
            return Err(local(format!(
                "the QMD asks for {} bytes per thread but SET_SHADER_LOCAL_MEMORY_* was never sent",
                d.local_bytes_per_thread
            )));
        }
        let need = u64::from(d.local_bytes_per_thread) * st.threads_per_tpc;
        if st.local_bytes_per_tpc < need {
            return Err(local(format!(
                "{} bytes per TPC, {} bytes per thread need {need}",
                st.local_bytes_per_tpc, d.local_bytes_per_thread
            )));
        }
        let len = st.local_bytes_per_tpc * u64::from(st.local_max_sm_count);
        if !mem.contains(st.local_memory_va, len) {
            return Err(fault("local memory", st.local_memory_va, len));
        }
    }
    Ok(())
}

/// The parameter block's address range (`c[0x0][0x198]`, `c[0x0][0x1a0]`): code that takes a grid constant's
/// address reads the start, which libcuda writes as the bank's address + 0x210; the end lies inside the bank.
fn check_param_block(cb0: u64, size: u64, w: &[u32]) -> Result<(), EnvFault> {
    let w64 = |byte: usize| u64::from(w[byte / 4]) | (u64::from(w[byte / 4 + 1]) << 32);
    let start = cb0 + DRIVER_BYTES as u64;
    let violation = |offset: usize, found: u64, expected: u64, what| {
        Err(EnvFault::Violation(QmdViolation::Cbank0Word {
            offset: offset as u64,
            found,
            expected,
            what,
        }))
    };
    if w64(PARAM_BLOCK_START) != start {
        return violation(
            PARAM_BLOCK_START,
            w64(PARAM_BLOCK_START),
            start,
            "the parameter block's address",
        );
    }
    let end = w64(PARAM_BLOCK_START + 8);
    if end < start || end > cb0 + size {
        return violation(
            PARAM_BLOCK_START + 8,
            end,
            cb0 + size,
            "the parameter block's end (inside the bank, at most its end)",
        );
    }
    Ok(())
}

/// The cluster words of cbank0 (`w` from its start): every launch has the reciprocals of its cluster shape that
/// `%clusterid` is derived with (1.0 without clusters); a cluster launch has the flag that makes `barrier.cluster`
/// a cluster barrier, its shape, the grid in clusters and the blocks per cluster; a launch without clusters must
/// not have the flag (its other cluster words may be left zero).
fn check_cluster_words(d: &QmdDesc, w: &[u32]) -> Result<(), EnvFault> {
    let at = |byte: usize| u64::from(w.get(byte / 4).copied().unwrap_or(0));
    let word = |offset: usize, expected: u64, what: &'static str| {
        let found = at(offset);
        if found == expected {
            Ok(())
        } else {
            Err(EnvFault::Violation(QmdViolation::Cbank0Word {
                offset: offset as u64,
                found,
                expected,
                what,
            }))
        }
    };
    let reciprocals = ["1 / cluster.x", "1 / cluster.y", "1 / cluster.z"];
    for i in 0..3 {
        let dim = d.cluster.map_or(1, |c| c[i].max(1));
        word(
            0x150 + 4 * i,
            (1.0f32 / dim as f32).to_bits().into(),
            reciprocals[i],
        )?;
    }
    let Some(c) = d.cluster else {
        return word(0x140, 0, "cluster flag of a launch without clusters");
    };
    word(0x140, 1, "cluster flag")?;
    let dims = ["cluster.x", "cluster.y", "cluster.z"];
    let grids = ["clusters along x", "clusters along y", "clusters along z"];
    for i in 0..3 {
        word(0x144 + 4 * i, u64::from(c[i]), dims[i])?;
        word(0x15c + 4 * i, u64::from(d.grid[i] / c[i].max(1)), grids[i])?;
    }
    word(
        0x188,
        c.iter().map(|&v| u64::from(v)).product(),
        "blocks per cluster",
    )
}

/// Why [`check_environment`] refused a launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvFault {
    /// An address outside every live allocation (an MMU fault on hardware).
    Address {
        /// What the address was for (the program, a constant bank, a release semaphore...).
        what: &'static str,
        /// The address.
        va: u64,
        /// Bytes that had to be mapped there.
        len: u64,
    },
    /// The launch breaks a rule the hardware checks.
    Violation(QmdViolation),
}

#[cfg(test)]
mod tests;
