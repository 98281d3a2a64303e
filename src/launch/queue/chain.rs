//! Chained launches: links the GPU's work distributor schedules one after the other, recorded and sent part
//! by part.

use crate::launch::params::Arg;
use crate::launch::qmd::{self, ChainAction, ConstBuffer, QMD_WORDS};
use crate::launch::{Error, Result};
use crate::module::{Kernel, newest_generation};
use crate::pushbuf::{Fence, Signal};

use super::config::{FIRST_CHAIN_PART, LaunchConfig};
use super::order::{Order, Release, take_latch};
use super::slots::bank0_size;
use super::{ComputeQueue, LOCAL_RESERVE, QMD_BYTES};

/// Chained launches recorded but not sent. The last one's QMD is held back until the next launch (or the chain's
/// end) says what follows it, so every QMD is written once and completely before the chain's head is sent.
#[derive(Clone, Copy)]
pub(super) struct OpenChain {
    first_slot: usize,
    len: usize,
    /// Links this part holds before it is sent.
    limit: usize,
    invalidate: bool,
    last_slot: usize,
    last_qmd: [u32; QMD_WORDS],
}

impl ComputeQueue {
    /// Records a launch as the next link of a chain: it starts when the launch before it in the chain has
    /// completed, scheduled by the GPU's compute work distributor itself (the QMD dependency libcuda's graphs use on
    /// Hopper), with no round trip through the channel's front end in between. The links are sent when the chain
    /// ends: by [`end_chain`](Self::end_chain), or first thing in any other launch, copy, join or synchronize, or when
    /// the queue is dropped. A long chain is also sent part by part while it is recorded
    /// (`ComputeQueueConfig::chain_part`), each part after the one before.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_launch_chained(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record_chained_as(kernel, cfg, args, false)
    }

    /// Records a launch as the next link of a chain ([`record_launch_chained`](Self::record_launch_chained)) that
    /// is a programmatic dependent of the link before it: the work distributor schedules it once every block of
    /// that link has exited or run `griddepcontrol.launch_dependents`, and its `griddepcontrol.wait` returns once
    /// that link has completed and its writes are visible (the link arrives at a latch the launch waits on), as a
    /// programmatic edge of a graph is built. The first launch of a chain, or of a chain part, waits for the work
    /// before it as usual.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, the kernel must run `griddepcontrol.wait` before it touches memory
    /// the launch before it writes, and must not, before that wait, write memory the launch before it reads or
    /// writes (that launch may still be running).
    pub unsafe fn record_launch_chained_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record_chained_as(kernel, cfg, args, true)
    }

    /// Records a launch as the next link of a chain, programmatic or not (as
    /// [`record_launch_chained`](Self::record_launch_chained) and
    /// [`record_launch_chained_programmatic`](Self::record_launch_chained_programmatic) do), and returns the
    /// timeline value the link completes with: its chain's part's ([`open_chain_value`](Self::open_chain_value)
    /// once it is recorded). [`fence_for`](Self::fence_for) makes its fence, which completes once the part is sent
    /// and done.
    ///
    /// # Safety
    /// As for [`record_launch_chained`](Self::record_launch_chained), and for a programmatic link as for
    /// [`record_launch_chained_programmatic`](Self::record_launch_chained_programmatic).
    pub unsafe fn record_chained_value(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<u64> {
        self.record_chained_as(kernel, cfg, args, programmatic)?;
        Ok(self.next_chain_value())
    }

    /// The timeline value the open chain (the part recorded and not yet sent) completes with once it is sent;
    /// `None` when no chain is open. Every other submission of the queue sends the open chain first, so it is the
    /// queue's next submission: one past `pushbuf::Queue::last_submitted`, or two past
    /// when unordered launches wait for the join sent before it.
    pub fn open_chain_value(&self) -> Option<u64> {
        self.chain.map(|_| self.next_chain_value())
    }

    /// The value the open chain is sent with ([`end_open_chain`](Self::end_open_chain) joins pending unordered
    /// launches first, a submission of its own).
    fn next_chain_value(&self) -> u64 {
        self.queue.last_submitted() + 1 + u64::from(self.unordered_pending)
    }

    fn record_chained_as(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<()> {
        if let Some(c) = &self.chain {
            // Local memory may not change under recorded links, and a slot may not be reused inside its own chain
            // (chain_part <= slots).
            let grows = kernel.info().min_stack_size + LOCAL_RESERVE > self.local_per_thread;
            if c.len >= c.limit || grows {
                let next = (c.limit * 2).min(self.chain_part);
                self.end_open_chain()?;
                self.queue.kick();
                // The chain goes on: its next part is larger (end_open_chain started a new chain's count).
                self.next_part = next;
            }
        }
        let (slot, mut q) = self.prepare(kernel, cfg, args, Release::Later)?;
        let invalidate = self.seen_generation < kernel.module().generation();
        match self.chain {
            None => {
                self.chain = Some(OpenChain {
                    first_slot: slot,
                    len: 1,
                    limit: self.next_part,
                    invalidate,
                    last_slot: slot,
                    last_qmd: q,
                })
            }
            Some(mut c) => {
                let next = (self.slot_qmd_va(slot), self.link_action(slot));
                qmd::set_chain_link(self.version, &mut c.last_qmd, Some(next))?;
                if programmatic {
                    // The link before lets this one be scheduled at its pre-exit and arrives at a latch this one's
                    // griddepcontrol.wait waits on. Scheduled that early, this launch relies on the prefetch of its
                    // own bank 0 every prepared QMD carries (bank 5, PRE): a POST prefetch by the link before would
                    // land too late (as for a graph's programmatic nodes), so none is asked for.
                    let latch = take_latch();
                    qmd::set_latch_arrive(self.version, &mut c.last_qmd, latch)?;
                    qmd::set_latch_wait(self.version, &mut q, latch)?;
                } else {
                    let bank = ConstBuffer {
                        va: self.slot_qmd_va(slot) + QMD_BYTES,
                        size: bank0_size(kernel),
                    };
                    qmd::prefetch_next_bank(self.version, &mut c.last_qmd, bank)?;
                }
                self.write_qmd(c.last_slot, &c.last_qmd)?;
                c.len += 1;
                c.invalidate |= invalidate;
                c.last_slot = slot;
                c.last_qmd = q;
                self.chain = Some(c);
            }
        }
        Ok(())
    }

    /// Ends the chain recorded by [`record_launch_chained`](Self::record_launch_chained) and rings the doorbell: its
    /// first launch waits for the queue's earlier work, and the fence completes when its last launch has completed.
    pub fn end_chain(&mut self) -> Result<Fence> {
        let fence = self.end_open_chain()?.ok_or(Error::NoChain)?;
        self.queue.kick();
        Ok(fence)
    }

    /// Turns chaining by the GPU on or off from now on
    /// ([`ComputeQueueConfig::chained_stream`](super::ComputeQueueConfig::chained_stream)); links already held are
    /// sent first when it is turned off.
    pub fn set_chained_stream(&mut self, chained: bool) -> Result<()> {
        if !chained && self.chained_stream {
            self.flush_held()?;
        }
        self.chained_stream = chained;
        Ok(())
    }

    /// On a chained stream ([`ComputeQueueConfig::chained_stream`](super::ComputeQueueConfig::chained_stream)),
    /// holds a stream-ordered or programmatic launch as the next link of the open chain when the queue's last
    /// submission is still running or links are already held, and returns the timeline value it will complete with;
    /// `None` when it is to be sent as usual (the queue is idle, or the launch is cooperative or unordered, or a
    /// built-in fill or copy, or unordered launches wait for a join). A launch that finds the GPU done with everything sent while links are
    /// held sends them with itself at once: the GPU never waits for links beyond the launch that noticed.
    pub(super) fn hold(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        order: Order,
    ) -> Result<Option<u64>> {
        if !self.chained_stream
            || self.hold_off
            || order == Order::Unordered
            || self.cooperative.is_some()
            || self.unordered_pending
        {
            return Ok(None);
        }
        // One read of the timeline while work is in flight (none once it has been seen complete).
        let idle = self
            .queue
            .timeline()
            .is_reached(self.queue.last_submitted());
        if idle && self.chain.is_none() {
            return Ok(None);
        }
        self.record_chained_as(kernel, cfg, args, order == Order::Programmatic)?;
        // The open chain is sent as the queue's next submission (a full part was sent above if need be; no
        // unordered launch is pending here).
        let value = self.next_chain_value();
        if idle {
            self.end_open_chain()?;
            self.queue.kick();
        }
        Ok(Some(value))
    }

    /// Sends the links held by a chained stream, or the open chain of
    /// [`record_launch_chained`](Self::record_launch_chained) (as [`end_chain`](Self::end_chain) would), and rings
    /// the doorbell for everything recorded. Nothing to send is not an error.
    pub fn flush_held(&mut self) -> Result<()> {
        self.end_open_chain()?;
        // With the write prefetch, as a launch call rings: a caller that records deferred launches and flushes each
        // gets the same head start on its next launch.
        self.send_launch_now();
        Ok(())
    }

    /// Launches recorded in the open chain, not yet sent.
    pub fn chain_len(&self) -> usize {
        self.chain.map_or(0, |c| c.len)
    }

    /// How a chain's QMDs schedule the next one: `InvalidateCopySchedule` (the default) fetches each QMD afresh, as
    /// rewritten slots need; `Schedule` is what libcuda's graphs use for QMDs that never change. Under `Schedule` no
    /// QMD is read ahead of its launch ([`ComputeQueueConfig::prefetch_qmds`](super::ComputeQueueConfig::prefetch_qmds)),
    /// and a link into a slot read ahead before fetches afresh, since a `Schedule` link would run the copy read then.
    pub fn set_chain_action(&mut self, action: ChainAction) {
        self.chain_action = action;
    }

    pub(super) fn end_open_chain(&mut self) -> Result<Option<Fence>> {
        let Some(mut c) = self.chain.take() else {
            return Ok(None);
        };
        self.next_part = FIRST_CHAIN_PART.min(self.chain_part);
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let prev = self.queue.last_submitted();
        let value = prev + 1;
        let prev_done = self.settled_now(prev);
        let cb_va = self.slot_qmd_va(c.last_slot) + QMD_BYTES;
        qmd::patch_launch(self.version, &mut c.last_qmd, cb_va, Some(value))?;
        qmd::set_chain_link(self.version, &mut c.last_qmd, None)?;
        self.write_qmd(c.last_slot, &c.last_qmd)?;
        // Read before the invalidation is recorded: code uploaded after it is not counted as seen.
        let newest = newest_generation();
        let sent = self.send(c.first_slot, c.invalidate, prev_done, prev)?;
        debug_assert_eq!(sent, value);
        if c.invalidate {
            self.seen_generation = newest;
        }
        let n = self.slot_values.len();
        for i in 0..c.len {
            self.slot_values[(c.first_slot + i) % n] = value;
        }
        Ok(Some(self.queue.fence_for(sent)))
    }
}
