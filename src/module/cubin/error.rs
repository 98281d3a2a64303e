//! The errors of reading and linking a cubin.

use super::EM_CUDA;

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
    /// A kernel (or code it calls) uses texture or surface objects: their descriptors live in the texture header
    /// pool the CUDA driver binds in its own channels, which APEX's channels do not have.
    #[error(
        "kernel `{kernel}` uses {kind} instructions ({section} at offset {offset:#x}), whose texture and surface \
         objects live in the CUDA driver's texture header pool, which the direct path does not bind; launch it \
         through CUDA (the CUDA driver backend, APEX_BACKEND=driver)"
    )]
    TextureInstructions {
        /// The kernel.
        kernel: String,
        /// `texture` or `surface`.
        kind: &'static str,
        /// The code section holding the first such instruction.
        section: String,
        /// Its byte offset in that section.
        offset: u64,
    },
    /// A kernel's parameter table (`EIATTR_KPARAM_INFO`) does not describe its parameter block: a launch would pack
    /// the arguments wrongly.
    #[error(
        "kernel `{kernel}`: {why}; APEX packs arguments by that table, so it does not launch the kernel from it: \
         launch it through CUDA (the CUDA driver backend, APEX_BACKEND=driver)"
    )]
    ParameterTable {
        /// The kernel.
        kernel: String,
        /// What is wrong with the table.
        why: String,
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

pub(super) fn corrupt(what: impl Into<String>) -> CubinError {
    CubinError::Corrupt { what: what.into() }
}
