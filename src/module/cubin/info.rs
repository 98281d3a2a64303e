//! What a parsed cubin describes: its kernels (parameters, constant banks), module variables and image sections,
//! and variables placed outside the image.

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
    /// What is wrong with the parameter table, if it does not describe the parameter block: no records for a block
    /// of some bytes, a parameter reaching past the block's end, or two overlapping. A launch packs the arguments by
    /// this table, so a kernel whose table cannot be trusted must not be launched from it.
    pub fn parameter_table_problem(&self) -> Option<String> {
        let block = self.param_cbank_size;
        if block > 0 && self.params.is_empty() {
            return Some(format!(
                "no parameter records for its {block}-byte parameter block"
            ));
        }
        if block > 0
            && let Some(p) = self
                .params
                .iter()
                .find(|p| p.offset.checked_add(p.size).is_none_or(|end| end > block))
        {
            return Some(format!(
                "parameter {} ({} bytes at offset {}) ends past its {block}-byte parameter block",
                p.ordinal, p.size, p.offset
            ));
        }
        let overlap = |a: &ParamInfo, b: &ParamInfo| {
            (a.offset.saturating_add(a.size) > b.offset).then(|| {
                format!(
                    "parameters {} and {} overlap (offsets {} and {}, {} bytes at the first)",
                    a.ordinal, b.ordinal, a.offset, b.offset, a.size
                )
            })
        };
        // Checked for every kernel at every module load: the parameters are almost always in offset order already,
        // and then nothing is allocated.
        if self.params.windows(2).all(|w| w[0].offset <= w[1].offset) {
            return self.params.windows(2).find_map(|w| overlap(&w[0], &w[1]));
        }
        let mut by_offset: Vec<&ParamInfo> = self.params.iter().collect();
        by_offset.sort_by_key(|p| p.offset);
        by_offset.windows(2).find_map(|w| overlap(w[0], w[1]))
    }

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
    /// `STB_LOCAL` binding: visible inside the module only (a `static` variable, a constant the compiler made);
    /// `cuModuleGetGlobal` may not find it.
    pub local: bool,
}

impl GlobalSymbol {
    /// Whether the variable is `__constant__` data: it lives in a constant bank's section, which launches bind
    /// (bank 3 for `__constant__` variables) and read through the SM's constant caches.
    pub fn is_constant(&self) -> bool {
        self.section.starts_with(".nv.constant")
    }

    /// Whether the variable is a constant the compiler made of the source (a string literal, the
    /// `__PRETTY_FUNCTION__` an `assert` passes on, a constant aggregate): module-local and named as compilers name
    /// them — `__unnamed_<n>` (NVVM, LLVM's NVPTX backend), `$str` and `$str$<n>` (NVVM), `_$_str` and
    /// `_$_str_$_<n>` (LLVM's NVPTX backend: clang, Triton's libdevice). The source cannot name or write them
    /// (writing the source's constant is undefined behaviour), so two instances of a module made from the same cubin
    /// hold the same bytes for the whole run; and in a module linked from many objects each object brings its own
    /// `__unnamed_1` (NCCL 2.28's kernel modules: hundreds, its primitives' assert strings), so their names do not
    /// say which one is meant. Only initialized data (`.nv.global.init`) counts: a constant has bytes, and a
    /// zero-initialized variable of such a name would be writable state.
    pub fn is_compiler_constant(&self) -> bool {
        self.local && self.section == ".nv.global.init" && compiler_constant_name(&self.name)
    }
}

/// Whether `name` is a name compilers give the constants they make ([`GlobalSymbol::is_compiler_constant`]).
fn compiler_constant_name(name: &str) -> bool {
    let numbered = |rest: &str| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("__unnamed_").is_some_and(numbered)
        || name == "$str"
        || name.strip_prefix("$str$").is_some_and(numbered)
        || name == "_$_str"
        || name.strip_prefix("_$_str_$_").is_some_and(numbered)
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

/// A module variable that lives at `address` instead of inside the module's image
/// ([`Cubin::link_placed`](super::Cubin::link_placed)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedGlobal {
    /// The variable's offset inside the image ([`GlobalSymbol::image_offset`]).
    pub image_offset: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Where it lives.
    pub address: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(name: &str, local: bool) -> GlobalSymbol {
        GlobalSymbol {
            name: name.into(),
            image_offset: 0,
            size: 8,
            section: ".nv.global.init".into(),
            local,
        }
    }

    #[test]
    fn compiler_constants_are_local_and_named_as_compilers_name_them() {
        for name in [
            "__unnamed_1",
            "__unnamed_407",
            "$str",
            "$str$12",
            "_$_str",
            "_$_str_$_3",
        ] {
            assert!(global(name, true).is_compiler_constant(), "{name}");
            assert!(
                !global(name, false).is_compiler_constant(),
                "{name}, global binding"
            );
            let zeroed = GlobalSymbol {
                section: ".nv.global".into(),
                ..global(name, true)
            };
            assert!(!zeroed.is_compiler_constant(), "{name}, zero-initialized");
        }
        for name in [
            "__unnamed_",
            "__unnamed_1x",
            "__unnamed",
            "unnamed_1",
            "$str$",
            "$strx",
            "_$_str_$_",
            "_$_strx",
            "counter",
            "_ZZ3runvE8nworkers",
            "__unnamed_1 ",
        ] {
            assert!(!global(name, true).is_compiler_constant(), "{name}");
        }
    }
}
