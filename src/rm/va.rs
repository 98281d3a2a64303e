//! Address ranges shared by the CPU and the GPU.
//!
//! UVM external ranges make a GPU virtual address equal to the CPU address of the same buffer, so APEX
//! reserves CPU address space (PROT_NONE, no backing) and hands out GPU addresses from it: nothing else in
//! the process can be mapped there, and a buffer can be mapped for the CPU at exactly its GPU address.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
use tracing::debug;

use super::{Error, Result};

/// A reserved range of the process's address space with a first-fit allocator over it.
#[derive(Debug)]
pub struct VaRegion {
    base: u64,
    size: u64,
    free: Mutex<BTreeMap<u64, u64>>,
}

impl VaRegion {
    /// Reserves `size` bytes at the first of `candidates` that is free (below `limit`), or anywhere the
    /// kernel chooses when `candidates` is empty.
    pub fn reserve(
        size: u64,
        candidates: impl IntoIterator<Item = u64>,
        limit: u64,
    ) -> Result<VaRegion> {
        let flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        let mut tried = false;
        for base in candidates {
            tried = true;
            if base.checked_add(size).is_none_or(|end| end > limit) {
                continue;
            }
            // SAFETY: FIXED_NOREPLACE never replaces an existing mapping; PROT_NONE backs nothing.
            let r = unsafe {
                mmap_anonymous(
                    base as *mut c_void,
                    size as usize,
                    ProtFlags::empty(),
                    flags | MapFlags::FIXED_NOREPLACE,
                )
            };
            match r {
                Ok(p) if p as u64 == base => return Ok(Self::new(base, size)),
                Ok(p) => {
                    // An old kernel treated the address as a hint; give the range back and try the next.
                    // SAFETY: `p` is the mapping just created, of `size` bytes.
                    let _ = unsafe { munmap(p, size as usize) };
                }
                Err(_) => continue,
            }
        }
        if tried {
            return Err(Error::NoVaReservation);
        }
        // SAFETY: a fresh PROT_NONE mapping at a kernel-chosen address.
        let p = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                size as usize,
                ProtFlags::empty(),
                flags,
            )
        }
        .map_err(|e| Error::Mmap {
            what: "address-space reservation",
            source: e.into(),
        })?;
        Ok(Self::new(p as u64, size))
    }

    fn new(base: u64, size: u64) -> VaRegion {
        debug!(
            base = format_args!("{base:#x}"),
            size = format_args!("{size:#x}"),
            "reserved VA region"
        );
        VaRegion {
            base,
            size,
            free: Mutex::new(BTreeMap::from([(base, size)])),
        }
    }

    /// The region's lowest address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The region's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether `[va, va + len)` lies inside the region.
    pub fn contains(&self, va: u64, len: u64) -> bool {
        va >= self.base
            && va
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.size)
    }

    /// A free range of `size` bytes aligned to `align` (a power of two).
    pub fn alloc(&self, size: u64, align: u64) -> Result<u64> {
        if size == 0 || !align.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "VA allocation of {size:#x} bytes aligned to {align:#x}"
            )));
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let found = free.iter().find_map(|(&start, &len)| {
            let va = start.checked_add(align - 1)? & !(align - 1);
            let end = va.checked_add(size)?;
            (end <= start + len).then_some((start, len, va, end))
        });
        let Some((start, len, va, end)) = found else {
            return Err(Error::OutOfVa { size, align });
        };
        free.remove(&start);
        if va > start {
            free.insert(start, va - start);
        }
        if end < start + len {
            free.insert(end, start + len - end);
        }
        Ok(va)
    }

    /// Returns a range from [`alloc`](Self::alloc), merging it with free neighbours.
    pub fn free(&self, va: u64, size: u64) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (mut start, mut len) = (va, size);
        if let Some((&prev, &plen)) = free.range(..va).next_back()
            && prev + plen == va
        {
            free.remove(&prev);
            start = prev;
            len += plen;
        }
        if let Some(&nlen) = free.get(&(va + size)) {
            free.remove(&(va + size));
            len += nlen;
        }
        free.insert(start, len);
    }

    /// Puts the reservation back over `[va, va + size)` after a device mapping there is torn down.
    pub fn unmap(&self, va: u64, size: u64) -> Result<()> {
        debug_assert!(self.contains(va, size));
        // SAFETY: the range lies inside this reservation and its previous mapping belongs to the caller,
        // which no longer uses it; MAP_FIXED replaces it atomically with inaccessible memory.
        unsafe {
            mmap_anonymous(
                va as *mut c_void,
                size as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED,
            )
        }
        .map(|_| ())
        .map_err(|e| Error::Mmap {
            what: "re-reserving freed range",
            source: e.into(),
        })
    }

    /// Bytes currently free (for leak checks in tests).
    pub fn free_bytes(&self) -> u64 {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }
}

impl Drop for VaRegion {
    fn drop(&mut self) {
        // SAFETY: the whole reservation is ours; every buffer inside it was freed before the region.
        let _ = unsafe { munmap(self.base as *mut c_void, self.size as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_alignment_and_coalescing() {
        let r = VaRegion::reserve(1 << 30, [], u64::MAX).unwrap();
        let total = r.free_bytes();
        let a = r.alloc(0x1000, 0x1000).unwrap();
        let b = r.alloc(0x3000, 0x20_0000).unwrap();
        assert_eq!(b % 0x20_0000, 0);
        assert!(r.contains(a, 0x1000) && r.contains(b, 0x3000));
        assert!(b >= a + 0x1000);
        r.free(a, 0x1000);
        let c = r.alloc(0x1000, 0x1000).unwrap();
        assert_eq!(c, a, "first fit reuses the freed hole");
        r.free(b, 0x3000);
        r.free(c, 0x1000);
        assert_eq!(r.free_bytes(), total);
        assert_eq!(
            r.free.lock().unwrap().len(),
            1,
            "neighbours merge back into one range"
        );
    }

    #[test]
    fn exhaustion_and_bad_arguments_are_errors() {
        let r = VaRegion::reserve(1 << 20, [], u64::MAX).unwrap();
        assert!(matches!(
            r.alloc(2 << 20, 0x1000),
            Err(Error::OutOfVa { .. })
        ));
        assert!(matches!(r.alloc(0, 0x1000), Err(Error::InvalidArgument(_))));
        assert!(matches!(r.alloc(0x1000, 3), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn fixed_candidates_below_a_limit() {
        let r = VaRegion::reserve(1 << 24, (1..64u64).map(|i| i << 36), 1 << 43).unwrap();
        assert_eq!(r.base() % (1 << 36), 0);
        assert!(r.base() + r.size() <= 1 << 43);
        assert!(matches!(
            VaRegion::reserve(1 << 24, [1 << 40], 1 << 40),
            Err(Error::NoVaReservation)
        ));
    }
}
