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

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, Rel as _, Rela as _, SectionHeader, Sym as _};

type Elf = elf::FileHeader64<LittleEndian>;

/// `e_machine` of CUDA ELFs.
pub const EM_CUDA: u16 = 190;
/// Section type of `.nv.info` and `.nv.info.<kernel>`.
pub const SHT_CUDA_INFO: u32 = 0x7000_0000;
/// `st_other` bit marking a kernel entry point (`__global__`), as opposed to a `__device__` function.
pub const STO_CUDA_ENTRY: u8 = 0x10;

/// `.nv.info` record formats: the first byte of every record.
pub mod eifmt {
    /// No value (the record is still 4 bytes: the u16 after the attribute is padding).
    pub const NVAL: u8 = 0x01;
    /// One byte of value, then a padding byte.
    pub const BVAL: u8 = 0x02;
    /// A u16 value.
    pub const HVAL: u8 = 0x03;
    /// A u16 size, then that many bytes.
    pub const SVAL: u8 = 0x04;
}

/// `.nv.info` attribute codes this module reads (names as cuobjdump prints them; codes checked against the
/// fixtures' `cuobjdump -elf` output where they occur there).
pub mod eiattr {
    /// `u32 x, y, z` from `__launch_bounds__` / `.maxntid`.
    pub const MAX_THREADS: u8 = 0x05;
    /// `u32 symbol, u16 offset, u16 size`: where the parameters live in constant bank 0.
    pub const PARAM_CBANK: u8 = 0x0a;
    /// `u32 x, y, z` from `.reqntid`.
    pub const REQNTID: u8 = 0x10;
    /// Module-wide `u32 symbol, u32 bytes`: the function's frame size.
    pub const FRAME_SIZE: u8 = 0x11;
    /// Module-wide `u32 symbol, u32 bytes`: the per-thread stack the function needs.
    pub const MIN_STACK_SIZE: u8 = 0x12;
    /// `u32 index, u16 ordinal, u16 offset, u32 flags` (size in flags bits 31:18).
    pub const KPARAM_INFO: u8 = 0x17;
    /// `u16`: bytes of parameters.
    pub const CBANK_PARAM_SIZE: u8 = 0x19;
    /// `u16`: the `-maxrregcount` limit (0xff: none).
    pub const MAXREG_COUNT: u8 = 0x1b;
    /// `u32` list: code offsets of the EXIT instructions.
    pub const EXIT_INSTR_OFFSETS: u8 = 0x1c;
    /// `u32` list: code offsets of the S2R SR_CTAID instructions.
    pub const S2RCTAID_INSTR_OFFSETS: u8 = 0x1d;
    /// `u32`: call/return stack bytes.
    pub const CRS_STACK_SIZE: u8 = 0x1e;
    /// Module-wide `u32 symbol, u32 bytes`: the stack with recursion bounded.
    pub const MAX_STACK_SIZE: u8 = 0x23;
    /// Module-wide `u32 symbol, u32 count`: registers per thread.
    pub const REGCOUNT: u8 = 0x2f;
    /// `u32 x, y, z`: `__cluster_dims__` / `.reqnctapercluster` (kernels/conformance/cluster.sm_90.cubin: an SVAL
    /// of 12 bytes, `02 00 00 00 01 00 00 00 01 00 00 00` for `__cluster_dims__(2, 1, 1)`).
    pub const CTA_PER_CLUSTER: u8 = 0x3d;
    /// No value: `.explicitcluster`, the kernel must be launched with a cluster shape (set with
    /// `__cluster_dims__` too).
    pub const EXPLICIT_CLUSTER: u8 = 0x3e;
    /// `u8`: named barriers the kernel uses (`bar.sync` ids).
    pub const NUM_BARRIERS: u8 = 0x4c;
    /// `u32` list: symbol indices of the external functions the kernel calls (`vprintf`, `__assertfail`, `malloc`).
    pub const EXTERNS: u8 = 0x0f;
}

/// Relocation types (`R_CUDA_*`) that [`Cubin::link`] applies.
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

/// Why a cubin could not be read or linked.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum CubinError {
    /// The bytes are not a 64-bit little-endian ELF file.
    #[error(
        "not a cubin: not a 64-bit little-endian ELF file ({0}); pass a cubin (nvcc -cubin), a fatbin or PTX"
    )]
    NotElf(String),
    /// An ELF file for another machine than EM_CUDA.
    #[error(
        "not a cubin: the ELF machine is {machine}, not EM_CUDA ({EM_CUDA}); pass a file built by nvcc for the GPU"
    )]
    NotCuda {
        /// The ELF `e_machine`.
        machine: u16,
    },
    /// Relocatable device code, which must be linked first.
    #[error(
        "cubin is not executable (e_type {e_type}): relocatable device code (nvcc -rdc / -dc) must go through nvlink first"
    )]
    NotExecutable {
        /// The ELF `e_type`.
        e_type: u16,
    },
    /// The cubin's structure is malformed.
    #[error("corrupt cubin: {what}; rebuild it with nvcc")]
    Corrupt {
        /// What is wrong, and where.
        what: String,
    },
    /// The cubin's SASS is for an architecture the device cannot run.
    #[error(
        "cubin is built for sm_{cubin_sm}, which cannot run on an sm_{device_sm} device; rebuild it with \
         -arch=sm_{device_sm} (or ship a fatbin with PTX)"
    )]
    WrongArch {
        /// The cubin's SM version.
        cubin_sm: u32,
        /// The device's SM version.
        device_sm: u32,
    },
    /// A relocation type APEX does not apply.
    #[error(
        "relocation type {kind} in section {section} is not supported by the direct path; load the module on the \
         CUDA driver backend (APEX_BACKEND=driver)"
    )]
    UnknownRelocation {
        /// The relocation type.
        kind: u32,
        /// The section it is in.
        section: String,
    },
    /// A relocation names a symbol the image does not hold.
    #[error(
        "relocation in section {section} refers to symbol {symbol:?}, which is not in the loadable image (undefined or in a non-global memory); link the missing code with nvlink"
    )]
    UnresolvedSymbol {
        /// The symbol.
        symbol: String,
        /// The section the relocation is in.
        section: String,
    },
    /// A relocated value does not fit its field.
    #[error(
        "relocation type {kind} at image offset {offset:#x}: value {value:#x} does not fit; the cubin is corrupt or \
         built for another memory model"
    )]
    RelocationOverflow {
        /// The relocation type.
        kind: u32,
        /// Where in the image.
        offset: u64,
        /// The value that does not fit.
        value: u64,
    },
    /// No kernel of that name.
    #[error("no kernel named {0:?} in the cubin; `cuobjdump -elf` lists the kernels it holds")]
    NoSuchKernel(String),
    /// The buffer given for the loaded image is too small.
    #[error(
        "image buffer holds {got} bytes, the image needs {need}; allocate at least {need} bytes"
    )]
    ImageTooSmall {
        /// Bytes the image needs.
        need: u64,
        /// Bytes the buffer holds.
        got: u64,
    },
    /// The module calls a device function the direct path does not provide.
    #[error(
        "the module calls the external device function `{symbol}`, which the direct path does not provide ({why}); load it on the CUDA driver backend (APEX_BACKEND=driver)"
    )]
    UnsupportedExtern {
        /// The function.
        symbol: String,
        /// Why it is not provided.
        why: String,
    },
    /// A demangled name matches several kernels.
    #[error("kernel name {name:?} fits several kernels ({}); give the mangled name", candidates.join(", "))]
    AmbiguousKernel {
        /// The name asked for.
        name: String,
        /// The kernels it matches.
        candidates: Vec<String>,
    },
}

fn corrupt(what: impl Into<String>) -> CubinError {
    CubinError::Corrupt { what: what.into() }
}

/// One kernel parameter, from `EIATTR_KPARAM_INFO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    /// Position in the kernel's parameter list.
    pub ordinal: u32,
    /// Byte offset inside the parameter block (add [`KernelInfo::param_cbank_offset`] for the bank 0 offset).
    pub offset: u32,
    /// Bytes.
    pub size: u32,
}

/// A constant bank the kernel uses, and where its initial contents are in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConstBank {
    /// Bank number (`.nv.constantN`): 0 holds driver values and parameters, 3 holds `__constant__` data.
    pub bank: u32,
    /// Offset of the bank's template inside the image; `None` when the bank has no image section.
    pub image_offset: Option<u64>,
    /// Bytes.
    pub size: u64,
}

/// What a launcher needs to know about one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelInfo {
    /// The kernel's symbol: the mangled name for C++ kernels.
    pub name: String,
    /// Offset of `.text.<name>` inside the image: the program entry is `base_va + code_offset`.
    pub code_offset: u64,
    /// Bytes of `.text.<name>`.
    pub code_size: u64,
    /// Registers per thread: `EIATTR_REGCOUNT`, else the high byte of the text section's `sh_info` (older cubins).
    pub registers: u32,
    /// Offset of the parameter block in constant bank 0 (`EIATTR_PARAM_CBANK`; 0x210 on sm_90). 0 without parameters.
    pub param_cbank_offset: u32,
    /// Bytes of the parameter block per `EIATTR_PARAM_CBANK`. 0 without parameters.
    pub param_cbank_size: u32,
    /// Parameters, sorted by ordinal.
    pub params: Vec<ParamInfo>,
    /// `EIATTR_CBANK_PARAM_SIZE`: bytes of parameters.
    pub cbank_param_size: u32,
    /// `EIATTR_MAX_THREADS` as a thread count (x * y * z).
    pub max_threads: Option<u32>,
    /// `EIATTR_MAX_THREADS` as written.
    pub max_threads_dims: Option<[u32; 3]>,
    /// `EIATTR_REQNTID`: the block shape the kernel was compiled for.
    pub required_block: Option<[u32; 3]>,
    /// `EIATTR_CTA_PER_CLUSTER`: compile-time cluster shape.
    pub cluster_dims: Option<[u32; 3]>,
    /// `EIATTR_EXPLICIT_CLUSTER`: the kernel must be launched as a cluster (compile-time or run-time shape).
    pub explicit_cluster: bool,
    /// `EIATTR_MIN_STACK_SIZE`: per-thread stack (local memory) bytes.
    pub min_stack_size: u32,
    /// `EIATTR_FRAME_SIZE`, 0 if absent.
    pub frame_size: u32,
    /// `EIATTR_MAX_STACK_SIZE`, 0 if absent.
    pub max_stack_size: u32,
    /// `EIATTR_CRS_STACK_SIZE`, 0 if absent.
    pub crs_stack_size: u32,
    /// `EIATTR_NUM_BARRIERS`; cubins without it keep the count in bits 20..27 of the text section's `sh_flags`.
    pub barrier_count: u32,
    /// Bytes of `.nv.shared.<name>` (0 if absent). On sm_90+ this includes the 1 KiB the compiler reserves at
    /// shared address 0, so dynamic shared memory starts after it (cuobjdump's `SHARED:1024`).
    pub static_shared: u64,
    /// `.nv.constantN.<name>` and module-wide `.nv.constantN` banks, sorted by bank.
    pub const_banks: Vec<ConstBank>,
    /// `EIATTR_EXIT_INSTR_OFFSETS`: code offsets of EXIT instructions.
    pub exit_offsets: Vec<u32>,
    /// `EIATTR_S2RCTAID_INSTR_OFFSETS`.
    pub ctaid_offsets: Vec<u32>,
    /// `EIATTR_EXTERNS`: external device functions the kernel calls (the driver's `vprintf`, `__assertfail`, ...).
    pub externs: Vec<String>,
}

impl KernelInfo {
    /// The constant bank numbered `bank`, if the kernel has one.
    pub fn const_bank(&self, bank: u32) -> Option<&ConstBank> {
        self.const_banks.iter().find(|b| b.bank == bank)
    }
}

/// A module-scope variable (`__device__`, `__constant__`): an `STT_OBJECT` symbol in a section of the loadable
/// image (`.nv.global`, `.nv.global.init`, `.nv.constant3`, ...). Its GPU address is the image's base address plus
/// [`image_offset`](Self::image_offset), what `cuModuleGetGlobal` returns for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalSymbol {
    /// The symbol's name (mangled for a C++ variable in a namespace).
    pub name: String,
    /// Offset of the variable inside the image.
    pub image_offset: u64,
    /// Bytes (`st_size`).
    pub size: u64,
    /// The image section holding it.
    pub section: String,
}

impl GlobalSymbol {
    /// Whether the variable is `__constant__` data: it lives in a constant bank's section, which launches bind
    /// (bank 3 for `__constant__` variables) and read through the SM's constant caches.
    pub fn is_constant(&self) -> bool {
        self.section.starts_with(".nv.constant")
    }
}

/// One section of the loadable image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSection {
    /// The ELF section's name (`.text.<kernel>`, `.nv.constant0.<kernel>`, ...).
    pub name: String,
    /// Offset inside the image.
    pub image_offset: u64,
    /// Bytes.
    pub size: u64,
    /// `SHT_NOBITS`: zero-filled, no bytes in the file.
    pub nobits: bool,
}

#[derive(Debug, Clone)]
struct LoadedSection {
    info: ImageSection,
    /// The section's bytes; `None` for NOBITS.
    data: Option<Vec<u8>>,
}

/// Where a relocation's symbol is.
#[derive(Debug, Clone)]
enum SymbolValue {
    /// This offset inside the image: the address is `base_va + offset`.
    Image(u64),
    /// An absolute value (`SHN_ABS`, or no symbol).
    Absolute(u64),
    /// An undefined symbol the loader provides (the driver's device runtime: `vprintf`, `__assertfail`).
    External(String),
}

#[derive(Debug, Clone)]
struct Relocation {
    kind: u32,
    /// Image offset of the patched bytes (the instruction's start for instruction relocations).
    offset: u64,
    symbol: SymbolValue,
    addend: i64,
    /// What the symbol names: a section (references go anywhere in it, by the addend) or one object.
    target: Target,
}

/// The kind of symbol a relocation names, for placing variables elsewhere ([`Cubin::link_placed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// A section symbol: the variable is where symbol plus addend lands.
    Section,
    /// A named symbol: the variable is the symbol's, whatever the addend (`arr + n` is still `arr`'s).
    Named,
    /// A section symbol in a REL entry whose addend is not in the patched field (the high half of a split
    /// address): where it lands is unknown, so placing a variable is refused.
    SectionNoAddend,
}

/// A parsed cubin: kernels, the loadable image and its relocations. Owns its data.
#[derive(Debug, Clone)]
pub struct Cubin {
    sm: u32,
    kernels: Vec<KernelInfo>,
    sections: Vec<LoadedSection>,
    relocations: Vec<Relocation>,
    image_size: u64,
    /// Undefined symbols that relocations refer to, sorted, each once.
    externals: Vec<String>,
    /// Module-scope variables in the image, in symbol table order.
    globals: Vec<GlobalSymbol>,
}

/// The fields of a section header this module uses, read once.
struct SectionMeta<'data> {
    name: String,
    sh_type: u32,
    flags: u64,
    size: u64,
    align: u64,
    link: u32,
    info: u32,
    /// File bytes; empty for NOBITS.
    data: &'data [u8],
}

struct SymbolMeta {
    name: String,
    st_type: u8,
    other: u8,
    /// Section index, `None` for undefined or special (`SHN_ABS`, `SHN_COMMON`) symbols.
    section: Option<usize>,
    absolute: bool,
    value: u64,
    /// `st_size`.
    size: u64,
}

/// Module-wide `.nv.info` values, per function symbol index.
#[derive(Default)]
struct ModuleInfo {
    regcount: Vec<(u32, u32)>,
    frame_size: Vec<(u32, u32)>,
    min_stack: Vec<(u32, u32)>,
    max_stack: Vec<(u32, u32)>,
}

fn lookup(list: &[(u32, u32)], symbol: u32) -> Option<u32> {
    list.iter().find(|(s, _)| *s == symbol).map(|(_, v)| *v)
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
            let name = String::from_utf8_lossy(name).into_owned();
            let data = sh
                .data(endian, bytes)
                .map_err(|e| corrupt(format!("section {name}: contents: {e}")))?;
            metas.push(SectionMeta {
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
                name: String::from_utf8_lossy(name).into_owned(),
                st_type: sym.st_type().0,
                other: sym.st_other().0,
                section,
                absolute: sym.st_shndx(endian) == elf::SHN_ABS,
                value: sym.st_value(endian),
                size: sym.st_size(endian),
            });
        }
        let symtab_index = symtab.section().0;

        let module = module_info(&metas)?;
        let mut kernels = Vec::new();
        for (sym_index, sym) in symbols.iter().enumerate() {
            if let Some(mut kernel) =
                kernel_info(sym_index, sym, &metas, &sections, &image_index, &module)?
            {
                // EIATTR_EXTERNS gives symbol indices; keep the names.
                for name in kernel.externs.iter_mut() {
                    let index: usize = name.parse().unwrap_or(usize::MAX);
                    let sym = symbols.get(index).ok_or_else(|| {
                        corrupt(format!(
                            "kernel {}: EXTERNS symbol {index} out of range",
                            kernel.name
                        ))
                    })?;
                    *name = sym.name.clone();
                }
                kernels.push(kernel);
            }
        }

        let relocations = relocations(
            &table,
            endian,
            bytes,
            &metas,
            &symbols,
            symtab_index,
            &sections,
            &image_index,
        )?;

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
            sm,
            kernels,
            sections,
            relocations,
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
        if let Some(k) = self.kernels.iter().find(|k| k.name == name) {
            return Ok(k);
        }
        let want = without_spaces(name);
        let matches: Vec<&KernelInfo> = self
            .kernels
            .iter()
            .filter(|k| {
                demangled_forms(&k.name)
                    .iter()
                    .any(|f| without_spaces(f) == want)
            })
            .collect();
        match matches[..] {
            [k] => Ok(k),
            [] => Err(CubinError::NoSuchKernel(name.to_owned())),
            _ => Err(CubinError::AmbiguousKernel {
                name: name.to_owned(),
                candidates: matches.iter().map(|k| k.name.clone()).collect(),
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
            if let Some(data) = &section.data {
                let dst = range_mut(image, section.info.image_offset, data.len())?;
                dst.copy_from_slice(data);
            }
        }
        for r in &self.relocations {
            apply(r, base_va, image, resolve, placed)?;
        }
        Ok(())
    }
}

/// A module variable that lives at `address` instead of inside the module's image ([`Cubin::link_placed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedGlobal {
    /// The variable's offset inside the image ([`GlobalSymbol::image_offset`]).
    pub image_offset: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Where it lives.
    pub address: u64,
}

/// Alignment of constant-bank sections in the image. The hardware takes bank addresses in 64-byte units
/// (`CONSTANT_BUFFER_ADDR_*_SHIFTED6`); 256 is what CUDA guarantees for constant banks.
pub const CONST_BANK_ALIGN: u64 = 256;

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
fn layout(metas: &[SectionMeta]) -> Result<Layout, CubinError> {
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
            Some(meta.data.to_vec())
        };
        if let Some(slot) = index.get_mut(i) {
            *slot = Some(sections.len());
        }
        sections.push(LoadedSection {
            info: ImageSection {
                name: meta.name.clone(),
                image_offset: offset,
                size: meta.size,
                nobits,
            },
            data,
        });
    }
    Ok((sections, index, cursor))
}

/// A decoded `.nv.info` record.
struct Record<'a> {
    attr: u8,
    value: Value<'a>,
}

enum Value<'a> {
    None,
    Byte(u8),
    Half(u16),
    Bytes(&'a [u8]),
}

/// Splits a `.nv.info` section into records: `u8 format, u8 attribute, u16 value-or-size[, size bytes]`.
fn records<'a>(data: &'a [u8], section: &str) -> Result<Vec<Record<'a>>, CubinError> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let Some((head, tail)) = rest.split_first_chunk::<4>() else {
            return Err(corrupt(format!("{section}: truncated attribute record")));
        };
        let [format, attr, lo, hi] = *head;
        let half = u16::from_le_bytes([lo, hi]);
        let value = match format {
            eifmt::NVAL => Value::None,
            eifmt::BVAL => Value::Byte(lo),
            eifmt::HVAL => Value::Half(half),
            eifmt::SVAL => {
                let len = usize::from(half);
                let Some((value, after)) = tail.split_at_checked(len) else {
                    return Err(corrupt(format!(
                        "{section}: attribute {attr:#x} runs past the section end"
                    )));
                };
                out.push(Record {
                    attr,
                    value: Value::Bytes(value),
                });
                rest = after;
                continue;
            }
            other => {
                return Err(corrupt(format!(
                    "{section}: unknown attribute format {other:#x}"
                )));
            }
        };
        out.push(Record { attr, value });
        rest = tail;
    }
    Ok(out)
}

fn u32_at(data: &[u8], offset: usize) -> Option<u32> {
    let end = offset.checked_add(4)?;
    Some(u32::from_le_bytes(data.get(offset..end)?.try_into().ok()?))
}

fn u16_at(data: &[u8], offset: usize) -> Option<u16> {
    let end = offset.checked_add(2)?;
    Some(u16::from_le_bytes(data.get(offset..end)?.try_into().ok()?))
}

fn u64_at(data: &[u8], offset: usize) -> Option<u64> {
    let end = offset.checked_add(8)?;
    Some(u64::from_le_bytes(data.get(offset..end)?.try_into().ok()?))
}

fn bytes_of<'a>(
    record: &Record<'a>,
    section: &str,
    len: Option<usize>,
) -> Result<&'a [u8], CubinError> {
    match record.value {
        Value::Bytes(b) if len.is_none_or(|l| l == b.len()) => Ok(b),
        _ => Err(corrupt(format!(
            "{section}: attribute {:#x} has the wrong format or size",
            record.attr
        ))),
    }
}

fn u32_list(record: &Record, section: &str) -> Result<Vec<u32>, CubinError> {
    let b = bytes_of(record, section, None)?;
    if !b.len().is_multiple_of(4) {
        return Err(corrupt(format!(
            "{section}: attribute {:#x} is not a list of u32",
            record.attr
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn triple(b: &[u8]) -> Option<[u32; 3]> {
    Some([u32_at(b, 0)?, u32_at(b, 4)?, u32_at(b, 8)?])
}

/// `(symbol, value)` pairs: the module-wide form of the per-function attributes.
fn keyed(record: &Record, section: &str) -> Result<(u32, u32), CubinError> {
    let b = bytes_of(record, section, Some(8))?;
    match (u32_at(b, 0), u32_at(b, 4)) {
        (Some(symbol), Some(value)) => Ok((symbol, value)),
        _ => Err(corrupt(format!(
            "{section}: attribute {:#x} is truncated",
            record.attr
        ))),
    }
}

fn module_info(metas: &[SectionMeta]) -> Result<ModuleInfo, CubinError> {
    let mut info = ModuleInfo::default();
    for meta in metas.iter().filter(|m| m.name == ".nv.info") {
        for record in records(meta.data, &meta.name)? {
            let list = match record.attr {
                eiattr::REGCOUNT => &mut info.regcount,
                eiattr::FRAME_SIZE => &mut info.frame_size,
                eiattr::MIN_STACK_SIZE => &mut info.min_stack,
                eiattr::MAX_STACK_SIZE => &mut info.max_stack,
                _ => continue,
            };
            list.push(keyed(&record, &meta.name)?);
        }
    }
    Ok(info)
}

/// Builds the kernel description for `sym` if it is a kernel: a function in `.text.<its name>`, marked as an
/// entry point or described by a `.nv.info.<its name>`.
fn kernel_info(
    sym_index: usize,
    sym: &SymbolMeta,
    metas: &[SectionMeta],
    sections: &[LoadedSection],
    image_index: &[Option<usize>],
    module: &ModuleInfo,
) -> Result<Option<KernelInfo>, CubinError> {
    if sym.st_type != elf::STT_FUNC.0 || sym.name.is_empty() {
        return Ok(None);
    }
    let Some(text_index) = sym.section else {
        return Ok(None);
    };
    let Some(text) = metas.get(text_index) else {
        return Ok(None);
    };
    if text.name.strip_prefix(".text.") != Some(sym.name.as_str()) {
        return Ok(None);
    }
    let info_name = format!(".nv.info.{}", sym.name);
    let info_section = metas.iter().find(|m| m.name == info_name).or_else(|| {
        metas.iter().find(|m| {
            m.sh_type == SHT_CUDA_INFO
                && m.name.starts_with(".nv.info.")
                && usize::try_from(m.info).ok() == Some(text_index)
        })
    });
    // Cubins mark kernels with STO_CUDA_ENTRY. Without the mark, a function is taken for a kernel only if its
    // `.nv.info.<name>` describes a launch (parameters, exits, block shape): nvlink and nvJitLink also write
    // `.nv.info.<name>` for `__device__` functions (libdevice slow paths, functions whose address is taken).
    let describes_launch = |meta: &SectionMeta| {
        records(meta.data, &meta.name).is_ok_and(|rs| {
            rs.iter().any(|r| {
                matches!(
                    r.attr,
                    eiattr::PARAM_CBANK
                        | eiattr::CBANK_PARAM_SIZE
                        | eiattr::KPARAM_INFO
                        | eiattr::EXIT_INSTR_OFFSETS
                        | eiattr::MAX_THREADS
                        | eiattr::REQNTID
                )
            })
        })
    };
    if sym.other & STO_CUDA_ENTRY == 0 && !info_section.is_some_and(describes_launch) {
        return Ok(None); // a __device__ function
    }
    let name = sym.name.clone();
    let image = image_index
        .get(text_index)
        .copied()
        .flatten()
        .and_then(|i| sections.get(i))
        .ok_or_else(|| corrupt(format!("kernel {name}: code section is not loadable")))?;
    let sym_key = u32::try_from(sym_index).map_err(|_| corrupt("symbol index overflows"))?;

    let mut k = KernelInfo {
        name,
        code_offset: image.info.image_offset,
        code_size: image.info.size,
        registers: 0,
        param_cbank_offset: 0,
        param_cbank_size: 0,
        params: Vec::new(),
        cbank_param_size: 0,
        max_threads: None,
        max_threads_dims: None,
        required_block: None,
        cluster_dims: None,
        explicit_cluster: false,
        min_stack_size: lookup(&module.min_stack, sym_key).unwrap_or(0),
        frame_size: lookup(&module.frame_size, sym_key).unwrap_or(0),
        max_stack_size: lookup(&module.max_stack, sym_key).unwrap_or(0),
        crs_stack_size: 0,
        barrier_count: 0,
        static_shared: 0,
        const_banks: Vec::new(),
        exit_offsets: Vec::new(),
        ctaid_offsets: Vec::new(),
        externs: Vec::new(),
    };
    let mut registers = lookup(&module.regcount, sym_key);
    let mut barriers = None;

    if let Some(meta) = info_section {
        let section = meta.name.as_str();
        for record in records(meta.data, section)? {
            match record.attr {
                eiattr::PARAM_CBANK => {
                    let b = bytes_of(&record, section, Some(8))?;
                    let (offset, size) = u16_at(b, 4)
                        .zip(u16_at(b, 6))
                        .ok_or_else(|| corrupt("PARAM_CBANK"))?;
                    k.param_cbank_offset = offset.into();
                    k.param_cbank_size = size.into();
                }
                eiattr::CBANK_PARAM_SIZE => match record.value {
                    Value::Half(v) => k.cbank_param_size = v.into(),
                    _ => return Err(corrupt(format!("{section}: CBANK_PARAM_SIZE is not a u16"))),
                },
                eiattr::KPARAM_INFO => {
                    let b = bytes_of(&record, section, Some(12))?;
                    let fields = u16_at(b, 4).zip(u16_at(b, 6)).zip(u32_at(b, 8));
                    let ((ordinal, offset), flags) =
                        fields.ok_or_else(|| corrupt("KPARAM_INFO"))?;
                    k.params.push(ParamInfo {
                        ordinal: ordinal.into(),
                        offset: offset.into(),
                        size: flags >> 18,
                    });
                }
                eiattr::MAX_THREADS => {
                    let dims = triple(bytes_of(&record, section, Some(12))?)
                        .ok_or_else(|| corrupt("MAX_THREADS"))?;
                    k.max_threads_dims = Some(dims);
                    k.max_threads = dims.iter().try_fold(1u32, |acc, d| acc.checked_mul(*d));
                    if k.max_threads.is_none() {
                        return Err(corrupt(format!("{section}: MAX_THREADS overflows")));
                    }
                }
                eiattr::REQNTID => {
                    k.required_block = Some(
                        triple(bytes_of(&record, section, Some(12))?)
                            .ok_or_else(|| corrupt("REQNTID"))?,
                    );
                }
                eiattr::CTA_PER_CLUSTER => {
                    let dims = triple(bytes_of(&record, section, Some(12))?)
                        .filter(|d| d.iter().all(|&v| v > 0))
                        .ok_or_else(|| corrupt(format!("{section}: CTA_PER_CLUSTER")))?;
                    k.cluster_dims = Some(dims);
                }
                eiattr::EXPLICIT_CLUSTER => k.explicit_cluster = true,
                eiattr::NUM_BARRIERS => match record.value {
                    Value::Byte(v) => barriers = Some(u32::from(v)),
                    Value::Half(v) => barriers = Some(u32::from(v)),
                    _ => {
                        return Err(corrupt(format!(
                            "{section}: NUM_BARRIERS has the wrong format"
                        )));
                    }
                },
                eiattr::EXIT_INSTR_OFFSETS => k.exit_offsets = u32_list(&record, section)?,
                eiattr::S2RCTAID_INSTR_OFFSETS => k.ctaid_offsets = u32_list(&record, section)?,
                // Symbol indices for now; `Cubin::parse` turns them into names.
                eiattr::EXTERNS => {
                    k.externs = u32_list(&record, section)?
                        .iter()
                        .map(|i| i.to_string())
                        .collect();
                }
                eiattr::CRS_STACK_SIZE => {
                    k.crs_stack_size = u32_at(bytes_of(&record, section, Some(4))?, 0).unwrap_or(0);
                }
                // Per-kernel copies of the module-wide attributes, keyed the same way.
                eiattr::REGCOUNT
                | eiattr::FRAME_SIZE
                | eiattr::MIN_STACK_SIZE
                | eiattr::MAX_STACK_SIZE => {
                    let (key, value) = keyed(&record, section)?;
                    if key == sym_key {
                        match record.attr {
                            eiattr::REGCOUNT => registers = Some(value),
                            eiattr::FRAME_SIZE => k.frame_size = value,
                            eiattr::MIN_STACK_SIZE => k.min_stack_size = value,
                            _ => k.max_stack_size = value,
                        }
                    }
                }
                _ => {}
            }
        }
    }
    k.params.sort_by_key(|p| p.ordinal);
    if k.params.windows(2).any(|w| w[0].ordinal == w[1].ordinal) {
        return Err(corrupt(format!(
            "kernel {}: two parameters with one ordinal",
            k.name
        )));
    }
    // Older cubins keep the register count in sh_info's high byte and the barrier count in sh_flags.
    k.registers = match registers {
        Some(r) => r,
        None => text.info >> 24,
    };
    if k.registers == 0 {
        return Err(corrupt(format!("kernel {}: no register count", k.name)));
    }
    k.barrier_count = barriers.unwrap_or(((text.flags >> 20) & 0x7f) as u32);

    let shared_name = format!(".nv.shared.{}", k.name);
    k.static_shared = metas
        .iter()
        .find(|m| m.name == shared_name)
        .map_or(0, |m| m.size);

    for (i, meta) in metas.iter().enumerate() {
        let Some(rest) = meta.name.strip_prefix(".nv.constant") else {
            continue;
        };
        let (digits, owner) = match rest.split_once('.') {
            Some((digits, owner)) => (digits, Some(owner)),
            None => (rest, None),
        };
        if owner.is_some_and(|o| o != k.name) {
            continue;
        }
        let Ok(bank) = digits.parse::<u32>() else {
            continue;
        };
        let image_offset = image_index
            .get(i)
            .copied()
            .flatten()
            .and_then(|s| sections.get(s))
            .map(|s| s.info.image_offset);
        k.const_banks.push(ConstBank {
            bank,
            image_offset,
            size: meta.size,
        });
    }
    k.const_banks.sort_by_key(|b| b.bank);
    if k.const_banks.windows(2).any(|w| w[0].bank == w[1].bank) {
        return Err(corrupt(format!(
            "kernel {}: two sections for one constant bank",
            k.name
        )));
    }
    Ok(Some(k))
}

/// The `STT_OBJECT` symbols that lie in image sections: the module's variables. A symbol reaching past its
/// section's end is a corrupt cubin.
fn global_symbols(
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
            name: sym.name.clone(),
            image_offset: section.info.image_offset + sym.value,
            size: sym.size,
            section: section.info.name.clone(),
        });
    }
    Ok(out)
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
fn relocations(
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
        let Some(image) = target
            .and_then(|t| image_index.get(t).copied().flatten())
            .and_then(|i| sections.get(i))
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
                section: meta.name.clone(),
            })?;
            if kind == reloc::R_CUDA_NONE {
                continue;
            }
            let end = offset.checked_add(width);
            let Some(data) = image
                .data
                .as_deref()
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
            let symbol = symbol_value(sym, symbols, sections, image_index, &meta.name)?;
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
            });
        }
    }
    Ok(out)
}

fn symbol_value(
    sym: u32,
    symbols: &[SymbolMeta],
    sections: &[LoadedSection],
    image_index: &[Option<usize>],
    section: &str,
) -> Result<SymbolValue, CubinError> {
    if sym == 0 {
        return Ok(SymbolValue::Absolute(0));
    }
    let s = usize::try_from(sym)
        .ok()
        .and_then(|i| symbols.get(i))
        .ok_or_else(|| corrupt(format!("{section}: relocation symbol {sym} out of range")))?;
    if s.absolute {
        return Ok(SymbolValue::Absolute(s.value));
    }
    if s.section.is_none() && !s.name.is_empty() {
        return Ok(SymbolValue::External(s.name.clone()));
    }
    let base = s
        .section
        .and_then(|i| image_index.get(i).copied().flatten())
        .and_then(|i| sections.get(i))
        .ok_or_else(|| CubinError::UnresolvedSymbol {
            symbol: s.name.clone(),
            section: section.to_owned(),
        })?;
    // Executable cubins give symbol values relative to their section.
    base.info
        .image_offset
        .checked_add(s.value)
        .map(SymbolValue::Image)
        .ok_or_else(|| corrupt(format!("{section}: symbol {} value overflows", s.name)))
}

const ABS55_LO_MASK: u128 = 0xff << 16;
const ABS55_HI_MASK: u128 = ((1u128 << 47) - 1) << 34;

/// Puts `address` into the R_CUDA_ABS55_16_34 fields of a 128-bit instruction.
fn abs55_encode(insn: u128, address: u64) -> u128 {
    let a = u128::from(address);
    (insn & !(ABS55_LO_MASK | ABS55_HI_MASK))
        | (((a >> 2) & 0xff) << 16)
        | (((a >> 10) & ((1 << 47) - 1)) << 34)
}

/// The address in the R_CUDA_ABS55_16_34 fields of a 128-bit instruction.
fn abs55_decode(insn: u128) -> u64 {
    ((((insn & ABS55_LO_MASK) >> 16) << 2) | (((insn & ABS55_HI_MASK) >> 34) << 10)) as u64
}

fn range_mut(image: &mut [u8], offset: u64, len: usize) -> Result<&mut [u8], CubinError> {
    let start = usize::try_from(offset).map_err(|_| corrupt("image offset overflows"))?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| corrupt("image offset overflows"))?;
    image
        .get_mut(start..end)
        .ok_or_else(|| corrupt("patch outside the image"))
}

fn apply(
    r: &Relocation,
    base_va: u64,
    image: &mut [u8],
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
    apply_value(r.kind, r.offset, value, image)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// References to a placed variable follow the symbol a relocation names: `var + n` past its end is still
    /// `var`'s; through a section symbol only bytes inside the variable are; a split address without its addend is
    /// refused.
    #[test]
    fn placed_references_follow_the_named_symbol() {
        let placed = [PlacedGlobal {
            image_offset: 0x100,
            size: 0x10,
            address: 0x9000_0000,
        }];
        let base = 0x1000_0000;
        let link = |symbol: u64, addend: i64, target: Target| {
            let mut img = vec![0u8; 0x200];
            let r = Relocation {
                kind: reloc::R_CUDA_64,
                offset: 0,
                symbol: SymbolValue::Image(symbol),
                addend,
                target,
            };
            apply(&r, base, &mut img, &|_| None, &placed)
                .map(|()| u64::from_le_bytes(img[..8].try_into().unwrap()))
        };
        assert_eq!(link(0x100, 0x10, Target::Named).unwrap(), 0x9000_0010);
        assert_eq!(link(0x100, -4, Target::Named).unwrap(), 0x8fff_fffc);
        assert_eq!(link(0x0, 0x108, Target::Section).unwrap(), 0x9000_0008);
        assert_eq!(link(0x0, 0x110, Target::Section).unwrap(), base + 0x110);
        assert_eq!(link(0x110, 0, Target::Named).unwrap(), base + 0x110);
        assert!(link(0x0, 0, Target::SectionNoAddend).is_err());
        // Nothing placed: nothing changes, and nothing is refused.
        let mut img = vec![0u8; 8];
        let r = Relocation {
            kind: reloc::R_CUDA_64,
            offset: 0,
            symbol: SymbolValue::Image(0),
            addend: 0x108,
            target: Target::SectionNoAddend,
        };
        apply(&r, base, &mut img, &|_| None, &[]).unwrap();
        assert_eq!(
            u64::from_le_bytes(img[..8].try_into().unwrap()),
            base + 0x108
        );
    }

    #[test]
    fn abs55_matches_nvdisasm() {
        // `CALL.ABS.NOINC 0x0` from nvcc -G; nvdisasm reads bit 16 as 0x4, bit 23 as 0x200, bit 34 as 0x400 and
        // bit 80 as 0x100000000000000.
        let call = u128::from_le_bytes(
            *b"\x43\x79\x00\x00\x00\x00\x00\x00\x00\x00\xc0\x03\x00\xde\x3f\x00",
        );
        for (bit, address) in [
            (16, 0x4u64),
            (23, 0x200),
            (34, 0x400),
            (80, 0x100_0000_0000_0000),
        ] {
            assert_eq!(abs55_encode(call, address), call | 1 << bit, "bit {bit}");
            assert_eq!(abs55_decode(call | 1 << bit), address);
        }
        let a = 0x7f12_3456_7890u64;
        assert_eq!(abs55_decode(abs55_encode(call, a)), a);
        // The rest of the instruction is untouched.
        assert_eq!(
            abs55_encode(call, a) & !(ABS55_LO_MASK | ABS55_HI_MASK),
            call
        );
    }

    #[test]
    fn sm_from_flags_both_encodings() {
        assert_eq!(sm_from_e_flags(8, 0x0600_5a04), 90);
        assert_eq!(sm_from_e_flags(8, 0x0600_6402), 100);
        assert_eq!(sm_from_e_flags(7, 0x0050_0550), 80);
    }

    #[test]
    fn records_reject_overruns() {
        assert!(records(&[4, 0x17, 12, 0, 1, 2], "t").is_err());
        assert!(records(&[1, 0x35], "t").is_err());
        assert!(records(&[9, 0x35, 0, 0], "t").is_err());
        let r = records(
            &[1, 0x35, 0, 0, 3, 0x19, 8, 0, 4, 0x1c, 4, 0, 0x60, 0, 0, 0],
            "t",
        )
        .unwrap();
        assert_eq!(r.len(), 3);
    }
}
