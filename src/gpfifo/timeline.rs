use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::{ChannelFault, Error, Result};

/// A page of 64-bit semaphores in CPU-cached system memory, which the GPU releases and the CPU polls.
/// Slots are 16 bytes apart: a four-word release writes a payload and a timestamp.
#[derive(Debug)]
pub struct Semaphores {
    mem: Memory,
    /// Per slot, a value the CPU has already read there: a lower bound of the slot's value that costs no read of
    /// memory the GPU writes (each such read misses the CPU's cache once the GPU has released).
    seen: Box<[AtomicU64]>,
}

impl Semaphores {
    /// Bytes between slots: room for a four-word release (payload and timestamp).
    pub const STRIDE: u64 = 16;
    const SIZE: u64 = 0x1000;

    /// A zeroed page of semaphores in memory the CPU polls and the GPU caches, below 1 TiB.
    pub fn new(core: &Arc<GpuCore>) -> Result<Arc<Semaphores>> {
        let desc = MemoryDesc::video(Self::SIZE)
            .placement(Placement::Semaphores)
            .with_cpu()
            .low();
        let mem = Memory::alloc(core, desc)?;
        mem.fill(0, Self::SIZE, 0)?;
        let seen = (0..Self::SIZE / Self::STRIDE)
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(Arc::new(Semaphores { mem, seen }))
    }

    /// The memory behind the semaphores (to map it on another GPU that waits on them).
    pub fn memory(&self) -> &Memory {
        &self.mem
    }

    /// How many slots the page holds (256).
    pub fn slots(&self) -> usize {
        (Self::SIZE / Self::STRIDE) as usize
    }

    /// GPU address of `slot`.
    pub fn va(&self, slot: usize) -> u64 {
        self.mem.va() + slot as u64 * Self::STRIDE
    }

    /// The value at `slot` (volatile: the GPU writes it). Out-of-range slots read as 0.
    pub fn read(&self, slot: usize) -> u64 {
        let v = self
            .mem
            .read_u64_volatile(slot as u64 * Self::STRIDE)
            .unwrap_or(0);
        if let Some(seen) = self.seen.get(slot)
            && v > seen.load(Ordering::Relaxed)
        {
            // A racing reader may store an older value after ours: `seen` then lags, which costs a read, never
            // a wrong answer (every value stored was read from the slot).
            seen.store(v, Ordering::Relaxed);
        }
        v
    }

    /// A value already read at `slot` (no read of the semaphore itself): at most what [`read`](Self::read)
    /// would return now.
    pub fn seen(&self, slot: usize) -> u64 {
        self.seen.get(slot).map_or(0, |s| s.load(Ordering::Relaxed))
    }

    /// The timestamp a four-word release wrote after the payload (nanoseconds, GPU clock).
    pub fn timestamp(&self, slot: usize) -> u64 {
        self.mem
            .read_u64_volatile(slot as u64 * Self::STRIDE + 8)
            .unwrap_or(0)
    }

    /// Sets `slot` to `value` from the CPU (to reset a timeline, or to release a waiter by hand).
    pub fn write(&self, slot: usize, value: u64) -> Result<()> {
        self.mem
            .write_u64_volatile(slot as u64 * Self::STRIDE, value)?;
        if let Some(seen) = self.seen.get(slot) {
            seen.store(value, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// A monotonically increasing 64-bit value in a semaphore slot: the GPU releases `n` when the n-th piece of
/// work is done; the CPU compares.
#[derive(Clone, Debug)]
pub struct Timeline {
    sems: Arc<Semaphores>,
    slot: usize,
}

impl Timeline {
    /// The timeline in slot `slot` of `sems`.
    pub fn new(sems: Arc<Semaphores>, slot: usize) -> Timeline {
        Timeline { sems, slot }
    }

    /// GPU address of the timeline's semaphore: what releases write and acquires poll.
    pub fn va(&self) -> u64 {
        self.sems.va(self.slot)
    }

    /// The last value the GPU released.
    pub fn completed(&self) -> u64 {
        self.sems.read(self.slot)
    }

    /// Whether the GPU has released `value` (or a later one). Reads the semaphore only when no earlier read
    /// already showed it.
    pub fn is_reached(&self, value: u64) -> bool {
        self.is_known_reached(value) || self.completed() >= value
    }

    /// Whether an earlier read already showed `value` released (never reads the semaphore: false may be stale).
    pub fn is_known_reached(&self, value: u64) -> bool {
        self.sems.seen(self.slot) >= value
    }

    /// The newest value an earlier read showed (never reads the semaphore).
    pub fn known(&self) -> u64 {
        self.sems.seen(self.slot)
    }

    /// The semaphore page the timeline lives in.
    pub fn semaphores(&self) -> &Arc<Semaphores> {
        &self.sems
    }

    /// The timeline's slot in its page.
    pub fn slot(&self) -> usize {
        self.slot
    }
}

/// Spins (then yields) until `done()` holds, `fault()` reports a channel error, or `timeout` passes.
pub fn wait_until(
    what: &'static str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
    mut fault: impl FnMut() -> Option<ChannelFault>,
) -> Result<()> {
    // A short pure spin catches the microsecond completions this library exists for; after that, yield
    // so a long kernel does not starve other threads, and look at the clock and the error notifier.
    for _ in 0..2048 {
        if done() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if done() {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            if let Some(f) = fault() {
                return Err(Error::Fault(f));
            }
            if start.elapsed() >= timeout {
                // One last look: the value may have landed while we read the clock.
                return if done() {
                    Ok(())
                } else {
                    Err(Error::Timeout {
                        what,
                        waited: start.elapsed(),
                    })
                };
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_times_out_with_what_it_waited_for() {
        let e = wait_until("nothing", Duration::from_millis(5), || false, || None).unwrap_err();
        assert!(
            matches!(e, Error::Timeout { what: "nothing", waited } if waited >= Duration::from_millis(5))
        );
    }

    #[test]
    fn wait_returns_as_soon_as_done() {
        let mut n = 0;
        wait_until(
            "n",
            Duration::from_secs(5),
            || {
                n += 1;
                n > 5000
            },
            || None,
        )
        .unwrap();
    }

    #[test]
    fn a_fault_ends_the_wait() {
        let f = ChannelFault {
            status: 0xffff,
            info32: 31,
            info16: 0,
            timestamp_ns: 1,
            mmu: None,
            sm: None,
        };
        let e = wait_until("x", Duration::from_secs(5), || false, || Some(f)).unwrap_err();
        assert!(matches!(e, Error::Fault(ChannelFault { info32: 31, .. })));
    }
}
