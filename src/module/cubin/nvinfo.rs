//! `.nv.info` sections: their record formats and attributes, and the kernel descriptions read from them.

/// Seeded per map (a cubin's names cannot be chosen to collide), and several times quicker than SipHash on names.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

use object::elf;

use super::error::{CubinError, corrupt};
use super::info::{ConstBank, KernelInfo, ParamInfo};
use super::sections::{LoadedSection, SectionMeta, SymbolMeta};
use super::{SHT_CUDA_INFO, STO_CUDA_ENTRY};

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
    /// `u32 index, u16 ordinal, u16 offset, u32 size` (size in the low 16 bits; cuobjdump prints the pointee's
    /// alignment and space from the rest): what nvcc 13.0 writes for kernels whose parameters pass 4 KiB, whose
    /// sizes do not fit `KPARAM_INFO`'s 14 bits (a 32000-byte struct: `00 7d 00 00`; H200, 2026-11-28).
    pub const KPARAM_INFO_V2: u8 = 0x45;
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

/// Module-wide `.nv.info` values, per function symbol index.
#[derive(Default)]
pub(super) struct ModuleInfo {
    regcount: HashMap<u32, u32>,
    frame_size: HashMap<u32, u32>,
    min_stack: HashMap<u32, u32>,
    max_stack: HashMap<u32, u32>,
}

fn lookup(map: &HashMap<u32, u32>, symbol: u32) -> Option<u32> {
    map.get(&symbol).copied()
}

/// The sections a kernel's description is read from, found by name once per cubin rather than searched for each
/// kernel (PyTorch's cubins hold over a thousand kernels and several thousand sections).
pub(super) struct SectionIndex<'m> {
    /// `.nv.info.<owner>` by owner: the first section of each name.
    info_by_owner: HashMap<&'m str, usize>,
    /// `.nv.shared.<owner>` by owner: the first section of each name.
    shared_by_owner: HashMap<&'m str, usize>,
    /// For each code section, the first `.nv.info.*` section whose `sh_info` names it.
    info_by_text: HashMap<usize, usize>,
    /// `.nv.constant<bank>` sections (no owner) and `.nv.constant<bank>.<kernel>` sections by owner: (bank digits,
    /// section index), in section order.
    constants: HashMap<Option<&'m str>, Vec<(&'m str, usize)>>,
}

impl<'m> SectionIndex<'m> {
    pub(super) fn new(metas: &'m [SectionMeta]) -> SectionIndex<'m> {
        let mut index = SectionIndex {
            info_by_owner: HashMap::default(),
            shared_by_owner: HashMap::default(),
            info_by_text: HashMap::default(),
            constants: HashMap::default(),
        };
        for (i, m) in metas.iter().enumerate() {
            if let Some(owner) = m.name.strip_prefix(".nv.info.") {
                index.info_by_owner.entry(owner).or_insert(i);
            } else if let Some(owner) = m.name.strip_prefix(".nv.shared.") {
                index.shared_by_owner.entry(owner).or_insert(i);
            }
            if m.sh_type == SHT_CUDA_INFO
                && m.name.starts_with(".nv.info.")
                && let Ok(text) = usize::try_from(m.info)
            {
                index.info_by_text.entry(text).or_insert(i);
            }
            if let Some(rest) = m.name.strip_prefix(".nv.constant") {
                let (digits, owner) = match rest.split_once('.') {
                    Some((digits, owner)) => (digits, Some(owner)),
                    None => (rest, None),
                };
                index.constants.entry(owner).or_default().push((digits, i));
            }
        }
        index
    }
}

/// A decoded `.nv.info` record.
pub(super) struct Record<'a> {
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
pub(super) fn records<'a>(data: &'a [u8], section: &str) -> Result<Vec<Record<'a>>, CubinError> {
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

pub(super) fn u32_at(data: &[u8], offset: usize) -> Option<u32> {
    let end = offset.checked_add(4)?;
    Some(u32::from_le_bytes(data.get(offset..end)?.try_into().ok()?))
}

fn u16_at(data: &[u8], offset: usize) -> Option<u16> {
    let end = offset.checked_add(2)?;
    Some(u16::from_le_bytes(data.get(offset..end)?.try_into().ok()?))
}

pub(super) fn u64_at(data: &[u8], offset: usize) -> Option<u64> {
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

pub(super) fn module_info(metas: &[SectionMeta]) -> Result<ModuleInfo, CubinError> {
    let mut info = ModuleInfo::default();
    for meta in metas.iter().filter(|m| m.name == ".nv.info") {
        for record in records(meta.data, &meta.name)? {
            let map = match record.attr {
                eiattr::REGCOUNT => &mut info.regcount,
                eiattr::FRAME_SIZE => &mut info.frame_size,
                eiattr::MIN_STACK_SIZE => &mut info.min_stack,
                eiattr::MAX_STACK_SIZE => &mut info.max_stack,
                _ => continue,
            };
            let (symbol, value) = keyed(&record, &meta.name)?;
            // The first record of a symbol counts, as it always has.
            map.entry(symbol).or_insert(value);
        }
    }
    Ok(info)
}

/// Builds the kernel description for `sym` if it is a kernel: a function in `.text.<its name>`, marked as an
/// entry point or described by a `.nv.info.<its name>`.
pub(super) fn kernel_info(
    sym_index: usize,
    sym: &SymbolMeta,
    metas: &[SectionMeta],
    index: &SectionIndex,
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
    if text.name.strip_prefix(".text.") != Some(&*sym.name) {
        return Ok(None);
    }
    let info_section = index
        .info_by_owner
        .get(&*sym.name)
        .or_else(|| index.info_by_text.get(&text_index))
        .and_then(|&i| metas.get(i));
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
                        | eiattr::KPARAM_INFO_V2
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
    let name = sym.name.to_string();
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
    // Ordinals described by `KPARAM_INFO_V2` records.
    let mut v2_ordinals: Vec<u32> = Vec::new();

    if let Some(meta) = info_section {
        let section = &*meta.name;
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
                eiattr::KPARAM_INFO | eiattr::KPARAM_INFO_V2 => {
                    let b = bytes_of(&record, section, Some(12))?;
                    let fields = u16_at(b, 4).zip(u16_at(b, 6)).zip(u32_at(b, 8));
                    let ((ordinal, offset), word) = fields.ok_or_else(|| corrupt("KPARAM_INFO"))?;
                    let v2 = record.attr == eiattr::KPARAM_INFO_V2;
                    let param = ParamInfo {
                        ordinal: ordinal.into(),
                        offset: offset.into(),
                        size: if v2 { word & 0xffff } else { word >> 18 },
                    };
                    // A toolchain that wrote both records for one parameter: the second version's stands.
                    let v2_before = v2_ordinals.contains(&param.ordinal);
                    match k.params.iter().position(|p| p.ordinal == param.ordinal) {
                        Some(i) if v2 && !v2_before => k.params[i] = param,
                        Some(_) if !v2 && v2_before => {}
                        _ => k.params.push(param),
                    }
                    if v2 {
                        v2_ordinals.push(param.ordinal);
                    }
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

    k.static_shared = index
        .shared_by_owner
        .get(k.name.as_str())
        .and_then(|&i| metas.get(i))
        .map_or(0, |m| m.size);

    // The module's own constant banks and the kernel's.
    let banks = [None, Some(k.name.as_str())]
        .into_iter()
        .filter_map(|owner| index.constants.get(&owner))
        .flatten();
    for &(digits, i) in banks {
        let Some(meta) = metas.get(i) else {
            continue;
        };
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
