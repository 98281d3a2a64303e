//! Generated class tables spot-checked against the headers, and the pushbuffer/QMD decoder checked
//! against hand-assembled input, garbage, and captures of what libcuda wrote on an H200.

use apex::hw::{self, Field, compute::cbc0, copy::c8b5, host::c56f, host::c86f, qmd};
use apex::pushbuf::decode::{
    DecodeError, DecodedMethod, HeaderKind, QmdDecodeError, SubchannelClasses, decode, decode_qmd,
};

// ---------------------------------------------------------------------------------------------
// Generated tables
// ---------------------------------------------------------------------------------------------

#[test]
fn field_helpers() {
    let f = Field::new(24, 24);
    assert_eq!((f.width(), f.mask()), (1, 1));
    assert_eq!(f.pack(1), 1 << 24);
    assert_eq!(f.unpack(0x0100_0000), 1);
    assert!(f.fits(1) && !f.fits(2));
    assert_eq!(Field::new(63, 0).mask(), u64::MAX);
    assert_eq!(Field::new(31, 0).pack(0xdead_beef), 0xdead_beef);
    // A field straddling two words.
    let mut words = [0u32; 4];
    let wide = Field::new(79, 16);
    wide.set(&mut words, 0x1234_5678_9abc_def0).unwrap();
    assert_eq!(words, [0xdef0_0000, 0x5678_9abc, 0x1234, 0]);
    assert_eq!(wide.get(&words), Some(0x1234_5678_9abc_def0));
    assert!(wide.get(&words[..2]).is_none());
    assert!(Field::new(3, 0).set(&mut words, 16).is_err());
}

#[test]
fn host_classes() {
    assert_eq!(c86f::CLASS, 0xc86f);
    assert_eq!(c86f::HOPPER_CHANNEL_GPFIFO_A, 0xc86f);
    assert_eq!(c86f::SEM_EXECUTE, 0x6c);
    assert_eq!(c86f::SEM_EXECUTE_OPERATION, Field::new(2, 0));
    assert_eq!(c86f::SEM_EXECUTE_OPERATION_RELEASE, 1);
    assert_eq!(c86f::SEM_EXECUTE_OPERATION_ACQ_CIRC_GEQ, 3);
    assert_eq!(c86f::SEM_EXECUTE_RELEASE_WFI, Field::new(20, 20));
    assert_eq!(c86f::SEM_EXECUTE_PAYLOAD_SIZE, Field::new(24, 24));
    assert_eq!(c86f::SEM_EXECUTE_RELEASE_TIMESTAMP, Field::new(25, 25));
    assert_eq!(c86f::SEM_ADDR_LO, 0x5c);
    assert_eq!(c86f::SEM_ADDR_HI_OFFSET, Field::new(24, 0));
    assert_eq!(c86f::GP_ENTRY1_LENGTH, Field::new(30, 10));
    assert_eq!(c56f::SET_OBJECT, 0);
    assert_eq!(c56f::NON_STALL_INTERRUPT, 0x20);
    assert_eq!(c56f::WFI, 0x78);
    assert_eq!(c56f::DMA_SEC_OP, Field::new(31, 29));
    assert_eq!(c56f::DMA_METHOD_COUNT, Field::new(28, 16));
    assert_eq!(c56f::DMA_METHOD_ADDRESS, Field::new(11, 0));
    assert_eq!(c56f::DMA_SEC_OP_END_PB_SEGMENT, 7);
    assert_eq!(hw::host::c361::NOTIFY_CHANNEL_PENDING, 0x90);
    assert_eq!(hw::host::c361::CLASS, 0xc361);
    assert_eq!(hw::host::ca6f::CLASS, 0xca6f);
}

#[test]
fn compute_and_copy_classes() {
    assert_eq!(cbc0::CLASS, 0xcbc0);
    assert_eq!(cbc0::HOPPER_COMPUTE_A, 0xcbc0);
    assert_eq!(cbc0::SEND_PCAS_A, 0x2b4);
    assert_eq!(cbc0::SEND_SIGNALING_PCAS2_B, 0x2c0);
    assert_eq!(cbc0::SEND_SIGNALING_PCAS2_B_PCAS_ACTION, Field::new(3, 0));
    assert_eq!(
        cbc0::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE,
        0xa
    );
    assert_eq!(cbc0::LOAD_INLINE_DATA, 0x1b4);
    assert_eq!(cbc0::LOAD_INLINE_QMD_DATA(0), 0x320);
    assert_eq!(cbc0::LOAD_INLINE_QMD_DATA(3), 0x32c);
    assert_eq!(cbc0::CALL_MME_DATA(2), 0x3814);
    assert_eq!(hw::compute::c6c0::CLASS, 0xc6c0);
    assert_eq!(hw::compute::cec0::CLASS, 0xcec0);
    assert_eq!(c8b5::CLASS, 0xc8b5);
    assert_eq!(c8b5::LAUNCH_DMA, 0x300);
    assert_eq!(c8b5::LAUNCH_DMA_DATA_TRANSFER_TYPE, Field::new(1, 0));
    assert_eq!(c8b5::SET_SEMAPHORE_PAYLOAD_UPPER, 0x24c);
    assert_eq!(hw::copy::cab5::CLASS, 0xcab5);
}

#[test]
fn qmd_layouts() {
    assert_eq!(qmd::v04::QMD_MAJOR_VERSION, Field::new(583, 580));
    assert_eq!(qmd::v04::GRID_WIDTH, Field::new(1055, 1024));
    assert_eq!(qmd::v04::CTA_THREAD_DIMENSION0, Field::new(1167, 1152));
    assert_eq!(qmd::v04::REGISTER_COUNT, Field::new(1208, 1200));
    assert_eq!(qmd::v04::PROGRAM_ADDRESS_LOWER, Field::new(1247, 1216));
    assert_eq!(
        qmd::v04::RELEASE_SEMAPHORE0_ADDR_LOWER,
        Field::new(671, 640)
    );
    assert_eq!(qmd::v04::CONSTANT_BUFFER_VALID(0), Field::new(416, 416));
    assert_eq!(qmd::v04::CONSTANT_BUFFER_VALID(5), Field::new(436, 436));
    assert_eq!(
        qmd::v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(1),
        Field::new(1631, 1600)
    );
    assert_eq!(qmd::v04::QMD_TYPE_GRID_CTA, 2);
    assert_eq!(qmd::v04::SIZE_BYTES, 384);
    assert_eq!(qmd::v03::QMD_MAJOR_VERSION, Field::new(583, 580));
    assert_eq!(qmd::v03::CTA_RASTER_WIDTH, Field::new(415, 384));
    assert_eq!(qmd::v03::CONSTANT_BUFFER_VALID(5), Field::new(645, 645));
    assert_eq!(qmd::v03::SIZE_BYTES, 256);
    assert_eq!(qmd::v05::QMD_MAJOR_VERSION, Field::new(471, 468));
    assert_eq!(qmd::v05::GRID_WIDTH, Field::new(1279, 1248));
    assert_eq!(qmd::v05::CONSTANT_BUFFER_VALID(5), Field::new(1876, 1876));
    assert_eq!(qmd::v05::SIZE_BYTES, 384);

    // FIELDS: indexed fields expanded over the documented instances.
    let names = |f: &[(&str, Field)]| f.iter().map(|x| x.0.to_string()).collect::<Vec<_>>();
    let v04 = names(qmd::v04::FIELDS);
    for n in [
        "CONSTANT_BUFFER_VALID(7)",
        "RELEASE_ENABLE(2)",
        "DEPENDENT_QMD_ENABLE(1)",
        "GRID_WIDTH",
    ] {
        assert!(v04.contains(&n.to_string()), "{n}");
    }
    for n in [
        "CONSTANT_BUFFER_VALID(8)",
        "RELEASE_ENABLE(3)",
        "DEPENDENT_QMD_ENABLE(2)",
    ] {
        assert!(!v04.contains(&n.to_string()), "{n}");
    }
    for (layout, size) in [
        (qmd::v03::FIELDS, 256),
        (qmd::v04::FIELDS, 384),
        (qmd::v05::FIELDS, 384),
    ] {
        assert!(layout.iter().all(|(_, f)| f.hi < size * 8 && f.lo <= f.hi));
        assert!(
            layout.windows(2).all(|w| w[0].1.lo <= w[1].1.lo),
            "sorted by bit"
        );
    }
}

#[test]
fn method_tables() {
    let (m, i) = hw::method_by_offset(cbc0::METHODS, 0x2b4).unwrap();
    assert_eq!((m.name, i), ("SEND_PCAS_A", 0));
    let (m, i) = hw::method_by_offset(cbc0::METHODS, cbc0::LOAD_INLINE_QMD_DATA(5)).unwrap();
    assert_eq!((m.name, i), ("LOAD_INLINE_QMD_DATA", 5));
    // Interleaved arrays with stride 8.
    let (m, i) = hw::method_by_offset(cbc0::METHODS, cbc0::CALL_MME_MACRO(3)).unwrap();
    assert_eq!((m.name, i, m.stride), ("CALL_MME_MACRO", 3, 8));
    let (m, _) = hw::method_by_offset(c86f::METHODS, 0x6c).unwrap();
    let op = m.fields.iter().find(|f| f.name == "OPERATION").unwrap();
    assert_eq!(op.field, c86f::SEM_EXECUTE_OPERATION);
    assert_eq!(op.value_name(1), Some("RELEASE"));
    assert!(hw::method_by_offset(cbc0::METHODS, 0x2b6).is_none());
    assert!(hw::methods_for_class(0xc8b5).is_some());
    assert!(hw::methods_for_class(0x1234).is_none());
    // Every table is sorted, with unique offsets for plain methods.
    for class in [
        0xc56f, 0xc86f, 0xc6c0, 0xcbc0, 0xcdc0, 0xc6b5, 0xc8b5, 0xcab5,
    ] {
        let t = hw::methods_for_class(class).unwrap();
        assert!(
            t.windows(2).all(|w| w[0].offset < w[1].offset),
            "{class:#x}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Decoder: hand-assembled input and garbage
// ---------------------------------------------------------------------------------------------

#[test]
fn decode_hand_assembled() {
    let words = [
        0x2001_2000,
        0x0000_cbc0, // s1 SET_OBJECT HOPPER_COMPUTE_A
        0x2005_0017,
        0x0460_ff70,
        0x2,
        0x52,
        0x0,
        0x0100_1001, // s0 SEM_* block
        0x8003_20b0, // s1 immediate SEND_SIGNALING_PCAS2_B = 3
        0x6002_206d,
        0x11,
        0x22, // s1 non-incrementing LOAD_INLINE_DATA x2
        0xa003_20c8,
        0x1,
        0x2,
        0x3,         // s1 increment-once LOAD_INLINE_QMD_DATA(0), (1), (1)
        0x0000_0000, // NOP
        0xe000_0000, // END_PB_SEGMENT
        0xdead_beef, // not decoded
    ];
    let d = decode(&words, &SubchannelClasses::new(c86f::CLASS)).unwrap();
    let summary: Vec<(u8, &str, u32)> = d
        .iter()
        .map(|m| (m.subchannel, m.name.as_deref().unwrap(), m.value))
        .collect();
    assert_eq!(
        summary,
        [
            (1, "SET_OBJECT", 0xcbc0),
            (0, "SEM_ADDR_LO", 0x0460_ff70),
            (0, "SEM_ADDR_HI", 2),
            (0, "SEM_PAYLOAD_LO", 0x52),
            (0, "SEM_PAYLOAD_HI", 0),
            (0, "SEM_EXECUTE", 0x0100_1001),
            (1, "SEND_SIGNALING_PCAS2_B", 3),
            (1, "LOAD_INLINE_DATA", 0x11),
            (1, "LOAD_INLINE_DATA", 0x22),
            (1, "LOAD_INLINE_QMD_DATA(0)", 1),
            (1, "LOAD_INLINE_QMD_DATA(1)", 2),
            (1, "LOAD_INLINE_QMD_DATA(1)", 3),
            (0, "END_PB_SEGMENT", 0xe000_0000),
        ]
    );
    assert_eq!(
        d[0].to_string(),
        "s1 SET_OBJECT = 0x0000cbc0 (CLASS_ID=0xcbc0)"
    );
    assert_eq!(d[0].kind, HeaderKind::Incrementing);
    let exec = &d[5];
    assert!(exec.fields.contains(&("OPERATION", 1, Some("RELEASE"))));
    assert!(exec.fields.contains(&("RELEASE_TIMESTAMP", 0, Some("DIS"))));
    assert!(
        exec.fields.contains(&("PAYLOAD_SIZE", 1, None)),
        "c86f names only PAYLOAD_SIZE_32BIT"
    );
    assert_eq!(d[6].kind, HeaderKind::Immediate);
    assert_eq!(
        d[6].to_string(),
        "s1 SEND_SIGNALING_PCAS2_B = 0x00000003 (PCAS_ACTION=INVALIDATE_COPY_SCHEDULE)"
    );
    assert_eq!(d[7].kind, HeaderKind::NonIncrementing);
    assert_eq!(d[9].kind, HeaderKind::IncrementOnce);
    assert_eq!(d[12].kind, HeaderKind::EndSegment);
}

#[test]
fn decode_tracks_set_object_and_unknown_methods() {
    // s2 starts unbound: its methods have no names until SET_OBJECT binds the copy class.
    let words = [
        0x2001_4000 | (c8b5::LAUNCH_DMA >> 2),
        0x1,
        0x2001_4000,
        c8b5::CLASS,
        0x2001_4000 | (c8b5::LAUNCH_DMA >> 2),
        0x1,
    ];
    let d = decode(&words, &SubchannelClasses::hopper()).unwrap();
    assert_eq!(d[0].name, None);
    assert_eq!(d[0].to_string(), "s2 0x0300 = 0x00000001");
    assert_eq!(d[2].name.as_deref(), Some("LAUNCH_DMA"));
    assert!(
        d[2].fields
            .contains(&("DATA_TRANSFER_TYPE", 1, Some("PIPELINED")))
    );
}

#[test]
fn decode_errors() {
    let classes = SubchannelClasses::hopper();
    assert_eq!(
        decode(&[0x2001_2000, 0xcbc0, 0x2005_0017, 1, 2], &classes),
        Err(DecodeError::Truncated {
            at_word: 2,
            header: 0x2005_0017,
            needed: 5,
            available: 2
        })
    );
    assert_eq!(
        decode(&[0xc000_0000], &classes),
        Err(DecodeError::UnknownHeader {
            at_word: 0,
            header: 0xc000_0000
        })
    );
    assert!(matches!(
        decode(&[0x4001_2000, 0], &classes),
        Err(DecodeError::UnknownHeader { .. })
    ));
    assert_eq!(decode(&[], &classes), Ok(vec![]));
}

#[test]
fn decode_garbage_never_panics() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..3000 {
        let len = (next() % 64) as usize;
        let words: Vec<u32> = (0..len)
            .map(|_| {
                let w = next() as u32;
                // Bias towards well-formed headers with small counts so decoding goes deep.
                if round % 2 == 0 {
                    (w & 0xe000_ffff) | ((w >> 16) & 0x7) << 16
                } else {
                    w
                }
            })
            .collect();
        if let Ok(methods) = decode(&words, &SubchannelClasses::hopper()) {
            for m in &methods {
                let _ = m.to_string();
            }
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        for v in 0..7 {
            let _ = decode_qmd(v, &bytes);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Captures from libcuda on an H200 (tests/fixtures, copied from research/hopper-launch-raw)
// ---------------------------------------------------------------------------------------------

/// One GPFIFO segment of the capture: the words, and per data word the method name and value the
/// sniffer printed (`None` where it cut long inline data short).
struct Segment {
    title: String,
    words: Vec<u32>,
    expected: Vec<(String, Option<u32>)>,
}

fn parse_methods_capture(text: &str) -> Vec<Segment> {
    let hex = |s: &str| u32::from_str_radix(s, 16).unwrap();
    let strip = |n: &str| n.split_once('_').map(|x| x.1).unwrap_or(n).to_string();
    let mut segs: Vec<Segment> = Vec::new();
    let mut pending = 0usize; // data words still expected for the current header
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        if !line.starts_with(' ') {
            segs.push(Segment {
                title: line.to_string(),
                words: vec![],
                expected: vec![],
            });
            continue;
        }
        let seg = segs.last_mut().unwrap();
        let t = line.trim();
        if let Some(rest) = t.strip_prefix('[') {
            assert_eq!(pending, 0, "{line}");
            let (hdr, rest) = rest.split_once(']').unwrap();
            let mut parts = hdr.split_whitespace();
            seg.words.push(hex(parts.next().unwrap()));
            let n: usize = hdr.rsplit_once("n=").unwrap().1.parse().unwrap();
            pending = n;
            // Inline form: "NAME = v v v ...(+K more dwords)".
            if let Some((name, vals)) = rest.split_once('=') {
                let name = strip(name.trim());
                for v in vals
                    .split_whitespace()
                    .take_while(|v| !v.starts_with("..."))
                {
                    seg.words.push(hex(v));
                    seg.expected.push((name.clone(), Some(hex(v))));
                    pending -= 1;
                }
                for _ in 0..pending {
                    seg.words.push(0);
                    seg.expected.push((name.clone(), None));
                }
                pending = 0;
            }
        } else {
            let (name, v) = t.split_once('=').unwrap();
            seg.words.push(hex(v.trim()));
            seg.expected.push((strip(name.trim()), Some(hex(v.trim()))));
            pending -= 1;
        }
    }
    segs
}

#[test]
fn decode_libcuda_capture() {
    let segs = parse_methods_capture(include_str!("fixtures/hopper_methods.txt"));
    assert_eq!(segs.len(), 6);
    let mut checked = 0;
    for seg in &segs {
        // The GP entry's length (dwords) covers exactly the headers and data words listed.
        let len: usize = seg
            .title
            .split_once(" len=")
            .unwrap()
            .1
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(seg.words.len(), len, "{}", seg.title);
        let d = decode(&seg.words, &SubchannelClasses::hopper())
            .unwrap_or_else(|e| panic!("{}: {e}", seg.title));
        assert_eq!(d.len(), seg.expected.len(), "{}", seg.title);
        for (m, (name, value)) in d.iter().zip(&seg.expected) {
            assert_eq!(m.name.as_deref(), Some(name.as_str()), "{}: {m}", seg.title);
            if let Some(v) = value {
                assert_eq!(m.value, *v, "{}: {m}", seg.title);
                checked += 1;
            }
        }
    }
    assert!(checked > 250, "{checked}");

    // A few decoded fields, as research/hopper-launch.md describes them.
    let add1 = segs.iter().find(|s| s.title.starts_with("add1")).unwrap();
    let d = decode(&add1.words, &SubchannelClasses::hopper()).unwrap();
    let find = |n: &str| d.iter().find(|m| m.name.as_deref() == Some(n)).unwrap();
    assert!(find("SEND_SIGNALING_PCAS2_B").fields.contains(&(
        "PCAS_ACTION",
        0xa,
        Some("INVALIDATE_PREFETCH_COPY_SCHEDULE")
    )));
    assert!(
        find("SEND_PCAS_A")
            .fields
            .contains(&("QMD_ADDRESS_SHIFTED8", 0x0204_e118, None))
    );
    let report_d = d
        .iter()
        .rev()
        .find(|m| m.name.as_deref() == Some("SET_REPORT_SEMAPHORE_D"))
        .unwrap();
    assert!(report_d.fields.contains(&("OPERATION", 0, Some("RELEASE"))));
    assert!(
        report_d
            .fields
            .contains(&("FLUSH_DISABLE", 1, Some("TRUE")))
    );

    let host = segs.iter().find(|s| s.title.contains("gp[16]")).unwrap();
    let d = decode(&host.words, &SubchannelClasses::hopper()).unwrap();
    let exec = d
        .iter()
        .find(|m| m.name.as_deref() == Some("SEM_EXECUTE"))
        .unwrap();
    assert_eq!(exec.subchannel, 0);
    assert!(
        exec.fields
            .contains(&("OPERATION", 3, Some("ACQ_CIRC_GEQ")))
    );
    assert!(exec.fields.contains(&("ACQUIRE_SWITCH_TSG", 1, Some("EN"))));
}

/// A QMD as uploaded, and the non-zero fields the sniffer decoded from it.
type CapturedQmd = (Vec<u8>, Vec<(String, u64)>);

fn parse_qmd_capture(text: &str) -> Vec<CapturedQmd> {
    let mut out: Vec<CapturedQmd> = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(hexes) = t.strip_prefix("QMD hex:") {
            let bytes = hexes
                .split_whitespace()
                .flat_map(|w| u32::from_str_radix(w, 16).unwrap().to_le_bytes())
                .collect();
            out.push((bytes, vec![]));
        } else if line.starts_with("    ")
            && let Some((name, v)) = t.split_once('=')
            && let Some(last) = out.last_mut()
        {
            let v = u64::from_str_radix(v.trim().trim_start_matches("0x"), 16).unwrap();
            last.1.push((name.trim().to_string(), v));
        }
    }
    out
}

#[test]
fn decode_libcuda_qmds() {
    let qmds = parse_qmd_capture(include_str!("fixtures/hopper_qmds.txt"));
    assert_eq!(qmds.len(), 2);
    for (bytes, expected) in &qmds {
        assert_eq!(bytes.len(), 384);
        let got: Vec<(String, u64)> = decode_qmd(4, bytes)
            .unwrap()
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect();
        assert_eq!(&got, expected);
    }
}

/// QMD B of research/hopper-launch.md section 5 (`add<<<2,32>>>`), as uploaded.
const QMD_B: &str = include_str!("fixtures/qmd_b_add.txt");

#[test]
fn decode_qmd_b_from_research_notes() {
    let mut words: Vec<u32> = QMD_B
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(str::split_whitespace)
        .map(|w| u32::from_str_radix(w, 16).unwrap())
        .collect();
    words.resize(96, 0); // +100..+17f: 0
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let fields = decode_qmd(4, &bytes).unwrap();
    let get = |n: &str| fields.iter().find(|f| f.0 == n).map(|f| f.1);
    assert_eq!(get("QMD_MAJOR_VERSION"), Some(4));
    assert_eq!(get("QMD_MINOR_VERSION"), None, "zero fields are left out");
    assert_eq!(
        get("QMD_TYPE"),
        Some(u64::from(qmd::v04::QMD_TYPE_GRID_CTA))
    );
    assert_eq!(get("GRID_WIDTH"), Some(2));
    assert_eq!(get("CTA_THREAD_DIMENSION0"), Some(0x20));
    assert_eq!(get("REGISTER_COUNT"), Some(0x10));
    assert_eq!(get("SHARED_MEMORY_SIZE"), Some(0x400));
    assert_eq!(get("RELEASE_SEMAPHORE0_PAYLOAD_LOWER"), Some(6));
    assert_eq!(get("CONSTANT_BUFFER_SIZE_SHIFTED4(7)"), Some(0x1000));
    let program =
        get("PROGRAM_ADDRESS_UPPER").unwrap() << 32 | get("PROGRAM_ADDRESS_LOWER").unwrap();
    assert_eq!(program, 0x7fee_af7a_2400);
    // Field::get reads the same through the generated positions.
    assert_eq!(qmd::v04::GRID_WIDTH.get(&words), Some(2));
    assert_eq!(qmd::v04::CONSTANT_BUFFER_VALID(5).get(&words), Some(1));

    assert_eq!(
        decode_qmd(4, &bytes[..100]),
        Err(QmdDecodeError::TooShort {
            needed: 384,
            available: 100
        })
    );
    assert_eq!(
        decode_qmd(9, &bytes),
        Err(QmdDecodeError::UnknownVersion(9))
    );
    // The same bytes read as V03 (256 bytes) still decode without error.
    assert!(decode_qmd(3, &bytes).is_ok());
}

#[test]
fn display_is_one_line() {
    let d = decode(
        &[0x2001_0000 | (c86f::WFI >> 2), 1],
        &SubchannelClasses::hopper(),
    )
    .unwrap();
    let line: &DecodedMethod = &d[0];
    assert_eq!(line.to_string(), "s0 WFI = 0x00000001 (SCOPE=ALL)");
}
