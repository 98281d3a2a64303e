//! The simulator's own reading of NVIDIA's class headers.
//!
//! The encoder writes QMDs and methods with the tables `build/classes.rs` generates into [`crate::hw`]; if
//! the simulator checked them with the same tables, a wrong table would pass. So the simulator reads the
//! vendored headers a second time, independently: each header is embedded with `include_str!` and every
//! constant the simulator uses is found by name (`#define NVCBC0_QMDV04_00_GRID_WIDTH MW(1055:1024)`) and
//! evaluated by the `const fn`s below when the crate compiles. A define that is missing or has a form the
//! reader does not know fails the build. The forms read are the ones the headers use for what the
//! simulator needs:
//!
//! - `#define NAME 0x02b4` / `#define NAME (0x0000005C)`: a method offset or a value;
//! - `#define NAME 31:29`: a field of a 32-bit method data word or method header;
//! - `#define NAME MW(583:580)`: a QMD field as absolute bit positions;
//! - function-like `#define NAME(i) (0x0320+(i)*4)` and `#define NAME(i) MW((416+(i)*4):(416+(i)*4))`,
//!   evaluated at `i` (`+ - *`, parentheses, decimal and hex literals).
//!
//! Only the bit-range type [`Field`] is shared with the encoder; no position or offset is.

// Scanning a header for each constant is a few hundred thousand const-eval steps.
#![allow(long_running_const_eval)]

use crate::hw::Field;

macro_rules! header {
    ($path:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/open-gpu-headers/",
            $path
        ))
    };
}

/// `clcbc0qmd.h`: QMD V04 (Hopper).
const CLCBC0QMD: &str = header!("open-gpu-doc/classes/compute/clcbc0qmd.h");
/// `clcbc0.h`: `HOPPER_COMPUTE_A`.
const CLCBC0: &str = header!("open-gpu-doc/classes/compute/clcbc0.h");
/// `clc8b5.h`: `HOPPER_DMA_COPY_A`.
const CLC8B5: &str = header!("open-gpu-doc/classes/dma-copy/clc8b5.h");
/// `clc86f.h`: `HOPPER_CHANNEL_GPFIFO_A`.
const CLC86F: &str = header!("open-gpu-kernel-modules/src/common/sdk/nvidia/inc/class/clc86f.h");
/// `clc56f.h`: `AMPERE_CHANNEL_GPFIFO_A`, for the host defines Hopper's header leaves out.
const CLC56F: &str = header!("open-gpu-kernel-modules/src/common/sdk/nvidia/inc/class/clc56f.h");

const fn is_space(b: u8) -> bool {
    b == b' ' || b == b'\t' || b == b'\r'
}

const fn skip_space(b: &[u8], mut at: usize) -> usize {
    while at < b.len() && is_space(b[at]) {
        at += 1;
    }
    at
}

/// Whether `b[at..]` starts with `word`.
const fn starts(b: &[u8], at: usize, word: &[u8]) -> bool {
    if at + word.len() > b.len() {
        return false;
    }
    let mut k = 0;
    while k < word.len() {
        if b[at + k] != word[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// The body of `#define NAME ...` (after the name and, for a function-like define, its parameter list):
/// its start and the end of its line. Panics (a build error) if the header has no such define.
const fn body(text: &str, name: &str) -> (usize, usize) {
    let b = text.as_bytes();
    let n = name.as_bytes();
    let mut line = 0;
    while line < b.len() {
        let mut end = line;
        while end < b.len() && b[end] != b'\n' {
            end += 1;
        }
        let at = skip_space(b, line);
        if starts(b, at, b"#define") {
            let at = skip_space(b, at + 7);
            if starts(b, at, n) {
                let mut at = at + n.len();
                if at < end && b[at] == b'(' {
                    while at < end && b[at] != b')' {
                        at += 1;
                    }
                    return (skip_space(b, at + 1), end);
                }
                if at < end && is_space(b[at]) {
                    return (skip_space(b, at), end);
                }
            }
        }
        line = end + 1;
    }
    panic!("define not found in the class header");
}

/// `expr := term (('+' | '-') term)*`, returning the value and where it stopped.
const fn expr(b: &[u8], at: usize, i: u64) -> (u64, usize) {
    let (mut v, mut at) = term(b, at, i);
    loop {
        at = skip_space(b, at);
        if at < b.len() && b[at] == b'+' {
            let (t, next) = term(b, at + 1, i);
            v = v.wrapping_add(t);
            at = next;
        } else if at < b.len() && b[at] == b'-' {
            let (t, next) = term(b, at + 1, i);
            v = v.wrapping_sub(t);
            at = next;
        } else {
            return (v, at);
        }
    }
}

/// `term := atom ('*' atom)*`.
const fn term(b: &[u8], at: usize, i: u64) -> (u64, usize) {
    let (mut v, mut at) = atom(b, at, i);
    loop {
        at = skip_space(b, at);
        if at < b.len() && b[at] == b'*' {
            let (t, next) = atom(b, at + 1, i);
            v = v.wrapping_mul(t);
            at = next;
        } else {
            return (v, at);
        }
    }
}

/// `atom := '(' expr ')' | 'i' | decimal | 0x hex`.
const fn atom(b: &[u8], at: usize, i: u64) -> (u64, usize) {
    let at = skip_space(b, at);
    assert!(at < b.len(), "expression ends early");
    if b[at] == b'(' {
        let (v, at) = expr(b, at + 1, i);
        let at = skip_space(b, at);
        assert!(at < b.len() && b[at] == b')', "unbalanced parenthesis");
        return (v, at + 1);
    }
    if b[at] == b'i' {
        return (i, at + 1);
    }
    let (mut at, radix) = if starts(b, at, b"0x") || starts(b, at, b"0X") {
        (at + 2, 16)
    } else {
        (at, 10)
    };
    let start = at;
    let mut v: u64 = 0;
    while at < b.len() {
        let d = match b[at] {
            c @ b'0'..=b'9' => (c - b'0') as u64,
            c @ b'a'..=b'f' if radix == 16 => (c - b'a' + 10) as u64,
            c @ b'A'..=b'F' if radix == 16 => (c - b'A' + 10) as u64,
            _ => break,
        };
        v = v * radix + d;
        at += 1;
    }
    assert!(at > start, "expected a number");
    (v, at)
}

/// Panics unless only whitespace (or a comment) is left of the body.
const fn done(b: &[u8], at: usize, end: usize) {
    let at = skip_space(b, at);
    assert!(
        at >= end || starts(b, at, b"/*") || starts(b, at, b"//"),
        "trailing text"
    );
}

/// `#define NAME value` (or `NAME(i) expression`, at `i`).
pub(crate) const fn value(text: &str, name: &str, i: u64) -> u64 {
    let b = text.as_bytes();
    let (at, end) = body(text, name);
    let (v, at) = expr(b, at, i);
    done(b, at, end);
    v
}

/// `#define NAME hi:lo`, a field of a method data word.
pub(crate) const fn field(text: &str, name: &str) -> Field {
    let b = text.as_bytes();
    let (at, end) = body(text, name);
    let (hi, at) = expr(b, at, 0);
    let at = skip_space(b, at);
    assert!(at < end && b[at] == b':', "expected hi:lo");
    let (lo, at) = expr(b, at + 1, 0);
    done(b, at, end);
    assert!(hi < 32 && lo <= hi, "not a method data field");
    Field::new(hi as u32, lo as u32)
}

/// `#define NAME MW(hi:lo)` (or `NAME(i) MW(hi(i):lo(i))`, at `i`), a QMD field.
pub(crate) const fn mw(text: &str, name: &str, i: u64) -> Field {
    let b = text.as_bytes();
    let (at, end) = body(text, name);
    assert!(starts(b, at, b"MW("), "expected MW(hi:lo)");
    let (hi, at) = expr(b, at + 3, i);
    let at = skip_space(b, at);
    assert!(at < end && b[at] == b':', "expected hi:lo");
    let (lo, at) = expr(b, at + 1, i);
    let at = skip_space(b, at);
    assert!(at < end && b[at] == b')', "expected ')'");
    done(b, at + 1, end);
    assert!(lo <= hi && hi < 1 << 16, "bad MW range");
    Field::new(hi as u32, lo as u32)
}

/// Defines constants read from `$text`, each `NAME` being the define `$prefix NAME`.
///
/// `value NAME;` (a `u32`), `field NAME;` (a method data [`Field`]), `mw NAME;` (a QMD [`Field`]),
/// `value_at NAME;` and `mw_at NAME;` (indexed, `NAME(i: u32)`, affine in `i`: read at 0 and 1 and checked
/// at 2). Under `cfg(test)` each module gets `ALL`, its constants as `(name, value)` pairs for the
/// comparison against the encoder's tables.
macro_rules! read {
    (@item $text:ident, $prefix:literal, value $name:ident) => {
        #[doc = concat!("`", $prefix, stringify!($name), "`")]
        pub(crate) const $name: u32 = {
            let v = super::value($text, concat!($prefix, stringify!($name)), 0);
            assert!(v <= u32::MAX as u64);
            v as u32
        };
    };
    (@item $text:ident, $prefix:literal, field $name:ident) => {
        #[doc = concat!("`", $prefix, stringify!($name), "`")]
        pub(crate) const $name: Field = super::field($text, concat!($prefix, stringify!($name)));
    };
    (@item $text:ident, $prefix:literal, mw $name:ident) => {
        #[doc = concat!("`", $prefix, stringify!($name), "`")]
        pub(crate) const $name: Field = super::mw($text, concat!($prefix, stringify!($name)), 0);
    };
    (@item $text:ident, $prefix:literal, value_at $name:ident) => {
        #[doc = concat!("`", $prefix, stringify!($name), "(i)`")]
        pub(crate) const fn $name(i: u32) -> u32 {
            const NAME: &str = concat!($prefix, stringify!($name));
            const AT0: u32 = super::value($text, NAME, 0) as u32;
            const STEP: u32 = (super::value($text, NAME, 1) as u32).wrapping_sub(AT0);
            const _: () = assert!(super::value($text, NAME, 2) as u32 == AT0 + 2 * STEP);
            AT0.wrapping_add(i.wrapping_mul(STEP))
        }
    };
    (@item $text:ident, $prefix:literal, mw_at $name:ident) => {
        #[doc = concat!("`", $prefix, stringify!($name), "(i)`")]
        pub(crate) const fn $name(i: u32) -> Field {
            const NAME: &str = concat!($prefix, stringify!($name));
            const AT0: Field = super::mw($text, NAME, 0);
            const AT1: Field = super::mw($text, NAME, 1);
            const AT2: Field = super::mw($text, NAME, 2);
            const STEP: u32 = AT1.lo.wrapping_sub(AT0.lo);
            const _: () = assert!(
                AT1.hi.wrapping_sub(AT0.hi) == STEP
                    && AT2.lo == AT0.lo + 2 * STEP
                    && AT2.hi == AT0.hi + 2 * STEP
            );
            Field::new(AT0.hi.wrapping_add(i.wrapping_mul(STEP)), AT0.lo.wrapping_add(i.wrapping_mul(STEP)))
        }
    };
    (@test value $($name:ident)::+) => { Read::Value($($name)::+) };
    (@test field $($name:ident)::+) => { Read::Field($($name)::+) };
    (@test mw $($name:ident)::+) => { Read::Field($($name)::+) };
    (@test value_at $($name:ident)::+) => { Read::Values([$($name)::+(0), $($name)::+(1), $($name)::+(2)]) };
    (@test mw_at $($name:ident)::+) => { Read::Fields([$($name)::+(0), $($name)::+(1), $($name)::+(2)]) };
    ($text:ident, $prefix:literal, $($hw:ident)::+ { $($kind:ident $name:ident;)* }) => {
        $(read!(@item $text, $prefix, $kind $name);)*

        /// The encoder's generated table for the same constants, in the same order as `ALL`.
        #[cfg(test)]
        pub(crate) const HW: &[(&str, super::Read)] = {
            use super::Read;
            use $($hw)::+ as hw;
            &[$((stringify!($name), read!(@test $kind hw::$name)),)*]
        };

        /// Every constant above, by its name without the prefix.
        #[cfg(test)]
        pub(crate) const ALL: &[(&str, super::Read)] = {
            use super::Read;
            &[$((stringify!($name), read!(@test $kind $name)),)*]
        };
    };
}

/// One constant as read, for the comparison tests (indexed ones at `i` = 0, 1, 2).
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    Value(u32),
    Field(Field),
    Values([u32; 3]),
    Fields([Field; 3]),
}

/// QMD V04 (`clcbc0qmd.h`), the fields the simulator checks.
#[allow(non_snake_case)]
pub(crate) mod qmd_v04 {
    use super::{CLCBC0QMD, Field};

    /// Size of a V04 QMD: 3072 bits, the span of the `MW()` positions in `clcbc0qmd.h` (checked in the tests).
    pub(crate) const SIZE_BYTES: usize = 384;

    read!(CLCBC0QMD, "NVCBC0_QMDV04_00_", crate::hw::qmd::v04 {
        mw ARRIVE_AT_LATCH_ID;
        mw ARRIVE_AT_LATCH_VALID;
        mw BARRIER_COUNT;
        mw_at CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6;
        mw_at CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6;
        mw_at CONSTANT_BUFFER_SIZE_SHIFTED4;
        mw_at CONSTANT_BUFFER_VALID;
        mw CTA_THREAD_DIMENSION0;
        mw CTA_THREAD_DIMENSION1;
        mw CTA_THREAD_DIMENSION2;
        mw DEPENDENCE_COUNTER;
        mw DEPENDENT_QMD0_POINTER;
        mw DEPENDENT_QMD1_POINTER;
        mw_at DEPENDENT_QMD_ACTION;
        value DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE;
        value DEPENDENT_QMD_ACTION_QMD_INVALIDATE_COPY_SCHEDULE;
        value DEPENDENT_QMD_ACTION_QMD_SCHEDULE;
        mw_at DEPENDENT_QMD_ENABLE;
        mw GPC_CGA_DEPTH;
        mw GPC_CGA_HEIGHT;
        mw GPC_CGA_WIDTH;
        mw GPU_CGA_DEPTH;
        mw GPU_CGA_HEIGHT;
        mw GPU_CGA_WIDTH;
        mw GRID_DEPTH;
        mw GRID_HEIGHT;
        mw GRID_WIDTH;
        mw MAX_SM_CONFIG_SHARED_MEM_SIZE;
        mw MIN_SM_CONFIG_SHARED_MEM_SIZE;
        mw PROGRAM_ADDRESS_LOWER;
        mw PROGRAM_ADDRESS_UPPER;
        mw QMD_MAJOR_VERSION;
        mw QMD_TYPE;
        value QMD_TYPE_GRID_CTA;
        value QMD_TYPE_GRID_GPC_CGA;
        mw REGISTER_COUNT;
        mw_at RELEASE_ENABLE;
        mw_at RELEASE_PAYLOAD64B;
        mw_at RELEASE_REDUCTION_ENABLE;
        mw_at RELEASE_REDUCTION_FORMAT;
        value RELEASE_REDUCTION_FORMAT_UNSIGNED;
        mw_at RELEASE_REDUCTION_OP;
        value RELEASE_REDUCTION_OP_RED_ADD;
        mw RELEASE_SEMAPHORE0_ADDR_LOWER;
        mw RELEASE_SEMAPHORE0_ADDR_UPPER;
        mw RELEASE_SEMAPHORE0_PAYLOAD_LOWER;
        mw RELEASE_SEMAPHORE0_PAYLOAD_UPPER;
        mw RELEASE_SEMAPHORE1_ADDR_LOWER;
        mw RELEASE_SEMAPHORE1_ADDR_UPPER;
        mw RELEASE_SEMAPHORE1_PAYLOAD_LOWER;
        mw RELEASE_SEMAPHORE1_PAYLOAD_UPPER;
        mw RELEASE_SEMAPHORE2_ADDR_LOWER;
        mw RELEASE_SEMAPHORE2_ADDR_UPPER;
        mw RELEASE_SEMAPHORE2_PAYLOAD_LOWER;
        mw RELEASE_SEMAPHORE2_PAYLOAD_UPPER;
        mw_at RELEASE_STRUCTURE_SIZE;
        value RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS;
        value RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD;
        value RELEASE_STRUCTURE_SIZE_SEMAPHORE_TWO_WORDS;
        mw REQUIRE_SCHEDULING_PCAS;
        mw SASS_VERSION;
        mw SELF_COPY_ON_COMPLETION;
        mw SHADER_LOCAL_MEMORY_HIGH_SIZE;
        mw SHARED_MEMORY_SIZE;
        mw TARGET_SM_CONFIG_SHARED_MEM_SIZE;
        mw WAIT_ON_LATCH_ID;
        mw WAIT_ON_LATCH_VALID;
    });
}

/// `HOPPER_COMPUTE_A` (`clcbc0.h`), the methods the simulator executes.
#[allow(non_snake_case)]
pub(crate) mod cbc0 {
    use super::{CLCBC0, Field};

    /// The class number, `HOPPER_COMPUTE_A`.
    pub(crate) const CLASS: u32 = super::value(CLCBC0, "HOPPER_COMPUTE_A", 0) as u32;

    read!(CLCBC0, "NVCBC0_", crate::hw::compute::cbc0 {
        value INVALIDATE_SHADER_CACHES;
        value INVALIDATE_SHADER_CACHES_NO_WFI;
        value LAUNCH_DMA;
        field LAUNCH_DMA_COMPLETION_TYPE;
        value LAUNCH_DMA_COMPLETION_TYPE_RELEASE_SEMAPHORE;
        field LAUNCH_DMA_DST_MEMORY_LAYOUT;
        value LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH;
        field LAUNCH_DMA_REDUCTION_ENABLE;
        value LINE_COUNT;
        value LINE_LENGTH_IN;
        value LOAD_INLINE_DATA;
        value_at LOAD_INLINE_QMD_DATA;
        value NO_OPERATION;
        value OFFSET_OUT;
        value OFFSET_OUT_UPPER;
        field OFFSET_OUT_UPPER_VALUE;
        value SEND_PCAS_A;
        value SEND_SIGNALING_PCAS2_B;
        field SEND_SIGNALING_PCAS2_B_PCAS_ACTION;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_DECREMENT_DEPENDENCE;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_COPY_SCHEDULE;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_FORCE_REQUIRE_SCHEDULING;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH_SCHEDULE;
        value SEND_SIGNALING_PCAS2_B_PCAS_ACTION_SCHEDULE;
        value SET_INLINE_QMD_ADDRESS_A;
        field SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE;
        value SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE_INLINE_384;
        field SET_INLINE_QMD_ADDRESS_A_QMD_ADDRESS_SHIFTED8_UPPER;
        value SET_INLINE_QMD_ADDRESS_B;
        value SET_QMD_VERSION;
        value SET_SHADER_LOCAL_MEMORY_A;
        field SET_SHADER_LOCAL_MEMORY_A_ADDRESS_UPPER;
        value SET_SHADER_LOCAL_MEMORY_B;
        value SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A;
        field SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A_SIZE_UPPER;
        value SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_B;
        value SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C;
        field SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C_MAX_SM_COUNT;
        value SET_SHADER_LOCAL_MEMORY_WINDOW_A;
        field SET_SHADER_LOCAL_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER;
        value SET_SHADER_LOCAL_MEMORY_WINDOW_B;
        value SET_SHADER_SHARED_MEMORY_WINDOW_A;
        field SET_SHADER_SHARED_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER;
        value SET_SHADER_SHARED_MEMORY_WINDOW_B;
        value SET_SPA_VERSION;
        value WAIT_FOR_IDLE;
    });
}

/// `HOPPER_DMA_COPY_A` (`clc8b5.h`), the methods the simulator executes.
#[allow(non_snake_case)]
pub(crate) mod c8b5 {
    use super::{CLC8B5, Field};

    /// The class number, `HOPPER_DMA_COPY_A`.
    pub(crate) const CLASS: u32 = super::value(CLC8B5, "HOPPER_DMA_COPY_A", 0) as u32;

    read!(CLC8B5, "NVC8B5_", crate::hw::copy::c8b5 {
        value LAUNCH_DMA;
        field LAUNCH_DMA_DATA_TRANSFER_TYPE;
        value LAUNCH_DMA_DATA_TRANSFER_TYPE_NONE;
        field LAUNCH_DMA_DST_MEMORY_LAYOUT;
        value LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH;
        field LAUNCH_DMA_DST_TYPE;
        value LAUNCH_DMA_DST_TYPE_VIRTUAL;
        field LAUNCH_DMA_MULTI_LINE_ENABLE;
        value LAUNCH_DMA_MULTI_LINE_ENABLE_FALSE;
        field LAUNCH_DMA_SEMAPHORE_TYPE;
        value LAUNCH_DMA_SEMAPHORE_TYPE_NONE;
        value LAUNCH_DMA_SEMAPHORE_TYPE_RELEASE_ONE_WORD_SEMAPHORE;
        field LAUNCH_DMA_SRC_MEMORY_LAYOUT;
        value LAUNCH_DMA_SRC_MEMORY_LAYOUT_PITCH;
        field LAUNCH_DMA_SRC_TYPE;
        value LAUNCH_DMA_SRC_TYPE_VIRTUAL;
        value LINE_LENGTH_IN;
        value NOP;
        value OFFSET_IN_LOWER;
        value OFFSET_IN_UPPER;
        field OFFSET_IN_UPPER_UPPER;
        value OFFSET_OUT_LOWER;
        value OFFSET_OUT_UPPER;
        field OFFSET_OUT_UPPER_UPPER;
        value SET_SEMAPHORE_A;
        field SET_SEMAPHORE_A_UPPER;
        value SET_SEMAPHORE_B;
        value SET_SEMAPHORE_PAYLOAD;
    });
}

/// `HOPPER_CHANNEL_GPFIFO_A` (`clc86f.h`), the host methods the simulator executes.
#[allow(non_snake_case)]
pub(crate) mod c86f {
    use super::{CLC86F, Field};

    read!(CLC86F, "NVC86F_", crate::hw::host::c86f {
        value MEM_OP_A;
        value MEM_OP_B;
        value MEM_OP_C;
        value MEM_OP_D;
        field MEM_OP_D_OPERATION;
        value MEM_OP_D_OPERATION_MEMBAR;
        value SEM_ADDR_HI;
        field SEM_ADDR_HI_OFFSET;
        value SEM_ADDR_LO;
        field SEM_ADDR_LO_OFFSET;
        value SEM_EXECUTE;
        field SEM_EXECUTE_OPERATION;
        value SEM_EXECUTE_OPERATION_ACQUIRE;
        value SEM_EXECUTE_OPERATION_ACQ_CIRC_GEQ;
        value SEM_EXECUTE_OPERATION_RELEASE;
        field SEM_EXECUTE_PAYLOAD_SIZE;
        field SEM_EXECUTE_RELEASE_TIMESTAMP;
        value SEM_EXECUTE_RELEASE_TIMESTAMP_EN;
        field SEM_EXECUTE_RELEASE_WFI;
        value SEM_PAYLOAD_HI;
        value SEM_PAYLOAD_LO;
        value SET_OBJECT;
        value WFI;
    });
}

/// `AMPERE_CHANNEL_GPFIFO_A` (`clc56f.h`): host defines `clc86f.h` leaves out, and the method header format
/// (`NVC56F_DMA_*`: SEC_OP, METHOD_ADDRESS, METHOD_SUBCHANNEL, METHOD_COUNT, IMMD_DATA), which only this header
/// defines.
#[allow(non_snake_case)]
pub(crate) mod c56f {
    use super::{CLC56F, Field};

    read!(CLC56F, "NVC56F_", crate::hw::host::c56f {
        field DMA_IMMD_DATA;
        field DMA_METHOD_ADDRESS;
        field DMA_METHOD_COUNT;
        field DMA_METHOD_SUBCHANNEL;
        value DMA_NOP;
        field DMA_SEC_OP;
        value DMA_SEC_OP_END_PB_SEGMENT;
        value DMA_SEC_OP_GRP0_USE_TERT;
        value DMA_SEC_OP_IMMD_DATA_METHOD;
        value DMA_SEC_OP_INC_METHOD;
        value DMA_SEC_OP_NON_INC_METHOD;
        value DMA_SEC_OP_ONE_INC;
        field DMA_SET_SUBDEVICE_MASK_OPCODE;
        value DMA_SET_SUBDEVICE_MASK_OPCODE_VALUE;
        field DMA_STORE_SUBDEVICE_MASK_OPCODE;
        value DMA_STORE_SUBDEVICE_MASK_OPCODE_VALUE;
        field DMA_USE_SUBDEVICE_MASK_OPCODE;
        value DMA_USE_SUBDEVICE_MASK_OPCODE_VALUE;
        value NON_STALL_INTERRUPT;
        value NOP;
        value SEM_EXECUTE_OPERATION_ACQ_STRICT_GEQ;
        value SEM_EXECUTE_PAYLOAD_SIZE_64BIT;
        value SEM_EXECUTE_RELEASE_WFI_EN;
        field SET_OBJECT_NVCLASS;
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::qmd::{ConstBuffer, QMD_WORDS, QmdParams, QmdVersion, build};
    use crate::sim::qmd::{QmdDesc, ReleaseDesc, ReleaseKind, check_fields};

    /// Every constant the simulator reads, against the encoder's generated table: a drift in either
    /// reading of the headers fails here with the constant's name.
    #[test]
    fn the_simulators_reading_matches_the_encoders_tables() {
        let tables = [
            ("qmd_v04", qmd_v04::ALL, qmd_v04::HW),
            ("cbc0", cbc0::ALL, cbc0::HW),
            ("c8b5", c8b5::ALL, c8b5::HW),
            ("c86f", c86f::ALL, c86f::HW),
            ("c56f", c56f::ALL, c56f::HW),
        ];
        let mut compared = 0;
        for (module, ours, theirs) in tables {
            assert_eq!(ours.len(), theirs.len(), "{module}");
            for ((name, a), (hw_name, b)) in ours.iter().zip(theirs) {
                assert_eq!(name, hw_name);
                assert_eq!(a, b, "{module}::{name}: simulator {a:?}, encoder {b:?}");
                compared += 1;
            }
        }
        assert!(compared > 150, "{compared}");
        assert_eq!(cbc0::CLASS, crate::hw::compute::cbc0::CLASS);
        assert_eq!(c8b5::CLASS, crate::hw::copy::c8b5::CLASS);
        assert_eq!(qmd_v04::SIZE_BYTES, crate::hw::qmd::v04::SIZE_BYTES);
        // The highest QMD field read ends inside the QMD's last word.
        assert!(qmd_v04::RELEASE_SEMAPHORE2_PAYLOAD_UPPER.hi < qmd_v04::SIZE_BYTES as u32 * 8);
    }

    #[test]
    fn the_reader_parses_each_form() {
        const T: &str = "/* x */\n#define  P_A (0x0000005C)\n#define P_A_B 31:29\n#define P_Q MW(583:580)\n\
                         #define P_I(i) (0x0320+(i)*4)\n#define P_M(i)   MW((416+(i)*4):(414+(i)*4))\n\
                         #define P_Z 7 /* note */\n";
        assert_eq!(value(T, "P_A", 0), 0x5c);
        assert_eq!(field(T, "P_A_B"), Field::new(31, 29));
        assert_eq!(mw(T, "P_Q", 0), Field::new(583, 580));
        assert_eq!(value(T, "P_I", 3), 0x320 + 12);
        assert_eq!(mw(T, "P_M", 2), Field::new(424, 422));
        assert_eq!(value(T, "P_Z", 0), 7);
    }

    #[test]
    #[should_panic(expected = "define not found")]
    fn a_missing_define_is_an_error() {
        // `P_A` is a prefix of `P_AB`, not a match.
        value("#define P_AB 1\n", "P_A", 0);
    }

    fn params() -> QmdParams {
        let mut cbs = [None; 8];
        cbs[0] = Some(ConstBuffer {
            va: 0x12_3456_7840,
            size: 0x380,
        });
        cbs[3] = Some(ConstBuffer {
            va: 0x7_0000_0100,
            size: 0x40,
        });
        QmdParams {
            sm_version: 90,
            program_va: 0xab_cdef_0100,
            program_bytes: 0x200,
            registers: 24,
            barriers: 1,
            grid: [3, 5, 7],
            block: [8, 4, 2],
            shared_bytes: 0x1400,
            local_bytes_per_thread: 0,
            const_buffers: cbs,
            release: Some((0x9_8765_4300, 0x1_2345_6789)),
            cluster: None,
            sync_domain: 0,
            cluster_load_balancing: false,
        }
    }

    fn encoded() -> [u32; QMD_WORDS] {
        let mut q = [0u32; QMD_WORDS];
        build(QmdVersion::V04, &params(), &mut q).unwrap();
        q
    }

    /// A QMD the encoder wrote, read back with the simulator's own field positions.
    #[test]
    fn an_encoded_qmd_reads_back_with_the_simulators_fields() {
        let q = encoded();
        let get = |f: Field| f.get(&q).unwrap();
        assert_eq!(
            [
                qmd_v04::GRID_WIDTH,
                qmd_v04::GRID_HEIGHT,
                qmd_v04::GRID_DEPTH
            ]
            .map(get),
            [3, 5, 7]
        );
        assert_eq!(
            [
                qmd_v04::CTA_THREAD_DIMENSION0,
                qmd_v04::CTA_THREAD_DIMENSION1,
                qmd_v04::CTA_THREAD_DIMENSION2
            ]
            .map(get),
            [8, 4, 2]
        );
        assert_eq!(
            get(qmd_v04::PROGRAM_ADDRESS_LOWER) | get(qmd_v04::PROGRAM_ADDRESS_UPPER) << 32,
            0xab_cdef_0100
        );
        assert_eq!(get(qmd_v04::SHARED_MEMORY_SIZE), 0x1400);
        assert_eq!(get(qmd_v04::REGISTER_COUNT), 24);

        let d: QmdDesc = check_fields(&q, 90).unwrap();
        assert_eq!(
            (d.grid, d.block, d.shared_bytes),
            ([3, 5, 7], [8, 4, 2], 0x1400)
        );
        assert_eq!(d.program_va, 0xab_cdef_0100);
        assert_eq!(d.const_banks[0], Some((0x12_3456_7840, 0x380)));
        assert_eq!(d.const_banks[3], Some((0x7_0000_0100, 0x40)));
        assert_eq!(d.const_banks.iter().flatten().count(), 2);
        assert_eq!(
            d.releases,
            vec![ReleaseDesc {
                va: 0x9_8765_4300,
                payload: 0x1_2345_6789,
                kind: ReleaseKind::FourWords { payload64: true }
            }]
        );
    }

    /// An encoder whose table put a field one bit off: the simulator, reading its own positions,
    /// no longer sees what the launch asked for (a shared table would see it and pass).
    #[test]
    fn a_misplaced_field_is_caught() {
        use crate::hw::qmd::v04 as hw;
        let good = check_fields(&encoded(), 90).unwrap();
        let fields = [
            hw::GRID_WIDTH,
            hw::GRID_DEPTH,
            hw::CTA_THREAD_DIMENSION0,
            hw::PROGRAM_ADDRESS_LOWER,
            hw::PROGRAM_ADDRESS_UPPER,
            hw::SHARED_MEMORY_SIZE,
            hw::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(0),
            hw::CONSTANT_BUFFER_SIZE_SHIFTED4(3),
            hw::CONSTANT_BUFFER_VALID(3),
            hw::RELEASE_SEMAPHORE0_ADDR_LOWER,
            hw::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
            hw::RELEASE_ENABLE(0),
        ];
        for f in fields {
            let mut q = encoded();
            let v = f.get(&q).unwrap();
            assert_ne!(v, 0, "{f:?}");
            f.set(&mut q, 0).unwrap();
            let wrong = Field::new(f.hi + 1, f.lo + 1);
            let old = wrong.get(&q).unwrap();
            wrong.set(&mut q, v | old).unwrap();
            assert_ne!(
                check_fields(&q, 90).as_ref(),
                Ok(&good),
                "{f:?} one bit up passed"
            );
        }
    }
}
