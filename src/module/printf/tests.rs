//! Tests of printf and assert: formatting, decoding, the committed runtime, linking plans, the ring protocol.

use super::fifo::{CAPACITY, DROPPED, HEAD, HEADER_BYTES, TAIL};
use super::format::{Consumes, MAX_FIELD, conversions};
use super::record::{KIND_ASSERT, KIND_PRINTF, u64_at};
use super::runtime::{FIFO_SYMBOL, RUNTIME_SM90};
use super::*;

fn record(kind: u32, body: &[u8]) -> Vec<u8> {
    let len = (8 + body.len()).next_multiple_of(8);
    let mut r = Vec::with_capacity(len);
    r.extend_from_slice(&(u64::from(kind) | ((len as u64) << 32)).to_le_bytes());
    r.extend_from_slice(body);
    r.resize(len, 0);
    r
}

fn fmt_slot(f: &str) -> Vec<u8> {
    let mut v = f.as_bytes().to_vec();
    v.push(0);
    v.resize(v.len().next_multiple_of(8), 0);
    v
}

fn str_slot(s: Option<&str>) -> Vec<u8> {
    match s {
        None => u64::MAX.to_le_bytes().to_vec(),
        Some(s) => {
            let mut v = (s.len() as u64).to_le_bytes().to_vec();
            v.extend_from_slice(s.as_bytes());
            v.resize(8 + s.len().next_multiple_of(8), 0);
            v
        }
    }
}

#[test]
fn formats_like_c() {
    let f = |fmt: &str, args: &[PrintfArg]| {
        String::from_utf8(format_printf(fmt.as_bytes(), args)).unwrap()
    };
    use PrintfArg::Word as W;
    assert_eq!(f("i=%d\n", &[W(-5i32 as u32 as u64)]), "i=-5\n");
    assert_eq!(
        f("%u %x %#X %o", &[W(255), W(255), W(255), W(8)]),
        "255 ff 0XFF 10"
    );
    assert_eq!(
        f("%lld %llu", &[W(-3i64 as u64), W(u64::MAX)]),
        "-3 18446744073709551615"
    );
    assert_eq!(f("%ld|%zu", &[W(-1i64 as u64), W(7)]), "-1|7");
    assert_eq!(
        f(
            "%.3f %e %g",
            &[
                W(1.5f64.to_bits()),
                W(2.0f64.to_bits()),
                W(0.5f64.to_bits())
            ]
        ),
        "1.500 2.000000e+00 0.5"
    );
    assert_eq!(
        f("[%8d] [%-8d] [%+d]", &[W(42), W(42), W(42)]),
        "[      42] [42      ] [+42]"
    );
    assert_eq!(
        f("[%*d] [%.*f]", &[W(6), W(42), W(2), W(1.239f64.to_bits())]),
        "[    42] [1.24]"
    );
    assert_eq!(f("%hd %hhu", &[W(0x1_0005), W(0x1ff)]), "5 255");
    assert_eq!(f("%c%c", &[W(b'o' as u64), W(b'k' as u64)]), "ok");
    assert_eq!(
        f("100%% %s", &[PrintfArg::Str(Some(b"done".to_vec()))]),
        "100% done"
    );
    assert_eq!(
        f("[%10.4s]", &[PrintfArg::Str(Some(b"truncate".to_vec()))]),
        "[      trun]"
    );
    assert_eq!(f("%s", &[PrintfArg::Str(None)]), "(null)");
    assert_eq!(f("%p", &[W(0x1000)]), "0x1000");
    assert_eq!(f("%y %d", &[W(1)]), "%y 1");
    assert_eq!(f("tail %", &[]), "tail %");
    // Missing arguments print as zero rather than reading anything else.
    assert_eq!(f("%d %s", &[]), "0 (null)");
    // Huge fields are bounded.
    assert_eq!(f("%999999999d", &[W(1)]).len(), MAX_FIELD as usize);
    assert_eq!(f("%*d", &[W(1 << 30), W(1)]).len(), MAX_FIELD as usize);
    assert_eq!(
        f("%.99999999f", &[W(1.0f64.to_bits())]).len(),
        MAX_FIELD as usize + 2
    );
}

#[test]
fn conversions_match_the_device_walk() {
    use Consumes::*;
    assert_eq!(
        conversions(b"%d %s %*.*f %% %p %n %lld %y"),
        vec![Word, Str, Word, Word, Word, Word, Word, Word]
    );
    assert_eq!(conversions(b"none"), vec![]);
}

#[test]
fn decodes_printf_and_assert_records() {
    let mut body = fmt_slot("a %d %s %s\n");
    body.extend_from_slice(&7u64.to_le_bytes());
    body.extend(str_slot(Some("xyz123456")));
    body.extend(str_slot(None));
    let r = decode_record(&record(KIND_PRINTF, &body)).unwrap();
    let DeviceRecord::Printf { format, args } = r else {
        panic!("{r:?}")
    };
    assert_eq!(format, b"a %d %s %s\n");
    assert_eq!(
        String::from_utf8(format_printf(&format, &args)).unwrap(),
        "a 7 xyz123456 (null)\n"
    );

    let mut body = Vec::new();
    body.extend_from_slice(&42u64.to_le_bytes());
    body.extend_from_slice(&(1u64 | 2 << 32).to_le_bytes());
    body.extend_from_slice(&(3u64 | 4 << 32).to_le_bytes());
    body.extend_from_slice(&(5u64 | 6 << 32).to_le_bytes());
    body.extend(str_slot(Some("x != bad")));
    body.extend(str_slot(Some("k.cu")));
    body.extend(str_slot(Some("void k(int)")));
    let DeviceRecord::Assert(a) = decode_record(&record(KIND_ASSERT, &body)).unwrap() else {
        panic!()
    };
    assert_eq!(
        a.to_string(),
        "k.cu:42: void k(int): block: [1,2,3], thread: [4,5,6] Assertion `x != bad` failed."
    );
}

#[test]
fn corrupt_records_are_errors() {
    assert!(decode_record(&[]).is_err());
    assert!(decode_record(&record(9, b"")).is_err());
    assert!(decode_record(&record(KIND_PRINTF, b"8 bytes!")).is_err());
    let mut body = fmt_slot("%s");
    body.extend_from_slice(&1000u64.to_le_bytes());
    assert!(decode_record(&record(KIND_PRINTF, &body)).is_err());
    assert!(decode_record(&record(KIND_ASSERT, &[0; 16])).is_err());
}

#[test]
fn the_committed_runtime_parses() {
    let rt = DeviceRuntime::parse(RUNTIME_SM90).unwrap();
    assert_eq!(rt.sm_version(), 90);
    let v = rt.function("vprintf").unwrap();
    let a = rt.function("__assertfail").unwrap();
    assert_eq!(
        (v.name.as_str(), a.name.as_str()),
        ("apex_vprintf", "apex_assertfail")
    );
    // Built with -maxrregcount=32 so it raises few kernels' register counts.
    assert!(
        v.registers <= 32 && a.registers <= 32,
        "{} {}",
        v.registers,
        a.registers
    );
    assert!(!v.relocs.is_empty() && v.relocs.iter().all(|r| r.symbol == FIFO_SYMBOL));
    assert!(v.code_size() > 0 && v.code_size().is_multiple_of(16));
}

#[test]
fn plan_refuses_unknown_externs_and_raises_kernels() {
    let both = ["malloc".to_owned(), "vprintf".to_owned()];
    let p = RuntimeLink::plan(90, &both, 0x100);
    assert_eq!(p.unsupported.len(), 1);
    let e = &p.unsupported[0];
    assert!(
        e.to_string().contains("malloc") && e.to_string().contains("APEX_BACKEND=driver"),
        "{e}"
    );
    // Only kernels that call the unsupported symbol are refused.
    assert!(p.refusal_for(&both[..1]).is_some());
    assert!(p.refusal_for(&both[1..]).is_none());
    assert!(p.link.is_some_and(|l| l.address(0, "vprintf").is_some()));
    let p = RuntimeLink::plan(80, &["vprintf".to_owned()], 0x100);
    assert!(p.link.is_none());
    assert!(
        p.unsupported[0].to_string().contains("Hopper"),
        "{}",
        p.unsupported[0]
    );
    assert!(RuntimeLink::plan(90, &[], 0).link.is_none());
    let plan = RuntimeLink::plan(90, &["vprintf".to_owned()], 0x104)
        .link
        .unwrap();
    assert_eq!(plan.placed[0].1, 0x180);
    assert_eq!(plan.address(0x1000, "vprintf"), Some(0x1180));
    // Linked on its own, the region runs from the first function to the end of the image, FIFO address patched.
    let (at, code) = plan.link_region(0x0000_7e57_0000_0000).unwrap();
    assert_eq!(at, 0x180);
    assert_eq!(at + code.len() as u64, plan.image_size);
    assert_ne!(
        code,
        plan.link_region(0x0000_7e58_0000_0000).unwrap().1,
        "the FIFO's address is in the code"
    );
    let (regs, stack) = plan.kernel_needs(Some(&["vprintf".to_owned()]), 24, 16);
    assert_eq!(regs, 32);
    assert!(stack > 16);
    assert_eq!(
        plan.kernel_needs(Some(&["vprintf".to_owned()]), 40, 0).0,
        40
    );
    // A kernel that calls nothing keeps its own needs.
    assert_eq!(plan.kernel_needs(Some(&[]), 24, 16), (24, 16));
    assert_eq!(plan.kernel_needs(None, 24, 16).0, 32);
}

/// Plays the device's half of the ring in host memory, as kernels/apex_printf.cu does.
struct FakeRing {
    bytes: std::cell::RefCell<Vec<u8>>,
    capacity: u64,
}

impl FakeRing {
    fn new(capacity: u64) -> FakeRing {
        let r = FakeRing {
            bytes: std::cell::RefCell::new(vec![0; (HEADER_BYTES + capacity) as usize]),
            capacity,
        };
        r.store(CAPACITY, capacity).unwrap();
        r
    }

    /// `reserve` + writes, without `publish` (the header stays zero) when `publish` is false.
    fn device_write(&self, rec: &[u8], publish: bool) -> bool {
        let len = rec.len() as u64;
        let (tail, head) = (self.load(TAIL).unwrap(), self.load(HEAD).unwrap());
        if tail + len - head > self.capacity {
            self.store(DROPPED, self.load(DROPPED).unwrap() + 1)
                .unwrap();
            return false;
        }
        self.store(TAIL, tail + len).unwrap();
        let mut b = self.bytes.borrow_mut();
        for (i, byte) in rec.iter().enumerate().skip(8) {
            b[(HEADER_BYTES + ((tail + i as u64) & (self.capacity - 1))) as usize] = *byte;
        }
        if publish {
            for (i, byte) in rec.iter().enumerate().take(8) {
                b[(HEADER_BYTES + ((tail + i as u64) & (self.capacity - 1))) as usize] = *byte;
            }
        }
        true
    }

    fn publish_at(&self, pos: u64, rec: &[u8]) {
        let mut b = self.bytes.borrow_mut();
        for (i, byte) in rec.iter().enumerate().take(8) {
            b[(HEADER_BYTES + ((pos + i as u64) & (self.capacity - 1))) as usize] = *byte;
        }
    }
}

impl RingMemory for FakeRing {
    fn load(&self, offset: u64) -> crate::rm::Result<u64> {
        let b = self.bytes.borrow();
        Ok(u64_at(&b, offset as usize).unwrap())
    }
    fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()> {
        self.bytes.borrow_mut()[offset as usize..offset as usize + 8]
            .copy_from_slice(&value.to_le_bytes());
        Ok(())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()> {
        out.copy_from_slice(&self.bytes.borrow()[offset as usize..offset as usize + out.len()]);
        Ok(())
    }
    fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()> {
        self.bytes.borrow_mut()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

fn line(n: u64) -> Vec<u8> {
    let mut body = fmt_slot("n=%d\n");
    body.extend_from_slice(&n.to_le_bytes());
    record(KIND_PRINTF, &body)
}

fn texts(recs: &[DeviceRecord]) -> Vec<String> {
    recs.iter()
        .map(|r| match r {
            DeviceRecord::Printf { format, args } => {
                String::from_utf8(format_printf(format, args)).unwrap()
            }
            DeviceRecord::Assert(a) => a.to_string(),
        })
        .collect()
}

#[test]
fn ring_wraps_waits_for_unpublished_records_and_counts_drops() {
    let ring = FakeRing::new(128); // each line record is 24 bytes
    let mut reported = 0;
    for n in 0..5 {
        assert!(ring.device_write(&line(n), true));
    }
    // 120 of 128 bytes used: the sixth does not fit and is dropped.
    assert!(!ring.device_write(&line(5), true));
    let (recs, dropped) = take_records(&ring, 128, &mut reported).unwrap();
    assert_eq!(texts(&recs), ["n=0\n", "n=1\n", "n=2\n", "n=3\n", "n=4\n"]);
    assert_eq!(dropped, 1);
    // Consumed bytes are zero again, head moved up to tail.
    assert_eq!(ring.load(HEAD).unwrap(), 120);
    assert!(
        ring.bytes.borrow()[HEADER_BYTES as usize..]
            .iter()
            .all(|&b| b == 0)
    );

    // Records that straddle the end of the ring; one reserved but not yet written blocks the ones after it.
    assert!(ring.device_write(&line(6), true)); // 120..144: wraps
    let pending_at = ring.load(TAIL).unwrap();
    assert!(ring.device_write(&line(7), false));
    assert!(ring.device_write(&line(8), true));
    let (recs, dropped) = take_records(&ring, 128, &mut reported).unwrap();
    assert_eq!((texts(&recs), dropped), (vec!["n=6\n".to_owned()], 0));
    ring.publish_at(pending_at, &line(7));
    let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
    assert_eq!(texts(&recs), ["n=7\n", "n=8\n"]);
    assert_eq!(ring.load(HEAD).unwrap(), ring.load(TAIL).unwrap());
}

#[test]
fn ring_discards_corrupt_contents_without_hanging() {
    let ring = FakeRing::new(128);
    let mut reported = 0;
    let mut bad = line(1);
    bad[4..8].copy_from_slice(&1000u32.to_le_bytes()); // a length past the tail
    assert!(ring.device_write(&bad, true));
    let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
    assert!(recs.is_empty());
    assert_eq!(ring.load(HEAD).unwrap(), ring.load(TAIL).unwrap());
    assert!(ring.device_write(&line(2), true));
    let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
    assert_eq!(texts(&recs), ["n=2\n"]);
    // Indices further apart than the ring: everything is discarded and head catches up.
    ring.store(TAIL, 10_000).unwrap();
    let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
    assert!(recs.is_empty());
    assert_eq!(ring.load(HEAD).unwrap(), 10_000);
}
