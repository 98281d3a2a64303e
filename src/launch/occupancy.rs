//! Launch advisor: exact occupancy of a kernel and block size on one SM, the factor that limits it,
//! and advice for launch shapes that leave the GPU idle.
//!
//! The arithmetic follows NVIDIA's occupancy calculator (`cuda_occupancy.h`, the logic behind
//! `cuOccupancyMaxActiveBlocksPerMultiprocessor`) for the default shared-memory carveout:
//!
//! - warps: `max_warps_per_sm / ceil(threads / 32)`;
//! - blocks: the per-SM block slots;
//! - registers: allocated per warp in units of 256, per SM sub-partition (4 per SM): a sub-partition
//!   of `regs_per_sm / 4` registers holds `floor(that / regs_per_warp)` warps; a block whose warps,
//!   rounded up to a multiple of 4, need more than `regs_per_block` cannot launch at all;
//! - shared memory: `round_up(static + reserved + dynamic, 128)` per block out of the SM's shared
//!   memory (the largest carveout), where `reserved` is the 1 KiB per block the driver keeps since
//!   Ampere. sm_90 cubins already hold that 1 KiB in their `.nv.shared.<kernel>` section
//!   (`__nv_reservedSMEM`), so it is counted once ([`KernelResources::reserve_in_static`]).

use std::fmt;

use crate::hw::Generation;

/// What one SM of a compute capability offers (CUDA Programming Guide, "Technical Specifications per
/// Compute Capability"; `cuda_occupancy.h` for the allocation units).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceLimits {
    /// `major * 10 + minor`, e.g. 90.
    pub sm: u32,
    /// Streaming multiprocessors on the device (132 on an H100 SXM / H200).
    pub sm_count: u32,
    /// Threads per warp (32).
    pub warp_size: u32,
    /// The most threads one block may have (1024).
    pub max_threads_per_block: u32,
    /// The most warps an SM holds at once (64 on Hopper).
    pub max_warps_per_sm: u32,
    /// The most blocks an SM holds at once (32 on Hopper).
    pub max_blocks_per_sm: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// Registers one block may hold.
    pub regs_per_block: u32,
    /// Registers are allocated per warp in units of this many.
    pub reg_alloc_unit: u32,
    /// The most registers one thread may use (255).
    pub max_regs_per_thread: u32,
    /// Register file partitions per SM (one per warp scheduler).
    pub sub_partitions: u32,
    /// Shared memory per SM at the largest carveout, bytes.
    pub smem_per_sm: u32,
    /// Shared memory a block may use without opting in (`MAX_DYNAMIC_SHARED_SIZE_BYTES`), bytes.
    pub smem_per_block: u32,
    /// Shared memory a block may use after opting in, bytes (excluding the driver's reserve).
    pub smem_per_block_optin: u32,
    /// Shared memory the driver reserves per block, bytes.
    pub reserved_smem_per_block: u32,
    /// Shared memory is allocated per block in units of this many bytes.
    pub smem_alloc_unit: u32,
    /// The shared-memory carveouts the SM can be configured with, KiB, ascending.
    pub carveouts_kib: &'static [u32],
}

const KIB: u32 = 1024;

impl DeviceLimits {
    /// Limits of compute capability `sm` with `sm_count` SMs, from the GPU-generation table
    /// ([`crate::hw::generation`]); `None` for one the table does not know.
    pub fn for_sm(sm: u32, sm_count: u32) -> Option<Self> {
        Generation::for_sm(sm).map(|g| DeviceLimits::for_generation(g, sm_count))
    }

    /// Limits of generation `g` with `sm_count` SMs.
    pub fn for_generation(g: &Generation, sm_count: u32) -> Self {
        let l = &g.limits;
        DeviceLimits {
            sm: g.sm_version,
            sm_count,
            warp_size: 32,
            max_threads_per_block: l.max_threads_per_block,
            max_warps_per_sm: l.max_warps_per_sm,
            max_blocks_per_sm: l.max_blocks_per_sm,
            regs_per_sm: l.regs_per_sm,
            regs_per_block: l.regs_per_block,
            reg_alloc_unit: l.reg_alloc_unit,
            max_regs_per_thread: l.max_regs_per_thread,
            sub_partitions: l.sub_partitions,
            smem_per_sm: g.smem_per_sm_kib() * KIB,
            smem_per_block: l.smem_per_block_kib * KIB,
            smem_per_block_optin: l.smem_per_block_optin_kib * KIB,
            reserved_smem_per_block: l.reserved_smem_per_block,
            smem_alloc_unit: l.smem_alloc_unit,
            carveouts_kib: g.carveouts_kib,
        }
    }

    /// Registers allocated to one warp of a kernel using `regs` registers per thread.
    pub fn regs_per_warp(&self, regs: u32) -> u32 {
        round_up(regs * self.warp_size, self.reg_alloc_unit)
    }

    /// Blocks of `warps` warps whose registers fit one SM; `None` when registers do not limit
    /// (a kernel with no registers).
    fn blocks_by_registers(&self, regs: u32, warps: u32) -> Option<u32> {
        let per_warp = self.regs_per_warp(regs);
        if per_warp == 0 {
            return None;
        }
        let warps_per_partition = self.regs_per_sm / self.sub_partitions / per_warp;
        Some(warps_per_partition * self.sub_partitions / warps)
    }
}

/// What a kernel needs per thread and per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelResources {
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory, bytes, as the cubin has it (`KernelInfo::static_shared`).
    pub static_shared: u32,
    /// `static_shared` already contains the driver's per-block reserve (sm_90+ cubins, whose
    /// compiler places it at shared address 0), so it must not be added again.
    pub reserve_in_static: bool,
}

impl KernelResources {
    /// A kernel of `registers` registers per thread and `static_shared` bytes of static shared memory, which already
    /// hold the driver's per-block reserve if `reserve_in_static` (see the fields).
    pub const fn new(registers: u32, static_shared: u32, reserve_in_static: bool) -> Self {
        KernelResources {
            registers,
            static_shared,
            reserve_in_static,
        }
    }

    /// Resources of a cubin kernel; `cubin_sm` is the cubin's SM version (`Cubin::sm_version`).
    pub fn from_kernel(kernel: &crate::module::cubin::KernelInfo, cubin_sm: u32) -> Self {
        let static_shared = u32::try_from(kernel.static_shared).unwrap_or(u32::MAX);
        KernelResources {
            registers: kernel.registers,
            static_shared,
            // sm_90 compilers emit `.nv.reservedSmem` and size every `.nv.shared.<kernel>` to include it.
            reserve_in_static: cubin_sm >= 90 && static_shared >= KIB,
        }
    }

    /// Shared memory of one block before rounding: kernel static + driver reserve + dynamic.
    pub fn shared_per_block(&self, limits: &DeviceLimits, dynamic_smem: u32) -> u64 {
        let reserve = if self.reserve_in_static {
            0
        } else {
            u64::from(limits.reserved_smem_per_block)
        };
        u64::from(self.static_shared) + reserve + u64::from(dynamic_smem)
    }
}

/// Why a launch shape cannot run at all.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OccupancyError {
    /// A block of zero threads.
    #[error("a block of 0 threads cannot run; give the block at least one thread")]
    EmptyBlock,
    /// More threads per block than the device allows.
    #[error(
        "{threads} threads per block exceed the device's {max}; use a block of at most {max} threads"
    )]
    BlockTooLarge {
        /// Threads asked for.
        threads: u32,
        /// The device's maximum.
        max: u32,
    },
    /// More registers per thread than the device allows.
    #[error(
        "{registers} registers per thread exceed the device's {max}; compile with -maxrregcount={max} or less"
    )]
    TooManyRegisters {
        /// The kernel's registers per thread.
        registers: u32,
        /// The device's maximum.
        max: u32,
    },
    /// The block's registers do not fit one SM.
    #[error(
        "a block needs {needed} registers ({per_warp} per warp × {warps} warps, rounded to {sub_partitions} sub-partitions), the device allows {max} per block; use a smaller block or fewer registers (-maxrregcount)"
    )]
    RegistersPerBlock {
        /// Registers the block needs.
        needed: u32,
        /// Registers per warp, after allocation granularity.
        per_warp: u32,
        /// Warps in the block.
        warps: u32,
        /// Register-file sub-partitions per SM.
        sub_partitions: u32,
        /// The device's maximum per block.
        max: u32,
    },
    /// The block's shared memory does not fit one SM.
    #[error(
        "a block needs {needed} bytes of shared memory (with the driver's reserve), the device allows {max}; use less dynamic shared memory"
    )]
    SharedPerBlock {
        /// Bytes the block needs.
        needed: u64,
        /// The device's maximum per block.
        max: u64,
    },
}

/// A resource that caps the blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limiter {
    /// Resident warps per SM.
    Warps,
    /// Resident blocks per SM.
    Blocks,
    /// The register file.
    Registers,
    /// Shared memory.
    SharedMemory,
}

impl fmt::Display for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limiter::Warps => "warps",
            Limiter::Blocks => "blocks",
            Limiter::Registers => "registers",
            Limiter::SharedMemory => "shared memory",
        })
    }
}

/// Occupancy of one launch shape on one SM.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Occupancy {
    /// Blocks resident per SM.
    pub active_blocks: u32,
    /// Warps resident per SM.
    pub active_warps: u32,
    /// `active_warps / max_warps_per_sm`.
    pub fraction: f64,
    /// Warps in one block (its threads rounded up to whole warps).
    pub warps_per_block: u32,
    /// Blocks per SM the warp limit allows.
    pub by_warps: u32,
    /// Blocks per SM the block limit allows.
    pub by_blocks: u32,
    /// Blocks per SM the register file allows; `None` where registers do not limit (a kernel using none).
    pub by_registers: Option<u32>,
    /// Blocks per SM shared memory allows.
    pub by_shared: u32,
    /// Registers allocated per warp (rounded to the allocation unit).
    pub regs_per_warp: u32,
    /// Registers allocated per block.
    pub regs_per_block: u32,
    /// Shared memory allocated per block, bytes (with the reserve, rounded to the allocation unit).
    pub shared_per_block: u32,
    /// Every resource whose limit equals `active_blocks`.
    pub limiters: Vec<Limiter>,
    /// The smallest carveout, KiB, that holds `active_blocks` blocks' shared memory: the
    /// configuration the driver can pick without losing occupancy.
    pub carveout_kib: u32,
}

impl fmt::Display for Occupancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} blocks/SM, {} warps/SM ({:.1}%), limited by {}; limits: warps {}, blocks {}, registers {}, shared memory {} ({} regs/warp, {} B smem/block, carveout {} KiB)",
            self.active_blocks,
            self.active_warps,
            self.fraction * 100.0,
            self.limiters
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" and "),
            self.by_warps,
            self.by_blocks,
            self.by_registers
                .map_or_else(|| "unlimited".to_string(), |b| b.to_string()),
            self.by_shared,
            self.regs_per_warp,
            self.shared_per_block,
            self.carveout_kib,
        )
    }
}

fn round_up(x: u32, unit: u32) -> u32 {
    x.div_ceil(unit) * unit
}

/// Blocks per SM, warps per SM and what limits them, for `kernel` launched with blocks of
/// `block_threads` threads and `dynamic_smem` bytes of dynamic shared memory.
pub fn occupancy(
    limits: &DeviceLimits,
    kernel: &KernelResources,
    block_threads: u32,
    dynamic_smem: u32,
) -> Result<Occupancy, OccupancyError> {
    if block_threads == 0 {
        return Err(OccupancyError::EmptyBlock);
    }
    if block_threads > limits.max_threads_per_block {
        return Err(OccupancyError::BlockTooLarge {
            threads: block_threads,
            max: limits.max_threads_per_block,
        });
    }
    if kernel.registers > limits.max_regs_per_thread {
        return Err(OccupancyError::TooManyRegisters {
            registers: kernel.registers,
            max: limits.max_regs_per_thread,
        });
    }
    let warps = block_threads.div_ceil(limits.warp_size);
    let regs_per_warp = limits.regs_per_warp(kernel.registers);
    // The hardware checks the per-block register limit as if every sub-partition got the same
    // number of warps (cuda_occupancy.h: "regsAssumedPerCTA").
    let assumed = regs_per_warp * round_up(warps, limits.sub_partitions);
    if assumed > limits.regs_per_block {
        return Err(OccupancyError::RegistersPerBlock {
            needed: assumed,
            per_warp: regs_per_warp,
            warps,
            sub_partitions: limits.sub_partitions,
            max: limits.regs_per_block,
        });
    }
    let smem = kernel.shared_per_block(limits, dynamic_smem);
    let smem_alloc =
        smem.div_ceil(u64::from(limits.smem_alloc_unit)) * u64::from(limits.smem_alloc_unit);
    let smem_max =
        u64::from(limits.smem_per_block_optin) + u64::from(limits.reserved_smem_per_block);
    if smem_alloc > smem_max {
        return Err(OccupancyError::SharedPerBlock {
            needed: smem_alloc,
            max: smem_max,
        });
    }
    let smem_alloc = smem_alloc as u32; // <= smem_max, which is a u32 sum
    let by_warps = limits.max_warps_per_sm / warps;
    let by_blocks = limits.max_blocks_per_sm;
    let by_registers = limits.blocks_by_registers(kernel.registers, warps);
    let by_shared = limits
        .smem_per_sm
        .checked_div(smem_alloc)
        .unwrap_or(u32::MAX);
    let active = by_warps
        .min(by_blocks)
        .min(by_registers.unwrap_or(u32::MAX))
        .min(by_shared);
    let mut limiters = Vec::new();
    for (limit, which) in [
        (Some(by_warps), Limiter::Warps),
        (Some(by_blocks), Limiter::Blocks),
        (by_registers, Limiter::Registers),
        (Some(by_shared), Limiter::SharedMemory),
    ] {
        if limit == Some(active) {
            limiters.push(which);
        }
    }
    let need_kib = (u64::from(active) * u64::from(smem_alloc)).div_ceil(u64::from(KIB));
    let carveout_kib = limits
        .carveouts_kib
        .iter()
        .copied()
        .find(|&c| u64::from(c) >= need_kib)
        .unwrap_or(limits.smem_per_sm / KIB);
    let active_warps = active * warps;
    Ok(Occupancy {
        active_blocks: active,
        active_warps,
        fraction: f64::from(active_warps) / f64::from(limits.max_warps_per_sm),
        warps_per_block: warps,
        by_warps,
        by_blocks,
        by_registers,
        by_shared,
        regs_per_warp,
        regs_per_block: regs_per_warp * warps,
        shared_per_block: smem_alloc,
        limiters,
        carveout_kib,
    })
}

/// One piece of advice about a launch shape, with the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Advice {
    /// The shape cannot launch.
    Invalid(OccupancyError),
    /// The grid cannot fill the GPU: `grid_blocks < sm_count × active_blocks`.
    TooFewBlocks {
        /// Blocks in the grid.
        grid_blocks: u64,
        /// SMs on the device.
        sm_count: u32,
        /// Blocks one SM holds at once.
        active_blocks: u32,
        /// SMs that get no block at all.
        idle_sms: u32,
    },
    /// Registers cap occupancy below what the other resources allow.
    RegisterLimited {
        /// Registers per thread the kernel uses.
        registers: u32,
        /// Blocks one SM holds at once.
        active_blocks: u32,
        /// Blocks per SM the other resources would allow.
        others_allow: u32,
        /// Registers per thread that would give one more block per SM, and that block count.
        next_step: Option<(u32, u32)>,
        /// Registers per thread that would reach `others_allow`.
        to_reach_others: Option<u32>,
    },
    /// Shared memory caps occupancy below what the other resources allow.
    SharedLimited {
        /// Shared memory allocated per block, bytes (static, dynamic and the reserve, rounded).
        shared_per_block: u32,
        /// Dynamic shared memory per block the launch asks for, bytes.
        dynamic_smem: u32,
        /// Blocks one SM holds at once.
        active_blocks: u32,
        /// Blocks per SM the other resources would allow.
        others_allow: u32,
        /// Dynamic shared memory per block that would give one more block per SM, and that count.
        next_step: Option<(u32, u32)>,
        /// Dynamic shared memory per block that would reach `others_allow`.
        to_reach_others: Option<u32>,
    },
    /// `threads % 32 != 0`: the last warp of every block runs with idle lanes.
    PartialWarp {
        /// Threads per block.
        block_threads: u32,
        /// Warps per block.
        warps: u32,
        /// Lanes of the last warp that run no thread.
        idle_lanes: u32,
    },
    /// More than the default 48 KiB of shared memory per block: the kernel must opt in first.
    NeedsOptIn {
        /// Shared memory per block the launch needs, bytes.
        shared_bytes: u64,
        /// What a block may use without opting in, bytes.
        default_max: u32,
    },
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Advice::Invalid(e) => write!(f, "cannot launch: {e}"),
            Advice::TooFewBlocks {
                grid_blocks,
                sm_count,
                active_blocks,
                idle_sms,
            } => {
                let capacity = u64::from(*sm_count) * u64::from(*active_blocks);
                write!(
                    f,
                    "too few blocks: the grid has {grid_blocks}, the GPU holds {capacity} at once ({sm_count} SMs × {active_blocks} blocks/SM)"
                )?;
                if *idle_sms > 0 {
                    write!(f, "; {idle_sms} SMs get no block")?;
                }
                Ok(())
            }
            Advice::RegisterLimited {
                registers,
                active_blocks,
                others_allow,
                next_step,
                to_reach_others,
            } => {
                write!(
                    f,
                    "registers limit occupancy: {registers} regs/thread allow {active_blocks} blocks/SM, the other resources {others_allow}"
                )?;
                if let Some((r, b)) = next_step {
                    write!(f, "; ≤ {r} regs/thread would allow {b}")?;
                }
                if let Some(r) = to_reach_others {
                    write!(
                        f,
                        "; ≤ {r} regs/thread would allow {others_allow} (__launch_bounds__ or -maxrregcount)"
                    )?;
                }
                Ok(())
            }
            Advice::SharedLimited {
                shared_per_block,
                dynamic_smem,
                active_blocks,
                others_allow,
                next_step,
                to_reach_others,
            } => {
                write!(
                    f,
                    "shared memory limits occupancy: {shared_per_block} B/block ({dynamic_smem} B dynamic) allow {active_blocks} blocks/SM, the other resources {others_allow}"
                )?;
                if let Some((d, b)) = next_step {
                    write!(f, "; ≤ {d} B dynamic would allow {b}")?;
                }
                if let Some(d) = to_reach_others {
                    write!(f, "; ≤ {d} B dynamic would allow {others_allow}")?;
                }
                Ok(())
            }
            Advice::PartialWarp {
                block_threads,
                warps,
                idle_lanes,
            } => write!(
                f,
                "{block_threads} threads per block are not a multiple of 32: {warps} warps with {idle_lanes} idle lanes per block ({:.1}% of the lanes)",
                f64::from(*idle_lanes) * 100.0 / f64::from(warps * 32)
            ),
            Advice::NeedsOptIn {
                shared_bytes,
                default_max,
            } => write!(
                f,
                "{shared_bytes} B of shared memory per block exceed the default {default_max} B: set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first"
            ),
        }
    }
}

/// Advice for launching `kernel` as `grid_blocks` blocks of `block_threads` threads with
/// `dynamic_smem` bytes of dynamic shared memory. Empty when nothing is wrong.
pub fn advise(
    limits: &DeviceLimits,
    kernel: &KernelResources,
    grid_blocks: u64,
    block_threads: u32,
    dynamic_smem: u32,
) -> Vec<Advice> {
    let mut out = Vec::new();
    if !block_threads.is_multiple_of(limits.warp_size)
        && block_threads <= limits.max_threads_per_block
    {
        let warps = block_threads.div_ceil(limits.warp_size);
        out.push(Advice::PartialWarp {
            block_threads,
            warps,
            idle_lanes: warps * limits.warp_size - block_threads,
        });
    }
    let occ = match occupancy(limits, kernel, block_threads, dynamic_smem) {
        Ok(o) => o,
        Err(e) => {
            out.push(Advice::Invalid(e));
            return out;
        }
    };
    // What the program asked for, without the driver's reserve.
    let reserve_held = if kernel.reserve_in_static {
        limits.reserved_smem_per_block
    } else {
        0
    };
    let user_smem =
        u64::from(kernel.static_shared.saturating_sub(reserve_held)) + u64::from(dynamic_smem);
    if user_smem > u64::from(limits.smem_per_block) {
        out.push(Advice::NeedsOptIn {
            shared_bytes: user_smem,
            default_max: limits.smem_per_block,
        });
    }
    let by_regs = occ.by_registers.unwrap_or(u32::MAX);
    let not_regs = occ.by_warps.min(occ.by_blocks).min(occ.by_shared);
    if by_regs < not_regs {
        // Fewer registers per thread: search downwards (allocation moves in steps of 8 per thread).
        let blocks_at = |r: u32| {
            limits
                .blocks_by_registers(r, occ.warps_per_block)
                .unwrap_or(u32::MAX)
        };
        let find = |target: u32| {
            (0..kernel.registers)
                .rev()
                .find(|&r| blocks_at(r) >= target)
        };
        let next = find(by_regs + 1).map(|r| (r, blocks_at(r).min(not_regs)));
        out.push(Advice::RegisterLimited {
            registers: kernel.registers,
            active_blocks: by_regs,
            others_allow: not_regs,
            next_step: next,
            to_reach_others: find(not_regs),
        });
    }
    let not_smem = occ.by_warps.min(occ.by_blocks).min(by_regs);
    if occ.by_shared < not_smem {
        // Largest dynamic size whose rounded block allocation fits `n` blocks in the SM.
        let dyn_for = |n: u32| -> Option<u32> {
            let per_block =
                limits.smem_per_sm / n / limits.smem_alloc_unit * limits.smem_alloc_unit;
            let fixed = kernel.shared_per_block(limits, 0);
            u64::from(per_block).checked_sub(fixed).map(|d| d as u32)
        };
        out.push(Advice::SharedLimited {
            shared_per_block: occ.shared_per_block,
            dynamic_smem,
            active_blocks: occ.by_shared,
            others_allow: not_smem,
            next_step: dyn_for(occ.by_shared + 1).map(|d| (d, occ.by_shared + 1)),
            to_reach_others: dyn_for(not_smem),
        });
    }
    let capacity = u64::from(limits.sm_count) * u64::from(occ.active_blocks);
    if grid_blocks < capacity {
        out.push(Advice::TooFewBlocks {
            grid_blocks,
            sm_count: limits.sm_count,
            active_blocks: occ.active_blocks,
            idle_sms: u64::from(limits.sm_count).saturating_sub(grid_blocks) as u32,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> DeviceLimits {
        DeviceLimits::for_sm(90, 132).unwrap()
    }

    /// An sm_90 kernel: its static shared memory holds the 1 KiB reserve.
    fn k90(registers: u32, user_static: u32) -> KernelResources {
        KernelResources {
            registers,
            static_shared: 1024 + user_static,
            reserve_in_static: true,
        }
    }

    #[test]
    fn full_occupancy_limited_by_warps() {
        // empty: 4 regs → 128 → 256 regs/warp; 16384/256 = 64 warps per partition → 256/SM → 8 blocks
        // of 32 warps; shared 1 KiB → 228 blocks; warps 64/32 = 2.
        let o = occupancy(&h200(), &k90(4, 0), 1024, 0).unwrap();
        assert_eq!((o.active_blocks, o.active_warps), (2, 64));
        assert_eq!(o.fraction, 1.0);
        assert_eq!(o.limiters, vec![Limiter::Warps]);
        assert_eq!(
            (o.by_warps, o.by_blocks, o.by_registers, o.by_shared),
            (2, 32, Some(8), 228)
        );
        assert_eq!(o.regs_per_warp, 256);
        assert_eq!(o.shared_per_block, 1024);
        // 2 KiB in use → the 8 KiB carveout holds it.
        assert_eq!(o.carveout_kib, 8);
    }

    #[test]
    fn small_blocks_limited_by_block_slots() {
        // 32 threads: warps allow 64, block slots 32.
        let o = occupancy(&h200(), &k90(8, 0), 32, 0).unwrap();
        assert_eq!((o.active_blocks, o.active_warps), (32, 32));
        assert_eq!(o.fraction, 0.5);
        assert_eq!(o.limiters, vec![Limiter::Blocks]);
    }

    #[test]
    fn registers_limit_and_what_lifts_them() {
        // 64 regs → 2048/warp; 16384/2048 = 8 warps per partition → 32/SM → 8 blocks of 4 warps.
        let l = h200();
        let k = k90(64, 0);
        let o = occupancy(&l, &k, 128, 0).unwrap();
        assert_eq!((o.active_blocks, o.active_warps), (8, 32));
        assert_eq!(o.limiters, vec![Limiter::Registers]);
        assert_eq!(o.by_warps, 16);
        let advice = advise(&l, &k, 10_000, 128, 0);
        // 9 blocks need 36 warps = 9 per partition → ≤ 1820 regs/warp → 1792 → 56 regs/thread;
        // 16 blocks need 16 per partition → ≤ 1024 regs/warp → 32 regs/thread.
        assert_eq!(
            advice,
            vec![Advice::RegisterLimited {
                registers: 64,
                active_blocks: 8,
                others_allow: 16,
                next_step: Some((56, 9)),
                to_reach_others: Some(32),
            }]
        );
        assert!(
            advice[0]
                .to_string()
                .contains("≤ 32 regs/thread would allow 16")
        );
    }

    #[test]
    fn shared_memory_limit() {
        // 1 KiB static + 48 KiB dynamic = 50176 B (a multiple of 128); 233472 / 50176 = 4 blocks.
        let l = h200();
        let k = k90(16, 0);
        let o = occupancy(&l, &k, 256, 48 * 1024).unwrap();
        assert_eq!((o.active_blocks, o.active_warps, o.fraction), (4, 32, 0.5));
        assert_eq!(o.limiters, vec![Limiter::SharedMemory]);
        assert_eq!(o.shared_per_block, 50176);
        // 4 × 49 KiB = 196 KiB: the 196 KiB carveout.
        assert_eq!(o.carveout_kib, 196);
        let advice = advise(&l, &k, 100_000, 256, 48 * 1024);
        // 5 blocks: 233472/5 = 46694 → 46592 per block → 45568 dynamic; 8 blocks: 29184 → 28160.
        assert_eq!(
            advice,
            vec![Advice::SharedLimited {
                shared_per_block: 50176,
                dynamic_smem: 48 * 1024,
                active_blocks: 4,
                others_allow: 8,
                next_step: Some((45568, 5)),
                to_reach_others: Some(28160),
            }]
        );
    }

    #[test]
    fn shared_memory_rounds_to_128_bytes() {
        // 1024 + 1 → 1152 per block: 233472 / 1152 = 202.
        let o = occupancy(&h200(), &k90(8, 0), 32, 1).unwrap();
        assert_eq!(o.shared_per_block, 1152);
        assert_eq!(o.by_shared, 202);
    }

    #[test]
    fn sm80_adds_the_reserve() {
        // sm_80 cubins do not hold the reserve: 0 static + 1 KiB reserve + 2 KiB dynamic = 3 KiB;
        // 164 KiB / 3 KiB = 54; block slots 32.
        let l = DeviceLimits::for_sm(80, 108).unwrap();
        let k = KernelResources {
            registers: 32,
            static_shared: 0,
            reserve_in_static: false,
        };
        let o = occupancy(&l, &k, 64, 2048).unwrap();
        assert_eq!(o.shared_per_block, 3072);
        assert_eq!(o.by_shared, 54);
        assert_eq!(o.active_blocks, 32);
    }

    #[test]
    fn partial_warps_and_small_grids() {
        let l = h200();
        let k = k90(8, 0);
        let advice = advise(&l, &k, 100, 100, 0);
        // 100 threads → 4 warps, 28 idle lanes; warps allow 16 blocks/SM → capacity 2112 > 100.
        assert_eq!(
            advice[0],
            Advice::PartialWarp {
                block_threads: 100,
                warps: 4,
                idle_lanes: 28
            }
        );
        assert_eq!(
            advice[1],
            Advice::TooFewBlocks {
                grid_blocks: 100,
                sm_count: 132,
                active_blocks: 16,
                idle_sms: 32
            }
        );
        assert!(advice[1].to_string().contains("32 SMs get no block"));
        assert!(advise(&l, &k, 132 * 16, 128, 0).is_empty());
    }

    #[test]
    fn shapes_that_cannot_launch() {
        let l = h200();
        assert_eq!(
            occupancy(&l, &k90(8, 0), 0, 0),
            Err(OccupancyError::EmptyBlock)
        );
        assert!(matches!(
            occupancy(&l, &k90(8, 0), 1025, 0),
            Err(OccupancyError::BlockTooLarge { .. })
        ));
        assert!(matches!(
            occupancy(&l, &k90(256, 0), 32, 0),
            Err(OccupancyError::TooManyRegisters { .. })
        ));
        // 255 regs → 8192/warp × 32 warps = 262144 > 65536.
        assert_eq!(
            occupancy(&l, &k90(255, 0), 1024, 0),
            Err(OccupancyError::RegistersPerBlock {
                needed: 262_144,
                per_warp: 8192,
                warps: 32,
                sub_partitions: 4,
                max: 65536
            })
        );
        // 64 regs × 1024 threads is exactly 65536: allowed, 1 block.
        assert_eq!(
            occupancy(&l, &k90(64, 0), 1024, 0).unwrap().active_blocks,
            1
        );
        // 227 KiB dynamic + 1 KiB = 228 KiB fits; one byte more does not.
        assert_eq!(
            occupancy(&l, &k90(8, 0), 32, 227 * 1024)
                .unwrap()
                .active_blocks,
            1
        );
        assert!(matches!(
            occupancy(&l, &k90(8, 0), 32, 227 * 1024 + 1),
            Err(OccupancyError::SharedPerBlock { .. })
        ));
        let advice = advise(&l, &k90(8, 0), 1, 32, 227 * 1024 + 1);
        assert!(matches!(advice[0], Advice::Invalid(_)));
    }

    #[test]
    fn opt_in_advice() {
        let advice = advise(&h200(), &k90(8, 0), 1_000_000, 1024, 60 * 1024);
        assert!(advice.iter().any(|a| matches!(
            a,
            Advice::NeedsOptIn {
                shared_bytes: 61440,
                ..
            }
        )));
    }

    #[test]
    fn limits_match_the_old_table() {
        // (sm, max warps, max blocks, smem per SM KiB, opt-in per block KiB, largest carveout) as the occupancy
        // table had them before the generation table.
        for (sm, warps, blocks, smem, optin, carve) in [
            (80, 64, 32, 164, 163, 164),
            (87, 48, 16, 164, 163, 164),
            (86, 48, 16, 100, 99, 100),
            (89, 48, 24, 100, 99, 100),
            (90, 64, 32, 228, 227, 228),
        ] {
            let l = DeviceLimits::for_sm(sm, 1).unwrap();
            assert_eq!(
                (
                    l.max_warps_per_sm,
                    l.max_blocks_per_sm,
                    l.smem_per_sm,
                    l.smem_per_block_optin
                ),
                (warps, blocks, smem * KIB, optin * KIB),
                "sm_{sm}"
            );
            assert_eq!(l.carveouts_kib.last(), Some(&carve));
            assert_eq!(
                (l.regs_per_sm, l.regs_per_block, l.smem_per_block),
                (64 * KIB, 64 * KIB, 48 * KIB)
            );
            assert_eq!(
                (l.reg_alloc_unit, l.max_regs_per_thread, l.sub_partitions),
                (256, 255, 4)
            );
            assert_eq!(
                (
                    l.reserved_smem_per_block,
                    l.smem_alloc_unit,
                    l.max_threads_per_block
                ),
                (KIB, 128, 1024)
            );
        }
    }

    #[test]
    fn known_sm_versions() {
        for sm in [80, 86, 87, 89, 90] {
            assert!(DeviceLimits::for_sm(sm, 1).is_some());
        }
        assert!(DeviceLimits::for_sm(75, 1).is_none());
        let ada = DeviceLimits::for_sm(89, 128).unwrap();
        assert_eq!((ada.max_warps_per_sm, ada.max_blocks_per_sm), (48, 24));
    }
}
