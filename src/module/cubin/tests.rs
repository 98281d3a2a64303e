//! Tests of the cubin reader: relocations applied to placed variables, the ABS55 encoding, SM versions in
//! `e_flags`, `.nv.info` records.

use super::nvinfo::records;
use super::relocate::{ABS55_HI_MASK, ABS55_LO_MASK, Target, abs55_decode, abs55_encode};
use super::*;

/// References to a placed variable follow the symbol a relocation names: `var + n` past its end is still
/// `var`'s; through a section symbol only bytes inside the variable are; a split address without its addend is
/// refused.
#[test]
fn placed_references_follow_the_named_symbol() {
    let placed = [PlacedGlobal {
        image_offset: 0x100,
        size: 0x10,
        address: 0x9000_0000,
    }];
    let base = 0x1000_0000;
    let link = |symbol: u64, addend: i64, target: Target| {
        let mut img = vec![0u8; 0x200];
        let r = Relocation {
            kind: reloc::R_CUDA_64,
            offset: 0,
            symbol: SymbolValue::Image(symbol),
            addend,
            target,
            section: 0,
            refers_to: None,
        };
        apply(&r, base, &mut img, 0, &|_| None, &placed)
            .map(|()| u64::from_le_bytes(img[..8].try_into().unwrap()))
    };
    assert_eq!(link(0x100, 0x10, Target::Named).unwrap(), 0x9000_0010);
    assert_eq!(link(0x100, -4, Target::Named).unwrap(), 0x8fff_fffc);
    assert_eq!(link(0x0, 0x108, Target::Section).unwrap(), 0x9000_0008);
    assert_eq!(link(0x0, 0x110, Target::Section).unwrap(), base + 0x110);
    assert_eq!(link(0x110, 0, Target::Named).unwrap(), base + 0x110);
    assert!(link(0x0, 0, Target::SectionNoAddend).is_err());
    // Nothing placed: nothing changes, and nothing is refused.
    let mut img = vec![0u8; 8];
    let r = Relocation {
        kind: reloc::R_CUDA_64,
        offset: 0,
        symbol: SymbolValue::Image(0),
        addend: 0x108,
        target: Target::SectionNoAddend,
        section: 0,
        refers_to: None,
    };
    apply(&r, base, &mut img, 0, &|_| None, &[]).unwrap();
    assert_eq!(
        u64::from_le_bytes(img[..8].try_into().unwrap()),
        base + 0x108
    );
}

#[test]
fn abs55_matches_nvdisasm() {
    // `CALL.ABS.NOINC 0x0` from nvcc -G; nvdisasm reads bit 16 as 0x4, bit 23 as 0x200, bit 34 as 0x400 and
    // bit 80 as 0x100000000000000.
    let call =
        u128::from_le_bytes(*b"\x43\x79\x00\x00\x00\x00\x00\x00\x00\x00\xc0\x03\x00\xde\x3f\x00");
    for (bit, address) in [
        (16, 0x4u64),
        (23, 0x200),
        (34, 0x400),
        (80, 0x100_0000_0000_0000),
    ] {
        assert_eq!(abs55_encode(call, address), call | 1 << bit, "bit {bit}");
        assert_eq!(abs55_decode(call | 1 << bit), address);
    }
    let a = 0x7f12_3456_7890u64;
    assert_eq!(abs55_decode(abs55_encode(call, a)), a);
    // The rest of the instruction is untouched.
    assert_eq!(
        abs55_encode(call, a) & !(ABS55_LO_MASK | ABS55_HI_MASK),
        call
    );
}

#[test]
fn sm_from_flags_both_encodings() {
    assert_eq!(sm_from_e_flags(8, 0x0600_5a04), 90);
    assert_eq!(sm_from_e_flags(8, 0x0600_6402), 100);
    assert_eq!(sm_from_e_flags(7, 0x0050_0550), 80);
}

#[test]
fn records_reject_overruns() {
    assert!(records(&[4, 0x17, 12, 0, 1, 2], "t").is_err());
    assert!(records(&[1, 0x35], "t").is_err());
    assert!(records(&[9, 0x35, 0, 0], "t").is_err());
    let r = records(
        &[1, 0x35, 0, 0, 3, 0x19, 8, 0, 4, 0x1c, 4, 0, 0x60, 0, 0, 0],
        "t",
    )
    .unwrap();
    assert_eq!(r.len(), 3);
}

/// A cubin parsed from owned bytes keeps them without a copy and links from them exactly as one parsed from a
/// borrowed slice; bytes that do not parse come back with the error.
#[test]
fn owned_bytes_are_kept_not_copied_and_come_back_on_failure() {
    let fixture: &[u8] = include_bytes!("../../../kernels/conformance/module_data.sm_90.cubin");
    let owned = fixture.to_vec();
    let at = owned.as_ptr();
    let cubin = Cubin::parse_vec(owned).unwrap();
    assert_eq!(
        cubin.bytes().as_ptr(),
        at,
        "the same allocation, not a copy"
    );
    assert_eq!(cubin.bytes(), fixture);
    let borrowed = Cubin::parse(fixture).unwrap();
    let (mut a, mut b) = (
        vec![0u8; cubin.image_size() as usize],
        vec![0u8; borrowed.image_size() as usize],
    );
    cubin.link(0x7f00_0000_0000, &mut a).unwrap();
    borrowed.link(0x7f00_0000_0000, &mut b).unwrap();
    assert!(a == b, "the same image either way");
    // Each section linked on its own lands where the whole link put it.
    let mut one = Vec::new();
    for i in 0..cubin.image_section_count() {
        let off = cubin
            .link_section(i, 0x7f00_0000_0000, &mut one, &|_| None, &[])
            .unwrap() as usize;
        assert!(a[off..off + one.len()] == one[..], "section {i}");
    }
    let shared = cubin.clone();
    assert_eq!(shared.bytes().as_ptr(), at, "clones share the file");
    assert_eq!(
        cubin.into_bytes(),
        fixture,
        "copied out while a clone holds it"
    );
    let last = shared.into_bytes();
    assert_eq!(
        last.as_ptr(),
        at,
        "the last holder gets the allocation back"
    );

    let garbage = b"\x7fELF not really".to_vec();
    let (e, back) = Cubin::parse_vec(garbage.clone()).unwrap_err();
    assert!(matches!(e, CubinError::NotElf(_)), "{e}");
    assert_eq!(back, garbage);
}
