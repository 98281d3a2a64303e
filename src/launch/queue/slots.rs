//! Launch slots: claiming the next free one, the template QMD, the constant bank 0 words written where they
//! differ from what the slot holds, and the QMD's parameters.

use std::sync::Arc;

use crate::launch::cbank::{
    CLUSTER_WORDS, CLUSTER_WORDS_START, DRIVER_BYTES, PARAM_BLOCK_START, param_block_words,
    write_cluster_words, write_driver_words, write_grid_barrier,
};
use crate::launch::params::{Arg, pack};
use crate::launch::qmd::{self, ConstBuffer, QMD_WORDS, QmdParams};
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::Signal;
use crate::rm::Memory;

use super::config::{ClusterPolicy, LaunchConfig};
use super::order::Release;
use super::{CBANK_DRIVER_WORDS, ComputeQueue, LOCAL_RESERVE, QMD_BYTES, SLOT_BYTES};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TemplateKey {
    program_va: u64,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    local: u32,
    cbank_size: u32,
    ordered: bool,
    cluster: Option<[u32; 3]>,
    sync_domain: u8,
    cluster_policy: ClusterPolicy,
}

/// Writes the words of `new` that differ from `shadow` (runs of them at once) and updates the shadow.
pub(super) fn write_changed(
    mem: &Memory,
    offset: u64,
    shadow: &mut [u32],
    new: &[u32],
) -> Result<()> {
    let mut i = 0;
    while i < new.len() {
        if shadow[i] == new[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < new.len() && shadow[i] != new[i] {
            i += 1;
        }
        mem.write_words(offset + start as u64 * 4, &new[start..i])?;
        shadow[start..i].copy_from_slice(&new[start..i]);
    }
    Ok(())
}

impl ComputeQueue {
    /// Checks a launch, packs its parameters, takes the next free slot and writes the slot's constant bank 0; returns
    /// the slot and the launch's QMD (not yet written).
    pub(super) fn prepare(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        release: Release,
    ) -> Result<(usize, [u32; QMD_WORDS])> {
        let k = kernel.info();
        let (shared, cluster) = self.check(kernel, cfg)?;
        let n = pack(k, args, &mut self.params)?;
        self.adopt_printf(kernel);
        if k.min_stack_size + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(k.min_stack_size)?;
        }
        self.retire_local();

        let slot = self.claim_slot()?;
        // The general path rewrites whatever differs, so no prepared launch owns the slot afterwards.
        self.slot_owner[slot] = 0;
        let slot_off = slot as u64 * SLOT_BYTES;
        let cb_va = self.slot_qmd_va(slot) + QMD_BYTES;
        // After anything above that submitted (local memory, a join): the value this launch will be sent with.
        let release = match release {
            Release::None => None,
            Release::Next => {
                Some(self.queue.last_submitted() + 1 + u64::from(self.unordered_pending))
            }
            Release::Later => Some(0),
        };

        let key = TemplateKey {
            program_va: kernel.program_va(),
            grid: cfg.grid,
            block: cfg.block,
            shared,
            local: self.local_per_thread,
            cbank_size: k.param_cbank_size,
            ordered: release.is_some(),
            cluster,
            sync_domain: cfg.sync_domain,
            cluster_policy: cfg.cluster_policy,
        };
        let release_va = self.queue.timeline().va();
        let mut q = [0u32; QMD_WORDS];
        let reused = match &self.template {
            Some((t, words)) if *t == key => {
                q = *words;
                qmd::patch_launch(self.version, &mut q, cb_va, release)?
            }
            _ => false,
        };
        if !reused {
            let params = qmd_params(
                kernel,
                cfg,
                (shared, cluster),
                cb_va,
                self.local_per_thread,
                release.map(|v| (release_va, v)),
            )?;
            qmd::build(self.version, &params, &mut q)?;
            qmd::prefetch_bank0(self.version, &mut q)?;
            self.template = Some((key, q));
        }

        // Only the words that differ from what the slot already holds go over the bus (write-combined BAR1).
        let (driver, cluster_words) = self.bank_words(cfg, cluster, self.cooperative);
        self.write_bank_words(slot, &driver, &cluster_words, k.param_cbank_size)?;
        self.slots.write(
            slot_off + QMD_BYTES + DRIVER_BYTES as u64,
            &self.params[..n],
        )?;
        self.next_slot = (slot + 1) % self.slot_values.len();
        Ok((slot, q))
    }

    /// Takes the printf FIFO of `kernel`'s module when it has one of its own, draining the one held so far.
    pub(super) fn adopt_printf(&mut self, kernel: &Kernel) {
        if let Some(fifo) = kernel.module().printf_fifo()
            && !self.printf.as_ref().is_some_and(|f| Arc::ptr_eq(f, fifo))
            && let Some(old) = self.printf.replace(fifo.clone())
        {
            let _ = old.drain();
        }
    }

    /// The next launch slot, once the launch that used it last has completed (the caller advances `next_slot`).
    pub(super) fn claim_slot(&mut self) -> Result<usize> {
        let slot = self.next_slot;
        let busy_until = self.slot_values[slot];
        if !self.queue.timeline().is_reached(busy_until) {
            if self.unordered_pending {
                // Unordered launches release nothing themselves: a join makes their slots free again.
                self.queue.record(0, Signal::Host, |_, _| {})?;
                self.unordered_pending = false;
            }
            // The launch that holds the slot may only be recorded so far: send it before waiting.
            self.queue.kick();
            self.queue.wait_kicking(busy_until, self.timeout)?;
        }
        Ok(slot)
    }

    pub(super) fn slot_qmd_va(&self, slot: usize) -> u64 {
        self.slots.va() + slot as u64 * SLOT_BYTES
    }

    /// The driver and cluster words constant bank 0 holds for a launch over `cfg` with cluster shape `cluster`, and
    /// the grid barrier of a cooperative launch.
    pub(super) fn bank_words(
        &self,
        cfg: &LaunchConfig,
        cluster: Option<[u32; 3]>,
        grid_barrier: Option<u64>,
    ) -> ([u32; CBANK_DRIVER_WORDS], [u32; CLUSTER_WORDS]) {
        let mut driver = [0u32; CBANK_DRIVER_WORDS];
        write_driver_words(
            &mut driver,
            cfg.block,
            cfg.grid,
            self.shared_window(),
            self.local_window(),
        );
        write_grid_barrier(&mut driver, grid_barrier);
        let mut words = [0u32; CLUSTER_WORDS];
        write_cluster_words(&mut words, cfg.grid, cluster);
        (driver, words)
    }

    /// Writes the driver and cluster words of a slot's constant bank 0 that differ from what it holds, and the
    /// address range of its parameter block (`param_bytes` long), which depends on the slot.
    pub(super) fn write_bank_words(
        &mut self,
        slot: usize,
        driver: &[u32; CBANK_DRIVER_WORDS],
        cluster: &[u32; CLUSTER_WORDS],
        param_bytes: u32,
    ) -> Result<()> {
        let bank = slot as u64 * SLOT_BYTES + QMD_BYTES;
        write_changed(&self.slots, bank, &mut self.cb_shadow[slot], driver)?;
        write_changed(
            &self.slots,
            bank + CLUSTER_WORDS_START as u64,
            &mut self.cluster_shadow[slot],
            cluster,
        )?;
        let block = param_block_words(self.slots.va() + bank, param_bytes);
        write_changed(
            &self.slots,
            bank + PARAM_BLOCK_START as u64,
            &mut self.param_block_shadow[slot],
            &block,
        )
    }

    /// Writes the words of a slot's QMD that differ from what it holds.
    pub(super) fn write_qmd(&mut self, slot: usize, q: &[u32; QMD_WORDS]) -> Result<()> {
        let qmd_words = self.version.size_bytes() / 4;
        write_changed(
            &self.slots,
            slot as u64 * SLOT_BYTES,
            &mut self.qmd_shadow[slot][..qmd_words],
            &q[..qmd_words],
        )
    }

    /// Writes a slot's QMD for the GPU to fetch, or with inline QMDs only notes it (the launch carries it).
    pub(super) fn stage_qmd(&mut self, slot: usize, q: &[u32; QMD_WORDS]) -> Result<()> {
        if self.inline_qmd {
            // The launch carries the QMD and the GPU stores it in the slot: the shadow is what the slot will hold.
            self.qmd_shadow[slot] = *q;
            Ok(())
        } else {
            self.write_qmd(slot, q)
        }
    }
}

/// The size constant bank 0 of `kernel`'s launches is bound with (driver words, then the parameters).
pub(super) fn bank0_size(kernel: &Kernel) -> u32 {
    (DRIVER_BYTES as u32 + kernel.info().param_cbank_size).next_multiple_of(16)
}

/// What the QMD of a launch of `kernel` over `cfg` says, with the block's shared memory and cluster shape
/// `checked` by [`validate`](super::validate) and [`cluster_shape`](super::cluster_shape), constant bank 0 at
/// `cb_va`, `local` bytes of local memory per thread, and the semaphore release `(va, payload)` it performs on
/// completion.
pub(super) fn qmd_params(
    kernel: &Kernel,
    cfg: &LaunchConfig,
    (shared, cluster): (u32, Option<[u32; 3]>),
    cb_va: u64,
    local: u32,
    release: Option<(u64, u64)>,
) -> Result<QmdParams> {
    let k = kernel.info();
    let mut cbs = [None; 8];
    cbs[0] = Some(ConstBuffer {
        va: cb_va,
        size: bank0_size(kernel),
    });
    for bank in k.const_banks.iter().filter(|b| b.bank != 0 && b.bank < 8) {
        if let Some(off) = bank.image_offset {
            let size = u32::try_from(bank.size).map_err(|_| Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!("constant bank {} of {} bytes", bank.bank, bank.size),
            })?;
            cbs[bank.bank as usize] = Some(ConstBuffer {
                va: kernel.module().bank_va(off),
                size,
            });
        }
    }
    Ok(QmdParams {
        sm_version: kernel.module().gpu().info().sm_version,
        program_va: kernel.program_va(),
        program_bytes: k.code_size,
        registers: k.registers,
        barriers: k.barrier_count.max(1),
        grid: cfg.grid,
        block: cfg.block,
        // At least the 1 KiB the sm_90 compiler reserves at shared address 0 (libcuda never sends less).
        shared_bytes: shared.max(1024).next_multiple_of(256),
        local_bytes_per_thread: local,
        const_buffers: cbs,
        release,
        cluster,
        sync_domain: cfg.sync_domain,
        cluster_load_balancing: cfg.cluster_policy == ClusterPolicy::LoadBalancing,
    })
}
