//! `GpEntry::segment` on arbitrary (va, dwords): an accepted segment must be 4-byte aligned, 1 to
//! `MAX_DWORDS` long, end at or below `MAX_VA`, and read back as the same va and length; any raw entry word
//! must decode without panicking.
#![no_main]

use apex::gpfifo::GpEntry;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, u64, u64)| {
    let (va, dwords, raw) = input;
    // Half the time, steer toward the interesting range (below 2^40, lengths below 2^22).
    let (va, dwords) = if raw & 1 == 0 {
        (va & ((1 << 41) - 1), dwords & ((1 << 22) - 1))
    } else {
        (va, dwords)
    };
    if let Ok(e) = GpEntry::segment(va, dwords) {
        assert!(va.is_multiple_of(4));
        assert!((1..=GpEntry::MAX_DWORDS).contains(&dwords));
        assert!(va + dwords * 4 <= GpEntry::MAX_VA);
        assert_eq!((e.va(), e.dwords()), (va, dwords));
    } else {
        assert!(
            !va.is_multiple_of(4)
                || dwords == 0
                || dwords > GpEntry::MAX_DWORDS
                || va
                    .checked_add(dwords * 4)
                    .is_none_or(|end| end > GpEntry::MAX_VA)
        );
    }
    let e = GpEntry(raw);
    assert!(e.va() < GpEntry::MAX_VA && e.va().is_multiple_of(4));
    assert!(e.dwords() <= GpEntry::MAX_DWORDS);
});
