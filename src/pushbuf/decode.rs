//! Pushbuffer decoder: turns method headers and data words back into method names and field values
//! (for tests now, a tracer later), and QMDs into their non-zero fields.
//!
//! Every header bit position comes from the generated host tables (`NVC56F_DMA_*` in clc56f.h) and
//! every method name and field from the class tables in [`crate::hw`]. The decoder never panics: it
//! is meant to be fed arbitrary words.

use std::fmt;

use crate::hw::{self, MethodDesc, host::c56f};

/// How a method header spreads its data words over methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// SEC_OP INC_METHOD: data word `k` goes to `METHOD + 4k`.
    Incrementing,
    /// SEC_OP NON_INC_METHOD: every data word goes to `METHOD`.
    NonIncrementing,
    /// SEC_OP IMMD_DATA_METHOD: the 13-bit value sits in the header itself.
    Immediate,
    /// SEC_OP ONE_INC: the first word goes to `METHOD`, the rest to `METHOD + 4`.
    IncrementOnce,
    /// SEC_OP END_PB_SEGMENT: the segment ends here; decoding stops.
    EndSegment,
}

/// One method write recovered from a pushbuffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedMethod {
    /// The subchannel the header addresses (which bound class executes the method).
    pub subchannel: u8,
    /// Method byte offset.
    pub offset: u32,
    /// Data word (the header word itself for [`HeaderKind::EndSegment`]).
    pub value: u32,
    /// The header form the write came from (incrementing, non-incrementing, immediate, ...).
    pub kind: HeaderKind,
    /// Header name without class prefix, e.g. `SEM_EXECUTE`, or `LOAD_INLINE_QMD_DATA(3)` for an
    /// element of an array method; `None` for an offset the subchannel's class does not define.
    pub name: Option<String>,
    /// Field name, field value, and the name of that value where the header names one.
    pub fields: Vec<(&'static str, u32, Option<&'static str>)>,
}

impl fmt::Display for DecodedMethod {
    /// One line, e.g. `s1 SET_OBJECT = 0x0000cbc0 (CLASS_ID=0xcbc0)`. Fields are shown when non-zero
    /// or when the header names their value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == HeaderKind::EndSegment {
            return write!(f, "s{} END_PB_SEGMENT", self.subchannel);
        }
        write!(f, "s{} ", self.subchannel)?;
        match &self.name {
            Some(name) => write!(f, "{name}")?,
            None => write!(f, "{:#06x}", self.offset)?,
        }
        write!(f, " = {:#010x}", self.value)?;
        // A lone unnamed field equal to the whole word (e.g. `V` 31:0) would only repeat the value.
        let lone_word =
            |v: u32, n: Option<&str>| self.fields.len() == 1 && v == self.value && n.is_none();
        let mut shown = self
            .fields
            .iter()
            .filter(|(_, v, n)| (*v != 0 || n.is_some()) && !lone_word(*v, *n))
            .peekable();
        if shown.peek().is_some() {
            f.write_str(" (")?;
            for (i, (name, v, vname)) in shown.enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                match vname {
                    Some(vname) => write!(f, "{name}={vname}")?,
                    None => write!(f, "{name}={v:#x}")?,
                }
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

/// Number of subchannels a channel has (from `NVC56F_NUMBER_OF_SUBCHANNELS`).
const SUBCHANNELS: usize = c56f::NUMBER_OF_SUBCHANNELS as usize;

/// Which class is bound to each subchannel; subchannel 0 is the host (GPFIFO) class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubchannelClasses {
    classes: [Option<u32>; SUBCHANNELS],
}

impl SubchannelClasses {
    /// Only the host class bound, on subchannel 0.
    pub fn new(host: u32) -> Self {
        let mut classes = [None; SUBCHANNELS];
        classes[0] = Some(host);
        SubchannelClasses { classes }
    }

    /// Binds `class` to `subchannel`; subchannels beyond the channel's 8 are ignored.
    pub fn bind(&mut self, subchannel: u8, class: u32) {
        if let Some(slot) = self.classes.get_mut(usize::from(subchannel)) {
            *slot = Some(class);
        }
    }

    /// The class bound to `subchannel`, if any.
    pub fn class(&self, subchannel: u8) -> Option<u32> {
        self.classes.get(usize::from(subchannel)).copied().flatten()
    }

    /// The Hopper layout CUDA uses: 0 host (c86f), 1 compute (cbc0), 4 copy (c8b5), the encoder's classes
    /// ([`crate::hw::generation::encoder`]).
    pub fn hopper() -> Self {
        use crate::hw::generation::encoder;
        let mut s = SubchannelClasses::new(encoder::host::CLASS);
        s.bind(1, encoder::compute::CLASS);
        s.bind(4, encoder::copy::CLASS);
        s
    }

    /// Host method tables to try: the bound host class, then clc56f.h, the most complete host list
    /// (the Hopper and Blackwell host headers list only a subset of the host methods).
    fn host_tables(&self) -> [Option<&'static [MethodDesc]>; 2] {
        let own = self.class(0).and_then(hw::methods_for_class);
        [own, Some(c56f::METHODS)]
    }
}

/// Why a pushbuffer could not be decoded.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// A header announces more data words than the segment holds.
    #[error(
        "method header {header:#010x} at word {at_word} needs {needed} data words, only {available} left"
    )]
    Truncated {
        /// Where the header is.
        at_word: usize,
        /// The header.
        header: u32,
        /// Data words it announces.
        needed: usize,
        /// Words left in the segment.
        available: usize,
    },
    /// A word that is no method header the host front end knows.
    #[error("unknown method header {header:#010x} at word {at_word}")]
    UnknownHeader {
        /// Where the header is.
        at_word: usize,
        /// The word.
        header: u32,
    },
}

/// Decodes `words` with the subchannel bindings `classes` (a SET_OBJECT in the stream rebinds its
/// subchannel for the methods after it; `classes` itself is left as it was).
pub fn decode(
    words: &[u32],
    classes: &SubchannelClasses,
) -> Result<Vec<DecodedMethod>, DecodeError> {
    let mut classes = classes.clone();
    decode_tracking(words, &mut classes)
}

/// Like [`decode`], but leaves the bindings after the last SET_OBJECT in `classes`, so a tracer can
/// decode consecutive GPFIFO segments of one channel.
pub fn decode_tracking(
    words: &[u32],
    classes: &mut SubchannelClasses,
) -> Result<Vec<DecodedMethod>, DecodeError> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(&header) = words.get(at) {
        let sec_op = c56f::DMA_SEC_OP.unpack(header);
        // METHOD_ADDRESS is a dword address.
        let offset = c56f::DMA_METHOD_ADDRESS.unpack(header) * 4;
        let subchannel = c56f::DMA_METHOD_SUBCHANNEL.unpack(header) as u8;
        let count = c56f::DMA_METHOD_COUNT.unpack(header) as usize;
        let kind = match sec_op {
            c56f::DMA_SEC_OP_INC_METHOD => HeaderKind::Incrementing,
            c56f::DMA_SEC_OP_NON_INC_METHOD => HeaderKind::NonIncrementing,
            c56f::DMA_SEC_OP_ONE_INC => HeaderKind::IncrementOnce,
            c56f::DMA_SEC_OP_IMMD_DATA_METHOD => {
                let value = c56f::DMA_IMMD_DATA.unpack(header);
                out.push(decode_method(
                    classes,
                    subchannel,
                    offset,
                    value,
                    HeaderKind::Immediate,
                ));
                at += 1;
                continue;
            }
            c56f::DMA_SEC_OP_END_PB_SEGMENT => {
                let name = Some("END_PB_SEGMENT".to_string());
                let kind = HeaderKind::EndSegment;
                out.push(DecodedMethod {
                    subchannel,
                    offset,
                    value: header,
                    kind,
                    name,
                    fields: Vec::new(),
                });
                break;
            }
            c56f::DMA_SEC_OP_GRP0_USE_TERT if is_grp0_no_method(header) => {
                at += 1;
                continue;
            }
            _ => {
                return Err(DecodeError::UnknownHeader {
                    at_word: at,
                    header,
                });
            }
        };
        let available = words.len() - at - 1;
        let data = words
            .get(at + 1..at + 1 + count)
            .ok_or(DecodeError::Truncated {
                at_word: at,
                header,
                needed: count,
                available,
            })?;
        for (k, &value) in data.iter().enumerate() {
            let step = match kind {
                HeaderKind::Incrementing => k as u32,
                HeaderKind::IncrementOnce => u32::from(k > 0),
                _ => 0,
            };
            out.push(decode_method(
                classes,
                subchannel,
                offset + 4 * step,
                value,
                kind,
            ));
        }
        at += 1 + count;
    }
    Ok(out)
}

/// Group-0 headers that carry no method: the NOP word and the subdevice-mask operations (SLI).
fn is_grp0_no_method(header: u32) -> bool {
    header == c56f::DMA_NOP
        || c56f::DMA_SET_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_SET_SUBDEVICE_MASK_OPCODE_VALUE
        || c56f::DMA_STORE_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_STORE_SUBDEVICE_MASK_OPCODE_VALUE
        || c56f::DMA_USE_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_USE_SUBDEVICE_MASK_OPCODE_VALUE
}

fn decode_method(
    classes: &mut SubchannelClasses,
    subchannel: u8,
    offset: u32,
    value: u32,
    kind: HeaderKind,
) -> DecodedMethod {
    let set_object = offset == c56f::SET_OBJECT;
    if set_object {
        classes.bind(subchannel, c56f::SET_OBJECT_NVCLASS.unpack(value));
    }
    let host_hit = || {
        classes
            .host_tables()
            .into_iter()
            .flatten()
            .find_map(|t| hw::method_by_offset(t, offset))
    };
    let class_hit = || {
        let table = classes.class(subchannel).and_then(hw::methods_for_class)?;
        hw::method_by_offset(table, offset)
    };
    // Host methods execute on any subchannel; SET_OBJECT is described best by the class it binds.
    let hit = if set_object {
        class_hit().or_else(host_hit)
    } else {
        host_hit().or_else(class_hit)
    };
    let (name, fields) = match hit {
        Some((m, index)) => {
            let name = if m.count > 1 {
                format!("{}({index})", m.name)
            } else {
                m.name.to_string()
            };
            let fields = m
                .fields
                .iter()
                .map(|f| {
                    let v = f.field.unpack(value);
                    (f.name, v, f.value_name(v))
                })
                .collect();
            (Some(name), fields)
        }
        None => (None, Vec::new()),
    };
    DecodedMethod {
        subchannel,
        offset,
        value,
        kind,
        name,
        fields,
    }
}

/// Why a QMD could not be decoded.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum QmdDecodeError {
    /// A QMD major version with no layout in the class tables.
    #[error("no QMD layout for major version {0} (known: 3, 4, 5)")]
    UnknownVersion(u8),
    /// Fewer bytes than a QMD of that version.
    #[error("QMD needs {needed} bytes, got {available}")]
    TooShort {
        /// Bytes a QMD of that version has.
        needed: usize,
        /// Bytes given.
        available: usize,
    },
}

/// Every non-zero field of a QMD (little-endian bytes, as uploaded), named as in the generated
/// `FIELDS` table of `hw::qmd::v0N` (indexed ones as `NAME(i)`), in bit order. Bytes past the
/// layout's size are ignored.
pub fn decode_qmd(version: u8, qmd: &[u8]) -> Result<Vec<(&'static str, u64)>, QmdDecodeError> {
    let (fields, size) = hw::qmd_layout(version).ok_or(QmdDecodeError::UnknownVersion(version))?;
    let bytes = qmd.get(..size).ok_or(QmdDecodeError::TooShort {
        needed: size,
        available: qmd.len(),
    })?;
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(fields
        .iter()
        .filter_map(|&(name, field)| field.get(&words).filter(|&v| v != 0).map(|v| (name, v)))
        .collect())
}
