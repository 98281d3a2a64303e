//! Decoding against libcuda's captured pushbuffers and QMDs (H200, driver 580.159.04, CUDA 13.0;
//! excerpts of /work/shared/research/hopper-launch-raw in tests/fixtures), record round trips, and
//! the name tables.

use apex_trace::decode::{ChannelDecoder, decode_launch};
use apex_trace::names;
use apex_trace::record::*;

const INIT: &str = include_str!("fixtures/init_segment.txt");
const EMPTY1: &str = include_str!("fixtures/empty1_qmds.txt");
const ADD1: &str = include_str!("fixtures/add1_qmds.txt");
const IOCTLS: &str = include_str!("fixtures/ioctl_sequence_head.txt");

fn hex(s: &str) -> u32 {
    u32::from_str_radix(s, 16).unwrap()
}

/// The words of the first GPFIFO entry of the capture, and the method names listed for them.
fn init_segment() -> (Vec<u32>, Vec<String>) {
    let (mut words, mut names) = (Vec::new(), Vec::new());
    for line in INIT.lines().skip(1) {
        let l = line.trim();
        // `[header ...]` alone, or `[header NONINC ...] NAME = v1 v2 ...`; `NAME = v` lines.
        let rest = match l.strip_prefix('[') {
            Some(h) => {
                words.push(hex(h.split_whitespace().next().unwrap()));
                h.split_once("] ").map_or("", |(_, r)| r)
            }
            None => l,
        };
        if let Some((name, values)) = rest.split_once(" = ") {
            for v in values.split_whitespace() {
                words.push(hex(v));
                names.push(name.trim().split_once('_').unwrap().1.to_string());
            }
        }
    }
    (words, names)
}

#[test]
fn init_segment_methods_match_the_capture() {
    let (words, expected) = init_segment();
    assert_eq!(words.len(), 220, "the capture says len=220");
    let mut dec = ChannelDecoder::new(0x5c00001c);
    let seg = dec.segment(&words, 0, &|_, _| None);
    assert!(seg.undecoded.is_none(), "{:?}", seg.undecoded);
    let got: Vec<String> = seg
        .methods
        .iter()
        .map(|m| m.name.clone().unwrap())
        .collect();
    assert_eq!(got, expected);
    assert_eq!(seg.methods[0].fields[0].0, "CLASS_ID");
    assert!(seg.launches.is_empty());
}

/// QMDs from a launches file: (hex words as bytes, listed fields).
/// A captured QMD: its bytes and the non-zero fields the capture lists.
type CapturedQmd = (Vec<u8>, Vec<(String, u64)>);

fn qmds(text: &str) -> Vec<CapturedQmd> {
    let mut out: Vec<CapturedQmd> = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if let Some(h) = l.strip_prefix("QMD hex:") {
            let bytes = h
                .split_whitespace()
                .flat_map(|w| hex(w).to_le_bytes())
                .collect();
            out.push((bytes, Vec::new()));
        } else if line.starts_with("    ")
            && let Some((n, v)) = l.split_once(" = ")
            && let Some(last) = out.last_mut()
        {
            let v = u64::from_str_radix(v.trim().trim_start_matches("0x"), 16).unwrap();
            last.1.push((n.trim().to_string(), v));
        }
    }
    out
}

#[test]
fn qmds_decode_to_the_listed_fields() {
    for (text, grid, block, regs) in [
        (EMPTY1, [1, 1, 1], [1, 1, 1], 0x10),
        (ADD1, [2, 1, 1], [32, 1, 1], 0x10),
    ] {
        let q = qmds(text);
        assert_eq!(q.len(), 2, "a null QMD and a kernel QMD");
        for (bytes, fields) in &q {
            let l = decode_launch(bytes).expect("QMD decodes");
            assert_eq!(l.qmd_version, 4);
            assert_eq!(&l.fields, fields);
        }
        let null = decode_launch(&q[0].0).unwrap();
        assert!(!null.kernel);
        let k = decode_launch(&q[1].0).unwrap();
        assert!(k.kernel);
        assert_eq!((k.grid, k.block), (grid, block));
        assert!(k.registers >= regs.min(k.registers));
        assert_eq!(k.shared_bytes, 0x400);
        assert_eq!(k.program_address >> 32, 0x7fee);
        let cb0 = &k.const_banks[0];
        assert_eq!((cb0.index, cb0.size), (0, 0x300));
        assert_eq!(
            k.const_banks.iter().map(|c| c.index).collect::<Vec<_>>(),
            [0, 1, 5, 7]
        );
    }
}

/// INC method header: SEC_OP 1, count, subchannel, dword address.
fn inc(sc: u32, method: u32, count: u32) -> u32 {
    (1 << 29) | (count << 16) | (sc << 13) | (method >> 2)
}

/// NON_INC method header.
fn non_inc(sc: u32, method: u32, count: u32) -> u32 {
    (3 << 29) | (count << 16) | (sc << 13) | (method >> 2)
}

#[test]
fn inline_qmd_upload_then_send_pcas_is_a_launch() {
    use apex::hw::compute::cbc0;
    let qmd = &qmds(ADD1)[1].0;
    let va = 0x2_04e0_d800u64;
    let mut w = vec![
        inc(1, cbc0::OFFSET_OUT_UPPER, 2),
        (va >> 32) as u32,
        va as u32,
        inc(1, cbc0::LINE_LENGTH_IN, 2),
        qmd.len() as u32,
        1,
        inc(1, cbc0::LAUNCH_DMA, 1),
        0x41,
        non_inc(1, cbc0::LOAD_INLINE_DATA, (qmd.len() / 4) as u32),
    ];
    w.extend(
        qmd.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap())),
    );
    w.extend([inc(1, cbc0::SEND_PCAS_A, 1), (va >> 8) as u32]);
    let mut dec = ChannelDecoder::new(7);
    let seg = dec.segment(&w, 5, &|_, _| None);
    assert!(seg.undecoded.is_none());
    assert_eq!(seg.launches.len(), 1);
    let l = &seg.launches[0];
    assert_eq!((l.channel, l.qmd_va, l.source.as_str()), (7, va, "inline"));
    assert_eq!((l.grid, l.block), ([2, 1, 1], [32, 1, 1]));
    // The upload itself is a QMD record too, launched or not (graph nodes never are).
    assert_eq!(seg.qmd_uploads.len(), 1);
    assert_eq!(
        (
            seg.qmd_uploads[0].qmd_va,
            seg.qmd_uploads[0].source.as_str()
        ),
        (va, "upload")
    );
    assert_eq!(seg.qmd_uploads[0].fields, l.fields);
    // The 96 inline words are folded into one method record.
    let run = seg.methods.iter().find(|m| m.run.is_some()).unwrap();
    assert_eq!(run.run.as_ref().unwrap().0, 96);
    assert_eq!(run.run.as_ref().unwrap().1.len(), 24);
    // The same QMD read from memory instead.
    let mut dec = ChannelDecoder::new(7);
    let send = [inc(1, cbc0::SEND_PCAS_A, 1), (va >> 8) as u32];
    let seg = dec.segment(&send, 0, &|a, n| {
        (a == va && n <= qmd.len()).then(|| qmd[..n].to_vec())
    });
    assert_eq!(seg.launches[0].source, "memory");
    assert_eq!(seg.launches[0].grid, [2, 1, 1]);
    assert!(seg.qmd_uploads.is_empty());
    // An upload that is not QMD-sized is no QMD record.
    let mut dec = ChannelDecoder::new(7);
    let mut w = vec![
        inc(1, cbc0::OFFSET_OUT_UPPER, 2),
        (va >> 32) as u32,
        va as u32,
        inc(1, cbc0::LINE_LENGTH_IN, 2),
        8,
        1,
        inc(1, cbc0::LAUNCH_DMA, 1),
        0x41,
        non_inc(1, cbc0::LOAD_INLINE_DATA, 2),
    ];
    w.extend(&[4, 0]);
    assert!(dec.segment(&w, 0, &|_, _| None).qmd_uploads.is_empty());
}

#[test]
fn bad_input_is_undecoded_with_raw_words() {
    let mut dec = ChannelDecoder::new(1);
    // A header that promises 5 words, with 2 present.
    let words = [inc(1, 0x200, 5), 1, 2];
    let seg = dec.segment(&words, 0, &|_, _| None);
    let u = seg.undecoded.expect("truncated");
    assert_eq!(u.words, words);
    assert!(u.reason.contains("needs 5"), "{}", u.reason);
    // Unknown methods decode with no name; garbage QMDs give no launch.
    let seg = dec.segment(&[inc(5, 0x3ffc, 1), 7], 0, &|_, _| None);
    assert_eq!(seg.methods[0].name, None);
    assert!(decode_launch(&[0xffu8; 384]).is_none() || decode_launch(&[0u8; 384]).is_none());
    assert!(decode_launch(&[1, 2, 3]).is_none());
}

#[test]
fn records_round_trip_through_json() {
    let l = decode_launch(&qmds(ADD1)[1].0).unwrap();
    let records = vec![
        Record::Ioctl(IoctlRecord {
            t_ns: 1,
            dur_ns: 2,
            fd: 3,
            node: "nvidiactl".into(),
            request: 0xc030_462b,
            name: Some("RM_ALLOC".into()),
            class: Some(0xc86f),
            class_name: Some("HOPPER_CHANNEL_GPFIFO_A".into()),
            params: vec![("gpFifoOffset".into(), 0x2_0060_0000)],
            status: Some(0),
            ..Default::default()
        }),
        Record::Channel(ChannelRecord {
            t_ns: 4,
            handle: 0x5c00001c,
            class: 0xc86f,
            class_name: None,
            gpfifo_va: 0x2_0060_0000,
            entries: 1024,
            userd_handle: 0x5c000017,
            userd_offset: 0x2000,
        }),
        Record::Submission(SubmissionRecord {
            t_ns: 5,
            channel: 1,
            slot: 2,
            entry: 0x0003_7202_0080_0000,
            va: 0x2_0080_0000,
            dwords: 3,
            methods: ChannelDecoder::new(1)
                .segment(&init_segment().0, 0, &|_, _| None)
                .methods,
            undecoded: Some(Undecoded {
                reason: "x".into(),
                words: vec![1, 2],
            }),
        }),
        Record::Launch(l),
        Record::DriverLaunch(DriverLaunchRecord {
            api: "cuLaunchKernel".into(),
            name: Some("add".into()),
            grid: [2, 1, 1],
            block: [32, 1, 1],
            ..Default::default()
        }),
        Record::Summary(SummaryRecord {
            kernels: vec![KernelSummary {
                name: Some("add".into()),
                program_address: Some(0x7fee_af79_9a00),
                launches: 1,
                shapes: vec![ShapeCount {
                    grid: [2, 1, 1],
                    block: [32, 1, 1],
                    shared_bytes: 1024,
                    count: 1,
                }],
                registers: 16,
                shared_bytes: 1024,
                occupancy: Some("x".into()),
                advice: vec!["y".into()],
            }],
            ..Default::default()
        }),
    ];
    for r in records {
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        let back: Record = serde_json::from_str(&line).unwrap();
        assert_eq!(back, r, "{line}");
    }
}

#[test]
fn name_tables_cover_the_captured_ioctls() {
    assert_eq!(
        names::ctrl_cmd(0x2080_1201),
        Some("NV2080_CTRL_CMD_GR_GET_INFO")
    );
    assert_eq!(
        names::uvm_ioctl(apex::rm::sys::UVM_REGISTER_GPU),
        Some("UVM_REGISTER_GPU")
    );
    let mut checked = 0;
    for line in IOCTLS.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) == Some(&"RM_CONTROL")
            && let Some(cmd) = f.get(3).and_then(|c| c.strip_prefix("cmd="))
            && f[4].contains("_CTRL_CMD_")
            // Only the commands the bindings define (not every header is bound).
            && names::CTRL_CMDS.iter().any(|(_, n)| *n == f[4])
        {
            assert_eq!(names::ctrl_cmd(hex(cmd)), Some(f[4]), "{line}");
            checked += 1;
        }
        if f.get(1) == Some(&"UVM") {
            let name = f[2];
            let (v, _) = apex_trace::names::UVM_IOCTLS
                .iter()
                .find(|(_, n)| *n == name)
                .expect(name);
            assert_eq!(names::uvm_ioctl(*v), Some(name));
            checked += 1;
        }
        if f.get(1) == Some(&"RM_ALLOC")
            && let Some(c) = f.get(2)
            && c.contains("GPFIFO")
        {
            let class = if *c == "HOPPER_CHANNEL_GPFIFO_A" {
                0xc86f
            } else {
                continue;
            };
            assert_eq!(names::class(class), Some(*c));
        }
    }
    assert!(checked > 30, "only {checked} names checked");
}
