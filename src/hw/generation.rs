//! The GPU-generation table: one row per GPU generation (per SM version), read by every layer that needs to
//! know what a generation is.
//!
//! A row says which RM classes drive the generation (GPFIFO channel, compute, copy engine), which QMD layout its
//! compute class consumes, the SM's limits (threads, warps, blocks, registers, shared memory, clusters), the
//! shared-memory carveouts it can be configured with, and what APEX's launch recipe has been verified on. Only
//! Hopper (sm_90) has been run on hardware (H100 and H200); the other rows come from NVIDIA's class headers and
//! published specifications and are used for occupancy, limits checks and QMD encoding tests, never for a direct
//! launch ([`Generation::direct_launch`]).
//!
//! Who reads it: `rm` (the compute classes that mark a CUDA context's channel; the simulated RM's classes),
//! `gpfifo` (the classes a channel is built with), `pushbuf` (the classes whose methods it encodes,
//! [`encoder`]), `launch` (QMD version, carveouts, limits, occupancy, which GPUs run the direct path) and `sim`
//! (the limits and carveouts a QMD is checked against).
//!
//! An SM version without a row is an [`UnknownGeneration`] error wherever a generation's numbers are needed;
//! nothing falls back to another generation's row. Adding a generation is one row in [`GENERATIONS`] (and, if
//! its QMD layout is new, a [`QmdVersion`] with its layout type and dispatch arm in `launch::qmd` and its header
//! in `build/classes.rs`).

use super::{compute, copy, host, qmd};

/// QMD layout versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QmdVersion {
    /// Ampere and Ada (`c6c0`, `c7c0`, `c9c0`); Hopper accepts it too.
    V03,
    /// Hopper (`cbc0`).
    V04,
    /// Blackwell (`cdc0`, `cec0`).
    V05,
}

impl QmdVersion {
    /// The layout a compute class consumes (the row of [`GENERATIONS`] with that compute class).
    pub fn for_compute_class(class: u32) -> Option<QmdVersion> {
        Generation::for_compute_class(class).map(|g| g.qmd)
    }

    /// Bytes of a QMD of this layout.
    pub fn size_bytes(self) -> usize {
        match self {
            QmdVersion::V03 => qmd::v03::SIZE_BYTES,
            QmdVersion::V04 => qmd::v04::SIZE_BYTES,
            QmdVersion::V05 => qmd::v05::SIZE_BYTES,
        }
    }

    /// The layout's major version (the `QMD_MAJOR_VERSION` field).
    pub fn major(self) -> u8 {
        match self {
            QmdVersion::V03 => 3,
            QmdVersion::V04 => 4,
            QmdVersion::V05 => 5,
        }
    }
}

/// The RM classes that drive a generation: what a channel is allocated as and what is bound on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Classes {
    /// The GPFIFO (host) channel class, e.g. `0xc86f` (HOPPER_CHANNEL_GPFIFO_A).
    pub gpfifo: u32,
    /// The compute class, e.g. `0xcbc0` (HOPPER_COMPUTE_A).
    pub compute: u32,
    /// The copy-engine class, e.g. `0xc8b5` (HOPPER_DMA_COPY_A).
    pub copy: u32,
}

/// What one SM of a generation offers (CUDA Programming Guide, "Technical Specifications per Compute
/// Capability"; `cuda_occupancy.h` for the allocation units).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SmLimits {
    /// Most blocks per grid axis, x y z.
    pub max_grid: [u32; 3],
    /// Most threads per block axis, x y z.
    pub max_block: [u32; 3],
    /// Most threads in one block.
    pub max_threads_per_block: u32,
    /// Most warps an SM holds at once.
    pub max_warps_per_sm: u32,
    /// Most blocks an SM holds at once.
    pub max_blocks_per_sm: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// Registers one block may hold.
    pub regs_per_block: u32,
    /// Registers are allocated per warp in units of this many.
    pub reg_alloc_unit: u32,
    /// Most registers one thread may use.
    pub max_regs_per_thread: u32,
    /// Register file partitions per SM (one per warp scheduler).
    pub sub_partitions: u32,
    /// Named barriers per block (`bar.sync` ids).
    pub max_barriers: u32,
    /// Shared memory a block may use without opting in, KiB.
    pub smem_per_block_kib: u32,
    /// Shared memory a block may use after opting in, KiB (without the driver's 1 KiB reserve).
    pub smem_per_block_optin_kib: u32,
    /// Shared memory the driver reserves per block, bytes.
    pub reserved_smem_per_block: u32,
    /// Shared memory is allocated per block in units of this many bytes.
    pub smem_alloc_unit: u32,
    /// Most blocks in a thread block cluster the hardware runs (non-portable sizes included); 0 for a
    /// generation without clusters.
    pub max_cluster_blocks: u32,
    /// Memory synchronization domains (0 for a generation without them).
    pub sync_domains: u32,
}

/// What APEX's launch recipe (QMD fields, constant bank 0's driver words, the pushbuffer around a launch) has
/// been verified on for a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verification {
    /// Run on hardware: the GPU tests pass and the QMDs match libcuda's captured ones. The text says which GPUs
    /// and driver.
    Hardware(&'static str),
    /// Encoded from the class headers and NVIDIA's published specifications, never run. The direct path refuses
    /// the generation; the driver backend runs it.
    Unverified(&'static str),
}

/// One GPU generation (one SM version): its classes, QMD layout, limits, carveouts and verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Generation {
    /// The architecture, e.g. `Hopper`.
    pub name: &'static str,
    /// The chips of the row, e.g. `GH100 (H100, H200)`.
    pub chips: &'static str,
    /// SM version as major * 10 + minor, e.g. 90.
    pub sm_version: u32,
    /// The RM classes that drive it; `None` where APEX knows none (a GPU RM's ioctls do not drive).
    pub classes: Option<Classes>,
    /// The QMD layout its compute class consumes.
    pub qmd: QmdVersion,
    /// What one SM offers.
    pub limits: SmLimits,
    /// The shared-memory carveouts the SM can be configured with, KiB, ascending; the last is the SM's shared
    /// memory.
    pub carveouts_kib: &'static [u32],
    /// What the launch recipe has been verified on.
    pub verified: Verification,
}

const KIB: u32 = 1024;

/// Limits common to Ampere through Blackwell; rows override what differs.
const COMMON: SmLimits = SmLimits {
    max_grid: [i32::MAX as u32, 65535, 65535],
    max_block: [1024, 1024, 64],
    max_threads_per_block: 1024,
    max_warps_per_sm: 64,
    max_blocks_per_sm: 32,
    regs_per_sm: 64 * KIB,
    regs_per_block: 64 * KIB,
    reg_alloc_unit: 256,
    max_regs_per_thread: 255,
    sub_partitions: 4,
    max_barriers: 16,
    smem_per_block_kib: 48,
    smem_per_block_optin_kib: 227,
    reserved_smem_per_block: KIB,
    smem_alloc_unit: 128,
    max_cluster_blocks: 16,
    sync_domains: 4,
};

/// The carveouts of GA100 and GA10B (Ampere tuning guide).
const CARVEOUTS_GA100: &[u32] = &[0, 8, 16, 32, 64, 100, 132, 164];
/// The carveouts of GA10x and AD10x (Ampere and Ada tuning guides).
const CARVEOUTS_GA10X: &[u32] = &[0, 8, 16, 32, 64, 100];
/// The carveouts of GH100 (Hopper tuning guide) and GB10x (Blackwell tuning guide).
const CARVEOUTS_GH100: &[u32] = &[0, 8, 16, 32, 64, 100, 132, 164, 196, 228];

const NEVER_RUN: Verification = Verification::Unverified(
    "classes from the headers, limits from NVIDIA's specifications; never run by APEX",
);

/// Ampere GA100 (A100): sm_80.
pub const GA100: Generation = Generation {
    name: "Ampere",
    chips: "GA100 (A100, A30)",
    sm_version: 80,
    classes: Some(Classes {
        gpfifo: host::c56f::CLASS,
        compute: compute::c6c0::CLASS,
        copy: copy::c6b5::CLASS,
    }),
    qmd: QmdVersion::V03,
    limits: SmLimits {
        smem_per_block_optin_kib: 163,
        max_cluster_blocks: 0,
        sync_domains: 0,
        ..COMMON
    },
    carveouts_kib: CARVEOUTS_GA100,
    verified: NEVER_RUN,
};

/// Ampere GA10x (RTX 30, A10, A40): sm_86.
pub const GA10X: Generation = Generation {
    name: "Ampere",
    chips: "GA10x (RTX 30, A10, A40)",
    sm_version: 86,
    classes: Some(Classes {
        gpfifo: host::c56f::CLASS,
        compute: compute::c7c0::CLASS,
        copy: copy::c7b5::CLASS,
    }),
    qmd: QmdVersion::V03,
    limits: SmLimits {
        max_warps_per_sm: 48,
        max_blocks_per_sm: 16,
        smem_per_block_optin_kib: 99,
        max_cluster_blocks: 0,
        sync_domains: 0,
        ..COMMON
    },
    carveouts_kib: CARVEOUTS_GA10X,
    verified: NEVER_RUN,
};

/// Ampere GA10B (Jetson Orin): sm_87. Its GPU is driven through nvgpu, not RM, so it has no classes here; the
/// row serves occupancy and limits.
pub const GA10B: Generation = Generation {
    name: "Ampere",
    chips: "GA10B (Jetson Orin)",
    sm_version: 87,
    classes: None,
    qmd: QmdVersion::V03,
    limits: SmLimits {
        max_warps_per_sm: 48,
        max_blocks_per_sm: 16,
        smem_per_block_optin_kib: 163,
        max_cluster_blocks: 0,
        sync_domains: 0,
        ..COMMON
    },
    carveouts_kib: CARVEOUTS_GA100,
    verified: NEVER_RUN,
};

/// Ada AD10x (RTX 40, L4, L40): sm_89.
pub const AD10X: Generation = Generation {
    name: "Ada",
    chips: "AD10x (RTX 40, L4, L40)",
    sm_version: 89,
    classes: Some(Classes {
        gpfifo: host::c56f::CLASS,
        compute: compute::c9c0::CLASS,
        copy: copy::c7b5::CLASS,
    }),
    qmd: QmdVersion::V03,
    limits: SmLimits {
        max_warps_per_sm: 48,
        max_blocks_per_sm: 24,
        smem_per_block_optin_kib: 99,
        max_cluster_blocks: 0,
        sync_domains: 0,
        ..COMMON
    },
    carveouts_kib: CARVEOUTS_GA10X,
    verified: NEVER_RUN,
};

/// Hopper GH100 (H100, H200): sm_90, the generation the direct launch path runs on.
pub const GH100: Generation = Generation {
    name: "Hopper",
    chips: "GH100 (H100, H200)",
    sm_version: 90,
    classes: Some(Classes {
        gpfifo: host::c86f::CLASS,
        compute: compute::cbc0::CLASS,
        copy: copy::c8b5::CLASS,
    }),
    qmd: QmdVersion::V04,
    limits: COMMON,
    carveouts_kib: CARVEOUTS_GH100,
    verified: Verification::Hardware(
        "H100 and H200 with driver 580: every GPU test, and QMDs equal to libcuda's captured ones",
    ),
};

/// Blackwell GB10x (B200, GB200): sm_100.
pub const GB10X: Generation = Generation {
    name: "Blackwell",
    chips: "GB10x (B200, GB200)",
    sm_version: 100,
    classes: Some(Classes {
        gpfifo: host::c96f::CLASS,
        compute: compute::cdc0::CLASS,
        copy: copy::c9b5::CLASS,
    }),
    qmd: QmdVersion::V05,
    limits: COMMON,
    carveouts_kib: CARVEOUTS_GH100,
    verified: NEVER_RUN,
};

/// Blackwell GB20x (RTX 50, RTX PRO 6000): sm_120.
pub const GB20X: Generation = Generation {
    name: "Blackwell",
    chips: "GB20x (RTX 50, RTX PRO 6000)",
    sm_version: 120,
    classes: Some(Classes {
        gpfifo: host::ca6f::CLASS,
        compute: compute::cec0::CLASS,
        copy: copy::cab5::CLASS,
    }),
    qmd: QmdVersion::V05,
    limits: SmLimits {
        max_warps_per_sm: 48,
        smem_per_block_optin_kib: 99,
        max_cluster_blocks: 8,
        ..COMMON
    },
    carveouts_kib: CARVEOUTS_GA10X,
    verified: NEVER_RUN,
};

/// Every generation APEX knows, newest first.
pub const GENERATIONS: &[Generation] = &[GB20X, GB10X, GH100, AD10X, GA10B, GA10X, GA100];

/// An SM version with no row in [`GENERATIONS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "sm_{sm_version} has no row in APEX's GPU-generation table (it knows sm_80, 86, 87, 89, 90, 100 and 120); \
     its classes, QMD layout and limits are unknown, so the direct path cannot drive it: use the CUDA driver backend"
)]
pub struct UnknownGeneration {
    /// The SM version asked for (major * 10 + minor).
    pub sm_version: u32,
}

impl Generation {
    /// The row of SM version `sm_version` (major * 10 + minor); `None` for one the table does not know.
    pub fn for_sm(sm_version: u32) -> Option<&'static Generation> {
        GENERATIONS.iter().find(|g| g.sm_version == sm_version)
    }

    /// The row of SM version `sm_version`, or [`UnknownGeneration`].
    pub fn lookup(sm_version: u32) -> Result<&'static Generation, UnknownGeneration> {
        Generation::for_sm(sm_version).ok_or(UnknownGeneration { sm_version })
    }

    /// The row whose compute class is `class`.
    pub fn for_compute_class(class: u32) -> Option<&'static Generation> {
        GENERATIONS
            .iter()
            .find(|g| g.classes.is_some_and(|c| c.compute == class))
    }

    /// Shared memory per SM at the largest carveout, KiB.
    pub fn smem_per_sm_kib(&self) -> u32 {
        self.carveouts_kib.last().copied().unwrap_or(0)
    }

    /// Whether the direct launch path runs this generation: only where the launch recipe has been verified on
    /// hardware.
    pub fn direct_launch(&self) -> bool {
        matches!(self.verified, Verification::Hardware(_))
    }

    /// Whether the generation has thread block clusters.
    pub fn has_clusters(&self) -> bool {
        self.limits.max_cluster_blocks > 0
    }

    /// The QMD's SASS_VERSION for this generation: major in the high nibble, minor in the low one (0x90).
    pub fn sass_version(&self) -> u32 {
        ((self.sm_version / 10) << 4) | (self.sm_version % 10)
    }
}

/// Every GPFIFO class of the table, newest first, each once.
pub fn gpfifo_classes() -> impl Iterator<Item = u32> {
    distinct(|c| c.gpfifo)
}

/// Every compute class of the table, newest first, each once: a channel with one of these under it runs kernels.
pub fn compute_classes() -> impl Iterator<Item = u32> {
    distinct(|c| c.compute)
}

/// Every copy-engine class of the table, newest first, each once.
pub fn copy_classes() -> impl Iterator<Item = u32> {
    distinct(|c| c.copy)
}

fn distinct(pick: fn(&Classes) -> u32) -> impl Iterator<Item = u32> {
    let all = move || {
        GENERATIONS
            .iter()
            .filter_map(move |g| g.classes.as_ref().map(pick))
    };
    all()
        .enumerate()
        .filter(move |&(i, c)| !all().take(i).any(|d| d == c))
        .map(|(_, c)| c)
}

/// The classes whose method offsets and fields the pushbuffer encoder writes: Hopper's, the generation the
/// launch recipe is verified on. A unit test checks that every method the encoder emits has the same offset in
/// every row's classes that define it.
pub mod encoder {
    pub use crate::hw::compute::cbc0 as compute;
    pub use crate::hw::copy::c8b5 as copy;
    pub use crate::hw::host::c86f as host;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw;

    #[test]
    fn every_rows_classes_are_in_the_generated_tables() {
        for g in GENERATIONS {
            let Some(c) = g.classes else { continue };
            for (what, class) in [
                ("gpfifo", c.gpfifo),
                ("compute", c.compute),
                ("copy", c.copy),
            ] {
                assert!(
                    hw::methods_for_class(class).is_some(),
                    "sm_{} {what} class {class:#x} is not in hw",
                    g.sm_version
                );
            }
            assert_eq!(QmdVersion::for_compute_class(c.compute), Some(g.qmd));
        }
    }

    #[test]
    fn rows_are_consistent() {
        for (i, g) in GENERATIONS.iter().enumerate() {
            let sm = g.sm_version;
            // Newest first, one row per SM version.
            if let Some(next) = GENERATIONS.get(i + 1) {
                assert!(next.sm_version < sm, "rows out of order at sm_{sm}");
            }
            assert_eq!(Generation::for_sm(sm), Some(g));
            // Carveouts: ascending from 0, the largest the SM's shared memory, above what a block may opt in to.
            assert_eq!(g.carveouts_kib.first(), Some(&0), "sm_{sm}");
            assert!(g.carveouts_kib.windows(2).all(|w| w[0] < w[1]), "sm_{sm}");
            assert!(
                g.smem_per_sm_kib() > g.limits.smem_per_block_optin_kib,
                "sm_{sm}"
            );
            assert!(
                g.limits.smem_per_block_optin_kib >= g.limits.smem_per_block_kib,
                "sm_{sm}"
            );
            // Every carveout fits its QMD field (SM_CONFIG_SHARED_MEM_SIZE, KiB / 4 + 1).
            let field = hw::qmd::v04::MAX_SM_CONFIG_SHARED_MEM_SIZE;
            assert!(
                field.fits(u64::from(g.smem_per_sm_kib() / 4 + 1)),
                "sm_{sm}"
            );
            let l = &g.limits;
            assert!(
                l.max_warps_per_sm * 32 >= l.max_threads_per_block,
                "sm_{sm}"
            );
            assert!(
                l.max_block.iter().all(|&b| b <= l.max_threads_per_block),
                "sm_{sm}"
            );
            assert_eq!(
                l.regs_per_sm % (l.sub_partitions * l.reg_alloc_unit),
                0,
                "sm_{sm}"
            );
            // Clusters and memory sync domains came with Hopper, as did QMD V04.
            assert_eq!(g.has_clusters(), sm >= 90, "sm_{sm}");
            assert_eq!(l.sync_domains > 0, sm >= 90, "sm_{sm}");
            assert_eq!(g.qmd == QmdVersion::V03, sm < 90, "sm_{sm}");
            // Only a generation verified on hardware runs the direct path, and only Hopper is.
            assert_eq!(g.direct_launch(), sm == 90, "sm_{sm}");
        }
        assert_eq!(
            Generation::lookup(75),
            Err(UnknownGeneration { sm_version: 75 })
        );
        assert!(Generation::for_sm(91).is_none());
    }

    #[test]
    fn hoppers_row_is_what_the_old_lists_said() {
        let h = Generation::lookup(90).unwrap();
        assert_eq!(
            h.classes,
            Some(Classes {
                gpfifo: 0xc86f,
                compute: 0xcbc0,
                copy: 0xc8b5
            })
        );
        assert_eq!(h.qmd, QmdVersion::V04);
        assert_eq!(
            h.carveouts_kib,
            &[0, 8, 16, 32, 64, 100, 132, 164, 196, 228]
        );
        assert_eq!(h.smem_per_sm_kib(), 228);
        assert_eq!(h.sass_version(), 0x90);
        let l = h.limits;
        assert_eq!(
            (
                l.max_warps_per_sm,
                l.max_blocks_per_sm,
                l.smem_per_block_optin_kib
            ),
            (64, 32, 227)
        );
        assert_eq!(
            (l.max_cluster_blocks, l.sync_domains, l.max_barriers),
            (16, 4, 16)
        );
        assert_eq!(
            (
                l.regs_per_sm,
                l.max_regs_per_thread,
                l.max_threads_per_block
            ),
            (65536, 255, 1024)
        );
        assert!(matches!(h.verified, Verification::Hardware(_)));
        // The class lists gpfifo, rm::attach and the channel used before the table, newest first.
        assert_eq!(
            gpfifo_classes().collect::<Vec<_>>(),
            [0xca6f, 0xc96f, 0xc86f, 0xc56f]
        );
        assert_eq!(
            compute_classes().collect::<Vec<_>>(),
            [0xcec0, 0xcdc0, 0xcbc0, 0xc9c0, 0xc7c0, 0xc6c0]
        );
        assert_eq!(
            copy_classes().collect::<Vec<_>>(),
            [0xcab5, 0xc9b5, 0xc8b5, 0xc7b5, 0xc6b5]
        );
        // The encoder's classes are Hopper's.
        assert_eq!(
            Some(Classes {
                gpfifo: encoder::host::CLASS,
                compute: encoder::compute::CLASS,
                copy: encoder::copy::CLASS
            }),
            h.classes
        );
    }

    #[test]
    fn qmd_versions_follow_the_compute_class() {
        assert_eq!(QmdVersion::for_compute_class(0xcbc0), Some(QmdVersion::V04));
        assert_eq!(QmdVersion::for_compute_class(0xc6c0), Some(QmdVersion::V03));
        assert_eq!(QmdVersion::for_compute_class(0xc7c0), Some(QmdVersion::V03));
        assert_eq!(QmdVersion::for_compute_class(0xc9c0), Some(QmdVersion::V03));
        assert_eq!(QmdVersion::for_compute_class(0xcdc0), Some(QmdVersion::V05));
        assert_eq!(QmdVersion::for_compute_class(0xcec0), Some(QmdVersion::V05));
        assert_eq!(QmdVersion::for_compute_class(0x1234), None);
        for v in [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05] {
            assert_eq!(hw::qmd_layout(v.major()).map(|l| l.1), Some(v.size_bytes()));
        }
    }

    /// The methods `pushbuf::encode` emits, by class kind (c56f's DMA header formats and its NON_STALL_INTERRUPT,
    /// which the Hopper header leaves out, are the encoder's own).
    const ENCODED_HOST: &[&str] = &[
        "SET_OBJECT",
        "SEM_ADDR_LO",
        "SEM_EXECUTE",
        "WFI",
        "MEM_OP_A",
    ];
    const ENCODED_COMPUTE: &[&str] = &[
        "SET_OBJECT",
        "INVALIDATE_SHADER_CACHES_NO_WFI",
        "LAUNCH_DMA",
        "LINE_LENGTH_IN",
        "LOAD_INLINE_DATA",
        "OFFSET_OUT_UPPER",
        "SEND_PCAS_A",
        "SEND_SIGNALING_PCAS2_B",
        "SET_INLINE_QMD_ADDRESS_A",
        "SET_QMD_VERSION",
        "SET_SHADER_LOCAL_MEMORY_A",
        "SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A",
        "SET_SHADER_LOCAL_MEMORY_WINDOW_A",
        "SET_SHADER_SHARED_MEMORY_WINDOW_A",
        "SET_SPA_VERSION",
    ];
    const ENCODED_COPY: &[&str] = &[
        "LAUNCH_DMA",
        "LINE_LENGTH_IN",
        "OFFSET_IN_UPPER",
        "OFFSET_OUT_UPPER",
        "SET_SEMAPHORE_A",
    ];

    /// Methods the encoder emits, the encoder's class, and the row's class of that kind.
    type EncodedKind = (&'static [&'static str], u32, fn(&Classes) -> u32);

    #[test]
    fn the_encoders_methods_sit_at_the_same_offsets_in_every_row() {
        let offset = |class: u32, name: &str| {
            hw::methods_for_class(class)
                .unwrap()
                .iter()
                .find(|m| m.name == name)
                .map(|m| m.offset)
        };
        let kinds: [EncodedKind; 3] = [
            (ENCODED_HOST, encoder::host::CLASS, |c| c.gpfifo),
            (ENCODED_COMPUTE, encoder::compute::CLASS, |c| c.compute),
            (ENCODED_COPY, encoder::copy::CLASS, |c| c.copy),
        ];
        for g in GENERATIONS {
            let Some(c) = g.classes else { continue };
            for (names, reference, pick) in kinds {
                for name in names {
                    let want = offset(reference, name);
                    assert!(want.is_some(), "{name} is not a method of {reference:#x}");
                    if let Some(got) = offset(pick(&c), name) {
                        assert_eq!(
                            Some(got),
                            want,
                            "sm_{}: {name} of {:#x}",
                            g.sm_version,
                            pick(&c)
                        );
                    }
                }
            }
        }
    }
}
