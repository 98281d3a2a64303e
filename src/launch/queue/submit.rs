//! Sending launches to the channel, and what the queue's timeline says: join, completion values, waits and
//! releases of values, flush, synchronize and the printf drain.

use std::sync::Arc;

use crate::launch::cbank::DRIVER_BYTES;
use crate::launch::qmd::{self, ChainAction, QMD_WORDS};
use crate::launch::{Error, Result};
use crate::module::printf::{Drained, PrintfFifo};
use crate::module::{Kernel, newest_generation};
use crate::pushbuf::{Acquire, Fence, Signal};

use super::order::GateSend;
use super::{ComputeQueue, QMD_BYTES, SLOT_BYTES};

impl ComputeQueue {
    /// Sends the launch just recorded (the doorbell, or the gate of a polled queue), then prefetches for writing
    /// what the next launch writes. A launch held back as a chain link rings nothing: the GPU reads nothing of it
    /// until its part is sent, which rings for itself.
    #[inline]
    pub(super) fn send_launch_now(&mut self) {
        self.queue.kick_recorded();
        self.prefetch_next();
    }

    /// [`ComputeQueueConfig::prefetch_next`](super::ComputeQueueConfig::prefetch_next): prefetches for writing what
    /// the next launch writes.
    #[inline]
    fn prefetch_next(&self) {
        if !self.prefetch {
            return;
        }
        if let Some(base) = self.prefetch_slots {
            let slot = base + self.next_slot * SLOT_BYTES as usize;
            // An inline QMD's release payload travels in the pushbuffer, not the slot.
            if !self.inline_qmd
                && let Some(w) = qmd::release_payload_word(self.version)
            {
                crate::gpfifo::prefetch_for_write((slot + w * 4) as *const u8);
            }
            crate::gpfifo::prefetch_for_write(
                (slot + (QMD_BYTES + DRIVER_BYTES as u64) as usize) as *const u8,
            );
        }
        self.queue.prefetch_next();
    }

    /// A fence that completes once the queue's timeline reaches `value` (a value
    /// [`launch_prepared_value`](Self::launch_prepared_value) returned).
    pub fn fence_for(&self, value: u64) -> Fence {
        self.queue.fence_for(value)
    }

    /// Records a signal that completes once every launch so far has completed (waiting for the compute engine to
    /// go idle), rings the doorbell, and returns its fence.
    pub fn join(&mut self) -> Result<Fence> {
        self.end_open_chain()?;
        let fence = self.queue.submit(0, Signal::Host, |_, _| {})?;
        self.unordered_pending = false;
        Ok(fence)
    }

    /// Whether work sent after timeline value `prev` on this queue's channel needs no acquire of it: the CPU has
    /// seen it reached, or the front end released it itself after waiting for everything before it (its in-order
    /// processing then holds later methods until then).
    fn settled(&self, prev: u64) -> bool {
        prev == self.front_settled || self.queue.timeline().is_known_reached(prev)
    }

    /// Whether `prev` is settled ([`settled`](Self::settled)), reading the timeline if need be.
    pub(crate) fn settled_now(&self, prev: u64) -> bool {
        prev == self.front_settled || self.queue.timeline().is_reached(prev)
    }

    /// The timeline value that, once reached, means every launch and copy submitted to this queue so far is
    /// complete: what a stream-ordered free records. Sends an open chain and joins unordered launches first; with
    /// neither (the usual case) it reads one field and submits nothing.
    #[inline]
    pub fn completion_value(&mut self) -> Result<u64> {
        if self.chain.is_none() && !self.unordered_pending {
            return Ok(self.queue.last_submitted());
        }
        self.settle_earlier()
    }

    /// Sends an open chain and joins unordered launches, so that the queue's last timeline value covers all its
    /// work so far; returns that value (what later work waits for).
    pub(super) fn settle_earlier(&mut self) -> Result<u64> {
        self.end_open_chain()?;
        if self.unordered_pending {
            self.join()?;
        }
        Ok(self.queue.last_submitted())
    }

    /// Makes this queue's later launches and copies wait, on the GPU, until the 64-bit word at `va` reaches
    /// `value` (compared circularly, as 64-bit timelines are): how a queue waits for another agent, such as a
    /// CUDA stream's `cuStreamWriteValue64`. The word must be mapped in this GPU's address space.
    pub fn wait_value(&mut self, va: u64, value: u64) -> Result<Fence> {
        let prev = self.settle_earlier()?;
        let prev_done = self.settled(prev);
        let timeline_va = self.queue.timeline().va();
        // No wait for idle: the acquires order the release, and the timeline's earlier values were released after
        // their own work, so this value still means "everything before is done".
        let fence = self.queue.submit(24, Signal::Recorded, |p, own| {
            p.sem_acquire(va, value, Acquire::CircularGeq, true, false);
            if !prev_done {
                p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
            }
            p.sem_release(timeline_va, own, crate::pushbuf::Release::NOW_64);
        })?;
        self.front_settled = fence.value();
        Ok(fence)
    }

    /// Writes the 64-bit `value` at `va` once every earlier launch and copy of this queue has completed (their
    /// memory writes visible): how another agent, such as a CUDA stream's `cuStreamWaitValue64`, waits for this
    /// queue.
    pub fn release_value(&mut self, va: u64, value: u64) -> Result<Fence> {
        let prev = self.settle_earlier()?;
        let prev_done = self.settled(prev);
        let timeline_va = self.queue.timeline().va();
        // Every earlier value was released after its work and its memory barrier, so once the acquire sees `prev`
        // the writes are visible: release at once, without waiting for the engine to idle (which costs ~1.5 us).
        let fence = self.queue.submit(24, Signal::Recorded, |p, own| {
            if !prev_done {
                p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
            }
            p.sem_release(va, value, crate::pushbuf::Release::NOW_64);
            p.sem_release(timeline_va, own, crate::pushbuf::Release::NOW_64);
        })?;
        self.front_settled = fence.value();
        Ok(fence)
    }

    /// Makes this queue's later work wait, on the GPU, for `fence` of another queue, on this GPU or another one
    /// of its peer domain (whose semaphore page is then mapped on this GPU, once): no CPU in between.
    pub fn wait_fence(&mut self, fence: &Fence) -> Result<Fence> {
        // Idempotent: a no-op for this GPU's own fences and for pages mapped here before.
        fence.timeline().semaphores().memory().map_on(&self.gpu)?;
        self.wait_value(fence.timeline().va(), fence.value())
    }

    /// Sends the launch staged in `slot` (the next value on the timeline), after the previous one when `ordered`,
    /// invalidating the shader caches first if `kernel`'s module is newer than what the queue has run; through
    /// `gate` when it is a programmatic launch ([`GateSend`]).
    pub(super) fn send_launch(
        &mut self,
        slot: usize,
        kernel: &Kernel,
        ordered: bool,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let prev = self.queue.last_submitted();
        // Only what an earlier read showed: reading the semaphore would cost a cache miss on every launch, and an
        // acquire of a value already released costs the GPU little.
        let prev_done = !ordered || self.settled(prev);
        // Read before the invalidation is recorded: code uploaded after it is not counted as seen.
        let newest = newest_generation();
        let invalidate = self.seen_generation < kernel.module().generation();
        let value = self.send_slot(slot, invalidate, prev_done, prev, gate)?;
        debug_assert_eq!(value, prev + 1);
        if invalidate {
            self.seen_generation = newest;
        }
        self.slot_values[slot] = value;
        Ok(value)
    }

    /// Records the methods that launch the QMD staged for `slot`: inline, or fetched from the slot.
    fn send_slot(
        &mut self,
        slot: usize,
        invalidate: bool,
        prev_done: bool,
        prev: u64,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let inline = self.inline_qmd;
        // A slot's QMD is only ever written by the CPU, before the launch is sent, so it may be fetched early; a
        // gated QMD is not (its gate and latch change as the work distributor runs it).
        let early = self.reads_ahead() && gate.is_none();
        self.send_qmd(slot, inline, early, invalidate, prev_done, prev, gate)
    }

    /// Records the methods that launch the QMD of slot `slot` (a chain's head), fetched by the GPU. Every QMD of a
    /// chain is written by the CPU before its part is sent, and the head's is not gated, so a head that waits for the
    /// work before it is read ahead of that wait as a plain slot's QMD is: a chained queue sends each part while the
    /// one before runs, and the fetch then overlaps that part's work.
    pub(super) fn send(
        &mut self,
        slot: usize,
        invalidate: bool,
        prev_done: bool,
        prev: u64,
    ) -> Result<u64> {
        self.send_qmd(
            slot,
            false,
            self.reads_ahead(),
            invalidate,
            prev_done,
            prev,
            None,
        )
    }

    /// Whether fetched QMDs are read ahead of their waits ([`ComputeQueueConfig::prefetch_qmds`]): not while chains
    /// link with [`ChainAction::Schedule`], whose links run the work distributor's copy of a QMD if it holds one (a
    /// link into a slot read ahead before is linked with the action that fetches afresh instead: see
    /// [`link_action`](Self::link_action)).
    ///
    /// [`ComputeQueueConfig::prefetch_qmds`]: super::ComputeQueueConfig::prefetch_qmds
    fn reads_ahead(&self) -> bool {
        self.prefetch_qmds && self.chain_action != ChainAction::Schedule
    }

    /// How a chain link into `slot` is scheduled: the queue's [`ChainAction`], except that a `Schedule` link into a
    /// slot whose QMD the work distributor may hold a copy of (read ahead of an earlier launch from the slot, since
    /// rewritten) fetches afresh, as `InvalidateCopySchedule` does; that fetch leaves no copy behind.
    pub(super) fn link_action(&mut self, slot: usize) -> ChainAction {
        if self.chain_action == ChainAction::Schedule && !self.read_ahead_slots[slot] {
            return ChainAction::Schedule;
        }
        self.read_ahead_slots[slot] = false;
        ChainAction::InvalidateCopySchedule
    }

    /// Records a launch of slot `slot`'s QMD: sent inline from the slot's staged words (`inline`), or fetched. A
    /// fetched QMD that waits for the work before it is, where `early`, fetched before that wait, so that the fetch
    /// overlaps the work instead of following it (the slot is then marked as one whose QMD the work distributor may
    /// hold a copy of; any other launch of it fetches afresh, leaving none). With a gate ([`GateSend`]), that gate is
    /// armed first, and a launch the previous slot's gate schedules has that gate counted down instead of waiting for
    /// the work before it.
    #[allow(clippy::too_many_arguments)]
    fn send_qmd(
        &mut self,
        slot: usize,
        inline: bool,
        early: bool,
        invalidate: bool,
        prev_done: bool,
        prev: u64,
        gate: Option<GateSend>,
    ) -> Result<u64> {
        let qmd_va = self.slot_qmd_va(slot);
        let timeline_va = self.queue.timeline().va();
        let order = self.ordering;
        let words = inline.then(|| &self.qmd_shadow[slot]);
        // At most 17 words besides an inline QMD (cache invalidation 2, read-ahead 5, acquire 6, PCAS 4; or a gate's
        // 4 and a count-down's 4 in their place), so armed slots of 32 words still take every fetched launch.
        let max_words = 24 + words.map_or(0, |_| 3 + QMD_WORDS);
        let after = gate.and_then(|g| g.after);
        let waits = !prev_done && after.is_none();
        let prefetch = early && waits && words.is_none();
        let value = self
            .queue
            .record_value(max_words, Signal::Recorded, |p, _| {
                if invalidate {
                    p.invalidate_shader_caches_no_wfi();
                }
                if let Some(g) = gate {
                    // Armed (afresh, from memory) before this launch can pre-exit and count it down.
                    p.send_pcas(g.own);
                }
                if prefetch {
                    p.prefetch_qmd(qmd_va);
                }
                if waits {
                    // Stream order: this grid starts only after the previous one has completed.
                    order.wait(p, timeline_va, prev);
                }
                match words {
                    Some(w) => p.send_inline_qmd(qmd_va, w),
                    None if prefetch => p.schedule_prefetched(qmd_va),
                    None => p.send_pcas(qmd_va),
                }
                if let Some(previous) = after {
                    // This QMD requires a scheduling PCAS: the copy just sent waits for the previous slot's gate, which
                    // runs once the previous launch has pre-exited and this decrement has arrived.
                    p.send_pcas_decrement(previous);
                }
            })?;
        self.read_ahead_slots[slot] = prefetch;
        Ok(value)
    }

    /// Rings the doorbell for everything recorded (nothing when nothing was recorded since the last doorbell; links a
    /// chained queue holds are sent by [`flush_held`](Self::flush_held)).
    pub fn flush(&mut self) {
        self.queue.kick_recorded();
    }

    /// Waits until every launch so far (an open chain included) has completed, then prints what their kernels
    /// `printf`ed. A failed device `assert` is [`Error::Assert`].
    pub fn synchronize(&mut self) -> Result<()> {
        self.end_open_chain()?;
        // What is only recorded so far is sent first.
        self.queue.kick();
        let waited = self.queue.wait_idle_kicking(self.timeout);
        settle(self.printf.as_ref(), waited)
    }

    /// The printf FIFO this queue's kernels write to, once a kernel that calls `printf` or `assert` was launched.
    pub fn printf_fifo(&self) -> Option<&Arc<PrintfFifo>> {
        self.printf.as_ref()
    }

    /// Prints what the kernels completed so far have `printf`ed (waiting on a [`Fence`] of this layer does not).
    pub fn drain_printf(&self) -> Result<Drained> {
        Ok(match &self.printf {
            Some(f) => f.drain()?,
            None => Drained::default(),
        })
    }
}

/// Finishes a wait on work that may have called `printf` or `assert`: drains the FIFO, and turns a channel fault
/// caused by a failed assertion into [`Error::Assert`].
pub fn settle(
    printf: Option<&Arc<PrintfFifo>>,
    waited: std::result::Result<(), crate::pushbuf::Error>,
) -> Result<()> {
    let Some(fifo) = printf else {
        return Ok(waited?);
    };
    let drained = fifo.drain();
    match (waited, drained) {
        // An assert that ended its thread faults nothing: the drain is where it shows.
        (Ok(()), Ok(mut d))
            if !d.asserts.is_empty()
                && fifo.assert_action() == crate::module::printf::AssertAction::EndThread =>
        {
            Err(Error::Assert(Box::new(crate::launch::AssertError {
                failure: d.asserts.swap_remove(0),
                fault: None,
            })))
        }
        (Ok(()), Ok(_)) => Ok(()),
        (Ok(()), Err(e)) => Err(e.into()),
        (Err(fault), Ok(mut d)) if !d.asserts.is_empty() => {
            Err(Error::Assert(Box::new(crate::launch::AssertError {
                failure: d.asserts.swap_remove(0),
                fault: Some(fault),
            })))
        }
        (Err(fault), _) => Err(fault.into()),
    }
}
