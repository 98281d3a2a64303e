//! Fatbins: the containers nvcc (`-fatbin`, and the `.nv_fatbin`/`__nv_relfatbin` sections of host executables,
//! shared libraries and objects) and NVRTC write around cubins and PTX for several architectures.
//!
//! Layout (little-endian), as read from CUDA 13 output and public descriptions of the format:
//!
//! - container header, 16 bytes: `u32 magic 0xBA55ED50, u16 version (1), u16 header size (16), u64 bytes of
//!   entries that follow`; containers may follow each other (host binaries hold one per translation unit, and one
//!   more for the device-link step);
//! - entry header (64 bytes or more, its own size in it): `u16 kind (1 PTX, 2 ELF), u16 version, u32 header size,
//!   u64 padded payload size, u32 compressed size, u32 -, u16 code minor, u16 code major, u32 sm, u32 -, u32 -,
//!   u64 flags, u64 -, u64 uncompressed size`, then the payload, padded to 8 bytes. Longer headers (PTX entries,
//!   sm_100 cubins) carry options or a copy of the cubin's `.nv.compat` after the first 64 bytes.
//!
//! Flags: bit 0 64-bit, bit 4 Linux host, 0x2000 LZ4-compressed payload (a raw LZ4 block: CUDA 11.x
//! `-Xfatbin=-compress-all`, and CUDA 13 `--compress-mode=speed`), 0x8000 zstd-compressed payload (CUDA 12.8+
//! compresses PTX by default, `--compress-mode=size` and `-Xfatbin -compress-all` cubins too), 0x10_0000
//! architecture-specific code (`sm_90a`: nvcc 13.0 writes the same `sm` and the same cubin `e_flags` as for
//! `sm_90`; only this flag and the cubin's `.nv.compat` attribute 9 tell them apart, see
//! [`select`](super::select)). Payloads are decompressed here, never past [`MAX_PAYLOAD`] bytes whatever the
//! entry claims.
//!
//! Host binaries: `.nv_fatbin` holds linked (executable) code; `__nv_relfatbin` (`nvcc -rdc=true`) holds the
//! relocatable cubins and PTX the device-link step started from. [`entries`] reads both and says which each
//! entry came from ([`Origin`]).

use std::fmt;

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, SectionHeader};

use super::cache::ModuleCache;
use super::payload::Payload;

/// First four bytes of a fatbin container.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const CONTAINER_HEADER: usize = 16;
const ENTRY_HEADER_MIN: usize = 64;
/// Most bytes a payload may decompress to: a corrupt size field must not make the loader allocate gigabytes.
/// The largest cubins real programs ship are tens of MiB.
pub const MAX_PAYLOAD: usize = 256 << 20;
/// Most bytes one LZ4 input byte can decode to (a length byte of 255 adds 255 bytes of match).
const LZ4_MAX_RATIO: usize = 255;
/// Smallest zstd window accepted whatever the stated size: frames written without a content size may declare
/// a window larger than their output.
const ZSTD_MIN_WINDOW: u64 = 1 << 20;

/// Entry flag bits.
pub mod flags {
    /// 64-bit code.
    pub const ADDRESS_64: u64 = 0x1;
    /// Debug code (`-G`).
    pub const DEBUG: u64 = 0x2;
    /// Linux host.
    pub const LINUX: u64 = 0x10;
    /// The payload is one raw LZ4 block.
    pub const COMPRESSED_LZ4: u64 = 0x2000;
    /// The payload is a zstd frame.
    pub const COMPRESSED_ZSTD: u64 = 0x8000;
    /// Architecture-specific code (`sm_90a`, `compute_90a`): runs only on exactly that SM.
    pub const ARCH_SPECIFIC: u64 = 0x10_0000;
}

/// Where in the input an entry was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The input is a fatbin.
    Fatbin,
    /// The `.nv_fatbin` section of a host ELF: code as the program runs it.
    NvFatbin,
    /// The `__nv_relfatbin` section of a host ELF (`nvcc -rdc=true`): relocatable cubins and PTX that must be
    /// linked before they run.
    NvRelFatbin,
}

impl Origin {
    /// The section name, for host ELFs.
    pub fn section(self) -> Option<&'static str> {
        match self {
            Origin::Fatbin => None,
            Origin::NvFatbin => Some(".nv_fatbin"),
            Origin::NvRelFatbin => Some("__nv_relfatbin"),
        }
    }
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
    /// One raw LZ4 block.
    Lz4,
    /// One zstd frame.
    Zstd,
}

impl Compression {
    /// The algorithm's name in module cache keys.
    fn tag(self) -> &'static str {
        match self {
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
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
    /// Cubin or PTX.
    pub kind: FatbinEntryKind,
    /// Architecture: `sm_<sm>` for cubins, `compute_<sm>` for PTX.
    pub sm: u32,
    /// Architecture-specific code (`sm_<sm>a`, flag [`flags::ARCH_SPECIFIC`]): runs only on exactly `sm`.
    pub arch_specific: bool,
    /// Which section of a host ELF the entry is in (or that the input is a fatbin).
    pub origin: Origin,
    /// Index of the entry's container, counted across the input in file order. Each container is a module of
    /// its own (one per translation unit in a host binary).
    pub container: usize,
    /// Whether the payload is compressed.
    pub compressed: bool,
    /// How the payload is compressed.
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

impl FatbinEntry {
    /// The architecture as nvcc names it: `sm_90`, `sm_90a` (cubins), `compute_90` (PTX).
    pub fn arch_name(&self) -> String {
        let prefix = match self.kind {
            FatbinEntryKind::Cubin => "sm",
            FatbinEntryKind::Ptx => "compute",
        };
        let suffix = if self.arch_specific { "a" } else { "" };
        format!("{prefix}_{}{suffix}", self.sm)
    }
}

impl fmt::Display for FatbinEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            FatbinEntryKind::Cubin => write!(f, "{} cubin", self.arch_name())?,
            FatbinEntryKind::Ptx => write!(f, "{} PTX", self.arch_name())?,
        }
        if let Some(c) = self.compression {
            write!(f, " ({c})")?;
        }
        if self.origin == Origin::NvRelFatbin {
            f.write_str(" in __nv_relfatbin")?;
        }
        Ok(())
    }
}

/// Why a fatbin could not be read, or holds nothing for the device.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum FatbinError {
    /// Neither a fatbin nor an ELF with fatbin sections.
    #[error(
        "not a fatbin (no magic {FATBIN_MAGIC:#x}, and not an ELF with a .nv_fatbin or __nv_relfatbin section)"
    )]
    NotFatbin,
    /// The containers or entries are malformed.
    #[error("corrupt fatbin: {what}; rebuild it with nvcc")]
    Corrupt {
        /// What is wrong, and where.
        what: String,
    },
    /// `module::select::select_cubin` found no SASS the device runs.
    #[error(
        "no cubin for sm_{device_sm} in the fatbin; it holds: {}; rebuild with -gencode for sm_{device_sm} or include PTX",
        list(available)
    )]
    NoCubinForSm {
        /// The device's SM version.
        device_sm: u32,
        /// Every entry, described.
        available: Vec<String>,
    },
    /// A compressed payload does not decode, or decodes to another size than the entry states.
    #[error("bad {algorithm} payload in the {entry}: {what}")]
    Decompress {
        /// The entry, described.
        entry: String,
        /// How it is compressed.
        algorithm: Compression,
        /// What went wrong.
        what: String,
    },
    /// The entry states a decompressed size above [`MAX_PAYLOAD`].
    #[error(
        "the {entry} claims to decompress to {size} bytes, more than the {MAX_PAYLOAD}-byte limit: the fatbin is corrupt"
    )]
    TooLarge {
        /// The entry, described.
        entry: String,
        /// The stated size.
        size: u64,
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

/// The entries of a fatbin, or of the `.nv_fatbin` and `__nv_relfatbin` sections of a host ELF (executable,
/// shared library or object), in file order. Entries of kinds other than PTX and ELF are skipped.
pub fn entries(bytes: &[u8]) -> Result<Vec<FatbinEntry>, FatbinError> {
    let mut out = Vec::new();
    // Containers are numbered across sections, so an index names one container of the whole input.
    let mut next_container = 0;
    if is_fatbin(bytes) {
        containers(bytes, 0, (Origin::Fatbin, &mut next_container), &mut out)?;
        return Ok(out);
    }
    let sections = fatbin_sections(bytes).ok_or(FatbinError::NotFatbin)?;
    if sections.is_empty() {
        return Err(FatbinError::NotFatbin);
    }
    for (origin, offset, section) in sections {
        if !is_fatbin(section) {
            return Err(corrupt(format!(
                "the {} section does not start with a fatbin container",
                origin.section().unwrap_or_default()
            )));
        }
        containers(section, offset, (origin, &mut next_container), &mut out)?;
    }
    Ok(out)
}

/// The `.nv_fatbin` and `__nv_relfatbin` sections of a 64-bit little-endian ELF that is not itself a cubin,
/// with their file offsets, in section order; `None` if `bytes` is not such an ELF.
fn fatbin_sections(bytes: &[u8]) -> Option<Vec<(Origin, usize, &[u8])>> {
    let header = elf::FileHeader64::<LittleEndian>::parse(bytes).ok()?;
    let endian = header.endian().ok()?;
    if header.e_machine(endian) == elf::EM_CUDA {
        return None;
    }
    let sections = header.sections(endian, bytes).ok()?;
    let mut out = Vec::new();
    for section in sections.iter() {
        let origin = match sections.section_name(endian, section).ok()? {
            b".nv_fatbin" => Origin::NvFatbin,
            b"__nv_relfatbin" => Origin::NvRelFatbin,
            _ => continue,
        };
        let data = section.data(endian, bytes).ok()?;
        let offset = usize::try_from(section.sh_offset(endian)).ok()?;
        out.push((origin, offset, data));
    }
    Some(out)
}

/// Walks back-to-back containers in `data`, appending their entries to `out`; `base` is `data`'s offset in the
/// caller's bytes.
fn containers(
    data: &[u8],
    base: usize,
    (origin, next_container): (Origin, &mut usize),
    out: &mut Vec<FatbinEntry>,
) -> Result<(), FatbinError> {
    let mut pos = 0usize;
    loop {
        let rest = data.get(pos..).unwrap_or_default();
        // Containers are padded apart with zeros.
        let skip = rest.iter().take_while(|b| **b == 0).count();
        pos = pos
            .checked_add(skip)
            .ok_or_else(|| corrupt("offset overflows"))?;
        if pos >= data.len() {
            return Ok(());
        }
        if u32_at(data, pos) != Some(FATBIN_MAGIC) {
            return Err(corrupt(format!(
                "bytes at {:#x} are neither padding nor a container",
                base.saturating_add(pos)
            )));
        }
        pos = container(data, pos, base, (origin, *next_container), out)?;
        *next_container += 1;
    }
}

/// Reads the container at `start`, appends its entries, returns where it ends.
fn container(
    data: &[u8],
    start: usize,
    base: usize,
    (origin, index): (Origin, usize),
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
                arch_specific: entry_flags & flags::ARCH_SPECIFIC != 0,
                origin,
                container: index,
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

/// The payload of `entry` (from [`entries`] on the same `bytes`), decompressed. Uncompressed payloads come with
/// their zero padding (harmless to ELF and PTX readers); compressed ones must decode to exactly the size the
/// entry states, and never to more than [`MAX_PAYLOAD`] bytes. Large compressed payloads go through the
/// process-wide [`module_cache`](super::cache::module_cache), so a later process reads them instead of
/// decompressing.
pub fn payload(bytes: &[u8], entry: &FatbinEntry) -> Result<Vec<u8>, FatbinError> {
    payload_bytes(bytes, entry).map(Payload::into_vec)
}

/// As [`payload`], a module cache hit mapped rather than copied into memory ([`Payload`]).
pub fn payload_bytes(bytes: &[u8], entry: &FatbinEntry) -> Result<Payload, FatbinError> {
    // Fixed (from the environment, unless set before) only by the first compressed payload.
    decode(bytes, entry, super::cache::module_cache)
}

/// [`payload`] through `cache` instead of the process-wide one.
pub fn payload_with(
    bytes: &[u8],
    entry: &FatbinEntry,
    cache: &ModuleCache,
) -> Result<Vec<u8>, FatbinError> {
    decode(bytes, entry, || cache).map(Payload::into_vec)
}

fn decode<'c>(
    bytes: &[u8],
    entry: &FatbinEntry,
    cache: impl FnOnce() -> &'c ModuleCache,
) -> Result<Payload, FatbinError> {
    let end = entry.payload_offset.checked_add(entry.payload_size);
    let stored = end
        .and_then(|end| bytes.get(entry.payload_offset..end))
        .ok_or_else(|| corrupt("entry payload is outside the input"))?;
    let Some(algorithm) = entry.compression else {
        return Ok(stored.to_vec().into());
    };
    let too_large = || FatbinError::TooLarge {
        entry: entry.to_string(),
        size: entry.uncompressed_size,
    };
    // 0: the entry does not say (older nvcc); the output is then bounded by what the input can decode to.
    let stated = match usize::try_from(entry.uncompressed_size) {
        Ok(0) => None,
        Ok(size) if size <= MAX_PAYLOAD => Some(size),
        _ => return Err(too_large()),
    };
    let bad = |what: String| FatbinError::Decompress {
        entry: entry.to_string(),
        algorithm,
        what,
    };
    // The cache keys on exactly what is decoded here; it only stores what passed the checks below.
    cache().get_or_insert_payload(stored, algorithm.tag(), stated, || {
        let out = match algorithm {
            Compression::Lz4 => lz4_block(stored, stated),
            Compression::Zstd => zstd_frame(stored, stated),
        }
        .map_err(bad)?;
        if let Some(size) = stated.filter(|s| *s != out.len()) {
            return Err(bad(format!(
                "it decodes to {} bytes, the entry states {size}",
                out.len()
            )));
        }
        Ok(out)
    })
}

/// Decodes one raw LZ4 block (no frame) of at most `stated` bytes.
fn lz4_block(src: &[u8], stated: Option<usize>) -> Result<Vec<u8>, String> {
    let bound = src
        .len()
        .saturating_mul(LZ4_MAX_RATIO)
        .saturating_add(16)
        .min(MAX_PAYLOAD);
    let size = match stated {
        Some(size) if size > bound => {
            return Err(format!(
                "the entry states {size} bytes, more than {} bytes of LZ4 can decode to",
                src.len()
            ));
        }
        Some(size) => size,
        None => bound,
    };
    let mut out = vec![0u8; size];
    let written = lz4_flex::block::decompress_into(src, &mut out).map_err(|e| e.to_string())?;
    out.truncate(written);
    Ok(out)
}

/// Decodes one zstd frame (checksum verified when present) to at most `stated` bytes. With a stated size the output
/// is allocated once and the frame must fit it; without one the output grows as it decodes, bounded by
/// [`MAX_PAYLOAD`], rather than trusting a size up front.
fn zstd_frame(src: &[u8], stated: Option<usize>) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let limit = stated.unwrap_or(MAX_PAYLOAD);
    // The decoder allocates the frame's window before decoding: bound it by what the entry may decode to.
    let window = u64::try_from(limit)
        .unwrap_or(u64::MAX)
        .clamp(ZSTD_MIN_WINDOW, MAX_PAYLOAD as u64);
    let window_log = 63 - window.next_power_of_two().leading_zeros();
    // The entry's first frame only: a payload may carry zero padding after it (an entry without a compressed
    // size is read to its padded end), which the decoder would take for a broken second frame.
    let src = match zstd::zstd_safe::find_frame_compressed_size(src) {
        Ok(n) if n <= src.len() => &src[..n],
        // Unreadable header or truncated frame: the decoder reports it.
        _ => src,
    };
    if let Some(size) = stated {
        let mut d = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
        d.window_log_max(window_log).map_err(|e| e.to_string())?;
        // One byte more than stated, so that a frame decoding to more is caught rather than cut.
        let mut out = Vec::with_capacity(size + 1);
        d.decompress_to_buffer(src, &mut out)
            .map_err(|e| e.to_string())?;
        if out.len() > size {
            return Err(format!("it decodes to more than {size} bytes"));
        }
        return Ok(out);
    }
    let mut decoder = zstd::stream::read::Decoder::with_buffer(src).map_err(|e| e.to_string())?;
    decoder
        .window_log_max(window_log)
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    if out.len() > limit {
        return Err(format!("it decodes to more than {limit} bytes"));
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
        assert_eq!(lz4_block(&block, None).unwrap(), b"abcabcabcabc!");
        assert!(
            lz4_block(&block, Some(12)).is_err(),
            "output past the stated size"
        );
        assert!(lz4_block(&[0x35, b'a', b'b', b'c', 4, 0, 0x10, b'!'], None).is_err());
        assert!(lz4_block(&[0xf0], None).is_err());
        assert!(lz4_block(&[], None).is_err());
        assert!(
            lz4_block(&block, Some(1 << 20)).is_err(),
            "8 bytes cannot decode to 1 MiB: refused before allocating"
        );
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

    #[test]
    fn zstd_bounds() {
        // A raw-block frame of "hello" with its content size (5) in the header, no checksum.
        let frame = [
            0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x05, 0x29, 0x00, 0x00, b'h', b'e', b'l', b'l', b'o',
        ];
        assert_eq!(zstd_frame(&frame, Some(5)).unwrap(), b"hello");
        assert_eq!(zstd_frame(&frame, None).unwrap(), b"hello");
        assert!(zstd_frame(&frame, Some(4)).is_err(), "more than stated");
        assert!(zstd_frame(&frame[..10], Some(5)).is_err(), "truncated");
        assert!(zstd_frame(b"not zstd", Some(5)).is_err());
        // A frame with a content checksum: a flipped byte is caught, with or without a stated size.
        let text = b"checksummed payload, checksummed payload, checksummed payload".repeat(20);
        let mut c = zstd::bulk::Compressor::new(3).unwrap();
        c.include_checksum(true).unwrap();
        let mut framed = c.compress(&text).unwrap();
        assert_eq!(zstd_frame(&framed, Some(text.len())).unwrap(), text);
        let last = framed.len() - 1;
        framed[last] ^= 0x01;
        assert!(zstd_frame(&framed, Some(text.len())).is_err(), "checksum");
        assert!(zstd_frame(&framed, None).is_err(), "checksum, streamed");
        // Zero padding after the frame (an entry read to its padded end) is not a second frame.
        let mut padded = frame.to_vec();
        padded.extend_from_slice(&[0; 11]);
        assert_eq!(zstd_frame(&padded, Some(5)).unwrap(), b"hello");
        assert_eq!(zstd_frame(&padded, None).unwrap(), b"hello");
        // A frame declaring a 2^41-byte window is refused before anything that size is allocated.
        let huge_window = [0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xf8, 0x01, 0x00, 0x00];
        assert!(zstd_frame(&huge_window, Some(5)).is_err());
    }
}
