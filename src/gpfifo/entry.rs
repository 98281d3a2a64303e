use crate::hw::generation::encoder::host;

use super::{Error, Result};

/// One 8-byte GPFIFO entry: a pushbuffer segment's GPU address (40 bits) and length in dwords.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpEntry(pub u64);

impl GpEntry {
    /// Largest segment one entry can describe.
    pub const MAX_DWORDS: u64 =
        (1 << (host::GP_ENTRY1_LENGTH.hi - host::GP_ENTRY1_LENGTH.lo + 1)) - 1;
    /// The front end fetches 40 address bits from an entry.
    pub const MAX_VA: u64 = 1 << (32 + host::GP_ENTRY1_GET_HI.hi + 1);

    /// An entry that makes the channel execute `dwords` method words at `va`, as a subroutine (the level
    /// libcuda uses: the segment returns to the ring when it ends).
    pub fn segment(va: u64, dwords: u64) -> Result<GpEntry> {
        if !va.is_multiple_of(4) {
            return Err(Error::BadSegment {
                va,
                dwords,
                why: "not 4-byte aligned",
            });
        }
        if dwords == 0 || dwords > Self::MAX_DWORDS {
            return Err(Error::BadSegment {
                va,
                dwords,
                why: "length must be 1 to 2^21-1 dwords",
            });
        }
        if va
            .checked_add(dwords * 4)
            .is_none_or(|end| end > Self::MAX_VA)
        {
            return Err(Error::BadSegment {
                va,
                dwords,
                why: "above the 40-bit pushbuffer address limit",
            });
        }
        let e0 = host::GP_ENTRY0_GET.pack((va as u32) >> 2)
            | host::GP_ENTRY0_FETCH.pack(host::GP_ENTRY0_FETCH_UNCONDITIONAL);
        let e1 = host::GP_ENTRY1_GET_HI.pack((va >> 32) as u32)
            | host::GP_ENTRY1_LEVEL.pack(host::GP_ENTRY1_LEVEL_SUBROUTINE)
            | host::GP_ENTRY1_LENGTH.pack(dwords as u32)
            | host::GP_ENTRY1_SYNC.pack(host::GP_ENTRY1_SYNC_PROCEED);
        Ok(GpEntry(u64::from(e0) | (u64::from(e1) << 32)))
    }

    /// The same entry, fetched only once every method before it has run (`SYNC_WAIT`): the front end does not
    /// prefetch the segment, so the CPU may still write it after the entry is published, until a semaphore
    /// acquire in an earlier segment lets the channel pass.
    pub fn fetched_after_previous(self) -> GpEntry {
        GpEntry(self.0 | (u64::from(host::GP_ENTRY1_SYNC.pack(host::GP_ENTRY1_SYNC_WAIT)) << 32))
    }

    /// Whether the front end fetches the segment only after every method before it has run.
    pub fn is_fetched_after_previous(self) -> bool {
        host::GP_ENTRY1_SYNC.unpack((self.0 >> 32) as u32) == host::GP_ENTRY1_SYNC_WAIT
    }

    /// The GPU address of the pushbuffer segment this entry points at.
    pub fn va(self) -> u64 {
        let e0 = self.0 as u32;
        let e1 = (self.0 >> 32) as u32;
        (u64::from(host::GP_ENTRY1_GET_HI.unpack(e1)) << 32)
            | (u64::from(host::GP_ENTRY0_GET.unpack(e0)) << 2)
    }

    /// The segment's length in 32-bit words.
    pub fn dwords(self) -> u64 {
        u64::from(host::GP_ENTRY1_LENGTH.unpack((self.0 >> 32) as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_entry_libcuda_wrote() {
        // research/hopper-launch.md §3: raw=0x00061a02008347dc is va 0x2008347dc, SUBROUTINE, 390 dwords.
        let e = GpEntry::segment(0x2_0083_47dc, 390).unwrap();
        assert_eq!(e.0, 0x0006_1a02_0083_47dc);
        assert_eq!((e.va(), e.dwords()), (0x2_0083_47dc, 390));
    }

    #[test]
    fn sync_wait_sets_bit_63_only() {
        let e = GpEntry::segment(0x2_0083_47dc, 390).unwrap();
        assert!(!e.is_fetched_after_previous());
        let w = e.fetched_after_previous();
        assert_eq!(w.0, e.0 | (1 << 63));
        assert!(w.is_fetched_after_previous());
        assert_eq!((w.va(), w.dwords()), (e.va(), e.dwords()));
    }

    #[test]
    fn rejects_what_the_front_end_cannot_fetch() {
        assert!(GpEntry::segment(0x1002, 4).is_err());
        assert!(GpEntry::segment(0x1000, 0).is_err());
        assert!(GpEntry::segment(0x1000, 1 << 21).is_err());
        assert!(GpEntry::segment(1 << 40, 4).is_err());
        assert!(GpEntry::segment((1 << 40) - 8, 2).is_ok());
        assert!(GpEntry::segment((1 << 40) - 8, 3).is_err());
    }
}
