//! Which code in a fatbin runs best on a device: a pure function of the entries and the device's SM version,
//! which says what it chose and why, and why it passed over the rest.
//!
//! The rules, as CUDA's compatibility guides state them:
//!
//! - SASS runs only on the major version it was built for, on devices whose minor version is at least the
//!   cubin's: an sm_86 GPU runs sm_80 SASS, an sm_90 GPU runs no sm_8x SASS, nor sm_100.
//! - Architecture-specific SASS (`sm_90a`, from `compute_90a`) uses features only that SM has, and runs only on
//!   exactly that SM.
//! - PTX for `compute_XY` compiles for any device of SM version XY or above (architecture-specific PTX, for
//!   exactly XY).
//!
//! Ranked, best first: architecture-specific SASS for exactly the device's SM, SASS for exactly its SM, SASS of an
//! older minor version of its major (newest first), then PTX (highest compute version first), to be compiled for
//! the device. Entries from `__nv_relfatbin` (relocatable device code, `nvcc -rdc=true`) come after all others,
//! in the same order: they must be linked before they run, and the `.nv_fatbin` of the same program holds them
//! linked. Ties keep file order.
//!
//! How `a` is marked, as read from nvcc 13.0 output (tests/fixtures/modules): the fatbin entry of an `sm_90a`
//! cubin has flag [`flags::ARCH_SPECIFIC`](super::fatbin::flags::ARCH_SPECIFIC) (0x10_0000) and the same `sm` (90)
//! as the `sm_90` one. The cubins themselves have the same `e_flags` (0x0600_5a04: ELF ABI version 8 puts the SM
//! in bits 15:8 and leaves `EF_CUDA_ACCELERATORS`, bit 3, clear); they differ only in the ptxas command line in
//! `.note.nv.tkinfo` and in attribute 9 of `.nv.compat` (1 for `sm_90a`, 0 for `sm_90`). Older cubins (ABI
//! version 7, CUDA 12) set `EF_CUDA_ACCELERATORS_V1` (0x800) in `e_flags`. [`cubin_arch`] reads all three.
//! `cuobjdump -lelf` names the entry `sm_90a` from the fatbin flag.

use std::fmt;

use object::LittleEndian;
use object::elf;
use object::read::elf::{FileHeader, SectionHeader};

use super::cubin::{sass_compatible, sm_from_e_flags};
use super::fatbin::{self, FatbinEntry, FatbinEntryKind, FatbinError, Origin};

/// How a usable entry fits the device, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fit {
    /// Architecture-specific SASS (`sm_XYa`) for exactly the device's SM.
    ArchSpecificSass,
    /// SASS for exactly the device's SM.
    ExactSass,
    /// SASS for an older minor version of the device's major version, which the device runs unchanged.
    CompatibleSass,
    /// PTX for a compute version at or below the device's, to be compiled for the device.
    Ptx,
}

impl fmt::Display for Fit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fit::ArchSpecificSass => {
                "architecture-specific SASS for exactly this SM, the best code there is for it"
            }
            Fit::ExactSass => "SASS for exactly this SM",
            Fit::CompatibleSass => {
                "SASS for an older minor version of this SM's major version, which it runs unchanged"
            }
            Fit::Ptx => "no SASS fits, and this PTX compiles for the device",
        })
    }
}

/// Why an entry cannot run on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unfit {
    /// SASS for another major version.
    OtherMajor,
    /// SASS for a newer minor version of the device's major version.
    NewerMinor,
    /// Architecture-specific SASS or PTX for another SM.
    ArchSpecificElsewhere,
    /// PTX for a newer compute version than the device's.
    NewerPtx,
}

impl fmt::Display for Unfit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unfit::OtherMajor => "SASS runs only on GPUs of the major version it was built for",
            Unfit::NewerMinor => "SASS for a newer minor version than the device's",
            Unfit::ArchSpecificElsewhere => {
                "architecture-specific code runs only on exactly the SM it was built for"
            }
            Unfit::NewerPtx => "PTX for a newer compute version than the device's",
        })
    }
}

/// An entry the device can run (after compiling or linking it, for PTX and relocatable code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Index of the entry in the slice given to [`select`].
    pub index: usize,
    /// How it fits.
    pub fit: Fit,
    /// From `__nv_relfatbin`: relocatable code, to be linked before it runs.
    pub relocatable: bool,
}

/// An entry the device cannot run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Index of the entry in the slice given to [`select`].
    pub index: usize,
    /// Why not.
    pub why: Unfit,
}

/// What [`select`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selection {
    /// Every entry the device can run, best first.
    pub candidates: Vec<Candidate>,
    /// Every other entry, in file order, with why it cannot run.
    pub refused: Vec<Refusal>,
}

impl Selection {
    /// The best entry, if any runs.
    pub fn best(&self) -> Option<&Candidate> {
        self.candidates.first()
    }

    /// One line per entry of `entries` (the slice given to [`select`]), in file order: what it is, and whether
    /// and why it was ranked or refused.
    pub fn describe(&self, entries: &[FatbinEntry]) -> Vec<String> {
        let mut lines: Vec<(usize, String)> = self
            .candidates
            .iter()
            .enumerate()
            .map(|(rank, c)| {
                let link = if c.relocatable {
                    ", relocatable: must be linked"
                } else {
                    ""
                };
                (c.index, format!("choice {}: {}{link}", rank + 1, c.fit))
            })
            .chain(self.refused.iter().map(|r| (r.index, r.why.to_string())))
            .collect();
        lines.sort_by_key(|(index, _)| *index);
        lines
            .into_iter()
            .map(|(index, why)| match entries.get(index) {
                Some(e) => format!("{e}: {why}"),
                None => format!("entry {index}: {why}"),
            })
            .collect()
    }
}

/// Whether code of `kind` for `sm` (`arch_specific`: `sm_<sm>a`) runs on an `sm_<device_sm>` GPU, and how well.
pub fn fit(
    kind: FatbinEntryKind,
    sm: u32,
    arch_specific: bool,
    device_sm: u32,
) -> Result<Fit, Unfit> {
    match kind {
        FatbinEntryKind::Cubin if arch_specific => {
            if sm == device_sm {
                Ok(Fit::ArchSpecificSass)
            } else {
                Err(Unfit::ArchSpecificElsewhere)
            }
        }
        FatbinEntryKind::Cubin if sm == device_sm => Ok(Fit::ExactSass),
        FatbinEntryKind::Cubin if sass_compatible(sm, device_sm) => Ok(Fit::CompatibleSass),
        FatbinEntryKind::Cubin if sm / 10 == device_sm / 10 => Err(Unfit::NewerMinor),
        FatbinEntryKind::Cubin => Err(Unfit::OtherMajor),
        FatbinEntryKind::Ptx if arch_specific && sm != device_sm => {
            Err(Unfit::ArchSpecificElsewhere)
        }
        FatbinEntryKind::Ptx if sm <= device_sm => Ok(Fit::Ptx),
        FatbinEntryKind::Ptx => Err(Unfit::NewerPtx),
    }
}

/// Ranks `entries` (from [`fatbin::entries`]) for an `sm_<device_sm>` GPU: see the
/// module's documentation for the order.
pub fn select(entries: &[FatbinEntry], device_sm: u32) -> Selection {
    let mut out = Selection::default();
    for (index, e) in entries.iter().enumerate() {
        match fit(e.kind, e.sm, e.arch_specific, device_sm) {
            Ok(fit) => out.candidates.push(Candidate {
                index,
                fit,
                relocatable: e.origin == Origin::NvRelFatbin,
            }),
            Err(why) => out.refused.push(Refusal { index, why }),
        }
    }
    // Within a fit, the newest architecture is closest to the device; the sort is stable, so ties keep file order.
    out.candidates
        .sort_by_key(|c| (c.relocatable, c.fit, std::cmp::Reverse(entries[c.index].sm)));
    out
}

/// What a cubin's ELF header and `.nv.compat` say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CubinArch {
    /// SM version of its SASS.
    pub sm: u32,
    /// Architecture-specific (`sm_<sm>a`): runs only on exactly `sm`.
    pub arch_specific: bool,
    /// Relocatable (`ET_REL`, `nvcc -rdc=true`): must be linked before it runs.
    pub relocatable: bool,
}

impl CubinArch {
    /// `sm_90` or `sm_90a`, as nvcc names it.
    pub fn name(&self) -> String {
        format!(
            "sm_{}{}",
            self.sm,
            if self.arch_specific { "a" } else { "" }
        )
    }
}

/// `.nv.compat` attribute whose value is 1 in architecture-specific cubins.
const COMPAT_ARCH_SPECIFIC: u8 = 9;
/// `EF_CUDA_ACCELERATORS_V1`: the `a` flag in `e_flags` of ELF ABI version 7 (CUDA 12).
const EF_ACCELERATORS_V7: u32 = 0x800;
/// `EF_CUDA_ACCELERATORS`: the `a` flag in `e_flags` from ELF ABI version 8 (LLVM's definition; nvcc 13.0 leaves
/// it clear).
const EF_ACCELERATORS_V8: u32 = 0x8;

/// Reads a cubin's architecture; `None` if `bytes` is not a 64-bit little-endian CUDA ELF.
pub fn cubin_arch(bytes: &[u8]) -> Option<CubinArch> {
    let header = elf::FileHeader64::<LittleEndian>::parse(bytes).ok()?;
    let endian = header.endian().ok()?;
    if header.e_machine(endian) != elf::EM_CUDA {
        return None;
    }
    let abi = header.e_ident().abi_version;
    let e_flags = header.e_flags(endian).0;
    let flag = if abi >= 8 {
        EF_ACCELERATORS_V8
    } else {
        EF_ACCELERATORS_V7
    };
    let compat = header.sections(endian, bytes).ok().and_then(|sections| {
        let (_, section) = sections.section_by_name(endian, b".nv.compat")?;
        compat_attribute(section.data(endian, bytes).ok()?, COMPAT_ARCH_SPECIFIC)
    });
    Some(CubinArch {
        sm: sm_from_e_flags(abi, e_flags),
        arch_specific: e_flags & flag != 0 || compat.is_some_and(|v| v != 0),
        relocatable: header.e_type(endian) == elf::ET_REL,
    })
}

/// The value of attribute `attr` in `.nv.compat`: records of `u8 format, u8 attribute`, then for format 4 a `u16`
/// size and that many bytes, for the others a `u16` value.
fn compat_attribute(mut data: &[u8], attr: u8) -> Option<u16> {
    while let [format, attribute, a, b, rest @ ..] = data {
        let value = u16::from_le_bytes([*a, *b]);
        if *format == 4 {
            data = rest.get(usize::from(value)..)?;
        } else {
            if *attribute == attr {
                return Some(value);
            }
            data = rest;
        }
    }
    None
}

/// The architecture a PTX module targets: its `.target` directive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtxTarget {
    /// `XY` of `sm_XY`.
    pub sm: u32,
    /// `a` (architecture-specific) or `f` (family-specific), if the target has one.
    pub suffix: Option<char>,
}

impl PtxTarget {
    /// `sm_90`, `sm_90a`: the target as PTX writes it.
    pub fn name(&self) -> String {
        match self.suffix {
            Some(s) => format!("sm_{}{s}", self.sm),
            None => format!("sm_{}", self.sm),
        }
    }

    /// The architecture to compile this PTX for on an `sm_<device_sm>` GPU (`-arch=` of nvJitLink), or `None` if it
    /// cannot run there: plain PTX compiles for any SM at or above its target; `a` PTX only for exactly its SM;
    /// `f` PTX for the same major version at or above it.
    pub fn arch_for(&self, device_sm: u32) -> Option<String> {
        match self.suffix {
            None if self.sm <= device_sm => Some(format!("sm_{device_sm}")),
            Some('a') if self.sm == device_sm => Some(format!("sm_{device_sm}a")),
            Some('f') if sass_compatible(self.sm, device_sm) => Some(format!("sm_{device_sm}f")),
            _ => None,
        }
    }
}

/// The `.target` of PTX text (`None` if there is none, or it names no `sm_XY`). Comments are skipped.
pub fn ptx_target(text: &[u8]) -> Option<PtxTarget> {
    let target = directive(text, ".target")?;
    let arch = target
        .split(|b| *b == b',' || b.is_ascii_whitespace())
        .next()?;
    let rest = arch.strip_prefix(b"sm_")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let sm = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    let suffix = match &rest[digits..] {
        [] => None,
        [c @ (b'a' | b'f')] => Some(char::from(*c)),
        _ => return None,
    };
    Some(PtxTarget { sm, suffix })
}

/// Whether `bytes` look like PTX text: no NUL before the trailing ones, and `.version` and `.target` directives.
pub fn looks_like_ptx(bytes: &[u8]) -> bool {
    let text = trim_nuls(bytes);
    !text.is_empty()
        && !text.contains(&0)
        && directive(text, ".version").is_some()
        && ptx_target(text).is_some()
}

/// `bytes` without trailing NULs (fatbin padding, C strings).
pub fn trim_nuls(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    &bytes[..end]
}

/// The rest of the first line (comments stripped) that starts with `name` and a space.
fn directive<'a>(text: &'a [u8], name: &str) -> Option<&'a [u8]> {
    text.split(|b| *b == b'\n').find_map(|line| {
        let line = match line.windows(2).position(|w| w == b"//") {
            Some(at) => &line[..at],
            None => line,
        };
        let line = line.trim_ascii();
        let rest = line.strip_prefix(name.as_bytes())?;
        rest.first()
            .is_some_and(|b| b.is_ascii_whitespace())
            .then(|| rest.trim_ascii())
    })
}

/// The SASS to run on an `sm_<device_sm>` GPU, decompressed: the best executable cubin by [`select`]
/// (arch-specific SASS for exactly that SM, then SASS for exactly that SM, then the newest older minor version of
/// the same major). PTX and `__nv_relfatbin` entries are left out; [`super::image::resolve`] takes them too.
pub fn select_cubin(bytes: &[u8], device_sm: u32) -> Result<Vec<u8>, FatbinError> {
    let all = fatbin::entries(bytes)?;
    let chosen = select(&all, device_sm)
        .candidates
        .iter()
        .map(|c: &Candidate| &all[c.index])
        .find(|e| e.kind == FatbinEntryKind::Cubin && e.origin != Origin::NvRelFatbin);
    match chosen {
        Some(entry) => fatbin::payload(bytes, entry),
        None => Err(FatbinError::NoCubinForSm {
            device_sm,
            available: all.iter().map(|e| e.to_string()).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FatbinEntryKind::{Cubin, Ptx};

    fn entry(kind: FatbinEntryKind, sm: u32, arch_specific: bool, origin: Origin) -> FatbinEntry {
        FatbinEntry {
            kind,
            sm,
            arch_specific,
            origin,
            container: 0,
            compressed: false,
            compression: None,
            flags: 0,
            payload_offset: 0,
            payload_size: 0,
            uncompressed_size: 0,
        }
    }

    fn order(entries: &[FatbinEntry], device_sm: u32) -> Vec<String> {
        let s = select(entries, device_sm);
        s.candidates
            .iter()
            .map(|c| entries[c.index].to_string())
            .collect()
    }

    #[test]
    fn fit_rules() {
        assert_eq!(fit(Cubin, 90, true, 90), Ok(Fit::ArchSpecificSass));
        assert_eq!(fit(Cubin, 90, false, 90), Ok(Fit::ExactSass));
        assert_eq!(fit(Cubin, 80, false, 86), Ok(Fit::CompatibleSass));
        assert_eq!(fit(Cubin, 86, false, 80), Err(Unfit::NewerMinor));
        assert_eq!(fit(Cubin, 80, false, 90), Err(Unfit::OtherMajor));
        assert_eq!(fit(Cubin, 100, false, 90), Err(Unfit::OtherMajor));
        assert_eq!(fit(Cubin, 90, true, 91), Err(Unfit::ArchSpecificElsewhere));
        assert_eq!(
            fit(Cubin, 100, true, 103),
            Err(Unfit::ArchSpecificElsewhere)
        );
        assert_eq!(fit(Ptx, 90, false, 90), Ok(Fit::Ptx));
        assert_eq!(fit(Ptx, 80, false, 120), Ok(Fit::Ptx), "PTX runs forward");
        assert_eq!(fit(Ptx, 100, false, 90), Err(Unfit::NewerPtx));
        assert_eq!(fit(Ptx, 90, true, 90), Ok(Fit::Ptx));
        assert_eq!(fit(Ptx, 90, true, 100), Err(Unfit::ArchSpecificElsewhere));
    }

    #[test]
    fn ranking_on_sm90() {
        use Origin::{Fatbin, NvRelFatbin};
        let entries = [
            entry(Cubin, 80, false, Fatbin),
            entry(Ptx, 80, false, Fatbin),
            entry(Ptx, 90, false, Fatbin),
            entry(Cubin, 90, false, Fatbin),
            entry(Cubin, 90, true, Fatbin),
            entry(Cubin, 100, false, Fatbin),
            entry(Cubin, 90, true, NvRelFatbin),
            entry(Ptx, 90, false, NvRelFatbin),
        ];
        assert_eq!(
            order(&entries, 90),
            [
                "sm_90a cubin",
                "sm_90 cubin",
                "compute_90 PTX",
                "compute_80 PTX",
                "sm_90a cubin in __nv_relfatbin",
                "compute_90 PTX in __nv_relfatbin",
            ]
        );
        let s = select(&entries, 90);
        assert_eq!(
            s.refused,
            [
                Refusal {
                    index: 0,
                    why: Unfit::OtherMajor
                },
                Refusal {
                    index: 5,
                    why: Unfit::OtherMajor
                },
            ]
        );
        assert_eq!(
            s.best().map(|c| (c.index, c.fit)),
            Some((4, Fit::ArchSpecificSass))
        );
        let lines = s.describe(&entries);
        assert_eq!(lines.len(), entries.len());
        assert!(
            lines[0].starts_with("sm_80 cubin: SASS runs only"),
            "{lines:?}"
        );
        assert!(
            lines[4].starts_with("sm_90a cubin: choice 1: architecture-specific"),
            "{lines:?}"
        );
        assert!(
            lines[6].ends_with("relocatable: must be linked"),
            "{lines:?}"
        );

        // An sm_86 GPU: the sm_80 SASS first, then PTX; sm_90 code of any kind is too new.
        assert_eq!(order(&entries[..6], 86), ["sm_80 cubin", "compute_80 PTX"]);
        // sm_89 among sm_80 and sm_86: the newest minor not above the device's.
        let ampere = [
            entry(Cubin, 80, false, Fatbin),
            entry(Cubin, 86, false, Fatbin),
        ];
        assert_eq!(order(&ampere, 89), ["sm_86 cubin", "sm_80 cubin"]);
        assert_eq!(order(&ampere, 80), ["sm_80 cubin"]);
        // Nothing for Blackwell but the PTX.
        assert_eq!(
            order(&entries[..6], 100),
            ["sm_100 cubin", "compute_90 PTX", "compute_80 PTX"]
        );
        assert!(select(&[], 90).best().is_none());
    }

    #[test]
    fn ties_keep_file_order() {
        let mut a = entry(Cubin, 90, false, Origin::NvFatbin);
        let mut b = a.clone();
        a.container = 0;
        b.container = 1;
        let s = select(&[a, b], 90);
        assert_eq!(
            s.candidates.iter().map(|c| c.index).collect::<Vec<_>>(),
            [0, 1]
        );
    }

    #[test]
    fn ptx_targets() {
        let t = |s: &str| ptx_target(s.as_bytes());
        assert_eq!(
            t(".version 9.0\n.target sm_90\n"),
            Some(PtxTarget {
                sm: 90,
                suffix: None
            })
        );
        assert_eq!(
            t("//\n// .target sm_10\n\t.target   sm_90a, texmode_independent // note\n"),
            Some(PtxTarget {
                sm: 90,
                suffix: Some('a')
            })
        );
        assert_eq!(
            t(".target sm_100f\n").map(|p| p.name()),
            Some("sm_100f".into())
        );
        assert_eq!(t(".targets sm_90\n"), None);
        assert_eq!(t(".target compute_90\n"), None);
        assert_eq!(t(".target sm_90x\n"), None);
        assert_eq!(t(".target sm_\n"), None);
        assert_eq!(t("no directives"), None);

        let plain = PtxTarget {
            sm: 80,
            suffix: None,
        };
        assert_eq!(plain.arch_for(90).as_deref(), Some("sm_90"));
        assert_eq!(plain.arch_for(75), None);
        let a = PtxTarget {
            sm: 90,
            suffix: Some('a'),
        };
        assert_eq!(a.arch_for(90).as_deref(), Some("sm_90a"));
        assert_eq!(a.arch_for(100), None);
        let f = PtxTarget {
            sm: 100,
            suffix: Some('f'),
        };
        assert_eq!(f.arch_for(103).as_deref(), Some("sm_103f"));
        assert_eq!(f.arch_for(120), None);

        assert!(looks_like_ptx(
            b"//\n.version 9.0\n.target sm_90\n.address_size 64\n\0\0"
        ));
        assert!(!looks_like_ptx(b".target sm_90\n"), "no .version");
        assert!(
            !looks_like_ptx(b".version 9.0\n\0.target sm_90\n"),
            "NUL inside"
        );
        assert!(!looks_like_ptx(b"\x7fELF"));
        assert!(!looks_like_ptx(b""));
        assert_eq!(trim_nuls(b"ab\0\0"), b"ab");
        assert_eq!(trim_nuls(b"\0\0"), b"");
    }

    #[test]
    fn compat_records() {
        // As in nvcc 13.0's sm_90a cubin: BVAL-like records of 4 bytes, then one 8-byte SVAL.
        let sm90a = [
            2, 9, 1, 0, 2, 2, 1, 0, 2, 5, 5, 0, 3, 7, 1, 1, 2, 3, 0, 0, 2, 6, 1, 0, 4, 0x0b, 8, 0,
            0, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(compat_attribute(&sm90a, 9), Some(1));
        assert_eq!(compat_attribute(&sm90a, 6), Some(1));
        assert_eq!(
            compat_attribute(&sm90a, 0x0b),
            None,
            "sized records have no value"
        );
        assert_eq!(compat_attribute(&sm90a, 0x42), None);
        assert_eq!(compat_attribute(&[4, 1, 0xff, 0xff, 0], 9), None, "overrun");
        assert_eq!(compat_attribute(&[2, 9], 9), None);
    }
}
