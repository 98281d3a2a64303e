//! The ELF's section and symbol headers as the parser reads them, the layout of the loadable image, and the
//! module variables in it.

use object::elf;

use super::error::{CubinError, corrupt};
use super::info::{GlobalSymbol, ImageSection};

#[derive(Debug, Clone)]
pub(super) struct LoadedSection {
    pub(super) info: ImageSection,
    /// Machine code (`SHF_EXECINSTR`): uploaded when a kernel needing it is first looked up.
    pub(super) code: bool,
    /// Where the section's bytes are in the cubin's file; `None` for NOBITS.
    pub(super) data: Option<std::ops::Range<usize>>,
}

/// The fields of a section header this module uses, read once.
pub(super) struct SectionMeta<'data> {
    /// Borrowed from the file where it is valid UTF-8 (always, in practice).
    pub(super) name: std::borrow::Cow<'data, str>,
    pub(super) sh_type: u32,
    pub(super) flags: u64,
    pub(super) size: u64,
    pub(super) align: u64,
    pub(super) link: u32,
    pub(super) info: u32,
    /// File bytes; empty for NOBITS.
    pub(super) data: &'data [u8],
    /// Where `data` starts in the file.
    pub(super) file_offset: usize,
}

pub(super) struct SymbolMeta<'data> {
    /// Borrowed from the file where it is valid UTF-8 (always, in practice).
    pub(super) name: std::borrow::Cow<'data, str>,
    pub(super) st_type: u8,
    /// `STB_LOCAL` binding.
    pub(super) local: bool,
    pub(super) other: u8,
    /// Section index, `None` for undefined or special (`SHN_ABS`, `SHN_COMMON`) symbols.
    pub(super) section: Option<usize>,
    pub(super) absolute: bool,
    pub(super) value: u64,
    /// `st_size`.
    pub(super) size: u64,
}

/// Alignment of constant-bank sections in the image. The hardware takes bank addresses in 64-byte units
/// (`CONSTANT_BUFFER_ADDR_*_SHIFTED6`); 256 is what CUDA guarantees for constant banks.
pub const CONST_BANK_ALIGN: u64 = 256;

/// Whether a section belongs to the global-memory image.
fn in_image(meta: &SectionMeta) -> bool {
    let alloc = meta.flags & elf::SHF_ALLOC.0 != 0;
    let loadable = meta.sh_type == elf::SHT_PROGBITS.0 || meta.sh_type == elf::SHT_NOBITS.0;
    // Shared and local memory are per-CTA / per-thread windows, not global memory; mercury sections are
    // finalizer input.
    let other_space = [".nv.shared.", ".nv.local.", ".nv.merc.", ".nv.capmerc."]
        .iter()
        .any(|p| meta.name.starts_with(p));
    alloc && loadable && !other_space
}

type Layout = (Vec<LoadedSection>, Vec<Option<usize>>, u64);

/// Lays the image sections out in section order; returns them, a map from section index to image section, and
/// the image size.
pub(super) fn layout(metas: &[SectionMeta]) -> Result<Layout, CubinError> {
    let mut sections = Vec::new();
    let mut index = vec![None; metas.len()];
    let mut cursor: u64 = 0;
    for (i, meta) in metas.iter().enumerate() {
        if !in_image(meta) {
            continue;
        }
        let align = meta.align.max(1);
        if !align.is_power_of_two() {
            return Err(corrupt(format!(
                "section {}: alignment {align} is not a power of two",
                meta.name
            )));
        }
        // A constant bank is bound by an address the QMD stores shifted right by 6: a bank placed at the
        // section's own (4- or 8-byte) alignment would be read from the 64-byte boundary below it.
        let align = if meta.name.starts_with(".nv.constant") {
            align.max(CONST_BANK_ALIGN)
        } else {
            align
        };
        let offset = cursor
            .checked_next_multiple_of(align)
            .ok_or_else(|| corrupt(format!("section {}: image offset overflows", meta.name)))?;
        cursor = offset
            .checked_add(meta.size)
            .ok_or_else(|| corrupt(format!("section {}: size overflows", meta.name)))?;
        let nobits = meta.sh_type == elf::SHT_NOBITS.0;
        let data = if nobits {
            None
        } else {
            if u64::try_from(meta.data.len()).ok() != Some(meta.size) {
                return Err(corrupt(format!(
                    "section {}: contents outside the file",
                    meta.name
                )));
            }
            Some(meta.file_offset..meta.file_offset + meta.data.len())
        };
        if let Some(slot) = index.get_mut(i) {
            *slot = Some(sections.len());
        }
        sections.push(LoadedSection {
            info: ImageSection {
                name: meta.name.to_string(),
                image_offset: offset,
                size: meta.size,
                nobits,
            },
            code: meta.flags & elf::SHF_EXECINSTR.0 != 0,
            data,
        });
    }
    Ok((sections, index, cursor))
}

/// The `STT_OBJECT` symbols that lie in image sections: the module's variables. A symbol reaching past its
/// section's end is a corrupt cubin.
pub(super) fn global_symbols(
    symbols: &[SymbolMeta],
    sections: &[LoadedSection],
    image_index: &[Option<usize>],
) -> Result<Vec<GlobalSymbol>, CubinError> {
    let mut out = Vec::new();
    for sym in symbols {
        if sym.st_type != elf::STT_OBJECT.0 || sym.name.is_empty() || sym.absolute {
            continue;
        }
        let Some(section) = sym
            .section
            .and_then(|i| image_index.get(i).copied().flatten())
            .and_then(|i| sections.get(i))
        else {
            continue; // shared or local memory, or undefined: not a global in the image
        };
        let end = sym.value.checked_add(sym.size);
        if end.is_none_or(|e| e > section.info.size) {
            return Err(corrupt(format!(
                "variable {}: {:#x}+{:#x} runs past the end of {} ({:#x} bytes)",
                sym.name, sym.value, sym.size, section.info.name, section.info.size
            )));
        }
        out.push(GlobalSymbol {
            name: sym.name.to_string(),
            image_offset: section.info.image_offset + sym.value,
            size: sym.size,
            section: section.info.name.clone(),
            local: sym.local,
        });
    }
    Ok(out)
}
