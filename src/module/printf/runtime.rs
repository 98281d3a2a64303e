//! APEX's device runtime (`vprintf`, `__assertfail`): read from its relocatable cubin, and linked into the image
//! of each module that calls it.

use std::sync::OnceLock;

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, Rela as _, SectionHeader, Sym as _};
use tracing::warn;

use crate::module::cubin::{self, CubinError, EM_CUDA, reloc};

type Elf = elf::FileHeader64<LittleEndian>;

/// The symbol the runtime's code refers to for the ring's header.
pub(super) const FIFO_SYMBOL: &str = "apex_fifo";

/// The runtime for Hopper (sm_90; the same SASS runs in sm_90a modules).
pub(super) static RUNTIME_SM90: &[u8] = include_bytes!("../../../kernels/apex_printf.sm_90.cubin");

/// Which runtime function serves which external symbol of a module.
const SERVES: [(&str, &str); 2] = [
    ("vprintf", "apex_vprintf"),
    ("__assertfail", "apex_assertfail"),
];

/// External device functions of the CUDA driver's runtime the direct path does not provide, and why.
pub fn unsupported_extern_reason(symbol: &str) -> &'static str {
    match symbol {
        "malloc" | "free" | "__nv_malloc" | "__nv_free" => {
            "device-side malloc/free needs the driver's device heap"
        }
        s if s.starts_with("cudaGetParameterBuffer")
            || s.starts_with("cudaLaunchDevice")
            || s.starts_with("__cudaCDP")
            || s.starts_with("cudaCGGetIntrinsicHandle")
            || s.starts_with("cudaCG") =>
        {
            "dynamic parallelism and grid-wide cooperative groups need the driver's device runtime"
        }
        _ => "it is not part of the module and APEX has no implementation of it",
    }
}

/// Why a device runtime object could not be used.
fn bad_runtime(what: impl Into<String>) -> CubinError {
    CubinError::Corrupt {
        what: format!("APEX device runtime: {}", what.into()),
    }
}

/// One relocation of a runtime function, against a symbol the loader resolves.
#[derive(Debug, Clone)]
pub(super) struct RuntimeReloc {
    offset: u64,
    kind: u32,
    pub(super) symbol: String,
    addend: i64,
}

/// One function of the device runtime: its code, relocations and resource needs.
#[derive(Debug, Clone)]
pub struct RuntimeFunction {
    /// The function's own name (`apex_vprintf`).
    pub name: String,
    /// The external symbol of CUDA's runtime it stands in for (`vprintf`).
    pub serves: &'static str,
    code: Vec<u8>,
    pub(super) relocs: Vec<RuntimeReloc>,
    /// Registers per thread the function uses: a kernel that calls it gets at least this many.
    pub registers: u32,
    /// Stack bytes the function takes below its caller's frame.
    pub stack: u32,
}

impl RuntimeFunction {
    /// Bytes of code.
    pub fn code_size(&self) -> u64 {
        self.code.len() as u64
    }

    /// The code before relocation.
    pub fn code(&self) -> &[u8] {
        &self.code
    }

    /// Writes the function's code into `image` at `offset` (the code's GPU address is `base_va + offset`) and
    /// applies its relocations; `fifo_va` is the ring's header.
    fn link_into(&self, image: &mut [u8], offset: u64, fifo_va: u64) -> Result<(), CubinError> {
        let start = usize::try_from(offset).map_err(|_| bad_runtime("offset overflows"))?;
        let got = image.len() as u64;
        let dst = start
            .checked_add(self.code.len())
            .and_then(|end| image.get_mut(start..end))
            .ok_or(CubinError::ImageTooSmall {
                need: offset + self.code_size(),
                got,
            })?;
        dst.copy_from_slice(&self.code);
        for r in &self.relocs {
            let symbol = match r.symbol.as_str() {
                FIFO_SYMBOL => fifo_va,
                other => {
                    return Err(CubinError::UnresolvedSymbol {
                        symbol: other.to_owned(),
                        section: format!(".text.{}", self.name),
                    });
                }
            };
            let value =
                symbol
                    .checked_add_signed(r.addend)
                    .ok_or(CubinError::RelocationOverflow {
                        kind: r.kind,
                        offset: r.offset,
                        value: symbol,
                    })?;
            cubin::apply_value(r.kind, offset + r.offset, value, image)?;
        }
        Ok(())
    }
}

/// APEX's implementation of the driver's device runtime functions (`vprintf`, `__assertfail`) for one
/// architecture, read from a relocatable cubin.
#[derive(Debug, Clone)]
pub struct DeviceRuntime {
    sm: u32,
    functions: Vec<RuntimeFunction>,
}

impl DeviceRuntime {
    /// The runtime for an `sm` GPU, if APEX has one (Hopper).
    pub fn for_sm(sm: u32) -> Option<&'static DeviceRuntime> {
        static SM90: OnceLock<Option<DeviceRuntime>> = OnceLock::new();
        if sm != 90 {
            return None;
        }
        SM90.get_or_init(|| match DeviceRuntime::parse(RUNTIME_SM90) {
            Ok(rt) => Some(rt),
            Err(e) => {
                warn!(error = %e, "APEX's device runtime does not parse; printf and assert are unavailable");
                None
            }
        })
        .as_ref()
    }

    /// Reads a relocatable cubin holding the runtime functions. Refuses one whose functions use constant banks
    /// (they run with the calling kernel's banks bound) or relocations other than instruction immediates against
    /// the ring's symbol.
    pub fn parse(bytes: &[u8]) -> Result<DeviceRuntime, CubinError> {
        let header = Elf::parse(bytes).map_err(|e| CubinError::NotElf(e.to_string()))?;
        let endian = header
            .endian()
            .map_err(|e| CubinError::NotElf(e.to_string()))?;
        if header.e_machine(endian).0 != EM_CUDA {
            return Err(CubinError::NotCuda {
                machine: header.e_machine(endian).0,
            });
        }
        if header.e_type(endian).0 != elf::ET_REL.0 {
            return Err(bad_runtime("not a relocatable object"));
        }
        let sm = cubin::sm_from_e_flags(header.e_ident().abi_version, header.e_flags(endian).0);
        let table = header
            .sections(endian, bytes)
            .map_err(|e| bad_runtime(format!("section headers: {e}")))?;
        let mut names = Vec::with_capacity(table.len());
        for sh in table.iter() {
            let name = table
                .section_name(endian, sh)
                .map_err(|e| bad_runtime(format!("section name: {e}")))?;
            names.push(String::from_utf8_lossy(name).into_owned());
        }
        if let Some(bank) = names
            .iter()
            .find(|n| n.starts_with(".nv.constant") || n.starts_with(".nv.global"))
        {
            return Err(bad_runtime(format!(
                "it has a section {bank}: its code must not depend on module data"
            )));
        }
        let symtab = table
            .symbols(endian, bytes, elf::SHT_SYMTAB)
            .map_err(|e| bad_runtime(format!("symbol table: {e}")))?;
        let mut sym_names = Vec::with_capacity(symtab.len());
        for sym in symtab.iter() {
            let n = symtab
                .symbol_name(endian, sym)
                .map_err(|e| bad_runtime(format!("symbol name: {e}")))?;
            sym_names.push(String::from_utf8_lossy(n).into_owned());
        }

        // Module-wide .nv.info: per-function registers and stack, keyed by symbol index.
        let mut regcount = Vec::new();
        let mut stack = Vec::new();
        for (i, sh) in table.iter().enumerate() {
            if names.get(i).map(String::as_str) != Some(".nv.info") {
                continue;
            }
            let data = sh
                .data(endian, bytes)
                .map_err(|e| bad_runtime(format!(".nv.info: {e}")))?;
            for (attr, value) in info_records(data)? {
                let (Some(sym), Some(v)) = (u32_at(value, 0), u32_at(value, 4)) else {
                    continue;
                };
                match attr {
                    cubin::eiattr::REGCOUNT => regcount.push((sym, v)),
                    cubin::eiattr::FRAME_SIZE
                    | cubin::eiattr::MIN_STACK_SIZE
                    | cubin::eiattr::MAX_STACK_SIZE => stack.push((sym, v)),
                    _ => {}
                }
            }
        }

        let mut functions = Vec::new();
        for (extern_name, own) in SERVES {
            let Some((sym_index, sym)) = symtab.iter().enumerate().find(|(i, s)| {
                sym_names.get(*i).map(String::as_str) == Some(own) && s.st_type() == elf::STT_FUNC
            }) else {
                return Err(bad_runtime(format!("no function {own}")));
            };
            let text_index = symtab
                .symbol_section(endian, sym, object::SymbolIndex(sym_index))
                .map_err(|e| bad_runtime(format!("{own}: {e}")))?
                .ok_or_else(|| bad_runtime(format!("{own} is undefined")))?
                .0;
            let text = table
                .section(object::SectionIndex(text_index))
                .map_err(|e| bad_runtime(format!("{own}: {e}")))?;
            if names.get(text_index).map(String::as_str) != Some(&format!(".text.{own}")) {
                return Err(bad_runtime(format!("{own} is not alone in .text.{own}")));
            }
            if sym.st_value(endian) != 0 {
                return Err(bad_runtime(format!("{own} does not start its section")));
            }
            let code = text
                .data(endian, bytes)
                .map_err(|e| bad_runtime(format!("{own}: code: {e}")))?
                .to_vec();
            let key = u32::try_from(sym_index).map_err(|_| bad_runtime("symbol index"))?;
            let registers = regcount
                .iter()
                .find(|(s, _)| *s == key)
                .map(|(_, v)| *v)
                .ok_or_else(|| bad_runtime(format!("{own}: no register count")))?;
            let stack_bytes = stack
                .iter()
                .filter(|(s, _)| *s == key)
                .map(|(_, v)| *v)
                .max()
                .unwrap_or(0);

            let mut relocs = Vec::new();
            for (i, sh) in table.iter().enumerate() {
                let Some((rela, _)) = sh
                    .rela(endian, bytes)
                    .map_err(|e| bad_runtime(format!("relocations: {e}")))?
                else {
                    continue;
                };
                if usize::try_from(sh.sh_info(endian)).ok() != Some(text_index) {
                    continue;
                }
                let section = names.get(i).cloned().unwrap_or_default();
                for r in rela {
                    let kind = r.r_type(endian, false).0;
                    let offset = r.r_offset(endian);
                    let symbol = usize::try_from(r.r_sym(endian, false))
                        .ok()
                        .and_then(|s| sym_names.get(s))
                        .cloned()
                        .ok_or_else(|| bad_runtime(format!("{section}: symbol out of range")))?;
                    if !matches!(
                        kind,
                        reloc::R_CUDA_ABS32_LO_32
                            | reloc::R_CUDA_ABS32_HI_32
                            | reloc::R_CUDA_ABS32_32
                    ) || symbol != FIFO_SYMBOL
                    {
                        return Err(bad_runtime(format!(
                            "{section}: relocation type {kind} against {symbol:?} (only the ring's address is resolved)"
                        )));
                    }
                    if offset
                        .checked_add(8)
                        .is_none_or(|end| end > code.len() as u64)
                    {
                        return Err(bad_runtime(format!(
                            "{section}: relocation outside the code"
                        )));
                    }
                    relocs.push(RuntimeReloc {
                        offset,
                        kind,
                        symbol,
                        addend: r.r_addend(endian),
                    });
                }
            }
            functions.push(RuntimeFunction {
                name: own.to_owned(),
                serves: extern_name,
                code,
                relocs,
                registers,
                stack: stack_bytes,
            });
        }
        Ok(DeviceRuntime { sm, functions })
    }

    /// The SM version the runtime's SASS is for.
    pub fn sm_version(&self) -> u32 {
        self.sm
    }

    /// The function that stands in for the external symbol `name` (`vprintf`, `__assertfail`).
    pub fn function(&self, name: &str) -> Option<&RuntimeFunction> {
        self.functions.iter().find(|f| f.serves == name)
    }

    /// Every function, in a fixed order.
    pub fn functions(&self) -> &[RuntimeFunction] {
        &self.functions
    }
}

/// `.nv.info` records as (attribute, value bytes) for the SVAL records; others are skipped.
fn info_records(data: &[u8]) -> Result<Vec<(u8, &[u8])>, CubinError> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some((head, tail)) = rest.split_first_chunk::<4>() {
        let [format, attr, lo, hi] = *head;
        if format == cubin::eifmt::SVAL {
            let len = usize::from(u16::from_le_bytes([lo, hi]));
            let (value, after) = tail
                .split_at_checked(len)
                .ok_or_else(|| bad_runtime(".nv.info record runs past the section"))?;
            out.push((attr, value));
            rest = after;
        } else {
            rest = tail;
        }
    }
    Ok(out)
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// What [`RuntimeLink::plan`] found: the functions APEX links in, and the externals it cannot serve.
#[derive(Debug, Clone)]
pub(crate) struct RuntimePlan {
    /// The functions appended to the image, if the module calls any APEX provides.
    pub link: Option<RuntimeLink>,
    /// An [`CubinError::UnsupportedExtern`] for each external APEX does not provide.
    pub unsupported: Vec<CubinError>,
}

impl RuntimePlan {
    /// The refusal for a kernel calling the externals `externs`, if it calls one APEX does not provide.
    pub fn refusal_for(&self, externs: &[String]) -> Option<&CubinError> {
        self.unsupported.iter().find(|e| {
            matches!(e, CubinError::UnsupportedExtern { symbol, .. } if externs.contains(symbol))
        })
    }
}

/// Links the runtime functions a module calls into its image: where each goes and how it changes the kernels.
#[derive(Debug, Clone)]
pub(crate) struct RuntimeLink {
    /// (function, offset in the image) for each function appended.
    pub placed: Vec<(&'static RuntimeFunction, u64)>,
    /// Bytes of the image with the functions appended.
    pub image_size: u64,
}

impl RuntimeLink {
    /// Plans where the functions serving `externals` go after an image of `image_size` bytes. Externals the
    /// runtime does not provide come back in `unsupported`, each with the reason, for the loader to refuse.
    pub fn plan(sm: u32, externals: &[String], image_size: u64) -> RuntimePlan {
        let runtime = DeviceRuntime::for_sm(sm);
        let mut placed = Vec::new();
        let mut unsupported = Vec::new();
        let mut cursor = image_size;
        for name in externals {
            let Some(f) = runtime.and_then(|rt| rt.function(name)) else {
                let why = if runtime.is_none() && SERVES.iter().any(|(s, _)| s == name) {
                    format!("APEX's device runtime is built for Hopper only, not sm_{sm}")
                } else {
                    unsupported_extern_reason(name).to_owned()
                };
                unsupported.push(CubinError::UnsupportedExtern {
                    symbol: name.clone(),
                    why,
                });
                continue;
            };
            // Code sections are 128-byte aligned, as ptxas aligns them.
            let at = cursor.next_multiple_of(128);
            cursor = at + f.code_size();
            placed.push((f, at));
        }
        RuntimePlan {
            link: (!placed.is_empty()).then_some(RuntimeLink {
                placed,
                image_size: cursor,
            }),
            unsupported,
        }
    }

    /// The GPU address of the function serving `name`, for an image at `base_va`.
    pub fn address(&self, base_va: u64, name: &str) -> Option<u64> {
        self.placed
            .iter()
            .find(|(f, _)| f.serves == name)
            .map(|(_, at)| base_va + at)
    }

    /// The functions linked on their own: the image offset of the first and the bytes from there to the end of
    /// the image.
    pub fn link_region(&self, fifo_va: u64) -> Result<(u64, Vec<u8>), CubinError> {
        let start = self
            .placed
            .iter()
            .map(|(_, at)| *at)
            .min()
            .unwrap_or(self.image_size);
        let len =
            usize::try_from(self.image_size - start).map_err(|_| bad_runtime("size overflows"))?;
        let mut region = vec![0u8; len];
        for (f, at) in &self.placed {
            f.link_into(&mut region, at - start, fifo_va)?;
        }
        Ok((start, region))
    }

    /// Registers and stack a kernel calling `externs` needs, given its own; `None` when the cubin does not say
    /// which externals each kernel calls (every appended function counts then).
    pub fn kernel_needs(
        &self,
        externs: Option<&[String]>,
        registers: u32,
        stack: u32,
    ) -> (u32, u32) {
        let called = self
            .placed
            .iter()
            .map(|(f, _)| *f)
            .filter(|f| externs.is_none_or(|e| e.iter().any(|n| n == f.serves)));
        let (mut regs, mut extra) = (registers, 0);
        for f in called {
            regs = regs.max(f.registers);
            extra = extra.max(f.stack);
        }
        (regs, stack + extra)
    }
}
