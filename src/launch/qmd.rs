//! QMDs (queue meta data: the compute engine's launch descriptor), one builder per layout version, written
//! through the field tables generated from the class headers.
//!
//! V03 is the Ampere/Ada layout, V04 Hopper's, V05 Blackwell's. Hopper silently drops a V03 QMD (see
//! research/hopper-launch.md), so the version must follow the compute class: [`QmdVersion`] and the
//! shared-memory carveouts come from the GPU-generation table, [`crate::hw::generation`].

use crate::hw::qmd::{v03, v04, v05};
use crate::hw::{Field, FieldError, Generation};

pub use crate::hw::generation::QmdVersion;

/// Words of the largest QMD (384 bytes).
pub const QMD_WORDS: usize = 96;

/// A constant bank bound to the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ConstBuffer {
    /// GPU address of the bank's data.
    pub va: u64,
    /// Bytes of the bank (a multiple of 16).
    pub size: u32,
}

/// Everything a QMD says about one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmdParams {
    /// SM version as major * 10 + minor (90).
    pub sm_version: u32,
    /// GPU address of the kernel's first instruction.
    pub program_va: u64,
    /// Bytes of the kernel's code from `program_va`: the front end prefetches them into the instruction cache
    /// before the first block starts, as libcuda asks it to (0: no prefetch).
    pub program_bytes: u64,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers the kernel uses (`bar.sync` ids).
    pub barriers: u32,
    /// Grid size in blocks, x y z.
    pub grid: [u32; 3],
    /// Block size in threads, x y z.
    pub block: [u32; 3],
    /// Shared memory per block: the kernel's static size (with the 1 KiB the compiler reserves) plus dynamic.
    pub shared_bytes: u32,
    /// Local memory (stack) per thread that the context's local-memory buffer provides.
    pub local_bytes_per_thread: u32,
    /// Constant banks 0 to 7 bound to the launch (bank 0: parameters and driver constants).
    pub const_buffers: [Option<ConstBuffer>; 8],
    /// Semaphore written when the grid completes: four words (64-bit payload, then a timestamp).
    pub release: Option<(u64, u64)>,
    /// Thread block cluster shape (sm_90+): the grid runs as clusters of this many blocks per axis, each cluster's
    /// blocks co-scheduled on one GPC. `grid` stays in blocks and must be a multiple of it.
    pub cluster: Option<[u32; 3]>,
    /// Memory synchronization domain (0 to 3; sm_90+), see `LaunchConfig::sync_domain`.
    pub sync_domain: u8,
    /// Clusters' blocks balanced by load instead of multicast to one GPC (`ClusterPolicy::LoadBalancing`).
    pub cluster_load_balancing: bool,
}

/// Memory sync domains a QMD names (a 2-bit field; Hopper and Blackwell have four).
const SYNC_DOMAINS: u8 = 4;

fn sync_domain(p: &QmdParams) -> Result<u8, QmdError> {
    if p.sync_domain >= SYNC_DOMAINS {
        return Err(QmdError {
            field: "SYNC_DOMAIN_ID (0 to 3)",
            value: u64::from(p.sync_domain),
        });
    }
    Ok(p.sync_domain)
}

/// The QMD's grid: in clusters for a cluster launch (libcuda's GRID_WIDTH is 4 for 8 blocks in clusters of 2), in
/// blocks otherwise.
fn qmd_grid(p: &QmdParams) -> Result<[u32; 3], QmdError> {
    let Some(c) = p.cluster else {
        return Ok(p.grid);
    };
    let mut g = p.grid;
    for (i, (g, c)) in g.iter_mut().zip(c).enumerate() {
        if c == 0 || !g.is_multiple_of(c) {
            return Err(QmdError {
                field: ["GPC_CGA_WIDTH", "GPC_CGA_HEIGHT", "GPC_CGA_DEPTH"][i],
                value: u64::from(c),
            });
        }
        *g /= c;
    }
    Ok(g)
}

/// A value did not fit its QMD field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{field}: {value:#x} does not fit the QMD field; the launch asks for more than the GPU's hardware can encode"
)]
pub struct QmdError {
    /// The QMD field.
    pub field: &'static str,
    /// The value that does not fit.
    pub value: u64,
}

macro_rules! set {
    ($w:expr, $m:ident :: $f:ident, $v:expr) => {
        $w.set(stringify!($f), $m::$f, ($v) as u64)?
    };
    ($w:expr, $m:ident :: $f:ident ($i:expr), $v:expr) => {
        $w.set(stringify!($f), $m::$f($i as u32), ($v) as u64)?
    };
}

struct Writer<'a> {
    words: &'a mut [u32; QMD_WORDS],
}

impl Writer<'_> {
    fn set(&mut self, name: &'static str, field: Field, value: u64) -> Result<(), QmdError> {
        field.set(self.words, value).map_err(|e| match e {
            FieldError::TooWide { .. } | FieldError::OutOfRange { .. } => {
                QmdError { field: name, value }
            }
        })
    }

    fn get(&self, field: Field) -> u64 {
        field.get(&self.words[..]).unwrap_or(0)
    }

    /// Binds `cb` as V04 constant bank `i`, with prefetch mode `prefetch` (a CONSTANT_BUFFER_PREFETCH value).
    fn bind_bank(&mut self, i: u32, cb: ConstBuffer, prefetch: u32) -> Result<(), QmdError> {
        set!(self, v04::CONSTANT_BUFFER_VALID(i), 1);
        self.set_bank_address(i, cb.va)?;
        set!(
            self,
            v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
            cb.size.div_ceil(16)
        );
        set!(self, v04::CONSTANT_BUFFER_PREFETCH(i), prefetch);
        Ok(())
    }

    /// Binds `cb` as bank `i` for prefetch only, unless the kernel binds bank `i` itself.
    fn bind_prefetch(&mut self, i: u32, cb: ConstBuffer, prefetch: u32) -> Result<(), QmdError> {
        if self.get(v04::CONSTANT_BUFFER_VALID(i)) == 0 {
            self.bind_bank(i, cb, prefetch)?;
        }
        Ok(())
    }

    fn set_bank_address(&mut self, i: u32, va: u64) -> Result<(), QmdError> {
        set!(
            self,
            v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i),
            (va >> 6) & 0xffff_ffff
        );
        set!(self, v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i), va >> 38);
        Ok(())
    }

    /// V04 constant bank `i` as bound, if it is.
    fn bank(&self, i: u32) -> Option<ConstBuffer> {
        (self.get(v04::CONSTANT_BUFFER_VALID(i)) != 0).then(|| ConstBuffer {
            va: ((self.get(v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i)) << 32)
                | self.get(v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i)))
                << 6,
            size: (self.get(v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i)) * 16) as u32,
        })
    }
}

/// Shared-memory carveouts (KiB) the SM can be configured with: the generation table's row for `sm_version`, empty
/// for an SM version the table does not know ([`build`] refuses those).
pub fn shared_carveouts_kib(sm_version: u32) -> &'static [u32] {
    Generation::for_sm(sm_version).map_or(&[], |g| g.carveouts_kib)
}

/// The SM_CONFIG_SHARED_MEM_SIZE encoding of a carveout: KiB / 4 + 1 (228 KiB is 0x3a, as libcuda sends).
pub const fn sm_config(kib: u32) -> u32 {
    kib / 4 + 1
}

/// (min, target, max) shared-memory configurations for a block of `shared_bytes`: the smallest carveout that
/// holds it, a target of at least 32 KiB (libcuda's choice for small kernels), and the largest carveout.
pub fn sm_configs(sm_version: u32, shared_bytes: u32) -> (u32, u32, u32) {
    let carve = shared_carveouts_kib(sm_version);
    let max = *carve.last().unwrap_or(&0);
    let min = carve
        .iter()
        .copied()
        .find(|&k| k * 1024 >= shared_bytes)
        .unwrap_or(max);
    let target = min.max(32.min(max));
    (sm_config(min), sm_config(target), sm_config(max))
}

/// Writes the QMD for `p` in layout `version` into `out` (all other bits zero).
pub fn build(
    version: QmdVersion,
    p: &QmdParams,
    out: &mut [u32; QMD_WORDS],
) -> Result<(), QmdError> {
    out.fill(0);
    if Generation::for_sm(p.sm_version).is_none() {
        // Its carveouts (and SASS version) would be another generation's guess.
        return Err(QmdError {
            field: "SASS_VERSION (an SM version with no row in the GPU-generation table, hw::generation)",
            value: u64::from(p.sm_version),
        });
    }
    // V04 and V05 keep bank addresses in 64-byte units: a misaligned bank would silently be read from the
    // boundary below it.
    if let Some(cb) = p.const_buffers.iter().flatten().find(|cb| cb.va % 64 != 0) {
        return Err(QmdError {
            field: "CONSTANT_BUFFER_ADDR (must be 64-byte aligned)",
            value: cb.va,
        });
    }
    let (min_cfg, target_cfg, max_cfg) = sm_configs(p.sm_version, p.shared_bytes);
    let sass = ((p.sm_version / 10) << 4) | (p.sm_version % 10);
    let grid = qmd_grid(p)?;
    let w = &mut Writer { words: out };
    match version {
        QmdVersion::V04 => {
            set!(w, v04::QMD_GROUP_ID, 0x3f);
            set!(w, v04::QMD_TYPE, v04::QMD_TYPE_GRID_CTA);
            if let Some(c) = p.cluster {
                // What libcuda sets for cluster launches on Hopper (apex-trace of probes/cluster_launch.cu): a GPC
                // CGA grid, the cluster shape, multicast distribution, the grid counted in clusters.
                set!(w, v04::QMD_TYPE, v04::QMD_TYPE_GRID_GPC_CGA);
                set!(w, v04::GPC_CGA_WIDTH, c[0]);
                set!(w, v04::GPC_CGA_HEIGHT, c[1]);
                set!(w, v04::GPC_CGA_DEPTH, c[2]);
                set!(
                    w,
                    v04::CGA_CTA_DISTRIBUTION_MODE,
                    if p.cluster_load_balancing {
                        v04::CGA_CTA_DISTRIBUTION_MODE_LOAD_BALANCING
                    } else {
                        v04::CGA_CTA_DISTRIBUTION_MODE_MULTI_CAST
                    }
                );
            }
            // libcuda writes the domain after its map (apex-trace of probes/launch_attrs.cu, H100, driver 580:
            // NCCL's "remote" domain is SYNC_DOMAIN_ID 1, the default domain leaves the field 0).
            set!(w, v04::SYNC_DOMAIN_ID, sync_domain(p)?);
            set!(w, v04::QMD_MAJOR_VERSION, 4);
            set!(w, v04::QMD_MINOR_VERSION, 0);
            set!(w, v04::SASS_VERSION, sass);
            set!(
                w,
                v04::API_VISIBLE_CALL_LIMIT,
                v04::API_VISIBLE_CALL_LIMIT_NO_CHECK
            );
            set!(w, v04::SAMPLER_INDEX, v04::SAMPLER_INDEX_VIA_HEADER_INDEX);
            set!(w, v04::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
            set!(w, v04::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
            set!(w, v04::INVALIDATE_TEXTURE_DATA_CACHE, 1);
            set!(w, v04::INVALIDATE_SHADER_DATA_CACHE, 1);
            set!(w, v04::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
            set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
            set!(w, v04::SHARED_MEMORY_SIZE, p.shared_bytes);
            set!(w, v04::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
            set!(w, v04::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
            set!(w, v04::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
            set!(
                w,
                v04::SHADER_LOCAL_MEMORY_HIGH_SIZE,
                p.local_bytes_per_thread
            );
            set!(w, v04::GRID_WIDTH, grid[0]);
            set!(w, v04::GRID_HEIGHT, grid[1]);
            set!(w, v04::GRID_DEPTH, grid[2]);
            set!(w, v04::CTA_THREAD_DIMENSION0, p.block[0]);
            set!(w, v04::CTA_THREAD_DIMENSION1, p.block[1]);
            set!(w, v04::CTA_THREAD_DIMENSION2, p.block[2]);
            set!(w, v04::REGISTER_COUNT, p.registers);
            set!(w, v04::BARRIER_COUNT, p.barriers);
            set!(w, v04::PROGRAM_ADDRESS_LOWER, p.program_va & 0xffff_ffff);
            set!(w, v04::PROGRAM_ADDRESS_UPPER, p.program_va >> 32);
            set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
            if let Some((start, units)) = program_prefetch_range(p.program_va, p.program_bytes) {
                set!(
                    w,
                    v04::PROGRAM_PREFETCH_ADDR_LOWER_SHIFTED,
                    (start >> 8) & 0xffff_ffff
                );
                set!(w, v04::PROGRAM_PREFETCH_ADDR_UPPER_SHIFTED, start >> 40);
                set!(w, v04::PROGRAM_PREFETCH_SIZE, units);
            }
            for (i, cb) in (0u32..).zip(p.const_buffers) {
                if let Some(cb) = cb {
                    w.bind_bank(i, cb, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_NONE)?;
                }
            }
            if let Some((va, payload)) = p.release {
                set!(w, v04::RELEASE_ENABLE(0), 1);
                set!(
                    w,
                    v04::RELEASE_STRUCTURE_SIZE(0),
                    v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
                );
                set!(w, v04::RELEASE_PAYLOAD64B(0), 1);
                set!(w, v04::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
                set!(w, v04::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
                set!(
                    w,
                    v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                    payload & 0xffff_ffff
                );
                set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
            }
        }
        QmdVersion::V05 => {
            set!(w, v05::QMD_GROUP_ID, 0x3f);
            set!(w, v05::QMD_TYPE, v05::QMD_TYPE_GRID_CTA);
            if let Some(c) = p.cluster {
                // The V04 recipe: the fields have the same names and meaning in V05 (unverified on Blackwell).
                set!(w, v05::QMD_TYPE, v05::QMD_TYPE_GRID_GPC_CGA);
                set!(w, v05::GPC_CGA_WIDTH, c[0]);
                set!(w, v05::GPC_CGA_HEIGHT, c[1]);
                set!(w, v05::GPC_CGA_DEPTH, c[2]);
                set!(
                    w,
                    v05::CGA_CTA_DISTRIBUTION_MODE,
                    if p.cluster_load_balancing {
                        v05::CGA_CTA_DISTRIBUTION_MODE_LOAD_BALANCING
                    } else {
                        v05::CGA_CTA_DISTRIBUTION_MODE_MULTI_CAST
                    }
                );
            }
            // libcuda writes the domain after its map (apex-trace of probes/launch_attrs.cu, H100, driver 580:
            // NCCL's "remote" domain is SYNC_DOMAIN_ID 1, the default domain leaves the field 0).
            set!(w, v05::SYNC_DOMAIN_ID, sync_domain(p)?);
            set!(w, v05::QMD_MAJOR_VERSION, 5);
            set!(w, v05::QMD_MINOR_VERSION, 0);
            set!(w, v05::SASS_VERSION, sass);
            set!(
                w,
                v05::API_VISIBLE_CALL_LIMIT,
                v05::API_VISIBLE_CALL_LIMIT_NO_CHECK
            );
            set!(w, v05::SAMPLER_INDEX, v05::SAMPLER_INDEX_VIA_HEADER_INDEX);
            set!(w, v05::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
            set!(w, v05::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
            set!(w, v05::INVALIDATE_TEXTURE_DATA_CACHE, 1);
            set!(w, v05::INVALIDATE_SHADER_DATA_CACHE, 1);
            set!(w, v05::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
            set!(w, v05::CWD_MEMBAR_TYPE, v05::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
            set!(
                w,
                v05::SHARED_MEMORY_SIZE_SHIFTED7,
                p.shared_bytes.div_ceil(128)
            );
            set!(w, v05::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
            set!(w, v05::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
            set!(w, v05::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
            set!(
                w,
                v05::SHADER_LOCAL_MEMORY_HIGH_SIZE_SHIFTED4,
                p.local_bytes_per_thread.div_ceil(16)
            );
            set!(w, v05::GRID_WIDTH, grid[0]);
            set!(w, v05::GRID_HEIGHT, grid[1]);
            set!(w, v05::GRID_DEPTH, grid[2]);
            set!(w, v05::CTA_THREAD_DIMENSION0, p.block[0]);
            set!(w, v05::CTA_THREAD_DIMENSION1, p.block[1]);
            set!(w, v05::CTA_THREAD_DIMENSION2, p.block[2]);
            set!(w, v05::REGISTER_COUNT, p.registers);
            set!(w, v05::BARRIER_COUNT, p.barriers);
            set!(
                w,
                v05::PROGRAM_ADDRESS_LOWER_SHIFTED4,
                (p.program_va >> 4) & 0xffff_ffff
            );
            set!(w, v05::PROGRAM_ADDRESS_UPPER_SHIFTED4, p.program_va >> 36);
            for (i, cb) in p.const_buffers.iter().enumerate() {
                if let Some(cb) = cb {
                    set!(w, v05::CONSTANT_BUFFER_VALID(i), 1);
                    set!(
                        w,
                        v05::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i),
                        (cb.va >> 6) & 0xffff_ffff
                    );
                    set!(w, v05::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i), cb.va >> 38);
                    set!(
                        w,
                        v05::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
                        cb.size.div_ceil(16)
                    );
                }
            }
            if let Some((va, payload)) = p.release {
                set!(w, v05::RELEASE_ENABLE(0), 1);
                set!(
                    w,
                    v05::RELEASE_STRUCTURE_SIZE(0),
                    v05::RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
                );
                set!(w, v05::RELEASE_PAYLOAD64B(0), 1);
                set!(w, v05::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
                set!(w, v05::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
                set!(
                    w,
                    v05::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                    payload & 0xffff_ffff
                );
                set!(w, v05::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
            }
        }
        QmdVersion::V03 => {
            if p.sync_domain != 0 {
                return Err(QmdError {
                    field: "SYNC_DOMAIN_ID (V03 QMDs, for GPUs before sm_90, have no memory sync domains)",
                    value: u64::from(p.sync_domain),
                });
            }
            if let Some(c) = p.cluster {
                // Ampere and Ada have no thread block clusters.
                return Err(QmdError {
                    field: "cluster (V03 QMDs, for GPUs before sm_90, have none)",
                    value: u64::from(c[0]) * u64::from(c[1]) * u64::from(c[2]),
                });
            }
            set!(w, v03::QMD_GROUP_ID, 0x3f);
            set!(w, v03::QMD_MAJOR_VERSION, 3);
            set!(w, v03::SASS_VERSION, sass);
            set!(w, v03::SM_GLOBAL_CACHING_ENABLE, 1);
            set!(
                w,
                v03::API_VISIBLE_CALL_LIMIT,
                v03::API_VISIBLE_CALL_LIMIT_NO_CHECK
            );
            set!(w, v03::SAMPLER_INDEX, v03::SAMPLER_INDEX_VIA_HEADER_INDEX);
            set!(w, v03::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
            set!(w, v03::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
            set!(w, v03::INVALIDATE_TEXTURE_DATA_CACHE, 1);
            set!(w, v03::INVALIDATE_SHADER_DATA_CACHE, 1);
            set!(w, v03::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
            set!(w, v03::CWD_MEMBAR_TYPE, v03::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
            set!(w, v03::SHARED_MEMORY_SIZE, p.shared_bytes);
            set!(w, v03::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
            set!(w, v03::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
            set!(w, v03::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
            set!(
                w,
                v03::SHADER_LOCAL_MEMORY_HIGH_SIZE,
                p.local_bytes_per_thread
            );
            set!(w, v03::CTA_RASTER_WIDTH, p.grid[0]);
            set!(w, v03::CTA_RASTER_HEIGHT, p.grid[1]);
            set!(w, v03::CTA_RASTER_DEPTH, p.grid[2]);
            set!(w, v03::CTA_THREAD_DIMENSION0, p.block[0]);
            set!(w, v03::CTA_THREAD_DIMENSION1, p.block[1]);
            set!(w, v03::CTA_THREAD_DIMENSION2, p.block[2]);
            set!(w, v03::REGISTER_COUNT_V, p.registers);
            set!(w, v03::BARRIER_COUNT, p.barriers);
            set!(w, v03::PROGRAM_ADDRESS_LOWER, p.program_va & 0xffff_ffff);
            set!(w, v03::PROGRAM_ADDRESS_UPPER, p.program_va >> 32);
            for (i, cb) in p.const_buffers.iter().enumerate() {
                if let Some(cb) = cb {
                    set!(w, v03::CONSTANT_BUFFER_VALID(i), 1);
                    set!(w, v03::CONSTANT_BUFFER_ADDR_LOWER(i), cb.va & 0xffff_ffff);
                    set!(w, v03::CONSTANT_BUFFER_ADDR_UPPER(i), cb.va >> 32);
                    set!(
                        w,
                        v03::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
                        cb.size.div_ceil(16)
                    );
                }
            }
            if let Some((va, payload)) = p.release {
                set!(w, v03::RELEASE0_ENABLE, 1);
                set!(
                    w,
                    v03::RELEASE0_STRUCTURE_SIZE,
                    v03::RELEASE0_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
                );
                set!(w, v03::RELEASE0_PAYLOAD64B, 1);
                set!(w, v03::RELEASE0_ADDRESS_LOWER, va & 0xffff_ffff);
                set!(w, v03::RELEASE0_ADDRESS_UPPER, va >> 32);
                set!(w, v03::RELEASE0_PAYLOAD_LOWER, payload & 0xffff_ffff);
                set!(w, v03::RELEASE0_PAYLOAD_UPPER, payload >> 32);
            }
        }
    }
    Ok(())
}

/// Runs `edit` on a V04 QMD's fields; `Ok(false)` without touching other layouts (the edits below are the V04
/// layout's fields, and other layouts are rebuilt instead).
fn edit_v04(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    edit: impl FnOnce(&mut Writer<'_>) -> Result<(), QmdError>,
) -> Result<bool, QmdError> {
    if version != QmdVersion::V04 {
        return Ok(false);
    }
    edit(&mut Writer { words })?;
    Ok(true)
}

/// Points the per-launch fields of a QMD built by [`build`] at another launch: constant bank 0's address
/// and the release payload (the rest of a template stays as built). V04 only; other layouts are rebuilt.
pub fn patch_launch(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    cb0_va: u64,
    payload: Option<u64>,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        // Bank 5 follows bank 0 when it is bank 0's prefetch ([`prefetch_bank0`]).
        let follows = w.get(v04::CONSTANT_BUFFER_PREFETCH(PREFETCH_BANK))
            == u64::from(v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE)
            && w.bank(PREFETCH_BANK) == w.bank(0);
        w.set_bank_address(0, cb0_va)?;
        if follows {
            w.set_bank_address(PREFETCH_BANK, cb0_va)?;
        }
        if let Some(payload) = payload {
            set!(
                w,
                v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                payload & 0xffff_ffff
            );
            set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
        }
        Ok(())
    })
}

/// The index of the QMD word holding the low half of the release payload, the high half in the word after it
/// (V04 only): what a launch that reuses a slot's QMD rewrites, and nothing else.
pub fn release_payload_word(version: QmdVersion) -> Option<usize> {
    let (lo, hi) = (
        v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
        v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER,
    );
    let whole_word = |f: Field| f.lo.is_multiple_of(32) && f.width() == 32;
    (version == QmdVersion::V04 && whole_word(lo) && whole_word(hi) && hi.lo == lo.lo + 32)
        .then_some((lo.lo / 32) as usize)
}

/// Clears the QMD's constant-cache invalidation (V04 only; `Ok(false)` for other layouts), for QMDs whose constant banks
/// stay unchanged between runs, as libcuda's graph nodes are built: each invalidation makes the grid's first
/// constant loads miss. Whoever rewrites such a bank must invalidate the constant cache before the next run.
pub fn keep_constant_cache(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        set!(w, v04::INVALIDATE_SHADER_CONSTANT_CACHE, 0);
        Ok(())
    })
}

/// Makes a chain link a programmatic producer (V04 only; `Ok(false)` otherwise): its dependent may be scheduled
/// once every block has exited or run `griddepcontrol.launch_dependents` (ENABLE_PROGRAM_PRE_EXIT), and the grid
/// arrives at latch `latch` when it completes, which the dependent's `griddepcontrol.wait` waits on. The fields
/// libcuda sets for a programmatic edge of a graph (apex-trace of `probes/pdl.cu`, H100, 580.159.04).
pub fn set_latch_arrive(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    latch: u32,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
        set!(w, v04::ARRIVE_AT_LATCH_VALID, 1);
        set!(w, v04::ARRIVE_AT_LATCH_ID, latch);
        Ok(())
    })
}

/// Makes a QMD a programmatic consumer of latch `latch` (V04 only; `Ok(false)` otherwise): its
/// `griddepcontrol.wait` returns once the producer has arrived there, with the data and texture caches
/// invalidated, as libcuda builds the consumer of a programmatic graph edge.
pub fn set_latch_wait(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    latch: u32,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        set!(w, v04::WAIT_ON_LATCH_VALID, 1);
        set!(w, v04::WAIT_ON_LATCH_ID, latch);
        set!(w, v04::REQUIRE_SCHEDULING_PCAS, 1);
        set!(w, v04::LATCH_ACQUIRE_INVALIDATE_SHADER_DATA_CACHE, 1);
        set!(w, v04::LATCH_ACQUIRE_INVALIDATE_TEXTURE_DATA_CACHE, 1);
        Ok(())
    })
}

/// Makes an eager launch's QMD a possible programmatic producer (V04 only; `Ok(false)` otherwise), as libcuda
/// builds every launch on a stream (apex-trace of `probes/pdl_stream.cu`, H100, 580.159.04): once every block has
/// exited or run `griddepcontrol.launch_dependents` (ENABLE_PROGRAM_PRE_EXIT) the grid counts down `gate`, the
/// null grid built by [`set_gate`] that schedules the next launch if that one is programmatic; the grid arrives at
/// latch `latch` when it completes, for that launch's `griddepcontrol.wait`. Its own completion release is
/// unchanged, so an ordinary next launch waits for it as before.
pub fn set_gated_producer(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    gate: u64,
    latch: u32,
) -> Result<bool, QmdError> {
    if !set_latch_arrive(version, words, latch)? {
        return Ok(false);
    }
    edit_v04(version, words, |w| {
        set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
        set!(
            w,
            v04::DEPENDENT_QMD_ACTION(0),
            v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE
        );
        set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 1);
        set!(w, v04::DEPENDENT_QMD0_POINTER, gate >> 8);
        Ok(())
    })
}

/// Makes a QMD built by [`build`] the gate of a launch slot (V04 only; `Ok(false)` otherwise): a null grid with a
/// dependence count of two that schedules the QMD at `next` (the next slot's launch) when both the launch in its own
/// slot has pre-exited and the front end has counted it down (which it does only when that next launch is
/// programmatic), and that re-arms itself from its copy when it has run. libcuda's stream gates carry the same
/// fields (apex-trace of `probes/pdl_stream.cu`).
pub fn set_gate(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: u64,
) -> Result<bool, QmdError> {
    if !set_null_grid(version, words)? {
        return Ok(false);
    }
    edit_v04(version, words, |w| {
        for i in 0..2 {
            set!(w, v04::RELEASE_ENABLE(i), 0);
        }
        set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
        set!(
            w,
            v04::DEPENDENT_QMD_ACTION(0),
            v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE
        );
        set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 0);
        set!(w, v04::DEPENDENT_QMD0_POINTER, next >> 8);
        set!(w, v04::DEPENDENT_QMD_ENABLE(1), 0);
        set!(w, v04::DEPENDENCE_COUNTER, 2);
        set!(w, v04::SELF_COPY_ON_COMPLETION, 1);
        set!(w, v04::REQUIRE_SCHEDULING_PCAS, 0);
        set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
        set!(w, v04::ARRIVE_AT_LATCH_VALID, 0);
        set!(w, v04::WAIT_ON_LATCH_VALID, 0);
        set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_NONE);
        Ok(())
    })
}

/// How a chained QMD schedules the next one (DEPENDENT_QMD0_ACTION, with prefetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainAction {
    /// QMD_SCHEDULE: what libcuda's graphs use on Hopper (their QMDs never change between replays).
    Schedule,
    /// QMD_INVALIDATE_COPY_SCHEDULE: the next QMD is fetched afresh, for slots whose QMDs are rewritten.
    InvalidateCopySchedule,
}

/// Makes a QMD built by [`build`] (with a release) a link of a chain. With `next`, the compute work distributor
/// schedules the QMD at `next` once this grid has completed and its writes are visible GPU-wide (an L1 membar with
/// task chasing); this QMD releases nothing. Without, it is the chain's end: no dependent, its release enabled, and a sysmembar so
/// the CPU sees the grid's writes once it sees the release. The recipe is the one libcuda's graphs use on Hopper.
/// V04 only (returns false for other layouts).
pub fn set_chain_link(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: Option<(u64, ChainAction)>,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        match next {
            Some((va, action)) => {
                let action = match action {
                    ChainAction::Schedule => v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE,
                    ChainAction::InvalidateCopySchedule => {
                        v04::DEPENDENT_QMD_ACTION_QMD_INVALIDATE_COPY_SCHEDULE
                    }
                };
                set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
                set!(w, v04::DEPENDENT_QMD_ACTION(0), action);
                set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 1);
                set!(w, v04::DEPENDENT_QMD0_POINTER, va >> 8);
                set!(w, v04::RELEASE_ENABLE(0), 0);
                set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_MEMBAR);
                set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, 1);
                // Pre-exit would let the next grid be scheduled once every block has exited, before this grid's writes
                // are known to be visible: programmatic dependent launch, for consumers that wait for their producer
                // themselves (griddepcontrol.wait). libcuda's graph nodes leave it off, and so does an ordinary link
                // (measured on the H100: with it, a chain of empty kernels ran at 0.57 µs per link, without 0.84 µs).
                set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
            }
            None => {
                set!(w, v04::DEPENDENT_QMD_ENABLE(0), 0);
                set!(w, v04::DEPENDENT_QMD_ACTION(0), 0);
                set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 0);
                set!(w, v04::DEPENDENT_QMD0_POINTER, 0);
                set!(w, v04::RELEASE_ENABLE(0), 1);
                set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
                set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, 0);
                // As `build` leaves it (and libcuda's stream launches): with no dependent it changes nothing.
                set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
            }
        }
        Ok(())
    })
}

/// The constant bank [`prefetch_bank0`] binds bank 0 again as.
const PREFETCH_BANK: u32 = 5;

/// Binds constant bank 0 a second time as bank 5 with PREFETCH_PRE, unless the kernel binds bank 5 itself (V04 only;
/// returns false otherwise): the work distributor then fetches the launch's parameters and driver words before the
/// grid starts, as libcuda's stream launches ask (their QMDs bind bank 5 at bank 0's address, research
/// hopper-launch.md §5). [`patch_launch`] moves both together.
pub fn prefetch_bank0(version: QmdVersion, words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| match w.bank(0) {
        Some(cb0) => w.bind_prefetch(
            PREFETCH_BANK,
            cb0,
            v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE,
        ),
        None => Ok(()),
    })
}

/// The constant bank [`prefetch_next_bank`] binds the next launch's bank 0 as.
const NEXT_BANK: u32 = 6;

/// Binds `next` (the constant bank 0 of the QMD this one schedules when it completes) as bank 6 with PREFETCH_POST,
/// unless the kernel binds bank 6 itself (V04 only; returns false otherwise): the work distributor fetches it while
/// this grid finishes, as libcuda's graph nodes do for their dependents.
pub fn prefetch_next_bank(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: ConstBuffer,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        w.bind_prefetch(NEXT_BANK, next, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_POST)
    })
}

/// What a completed grid does to one of its dependent QMDs (DEPENDENT_QMD_ACTION, with prefetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DependentAction {
    /// QMD_SCHEDULE: schedules a dependent with no other predecessor.
    Schedule,
    /// QMD_DECREMENT_DEPENDENCE: counts one predecessor of a fan-in down; the dependent is scheduled when its
    /// counter reaches zero.
    Decrement,
}

/// How a node of a graph resolved on the GPU is built (see [`set_graph_node`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphNodeForm {
    /// Up to two dependents, scheduled or counted down when this grid has completed.
    pub dependents: [Option<(u64, DependentAction)>; 2],
    /// DEPENDENCE_COUNTER: the predecessors that count this node down (0 unless it is a fan-in).
    pub counter: u16,
    /// Scheduled by its predecessors rather than sent: the node waits, once armed by a copying PCAS, for them
    /// (REQUIRE_SCHEDULING_PCAS) and re-arms itself when it completes (SELF_COPY_ON_COMPLETION).
    pub armed: bool,
    /// A sink: when the grid has completed and its writes are visible to the CPU, add 1 to the 32-bit word here.
    pub done: Option<u64>,
    /// Constant bank 0 of each dependent that is a launch: bound as banks 5 and 6 (when the kernel leaves them
    /// free) to be prefetched once this grid has completed, as libcuda's graph nodes do.
    pub prefetch: [Option<ConstBuffer>; 2],
}

/// Makes a QMD built by [`build`] a node of a graph whose dependencies the compute work distributor resolves
/// itself, as libcuda's graphs are built on Hopper (apex-trace of `probes/graph_fan.cu`, H100, 580.159.04): every
/// node but the roots is armed once by a PCAS that copies its counter, then scheduled by its only predecessor or
/// by the last of its fan-in's decrements, and re-arms itself on completion for the next replay. A node with
/// dependents makes its writes visible GPU-wide first (an L1 membar with task chasing); a sink makes them visible
/// to the system, then adds 1 to the graph's completion word. V04 only (returns false for other layouts).
pub fn set_graph_node(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    form: &GraphNodeForm,
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        let slots = [
            (v04::DEPENDENT_QMD0_POINTER, form.dependents[0]),
            (v04::DEPENDENT_QMD1_POINTER, form.dependents[1]),
        ];
        for (i, (pointer, dep)) in (0u32..).zip(slots) {
            let (va, action) = match dep {
                Some((va, DependentAction::Schedule)) => {
                    (va, v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE)
                }
                Some((va, DependentAction::Decrement)) => {
                    (va, v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE)
                }
                None => (0, 0),
            };
            let on = u64::from(dep.is_some());
            set!(w, v04::DEPENDENT_QMD_ENABLE(i), on);
            set!(w, v04::DEPENDENT_QMD_ACTION(i), action);
            set!(w, v04::DEPENDENT_QMD_PREFETCH(i), on);
            w.set("DEPENDENT_QMD_POINTER", pointer, va >> 8)?;
        }
        let chases = form.dependents.iter().any(Option::is_some);
        set!(
            w,
            v04::CWD_MEMBAR_TYPE,
            if form.done.is_some() {
                v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR
            } else if chases {
                v04::CWD_MEMBAR_TYPE_L1_MEMBAR
            } else {
                v04::CWD_MEMBAR_TYPE_L1_NONE
            }
        );
        set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, u64::from(chases));
        // Pre-exit is programmatic launch ([`set_latch_arrive`] sets it for a producer whose consumer waits itself).
        set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
        for (i, bank) in (5u32..).zip(form.prefetch) {
            if let Some(cb) = bank {
                w.bind_prefetch(i, cb, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_POST)?;
            }
        }
        // A root's own bank is fetched before it starts (the others' were prefetched by their predecessors).
        if !form.armed {
            set!(
                w,
                v04::CONSTANT_BUFFER_PREFETCH(0),
                v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE
            );
        }
        set!(w, v04::DEPENDENCE_COUNTER, form.counter);
        set!(w, v04::REQUIRE_SCHEDULING_PCAS, u64::from(form.armed));
        set!(w, v04::SELF_COPY_ON_COMPLETION, u64::from(form.armed));
        match form.done {
            Some(va) => {
                set!(w, v04::RELEASE_ENABLE(0), 1);
                set!(
                    w,
                    v04::RELEASE_STRUCTURE_SIZE(0),
                    v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD
                );
                set!(w, v04::RELEASE_PAYLOAD64B(0), 0);
                set!(w, v04::RELEASE_REDUCTION_ENABLE(0), 1);
                set!(
                    w,
                    v04::RELEASE_REDUCTION_OP(0),
                    v04::RELEASE_REDUCTION_OP_RED_ADD
                );
                set!(
                    w,
                    v04::RELEASE_REDUCTION_FORMAT(0),
                    v04::RELEASE_REDUCTION_FORMAT_UNSIGNED
                );
                set!(w, v04::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
                set!(w, v04::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
                set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER, 1);
                set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, 0);
            }
            None => set!(w, v04::RELEASE_ENABLE(0), 0),
        }
        Ok(())
    })
}

/// The instructions a QMD prefetches for a program of `bytes` bytes at `va`: a 256-byte-aligned start and a length in
/// 256-byte units, at most the field's 9 bits; `None` for no code.
pub fn program_prefetch_range(va: u64, bytes: u64) -> Option<(u64, u64)> {
    (bytes > 0).then(|| {
        let start = va & !0xff;
        (start, (va + bytes - start).div_ceil(256).min(0x1ff))
    })
}

/// Has the work distributor fetch the QMD's own constant bank 0 before the grid starts (V04 only; `Ok(false)`
/// otherwise): for a node scheduled before its predecessor's completion (a programmatic consumer, started at the
/// predecessor's pre-exit), whose bank a POST prefetch by that predecessor would reach too late. libcuda's
/// programmatic graph nodes carry it.
pub fn prefetch_own_bank0(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        set!(
            w,
            v04::CONSTANT_BUFFER_PREFETCH(0),
            v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE
        );
        Ok(())
    })
}

/// Makes a QMD built by [`build`] a null grid (V04 only; returns false otherwise): no blocks, so it completes as
/// soon as it is scheduled and only performs its dependent actions. libcuda spreads a fan-out wider than the two
/// dependents a QMD has over such grids.
pub fn set_null_grid(version: QmdVersion, words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
    edit_v04(version, words, |w| {
        set!(w, v04::GRID_WIDTH, 0);
        set!(w, v04::GRID_HEIGHT, 0);
        set!(w, v04::GRID_DEPTH, 0);
        set!(w, v04::PROGRAM_PREFETCH_SIZE, 0);
        Ok(())
    })
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
