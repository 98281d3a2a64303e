//! Armed submission: GPFIFO entries published ahead of the work they will carry, so that submitting work is
//! cached stores and no doorbell.
//!
//! Each armed slot is two entries. The first runs a host semaphore acquire that passes once a gate word in host
//! memory reaches the slot's sequence number. The second points at the slot's body and is fetched only after the
//! methods before it have run (`SYNC_WAIT`), so the front end reads the body after the gate opened, never a copy
//! prefetched before the CPU wrote it. A body holds an `END_PB_SEGMENT` header where its methods stop; an armed
//! slot never filled holds only that and runs as nothing. Submitting is: write the methods into the next body,
//! then store the gate. The front end, parked on the acquire, sees the store on its next poll.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::gpfifo::{Channel, GpEntry, Timeline};
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::encode::{Acquire, END_SEGMENT, Push};
use super::error::Result;

/// How an armed queue publishes entries ahead of its work (see [`Submission::Armed`](super::Submission::Armed)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Armed {
    /// Slots published ahead of use: a power of two from 2 to 256. Each costs the front end one semaphore read
    /// when it is passed unused (when a larger submission goes through the ring instead).
    pub slots: u32,
    /// Method words one slot holds, 16 to 4096, a multiple of 16. A submission that needs more goes through the
    /// ring with a doorbell, as on a queue that is not armed.
    pub slot_words: u32,
}

impl Default for Armed {
    fn default() -> Armed {
        Armed {
            slots: 16,
            slot_words: 256,
        }
    }
}

impl Armed {
    pub(super) fn check(&self) -> Result<()> {
        let ok = self.slots.is_power_of_two()
            && (2..=256).contains(&self.slots)
            && (16..=4096).contains(&self.slot_words)
            && self.slot_words.is_multiple_of(16);
        if ok {
            Ok(())
        } else {
            Err(crate::gpfifo::Error::InvalidConfig(format!(
                "armed submission with {} slots of {} words: need a power of two from 2 to 256 slots, and 16 to \
                 4096 words a slot, a multiple of 16",
                self.slots, self.slot_words
            ))
            .into())
        }
    }
}

/// Words before the first gate segment: the gate word alone on its 64-byte line, so the CPU's store to it does
/// not contend with the front end's reads of segments.
const GATE_WORDS: usize = 16;
/// Words a gate segment takes (one header and five semaphore words, padded).
const GATE_SEGMENT_WORDS: usize = 8;
/// Words of a gate segment that the front end runs.
const GATE_RUN_WORDS: u64 = 6;

/// The armed slots of one queue: a gate word, a gate segment and a body per slot, in CPU-cached host memory
/// the GPU reads without caching.
#[derive(Debug)]
pub(super) struct ArmedSlots {
    mem: Memory,
    words: NonNull<u32>,
    slots: usize,
    slot_words: usize,
    bodies: usize,
    /// Sequence number of the next slot to fill; sequence numbers start at 1.
    next: u64,
    /// Sequence number of the first slot not armed: `[next, armed)` are armed and empty.
    armed: u64,
    /// The gate's value: every slot up to it may run.
    opened: u64,
    /// Per slot, the timeline value whose release shows the front end is done with the slot's words.
    done: Box<[u64]>,
    /// Whether arming waits: empty slots were given up for a submission through the ring.
    paused: bool,
    /// Small submissions in a row that went through the ring since: arming starts again after two, so that a
    /// queue that alternates small and large work does not make the front end pass many empty slots.
    small_in_ring: u32,
    /// The timeline value an earlier read must show released before arming is tried again (the GPU was behind).
    retry_at: u64,
}

/// A slot's body being recorded into ([`ArmedSlots::body`]).
pub(super) struct Body<'a> {
    words: &'a mut [u32],
    keep: bool,
}

impl Body<'_> {
    /// The words to record into.
    pub(super) fn words(&mut self) -> &mut [u32] {
        self.words
    }

    /// The recording succeeded: the body keeps what was written.
    pub(super) fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Body<'_> {
    fn drop(&mut self) {
        if !self.keep
            && let Some(first) = self.words.first_mut()
        {
            *first = END_SEGMENT;
        }
    }
}

// SAFETY: `words` points into `mem`'s CPU mapping, owned by this struct; `&mut self` serialises every access.
unsafe impl Send for ArmedSlots {}

impl ArmedSlots {
    pub(super) fn new(core: &Arc<GpuCore>, config: Armed) -> Result<ArmedSlots> {
        config.check()?;
        let slots = config.slots as usize;
        let slot_words = config.slot_words as usize;
        let bodies = GATE_WORDS + slots * GATE_SEGMENT_WORDS;
        let bytes = ((bodies + slots * slot_words) * 4) as u64;
        // CPU-cached host memory the GPU does not cache: the CPU rewrites gate and bodies while the GPU runs, and
        // its stores stay in its cache until the front end reads them. (In video memory, through write-combined
        // BAR1, the front end's polls were slower and once did not see the gate open: H100, 2026-11-26.)
        let mem = Memory::alloc(
            core,
            MemoryDesc::video(bytes)
                .placement(Placement::SystemCached)
                .with_cpu()
                .low(),
        )?;
        mem.fill(0, mem.size(), 0)?;
        let words = mem
            .cpu_ptr()
            .ok_or(crate::rm::Error::NotCpuMapped { size: bytes })?
            .cast::<u32>();
        Ok(ArmedSlots {
            mem,
            words,
            slots,
            slot_words,
            bodies,
            next: 1,
            armed: 1,
            opened: 0,
            done: vec![0; slots].into_boxed_slice(),
            paused: false,
            small_in_ring: 0,
            retry_at: 0,
        })
    }

    /// The most method words one slot takes.
    pub(super) fn capacity(&self) -> usize {
        // One word stays for the END_PB_SEGMENT header.
        self.slot_words - 1
    }

    fn index(&self, seq: u64) -> usize {
        (seq as usize) & (self.slots - 1)
    }

    fn words_at(&mut self, start: usize, len: usize) -> &mut [u32] {
        // SAFETY: every caller passes a range inside the mapping (a gate segment or a body); `&mut self` makes it
        // the only reference, and the GPU reads it only after the gate, which the CPU stores after these writes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_ptr().add(start), len) }
    }

    fn body_start(&self, index: usize) -> usize {
        self.bodies + index * self.slot_words
    }

    /// Prefetches for writing the first line of the next slot's body.
    #[inline]
    pub(super) fn prefetch_next(&self) {
        let start = self.body_start(self.index(self.next));
        crate::gpfifo::prefetch_for_write(self.words.as_ptr().wrapping_add(start).cast());
    }

    /// Slots armed and not yet filled.
    pub(super) fn empty(&self) -> u64 {
        self.armed - self.next
    }

    /// Whether a submission of `words` method words can go into the next armed slot now.
    #[inline]
    pub(super) fn fits(&self, words: usize) -> bool {
        self.next < self.armed && words <= self.capacity()
    }

    /// The next armed slot's body, `words` long, to record into. Call only after [`fits`](Self::fits)`(words)`.
    /// Unless [`Body::keep`] is called, the body is left empty again when the guard goes (an overflow, or a panic
    /// in the caller's recording), so its gate never opens on a fragment.
    #[inline]
    pub(super) fn body(&mut self, words: usize) -> Body<'_> {
        let start = self.body_start(self.index(self.next));
        let words = words.min(self.capacity());
        Body {
            words: self.words_at(start, words),
            keep: false,
        }
    }

    /// The body from [`body`](Self::body) holds `used` words of a submission that releases `value`; it runs
    /// once the gate is opened.
    #[inline]
    pub(super) fn commit(&mut self, used: usize, value: u64) {
        let index = self.index(self.next);
        let start = self.body_start(index);
        self.words_at(start + used, 1)[0] = END_SEGMENT;
        self.done[index] = value;
        self.next += 1;
    }

    /// Gives up the armed slots not yet filled, so that an entry pushed to the ring next runs after them: they
    /// run as nothing once the gate opens. `value` is the timeline value of the submission that follows them.
    pub(super) fn give_up_empty(&mut self, value: u64, small: bool) {
        for seq in self.next..self.armed {
            let i = self.index(seq);
            self.done[i] = value;
        }
        if self.next < self.armed {
            self.paused = true;
        }
        self.next = self.armed;
        self.small_in_ring = if small {
            self.small_in_ring.saturating_add(1)
        } else {
            0
        };
    }

    /// Opens the gate up to the last filled slot (after ordering the stores before it for the GPU). Returns
    /// whether it moved.
    #[inline]
    pub(super) fn open(&mut self, channel: &Channel) -> bool {
        let last = self.next - 1;
        if last == self.opened {
            return false;
        }
        channel.order_stores();
        // SAFETY: the gate is the first 8 bytes of the mapping, 64-byte aligned; the front end reads it, so the
        // store is volatile.
        unsafe { self.words.as_ptr().cast::<u64>().write_volatile(last) };
        self.opened = last;
        true
    }

    /// Whether fewer than half the slots are armed, small submissions keep coming, and (by `known`, the timeline
    /// value already read) the GPU may be done with enough slots to arm half of them.
    #[inline]
    pub(super) fn wants_arming(&self, known: u64) -> bool {
        let empty = (self.armed - self.next) as usize;
        empty < self.slots / 2
            && (!self.paused || self.small_in_ring >= 2)
            && known >= self.retry_at
    }

    /// Arms as many slots as are free (their earlier use complete on `timeline`) and fit the ring, without
    /// waiting. The caller rings the doorbell for the entries pushed. Returns how many were armed.
    pub(super) fn arm(
        &mut self,
        channel: &mut Channel,
        timeline: &Timeline,
        timeout: Duration,
    ) -> Result<u32> {
        let gate_va = self.mem.va();
        let mut armed = 0;
        // Half the slots at a time, or none: the slot that makes up half must be free (its earlier use complete)
        // and the ring must hold the entries. What earlier reads showed first: reading the semaphore misses the
        // CPU's cache once the GPU has released.
        let half = self.slots / 2;
        let mut free = channel.ring_state().free();
        if free < 2 * half as u32 {
            free = channel.refresh();
        }
        let needed_done = self.done[self.index(self.armed + half as u64 - 1)];
        let mut completed = timeline.known();
        if needed_done > completed {
            completed = timeline.completed();
        }
        if needed_done > completed || free < 2 * half as u32 {
            // The GPU is behind: a kick looks again once an earlier read shows that slot's value released, or (for a
            // ring short of entries) shows the GPU has moved on at all.
            self.retry_at = needed_done.max(completed + 1);
            return Ok(0);
        }
        self.retry_at = 0;
        self.paused = false;
        self.small_in_ring = 0;
        while ((self.armed - self.next) as usize) < self.slots && free >= 2 {
            let i = self.index(self.armed);
            if self.done[i] > completed {
                break;
            }
            free -= 2;
            let seq = self.armed;
            let gate_start = GATE_WORDS + i * GATE_SEGMENT_WORDS;
            let mut push = Push::new(self.words_at(gate_start, GATE_SEGMENT_WORDS));
            // The acquire yields the channel group while the gate is closed (ACQUIRE_SWITCH_TSG): one that held on
            // made another queue's launches wait out its timeslice, 2.1 ms each (H100, 2026-11-26).
            push.sem_acquire(gate_va, seq, Acquire::StrictGeq, true, true);
            debug_assert_eq!(push.len() as u64, GATE_RUN_WORDS);
            let body = self.body_start(i);
            self.words_at(body, 1)[0] = END_SEGMENT;
            let gate = GpEntry::segment(self.mem.va() + gate_start as u64 * 4, GATE_RUN_WORDS)?;
            let body = GpEntry::segment(self.mem.va() + body as u64 * 4, self.slot_words as u64)?
                .fetched_after_previous();
            channel.push_entry(gate, timeout)?;
            channel.push_entry(body, timeout)?;
            self.armed += 1;
            armed += 1;
        }
        Ok(armed)
    }
}
