//! `printf` and `assert` in kernels on the direct path.
//!
//! nvcc compiles `printf(fmt, ...)` into a call of the external device function `vprintf(fmt, args)` (the
//! arguments packed in local memory, each at an offset aligned to its size) and `assert(e)` into a call of
//! `__assertfail(message, file, line, function, char_size)`. Neither is in the module: the CUDA driver links its own
//! implementations at load time. APEX links its own instead: a device runtime written in CUDA C
//! (`kernels/apex_printf.cu`, compiled relocatable by `kernels/build.sh` and committed), whose two functions
//! follow the same calling convention ptxas assumes for the driver's (checked against the SASS ptxas emits around
//! the call: arguments in R4.., return address in R20, R2 and R16–R31 preserved; the runtime is compiled with the
//! same ABI, saves what it uses and touches no constant bank but bank 0's driver words). [`DeviceRuntime`]
//! reads that object; [`super::Module`] appends the functions a module calls to its image and points the
//! module's references at them.
//!
//! The runtime writes one record per call into a ring in video memory, a [`PrintfFifo`] shared by the modules of
//! one GPU (the size is set before first use, as `cudaLimitPrintfFifoSize`; 1 MiB by default, as CUDA). The host
//! drains it when a queue synchronizes, when a fence is waited on through the public API, and when a queue is
//! dropped, and prints each record to standard output formatted as C's `printf` would (the C library formats each
//! conversion). Records that do not fit are dropped, as CUDA drops output past a full buffer; the count is logged.
//! A failed `assert` writes its record and traps: the channel faults, and the wait that sees the fault returns
//! [`launch::Error::Assert`](crate::launch::Error::Assert) naming the message, file, line, function, block and
//! thread. With [`AssertAction::EndThread`] it writes its record, sets a word in host memory and ends its thread
//! instead, so the channel (and the channel group it shares, a CUDA context's when attached) lives on; the next wait
//! returns the same error, or a host that reports asserts itself takes the records ([`PrintfFifo::take_asserts`]).
//!
//! This file is one unit: the runtime linked into a module at load time, the FIFO its code writes to (created when
//! the first module that needs it loads, so it lives here, beside the loader, on `rm` memory only), and the host's
//! reading of the records. The launch layer decides when to drain: `launch::settle` (on a synchronize, a wait, a
//! dropped queue) drains the FIFO and turns a fault caused by an assertion into
//! [`launch::AssertError`](crate::launch::AssertError), which holds the channel's fault and so lives in `launch`.
//!
//! Record layout (little-endian, 8-byte fields, each record a multiple of 8 bytes):
//! - `u32 kind` (1 printf, 2 assert; written last, after a fence), `u32 bytes of the record`;
//! - printf: the format string, NUL-terminated, padded to 8; then one slot per argument, in format order: 8 bytes
//!   for an integer, double or pointer (as the caller packed it, zero-extended), and for `%s` a `u64` length
//!   (`u64::MAX` for a null pointer) then the bytes, padded to 8;
//! - assert: `u64 line`, `u64 block.x | block.y << 32`, `u64 block.z | thread.x << 32`, `u64 thread.y | thread.z
//!   << 32`, then the message, file and function as `%s` slots.

use std::ffi::{CString, c_char, c_int};
use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, Rela as _, SectionHeader, Sym as _};
use tracing::{debug, warn};

use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::cubin::{self, CubinError, EM_CUDA, reloc};

type Elf = elf::FileHeader64<LittleEndian>;

/// The FIFO size when none is set: 1 MiB, as CUDA's default `cudaLimitPrintfFifoSize`.
pub const DEFAULT_FIFO_BYTES: u64 = 1 << 20;
/// Bytes before the ring: `tail`, `head`, `capacity`, `dropped`, reserved.
const HEADER_BYTES: u64 = 64;
const TAIL: u64 = 0;
const HEAD: u64 = 8;
const CAPACITY: u64 = 16;
const DROPPED: u64 = 24;
/// Header word the runtime reads at a failed `assert`: [`FLAG_ASSERT_ENDS_THREAD`].
const FLAGS: u64 = 32;
/// Header word holding the GPU address of the host word a failed `assert` sets (0: none).
const ASSERT_FLAG: u64 = 40;
/// In [`FLAGS`]: a failed `assert` ends its thread instead of trapping ([`AssertAction::EndThread`]).
const FLAG_ASSERT_ENDS_THREAD: u64 = 1;
/// Smallest ring: a record with a long format string must fit.
const MIN_FIFO_BYTES: u64 = 4096;
/// Largest ring: the record size field is 32 bits.
const MAX_FIFO_BYTES: u64 = 1 << 31;

const KIND_PRINTF: u32 = 1;
const KIND_ASSERT: u32 = 2;

/// The symbol the runtime's code refers to for the ring's header.
const FIFO_SYMBOL: &str = "apex_fifo";

/// The runtime for Hopper (sm_90; the same SASS runs in sm_90a modules).
static RUNTIME_SM90: &[u8] = include_bytes!("../../kernels/apex_printf.sm_90.cubin");

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
struct RuntimeReloc {
    offset: u64,
    kind: u32,
    symbol: String,
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
    relocs: Vec<RuntimeReloc>,
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

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
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

    /// Writes the functions into `image` (already linked for `base_va`).
    pub fn link(&self, image: &mut [u8], fifo_va: u64) -> Result<(), CubinError> {
        for (f, at) in &self.placed {
            f.link_into(image, *at, fifo_va)?;
        }
        Ok(())
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

/// How a failed device-side `assert` ends, in kernels launched on the direct path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AssertAction {
    /// The failing thread traps, as in CUDA: its channel faults (and with it the channel group the queue shares),
    /// and the wait that sees the fault returns [`launch::Error::Assert`](crate::launch::Error::Assert). The
    /// default.
    #[default]
    Trap,
    /// The failing thread records the failure, sets a word in host memory and ends; the rest of the grid and the
    /// queue go on, and no channel faults. The next wait that drains the FIFO returns
    /// [`launch::Error::Assert`](crate::launch::Error::Assert) (without a fault), or a host that reports asserts its
    /// own way checks
    /// [`PrintfFifo::assert_seen`] and takes them with [`PrintfFifo::take_asserts`] (apex-preload replays them
    /// through the CUDA driver, so that the program sees CUDA's own report).
    EndThread,
}

/// One argument of a device `printf`, as the record holds it.
#[derive(Clone, Debug, PartialEq)]
pub enum PrintfArg {
    /// 8 bytes as the caller packed them (zero-extended from 4 for `int`-sized arguments).
    Word(u64),
    /// A `%s` string's bytes; `None` for a null pointer.
    Str(Option<Vec<u8>>),
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

/// What a conversion takes from the record: the device runtime's view of C's format syntax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Consumes {
    Word,
    Str,
}

/// One piece of a format string.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece<'a> {
    Literal(&'a [u8]),
    Percent,
    Spec(Spec<'a>),
}

/// A conversion specification, split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Spec<'a> {
    flags: &'a [u8],
    /// `Some(None)` for `*`.
    width: Option<Option<&'a [u8]>>,
    precision: Option<Option<&'a [u8]>>,
    /// Whether a length modifier makes an integer 64-bit (`l`, `ll`, `z`, `j`, `t`, `q`, `L`).
    wide: bool,
    length: &'a [u8],
    conversion: u8,
    /// The whole text, for conversions C does not know (printed as written).
    text: &'a [u8],
}

/// Splits a format string as the device runtime walks it (the two must agree on what each conversion consumes).
fn pieces(fmt: &[u8]) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    let mut lit = 0;
    while i < fmt.len() {
        if fmt[i] != b'%' {
            i += 1;
            continue;
        }
        if lit < i {
            out.push(Piece::Literal(&fmt[lit..i]));
        }
        let start = i;
        i += 1;
        if fmt.get(i) == Some(&b'%') {
            out.push(Piece::Percent);
            i += 1;
            lit = i;
            continue;
        }
        let f0 = i;
        while matches!(fmt.get(i), Some(b'-' | b'+' | b' ' | b'#' | b'0' | b'\'')) {
            i += 1;
        }
        let flags = &fmt[f0..i];
        let number = |i: &mut usize| -> Option<Option<&[u8]>> {
            if fmt.get(*i) == Some(&b'*') {
                *i += 1;
                return Some(None);
            }
            let s = *i;
            while fmt.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            (s < *i).then(|| Some(&fmt[s..*i]))
        };
        let width = number(&mut i);
        let precision = if fmt.get(i) == Some(&b'.') {
            i += 1;
            Some(number(&mut i).unwrap_or(Some(&b"0"[..])))
        } else {
            None
        };
        let l0 = i;
        let mut wide = false;
        while let Some(&c) = fmt.get(i) {
            match c {
                b'l' | b'z' | b'j' | b't' | b'q' | b'L' => wide = true,
                b'h' => {}
                _ => break,
            }
            i += 1;
        }
        let length = &fmt[l0..i];
        let Some(&conversion) = fmt.get(i) else {
            // A trailing, unfinished specification: the runtime stops there too.
            out.push(Piece::Literal(&fmt[start..]));
            lit = fmt.len();
            break;
        };
        i += 1;
        out.push(Piece::Spec(Spec {
            flags,
            width,
            precision,
            wide,
            length,
            conversion,
            text: &fmt[start..i],
        }));
        lit = i;
    }
    if lit < fmt.len() {
        out.push(Piece::Literal(&fmt[lit..]));
    }
    out
}

fn is_integer(c: u8) -> bool {
    matches!(c, b'd' | b'i' | b'u' | b'o' | b'x' | b'X' | b'c')
}

fn is_float(c: u8) -> bool {
    matches!(c, b'f' | b'F' | b'e' | b'E' | b'g' | b'G' | b'a' | b'A')
}

/// What each argument-consuming conversion of `fmt` takes, in order (`*` widths and precisions included).
fn conversions(fmt: &[u8]) -> Vec<Consumes> {
    let mut out = Vec::new();
    for p in pieces(fmt) {
        let Piece::Spec(s) = p else { continue };
        let known = is_integer(s.conversion)
            || is_float(s.conversion)
            || matches!(s.conversion, b'p' | b'n' | b's');
        if s.width == Some(None) {
            out.push(Consumes::Word);
        }
        if s.precision == Some(None) {
            out.push(Consumes::Word);
        }
        if known {
            out.push(if s.conversion == b's' {
                Consumes::Str
            } else {
                Consumes::Word
            });
        }
    }
    out
}

unsafe extern "C" {
    /// The C library's formatter: device output is formatted exactly as C's `printf` formats it.
    fn snprintf(s: *mut c_char, n: usize, format: *const c_char, ...) -> c_int;
}

/// Value passed to `snprintf` for one conversion.
enum CArg<'a> {
    Int(c_int),
    Long(i64),
    Double(f64),
    Ptr(u64),
    Str(&'a CString),
}

/// Formats one conversion with the C library. `spec` is a complete `%...` specification without `*`.
fn c_format(spec: &[u8], arg: CArg<'_>, out: &mut Vec<u8>) {
    let Ok(spec) = CString::new(spec) else {
        return;
    };
    let mut buf = vec![0u8; 128];
    for _ in 0..2 {
        let p = buf.as_mut_ptr().cast::<c_char>();
        let n = buf.len();
        // SAFETY: `buf` is writable for `n` bytes; `spec` is a NUL-terminated format holding exactly one
        // conversion, built above to take exactly the type passed here (int, long long, double, pointer or a
        // NUL-terminated string that outlives the call).
        let written = unsafe {
            match arg {
                CArg::Int(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Long(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Double(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Ptr(v) => {
                    snprintf(p, n, spec.as_ptr(), v as usize as *const std::ffi::c_void)
                }
                CArg::Str(s) => snprintf(p, n, spec.as_ptr(), s.as_ptr()),
            }
        };
        let Ok(len) = usize::try_from(written) else {
            return;
        };
        if len < n {
            out.extend_from_slice(&buf[..len]);
            return;
        }
        buf.resize(len + 1, 0);
    }
}

/// Largest width or precision a conversion is formatted with.
const MAX_FIELD: i32 = 4096;

/// Formats a device `printf` record as C's `printf` would have (widths and precisions above 4096 are cut to it).
pub fn format_printf(format: &[u8], args: &[PrintfArg]) -> Vec<u8> {
    let mut out = Vec::with_capacity(format.len() + 16 * args.len());
    let mut args = args.iter();
    fn next_word<'a>(args: &mut impl Iterator<Item = &'a PrintfArg>) -> Option<u64> {
        match args.next() {
            Some(PrintfArg::Word(w)) => Some(*w),
            _ => None,
        }
    }
    for piece in pieces(format) {
        let s = match piece {
            Piece::Literal(l) => {
                out.extend_from_slice(l);
                continue;
            }
            Piece::Percent => {
                out.push(b'%');
                continue;
            }
            Piece::Spec(s) => s,
        };
        // Widths and precisions are bounded (a device could ask for a gigabyte of padding); `*` takes an int.
        let star = |v: Option<u64>| {
            (v.unwrap_or(0) as u32 as i32)
                .clamp(-MAX_FIELD, MAX_FIELD)
                .to_string()
                .into_bytes()
        };
        let digits = |d: &[u8]| {
            let v = std::str::from_utf8(d)
                .ok()
                .and_then(|t| t.parse::<i32>().ok())
                .unwrap_or(MAX_FIELD);
            v.min(MAX_FIELD).to_string().into_bytes()
        };
        let width = match s.width {
            Some(None) => Some(star(next_word(&mut args))),
            Some(Some(w)) => Some(digits(w)),
            None => None,
        };
        let precision = match s.precision {
            Some(None) => Some(star(next_word(&mut args))),
            Some(Some(p)) => Some(digits(p)),
            None => None,
        };
        let c = s.conversion;
        if !(is_integer(c) || is_float(c) || matches!(c, b'p' | b'n' | b's')) {
            out.extend_from_slice(s.text);
            continue;
        }
        let mut spec = vec![b'%'];
        spec.extend_from_slice(s.flags);
        if let Some(w) = &width {
            spec.extend_from_slice(w);
        }
        if let Some(p) = &precision {
            spec.push(b'.');
            spec.extend_from_slice(p);
        }
        match c {
            b'n' => {
                next_word(&mut args); // consumed, never written through
                continue;
            }
            b's' => {
                let text = match args_next_str(&mut args) {
                    Some(Some(bytes)) => bytes,
                    _ => b"(null)".to_vec(),
                };
                let Ok(text) = CString::new(
                    text.into_iter()
                        .take_while(|&b| b != 0)
                        .collect::<Vec<u8>>(),
                ) else {
                    continue;
                };
                spec.push(b's');
                c_format(&spec, CArg::Str(&text), &mut out);
            }
            b'p' => {
                spec.push(b'p');
                c_format(
                    &spec,
                    CArg::Ptr(next_word(&mut args).unwrap_or(0)),
                    &mut out,
                );
            }
            c if is_float(c) => {
                spec.push(c);
                c_format(
                    &spec,
                    CArg::Double(f64::from_bits(next_word(&mut args).unwrap_or(0))),
                    &mut out,
                );
            }
            c => {
                let v = next_word(&mut args).unwrap_or(0);
                if s.wide && c != b'c' {
                    spec.extend_from_slice(b"ll");
                    spec.push(c);
                    c_format(&spec, CArg::Long(v as i64), &mut out);
                } else {
                    // `h` and `hh` stay: C narrows the int as the device's printf would.
                    spec.extend_from_slice(if s.wide { b"" } else { s.length });
                    spec.push(c);
                    c_format(&spec, CArg::Int(v as u32 as c_int), &mut out);
                }
            }
        }
    }
    out
}

/// Takes the next argument as a string (`None` when it is not one).
fn args_next_str<'a>(args: &mut impl Iterator<Item = &'a PrintfArg>) -> Option<Option<Vec<u8>>> {
    match args.next() {
        Some(PrintfArg::Str(s)) => Some(s.clone()),
        _ => None,
    }
}

/// What one drain found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Drained {
    /// `printf` records printed.
    pub printed: usize,
    /// Failed assertions (also printed to standard error, as CUDA reports them).
    pub asserts: Vec<AssertFailure>,
    /// Records dropped for lack of room since the last drain.
    pub dropped: u64,
}

/// The ring the device runtime writes records into: one per GPU, shared by its modules and queues.
#[derive(Debug)]
pub struct PrintfFifo {
    memory: Memory,
    capacity: u64,
    /// Serializes drains; holds the drop count already reported.
    drain: Mutex<u64>,
    /// The host word a failed `assert` sets under [`AssertAction::EndThread`] (CPU-cached system memory: reading
    /// it costs what reading any cached word costs).
    seen: Memory,
    /// The [`AssertAction`] in force, as its [`FLAGS`] word.
    flags: AtomicU64,
}

impl PrintfFifo {
    /// A ring of `bytes` (rounded up to a power of two, at least 4 KiB, at most 2 GiB) in video memory.
    pub fn new(gpu: &Arc<GpuCore>, bytes: u64) -> crate::rm::Result<PrintfFifo> {
        let capacity = bytes
            .clamp(MIN_FIFO_BYTES, MAX_FIFO_BYTES)
            .next_power_of_two();
        let memory = Memory::alloc(gpu, MemoryDesc::video(HEADER_BYTES + capacity).with_cpu())?;
        memory.fill(0, HEADER_BYTES + capacity, 0)?;
        memory.write(CAPACITY, &capacity.to_le_bytes())?;
        let seen = Memory::alloc(
            gpu,
            MemoryDesc::video(8)
                .placement(Placement::SystemCached)
                .with_cpu(),
        )?;
        seen.write_u64_volatile(0, 0)?;
        memory.write(ASSERT_FLAG, &seen.va().to_le_bytes())?;
        debug!(
            capacity,
            va = format_args!("{:#x}", memory.va()),
            "printf FIFO"
        );
        Ok(PrintfFifo {
            memory,
            capacity,
            drain: Mutex::new(0),
            seen,
            flags: AtomicU64::new(0),
        })
    }

    /// Sets how a failed `assert` ends from now on (kernels already running may still see the previous action).
    pub fn set_assert_action(&self, action: AssertAction) -> crate::rm::Result<()> {
        let flags = match action {
            AssertAction::Trap => 0,
            AssertAction::EndThread => FLAG_ASSERT_ENDS_THREAD,
        };
        self.memory.write_u64_volatile(FLAGS, flags)?;
        self.flags.store(flags, Ordering::Relaxed);
        Ok(())
    }

    /// How a failed `assert` ends.
    pub fn assert_action(&self) -> AssertAction {
        if self.flags.load(Ordering::Relaxed) & FLAG_ASSERT_ENDS_THREAD != 0 {
            AssertAction::EndThread
        } else {
            AssertAction::Trap
        }
    }

    /// Whether a kernel failed an `assert` that ended its thread ([`AssertAction::EndThread`]) since
    /// [`take_asserts`](Self::take_asserts) last ran: one read of a CPU-cached word, cheap enough for every
    /// synchronization. Read it after the work that may have failed is known complete.
    pub fn assert_seen(&self) -> bool {
        self.seen.read_u64_volatile(0).is_ok_and(|v| v != 0)
    }

    /// Takes every complete record out of the ring: prints `printf` output to standard output, as
    /// [`drain`](Self::drain) does, and returns the failed assertions without printing them, for a host that
    /// reports them its own way. Clears the word [`assert_seen`](Self::assert_seen) reads first, so an assert that
    /// lands during the call is seen next time.
    pub fn take_asserts(&self) -> crate::rm::Result<Drained> {
        self.seen.write_u64_volatile(0, 0)?;
        std::sync::atomic::fence(Ordering::SeqCst);
        self.drain_with(false)
    }

    /// GPU address of the ring's header (what the runtime's `apex_fifo` resolves to).
    pub fn va(&self) -> u64 {
        self.memory.va()
    }

    /// Bytes of the ring.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Takes every complete record out of the ring, prints `printf` output to standard output and failed
    /// assertions to standard error, and returns what it found.
    pub fn drain(&self) -> crate::rm::Result<Drained> {
        self.drain_with(true)
    }

    fn drain_with(&self, print_asserts: bool) -> crate::rm::Result<Drained> {
        let records = self.take()?;
        let mut drained = Drained::default();
        let mut stdout = std::io::stdout().lock();
        for r in records.0 {
            match r {
                DeviceRecord::Printf { format, args } => {
                    let _ = stdout.write_all(&format_printf(&format, &args));
                    drained.printed += 1;
                }
                DeviceRecord::Assert(a) => {
                    if print_asserts {
                        let _ = stdout.flush();
                        let _ = writeln!(std::io::stderr(), "{a}");
                    }
                    drained.asserts.push(a);
                }
            }
        }
        let _ = stdout.flush();
        drained.dropped = records.1;
        if drained.dropped > 0 {
            warn!(
                dropped = drained.dropped,
                capacity = self.capacity,
                "device printf output did not fit the FIFO and was dropped; make it larger"
            );
        }
        Ok(drained)
    }

    /// Decodes and consumes the complete records; returns them and the records dropped since the last call.
    pub fn take(&self) -> crate::rm::Result<(Vec<DeviceRecord>, u64)> {
        let mut reported = self.drain.lock().unwrap_or_else(|p| p.into_inner());
        take_records(&self.memory, self.capacity, &mut reported)
    }
}

/// CPU access to the ring's memory: the GPU's (through BAR1) or, in tests, a buffer that plays the device.
pub trait RingMemory {
    /// A volatile 64-bit load at `offset`.
    fn load(&self, offset: u64) -> crate::rm::Result<u64>;
    /// A volatile 64-bit store at `offset`.
    fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()>;
    /// Copies bytes out at `offset`.
    fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()>;
    /// Zeroes `len` bytes at `offset`.
    fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()>;
}

impl RingMemory for Memory {
    fn load(&self, offset: u64) -> crate::rm::Result<u64> {
        self.read_u64_volatile(offset)
    }
    fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()> {
        self.write_u64_volatile(offset, value)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()> {
        Memory::read(self, offset, out)
    }
    fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()> {
        self.fill(offset, len, 0)
    }
}

/// The host's half of the ring protocol (the device's is `reserve`/`publish` in kernels/apex_printf.cu): takes
/// every published record from `head` on, zeroes what it consumed (so a later record's unwritten header reads as
/// "not ready"), then moves `head`. Stops at the first record reserved but not yet written.
pub fn take_records(
    m: &impl RingMemory,
    capacity: u64,
    reported: &mut u64,
) -> crate::rm::Result<(Vec<DeviceRecord>, u64)> {
    let mask = capacity - 1;
    let read_ring = |pos: u64, out: &mut [u8]| -> crate::rm::Result<()> {
        let at = pos & mask;
        let first = (capacity - at).min(out.len() as u64) as usize;
        let (a, b) = out.split_at_mut(first);
        m.read(HEADER_BYTES + at, a)?;
        if !b.is_empty() {
            m.read(HEADER_BYTES, b)?;
        }
        Ok(())
    };
    let consume = |pos: u64, len: u64| -> crate::rm::Result<()> {
        let at = pos & mask;
        let first = (capacity - at).min(len);
        m.zero(HEADER_BYTES + at, first)?;
        if len > first {
            m.zero(HEADER_BYTES, len - first)?;
        }
        Ok(())
    };
    let tail = m.load(TAIL)?;
    let head = m.load(HEAD)?;
    let dropped_total = m.load(DROPPED)?;
    let dropped = dropped_total.wrapping_sub(*reported);
    *reported = dropped_total;
    let mut out = Vec::new();
    if tail.wrapping_sub(head) > capacity {
        warn!(
            head,
            tail, "printf FIFO indices are inconsistent; its contents are discarded"
        );
        consume(0, capacity)?;
        m.store(HEAD, tail)?;
        return Ok((out, dropped));
    }
    let mut pos = head;
    while pos != tail {
        let first = m.load(HEADER_BYTES + (pos & mask))?;
        let (kind, len) = (first as u32, first >> 32);
        if kind == 0 {
            break; // reserved, not yet written: later records wait for it
        }
        if len < 8 || len % 8 != 0 || len > tail.wrapping_sub(pos) {
            warn!(
                kind,
                len, "corrupt printf record; the rest of the FIFO is discarded"
            );
            consume(pos, tail.wrapping_sub(pos))?;
            pos = tail;
            break;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        let mut rec = vec![0u8; len as usize];
        read_ring(pos, &mut rec)?;
        match decode_record(&rec) {
            Ok(r) => out.push(r),
            Err(e) => warn!(error = %e, "skipping a printf record"),
        }
        consume(pos, len)?;
        pos = pos.wrapping_add(len);
    }
    if pos != head {
        m.store(HEAD, pos)?;
    }
    Ok((out, dropped))
}

/// The printf FIFO of one GPU, created on first use with the size set before it (as CUDA fixes
/// `cudaLimitPrintfFifoSize` once a module that uses printf is loaded).
#[derive(Debug, Default)]
pub struct PrintfFifoCell {
    fifo: OnceLock<Arc<PrintfFifo>>,
    bytes: AtomicU64,
    /// [`AssertAction::EndThread`] asked for (applied when the FIFO is made, or at once if it exists).
    end_thread: std::sync::atomic::AtomicBool,
}

impl PrintfFifoCell {
    /// An empty cell; the FIFO will have [`DEFAULT_FIFO_BYTES`] unless set otherwise first.
    pub fn new() -> PrintfFifoCell {
        PrintfFifoCell::default()
    }

    /// Sets the FIFO's size. Fails once the FIFO exists (a module that uses printf has been loaded).
    pub fn set_size(&self, bytes: u64) -> Result<(), u64> {
        match self.fifo.get() {
            Some(f) => Err(f.capacity()),
            None => {
                self.bytes.store(bytes, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Sets how a failed `assert` ends, for the FIFO now or when it is made.
    pub fn set_assert_action(&self, action: AssertAction) -> crate::rm::Result<()> {
        self.end_thread
            .store(action == AssertAction::EndThread, Ordering::SeqCst);
        match self.fifo.get() {
            Some(f) => f.set_assert_action(action),
            None => Ok(()),
        }
    }

    /// The FIFO, created now if it does not exist yet.
    pub fn get_or_create(&self, gpu: &Arc<GpuCore>) -> crate::rm::Result<Arc<PrintfFifo>> {
        if let Some(f) = self.fifo.get() {
            return Ok(f.clone());
        }
        let bytes = match self.bytes.load(Ordering::Relaxed) {
            0 => DEFAULT_FIFO_BYTES,
            b => b,
        };
        let fifo = Arc::new(PrintfFifo::new(gpu, bytes)?);
        // Two threads may race here: the loser's ring is dropped unused.
        let fifo = self.fifo.get_or_init(|| fifo).clone();
        if self.end_thread.load(Ordering::SeqCst) {
            fifo.set_assert_action(AssertAction::EndThread)?;
        }
        Ok(fifo)
    }

    /// The FIFO, if it exists.
    pub fn get(&self) -> Option<&Arc<PrintfFifo>> {
        self.fifo.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32, body: &[u8]) -> Vec<u8> {
        let len = (8 + body.len()).next_multiple_of(8);
        let mut r = Vec::with_capacity(len);
        r.extend_from_slice(&(u64::from(kind) | ((len as u64) << 32)).to_le_bytes());
        r.extend_from_slice(body);
        r.resize(len, 0);
        r
    }

    fn fmt_slot(f: &str) -> Vec<u8> {
        let mut v = f.as_bytes().to_vec();
        v.push(0);
        v.resize(v.len().next_multiple_of(8), 0);
        v
    }

    fn str_slot(s: Option<&str>) -> Vec<u8> {
        match s {
            None => u64::MAX.to_le_bytes().to_vec(),
            Some(s) => {
                let mut v = (s.len() as u64).to_le_bytes().to_vec();
                v.extend_from_slice(s.as_bytes());
                v.resize(8 + s.len().next_multiple_of(8), 0);
                v
            }
        }
    }

    #[test]
    fn formats_like_c() {
        let f = |fmt: &str, args: &[PrintfArg]| {
            String::from_utf8(format_printf(fmt.as_bytes(), args)).unwrap()
        };
        use PrintfArg::Word as W;
        assert_eq!(f("i=%d\n", &[W(-5i32 as u32 as u64)]), "i=-5\n");
        assert_eq!(
            f("%u %x %#X %o", &[W(255), W(255), W(255), W(8)]),
            "255 ff 0XFF 10"
        );
        assert_eq!(
            f("%lld %llu", &[W(-3i64 as u64), W(u64::MAX)]),
            "-3 18446744073709551615"
        );
        assert_eq!(f("%ld|%zu", &[W(-1i64 as u64), W(7)]), "-1|7");
        assert_eq!(
            f(
                "%.3f %e %g",
                &[
                    W(1.5f64.to_bits()),
                    W(2.0f64.to_bits()),
                    W(0.5f64.to_bits())
                ]
            ),
            "1.500 2.000000e+00 0.5"
        );
        assert_eq!(
            f("[%8d] [%-8d] [%+d]", &[W(42), W(42), W(42)]),
            "[      42] [42      ] [+42]"
        );
        assert_eq!(
            f("[%*d] [%.*f]", &[W(6), W(42), W(2), W(1.239f64.to_bits())]),
            "[    42] [1.24]"
        );
        assert_eq!(f("%hd %hhu", &[W(0x1_0005), W(0x1ff)]), "5 255");
        assert_eq!(f("%c%c", &[W(b'o' as u64), W(b'k' as u64)]), "ok");
        assert_eq!(
            f("100%% %s", &[PrintfArg::Str(Some(b"done".to_vec()))]),
            "100% done"
        );
        assert_eq!(
            f("[%10.4s]", &[PrintfArg::Str(Some(b"truncate".to_vec()))]),
            "[      trun]"
        );
        assert_eq!(f("%s", &[PrintfArg::Str(None)]), "(null)");
        assert_eq!(f("%p", &[W(0x1000)]), "0x1000");
        assert_eq!(f("%y %d", &[W(1)]), "%y 1");
        assert_eq!(f("tail %", &[]), "tail %");
        // Missing arguments print as zero rather than reading anything else.
        assert_eq!(f("%d %s", &[]), "0 (null)");
        // Huge fields are bounded.
        assert_eq!(f("%999999999d", &[W(1)]).len(), MAX_FIELD as usize);
        assert_eq!(f("%*d", &[W(1 << 30), W(1)]).len(), MAX_FIELD as usize);
        assert_eq!(
            f("%.99999999f", &[W(1.0f64.to_bits())]).len(),
            MAX_FIELD as usize + 2
        );
    }

    #[test]
    fn conversions_match_the_device_walk() {
        use Consumes::*;
        assert_eq!(
            conversions(b"%d %s %*.*f %% %p %n %lld %y"),
            vec![Word, Str, Word, Word, Word, Word, Word, Word]
        );
        assert_eq!(conversions(b"none"), vec![]);
    }

    #[test]
    fn decodes_printf_and_assert_records() {
        let mut body = fmt_slot("a %d %s %s\n");
        body.extend_from_slice(&7u64.to_le_bytes());
        body.extend(str_slot(Some("xyz123456")));
        body.extend(str_slot(None));
        let r = decode_record(&record(KIND_PRINTF, &body)).unwrap();
        let DeviceRecord::Printf { format, args } = r else {
            panic!("{r:?}")
        };
        assert_eq!(format, b"a %d %s %s\n");
        assert_eq!(
            String::from_utf8(format_printf(&format, &args)).unwrap(),
            "a 7 xyz123456 (null)\n"
        );

        let mut body = Vec::new();
        body.extend_from_slice(&42u64.to_le_bytes());
        body.extend_from_slice(&(1u64 | 2 << 32).to_le_bytes());
        body.extend_from_slice(&(3u64 | 4 << 32).to_le_bytes());
        body.extend_from_slice(&(5u64 | 6 << 32).to_le_bytes());
        body.extend(str_slot(Some("x != bad")));
        body.extend(str_slot(Some("k.cu")));
        body.extend(str_slot(Some("void k(int)")));
        let DeviceRecord::Assert(a) = decode_record(&record(KIND_ASSERT, &body)).unwrap() else {
            panic!()
        };
        assert_eq!(
            a.to_string(),
            "k.cu:42: void k(int): block: [1,2,3], thread: [4,5,6] Assertion `x != bad` failed."
        );
    }

    #[test]
    fn corrupt_records_are_errors() {
        assert!(decode_record(&[]).is_err());
        assert!(decode_record(&record(9, b"")).is_err());
        assert!(decode_record(&record(KIND_PRINTF, b"8 bytes!")).is_err());
        let mut body = fmt_slot("%s");
        body.extend_from_slice(&1000u64.to_le_bytes());
        assert!(decode_record(&record(KIND_PRINTF, &body)).is_err());
        assert!(decode_record(&record(KIND_ASSERT, &[0; 16])).is_err());
    }

    #[test]
    fn the_committed_runtime_parses() {
        let rt = DeviceRuntime::parse(RUNTIME_SM90).unwrap();
        assert_eq!(rt.sm_version(), 90);
        let v = rt.function("vprintf").unwrap();
        let a = rt.function("__assertfail").unwrap();
        assert_eq!(
            (v.name.as_str(), a.name.as_str()),
            ("apex_vprintf", "apex_assertfail")
        );
        // Built with -maxrregcount=32 so it raises few kernels' register counts.
        assert!(
            v.registers <= 32 && a.registers <= 32,
            "{} {}",
            v.registers,
            a.registers
        );
        assert!(!v.relocs.is_empty() && v.relocs.iter().all(|r| r.symbol == FIFO_SYMBOL));
        assert!(v.code_size() > 0 && v.code_size().is_multiple_of(16));
    }

    #[test]
    fn plan_refuses_unknown_externs_and_raises_kernels() {
        let both = ["malloc".to_owned(), "vprintf".to_owned()];
        let p = RuntimeLink::plan(90, &both, 0x100);
        assert_eq!(p.unsupported.len(), 1);
        let e = &p.unsupported[0];
        assert!(
            e.to_string().contains("malloc") && e.to_string().contains("APEX_BACKEND=driver"),
            "{e}"
        );
        // Only kernels that call the unsupported symbol are refused.
        assert!(p.refusal_for(&both[..1]).is_some());
        assert!(p.refusal_for(&both[1..]).is_none());
        assert!(p.link.is_some_and(|l| l.address(0, "vprintf").is_some()));
        let p = RuntimeLink::plan(80, &["vprintf".to_owned()], 0x100);
        assert!(p.link.is_none());
        assert!(
            p.unsupported[0].to_string().contains("Hopper"),
            "{}",
            p.unsupported[0]
        );
        assert!(RuntimeLink::plan(90, &[], 0).link.is_none());
        let plan = RuntimeLink::plan(90, &["vprintf".to_owned()], 0x104)
            .link
            .unwrap();
        assert_eq!(plan.placed[0].1, 0x180);
        assert_eq!(plan.address(0x1000, "vprintf"), Some(0x1180));
        let (regs, stack) = plan.kernel_needs(Some(&["vprintf".to_owned()]), 24, 16);
        assert_eq!(regs, 32);
        assert!(stack > 16);
        assert_eq!(
            plan.kernel_needs(Some(&["vprintf".to_owned()]), 40, 0).0,
            40
        );
        // A kernel that calls nothing keeps its own needs.
        assert_eq!(plan.kernel_needs(Some(&[]), 24, 16), (24, 16));
        assert_eq!(plan.kernel_needs(None, 24, 16).0, 32);
    }

    /// Plays the device's half of the ring in host memory, as kernels/apex_printf.cu does.
    struct FakeRing {
        bytes: std::cell::RefCell<Vec<u8>>,
        capacity: u64,
    }

    impl FakeRing {
        fn new(capacity: u64) -> FakeRing {
            let r = FakeRing {
                bytes: std::cell::RefCell::new(vec![0; (HEADER_BYTES + capacity) as usize]),
                capacity,
            };
            r.store(CAPACITY, capacity).unwrap();
            r
        }

        /// `reserve` + writes, without `publish` (the header stays zero) when `publish` is false.
        fn device_write(&self, rec: &[u8], publish: bool) -> bool {
            let len = rec.len() as u64;
            let (tail, head) = (self.load(TAIL).unwrap(), self.load(HEAD).unwrap());
            if tail + len - head > self.capacity {
                self.store(DROPPED, self.load(DROPPED).unwrap() + 1)
                    .unwrap();
                return false;
            }
            self.store(TAIL, tail + len).unwrap();
            let mut b = self.bytes.borrow_mut();
            for (i, byte) in rec.iter().enumerate().skip(8) {
                b[(HEADER_BYTES + ((tail + i as u64) & (self.capacity - 1))) as usize] = *byte;
            }
            if publish {
                for (i, byte) in rec.iter().enumerate().take(8) {
                    b[(HEADER_BYTES + ((tail + i as u64) & (self.capacity - 1))) as usize] = *byte;
                }
            }
            true
        }

        fn publish_at(&self, pos: u64, rec: &[u8]) {
            let mut b = self.bytes.borrow_mut();
            for (i, byte) in rec.iter().enumerate().take(8) {
                b[(HEADER_BYTES + ((pos + i as u64) & (self.capacity - 1))) as usize] = *byte;
            }
        }
    }

    impl RingMemory for FakeRing {
        fn load(&self, offset: u64) -> crate::rm::Result<u64> {
            let b = self.bytes.borrow();
            Ok(u64_at(&b, offset as usize).unwrap())
        }
        fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()> {
            self.bytes.borrow_mut()[offset as usize..offset as usize + 8]
                .copy_from_slice(&value.to_le_bytes());
            Ok(())
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()> {
            out.copy_from_slice(&self.bytes.borrow()[offset as usize..offset as usize + out.len()]);
            Ok(())
        }
        fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()> {
            self.bytes.borrow_mut()[offset as usize..(offset + len) as usize].fill(0);
            Ok(())
        }
    }

    fn line(n: u64) -> Vec<u8> {
        let mut body = fmt_slot("n=%d\n");
        body.extend_from_slice(&n.to_le_bytes());
        record(KIND_PRINTF, &body)
    }

    fn texts(recs: &[DeviceRecord]) -> Vec<String> {
        recs.iter()
            .map(|r| match r {
                DeviceRecord::Printf { format, args } => {
                    String::from_utf8(format_printf(format, args)).unwrap()
                }
                DeviceRecord::Assert(a) => a.to_string(),
            })
            .collect()
    }

    #[test]
    fn ring_wraps_waits_for_unpublished_records_and_counts_drops() {
        let ring = FakeRing::new(128); // each line record is 24 bytes
        let mut reported = 0;
        for n in 0..5 {
            assert!(ring.device_write(&line(n), true));
        }
        // 120 of 128 bytes used: the sixth does not fit and is dropped.
        assert!(!ring.device_write(&line(5), true));
        let (recs, dropped) = take_records(&ring, 128, &mut reported).unwrap();
        assert_eq!(texts(&recs), ["n=0\n", "n=1\n", "n=2\n", "n=3\n", "n=4\n"]);
        assert_eq!(dropped, 1);
        // Consumed bytes are zero again, head moved up to tail.
        assert_eq!(ring.load(HEAD).unwrap(), 120);
        assert!(
            ring.bytes.borrow()[HEADER_BYTES as usize..]
                .iter()
                .all(|&b| b == 0)
        );

        // Records that straddle the end of the ring; one reserved but not yet written blocks the ones after it.
        assert!(ring.device_write(&line(6), true)); // 120..144: wraps
        let pending_at = ring.load(TAIL).unwrap();
        assert!(ring.device_write(&line(7), false));
        assert!(ring.device_write(&line(8), true));
        let (recs, dropped) = take_records(&ring, 128, &mut reported).unwrap();
        assert_eq!((texts(&recs), dropped), (vec!["n=6\n".to_owned()], 0));
        ring.publish_at(pending_at, &line(7));
        let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
        assert_eq!(texts(&recs), ["n=7\n", "n=8\n"]);
        assert_eq!(ring.load(HEAD).unwrap(), ring.load(TAIL).unwrap());
    }

    #[test]
    fn ring_discards_corrupt_contents_without_hanging() {
        let ring = FakeRing::new(128);
        let mut reported = 0;
        let mut bad = line(1);
        bad[4..8].copy_from_slice(&1000u32.to_le_bytes()); // a length past the tail
        assert!(ring.device_write(&bad, true));
        let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
        assert!(recs.is_empty());
        assert_eq!(ring.load(HEAD).unwrap(), ring.load(TAIL).unwrap());
        assert!(ring.device_write(&line(2), true));
        let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
        assert_eq!(texts(&recs), ["n=2\n"]);
        // Indices further apart than the ring: everything is discarded and head catches up.
        ring.store(TAIL, 10_000).unwrap();
        let (recs, _) = take_records(&ring, 128, &mut reported).unwrap();
        assert!(recs.is_empty());
        assert_eq!(ring.load(HEAD).unwrap(), 10_000);
    }
}
