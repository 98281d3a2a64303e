//! Kernel parameters, packed into constant bank 0 by the kernel's own parameter table (EIATTR_KPARAM_INFO).

use crate::module::cubin::KernelInfo;

/// A GPU virtual address: where a buffer, a CUDA allocation or a module variable lives in the address space kernels
/// see. A plain `u64` underneath (`#[repr(transparent)]`), so it crosses FFI and converts both ways; as a kernel
/// argument it is [`Arg::Ptr`].
///
/// ```
/// use apex::{Arg, DevicePtr};
/// let base = DevicePtr::new(0x7f00_0000_0000);
/// let elem = base.offset(4 * 10).unwrap();
/// assert_eq!(elem.get(), 0x7f00_0000_0028);
/// assert_eq!(Arg::from(elem), Arg::Ptr(0x7f00_0000_0028));
/// ```
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device address.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The address `va`.
    pub const fn new(va: u64) -> DevicePtr {
        DevicePtr(va)
    }

    /// The address as a number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Whether it is null.
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address `bytes` further on; `None` past the end of the 64-bit address space.
    pub const fn offset(self, bytes: u64) -> Option<DevicePtr> {
        match self.0.checked_add(bytes) {
            Some(v) => Some(DevicePtr(v)),
            None => None,
        }
    }
}

impl From<u64> for DevicePtr {
    fn from(va: u64) -> DevicePtr {
        DevicePtr(va)
    }
}

impl From<DevicePtr> for u64 {
    fn from(p: DevicePtr) -> u64 {
        p.0
    }
}

impl From<DevicePtr> for Arg<'_> {
    fn from(p: DevicePtr) -> Self {
        Arg::Ptr(p.0)
    }
}

impl std::fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl std::fmt::LowerHex for DevicePtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

/// One kernel argument. Scalars and pointers are checked against the size the kernel declares; `Bytes` carries
/// a by-value struct (or anything else) as its raw bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg<'a> {
    /// A `signed char` / `int8_t`.
    I8(i8),
    /// An `unsigned char` / `uint8_t` (or a `bool`).
    U8(u8),
    /// A `short` / `int16_t`.
    I16(i16),
    /// An `unsigned short` / `uint16_t`.
    U16(u16),
    /// An `int` / `int32_t`.
    I32(i32),
    /// An `unsigned int` / `uint32_t`.
    U32(u32),
    /// A `long long` / `int64_t`.
    I64(i64),
    /// An `unsigned long long` / `uint64_t` / `size_t`.
    U64(u64),
    /// A `float`.
    F32(f32),
    /// A `double`.
    F64(f64),
    /// A device pointer.
    Ptr(u64),
    /// A parameter passed by value as its raw bytes (a struct, a vector type), laid out as the kernel
    /// expects; only its size is checked.
    Bytes(&'a [u8]),
}

impl Arg<'_> {
    fn write(&self, out: &mut [u8]) {
        match *self {
            Arg::I8(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::U8(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::I16(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::U16(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::I32(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::U32(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::I64(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::U64(v) | Arg::Ptr(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::F32(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::F64(v) => out.copy_from_slice(&v.to_le_bytes()),
            Arg::Bytes(b) => out.copy_from_slice(b),
        }
    }

    /// Bytes the argument occupies in the parameter buffer.
    pub fn size(&self) -> usize {
        match self {
            Arg::I8(_) | Arg::U8(_) => 1,
            Arg::I16(_) | Arg::U16(_) => 2,
            Arg::I32(_) | Arg::U32(_) | Arg::F32(_) => 4,
            Arg::I64(_) | Arg::U64(_) | Arg::F64(_) | Arg::Ptr(_) => 8,
            Arg::Bytes(b) => b.len(),
        }
    }
}

/// Arguments that do not match what the kernel declares.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    /// The number of arguments differs from the kernel's parameters.
    #[error(
        "kernel `{kernel}` takes {expected} parameters, {given} given; pass one Arg per parameter"
    )]
    Count {
        /// The kernel.
        kernel: String,
        /// Parameters it declares.
        expected: usize,
        /// Arguments passed.
        given: usize,
    },
    /// An argument's size differs from its parameter's.
    #[error(
        "kernel `{kernel}` parameter {index} is {expected} bytes, the argument is {given}; pass an Arg of the \
         parameter's type"
    )]
    Size {
        /// The kernel.
        kernel: String,
        /// The parameter's position.
        index: usize,
        /// Its size in bytes.
        expected: u32,
        /// The argument's size in bytes.
        given: usize,
    },
    /// The cubin's parameter table places a parameter outside the parameter block (a corrupt cubin).
    #[error(
        "kernel `{kernel}` parameter {index} at {offset:#x}+{size} lies outside its {block}-byte parameter block; the cubin is corrupt: rebuild it"
    )]
    Layout {
        /// The kernel.
        kernel: String,
        /// The parameter's position.
        index: usize,
        /// Its offset in the block.
        offset: u32,
        /// Its size.
        size: u32,
        /// The block's size.
        block: u32,
    },
}

/// Packs `args` into `out` (the parameter block, at least `kernel.param_cbank_size` bytes) at the offsets the
/// kernel declares. Padding between parameters is zeroed. Returns the block's size.
pub fn pack(kernel: &KernelInfo, args: &[Arg<'_>], out: &mut [u8]) -> Result<usize, ParamError> {
    pack_by(
        &kernel.name,
        kernel.param_cbank_size,
        kernel.params.iter().map(|p| (p.offset, p.size)),
        args,
        out,
    )
}

/// Packs `args` by a table of (offset, size) pairs, one per parameter, as the CUDA driver reports them
/// (`cuFuncGetParamInfo`), for kernels whose cubin APEX did not read (PTX loaded by the driver). The block ends
/// with the last parameter. Returns the block's size.
pub fn pack_table(
    kernel: &str,
    table: &[(u32, u32)],
    args: &[Arg<'_>],
    out: &mut [u8],
) -> Result<usize, ParamError> {
    let block = table
        .iter()
        .map(|&(o, s)| o.saturating_add(s))
        .max()
        .unwrap_or(0);
    pack_by(kernel, block, table.iter().copied(), args, out)
}

fn pack_by(
    kernel: &str,
    block: u32,
    table: impl ExactSizeIterator<Item = (u32, u32)> + Clone,
    args: &[Arg<'_>],
    out: &mut [u8],
) -> Result<usize, ParamError> {
    if args.len() != table.len() {
        return Err(ParamError::Count {
            kernel: kernel.to_string(),
            expected: table.len(),
            given: args.len(),
        });
    }
    for (index, (arg, (offset, size))) in args.iter().zip(table.clone()).enumerate() {
        if arg.size() != size as usize {
            return Err(ParamError::Size {
                kernel: kernel.to_string(),
                index,
                expected: size,
                given: arg.size(),
            });
        }
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= block && e as usize <= out.len());
        if end.is_none() {
            return Err(ParamError::Layout {
                kernel: kernel.to_string(),
                index,
                offset,
                size,
                block,
            });
        }
    }
    let used = (block as usize).min(out.len());
    out[..used].fill(0);
    for (arg, (offset, size)) in args.iter().zip(table) {
        arg.write(&mut out[offset as usize..(offset + size) as usize]);
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::cubin::Cubin;

    fn kernels() -> Cubin {
        Cubin::parse(include_bytes!(
            "../../kernels/apex_test_kernels.sm_90.cubin"
        ))
        .unwrap()
    }

    #[test]
    fn scalars_land_at_their_declared_offsets() {
        let c = kernels();
        let k = c.kernel("scalar_params").unwrap();
        let mut block = [0xffu8; 64];
        let n = pack(
            k,
            &[
                Arg::Ptr(0x1122_3344_5566_7788),
                Arg::I8(-2),
                Arg::I16(-3),
                Arg::I32(-4),
                Arg::I64(-5),
                Arg::F32(1.5),
                Arg::F64(2.5),
                Arg::U8(7),
                Arg::U64(9),
            ],
            &mut block,
        )
        .unwrap();
        assert_eq!(n, k.param_cbank_size as usize);
        for (p, expect) in k.params.iter().zip([8usize, 1, 2, 4, 8, 4, 8, 1, 8]) {
            assert_eq!(p.size as usize, expect);
            assert_eq!(p.offset as usize % expect, 0, "natural alignment");
        }
        assert_eq!(&block[0..8], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(block[k.params[1].offset as usize] as i8, -2);
        let f = k.params[5].offset as usize;
        assert_eq!(f32::from_le_bytes(block[f..f + 4].try_into().unwrap()), 1.5);
        // The byte after the i8 is padding: zeroed, not left as it was.
        assert_eq!(block[k.params[1].offset as usize + 1], 0);
    }

    #[test]
    fn a_driver_table_packs_like_the_cubin_table() {
        let c = kernels();
        let k = c.kernel("saxpy").unwrap();
        let table: Vec<(u32, u32)> = k.params.iter().map(|p| (p.offset, p.size)).collect();
        let args = [
            Arg::F32(2.5),
            Arg::Ptr(0x1000),
            Arg::Ptr(0x2000),
            Arg::U32(77),
        ];
        let (mut a, mut b) = ([0xaau8; 64], [0x55u8; 64]);
        let n = pack(k, &args, &mut a).unwrap();
        assert_eq!(pack_table("saxpy", &table, &args, &mut b).unwrap(), n);
        assert_eq!(a[..n], b[..n]);
        assert!(matches!(
            pack_table("saxpy", &table, &args[..3], &mut b),
            Err(ParamError::Count {
                expected: 4,
                given: 3,
                ..
            })
        ));
        assert!(matches!(
            pack_table(
                "saxpy",
                &table,
                &[Arg::F64(1.0), args[1], args[2], args[3]],
                &mut b
            ),
            Err(ParamError::Size { index: 0, .. })
        ));
        assert!(matches!(
            pack_table("saxpy", &table, &args, &mut b[..8]),
            Err(ParamError::Layout { .. })
        ));
    }

    #[test]
    fn mismatches_are_errors() {
        let c = kernels();
        let k = c.kernel("saxpy").unwrap();
        let mut block = [0u8; 64];
        assert!(matches!(
            pack(k, &[Arg::F32(1.0)], &mut block),
            Err(ParamError::Count {
                expected: 4,
                given: 1,
                ..
            })
        ));
        let e = pack(
            k,
            &[Arg::F64(1.0), Arg::Ptr(0), Arg::Ptr(0), Arg::U32(1)],
            &mut block,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            ParamError::Size {
                index: 0,
                expected: 4,
                given: 8,
                ..
            }
        ));
        let big = c.kernel("big_param").unwrap();
        let words = [0u8; 4096];
        let mut small = [0u8; 64];
        assert!(matches!(
            pack(big, &[Arg::Ptr(0), Arg::Bytes(&words)], &mut small),
            Err(ParamError::Layout { .. })
        ));
        let mut room = vec![0u8; 8192];
        assert_eq!(
            pack(big, &[Arg::Ptr(0), Arg::Bytes(&words)], &mut room).unwrap(),
            big.param_cbank_size as usize
        );
    }
}

#[cfg(test)]
mod device_ptr_tests {
    use super::*;

    #[test]
    fn device_addresses_convert_offset_and_print() {
        let p = DevicePtr::from(0x1000u64);
        assert_eq!(u64::from(p), 0x1000);
        assert_eq!(p.offset(0x20), Some(DevicePtr(0x1020)));
        assert_eq!(DevicePtr(u64::MAX).offset(1), None);
        assert!(DevicePtr::NULL.is_null() && !p.is_null());
        assert_eq!(format!("{p}"), "0x1000");
        assert_eq!(format!("{p:x}"), "1000");
        assert_eq!(Arg::from(p), Arg::Ptr(0x1000));
        assert_eq!(std::mem::size_of::<DevicePtr>(), 8);
    }
}
