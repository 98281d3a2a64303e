//! How long a module image is, given only the pointer the program passed (`cuModuleLoadData`, `cuLibraryLoadData`
//! and `cuModuleLoadFatBinary` take no size): an ELF cubin ends with its last section or header table, a fatbin
//! container says its size, nvcc's fatbin wrapper points at a container, and PTX is NUL-terminated text.

/// ELF's magic, `\x7fELF`, little-endian.
const ELF_MAGIC: u32 = 0x464C_457F;
/// A fatbin container (`apex::module::fatbin::FATBIN_MAGIC`).
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// nvcc's `__fatBinC_Wrapper_t`: `{ int magic, int version, const unsigned long long *data, void *filename }`.
const WRAPPER_MAGIC: u32 = 0x466_243B1;
/// Images larger than this are taken to be garbage.
const MAX_IMAGE: u64 = 4 << 30;

/// What kind of image the pointer leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An ELF cubin.
    Cubin,
    /// A fatbin container (possibly reached through nvcc's wrapper).
    Fatbin,
    /// PTX text.
    Ptx,
}

/// An image whose extent cannot be told.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// A null pointer.
    #[error("the image pointer is null")]
    Null,
    /// Neither ELF, fatbin, nvcc's wrapper nor text.
    #[error("the image starts with {0:#010x}, which is neither a cubin, a fatbin nor PTX")]
    UnknownFormat(u32),
    /// Headers that do not add up.
    #[error("the {what} header is inconsistent: {why}")]
    Corrupt {
        /// Which format.
        what: &'static str,
        /// What does not add up.
        why: String,
    },
}

/// Reads `N` bytes at `p + off`.
///
/// # Safety
/// `p + off .. p + off + N` must be readable.
unsafe fn bytes<const N: usize>(p: *const u8, off: usize) -> [u8; N] {
    // SAFETY: per the contract; unaligned because nothing promises alignment.
    unsafe { std::ptr::read_unaligned(p.add(off).cast::<[u8; N]>()) }
}

/// # Safety
/// As for [`bytes`].
unsafe fn u16_at(p: *const u8, off: usize) -> u64 {
    // SAFETY: forwarded.
    u64::from(u16::from_le_bytes(unsafe { bytes::<2>(p, off) }))
}

/// # Safety
/// As for [`bytes`].
unsafe fn u32_at(p: *const u8, off: usize) -> u32 {
    // SAFETY: forwarded.
    u32::from_le_bytes(unsafe { bytes::<4>(p, off) })
}

/// # Safety
/// As for [`bytes`].
unsafe fn u64_at(p: *const u8, off: usize) -> u64 {
    // SAFETY: forwarded.
    u64::from_le_bytes(unsafe { bytes::<8>(p, off) })
}

fn checked(what: &'static str, len: Option<u64>) -> Result<usize, ImageError> {
    match len {
        Some(n) if n > 0 && n <= MAX_IMAGE => Ok(n as usize),
        other => Err(ImageError::Corrupt {
            what,
            why: format!("computed length {other:?}"),
        }),
    }
}

/// The image at `p`: where its bytes start (past nvcc's wrapper), how many there are, and its kind.
///
/// # Safety
/// `p` must be what the driver accepts as a module image: a cubin, a fatbin container, nvcc's fatbin wrapper or
/// NUL-terminated PTX, readable to its end.
pub unsafe fn locate(p: *const u8) -> Result<(*const u8, usize, Kind), ImageError> {
    if p.is_null() {
        return Err(ImageError::Null);
    }
    // SAFETY: every image is at least 4 bytes (PTX: a non-empty string, or its NUL and more).
    let magic = unsafe { u32_at(p, 0) };
    match magic {
        ELF_MAGIC => {
            // SAFETY: an ELF file has its 64-byte header.
            let (class, phoff, shoff, phentsize, phnum, shentsize, shnum) = unsafe {
                (
                    bytes::<1>(p, 4)[0],
                    u64_at(p, 0x20),
                    u64_at(p, 0x28),
                    u16_at(p, 0x36),
                    u16_at(p, 0x38),
                    u16_at(p, 0x3A),
                    u16_at(p, 0x3C),
                )
            };
            if class != 2 || (shnum > 0 && shentsize < 0x40) {
                return Err(ImageError::Corrupt {
                    what: "ELF",
                    why: format!("class {class}, section header size {shentsize}"),
                });
            }
            let mut end = 0x40u64
                .max(phoff.saturating_add(phentsize.saturating_mul(phnum)))
                .max(shoff.saturating_add(shentsize.saturating_mul(shnum)));
            if end > MAX_IMAGE {
                return checked("ELF", None).map(|n| (p, n, Kind::Cubin));
            }
            for i in 0..shnum {
                let h = (shoff + i * shentsize) as usize;
                // SAFETY: the section header table lies inside the image (its end was bounded above).
                let (kind, off, size) =
                    unsafe { (u32_at(p, h + 4), u64_at(p, h + 0x18), u64_at(p, h + 0x20)) };
                // SHT_NOBITS occupies no file bytes.
                if kind != 8 {
                    end = end.max(off.saturating_add(size));
                }
            }
            Ok((p, checked("ELF", Some(end))?, Kind::Cubin))
        }
        FATBIN_MAGIC => {
            // SAFETY: a fatbin container has its 16-byte header.
            let (header, size) = unsafe { (u16_at(p, 6), u64_at(p, 8)) };
            Ok((
                p,
                checked("fatbin", header.checked_add(size))?,
                Kind::Fatbin,
            ))
        }
        WRAPPER_MAGIC => {
            // SAFETY: nvcc's wrapper is 24 bytes, its data pointer at offset 8.
            let data = unsafe { u64_at(p, 8) } as usize as *const u8;
            if data.is_null() {
                return Err(ImageError::Null);
            }
            // SAFETY: the wrapper's data is a fatbin container the driver reads the same way.
            if unsafe { u32_at(data, 0) } != FATBIN_MAGIC {
                return Err(ImageError::Corrupt {
                    what: "fatbin wrapper",
                    why: "its data is not a fatbin container".into(),
                });
            }
            // SAFETY: as above.
            unsafe { locate(data) }
        }
        _ => {
            let first = magic.to_le_bytes();
            let text = first[0] != 0
                && first
                    .iter()
                    .take_while(|&&b| b != 0)
                    .all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace());
            if !text {
                return Err(ImageError::UnknownFormat(magic));
            }
            // SAFETY: text images are NUL-terminated, as the driver requires.
            let len = unsafe { std::ffi::CStr::from_ptr(p.cast()) }.count_bytes();
            // With the NUL: the loaders take it as the end of the text.
            Ok((p, checked("PTX", Some(len as u64 + 1))?, Kind::Ptx))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(path: &str) -> Vec<u8> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The image followed by bytes that must not be counted.
    fn with_tail(mut image: Vec<u8>) -> (Vec<u8>, usize) {
        let n = image.len();
        image.extend_from_slice(&[0xAB; 4096]);
        (image, n)
    }

    #[test]
    fn cubins_end_with_their_last_section_or_header_table() {
        for path in [
            "kernels/apex_test_kernels.sm_90.cubin",
            "kernels/conformance/module_data.sm_90.cubin",
            "kernels/conformance/printf_kernels.sm_90.cubin",
        ] {
            let (buf, n) = with_tail(fixture(path));
            // SAFETY: a cubin, readable past its end.
            let (start, len, kind) = unsafe { locate(buf.as_ptr()) }.unwrap();
            assert_eq!((start, len, kind), (buf.as_ptr(), n, Kind::Cubin), "{path}");
        }
    }

    #[test]
    fn fatbins_say_their_size_through_the_wrapper_too() {
        for path in [
            "kernels/apex_test_kernels.fatbin",
            "tests/fixtures/modules/md.default.fatbin",
            "tests/fixtures/modules/md.compress_all.fatbin",
            "tests/fixtures/modules/md.ptxonly.fatbin",
        ] {
            let (buf, n) = with_tail(fixture(path));
            // SAFETY: a fatbin, readable past its end.
            let (_, len, kind) = unsafe { locate(buf.as_ptr()) }.unwrap();
            assert_eq!((len, kind), (n, Kind::Fatbin), "{path}");
            let wrapper: [u64; 3] = [u64::from(WRAPPER_MAGIC) | (1 << 32), buf.as_ptr() as u64, 0];
            // SAFETY: nvcc's wrapper around the same container.
            let (start, len, _) = unsafe { locate(wrapper.as_ptr().cast()) }.unwrap();
            assert_eq!(
                (start, len),
                (buf.as_ptr(), n),
                "{path} through the wrapper"
            );
        }
    }

    #[test]
    fn ptx_is_its_text_and_nul() {
        let mut ptx = fixture("kernels/apex_test_kernels.ptx");
        let n = ptx.len();
        ptx.push(0);
        ptx.extend_from_slice(b"garbage after the NUL");
        // SAFETY: NUL-terminated text.
        let (_, len, kind) = unsafe { locate(ptx.as_ptr()) }.unwrap();
        assert_eq!((len, kind), (n + 1, Kind::Ptx));
    }

    #[test]
    fn garbage_and_null_are_typed_errors() {
        let junk = [0x00u8, 0xff, 0x13, 0x37, 0, 0, 0, 0];
        // SAFETY: 8 readable bytes.
        assert_eq!(
            unsafe { locate(junk.as_ptr()) },
            Err(ImageError::UnknownFormat(0x3713_ff00))
        );
        // SAFETY: null is checked first.
        assert_eq!(unsafe { locate(std::ptr::null()) }, Err(ImageError::Null));
        let mut elf = fixture("kernels/apex_test_kernels.sm_90.cubin");
        elf[4] = 1; // ELFCLASS32
        // SAFETY: readable header.
        assert!(matches!(
            unsafe { locate(elf.as_ptr()) },
            Err(ImageError::Corrupt { what: "ELF", .. })
        ));
    }
}
