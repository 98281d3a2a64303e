//! The front end's view of a simulated GPU ([`SimBus`], [`SimView`]): channel registrations, the doorbell, and
//! memory by GPU address, each access checked against the live allocations.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};

use super::SimConfig;
use super::objects::{SimChannel, SimShared, State};
use crate::hw::host;
use crate::rm::transport::Handle;

/// Why the front end could not access memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The range is not inside one live allocation (never allocated, freed, or running past its end).
    #[error("{len:#x} bytes at {va:#x} are not inside one live allocation")]
    Unmapped {
        /// GPU address of the access.
        va: u64,
        /// Bytes accessed.
        len: u64,
    },
    /// A word access at an address that is not a multiple of its size.
    #[error("{len}-byte access at {va:#x} is not naturally aligned")]
    Misaligned {
        /// GPU address of the access.
        va: u64,
        /// Bytes accessed.
        len: u64,
    },
}

/// The simulated GPU as its front end sees it: channel registrations, the doorbell, memory by GPU VA.
#[derive(Clone, Debug)]
pub struct SimBus(pub(super) Arc<SimShared>);

impl SimBus {
    /// Holds the registry until the view is dropped: allocations cannot go away meanwhile.
    pub fn lock(&self) -> SimView<'_> {
        SimView {
            st: self.0.lock(),
            shared: &self.0,
        }
    }

    /// The GPU the simulated RM describes.
    pub fn config(&self) -> &SimConfig {
        &self.0.config
    }

    /// Nanoseconds since the simulated GPU was opened (its timestamp clock; never 0).
    pub fn now_ns(&self) -> u64 {
        self.0.start.elapsed().as_nanos() as u64 + 1
    }
}

/// A locked view of the simulated GPU. Every access is checked against the live allocations.
pub struct SimView<'a> {
    st: MutexGuard<'a, State>,
    shared: &'a SimShared,
}

impl SimView<'_> {
    /// The last performance boost asked of the GPU, `(flags, duration)` as `NV2080_CTRL_CMD_PERF_BOOST` took
    /// them; `None` when none was.
    pub fn perf_boost(&self) -> Option<(u32, u32)> {
        self.st.perf_boost
    }

    /// Whether the doorbell page was asked for through BAR1 (`NV_HOPPER_USERMODE_A_PARAMS::bBar1Mapping`), as
    /// USERD's writes travel; `None` when no usermode object was allocated.
    pub fn doorbell_through_bar1(&self) -> Option<bool> {
        self.st.usermode_bar1
    }

    /// The compute preemption mode set on channel group `group` (`NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_*`),
    /// or `None` where none was set (RM's default, wait for idle).
    pub fn compute_preemption(&self, group: Handle) -> Option<u32> {
        self.st.compute_preemption.get(&group).copied()
    }

    /// Every live GPFIFO channel.
    pub fn channels(&self) -> Vec<SimChannel> {
        self.st.channels.values().copied().collect()
    }

    /// The channel with RM handle `handle`, if it is live.
    pub fn channel(&self, handle: Handle) -> Option<SimChannel> {
        self.st.channels.get(&handle).copied()
    }

    /// Whether an object of `class` is allocated under channel `channel` (what SET_OBJECT may bind).
    pub fn channel_has_class(&self, channel: Handle, class: u32) -> bool {
        self.st
            .objects
            .values()
            .any(|o| o.parent == channel && o.class == class)
    }

    /// Whether `[va, va + len)` lies inside one live allocation.
    pub fn contains(&self, va: u64, len: u64) -> bool {
        self.st.holds(va, len)
    }

    fn ptr(&self, va: u64, len: u64, align: u64) -> std::result::Result<*mut u8, AccessError> {
        if !va.is_multiple_of(align) {
            return Err(AccessError::Misaligned { va, len });
        }
        if len == 0 || !self.st.holds(va, len) {
            return Err(AccessError::Unmapped { va, len });
        }
        Ok(va as *mut u8)
    }

    /// Copies `out.len()` bytes from GPU address `va`.
    pub fn read(&self, va: u64, out: &mut [u8]) -> std::result::Result<(), AccessError> {
        if out.is_empty() {
            return Ok(());
        }
        let p = self.ptr(va, out.len() as u64, 1)?;
        // SAFETY: the range lies inside a live allocation, which is mapped read-write (VA == CPU address) and
        // cannot be unmapped while we hold the registry lock; `out` is a Rust buffer, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` to GPU address `va`.
    pub fn write(&self, va: u64, data: &[u8]) -> std::result::Result<(), AccessError> {
        if data.is_empty() {
            return Ok(());
        }
        let p = self.ptr(va, data.len() as u64, 1)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Reads `n` little-endian words at `va` (4-byte aligned).
    pub fn read_words(&self, va: u64, n: usize) -> std::result::Result<Vec<u32>, AccessError> {
        let len = n as u64 * 4;
        let p = self.ptr(va, len, 4)?.cast::<u32>();
        // SAFETY: as in `read`; 4-byte aligned, n words in bounds. The CPU writes these words concurrently only
        // in ways the protocol forbids (like DMA), so per-word volatile loads are what the hardware sees.
        Ok((0..n)
            .map(|i| unsafe { p.add(i).read_volatile() })
            .collect())
    }

    /// An atomic 32-bit load at `va` (4-byte aligned), as the front end reads semaphores and GPPut.
    pub fn read_u32(&self, va: u64) -> std::result::Result<u32, AccessError> {
        let p = self.ptr(va, 4, 4)?;
        // SAFETY: in a live allocation, 4-byte aligned; the CPU polls these words, so atomically.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// An atomic 64-bit load at `va` (8-byte aligned).
    pub fn read_u64(&self, va: u64) -> std::result::Result<u64, AccessError> {
        let p = self.ptr(va, 8, 8)?;
        // SAFETY: in a live allocation, 8-byte aligned.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// An atomic 32-bit store at `va` (4-byte aligned), as the front end releases semaphores and GPGet.
    pub fn write_u32(&self, va: u64, value: u32) -> std::result::Result<(), AccessError> {
        let p = self.ptr(va, 4, 4)?;
        // SAFETY: in a live allocation, 4-byte aligned; semaphores and GPGet are polled by the CPU.
        unsafe { AtomicU32::from_ptr(p.cast()) }.store(value, Ordering::Release);
        Ok(())
    }

    /// An atomic 64-bit store at `va` (8-byte aligned).
    pub fn write_u64(&self, va: u64, value: u64) -> std::result::Result<(), AccessError> {
        let p = self.ptr(va, 8, 8)?;
        // SAFETY: in a live allocation, 8-byte aligned.
        unsafe { AtomicU64::from_ptr(p.cast()) }.store(value, Ordering::Release);
        Ok(())
    }

    /// Takes the last token written to the doorbell since the previous call (0 when none).
    pub fn take_doorbell(&self) -> u32 {
        let offset = host::c361::NOTIFY_CHANNEL_PENDING as usize;
        // SAFETY: the usermode page is USERMODE_SIZE bytes, owned by `shared` (alive: we borrow it); the offset
        // is inside it and 4-byte aligned.
        let word = unsafe { AtomicU32::from_ptr(self.shared.usermode.as_ptr().add(offset).cast()) };
        word.swap(0, Ordering::AcqRel)
    }
}
