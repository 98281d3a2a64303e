//! Replaying an instantiated graph ([`ComputeQueue::replay_graph`]): a prefix when needed, the prebuilt methods,
//! the timeline release, one doorbell.

use std::sync::Arc;

use crate::launch::{Error, Result};
use crate::module::newest_generation;
use crate::pushbuf::{Fence, Release, Signal};

use super::{ComputeQueue, GraphExec};

impl ComputeQueue {
    /// Runs `exec` once, after every earlier launch and copy of this queue; later ones run after it. One doorbell;
    /// no allocation and no system call (once the queue has seen the graph's modules, and unless the ring or the
    /// pushbuffer is full). The fence completes when every node has completed and its writes are visible to the CPU.
    /// An error if `exec` was instantiated on another queue.
    ///
    /// # Safety
    /// Every kernel of the graph runs with the arguments it was recorded (or last updated) with, and may read and
    /// write any memory they lead it to. The caller guarantees that each node's declared reads and writes cover
    /// what it accesses (the graph orders nothing else), that this memory is alive, and that memory the graph
    /// writes is not in use elsewhere until the fence completes.
    pub unsafe fn replay_graph(&mut self, exec: &mut GraphExec) -> Result<Fence> {
        if exec.queue_id != self.id {
            return Err(Error::GraphQueue {
                built: exec.queue_id,
                used: self.id,
            });
        }
        self.end_open_chain()?;
        if self.unordered_pending {
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        if let Some(fifo) = &exec.printf
            && !self.printf.as_ref().is_some_and(|f| Arc::ptr_eq(f, fifo))
            && let Some(old) = self.printf.replace(fifo.clone())
        {
            // As a launch of a module with a FIFO of its own does: drain the one held so far.
            let _ = old.drain();
        }
        if !exec.pieces.is_empty() {
            let prev = self.queue.last_submitted();
            let prev_done = self.settled_now(prev);
            // Read before the invalidation is recorded: code uploaded after it is not counted as seen.
            let newest = newest_generation();
            let new_code = self.seen_generation < exec.generation;
            let invalidate = new_code || exec.banks_written || exec.shared_banks;
            if !prev_done || invalidate {
                let timeline_va = self.queue.timeline().va();
                let order = self.ordering;
                // Released by nothing: the replay's own release below covers this value too.
                self.queue.record(16, Signal::Recorded, |p, _| {
                    if invalidate {
                        p.invalidate_shader_caches_no_wfi();
                    }
                    if !prev_done {
                        order.wait(p, timeline_va, prev);
                    }
                })?;
                if new_code {
                    self.seen_generation = newest;
                }
                exec.banks_written = false;
            }
            if !exec.armed {
                for &(va, dwords) in &exec.arm_pieces {
                    self.queue.push_prebuilt(va, dwords)?;
                }
                exec.armed = true;
            }
            for &(va, dwords) in &exec.pieces {
                self.queue.push_prebuilt(va, dwords)?;
            }
        }
        let fence = if exec.pieces.is_empty() {
            self.queue.record(0, Signal::Host, |_, _| {})?
        } else {
            // The pieces end with acquires that pass only once every node has completed, each sink after its
            // system-scope membar: release at once instead of waiting for the engine to idle (~1.5 us per replay,
            // which back-to-back replays pay between each other). The front end then released the value itself,
            // so what follows needs no acquire of it.
            let timeline_va = self.queue.timeline().va();
            let fence = self.queue.record(8, Signal::Recorded, |p, own| {
                p.sem_release(timeline_va, own, Release::NOW_64)
            })?;
            self.front_settled = fence.value();
            fence
        };
        self.queue.kick();
        exec.last = Some(fence.clone());
        Ok(fence)
    }
}
