//! The records the device runtime writes: what they hold, and decoding one.

use std::fmt;

use super::format::{Consumes, PrintfArg, conversions};

pub(super) const KIND_PRINTF: u32 = 1;
pub(super) const KIND_ASSERT: u32 = 2;

pub(super) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// What a failed device-side `assert` reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssertFailure {
    /// The asserted expression, as written in the source.
    pub message: String,
    /// The source file, as the compiler recorded it.
    pub file: String,
    /// The line of the `assert` in `file`.
    pub line: u32,
    /// The function, as the compiler names it (`void k(int *)`).
    pub function: String,
    /// `blockIdx` of the failing thread.
    pub block: [u32; 3],
    /// `threadIdx` of the failing thread.
    pub thread: [u32; 3],
}

impl fmt::Display for AssertFailure {
    /// The line CUDA prints for a failed device assertion.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: block: [{},{},{}], thread: [{},{},{}] Assertion `{}` failed.",
            self.file,
            self.line,
            self.function,
            self.block[0],
            self.block[1],
            self.block[2],
            self.thread[0],
            self.thread[1],
            self.thread[2],
            self.message
        )
    }
}

/// A record from the FIFO.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceRecord {
    /// A `printf` call: the format string and the arguments it consumed.
    Printf {
        /// The format string's bytes, without the terminating NUL.
        format: Vec<u8>,
        /// The arguments, in order.
        args: Vec<PrintfArg>,
    },
    /// A failed `assert`.
    Assert(AssertFailure),
}

/// Why a record could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("corrupt printf record: {0}")]
pub struct RecordError(String);

fn rec_err(what: impl Into<String>) -> RecordError {
    RecordError(what.into())
}

/// Reads a `%s` slot at `at`: returns the string and the offset after it.
fn read_string(body: &[u8], at: usize) -> Result<(Option<Vec<u8>>, usize), RecordError> {
    let len = u64_at(body, at).ok_or_else(|| rec_err("string slot past the record"))?;
    if len == u64::MAX {
        return Ok((None, at + 8));
    }
    let len = usize::try_from(len).map_err(|_| rec_err("string length"))?;
    let start = at + 8;
    let bytes = start
        .checked_add(len)
        .and_then(|end| body.get(start..end))
        .ok_or_else(|| rec_err("string past the record"))?;
    Ok((Some(bytes.to_vec()), start + len.next_multiple_of(8)))
}

/// Decodes one whole record (header included).
pub fn decode_record(rec: &[u8]) -> Result<DeviceRecord, RecordError> {
    let head = u64_at(rec, 0).ok_or_else(|| rec_err("shorter than its header"))?;
    let kind = head as u32;
    match kind {
        KIND_PRINTF => {
            let nul = rec[8..]
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| rec_err("format string not terminated"))?;
            let format = rec[8..8 + nul].to_vec();
            let mut at = 8 + (nul + 1).next_multiple_of(8);
            let mut args = Vec::new();
            for conv in conversions(&format) {
                match conv {
                    Consumes::Word => {
                        let w =
                            u64_at(rec, at).ok_or_else(|| rec_err("argument past the record"))?;
                        args.push(PrintfArg::Word(w));
                        at += 8;
                    }
                    Consumes::Str => {
                        let (s, next) = read_string(rec, at)?;
                        args.push(PrintfArg::Str(s));
                        at = next;
                    }
                }
            }
            Ok(DeviceRecord::Printf { format, args })
        }
        KIND_ASSERT => {
            let word =
                |i: usize| u64_at(rec, 8 + 8 * i).ok_or_else(|| rec_err("assert record too short"));
            let line = word(0)? as u32;
            let (a, b, c) = (word(1)?, word(2)?, word(3)?);
            let block = [a as u32, (a >> 32) as u32, b as u32];
            let thread = [(b >> 32) as u32, c as u32, (c >> 32) as u32];
            let (message, at) = read_string(rec, 40)?;
            let (file, at) = read_string(rec, at)?;
            let (function, _) = read_string(rec, at)?;
            let text =
                |s: Option<Vec<u8>>| String::from_utf8_lossy(&s.unwrap_or_default()).into_owned();
            Ok(DeviceRecord::Assert(AssertFailure {
                message: text(message),
                file: text(file),
                line,
                function: text(function),
                block,
                thread,
            }))
        }
        other => Err(rec_err(format!("unknown kind {other}"))),
    }
}
