//! Cubins: the ELF files ptxas writes for one SM architecture.
//!
//! [`Cubin::parse`] reads everything a launcher needs from the ELF with the `object` crate and keeps owned copies,
//! so a [`Cubin`] outlives the bytes it came from:
//!
//! - the loadable image: every `SHF_ALLOC` `PROGBITS`/`NOBITS` section of global memory (kernel code, constant-bank
//!   templates, `__device__` and `__constant__` data) laid out in section order at its alignment;
//! - per kernel ([`KernelInfo`]): register count, parameter layout, stack and shared memory sizes, constant banks,
//!   from `.nv.info` (module-wide records keyed by symbol) and `.nv.info.<kernel>` (per-kernel records);
//! - the relocations that patch the image, resolved and checked at parse time so [`Cubin::link`] only does arithmetic.
//!
//! Shared (`.nv.shared.*`) and local (`.nv.local.*`) sections are allocated by the hardware per CTA / per thread, so
//! they are not part of the image; their sizes end up in [`KernelInfo::static_shared`]. Mercury sections of sm_100+
//! (`.nv.merc.*`, `.nv.capmerc.*`: input for the driver's finalizer) and debug sections are ignored.
//!
//! Everything read from the file is bounds-checked and uses checked arithmetic: bad input is a [`CubinError`],
//! never a panic.
//!
//! The code is split by concern: `error` ([`CubinError`]), `info` (what a parsed cubin describes: [`KernelInfo`],
//! [`GlobalSymbol`], [`ImageSection`], [`PlacedGlobal`]), `sections` (section and symbol headers, the image
//! layout and the variables in it), `nvinfo` (`.nv.info` records and the kernel descriptions read from them) and
//! `relocate` (relocations, read at parse time and applied at link time). This file holds [`Cubin`] itself:
//! parsing, lookups by name and linking.

mod error;
mod info;
mod nvinfo;
mod relocate;
mod sass;
mod sections;
#[cfg(test)]
mod tests;

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, SectionHeader, Sym as _};

pub use error::CubinError;
pub use info::{ConstBank, GlobalSymbol, ImageSection, KernelInfo, ParamInfo, PlacedGlobal};
pub use nvinfo::{eiattr, eifmt};
pub(crate) use relocate::apply_value;
pub use relocate::reloc;
pub use sections::CONST_BANK_ALIGN;

use error::corrupt;
use nvinfo::{SectionIndex, kernel_info, module_info};
use relocate::{Relocation, SymbolValue, apply, range_mut, relocations};
use sections::{LoadedSection, SectionMeta, SymbolMeta, global_symbols, layout};

use super::payload::Payload;

type Elf = elf::FileHeader64<LittleEndian>;

/// `e_machine` of CUDA ELFs.
pub const EM_CUDA: u16 = 190;
/// Section type of `.nv.info` and `.nv.info.<kernel>`.
pub const SHT_CUDA_INFO: u32 = 0x7000_0000;
/// `st_other` bit marking a kernel entry point (`__global__`), as opposed to a `__device__` function.
pub const STO_CUDA_ENTRY: u8 = 0x10;

/// A parsed cubin: kernels, the loadable image and its relocations. Shares the file it was parsed from (its
/// sections' bytes are read from there when linked), so it outlives the bytes it was given.
#[derive(Debug, Clone)]
pub struct Cubin {
    file: File,
    sm: u32,
    kernels: Vec<KernelInfo>,
    sections: Vec<LoadedSection>,
    /// Sorted by the section they patch (in file order within it).
    relocations: Vec<Relocation>,
    /// Per image section, the range of `relocations` that patch it.
    section_relocations: Vec<std::ops::Range<usize>>,
    image_size: u64,
    /// Undefined symbols that relocations refer to, sorted, each once.
    externals: Vec<String>,
    /// Module-scope variables in the image, in symbol table order.
    globals: Vec<GlobalSymbol>,
}

/// A cubin's file, shared by its clones; printed as its length.
#[derive(Clone)]
struct File(std::sync::Arc<Payload>);

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

/// The SM version in `e_flags`: bits 15:8 since ELF ABI version 8 (CUDA 12.8+), bits 7:0 before.
pub fn sm_from_e_flags(abi_version: u8, e_flags: u32) -> u32 {
    if abi_version >= 8 || e_flags >> 24 != 0 {
        (e_flags >> 8) & 0xff
    } else {
        e_flags & 0xff
    }
}

/// Whether SASS for `cubin_sm` runs on a `device_sm` GPU: same major version, device minor at least the cubin's.
pub fn sass_compatible(cubin_sm: u32, device_sm: u32) -> bool {
    cubin_sm / 10 == device_sm / 10 && cubin_sm <= device_sm
}

impl Cubin {
    /// Parses a cubin. Fails on anything that would make the image or the kernel descriptions wrong.
    pub fn parse(bytes: &[u8]) -> Result<Cubin, CubinError> {
        Cubin::parse_vec(bytes.to_vec()).map_err(|(e, _)| e)
    }

    /// As [`Cubin::parse`], keeping `bytes` without copying them (a fatbin payload just decompressed); on failure
    /// they come back with the error.
    pub fn parse_vec(bytes: Vec<u8>) -> Result<Cubin, (CubinError, Vec<u8>)> {
        Cubin::parse_payload(bytes.into()).map_err(|(e, back)| (e, back.into_vec()))
    }

    /// As [`Cubin::parse_vec`], keeping `bytes` as they are: a mapped module cache entry stays mapped, never copied
    /// into memory of the process's own.
    pub fn parse_payload(bytes: Payload) -> Result<Cubin, (CubinError, Payload)> {
        let file = std::sync::Arc::new(bytes);
        match Cubin::parse_file(&file) {
            Ok(cubin) => Ok(cubin),
            // Nothing else holds the file when parsing failed.
            Err(e) => Err((
                e,
                std::sync::Arc::try_unwrap(file)
                    .unwrap_or_else(|shared| Payload::from(shared.to_vec())),
            )),
        }
    }

    /// The ELF file the cubin was parsed from.
    pub fn bytes(&self) -> &[u8] {
        &self.file.0
    }

    /// The ELF file the cubin was parsed from, copied only if a clone of the cubin still shares it or it is mapped.
    pub fn into_bytes(self) -> Vec<u8> {
        std::sync::Arc::try_unwrap(self.file.0)
            .map_or_else(|shared| shared.to_vec(), Payload::into_vec)
    }

    fn parse_file(file: &std::sync::Arc<Payload>) -> Result<Cubin, CubinError> {
        let bytes: &[u8] = file;
        let header = Elf::parse(bytes).map_err(|e| CubinError::NotElf(e.to_string()))?;
        let endian = header
            .endian()
            .map_err(|e| CubinError::NotElf(e.to_string()))?;
        let machine = header.e_machine(endian).0;
        if machine != EM_CUDA {
            return Err(CubinError::NotCuda { machine });
        }
        let e_type = header.e_type(endian).0;
        if e_type != elf::ET_EXEC.0 {
            return Err(CubinError::NotExecutable { e_type });
        }
        let sm = sm_from_e_flags(header.e_ident().abi_version, header.e_flags(endian).0);
        if sm == 0 {
            return Err(corrupt("e_flags name no SM version"));
        }

        let table = header
            .sections(endian, bytes)
            .map_err(|e| corrupt(format!("section headers: {e}")))?;
        let mut metas = Vec::with_capacity(table.len());
        for (index, sh) in table.enumerate() {
            let name = table
                .section_name(endian, sh)
                .map_err(|e| corrupt(format!("section {}: name: {e}", index.0)))?;
            let name = borrowed_name(name);
            let data = sh
                .data(endian, bytes)
                .map_err(|e| corrupt(format!("section {name}: contents: {e}")))?;
            // Both lie in `bytes`: the section's place in the file (an empty section's slice may lie elsewhere).
            let file_offset = if data.is_empty() {
                0
            } else {
                (data.as_ptr() as usize).wrapping_sub(bytes.as_ptr() as usize)
            };
            metas.push(SectionMeta {
                file_offset,
                name,
                sh_type: sh.sh_type(endian).0,
                flags: sh.sh_flags(endian).0,
                size: sh.sh_size(endian),
                align: sh.sh_addralign(endian),
                link: sh.sh_link(endian),
                info: sh.sh_info(endian),
                data,
            });
        }

        let (sections, image_index, image_size) = layout(&metas)?;

        let symtab = table
            .symbols(endian, bytes, elf::SHT_SYMTAB)
            .map_err(|e| corrupt(format!("symbol table: {e}")))?;
        let mut symbols = Vec::with_capacity(symtab.len());
        for (index, sym) in symtab.enumerate() {
            let name = symtab
                .symbol_name(endian, sym)
                .map_err(|e| corrupt(format!("symbol {}: name: {e}", index.0)))?;
            let section = symtab
                .symbol_section(endian, sym, index)
                .map_err(|e| corrupt(format!("symbol {}: section: {e}", index.0)))?
                .map(|s| s.0);
            if section.is_some_and(|s| s >= metas.len()) {
                return Err(corrupt(format!(
                    "symbol {}: section index out of range",
                    index.0
                )));
            }
            symbols.push(SymbolMeta {
                name: borrowed_name(name),
                st_type: sym.st_type().0,
                local: sym.st_bind().0 == elf::STB_LOCAL.0,
                other: sym.st_other().0,
                section,
                absolute: sym.st_shndx(endian) == elf::SHN_ABS,
                value: sym.st_value(endian),
                size: sym.st_size(endian),
            });
        }
        let symtab_index = symtab.section().0;

        let module = module_info(&metas)?;
        let index = SectionIndex::new(&metas);
        let mut kernels = Vec::new();
        for (sym_index, sym) in symbols.iter().enumerate() {
            if let Some(mut kernel) = kernel_info(
                sym_index,
                sym,
                &metas,
                &index,
                &sections,
                &image_index,
                &module,
            )? {
                // EIATTR_EXTERNS gives symbol indices; keep the names.
                for name in kernel.externs.iter_mut() {
                    let index: usize = name.parse().unwrap_or(usize::MAX);
                    let sym = symbols.get(index).ok_or_else(|| {
                        corrupt(format!(
                            "kernel {}: EXTERNS symbol {index} out of range",
                            kernel.name
                        ))
                    })?;
                    *name = sym.name.to_string();
                }
                kernels.push(kernel);
            }
        }

        let mut relocations = relocations(
            &table,
            endian,
            bytes,
            &metas,
            &symbols,
            symtab_index,
            &sections,
            &image_index,
        )?;

        let section_relocations = group_relocations(&mut relocations, sections.len());

        let mut externals: Vec<String> = relocations
            .iter()
            .filter_map(|r| match &r.symbol {
                SymbolValue::External(name) => Some(name.clone()),
                _ => None,
            })
            .collect();
        externals.sort();
        externals.dedup();
        let globals = global_symbols(&symbols, &sections, &image_index)?;

        Ok(Cubin {
            file: File(file.clone()),
            sm,
            kernels,
            sections,
            relocations,
            section_relocations,
            image_size,
            externals,
            globals,
        })
    }

    /// SM version the SASS is for, e.g. 90.
    pub fn sm_version(&self) -> u32 {
        self.sm
    }

    /// [`CubinError::WrongArch`] unless the cubin's SASS runs on an `device_sm` GPU (see [`sass_compatible`]).
    pub fn check_arch(&self, device_sm: u32) -> Result<(), CubinError> {
        if sass_compatible(self.sm, device_sm) {
            Ok(())
        } else {
            Err(CubinError::WrongArch {
                cubin_sm: self.sm,
                device_sm,
            })
        }
    }

    /// Every kernel (`__global__` function), in symbol table order.
    pub fn kernels(&self) -> &[KernelInfo] {
        &self.kernels
    }

    /// The kernels, for the loader to adjust what linking changes (registers and stack of functions it adds).
    pub(crate) fn kernels_mut(&mut self) -> &mut [KernelInfo] {
        &mut self.kernels
    }

    /// The kernel named `name`: its symbol (the mangled name of a C++ kernel), or its demangled name with or
    /// without the parameter list (`scale_n<float, 256>(float*, float)`, `scale_n<float, 256>`,
    /// `ns::kernel`; spaces do not matter). A demangled name that fits several overloads is
    /// [`CubinError::AmbiguousKernel`].
    pub fn kernel(&self, name: &str) -> Result<&KernelInfo, CubinError> {
        self.kernel_index(name).map(|i| &self.kernels[i])
    }

    /// As [`Cubin::kernel`], the kernel's index in [`Cubin::kernels`]. A symbol is found without allocating (the
    /// queues look their built-in kernels up at every copy).
    pub(crate) fn kernel_index(&self, name: &str) -> Result<usize, CubinError> {
        if let Some(i) = self.kernels.iter().position(|k| k.name == name) {
            return Ok(i);
        }
        let want = without_spaces(name);
        let matches: Vec<usize> = (0..self.kernels.len())
            .filter(|&i| {
                demangled_forms(&self.kernels[i].name)
                    .iter()
                    .any(|f| without_spaces(f) == want)
            })
            .collect();
        match matches[..] {
            [i] => Ok(i),
            [] => Err(CubinError::NoSuchKernel(name.to_owned())),
            _ => Err(CubinError::AmbiguousKernel {
                name: name.to_owned(),
                candidates: matches
                    .iter()
                    .map(|&i| self.kernels[i].name.clone())
                    .collect(),
            }),
        }
    }

    /// Module-scope variables (`__device__`, `__constant__`) in the image, in symbol table order.
    pub fn globals(&self) -> &[GlobalSymbol] {
        &self.globals
    }

    /// The module-scope variable named `name`: its symbol, or, for a C++ variable in a namespace, its demangled
    /// name (`ns::table`; spaces do not matter) when exactly one variable has it.
    pub fn global(&self, name: &str) -> Option<&GlobalSymbol> {
        if let Some(g) = self.globals.iter().find(|g| g.name == name) {
            return Some(g);
        }
        let want = without_spaces(name);
        let mut matches = self.globals.iter().filter(|g| {
            demangled_forms(&g.name)
                .iter()
                .any(|f| without_spaces(f) == want)
        });
        match (matches.next(), matches.next()) {
            (Some(g), None) => Some(g),
            _ => None,
        }
    }

    /// Bytes of the loadable image.
    pub fn image_size(&self) -> u64 {
        self.image_size
    }

    /// The sections of the image, in image order.
    pub fn image_sections(&self) -> impl Iterator<Item = &ImageSection> {
        self.sections.iter().map(|s| &s.info)
    }

    /// Offset of the image section named `name` inside the image.
    pub fn section_offset(&self, name: &str) -> Option<u64> {
        self.sections
            .iter()
            .find(|s| s.info.name == name)
            .map(|s| s.info.image_offset)
    }

    /// External device functions the image refers to (undefined symbols of its relocations), sorted: what the
    /// CUDA driver links from its own device runtime (`vprintf`, `__assertfail`, `malloc`, ...).
    pub fn externals(&self) -> &[String] {
        &self.externals
    }

    /// Writes the image for loading at GPU virtual address `base_va` into `image[..image_size]`: section bytes,
    /// zeros for NOBITS sections and padding, then the relocations. Fails on a reference to an external symbol
    /// (see [`Cubin::link_with`]).
    pub fn link(&self, base_va: u64, image: &mut [u8]) -> Result<(), CubinError> {
        self.link_with(base_va, image, &|_| None)
    }

    /// As [`Cubin::link`], with `resolve` giving the GPU address of each external symbol
    /// ([`CubinError::UnresolvedSymbol`] where it gives none).
    pub fn link_with(
        &self,
        base_va: u64,
        image: &mut [u8],
        resolve: &dyn Fn(&str) -> Option<u64>,
    ) -> Result<(), CubinError> {
        self.link_placed(base_va, image, resolve, &[])
    }

    /// As [`Cubin::link_with`], with some of the module's variables living elsewhere: every reference into
    /// `placed[i]`'s image range (symbol plus addend, whichever symbol the relocation names) goes to the same offset
    /// at its address instead. Another instance of the same module (CUDA's, in an attached context) then shares its
    /// `__device__` variables with this one.
    pub fn link_placed(
        &self,
        base_va: u64,
        image: &mut [u8],
        resolve: &dyn Fn(&str) -> Option<u64>,
        placed: &[PlacedGlobal],
    ) -> Result<(), CubinError> {
        let need = self.image_size;
        let got = u64::try_from(image.len()).unwrap_or(u64::MAX);
        let too_small = CubinError::ImageTooSmall { need, got };
        let need_len = usize::try_from(need).map_err(|_| too_small.clone())?;
        let image = image.get_mut(..need_len).ok_or(too_small)?;
        image.fill(0);
        for section in &self.sections {
            if let Some(data) = self.section_bytes(section) {
                let dst = range_mut(image, section.info.image_offset, data.len())?;
                dst.copy_from_slice(data);
            }
        }
        for r in &self.relocations {
            apply(r, base_va, image, 0, resolve, placed)?;
        }
        Ok(())
    }

    /// A PROGBITS section's bytes (checked against the file at parse time); `None` for NOBITS.
    fn section_bytes(&self, section: &LoadedSection) -> Option<&[u8]> {
        section
            .data
            .clone()
            .and_then(|range| self.file.0.get(range))
    }

    /// How many sections the image has ([`Cubin::image_sections`]); the loader links them one by one.
    pub(crate) fn image_section_count(&self) -> usize {
        self.sections.len()
    }

    /// The first texture or surface instruction in kernel `kernel`'s code or in the code it may reach (the sections
    /// its relocations reach, through data too: a table of function pointers), as
    /// [`CubinError::TextureInstructions`]: such a kernel needs the texture header pool that only CUDA's channels
    /// bind.
    pub(crate) fn texture_use(&self, kernel: usize) -> Option<CubinError> {
        let (section, (kind, at)) =
            self.first_in_reach(kernel, |code| sass::texture_or_surface(code, self.sm))?;
        Some(CubinError::TextureInstructions {
            kernel: self.kernels.get(kernel)?.name.clone(),
            kind,
            section,
            offset: at as u64,
        })
    }

    /// The first trap instruction (`__trap()`, `asm("trap;")`) a thread of kernel `kernel` can reach, in its code or
    /// the code it may reach: the code section and the byte offset in it. A trap placed after a call that does not
    /// return (`__assertfail`'s) is not one. sm_90 code only; `None` for others.
    pub fn reachable_trap(&self, kernel: usize) -> Option<(String, u64)> {
        self.first_in_reach(kernel, |code| sass::reachable_trap(code, self.sm))
            .map(|(section, at)| (section, at as u64))
    }

    /// The byte offset of the first trap instruction in kernel `kernel`'s own code section (not in the functions it
    /// calls), as [`reachable_trap`](Self::reachable_trap) counts them.
    pub fn own_trap(&self, kernel: usize) -> Option<u64> {
        let s = self.sections.get(self.kernel_section(kernel)?)?;
        let code = self.section_bytes(s)?;
        sass::reachable_trap(code, self.sm).map(|at| at as u64)
    }

    /// What `find` first finds in kernel `kernel`'s code or in the code it may reach (the sections its relocations
    /// reach, through data too: a table of function pointers), with the name of the code section it was found in.
    fn first_in_reach<T>(
        &self,
        kernel: usize,
        find: impl Fn(&[u8]) -> Option<T>,
    ) -> Option<(String, T)> {
        let root = self.kernel_section(kernel)?;
        let mut seen = vec![false; self.sections.len()];
        let mut work = vec![root];
        while let Some(i) = work.pop() {
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            let s = &self.sections[i];
            if let Some(found) = self.section_bytes(s).filter(|_| s.code).and_then(&find) {
                return Some((s.info.name.clone(), found));
            }
            work.extend(self.section_refers_to(i).filter(|&j| !seen[j]));
        }
        None
    }

    /// Whether image section `section` holds machine code.
    pub(crate) fn section_is_code(&self, section: usize) -> bool {
        self.sections.get(section).is_some_and(|s| s.code)
    }

    /// The image section holding kernel `kernel`'s code (an index into [`Cubin::kernels`]).
    pub(crate) fn kernel_section(&self, kernel: usize) -> Option<usize> {
        let offset = self.kernels.get(kernel)?.code_offset;
        // Sections are laid out in ascending offsets; empty sections can share one.
        let i = self
            .sections
            .partition_point(|s| s.info.image_offset + s.info.size <= offset);
        self.sections
            .get(i)
            .filter(|s| s.info.image_offset <= offset && s.code)
            .map(|_| i)
    }

    /// The image sections that section `section`'s relocations refer to (with repeats): what must be in memory
    /// when its code runs or its data is used.
    pub(crate) fn section_refers_to(&self, section: usize) -> impl Iterator<Item = usize> + '_ {
        let range = self
            .section_relocations
            .get(section)
            .cloned()
            .unwrap_or(0..0);
        self.relocations[range].iter().filter_map(|r| r.refers_to)
    }

    /// Whether a relocation of image section `section` stores the address of code, or of a symbol outside the image
    /// (another instance of the module, relocated by another linker, holds other values there).
    pub(crate) fn section_stores_code_addresses(&self, section: usize) -> bool {
        let range = self
            .section_relocations
            .get(section)
            .cloned()
            .unwrap_or(0..0);
        self.relocations[range]
            .iter()
            .any(|r| r.refers_to.is_none_or(|t| self.section_is_code(t)))
    }

    /// Links image section `section` alone for an image at `base_va` into `out` (cleared first; resolved and
    /// placed as [`Cubin::link_placed`] does); returns its offset inside the image.
    pub(crate) fn link_section(
        &self,
        section: usize,
        base_va: u64,
        out: &mut Vec<u8>,
        resolve: &dyn Fn(&str) -> Option<u64>,
        placed: &[PlacedGlobal],
    ) -> Result<u64, CubinError> {
        let s = self
            .sections
            .get(section)
            .ok_or_else(|| corrupt(format!("image section {section} does not exist")))?;
        let len = usize::try_from(s.info.size).map_err(|_| corrupt("section size overflows"))?;
        out.clear();
        match self.section_bytes(s) {
            Some(data) => out.extend_from_slice(data),
            None => out.resize(len, 0),
        }
        let range = self
            .section_relocations
            .get(section)
            .cloned()
            .unwrap_or(0..0);
        for r in &self.relocations[range] {
            apply(r, base_va, out, s.info.image_offset, resolve, placed)?;
        }
        Ok(s.info.image_offset)
    }
}

/// Sorts `relocations` by the section they patch (stable: two relocations of one field apply in file order) and
/// returns, per image section, the range of them that patch it.
fn group_relocations(
    relocations: &mut [Relocation],
    sections: usize,
) -> Vec<std::ops::Range<usize>> {
    relocations.sort_by_key(|r| r.section);
    let mut ranges = vec![0..0; sections];
    let mut start = 0;
    while start < relocations.len() {
        let section = relocations[start].section;
        let end = start
            + relocations[start..]
                .iter()
                .take_while(|r| r.section == section)
                .count();
        if let Some(range) = ranges.get_mut(section) {
            *range = start..end;
        }
        start = end;
    }
    ranges
}

/// A test relocation: patched section, offset in it, the section and offset (or external) whose address it writes.
#[cfg(test)]
type SyntheticRelocation<'a> = (usize, u64, std::result::Result<(usize, u64), &'a str>);

#[cfg(test)]
impl Cubin {
    /// A cubin put together by a test, for the loader: `sections` (name, machine code, bytes) laid out back to back
    /// at 256 bytes; `relocations` (patched section, offset in it, the 64-bit address of a section's offset or of an
    /// external); `kernels`, each placed at the start of its section.
    pub(crate) fn synthetic(
        sections: &[(&str, bool, Vec<u8>)],
        relocations: &[SyntheticRelocation<'_>],
        kernels: Vec<(KernelInfo, usize)>,
    ) -> Cubin {
        let mut file = Vec::new();
        let mut loaded = Vec::new();
        let mut cursor = 0u64;
        for (name, code, bytes) in sections {
            let offset = cursor.next_multiple_of(256);
            cursor = offset + bytes.len() as u64;
            loaded.push(LoadedSection {
                info: ImageSection {
                    name: (*name).to_owned(),
                    image_offset: offset,
                    size: bytes.len() as u64,
                    nobits: false,
                },
                code: *code,
                data: Some(file.len()..file.len() + bytes.len()),
            });
            file.extend_from_slice(bytes);
        }
        let mut relocs: Vec<Relocation> = relocations
            .iter()
            .map(|(section, at, to)| {
                let (symbol, refers_to) = match to {
                    Ok((s, off)) => (
                        relocate::SymbolValue::Image(loaded[*s].info.image_offset + off),
                        Some(*s),
                    ),
                    Err(name) => (relocate::SymbolValue::External((*name).to_owned()), None),
                };
                Relocation {
                    kind: reloc::R_CUDA_64,
                    offset: loaded[*section].info.image_offset + at,
                    symbol,
                    addend: 0,
                    target: relocate::Target::Named,
                    section: *section,
                    refers_to,
                }
            })
            .collect();
        let section_relocations = group_relocations(&mut relocs, loaded.len());
        let kernels = kernels
            .into_iter()
            .map(|(mut k, s)| {
                k.code_offset = loaded[s].info.image_offset;
                k.code_size = loaded[s].info.size;
                k
            })
            .collect();
        Cubin {
            file: File(std::sync::Arc::new(file.into())),
            sm: 90,
            kernels,
            sections: loaded,
            relocations: relocs,
            section_relocations,
            image_size: cursor,
            externals: Vec::new(),
            globals: Vec::new(),
        }
    }
}

/// A section or symbol name, borrowed from the file: names are valid UTF-8 (ASCII) in practice, and a PyTorch cubin
/// has tens of thousands of them, most never kept (only kernels', variables' and externals' are); `from_utf8` checks
/// that several times quicker than the lossy conversion's walk, which only an invalid name takes.
fn borrowed_name(name: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(name) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(name),
    }
}

#[cfg(test)]
impl Cubin {
    /// The cubin with `globals` as its module variables (a test's).
    pub(crate) fn with_globals(mut self, globals: Vec<GlobalSymbol>) -> Cubin {
        self.globals = globals;
        self
    }
}

fn without_spaces(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// The names a C++ kernel symbol answers to besides itself: the full demangled signature and the qualified name
/// without parameters (and without the return type templates carry). Empty for names that are not mangled.
pub fn demangled_forms(symbol: &str) -> Vec<String> {
    let Ok(sym) = cpp_demangle::Symbol::new(symbol) else {
        return Vec::new();
    };
    let Ok(full) = sym.demangle() else {
        return Vec::new();
    };
    // The parameter list starts at the first '(' outside template arguments.
    let mut depth = 0i32;
    let mut name_end = full.len();
    let mut name_start = 0;
    for (i, c) in full.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            '(' if depth == 0 => {
                name_end = i;
                break;
            }
            // A return type before the name (function templates): the name starts after it.
            ' ' if depth == 0 => name_start = i + 1,
            _ => {}
        }
    }
    let name = full[name_start..name_end].to_owned();
    vec![full, name]
}
