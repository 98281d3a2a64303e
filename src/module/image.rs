//! From the bytes given to a module load to the cubin that runs on the device. The bytes may be:
//!
//! - a cubin, used as it is (relocatable ones, from `nvcc -rdc=true -cubin`, linked first);
//! - a fatbin, or a host executable, shared library or object with fatbins in `.nv_fatbin`/`__nv_relfatbin`:
//!   the best entry for the device by [`select`], decompressed; PTX compiled and relocatable code
//!   linked by [`Jit`] when no SASS fits;
//! - PTX text, compiled for the device by [`Jit`].
//!
//! A host binary holds one container per translation unit (plus one from the device-link step, which may define
//! no kernel): the first candidate, best first, whose code defines a kernel is taken, so such a file loads as the
//! module of its best-fitting translation unit.

use std::borrow::Cow;

use tracing::{debug, warn};

use super::cubin::{Cubin, CubinError};
use super::fatbin::{self, FatbinEntry, FatbinEntryKind, FatbinError};
use super::jit::{InputKind, Jit, JitError};
use super::payload::Payload;
use super::select::{self, CubinArch};

/// Why no cubin for the device could be had from the bytes.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImageError {
    /// The fatbin or its host ELF is malformed.
    #[error(transparent)]
    Fatbin(#[from] FatbinError),
    /// The chosen cubin is malformed.
    #[error(transparent)]
    Cubin(#[from] CubinError),
    /// PTX could not be compiled (or nvJitLink not loaded).
    #[error(transparent)]
    Jit(#[from] JitError),
    /// Relocatable device code is all that fits, and it could not be linked.
    #[error(
        "the only code for this GPU is relocatable device code (nvcc -rdc=true, {arch}), which must be linked \
         before it runs, and linking it with nvJitLink failed: {source}"
    )]
    Relocatable {
        /// The code's architecture.
        arch: String,
        /// Why linking failed.
        #[source]
        source: Box<JitError>,
    },
    /// Nothing in the fatbin runs on the device.
    #[error("nothing in the image runs on an sm_{device_sm} GPU: {}", entries.join("; "))]
    NoCodeForDevice {
        /// The device's SM version.
        device_sm: u32,
        /// Each entry and why it does not fit.
        entries: Vec<String>,
    },
    /// Architecture-specific code for another SM.
    #[error(
        "the code is built for {arch}, architecture-specific code that runs only on sm_{sm} GPUs, not on this \
         sm_{device_sm} one"
    )]
    ArchSpecific {
        /// The code's architecture (`sm_90a`).
        arch: String,
        /// The only SM it runs on.
        sm: u32,
        /// The device's SM version.
        device_sm: u32,
    },
    /// PTX whose target the device is below.
    #[error("the PTX targets {target}, which cannot be compiled for an sm_{device_sm} GPU")]
    PtxTarget {
        /// The PTX's `.target`.
        target: String,
        /// The device's SM version.
        device_sm: u32,
    },
    /// PTX without a usable `.target` directive.
    #[error("the PTX has no `.target sm_XY` directive")]
    PtxNoTarget,
}

/// What to do with PTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtxHandling {
    /// Compile it with the [`Jit`] (the direct path).
    Compile,
    /// Return it as it is (the CUDA driver compiles PTX itself).
    Keep,
}

/// Code for the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Code<'a> {
    /// An executable cubin.
    Cubin(Cow<'a, [u8]>),
    /// PTX text (only with [`PtxHandling::Keep`]).
    Ptx(Cow<'a, [u8]>),
}

impl Code<'_> {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Code::Cubin(b) | Code::Ptx(b) => b,
        }
    }

    /// Whether the code defines at least one kernel (unreadable cubins count as defining none), and the cubin
    /// parsed where it is one that parses. An owned cubin's bytes move into the parsed cubin (left empty here,
    /// [`Cubin::bytes`] has them): a PyTorch cubin is tens of megabytes, and copying it costs the load more than
    /// parsing it.
    fn kernels(&mut self) -> (bool, Option<Cubin>) {
        let cubin = match self {
            Code::Cubin(Cow::Owned(v)) => {
                let (back, cubin) = parse_owned(std::mem::take(v).into());
                *v = back;
                cubin
            }
            Code::Cubin(Cow::Borrowed(b)) => Cubin::parse(b).ok(),
            Code::Ptx(b) => return (b.windows(6).any(|w| w == b".entry"), None),
        };
        (
            cubin.as_ref().is_some_and(|c| !c.kernels().is_empty()),
            cubin,
        )
    }
}

/// `bytes` parsed as a cubin, kept without a copy: the cubin and no bytes (they are [`Cubin::bytes`]), or, where
/// they do not parse, the bytes back.
fn parse_owned(bytes: Payload) -> (Vec<u8>, Option<Cubin>) {
    match Cubin::parse_payload(bytes) {
        Ok(c) => (Vec::new(), Some(c)),
        Err((_, back)) => (back.into_vec(), None),
    }
}

/// Code for the device and how it was had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved<'a> {
    /// The code.
    pub code: Code<'a>,
    /// What was taken and why, for logs (`sm_90a cubin (zstd): architecture-specific SASS for exactly this SM`).
    pub chosen: String,
}

/// The cubin to load on an `sm_<device_sm>` GPU from `bytes`, with PTX compiled and relocatable code linked by
/// `jit`.
pub fn cubin_for_device<'a>(
    bytes: &'a [u8],
    device_sm: u32,
    jit: &Jit,
) -> Result<Cow<'a, [u8]>, ImageError> {
    let resolved = resolve_parsed(bytes, device_sm, jit, PtxHandling::Compile, None)?;
    match resolved.code {
        Code::Cubin(c) => Ok(c),
        // Compile mode never returns PTX.
        Code::Ptx(_) => Err(ImageError::PtxNoTarget),
    }
}

/// As [`cubin_for_device`], with the cubin parsed where choosing it parsed it already (a fatbin's entries are
/// parsed to find the one with kernels: a large cubin is not parsed twice). The bytes are then the parsed cubin's
/// ([`Cubin::bytes`]) and the first value is empty where the second is a cubin.
pub(crate) fn parsed_cubin_for_device<'a>(
    bytes: &'a [u8],
    device_sm: u32,
    jit: &Jit,
) -> Result<(Cow<'a, [u8]>, Option<Cubin>), ImageError> {
    let mut parsed = None;
    let resolved = resolve_parsed(
        bytes,
        device_sm,
        jit,
        PtxHandling::Compile,
        Some(&mut parsed),
    )?;
    debug!(device_sm, chosen = %resolved.chosen, "module code");
    match resolved.code {
        Code::Cubin(c) => Ok((c, parsed)),
        // Compile mode never returns PTX.
        Code::Ptx(_) => Err(ImageError::PtxNoTarget),
    }
}

/// The code to load on an `sm_<device_sm>` GPU from `bytes` (see the module's documentation).
pub fn resolve<'a>(
    bytes: &'a [u8],
    device_sm: u32,
    jit: &Jit,
    ptx: PtxHandling,
) -> Result<Resolved<'a>, ImageError> {
    resolve_parsed(bytes, device_sm, jit, ptx, None)
}

/// As [`resolve`]; `parsed` gets the chosen cubin parsed, where choosing it parsed it (`None`: the caller wants
/// only the code's bytes).
fn resolve_parsed<'a>(
    bytes: &'a [u8],
    device_sm: u32,
    jit: &Jit,
    ptx: PtxHandling,
    parsed: Option<&mut Option<Cubin>>,
) -> Result<Resolved<'a>, ImageError> {
    if let Some(arch) = select::cubin_arch(bytes) {
        let code = cubin_code(Cow::Borrowed(bytes), arch, device_sm, jit)?;
        return Ok(Resolved {
            code,
            chosen: format!("{} cubin", arch.name()),
        });
    }
    if fatbin::is_fatbin(bytes) || bytes.starts_with(b"\x7fELF") {
        return match fatbin::entries(bytes) {
            Ok(entries) => from_entries(bytes, &entries, device_sm, jit, ptx, parsed),
            // Not a fatbin and no fatbin sections: a broken cubin, which the cubin parser describes best.
            Err(FatbinError::NotFatbin) if !fatbin::is_fatbin(bytes) => Ok(Resolved {
                code: Code::Cubin(Cow::Borrowed(bytes)),
                chosen: "cubin".into(),
            }),
            Err(e) => Err(e.into()),
        };
    }
    if select::looks_like_ptx(bytes) {
        return Ok(Resolved {
            code: ptx_code(Cow::Borrowed(bytes), device_sm, jit, ptx)?,
            chosen: "PTX".into(),
        });
    }
    // Neither: the cubin parser says what is wrong with it.
    Ok(Resolved {
        code: Code::Cubin(Cow::Borrowed(bytes)),
        chosen: "cubin".into(),
    })
}

/// Tries the candidates best first; see the module's documentation.
fn from_entries<'a>(
    bytes: &[u8],
    entries: &[FatbinEntry],
    device_sm: u32,
    jit: &Jit,
    ptx: PtxHandling,
    parsed: Option<&mut Option<Cubin>>,
) -> Result<Resolved<'a>, ImageError> {
    // The chosen code, with its cubin parsed: the bytes went into the cubin, and come back where the caller does
    // not keep it.
    let done = |mut resolved: Resolved<'a>, cubin: Option<Cubin>| {
        match parsed {
            Some(slot) => *slot = cubin,
            None => {
                if let (Code::Cubin(Cow::Owned(v)), Some(c)) = (&mut resolved.code, cubin)
                    && v.is_empty()
                {
                    *v = c.into_bytes();
                }
            }
        }
        resolved
    };
    let selection = select::select(entries, device_sm);
    if selection.candidates.is_empty() {
        return Err(ImageError::NoCodeForDevice {
            device_sm,
            entries: selection.describe(entries),
        });
    }
    let mut first_error = None;
    let mut without_kernels: Option<(usize, Resolved<'a>, Option<Cubin>)> = None;
    for candidate in &selection.candidates {
        let entry = &entries[candidate.index];
        // The best code of a container is its module: its other entries define the same kernels.
        if without_kernels
            .as_ref()
            .is_some_and(|(container, _, _)| *container == entry.container)
        {
            continue;
        }
        // A cubin ready to run is parsed from the payload as it came (a module cache hit stays mapped); other code
        // is compiled or linked from a copy.
        let code = fatbin::payload_bytes(bytes, entry)
            .map_err(ImageError::from)
            .and_then(|payload| match entry.kind {
                FatbinEntryKind::Ptx => {
                    ptx_code(Cow::Owned(payload.into_vec()), device_sm, jit, ptx).map(Chosen::Code)
                }
                FatbinEntryKind::Cubin => match select::cubin_arch(&payload) {
                    Some(arch) if !arch.relocatable => {
                        check_arch_specific(arch, device_sm)?;
                        Ok(Chosen::Cubin(payload))
                    }
                    Some(arch) => cubin_code(Cow::Owned(payload.into_vec()), arch, device_sm, jit)
                        .map(Chosen::Code),
                    None => {
                        Err(CubinError::NotElf(format!("the {entry} is not a CUDA ELF")).into())
                    }
                },
            });
        let chosen = match code {
            Ok(chosen) => chosen,
            Err(e) => {
                warn!(%entry, error = %e, "fatbin entry not usable; trying the next");
                first_error.get_or_insert(e);
                continue;
            }
        };
        let chosen_as = format!("{entry}: {}", candidate.fit);
        let (resolved, has_kernels, cubin) = match chosen {
            Chosen::Code(code) => {
                let mut resolved = Resolved {
                    chosen: chosen_as,
                    code,
                };
                let (has_kernels, cubin) = resolved.code.kernels();
                (resolved, has_kernels, cubin)
            }
            // Parsed where it lies; the bytes are the cubin's ([`Cubin::bytes`]), or come back if it does not parse.
            Chosen::Cubin(payload) => {
                let (code, cubin) = parse_owned(payload);
                let has_kernels = cubin.as_ref().is_some_and(|c| !c.kernels().is_empty());
                let resolved = Resolved {
                    chosen: chosen_as,
                    code: Code::Cubin(Cow::Owned(code)),
                };
                (resolved, has_kernels, cubin)
            }
        };
        if has_kernels {
            return Ok(done(resolved, cubin));
        }
        debug!(%entry, container = entry.container, "no kernel in this container; trying the next");
        without_kernels.get_or_insert((entry.container, resolved, cubin));
    }
    match (without_kernels, first_error) {
        (Some((_, resolved, cubin)), _) => Ok(done(resolved, cubin)),
        (None, Some(e)) => Err(e),
        (None, None) => Err(ImageError::NoCodeForDevice {
            device_sm,
            entries: selection.describe(entries),
        }),
    }
}

/// A fatbin entry's code as chosen: a cubin ready to run, still to be parsed, or code compiled or linked for the
/// device.
enum Chosen<'a> {
    Cubin(Payload),
    Code(Code<'a>),
}

/// [`ImageError::ArchSpecific`] when `arch` is architecture-specific code for another SM than the device's.
fn check_arch_specific(arch: CubinArch, device_sm: u32) -> Result<(), ImageError> {
    if arch.arch_specific && arch.sm != device_sm {
        return Err(ImageError::ArchSpecific {
            arch: arch.name(),
            sm: arch.sm,
            device_sm,
        });
    }
    Ok(())
}

/// An executable cubin from a cubin: checked for architecture-specific code, linked if relocatable.
fn cubin_code<'a>(
    bytes: Cow<'a, [u8]>,
    arch: CubinArch,
    device_sm: u32,
    jit: &Jit,
) -> Result<Code<'a>, ImageError> {
    check_arch_specific(arch, device_sm)?;
    if !arch.relocatable {
        return Ok(Code::Cubin(bytes));
    }
    // Linked for its own architecture: the result runs wherever the relocatable SASS would.
    jit.compile(InputKind::RelocatableCubin, &bytes, &arch.name())
        .map(|cubin| Code::Cubin(Cow::Owned(cubin)))
        .map_err(|source| ImageError::Relocatable {
            arch: arch.name(),
            source: Box::new(source),
        })
}

/// PTX for the device, compiled or kept.
fn ptx_code<'a>(
    text: Cow<'a, [u8]>,
    device_sm: u32,
    jit: &Jit,
    ptx: PtxHandling,
) -> Result<Code<'a>, ImageError> {
    let target = select::ptx_target(&text).ok_or(ImageError::PtxNoTarget)?;
    let arch = target
        .arch_for(device_sm)
        .ok_or_else(|| ImageError::PtxTarget {
            target: target.name(),
            device_sm,
        })?;
    match ptx {
        PtxHandling::Keep => Ok(Code::Ptx(text)),
        PtxHandling::Compile => Ok(Code::Cubin(Cow::Owned(jit.compile(
            InputKind::Ptx,
            &text,
            &arch,
        )?))),
    }
}
