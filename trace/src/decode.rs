//! Pushbuffer segments and QMDs to records: the decoding half of the tracer, free of I/O so it can be
//! tested on captured words.

use std::collections::VecDeque;

use apex::hw;
use apex::pushbuf::decode::{self as pb, DecodedMethod, HeaderKind, SubchannelClasses};

use crate::record::{ConstBankRecord, LaunchRecord, MethodRecord, Undecoded};

/// Longest run of inline data words kept in a folded method record.
const RUN_KEEP: usize = 24;
/// Inline uploads remembered per channel, to find a QMD that SEND_PCAS_A names.
const UPLOADS_KEPT: usize = 32;
/// Inline uploads larger than this are not kept (code, big constant banks): no QMD is this big.
const UPLOAD_MAX: u32 = 4096;

/// A compute-class inline upload (OFFSET_OUT, LINE_LENGTH_IN, LAUNCH_DMA, LOAD_INLINE_DATA...).
#[derive(Debug, Clone)]
struct Upload {
    dst: u64,
    len: u32,
    /// Bytes still to come.
    remaining: u32,
    /// Whether `data` collects the bytes (small uploads only).
    keep: bool,
    data: Vec<u8>,
}

/// What decoding one segment found.
#[derive(Debug, Default)]
pub struct Segment {
    /// The segment's methods, in order.
    pub methods: Vec<MethodRecord>,
    /// QMDs the segment scheduled with SEND_PCAS_A.
    pub launches: Vec<LaunchRecord>,
    /// QMD-sized inline uploads that decode as a QMD, in upload order (see [`Record::QmdUpload`]).
    ///
    /// [`Record::QmdUpload`]: crate::record::Record::QmdUpload
    pub qmd_uploads: Vec<LaunchRecord>,
    /// Why the segment could not be decoded, with its words, if it could not.
    pub undecoded: Option<Undecoded>,
}

/// Per-channel decoding state carried from one segment to the next.
#[derive(Debug, Clone)]
pub struct ChannelDecoder {
    /// RM handle of the channel.
    pub channel: u32,
    classes: SubchannelClasses,
    offset_out_upper: u32,
    offset_out: u32,
    line_length: u32,
    upload: Option<Upload>,
    uploads: VecDeque<Upload>,
}

/// Compute classes are the `..c0` classes (c6c0, c7c0, c9c0, cbc0, cdc0, cec0).
fn is_compute(class: Option<u32>) -> bool {
    class.is_some_and(|c| c & 0xff == 0xc0)
}

impl ChannelDecoder {
    /// A decoder for a channel bound the way CUDA binds Hopper channels (s1 compute, s4 copy); a
    /// SET_OBJECT in the stream rebinds.
    pub fn new(channel: u32) -> Self {
        ChannelDecoder {
            channel,
            classes: SubchannelClasses::hopper(),
            offset_out_upper: 0,
            offset_out: 0,
            line_length: 0,
            upload: None,
            uploads: VecDeque::new(),
        }
    }

    /// Decodes one segment. `read` reads GPU memory that is mapped for the CPU (for a QMD that was
    /// not uploaded inline); it returns `None` for anything else.
    pub fn segment(
        &mut self,
        words: &[u32],
        t_ns: u64,
        read: &dyn Fn(u64, usize) -> Option<Vec<u8>>,
    ) -> Segment {
        let mut out = Segment::default();
        let decoded = match pb::decode_tracking(words, &mut self.classes) {
            Ok(d) => d,
            Err(e) => {
                out.undecoded = Some(Undecoded {
                    reason: e.to_string(),
                    words: words.to_vec(),
                });
                return out;
            }
        };
        for m in &decoded {
            let compute = is_compute(self.classes.class(m.subchannel));
            if compute {
                self.track(m, t_ns, read, &mut out);
            }
            fold(&mut out.methods, m);
        }
        out
    }

    fn track(
        &mut self,
        m: &DecodedMethod,
        t_ns: u64,
        read: &dyn Fn(u64, usize) -> Option<Vec<u8>>,
        out: &mut Segment,
    ) {
        match m.name.as_deref() {
            Some("OFFSET_OUT_UPPER") => self.offset_out_upper = m.value,
            Some("OFFSET_OUT") => self.offset_out = m.value,
            Some("LINE_LENGTH_IN") => self.line_length = m.value,
            Some("LAUNCH_DMA") => {
                let len = self.line_length;
                self.upload = (len > 0).then(|| Upload {
                    dst: (u64::from(self.offset_out_upper) << 32) | u64::from(self.offset_out),
                    len,
                    remaining: len,
                    keep: len <= UPLOAD_MAX,
                    data: Vec::new(),
                });
            }
            Some("LOAD_INLINE_DATA") => {
                let Some(up) = self.upload.as_mut() else {
                    return;
                };
                if up.keep {
                    up.data.extend_from_slice(&m.value.to_le_bytes());
                }
                up.remaining = up.remaining.saturating_sub(4);
                if up.remaining == 0 {
                    let mut up = self.upload.take().expect("checked above");
                    if up.keep {
                        up.data.truncate(up.len as usize);
                        if up.data.len() == QMD_BYTES
                            && let Some(mut l) = decode_launch(&up.data)
                        {
                            l.t_ns = t_ns;
                            l.channel = self.channel;
                            l.qmd_va = up.dst;
                            l.source = "upload".to_string();
                            out.qmd_uploads.push(l);
                        }
                        if self.uploads.len() == UPLOADS_KEPT {
                            self.uploads.pop_front();
                        }
                        self.uploads.push_back(up);
                    }
                }
            }
            Some("SEND_PCAS_A") => {
                let va = u64::from(m.value) << 8;
                let inline = self
                    .uploads
                    .iter()
                    .rev()
                    .find(|u| u.dst == va)
                    .map(|u| u.data.clone());
                let (bytes, source) = match inline {
                    Some(b) => (Some(b), "inline"),
                    None => (read(va, QMD_BYTES), "memory"),
                };
                if let Some(bytes) = bytes
                    && let Some(mut l) = decode_launch(&bytes)
                {
                    l.t_ns = t_ns;
                    l.channel = self.channel;
                    l.qmd_va = va;
                    l.source = source.to_string();
                    out.launches.push(l);
                }
            }
            _ => {}
        }
    }
}

/// Bytes read for a QMD (the largest layout, V04/V05: 384).
pub const QMD_BYTES: usize = 384;

/// Appends `m`, folding consecutive LOAD_INLINE_DATA words into the previous record.
fn fold(out: &mut Vec<MethodRecord>, m: &DecodedMethod) {
    let inline = m.name.as_deref() == Some("LOAD_INLINE_DATA");
    if inline
        && let Some(last) = out.last_mut()
        && last.name.as_deref() == Some("LOAD_INLINE_DATA")
        && last.subchannel == m.subchannel
        && let Some((count, words)) = last.run.as_mut()
    {
        *count += 1;
        if words.len() < RUN_KEEP {
            words.push(m.value);
        }
        return;
    }
    let fields = if m.kind == HeaderKind::EndSegment {
        Vec::new()
    } else {
        m.fields
            .iter()
            .filter(|(_, v, n)| *v != 0 || n.is_some())
            .map(|(n, v, vn)| (n.to_string(), *v, vn.map(str::to_string)))
            .collect()
    };
    out.push(MethodRecord {
        subchannel: m.subchannel,
        offset: m.offset,
        name: m.name.clone(),
        value: m.value,
        fields,
        run: inline.then(|| (1, vec![m.value])),
    });
}

/// The QMD major version of `qmd`: the layout (4, 5, then 3) whose QMD_MAJOR_VERSION field holds
/// its own number.
pub fn qmd_version(qmd: &[u8]) -> Option<u8> {
    let words: Vec<u32> = qmd
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    [4u8, 5, 3].into_iter().find(|&v| {
        hw::qmd_layout(v).is_some_and(|(fields, _)| {
            fields
                .iter()
                .find(|(n, _)| *n == "QMD_MAJOR_VERSION")
                .and_then(|(_, f)| f.get(&words))
                == Some(u64::from(v))
        })
    })
}

/// Grid, block, registers, shared memory, program address and constant banks of a QMD.
pub fn decode_launch(qmd: &[u8]) -> Option<LaunchRecord> {
    let version = qmd_version(qmd)?;
    let fields = pb::decode_qmd(version, qmd).ok()?;
    let get = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |&(_, v)| v)
    };
    let u32_of = |name: &str| u32::try_from(get(name)).unwrap_or(u32::MAX);
    let program_address = if get("PROGRAM_ADDRESS_LOWER_SHIFTED4") != 0
        || get("PROGRAM_ADDRESS_UPPER_SHIFTED4") != 0
    {
        ((get("PROGRAM_ADDRESS_UPPER_SHIFTED4") << 32) | get("PROGRAM_ADDRESS_LOWER_SHIFTED4")) << 4
    } else {
        (get("PROGRAM_ADDRESS_UPPER") << 32) | get("PROGRAM_ADDRESS_LOWER")
    };
    let mut const_banks = Vec::new();
    for i in 0..8u32 {
        if get(&format!("CONSTANT_BUFFER_VALID({i})")) == 0 {
            continue;
        }
        let lower = get(&format!("CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6({i})"));
        let upper = get(&format!("CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6({i})"));
        let size = get(&format!("CONSTANT_BUFFER_SIZE_SHIFTED4({i})"));
        const_banks.push(ConstBankRecord {
            index: i,
            address: ((upper << 32) | lower) << 6,
            size: u32::try_from(size << 4).unwrap_or(u32::MAX),
        });
    }
    let grid = [
        u32_of("GRID_WIDTH"),
        u32_of("GRID_HEIGHT"),
        u32_of("GRID_DEPTH"),
    ];
    Some(LaunchRecord {
        qmd_version: version,
        kernel: grid.iter().all(|&g| g > 0),
        grid,
        block: [
            u32_of("CTA_THREAD_DIMENSION0"),
            u32_of("CTA_THREAD_DIMENSION1"),
            u32_of("CTA_THREAD_DIMENSION2"),
        ],
        registers: u32_of("REGISTER_COUNT").max(u32_of("REGISTER_COUNT_V")),
        shared_bytes: u32_of("SHARED_MEMORY_SIZE"),
        program_address,
        const_banks,
        fields: fields.iter().map(|&(n, v)| (n.to_string(), v)).collect(),
        ..LaunchRecord::default()
    })
}
