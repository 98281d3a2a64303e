use super::{Kind, Method, decode};
use crate::hw::Field;
use crate::hw::host::c56f as hw;
use crate::pushbuf::decode::{self as shared, DecodeError, HeaderKind, SubchannelClasses};
use crate::pushbuf::{
    END_SEGMENT, Header, MAX_COUNT, MAX_IMMEDIATE, Subchannel, header, immediate,
};

fn m(subchannel: u8, offset: u32, value: u32, kind: Kind) -> Method {
    Method {
        subchannel,
        offset,
        value,
        kind,
    }
}

/// `words` as the encoder's decoder ([`crate::pushbuf::decode`]) reads them, taken as the front end took them
/// before it decoded segments itself: the methods before a bad word, and its error.
fn encoders_reading(words: &[u32]) -> (Vec<Method>, Option<DecodeError>) {
    let classes = SubchannelClasses::hopper();
    let (methods, error) = match shared::decode(words, &classes) {
        Ok(methods) => (methods, None),
        Err(e) => {
            let at = match &e {
                DecodeError::Truncated { at_word, .. }
                | DecodeError::UnknownHeader { at_word, .. } => *at_word,
            };
            (shared::decode(&words[..at], &classes).unwrap(), Some(e))
        }
    };
    let kind = |k| match k {
        HeaderKind::Incrementing => Kind::Incrementing,
        HeaderKind::NonIncrementing => Kind::NonIncrementing,
        HeaderKind::Immediate => Kind::Immediate,
        HeaderKind::IncrementOnce => Kind::IncrementOnce,
        HeaderKind::EndSegment => Kind::EndSegment,
    };
    let methods = methods
        .into_iter()
        .map(|d| m(d.subchannel, d.offset, d.value, kind(d.kind)))
        .collect();
    (methods, error)
}

/// Segments the encoder wrote, one per header kind, and the methods they were written for.
fn encoded() -> Vec<(Vec<u32>, Vec<Method>)> {
    use Kind::*;
    let long: Vec<u32> = (0..MAX_COUNT)
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let mut long_words = vec![header(
        Header::NonIncrementing,
        Subchannel(5),
        0x1230,
        MAX_COUNT,
    )];
    long_words.extend(&long);
    let mask_ops = [
        hw::DMA_SET_SUBDEVICE_MASK_OPCODE.pack(hw::DMA_SET_SUBDEVICE_MASK_OPCODE_VALUE) | 0xabc0,
        hw::DMA_STORE_SUBDEVICE_MASK_OPCODE.pack(hw::DMA_STORE_SUBDEVICE_MASK_OPCODE_VALUE)
            | 0x0010,
        hw::DMA_USE_SUBDEVICE_MASK_OPCODE.pack(hw::DMA_USE_SUBDEVICE_MASK_OPCODE_VALUE),
    ];
    vec![
        (
            vec![
                header(Header::Incrementing, Subchannel(1), 0x0214, 3),
                7,
                8,
                9,
            ],
            vec![
                m(1, 0x0214, 7, Incrementing),
                m(1, 0x0218, 8, Incrementing),
                m(1, 0x021c, 9, Incrementing),
            ],
        ),
        (
            vec![
                header(Header::NonIncrementing, Subchannel(4), 0x0400, 2),
                0xdead_beef,
                0,
            ],
            vec![
                m(4, 0x0400, 0xdead_beef, NonIncrementing),
                m(4, 0x0400, 0, NonIncrementing),
            ],
        ),
        (
            vec![
                header(Header::IncrementOnce, Subchannel(7), 0x3ff8, 3),
                1,
                2,
                3,
            ],
            vec![
                m(7, 0x3ff8, 1, IncrementOnce),
                m(7, 0x3ffc, 2, IncrementOnce),
                m(7, 0x3ffc, 3, IncrementOnce),
            ],
        ),
        (
            vec![
                immediate(Subchannel(2), 0x0100, MAX_IMMEDIATE),
                immediate(Subchannel(0), 0x3ffc, 0),
            ],
            vec![
                m(2, 0x0100, MAX_IMMEDIATE, Immediate),
                m(0, 0x3ffc, 0, Immediate),
            ],
        ),
        // A header with no data, then the NOP word and the subdevice-mask words: no methods.
        (
            [
                vec![
                    header(Header::Incrementing, Subchannel(3), 0x0040, 0),
                    hw::DMA_NOP,
                ],
                mask_ops.to_vec(),
            ]
            .concat(),
            Vec::new(),
        ),
        (
            long_words,
            long.iter()
                .map(|&v| m(5, 0x1230, v, NonIncrementing))
                .collect(),
        ),
        // The words after END_PB_SEGMENT are not methods.
        (
            vec![END_SEGMENT, 0xffff_ffff, 5],
            vec![m(0, 0, END_SEGMENT, EndSegment)],
        ),
    ]
}

/// Every header kind, read with the simulator's own reading of `clc56f.h`: the methods the encoder wrote them
/// for, as the encoder's decoder reads them too; one after another in a segment as well.
#[test]
fn every_header_kind_reads_as_the_encoder_wrote_it() {
    let cases = encoded();
    for (words, methods) in &cases {
        assert_eq!(decode(words), (methods.clone(), None), "{words:x?}");
        assert_eq!(encoders_reading(words), (methods.clone(), None));
    }
    let words: Vec<u32> = cases.iter().flat_map(|(w, _)| w.clone()).collect();
    let methods: Vec<Method> = cases.iter().flat_map(|(_, m)| m.clone()).collect();
    assert_eq!(decode(&words), (methods, None));
    assert_eq!(decode(&words), encoders_reading(&words));
}

/// A word that is no header, or a header whose data runs past the segment: the methods before it and its error,
/// as the encoder's decoder reports them.
#[test]
fn a_malformed_segment_stops_where_the_encoders_decoder_stops() {
    let first = immediate(Subchannel(1), 0x0200, 5);
    let short = header(Header::Incrementing, Subchannel(1), 0x0200, 4);
    let unknown = [
        hw::DMA_SEC_OP.pack(hw::DMA_SEC_OP_GRP2_USE_TERT) | 0x10,
        hw::DMA_SEC_OP.pack(6),
        // Group 0, but neither the NOP word nor a subdevice-mask operation.
        0x0000_2004,
    ];
    let mut cases = vec![(
        vec![first, short, 1, 2],
        DecodeError::Truncated {
            at_word: 1,
            header: short,
            needed: 4,
            available: 2,
        },
    )];
    for header in unknown {
        cases.push((
            vec![first, header, 3],
            DecodeError::UnknownHeader { at_word: 1, header },
        ));
    }
    for (words, error) in cases {
        let expected = (vec![m(1, 0x0200, 5, Kind::Immediate)], Some(error));
        assert_eq!(decode(&words), expected, "{words:x?}");
        assert_eq!(encoders_reading(&words), expected);
    }
}

/// Arbitrary words, most of them headers of every SEC_OP with small counts: the same methods and errors as the
/// encoder's decoder finds.
#[test]
fn arbitrary_words_read_as_the_encoders_decoder_reads_them() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut errors = 0;
    for _ in 0..4000 {
        let len = (next() % 24) as usize;
        let words: Vec<u32> = (0..len)
            .map(|_| {
                let r = next();
                match r % 4 {
                    0 => r as u32 ^ (r >> 32) as u32,
                    1 => (r >> 8) as u32 & 0xff,
                    _ => {
                        hw::DMA_SEC_OP.pack((r >> 8) as u32 % 8)
                            | hw::DMA_METHOD_COUNT.pack((r >> 16) as u32 % 5)
                            | hw::DMA_METHOD_SUBCHANNEL.pack((r >> 24) as u32)
                            | hw::DMA_METHOD_ADDRESS.pack((r >> 32) as u32)
                    }
                }
            })
            .collect();
        let ours = decode(&words);
        errors += usize::from(ours.1.is_some());
        assert_eq!(ours, encoders_reading(&words), "{words:x?}");
    }
    // Both outcomes were compared, many times.
    assert!((500..3500).contains(&errors), "{errors}");
}

/// The method-header fields, as an encoder's table places them.
#[derive(Clone, Copy)]
struct Fields {
    sec_op: Field,
    address: Field,
    subchannel: Field,
    count: Field,
    immediate: Field,
}

impl Fields {
    /// The encoder's table.
    fn encoders() -> Fields {
        Fields {
            sec_op: hw::DMA_SEC_OP,
            address: hw::DMA_METHOD_ADDRESS,
            subchannel: hw::DMA_METHOD_SUBCHANNEL,
            count: hw::DMA_METHOD_COUNT,
            immediate: hw::DMA_IMMD_DATA,
        }
    }

    /// [`header`] with these positions.
    fn header(self, sec_op: u32, subchannel: u8, method: u32, count: u32) -> u32 {
        self.sec_op.pack(sec_op)
            | self.count.pack(count)
            | self.subchannel.pack(u32::from(subchannel))
            | self.address.pack(method >> 2)
    }

    /// [`immediate`] with these positions.
    fn immediate(self, subchannel: u8, method: u32, value: u32) -> u32 {
        self.sec_op.pack(hw::DMA_SEC_OP_IMMD_DATA_METHOD)
            | self.immediate.pack(value)
            | self.subchannel.pack(u32::from(subchannel))
            | self.address.pack(method >> 2)
    }

    /// An incrementing header with two data words, then an immediate one.
    fn segment(self) -> Vec<u32> {
        vec![
            self.header(hw::DMA_SEC_OP_INC_METHOD, 5, 0x0ab4, 2),
            0x1111,
            0x2222,
            self.immediate(3, 0x0158, 0x0a5a),
        ]
    }
}

/// An encoder whose table put a method-header field one bit off: the simulator, reading its own positions, no
/// longer sees the methods meant (a decoder sharing the encoder's table would read them back and pass).
#[test]
fn a_misplaced_header_field_is_caught() {
    let good = Fields::encoders();
    // The test's encoder is the encoder.
    assert_eq!(
        good.segment(),
        vec![
            header(Header::Incrementing, Subchannel(5), 0x0ab4, 2),
            0x1111,
            0x2222,
            immediate(Subchannel(3), 0x0158, 0x0a5a),
        ]
    );
    let meant = vec![
        m(5, 0x0ab4, 0x1111, Kind::Incrementing),
        m(5, 0x0ab8, 0x2222, Kind::Incrementing),
        m(3, 0x0158, 0x0a5a, Kind::Immediate),
    ];
    assert_eq!(decode(&good.segment()), (meant.clone(), None));
    let moved = |f: Field| {
        if f.hi < 31 {
            Field::new(f.hi + 1, f.lo + 1)
        } else {
            Field::new(f.hi - 1, f.lo - 1)
        }
    };
    let wrong = [
        (
            "SEC_OP",
            Fields {
                sec_op: moved(good.sec_op),
                ..good
            },
        ),
        (
            "METHOD_ADDRESS",
            Fields {
                address: moved(good.address),
                ..good
            },
        ),
        (
            "METHOD_SUBCHANNEL",
            Fields {
                subchannel: moved(good.subchannel),
                ..good
            },
        ),
        (
            "METHOD_COUNT",
            Fields {
                count: moved(good.count),
                ..good
            },
        ),
        (
            "IMMD_DATA",
            Fields {
                immediate: moved(good.immediate),
                ..good
            },
        ),
    ];
    for (name, fields) in wrong {
        let (methods, error) = decode(&fields.segment());
        assert!(
            methods != meant || error.is_some(),
            "{name} one bit off passed: {methods:x?}"
        );
    }
}
