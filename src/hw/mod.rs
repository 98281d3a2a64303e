//! Class tables generated from NVIDIA's class headers by `build/classes.rs`.
//!
//! Every method offset, field position and enum value here comes from `open-gpu-headers/`; nothing
//! is typed by hand. Inside each module the names are the header names with the class prefix
//! stripped: `NVC86F_SEM_EXECUTE` is [`host::c86f::SEM_EXECUTE`], `NVCBC0_QMDV04_00_GRID_WIDTH` is
//! [`qmd::v04::GRID_WIDTH`], indexed defines become `const fn`s (`qmd::v04::CONSTANT_BUFFER_VALID(i)`).
//!
//! - [`host`]: GPFIFO (host) classes `c56f` (Ampere, the most complete host method list and the DMA
//!   method-header formats `DMA_*`), `c86f` (Hopper), `c96f`, `ca6f` (Blackwell), and the usermode
//!   (doorbell) class `c361`.
//! - [`compute`]: `c6c0`, `c7c0` (Ampere), `c9c0` (Ada), `cbc0` (Hopper), `cdc0`, `cec0` (Blackwell).
//! - [`qmd`]: QMD layouts `v03` (Ampere/Ada, also accepted by Hopper), `v04` (Hopper), `v05` (Blackwell).
//! - [`copy`]: copy-engine classes `c6b5`, `c7b5` (Ampere), `c8b5` (Hopper), `c9b5`, `cab5` (Blackwell).
//!
//! Each class module has `CLASS` (the class number), the named class define (e.g.
//! `HOPPER_COMPUTE_A`) and `METHODS`, a [`MethodDesc`] table for decoders. Each QMD module has
//! `SIZE_BYTES` and `FIELDS`.
//!
//! [`generation`] is the one GPU-generation table (classes, QMD layout, limits, shared-memory carveouts and what
//! the launch recipe is verified on, per SM version) that rm, gpfifo, pushbuf, launch and the simulator read.

pub mod generation;

pub use generation::{Generation, QmdVersion, UnknownGeneration};

include!(concat!(env!("OUT_DIR"), "/classes.rs"));

/// Inclusive bit range. For method fields: bits within the 32-bit data word. For QMD fields: absolute
/// bit index in the QMD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Field {
    /// Highest bit of the range.
    pub hi: u32,
    /// Lowest bit of the range.
    pub lo: u32,
}

impl Field {
    /// The bits `hi` down to `lo`, both included (the `hi:lo` of NVIDIA's headers).
    pub const fn new(hi: u32, lo: u32) -> Field {
        Field { hi, lo }
    }

    /// Number of bits; 0 for a malformed range (`hi < lo`), which the generator never emits.
    pub const fn width(self) -> u32 {
        if self.hi < self.lo {
            0
        } else {
            self.hi - self.lo + 1
        }
    }

    /// `(1 << width) - 1`, unshifted; all ones for a 64-bit (or wider) field.
    pub const fn mask(self) -> u64 {
        let w = self.width();
        if w >= 64 { u64::MAX } else { (1u64 << w) - 1 }
    }

    /// Whether `value` fits the field without truncation.
    pub const fn fits(self, value: u64) -> bool {
        value & !self.mask() == 0
    }

    /// `(value & mask) << lo`, for method data words (`hi < 32`); bits above 31 are dropped.
    pub const fn pack(self, value: u32) -> u32 {
        if self.lo >= 32 {
            return 0;
        }
        ((value as u64 & self.mask()) << self.lo) as u32
    }

    /// The field's value in a method data word.
    pub const fn unpack(self, word: u32) -> u32 {
        if self.lo >= 32 {
            return 0;
        }
        ((word as u64 >> self.lo) & self.mask()) as u32
    }

    /// Reads the field from a structure held as little-endian 32-bit words (a QMD), across word
    /// boundaries. `None` if the structure is too short or the field is wider than 64 bits.
    pub fn get(self, words: &[u32]) -> Option<u64> {
        if self.width() == 0 || self.width() > 64 || words.len() <= (self.hi / 32) as usize {
            return None;
        }
        let mut value = 0u64;
        // Walk the words the field touches; at most three for a 64-bit field.
        for w in self.lo / 32..=self.hi / 32 {
            let word = u64::from(*words.get(w as usize)?);
            let (start, end) = (self.lo.max(w * 32), self.hi.min(w * 32 + 31));
            let bits = (word >> (start - w * 32)) & Field::new(end - start, 0).mask();
            value |= bits << (start - self.lo);
        }
        Some(value)
    }

    /// Writes the field into a structure held as 32-bit words. Fails (and writes nothing) if the
    /// structure is too short or `value` does not fit.
    pub fn set(self, words: &mut [u32], value: u64) -> Result<(), FieldError> {
        if self.width() == 0 || self.width() > 64 || words.len() <= (self.hi / 32) as usize {
            return Err(FieldError::OutOfRange {
                field: self,
                words: words.len(),
            });
        }
        if !self.fits(value) {
            return Err(FieldError::TooWide { field: self, value });
        }
        for w in self.lo / 32..=self.hi / 32 {
            let (start, end) = (self.lo.max(w * 32), self.hi.min(w * 32 + 31));
            let part = Field::new(end - w * 32, start - w * 32);
            let bits = (value >> (start - self.lo)) as u32;
            if let Some(word) = words.get_mut(w as usize) {
                *word = (*word & !part.pack(u32::MAX)) | part.pack(bits);
            }
        }
        Ok(())
    }
}

/// Why [`Field::set`] refused a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    /// The field's bits lie past the end of the structure.
    #[error("field {field:?} lies outside a structure of {words} words")]
    OutOfRange {
        /// The field.
        field: Field,
        /// The structure's length in 32-bit words.
        words: usize,
    },
    /// The value has bits above the field's width.
    #[error("value {value:#x} does not fit field {field:?}")]
    TooWide {
        /// The field.
        field: Field,
        /// The value.
        value: u64,
    },
}

/// One method of a class, for decoders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MethodDesc {
    /// Header name without the class prefix, e.g. `SEM_EXECUTE`.
    pub name: &'static str,
    /// Byte offset of the method (of element 0 for arrays).
    pub offset: u32,
    /// 1, or the element count of an indexed method `NAME(i)`.
    pub count: u32,
    /// Byte distance between array elements (4 for plain methods; 8 for e.g. `CALL_MME_MACRO(j)`).
    pub stride: u32,
    /// The fields of the method's data word, for decoding it (empty when the header defines none).
    pub fields: &'static [FieldDesc],
}

/// One field of a method's data word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldDesc {
    /// Header name without the method prefix, e.g. `OPERATION`.
    pub name: &'static str,
    /// Where the field lies in the data word.
    pub field: Field,
    /// Named values, e.g. `("RELEASE", 1)`.
    pub values: &'static [(&'static str, u32)],
}

impl FieldDesc {
    /// Name of `value` among the field's named values (the first one, where names alias).
    pub fn value_name(&self, value: u32) -> Option<&'static str> {
        self.values.iter().find(|v| v.1 == value).map(|v| v.0)
    }
}

/// The method at byte `offset` in `methods`, with the element index for array methods.
pub fn method_by_offset(
    methods: &'static [MethodDesc],
    offset: u32,
) -> Option<(&'static MethodDesc, u32)> {
    methods.iter().find_map(|m| {
        let delta = offset.checked_sub(m.offset)?;
        if m.stride == 0 || !delta.is_multiple_of(m.stride) {
            return None;
        }
        let index = delta / m.stride;
        (index < m.count).then_some((m, index))
    })
}

/// `FIELDS` and `SIZE_BYTES` of the QMD layout with major version `version` (3, 4 or 5).
pub fn qmd_layout(version: u8) -> Option<(&'static [(&'static str, Field)], usize)> {
    match version {
        3 => Some((qmd::v03::FIELDS, qmd::v03::SIZE_BYTES)),
        4 => Some((qmd::v04::FIELDS, qmd::v04::SIZE_BYTES)),
        5 => Some((qmd::v05::FIELDS, qmd::v05::SIZE_BYTES)),
        _ => None,
    }
}
