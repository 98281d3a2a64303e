//! Relocations: read from the cubin's REL and RELA sections and checked at parse time, applied when the image is
//! linked.

use object::LittleEndian;
use object::elf;
use object::read::elf::{Rel as _, Rela as _, SectionHeader};

use super::Elf;
use super::error::{CubinError, corrupt};
use super::info::PlacedGlobal;
use super::nvinfo::{u32_at, u64_at};
use super::sections::{LoadedSection, SectionMeta, SymbolMeta};

/// Relocation types (`R_CUDA_*`) that [`Cubin::link`](super::Cubin::link) applies.
pub mod reloc {
    /// Nothing to do.
    pub const R_CUDA_NONE: u32 = 0;
    /// `u32` at the offset: the address (must fit in 32 bits).
    pub const R_CUDA_32: u32 = 1;
    /// `u64` at the offset: the address.
    pub const R_CUDA_64: u32 = 2;
    /// `u64` at the offset: a generic-space address (same value as [`R_CUDA_64`] for global memory).
    pub const R_CUDA_G64: u32 = 4;
    /// The 32-bit immediate of a 128-bit instruction (bits 32..64, byte offset + 4): the address (must fit).
    pub const R_CUDA_ABS32_32: u32 = 55;
    /// The 32-bit immediate of a 128-bit instruction: the low half of the address (`32@lo(sym)`).
    pub const R_CUDA_ABS32_LO_32: u32 = 56;
    /// The 32-bit immediate of a 128-bit instruction: the high half of the address (`32@hi(sym)`).
    pub const R_CUDA_ABS32_HI_32: u32 = 57;
    /// `u32` at the offset becomes zero.
    pub const R_CUDA_UNUSED_CLEAR32: u32 = 72;
    /// `u64` at the offset becomes zero.
    pub const R_CUDA_UNUSED_CLEAR64: u32 = 73;
    /// An absolute code address in a 128-bit instruction (`CALL.ABS` in `nvcc -G` code): address bits 2..10 in
    /// instruction bits 16..24, bits 10..57 in instruction bits 34..81; the address must be 4-byte aligned.
    /// Encoding found by flipping each bit of such an instruction under `nvdisasm` (CUDA 13.0).
    pub const R_CUDA_ABS55_16_34: u32 = 75;
}

/// Where a relocation's symbol is.
#[derive(Debug, Clone)]
pub(super) enum SymbolValue {
    /// This offset inside the image: the address is `base_va + offset`.
    Image(u64),
    /// An absolute value (`SHN_ABS`, or no symbol).
    Absolute(u64),
    /// An undefined symbol the loader provides (the driver's device runtime: `vprintf`, `__assertfail`).
    External(String),
}

#[derive(Debug, Clone)]
pub(super) struct Relocation {
    pub(super) kind: u32,
    /// Image offset of the patched bytes (the instruction's start for instruction relocations).
    pub(super) offset: u64,
    pub(super) symbol: SymbolValue,
    pub(super) addend: i64,
    /// What the symbol names: a section (references go anywhere in it, by the addend) or one object.
    pub(super) target: Target,
    /// The image section (index into the cubin's image sections) the patched bytes are in.
    pub(super) section: usize,
    /// The image section the symbol lies in, for a symbol in the image: code a section refers to must be in
    /// memory before it runs.
    pub(super) refers_to: Option<usize>,
}

/// The kind of symbol a relocation names, for placing variables elsewhere
/// ([`Cubin::link_placed`](super::Cubin::link_placed)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// A section symbol: the variable is where symbol plus addend lands.
    Section,
    /// A named symbol: the variable is the symbol's, whatever the addend (`arr + n` is still `arr`'s).
    Named,
    /// A section symbol in a REL entry whose addend is not in the patched field (the high half of a split
    /// address): where it lands is unknown, so placing a variable is refused.
    SectionNoAddend,
}

/// Bytes a relocation patches, counted from its offset.
fn reloc_width(kind: u32) -> Option<u64> {
    match kind {
        reloc::R_CUDA_NONE => Some(0),
        reloc::R_CUDA_32 | reloc::R_CUDA_UNUSED_CLEAR32 => Some(4),
        reloc::R_CUDA_64 | reloc::R_CUDA_G64 | reloc::R_CUDA_UNUSED_CLEAR64 => Some(8),
        // The 32-bit immediate sits in bytes 4..8 of the 16-byte instruction.
        reloc::R_CUDA_ABS32_32 | reloc::R_CUDA_ABS32_LO_32 | reloc::R_CUDA_ABS32_HI_32 => Some(8),
        reloc::R_CUDA_ABS55_16_34 => Some(16),
        _ => None,
    }
}

/// The implicit addend of a REL entry: what the patched field holds before linking.
fn implicit_addend(kind: u32, field: &[u8]) -> i64 {
    let value = match kind {
        reloc::R_CUDA_32 => u32_at(field, 0).map(u64::from),
        reloc::R_CUDA_64 | reloc::R_CUDA_G64 => u64_at(field, 0),
        reloc::R_CUDA_ABS32_32 | reloc::R_CUDA_ABS32_LO_32 => u32_at(field, 4).map(u64::from),
        reloc::R_CUDA_ABS55_16_34 => field
            .get(..16)
            .and_then(|b| <[u8; 16]>::try_from(b).ok())
            .map(|b| abs55_decode(u128::from_le_bytes(b))),
        _ => None,
    };
    value.map_or(0, |v| v as i64)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn relocations(
    table: &object::read::elf::SectionTable<Elf>,
    endian: LittleEndian,
    bytes: &[u8],
    metas: &[SectionMeta],
    symbols: &[SymbolMeta],
    symtab_index: usize,
    sections: &[LoadedSection],
    image_index: &[Option<usize>],
) -> Result<Vec<Relocation>, CubinError> {
    let mut out = Vec::new();
    for (index, sh) in table.enumerate() {
        let Some(meta) = metas.get(index.0) else {
            continue;
        };
        // (offset, info type, symbol, explicit addend)
        let entries: Vec<(u64, u32, u32, Option<i64>)> = if let Some((rela, _)) = sh
            .rela(endian, bytes)
            .map_err(|e| corrupt(format!("{}: {e}", meta.name)))?
        {
            rela.iter()
                .map(|r| {
                    (
                        r.r_offset(endian),
                        r.r_type(endian, false).0,
                        r.r_sym(endian, false),
                        Some(r.r_addend(endian)),
                    )
                })
                .collect()
        } else if let Some((rel, _)) = sh
            .rel(endian, bytes)
            .map_err(|e| corrupt(format!("{}: {e}", meta.name)))?
        {
            rel.iter()
                .map(|r| {
                    (
                        r.r_offset(endian),
                        r.r_type(endian).0,
                        r.r_sym(endian),
                        None,
                    )
                })
                .collect()
        } else {
            continue;
        };
        // Relocations of sections outside the image (debug info) are for tools, not for the loader.
        let target = usize::try_from(meta.info).ok();
        let Some((image_at, image)) = target
            .and_then(|t| image_index.get(t).copied().flatten())
            .and_then(|i| Some((i, sections.get(i)?)))
        else {
            continue;
        };
        if entries.is_empty() {
            continue;
        }
        if usize::try_from(meta.link).ok() != Some(symtab_index) {
            return Err(corrupt(format!(
                "{}: not linked to the symbol table",
                meta.name
            )));
        }
        for (offset, kind, sym, addend) in entries {
            let width = reloc_width(kind).ok_or_else(|| CubinError::UnknownRelocation {
                kind,
                section: meta.name.to_string(),
            })?;
            if kind == reloc::R_CUDA_NONE {
                continue;
            }
            let end = offset.checked_add(width);
            let Some(data) = image
                .data
                .clone()
                .and_then(|range| bytes.get(range))
                .filter(|_| end.is_some_and(|e| e <= image.info.size))
            else {
                return Err(corrupt(format!(
                    "{}: relocation at {offset:#x} is outside {} or patches a NOBITS section",
                    meta.name, image.info.name
                )));
            };
            let field = usize::try_from(offset)
                .ok()
                .and_then(|o| data.get(o..))
                .unwrap_or_default();
            let section_symbol = usize::try_from(sym)
                .ok()
                .and_then(|i| symbols.get(i))
                .is_some_and(|s| s.st_type == elf::STT_SECTION.0);
            let target = match (section_symbol, addend.is_none(), kind) {
                (false, _, _) => Target::Named,
                (true, true, reloc::R_CUDA_ABS32_HI_32) => Target::SectionNoAddend,
                (true, _, _) => Target::Section,
            };
            let addend = addend.unwrap_or_else(|| implicit_addend(kind, field));
            let (symbol, refers_to) =
                symbol_value(sym, symbols, sections, image_index, &meta.name)?;
            let offset =
                image.info.image_offset.checked_add(offset).ok_or_else(|| {
                    corrupt(format!("{}: relocation offset overflows", meta.name))
                })?;
            out.push(Relocation {
                kind,
                offset,
                symbol,
                addend,
                target,
                section: image_at,
                refers_to,
            });
        }
    }
    Ok(out)
}

/// Where relocation symbol `sym` is, and the image section it lies in.
fn symbol_value(
    sym: u32,
    symbols: &[SymbolMeta],
    sections: &[LoadedSection],
    image_index: &[Option<usize>],
    section: &str,
) -> Result<(SymbolValue, Option<usize>), CubinError> {
    if sym == 0 {
        return Ok((SymbolValue::Absolute(0), None));
    }
    let s = usize::try_from(sym)
        .ok()
        .and_then(|i| symbols.get(i))
        .ok_or_else(|| corrupt(format!("{section}: relocation symbol {sym} out of range")))?;
    if s.absolute {
        return Ok((SymbolValue::Absolute(s.value), None));
    }
    if s.section.is_none() && !s.name.is_empty() {
        return Ok((SymbolValue::External(s.name.to_string()), None));
    }
    let (at, base) = s
        .section
        .and_then(|i| image_index.get(i).copied().flatten())
        .and_then(|i| Some((i, sections.get(i)?)))
        .ok_or_else(|| CubinError::UnresolvedSymbol {
            symbol: s.name.to_string(),
            section: section.to_owned(),
        })?;
    // Executable cubins give symbol values relative to their section.
    base.info
        .image_offset
        .checked_add(s.value)
        .map(|offset| (SymbolValue::Image(offset), Some(at)))
        .ok_or_else(|| corrupt(format!("{section}: symbol {} value overflows", s.name)))
}

pub(super) const ABS55_LO_MASK: u128 = 0xff << 16;
pub(super) const ABS55_HI_MASK: u128 = ((1u128 << 47) - 1) << 34;

/// Puts `address` into the R_CUDA_ABS55_16_34 fields of a 128-bit instruction.
pub(super) fn abs55_encode(insn: u128, address: u64) -> u128 {
    let a = u128::from(address);
    (insn & !(ABS55_LO_MASK | ABS55_HI_MASK))
        | (((a >> 2) & 0xff) << 16)
        | (((a >> 10) & ((1 << 47) - 1)) << 34)
}

/// The address in the R_CUDA_ABS55_16_34 fields of a 128-bit instruction.
pub(super) fn abs55_decode(insn: u128) -> u64 {
    ((((insn & ABS55_LO_MASK) >> 16) << 2) | (((insn & ABS55_HI_MASK) >> 34) << 10)) as u64
}

pub(super) fn range_mut(
    image: &mut [u8],
    offset: u64,
    len: usize,
) -> Result<&mut [u8], CubinError> {
    let start = usize::try_from(offset).map_err(|_| corrupt("image offset overflows"))?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| corrupt("image offset overflows"))?;
    image
        .get_mut(start..end)
        .ok_or_else(|| corrupt("patch outside the image"))
}

/// Applies `r` to `image`, which holds the image from offset `origin` on (0: the whole image; a section's
/// offset: that section alone).
pub(super) fn apply(
    r: &Relocation,
    base_va: u64,
    image: &mut [u8],
    origin: u64,
    resolve: &dyn Fn(&str) -> Option<u64>,
    placed: &[PlacedGlobal],
) -> Result<(), CubinError> {
    let overflow = |value: u64| CubinError::RelocationOverflow {
        kind: r.kind,
        offset: r.offset,
        value,
    };
    let symbol = match &r.symbol {
        SymbolValue::Image(offset) => base_va
            .checked_add(*offset)
            .ok_or_else(|| overflow(*offset))?,
        SymbolValue::Absolute(v) => *v,
        SymbolValue::External(name) => {
            resolve(name).ok_or_else(|| CubinError::UnresolvedSymbol {
                symbol: name.clone(),
                section: "(image)".into(),
            })?
        }
    };
    let mut value = symbol
        .checked_add_signed(r.addend)
        .ok_or_else(|| overflow(symbol))?;
    if let (SymbolValue::Image(sym), false) = (&r.symbol, placed.is_empty()) {
        let inside = |at: u64| {
            placed
                .iter()
                .find(|p| at >= p.image_offset && at - p.image_offset < p.size)
        };
        match r.target {
            // `var + n` and `var - n` are `var`'s, even past its end.
            Target::Named => {
                if let Some(p) = inside(*sym) {
                    value = (p.address + (sym - p.image_offset))
                        .checked_add_signed(r.addend)
                        .ok_or_else(|| overflow(p.address))?;
                }
            }
            Target::Section => {
                if let Some(p) = inside(value.wrapping_sub(base_va)) {
                    value = p.address + (value - base_va - p.image_offset);
                }
            }
            Target::SectionNoAddend => {
                return Err(corrupt(format!(
                    "a split address at image offset {:#x} names a section without its addend: cannot tell \
                     whether it refers to a variable placed elsewhere",
                    r.offset
                )));
            }
        }
    }
    let at = r
        .offset
        .checked_sub(origin)
        .ok_or_else(|| corrupt("a relocation before the bytes being linked"))?;
    apply_value(r.kind, at, value, image)
}

/// Writes `value` (symbol address plus addend) into `image` as relocation type `kind` at `offset` prescribes.
pub(crate) fn apply_value(
    kind: u32,
    offset: u64,
    value: u64,
    image: &mut [u8],
) -> Result<(), CubinError> {
    let overflow = |value: u64| CubinError::RelocationOverflow {
        kind,
        offset,
        value,
    };
    let r = Relocation {
        kind,
        offset,
        symbol: SymbolValue::Absolute(value),
        addend: 0,
        target: Target::Named,
        section: 0,
        refers_to: None,
    };
    let fit32 = |v: u64| u32::try_from(v).map_err(|_| overflow(v));
    match r.kind {
        reloc::R_CUDA_32 => {
            range_mut(image, r.offset, 4)?.copy_from_slice(&fit32(value)?.to_le_bytes())
        }
        reloc::R_CUDA_64 | reloc::R_CUDA_G64 => {
            range_mut(image, r.offset, 8)?.copy_from_slice(&value.to_le_bytes())
        }
        reloc::R_CUDA_ABS32_32 | reloc::R_CUDA_ABS32_LO_32 | reloc::R_CUDA_ABS32_HI_32 => {
            let imm = match r.kind {
                reloc::R_CUDA_ABS32_32 => fit32(value)?,
                reloc::R_CUDA_ABS32_LO_32 => value as u32, // the low half by definition
                _ => (value >> 32) as u32,
            };
            let at = r.offset.checked_add(4).ok_or_else(|| overflow(value))?;
            range_mut(image, at, 4)?.copy_from_slice(&imm.to_le_bytes());
        }
        reloc::R_CUDA_ABS55_16_34 => {
            if !value.is_multiple_of(4) || value >> 57 != 0 {
                return Err(overflow(value));
            }
            let insn = range_mut(image, r.offset, 16)?;
            let mut bits = u128::from_le_bytes(insn.try_into().map_err(|_| overflow(value))?);
            bits = abs55_encode(bits, value);
            insn.copy_from_slice(&bits.to_le_bytes());
        }
        reloc::R_CUDA_UNUSED_CLEAR32 => range_mut(image, r.offset, 4)?.fill(0),
        reloc::R_CUDA_UNUSED_CLEAR64 => range_mut(image, r.offset, 8)?.fill(0),
        kind => {
            return Err(CubinError::UnknownRelocation {
                kind,
                section: "(image)".into(),
            });
        }
    }
    Ok(())
}
