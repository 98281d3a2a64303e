//! Fatbins: the containers nvcc (`-fatbin`, and the `.nv_fatbin` section of host objects) and NVRTC write around
//! cubins and PTX for several architectures.
//!
//! Layout (little-endian), as read from CUDA 13 output and public descriptions of the format:
//!
//! - container header, 16 bytes: `u32 magic 0xBA55ED50, u16 version (1), u16 header size (16), u64 bytes of
//!   entries that follow`; containers may follow each other (host objects hold one per translation unit);
//! - entry header (64 bytes or more, its own size in it): `u16 kind (1 PTX, 2 ELF), u16 version, u32 header size,
//!   u64 padded payload size, u32 compressed size, u32 -, u16 code minor, u16 code major, u32 sm, u32 -, u32 -,
//!   u64 flags, u64 -, u64 uncompressed size`, then the payload, padded to 8 bytes.
//!
//! Flags: bit 0 64-bit, bit 4 Linux host, 0x2000 LZ4-compressed payload (CUDA 11.x `-Xfatbin=-compress-all`),
//! 0x8000 zstd-compressed payload (CUDA 12.8+ compresses PTX by default; the fixture's compute_90 PTX is zstd).
//! LZ4 block payloads are decompressed here; zstd needs a decoder this crate does not carry, so those entries give
//! [`FatbinError::Compressed`].

use std::fmt;

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, SectionHeader};

use super::cubin::sass_compatible;

/// First four bytes of a fatbin container.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const CONTAINER_HEADER: usize = 16;
const ENTRY_HEADER_MIN: usize = 64;
/// Largest payload decompressed when the entry does not state its size.
const MAX_UNSTATED_SIZE: usize = 256 << 20;

/// Entry flag bits.
pub mod flags {
    pub const ADDRESS_64: u64 = 0x1;
    pub const DEBUG: u64 = 0x2;
    pub const LINUX: u64 = 0x10;
    pub const COMPRESSED_LZ4: u64 = 0x2000;
    pub const COMPRESSED_ZSTD: u64 = 0x8000;
}

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FatbinEntryKind {
    /// PTX text for `compute_<sm>`, to be JIT-compiled.
    Ptx,
    /// A cubin (ELF) with SASS for `sm_<sm>`.
    Cubin,
}

/// How an entry's payload is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Lz4,
    Zstd,
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::Lz4 => "LZ4",
            Compression::Zstd => "zstd",
        })
    }
}

/// One entry of a fatbin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FatbinEntry {
    pub kind: FatbinEntryKind,
    /// Architecture: `sm_<sm>` for cubins, `compute_<sm>` for PTX.
    pub sm: u32,
    pub compressed: bool,
    pub compression: Option<Compression>,
    /// The entry's raw flags.
    pub flags: u64,
    /// Offset of the stored payload in the bytes given to [`entries`].
    pub payload_offset: usize,
    /// Bytes of stored payload (compressed size for compressed entries).
    pub payload_size: usize,
    /// Bytes after decompression, as the entry states it (0 when it does not).
    pub uncompressed_size: u64,
}

impl fmt::Display for FatbinEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            FatbinEntryKind::Cubin => write!(f, "sm_{} cubin", self.sm)?,
            FatbinEntryKind::Ptx => write!(f, "compute_{} PTX", self.sm)?,
        }
        if let Some(c) = self.compression {
            write!(f, " ({c})")?;
        }
        Ok(())
    }
}

/// Why a fatbin could not be read, or holds nothing for the device.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum FatbinError {
    #[error("not a fatbin (no magic {FATBIN_MAGIC:#x}, and not an ELF with a .nv_fatbin section)")]
    NotFatbin,
    #[error("corrupt fatbin: {what}")]
    Corrupt { what: String },
    #[error(
        "no cubin for sm_{device_sm} in the fatbin; it holds: {}",
        list(available)
    )]
    NoCubinForSm {
        device_sm: u32,
        available: Vec<String>,
    },
    #[error("the sm_{sm} cubin is {algorithm}-compressed, which this crate cannot decompress")]
    Compressed { sm: u32, algorithm: Compression },
    #[error("bad {algorithm} payload: {what}")]
    Decompress {
        algorithm: Compression,
        what: String,
    },
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "nothing".to_owned()
    } else {
        items.join(", ")
    }
}

fn corrupt(what: impl Into<String>) -> FatbinError {
    FatbinError::Corrupt { what: what.into() }
}

fn u16_at(data: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        data.get(offset..offset.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(data: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        data.get(offset..offset.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(data: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        data.get(offset..offset.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Whether `bytes` starts with a fatbin container.
pub fn is_fatbin(bytes: &[u8]) -> bool {
    u32_at(bytes, 0) == Some(FATBIN_MAGIC)
}

/// The entries of a fatbin, or of the `.nv_fatbin` section of a host ELF object, in file order.
/// Entries of kinds other than PTX and ELF are skipped.
pub fn entries(bytes: &[u8]) -> Result<Vec<FatbinEntry>, FatbinError> {
    if is_fatbin(bytes) {
        return containers(bytes, 0);
    }
    let (offset, section) = nv_fatbin_section(bytes).ok_or(FatbinError::NotFatbin)?;
    if !is_fatbin(section) {
        return Err(corrupt(
            ".nv_fatbin section does not start with a fatbin container",
        ));
    }
    containers(section, offset)
}

/// The `.nv_fatbin` section of a 64-bit little-endian ELF, with its file offset.
fn nv_fatbin_section(bytes: &[u8]) -> Option<(usize, &[u8])> {
    let header = elf::FileHeader64::<LittleEndian>::parse(bytes).ok()?;
    let endian = header.endian().ok()?;
    let sections = header.sections(endian, bytes).ok()?;
    let (_, section) = sections.section_by_name(endian, b".nv_fatbin")?;
    let data = section.data(endian, bytes).ok()?;
    let offset = usize::try_from(section.sh_offset(endian)).ok()?;
    Some((offset, data))
}

/// Walks back-to-back containers in `data`; `base` is `data`'s offset in the caller's bytes.
fn containers(data: &[u8], base: usize) -> Result<Vec<FatbinEntry>, FatbinError> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    loop {
        let rest = data.get(pos..).unwrap_or_default();
        // Containers are padded apart with zeros.
        let skip = rest.iter().take_while(|b| **b == 0).count();
        pos = pos
            .checked_add(skip)
            .ok_or_else(|| corrupt("offset overflows"))?;
        if pos >= data.len() {
            return Ok(out);
        }
        if u32_at(data, pos) != Some(FATBIN_MAGIC) {
            return Err(corrupt(format!(
                "bytes at {:#x} are neither padding nor a container",
                base.saturating_add(pos)
            )));
        }
        pos = container(data, pos, base, &mut out)?;
    }
}

/// Reads the container at `start`, appends its entries, returns where it ends.
fn container(
    data: &[u8],
    start: usize,
    base: usize,
    out: &mut Vec<FatbinEntry>,
) -> Result<usize, FatbinError> {
    let truncated = || corrupt("container header is truncated");
    let header_size = usize::from(
        u16_at(data, start.checked_add(6).ok_or_else(truncated)?).ok_or_else(truncated)?,
    );
    let body = u64_at(data, start.checked_add(8).ok_or_else(truncated)?).ok_or_else(truncated)?;
    if header_size < CONTAINER_HEADER {
        return Err(corrupt(format!(
            "container header size {header_size} is below {CONTAINER_HEADER}"
        )));
    }
    let first = start.checked_add(header_size).ok_or_else(truncated)?;
    let end = usize::try_from(body)
        .ok()
        .and_then(|b| first.checked_add(b))
        .filter(|e| *e <= data.len())
        .ok_or_else(|| {
            corrupt(format!(
                "container claims {body} bytes of entries, the input is shorter"
            ))
        })?;

    let mut pos = first;
    while pos < end {
        let entry = data.get(pos..end).unwrap_or_default();
        let field = |offset: usize| {
            u32_at(entry, offset).ok_or_else(|| corrupt(format!("entry at {pos:#x} is truncated")))
        };
        let kind =
            u16_at(entry, 0).ok_or_else(|| corrupt(format!("entry at {pos:#x} is truncated")))?;
        let entry_header = usize::try_from(field(4)?).unwrap_or(usize::MAX);
        let padded =
            u64_at(entry, 8).ok_or_else(|| corrupt(format!("entry at {pos:#x} is truncated")))?;
        let compressed_size = field(0x10)?;
        let sm = field(0x1c)?;
        let entry_flags = u64_at(entry, 0x28)
            .ok_or_else(|| corrupt(format!("entry at {pos:#x} is truncated")))?;
        let uncompressed_size = u64_at(entry, 0x38)
            .ok_or_else(|| corrupt(format!("entry at {pos:#x} is truncated")))?;
        if entry_header < ENTRY_HEADER_MIN {
            return Err(corrupt(format!(
                "entry at {pos:#x}: header size {entry_header} is below {ENTRY_HEADER_MIN}"
            )));
        }
        let padded = usize::try_from(padded).ok();
        let payload_start = pos.checked_add(entry_header).filter(|p| *p <= end);
        let next = payload_start
            .zip(padded)
            .and_then(|(p, s)| p.checked_add(s))
            .filter(|e| *e <= end);
        let (Some(payload_start), Some(padded), Some(next)) = (payload_start, padded, next) else {
            return Err(corrupt(format!(
                "entry at {pos:#x} runs past its container"
            )));
        };
        let compression = if entry_flags & flags::COMPRESSED_ZSTD != 0 {
            Some(Compression::Zstd)
        } else if entry_flags & flags::COMPRESSED_LZ4 != 0 {
            Some(Compression::Lz4)
        } else {
            None
        };
        // Uncompressed payloads fill the padded size (padding is zeros, harmless to ELF and PTX readers);
        // compressed ones say how many bytes are real.
        let payload_size = match usize::try_from(compressed_size) {
            Ok(size) if compression.is_some() && size != 0 => {
                if size > padded {
                    return Err(corrupt(format!(
                        "entry at {pos:#x}: compressed size exceeds its payload"
                    )));
                }
                size
            }
            _ => padded,
        };
        let kind = match kind {
            1 => Some(FatbinEntryKind::Ptx),
            2 => Some(FatbinEntryKind::Cubin),
            other => {
                tracing::debug!(
                    kind = other,
                    offset = pos,
                    "skipping fatbin entry of unknown kind"
                );
                None
            }
        };
        if let Some(kind) = kind {
            out.push(FatbinEntry {
                kind,
                sm,
                compressed: compression.is_some(),
                compression,
                flags: entry_flags,
                payload_offset: base
                    .checked_add(payload_start)
                    .ok_or_else(|| corrupt("offset overflows"))?,
                payload_size,
                uncompressed_size,
            });
        }
        pos = next;
    }
    Ok(end)
}

/// The payload of `entry` (from [`entries`] on the same `bytes`), decompressed.
pub fn payload(bytes: &[u8], entry: &FatbinEntry) -> Result<Vec<u8>, FatbinError> {
    let end = entry.payload_offset.checked_add(entry.payload_size);
    let stored = end
        .and_then(|end| bytes.get(entry.payload_offset..end))
        .ok_or_else(|| corrupt("entry payload is outside the input"))?;
    match entry.compression {
        None => Ok(stored.to_vec()),
        Some(Compression::Lz4) => {
            let size = match usize::try_from(entry.uncompressed_size) {
                Ok(0) => None,
                Ok(size) => Some(size),
                Err(_) => return Err(corrupt("uncompressed size overflows")),
            };
            lz4_block(stored, size)
        }
        Some(Compression::Zstd) => Err(FatbinError::Compressed {
            sm: entry.sm,
            algorithm: Compression::Zstd,
        }),
    }
}

/// The cubin to run on an `sm_<device_sm>` GPU: the entry for exactly that SM if there is one, else the newest
/// binary-compatible one (same major version, lower minor), decompressed.
pub fn select_cubin(bytes: &[u8], device_sm: u32) -> Result<Vec<u8>, FatbinError> {
    let all = entries(bytes)?;
    let cubins = || all.iter().filter(|e| e.kind == FatbinEntryKind::Cubin);
    let chosen = cubins().find(|e| e.sm == device_sm).or_else(|| {
        cubins()
            .filter(|e| sass_compatible(e.sm, device_sm))
            .max_by_key(|e| e.sm)
    });
    match chosen {
        Some(entry) => payload(bytes, entry),
        None => Err(FatbinError::NoCubinForSm {
            device_sm,
            available: all.iter().map(|e| e.to_string()).collect(),
        }),
    }
}

/// Decodes one LZ4 block (the raw block format, no frame): sequences of literals and back-references.
/// `size` is the decoded size the entry states; without it output is capped at [`MAX_UNSTATED_SIZE`].
fn lz4_block(src: &[u8], size: Option<usize>) -> Result<Vec<u8>, FatbinError> {
    let bad = |what: &str| FatbinError::Decompress {
        algorithm: Compression::Lz4,
        what: what.to_owned(),
    };
    let limit = size.unwrap_or(MAX_UNSTATED_SIZE);
    let mut out: Vec<u8> = Vec::with_capacity(limit.min(src.len().saturating_mul(4)));
    let mut i = 0usize;
    // Lengths of 15 continue in following bytes, each adding up to 255.
    let long_len = |i: &mut usize, mut len: usize| -> Result<usize, FatbinError> {
        loop {
            let b = *src
                .get(*i)
                .ok_or_else(|| bad("length runs past the input"))?;
            *i += 1;
            len = len
                .checked_add(usize::from(b))
                .ok_or_else(|| bad("length overflows"))?;
            if b != 255 {
                return Ok(len);
            }
        }
    };
    loop {
        let token = *src
            .get(i)
            .ok_or_else(|| bad("input ends before a sequence"))?;
        i += 1;
        let mut literals = usize::from(token >> 4);
        if literals == 15 {
            literals = long_len(&mut i, literals)?;
        }
        let lit_end = i
            .checked_add(literals)
            .ok_or_else(|| bad("literal length overflows"))?;
        let lit = src
            .get(i..lit_end)
            .ok_or_else(|| bad("literals run past the input"))?;
        if out.len().checked_add(lit.len()).is_none_or(|n| n > limit) {
            return Err(bad("output exceeds the stated size"));
        }
        out.extend_from_slice(lit);
        i = lit_end;
        if i == src.len() {
            break; // the last sequence has literals only
        }
        let offset =
            usize::from(u16_at(src, i).ok_or_else(|| bad("match offset runs past the input"))?);
        i += 2;
        if offset == 0 || offset > out.len() {
            return Err(bad("match offset points before the output"));
        }
        let mut length = usize::from(token & 0x0f);
        if length == 15 {
            length = long_len(&mut i, length)?;
        }
        let length = length
            .checked_add(4)
            .ok_or_else(|| bad("match length overflows"))?;
        if out.len().checked_add(length).is_none_or(|n| n > limit) {
            return Err(bad("output exceeds the stated size"));
        }
        // Byte by byte: a match may overlap the bytes it produces (offset < length repeats a pattern).
        let from = out.len() - offset;
        for k in 0..length {
            let byte = out
                .get(from + k)
                .copied()
                .ok_or_else(|| bad("match offset points before the output"))?;
            out.push(byte);
        }
    }
    if size.is_some_and(|s| s != out.len()) {
        return Err(bad("decoded size differs from the stated size"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lz4_literals_and_overlapping_match() {
        // "abc" then a match of offset 3, length 9 ("abcabcabc"), then literal "!" as the final sequence.
        let block = [0x35, b'a', b'b', b'c', 3, 0, 0x10, b'!'];
        assert_eq!(lz4_block(&block, Some(13)).unwrap(), b"abcabcabcabc!");
        assert!(lz4_block(&block, Some(12)).is_err());
        assert!(lz4_block(&[0x35, b'a', b'b', b'c', 4, 0, 0x10, b'!'], None).is_err());
        assert!(lz4_block(&[0xf0], None).is_err());
        assert!(lz4_block(&[], None).is_err());
    }

    #[test]
    fn lz4_long_lengths() {
        // 20 literals (15 + 5), then offset 1 with length 15 + 4 + 1 = 20 repeats of the last byte, then "z".
        let mut block = vec![0xff, 5];
        block.extend_from_slice(b"0123456789abcdefghij");
        block.extend_from_slice(&[1, 0, 1, 0x10, b'z']);
        let out = lz4_block(&block, None).unwrap();
        assert_eq!(out.len(), 20 + 20 + 1);
        assert!(out[20..40].iter().all(|b| *b == b'j'));
    }
}
