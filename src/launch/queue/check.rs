//! Checks of a launch against the kernel and the device limits, before anything is submitted.

use std::sync::Arc;

use crate::launch::cbank::DRIVER_BYTES;
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::module::cubin::KernelInfo;

use super::config::{LaunchConfig, Limits};
use super::{ComputeQueue, MAX_PARAM_BYTES};

impl ComputeQueue {
    /// Checks a launch: the block's shared memory and the cluster shape it runs with.
    pub(super) fn check(
        &self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
    ) -> Result<(u32, Option<[u32; 3]>)> {
        let k = kernel.info();
        if !Arc::ptr_eq(kernel.module().gpu(), &self.gpu) {
            return Err(Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!(
                    "the module is loaded on {} and the queue runs on {}; load the module on the queue's GPU",
                    kernel.module().gpu().info().uuid,
                    self.gpu.info().uuid
                ),
            });
        }
        let shared = validate(k, cfg, &self.limits)?;
        Ok((shared, cluster_shape(k, cfg, &self.limits)?))
    }
}

/// Checks a launch of the kernel described by `k` against the device limits; returns the block's shared memory
/// (static + dynamic). Nothing is submitted.
pub fn validate(k: &KernelInfo, cfg: &LaunchConfig, l: &Limits) -> Result<u32> {
    let bad = |why: String| Error::InvalidLaunch {
        kernel: k.name.clone(),
        why,
    };
    for (i, axis) in ["x", "y", "z"].iter().enumerate() {
        if cfg.grid[i] == 0 || cfg.grid[i] > l.max_grid[i] {
            return Err(bad(format!(
                "grid.{axis} = {} (must be 1..={})",
                cfg.grid[i], l.max_grid[i]
            )));
        }
        if cfg.block[i] == 0 || cfg.block[i] > l.max_block[i] {
            return Err(bad(format!(
                "block.{axis} = {} (must be 1..={})",
                cfg.block[i], l.max_block[i]
            )));
        }
    }
    let threads = cfg.block.iter().map(|&b| u64::from(b)).product::<u64>();
    if threads > u64::from(l.max_threads_per_block) {
        return Err(bad(format!(
            "{threads} threads per block (at most {})",
            l.max_threads_per_block
        )));
    }
    if let Some(max) = k.max_threads.filter(|&m| threads > u64::from(m)) {
        return Err(bad(format!(
            "{threads} threads per block, the kernel was compiled for at most {max}"
        )));
    }
    if let Some(req) = k.required_block.filter(|r| *r != cfg.block) {
        return Err(bad(format!(
            "block {:?}, the kernel requires {req:?}",
            cfg.block
        )));
    }
    // Registers are allocated per warp in units of 256.
    let per_warp = (u64::from(k.registers.max(1)) * 32).next_multiple_of(256);
    let warps = threads.div_ceil(32);
    if per_warp * warps > u64::from(l.registers_per_sm) {
        return Err(bad(format!(
            "{threads} threads need {} registers ({} per thread), an SM has {}",
            per_warp * warps,
            k.registers,
            l.registers_per_sm
        )));
    }
    let shared = k.static_shared.saturating_add(u64::from(cfg.shared_bytes));
    if shared > u64::from(l.max_shared_per_block) {
        return Err(bad(format!(
            "{shared} bytes of shared memory ({} static + {} dynamic), at most {}",
            k.static_shared, cfg.shared_bytes, l.max_shared_per_block
        )));
    }
    if k.param_cbank_size as usize > MAX_PARAM_BYTES {
        return Err(bad(format!(
            "a {}-byte parameter block (at most {MAX_PARAM_BYTES})",
            k.param_cbank_size
        )));
    }
    if k.param_cbank_offset as usize != DRIVER_BYTES && !k.params.is_empty() {
        return Err(bad(format!(
            "parameters at c[0x0][{:#x}], expected {DRIVER_BYTES:#x} on sm_90",
            k.param_cbank_offset
        )));
    }
    cluster_shape(k, cfg, l)?;
    Ok(shared as u32)
}

/// The thread block cluster shape a launch runs with: the run-time shape of `cfg`, else the kernel's
/// compile-time `__cluster_dims__`; `None` for a launch without clusters. Refused, before anything is submitted:
/// a run-time shape other than the compile-time one, clusters on a GPU without them (before sm_90), a shape with a
/// zero axis, a grid that is not a multiple of the shape, a cluster of more than
/// [`Limits::max_cluster_blocks`] blocks, and a kernel compiled for cluster launches (`.explicitcluster`) launched
/// without a shape. A cluster's blocks must be resident at once on one GPC: [`validate`] has checked that one
/// block fits an SM (threads, registers, shared memory), so the at most 8 blocks of a cluster need at most 8 SMs,
/// fewer than any Hopper GPC has.
pub fn cluster_shape(k: &KernelInfo, cfg: &LaunchConfig, l: &Limits) -> Result<Option<[u32; 3]>> {
    let bad = |why: String| Error::InvalidLaunch {
        kernel: k.name.clone(),
        why,
    };
    let shape = match (cfg.cluster, k.cluster_dims) {
        (Some(run), Some(fixed)) if run != fixed => {
            return Err(bad(format!(
                "a cluster shape of {run:?} at launch, but the kernel was compiled with __cluster_dims__{fixed:?}; \
                 give the compiled shape or none"
            )));
        }
        (run, fixed) => run.or(fixed),
    };
    let Some(s) = shape else {
        if k.explicit_cluster {
            return Err(bad(
                "the kernel was compiled for cluster launches (.explicitcluster): give a cluster shape \
                 (LaunchConfig::with_cluster)"
                    .into(),
            ));
        }
        return Ok(None);
    };
    if l.max_cluster_blocks == 0 {
        return Err(bad(format!(
            "a cluster shape of {s:?}, but this GPU has no thread block clusters (they need sm_90 or newer)"
        )));
    }
    for (i, axis) in ["x", "y", "z"].iter().enumerate() {
        if s[i] == 0 {
            return Err(bad(format!("cluster.{axis} = 0 (must be at least 1)")));
        }
        if !cfg.grid[i].is_multiple_of(s[i]) {
            return Err(bad(format!(
                "grid.{axis} = {} is not a multiple of the cluster's {} (cluster shape {s:?})",
                cfg.grid[i], s[i]
            )));
        }
    }
    let blocks = s.iter().map(|&v| u64::from(v)).product::<u64>();
    if blocks > u64::from(l.max_cluster_blocks) {
        return Err(bad(format!(
            "a cluster of {blocks} blocks ({s:?}); at most {} (the portable cluster size)",
            l.max_cluster_blocks
        )));
    }
    Ok(Some(s))
}
