//! Prepared launches: a kernel over one shape checked and built once per queue, then launched by writing only
//! what differs per launch.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::launch::cbank::{CLUSTER_WORDS, DRIVER_BYTES};
use crate::launch::params::{Arg, pack};
use crate::launch::qmd::{self, QMD_WORDS};
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::{Fence, Signal};

use super::config::LaunchConfig;
use super::order::Order;
use super::slots::qmd_params;
use super::{CBANK_DRIVER_WORDS, ComputeQueue, LOCAL_RESERVE, QMD_BYTES, SLOT_BYTES};

/// Identities of prepared launches (0 is no launch), for the slots that hold one's QMD.
static NEXT_PREPARED_ID: AtomicU64 = AtomicU64::new(1);

/// A launch of one kernel over one shape, checked and built once by [`ComputeQueue::prepare_launch`] for one queue:
/// launching it again only packs the arguments and writes what differs per launch.
#[derive(Clone)]
pub struct PreparedLaunch {
    id: u64,
    queue: u64,
    kernel: Kernel,
    cfg: LaunchConfig,
    /// Local memory per thread the QMD was built for.
    local: u32,
    /// The QMD, constant bank 0 at address 0 and release payload 0 (both patched per slot and launch).
    qmd: Box<[u32; QMD_WORDS]>,
    driver: [u32; CBANK_DRIVER_WORDS],
    cluster: [u32; CLUSTER_WORDS],
}

impl PreparedLaunch {
    /// The kernel it launches.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// The grid, block, shared memory and cluster shape it launches with.
    pub fn config(&self) -> &LaunchConfig {
        &self.cfg
    }

    /// Local memory per thread its QMD was built for (a queue whose local memory grew since builds it afresh).
    pub(super) fn built_for_local(&self) -> u32 {
        self.local
    }
}

impl std::fmt::Debug for PreparedLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLaunch")
            .field("kernel", &self.kernel.info().name)
            .field("config", &self.cfg)
            .field("queue", &self.queue)
            .finish()
    }
}

impl ComputeQueue {
    /// Checks a launch of `kernel` over `cfg` once and builds its QMD and driver words, so that
    /// [`launch_prepared`](Self::launch_prepared) only packs the arguments and writes what changes per launch (on a
    /// slot that held the same prepared launch before: the parameters and two words of the QMD). Grows the queue's
    /// local memory for the kernel now. Cooperative launches are not prepared.
    pub fn prepare_launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
    ) -> Result<PreparedLaunch> {
        let checked = self.check(kernel, cfg)?;
        let k = kernel.info();
        if k.min_stack_size + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(k.min_stack_size)?;
        }
        let release = (self.queue.timeline().va(), 0);
        let params = qmd_params(
            kernel,
            cfg,
            checked,
            0,
            self.local_per_thread,
            Some(release),
        )?;
        let mut qmd = [0u32; QMD_WORDS];
        qmd::build(self.version, &params, &mut qmd)?;
        qmd::prefetch_bank0(self.version, &mut qmd)?;
        let (driver, cluster) = self.bank_words(cfg, checked.1, None);
        Ok(PreparedLaunch {
            id: NEXT_PREPARED_ID.fetch_add(1, Ordering::Relaxed),
            queue: self.id,
            kernel: kernel.clone(),
            cfg: *cfg,
            local: self.local_per_thread,
            qmd: Box::new(qmd),
            driver,
            cluster,
        })
    }

    /// Launches a [`PreparedLaunch`] of this queue with `args` (checked against the kernel's parameter table), in
    /// order with everything else on the queue, and rings the doorbell. Allocates nothing.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_prepared(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_prepared(prepared, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`launch_prepared`](Self::launch_prepared) without ringing the doorbell.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_prepared(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record_prepared_as(prepared, args, Order::Stream)?;
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_prepared`](Self::launch_prepared), returning the launch's value on the queue's timeline instead
    /// of a fence ([`fence_for`](Self::fence_for) makes one when it is wanted): a fence holds a reference count,
    /// and taking and dropping it are locked instructions, which wait until every store before them has left the
    /// CPU: the launch's own stores and its doorbell. The cheapest launch call for a caller that waits on the
    /// queue, or on a later launch's fence.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    #[inline]
    pub unsafe fn launch_prepared_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record_prepared_as(prepared, args, Order::Stream)?;
        self.send_launch_now();
        Ok(value)
    }

    /// Launches a [`PreparedLaunch`] of this queue as a programmatic dependent of the launch right before it
    /// ([`launch_programmatic`](Self::launch_programmatic)), and rings the doorbell. Allocates nothing once the
    /// queue's gates exist (its first programmatic launch builds them).
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    pub unsafe fn launch_prepared_programmatic(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record_prepared_as(prepared, args, Order::Programmatic)?;
        self.send_launch_now();
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_prepared_programmatic`](Self::launch_prepared_programmatic), returning the launch's value on
    /// the queue's timeline instead of a fence (see [`launch_prepared_value`](Self::launch_prepared_value)).
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    #[inline]
    pub unsafe fn launch_prepared_programmatic_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record_prepared_as(prepared, args, Order::Programmatic)?;
        self.send_launch_now();
        Ok(value)
    }

    /// As [`launch_prepared_value`](Self::launch_prepared_value) (or, `programmatic`,
    /// [`launch_prepared_programmatic_value`](Self::launch_prepared_programmatic_value)) without ringing the doorbell:
    /// the GPU learns of the launch at the queue's next doorbell ([`flush`](Self::flush), or any later call that
    /// rings). Allocates nothing.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch) (and, `programmatic`, [`launch_programmatic`](Self::launch_programmatic)).
    #[inline]
    pub unsafe fn record_prepared_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<u64> {
        self.record_prepared_as(prepared, args, Order::stream_or(programmatic))
    }

    /// Records a [`PreparedLaunch`] of this queue as the next link of a chain, programmatic or not, and returns the
    /// timeline value the link completes with (as [`record_chained_value`](Self::record_chained_value) does: a
    /// link is built as any chained link, from the prepared launch's kernel and shape).
    ///
    /// # Safety
    /// As for [`record_chained_value`](Self::record_chained_value).
    pub unsafe fn record_prepared_chained_value(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<u64> {
        self.owns(prepared)?;
        // SAFETY: forwarded.
        unsafe { self.record_chained_value(&prepared.kernel, &prepared.cfg, args, programmatic) }
    }

    /// An error unless this queue prepared `p`.
    #[inline]
    fn owns(&self, p: &PreparedLaunch) -> Result<()> {
        if p.queue != self.id {
            return Err(Error::InvalidLaunch {
                kernel: p.kernel.info().name.clone(),
                why: format!(
                    "it was prepared on compute queue {} and is launched on queue {}; prepare it on this queue",
                    p.queue, self.id
                ),
            });
        }
        Ok(())
    }

    fn record_prepared_as(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
        order: Order,
    ) -> Result<u64> {
        let p = prepared;
        let kernel = &p.kernel;
        self.owns(p)?;
        if p.local != self.local_per_thread {
            // Another kernel grew local memory since: the prepared QMD names the old size, so build afresh.
            return self.record(kernel, &p.cfg, args, order);
        }
        if let Some(value) = self.hold(kernel, &p.cfg, args, order)? {
            return Ok(value);
        }
        self.end_open_chain()?;
        let n = pack(kernel.info(), args, &mut self.params)?;
        self.adopt_printf(kernel);
        self.retire_local();
        let slot = self.claim_slot()?;
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let prev = self.queue.last_submitted();
        let value = prev + 1;
        let slot_off = slot as u64 * SLOT_BYTES;
        // A programmatic launch gets its own gate and latch fields, so its slot holds no reusable QMD afterwards.
        let gates = order == Order::Programmatic && self.can_gate();
        let mut gated = None;
        match qmd::release_payload_word(self.version) {
            Some(w) if self.slot_owner[slot] == p.id && !gates => {
                // The slot holds this launch's QMD and driver words: only the release payload changes.
                let payload = [value as u32, (value >> 32) as u32];
                if !self.inline_qmd {
                    self.slots.write_words(slot_off + w as u64 * 4, &payload)?;
                }
                self.qmd_shadow[slot][w..w + 2].copy_from_slice(&payload);
            }
            _ => {
                let mut q = *p.qmd;
                let cb_va = self.slot_qmd_va(slot) + QMD_BYTES;
                qmd::patch_launch(self.version, &mut q, cb_va, Some(value))?;
                gated = self.gate(order, slot, &mut q)?;
                self.stage_qmd(slot, &q)?;
                self.write_bank_words(
                    slot,
                    &p.driver,
                    &p.cluster,
                    p.kernel.info().param_cbank_size,
                )?;
                self.slot_owner[slot] = if gated.is_some() { 0 } else { p.id };
            }
        }
        self.slots.write(
            slot_off + QMD_BYTES + DRIVER_BYTES as u64,
            &self.params[..n],
        )?;
        self.next_slot = (slot + 1) % self.slot_values.len();
        self.send_ordered(slot, kernel, true, gated)
    }
}
