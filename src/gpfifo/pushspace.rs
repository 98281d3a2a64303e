use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::timeline::{Timeline, wait_until};
use super::{Error, Result};

/// Pushbuffer memory used as a ring: each submission takes a contiguous run of words, which becomes free again
/// once the timeline reaches the value that submission releases. Bookkeeping is preallocated; reserving and
/// committing allocate nothing.
#[derive(Debug)]
pub struct PushSpace {
    mem: Memory,
    words: NonNull<u32>,
    len: usize,
    head: usize,
    /// (start word, end word, timeline value) of submissions not known to be complete, oldest first.
    pending: Vec<(usize, usize, u64)>,
    first: usize,
    count: usize,
}

// SAFETY: the pointer is into `mem`'s CPU mapping, owned by this struct; `&mut self` serialises access.
unsafe impl Send for PushSpace {}

impl PushSpace {
    /// `bytes` of pushbuffer in `placement` (write-combined for the CPU), below the 40-bit limit.
    pub fn new(
        core: &Arc<GpuCore>,
        bytes: u64,
        placement: Placement,
        max_pending: usize,
    ) -> Result<PushSpace> {
        if placement == Placement::Semaphores {
            // GPU-cacheable: the GPU could run stale methods from its cache after the CPU rewrote them.
            return Err(Error::InvalidConfig(
                "a pushbuffer cannot live in GPU-cacheable semaphore memory; use video or system memory".into(),
            ));
        }
        let mem = Memory::alloc(
            core,
            MemoryDesc {
                size: bytes,
                placement,
                cpu_mapped: true,
                low: true,
                contiguous: false,
            },
        )?;
        let words = mem
            .cpu_ptr()
            .ok_or(crate::rm::Error::NotCpuMapped { size: bytes })?
            .cast::<u32>();
        let len = (mem.size() / 4) as usize;
        Ok(PushSpace {
            mem,
            words,
            len,
            head: 0,
            pending: vec![(0, 0, 0); max_pending.max(1)],
            first: 0,
            count: 0,
        })
    }

    /// The GPU address of the pushbuffer memory.
    pub fn va(&self) -> u64 {
        self.mem.va()
    }

    /// How many 32-bit words the pushbuffer holds.
    pub fn capacity_words(&self) -> usize {
        self.len
    }

    fn tail(&self) -> Option<usize> {
        (self.count > 0).then(|| self.pending[self.first].0)
    }

    fn retire(&mut self, completed: u64) {
        while self.count > 0 && self.pending[self.first].2 <= completed {
            self.first = (self.first + 1) % self.pending.len();
            self.count -= 1;
        }
        if self.count == 0 {
            // Nothing in flight: start again at the beginning, which keeps segments contiguous and small.
            self.head = 0;
        }
    }

    /// Where `words` would go if free now: Some(start) or None.
    fn fit(&self, words: usize) -> Option<usize> {
        if self.count == self.pending.len() {
            return None;
        }
        let Some(tail) = self.tail() else {
            return (words <= self.len).then_some(0);
        };
        if self.head >= tail {
            // Free: [head, len) and [0, tail). Never let head catch up with tail exactly (that reads as empty).
            if self.head + words <= self.len && !(self.head + words == self.len && tail == 0) {
                Some(self.head)
            } else if words < tail {
                Some(0)
            } else {
                None
            }
        } else {
            (self.head + words < tail).then_some(self.head)
        }
    }

    /// Whether `words` fit now, given the timeline's completed value (no waiting).
    pub fn fits_now(&mut self, words: usize, completed: u64) -> bool {
        self.retire(completed);
        self.fit(words).is_some()
    }

    /// Reserves `words` contiguous words, waiting up to `timeout` for earlier submissions to complete.
    /// Returns the GPU address and the words to write; nothing is committed until [`commit`](Self::commit).
    pub fn reserve(
        &mut self,
        words: usize,
        timeline: &Timeline,
        timeout: Duration,
    ) -> Result<(u64, &mut [u32])> {
        if words == 0 || words >= self.len {
            return Err(Error::InvalidConfig(format!(
                "a pushbuffer segment of {words} words (space holds {})",
                self.len
            )));
        }
        // What earlier reads showed first: reading the semaphore costs a cache miss once the GPU has released.
        self.retire(timeline.known());
        if self.fit(words).is_none() {
            self.retire(timeline.completed());
        }
        if self.fit(words).is_none() {
            let mut start = None;
            wait_until(
                "pushbuffer space (earlier submissions to complete)",
                timeout,
                || {
                    self.retire(timeline.completed());
                    start = self.fit(words);
                    start.is_some()
                },
                || None,
            )?;
        }
        let start = self.fit(words).expect("checked above");
        // SAFETY: start + words <= len words of our CPU mapping; the range is not referenced by any pending
        // submission (fit() keeps it clear of [tail, head)), so the GPU is not reading it.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(self.words.as_ptr().add(start), words) };
        Ok((self.mem.va() + start as u64 * 4, slice))
    }

    /// Commits the segment that [`reserve`](Self::reserve) returned at `va`, `used` words long, free again once
    /// the timeline reaches `value`.
    pub fn commit(&mut self, va: u64, used: usize, value: u64) {
        let start = ((va - self.mem.va()) / 4) as usize;
        let end = start + used;
        let slot = (self.first + self.count) % self.pending.len();
        self.pending[slot] = (start, end, value);
        self.count += 1;
        self.head = end;
    }

    /// Prefetches for writing the line the next reservation most likely starts in
    /// ([`prefetch_for_write`](super::prefetch_for_write)).
    #[inline]
    pub fn prefetch_head(&self) {
        if self.head < self.len {
            super::prefetch_for_write(self.words.as_ptr().wrapping_add(self.head).cast());
        }
    }

    /// Submissions whose words are still held.
    pub fn in_flight(&self) -> usize {
        self.count
    }
}
