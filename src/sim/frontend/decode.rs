//! The front end's own decoding of a pushbuffer segment into method writes: each 32-bit method header read with
//! the simulator's reading of `clc56f.h` (`NVC56F_DMA_*` in [`c56f`]), not with the encoder's tables or its
//! decoder ([`crate::pushbuf::decode`]), so that a wrong bit position on the encoder's side shows up here as
//! methods other than the ones meant. Only the error type, [`DecodeError`], is shared: it is what the simulator
//! reports ([`SimErrorKind::Decode`](super::super::SimErrorKind::Decode)).

use super::super::headers::c56f;
use crate::pushbuf::decode::DecodeError;

/// How a method header spreads its data words over methods (its SEC_OP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// INC_METHOD: data word `k` goes to `METHOD + 4k`.
    Incrementing,
    /// NON_INC_METHOD: every data word goes to `METHOD`.
    NonIncrementing,
    /// IMMD_DATA_METHOD: the value sits in the header itself.
    Immediate,
    /// ONE_INC: the first word goes to `METHOD`, the rest to `METHOD + 4`.
    IncrementOnce,
    /// END_PB_SEGMENT: the segment ends here; the words after it are not methods.
    EndSegment,
}

/// One method write of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Method {
    /// The subchannel the header addresses.
    pub(super) subchannel: u8,
    /// The method's byte offset.
    pub(super) offset: u32,
    /// The data word (the header itself for [`Kind::EndSegment`]).
    pub(super) value: u32,
    /// The header form the write came from.
    pub(super) kind: Kind,
}

/// Decodes `words` as method headers and their data, up to the end of the segment or its END_PB_SEGMENT header.
/// A word that is no header the front end knows, or a header that announces more data words than the segment
/// holds, ends the decoding: the methods before it are returned with its error (the front end runs them, then
/// faults).
pub(super) fn decode(words: &[u32]) -> (Vec<Method>, Option<DecodeError>) {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(&header) = words.get(at) {
        let sec_op = c56f::DMA_SEC_OP.unpack(header);
        // METHOD_ADDRESS is a dword address.
        let offset = c56f::DMA_METHOD_ADDRESS.unpack(header) * 4;
        let subchannel = c56f::DMA_METHOD_SUBCHANNEL.unpack(header) as u8;
        let count = c56f::DMA_METHOD_COUNT.unpack(header) as usize;
        let kind = match sec_op {
            c56f::DMA_SEC_OP_INC_METHOD => Kind::Incrementing,
            c56f::DMA_SEC_OP_NON_INC_METHOD => Kind::NonIncrementing,
            c56f::DMA_SEC_OP_ONE_INC => Kind::IncrementOnce,
            c56f::DMA_SEC_OP_IMMD_DATA_METHOD => {
                out.push(Method {
                    subchannel,
                    offset,
                    value: c56f::DMA_IMMD_DATA.unpack(header),
                    kind: Kind::Immediate,
                });
                at += 1;
                continue;
            }
            c56f::DMA_SEC_OP_END_PB_SEGMENT => {
                out.push(Method {
                    subchannel,
                    offset,
                    value: header,
                    kind: Kind::EndSegment,
                });
                break;
            }
            c56f::DMA_SEC_OP_GRP0_USE_TERT if carries_no_method(header) => {
                at += 1;
                continue;
            }
            _ => {
                let error = DecodeError::UnknownHeader {
                    at_word: at,
                    header,
                };
                return (out, Some(error));
            }
        };
        let Some(data) = words.get(at + 1..at + 1 + count) else {
            let error = DecodeError::Truncated {
                at_word: at,
                header,
                needed: count,
                available: words.len() - at - 1,
            };
            return (out, Some(error));
        };
        for (k, &value) in data.iter().enumerate() {
            let step = match kind {
                Kind::Incrementing => k as u32,
                Kind::IncrementOnce => u32::from(k > 0),
                _ => 0,
            };
            out.push(Method {
                subchannel,
                offset: offset + 4 * step,
                value,
                kind,
            });
        }
        at += 1 + count;
    }
    (out, None)
}

/// Group-0 headers that carry no method: the NOP word and the subdevice-mask operations (SLI).
fn carries_no_method(header: u32) -> bool {
    header == c56f::DMA_NOP
        || c56f::DMA_SET_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_SET_SUBDEVICE_MASK_OPCODE_VALUE
        || c56f::DMA_STORE_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_STORE_SUBDEVICE_MASK_OPCODE_VALUE
        || c56f::DMA_USE_SUBDEVICE_MASK_OPCODE.unpack(header)
            == c56f::DMA_USE_SUBDEVICE_MASK_OPCODE_VALUE
}

#[cfg(test)]
mod tests;
