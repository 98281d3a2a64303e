//! Copy engines as RM names them: logical copy engine (LCE) indices, their `NV2080_ENGINE_TYPE_COPY(n)` engine
//! types, and the allocation parameters that bind a copy object to one.

use super::sys;

/// LCE indices RM has engine types for (`NV2080_ENGINE_TYPE_COPY0` to `COPY19`).
pub const MAX_LCES: u32 = 20;

/// `NV2080_ENGINE_TYPE_COPY(lce)`: the engine type of logical copy engine `lce` (COPY0-9 and COPY10-19 are not
/// contiguous), or `None` past the last one RM names.
pub fn copy_engine_type(lce: u32) -> Option<u32> {
    match lce {
        0..10 => Some(sys::NV2080_ENGINE_TYPE_COPY0 + lce),
        10..MAX_LCES => Some(sys::NV2080_ENGINE_TYPE_COPY10 + lce - 10),
        _ => None,
    }
}

/// The LCE index of a copy engine type (`NV2080_ENGINE_TYPE_IS_COPY`), or `None` for any other engine.
pub fn lce_of_engine_type(engine_type: u32) -> Option<u32> {
    match engine_type {
        t if (sys::NV2080_ENGINE_TYPE_COPY0..=sys::NV2080_ENGINE_TYPE_COPY9).contains(&t) => {
            Some(t - sys::NV2080_ENGINE_TYPE_COPY0)
        }
        t if (sys::NV2080_ENGINE_TYPE_COPY10..=sys::NV2080_ENGINE_TYPE_COPY19).contains(&t) => {
            Some(t - sys::NV2080_ENGINE_TYPE_COPY10 + 10)
        }
        _ => None,
    }
}

/// `NVB0B5_ALLOCATION_PARAMETERS` (class/clb0b5sw.h, not among the vendored headers): which copy engine a copy
/// object (a `*_DMA_COPY_*` class allocated under a channel) runs on. Without parameters RM binds it to CE 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyAllocParams {
    /// [`COPY_ALLOC_VERSION_INSTANCE`] or [`COPY_ALLOC_VERSION_ENGINE_TYPE`].
    pub version: u32,
    /// A CE instance index (version 0) or an `NV2080_ENGINE_TYPE_COPY(n)` (version 1).
    pub engine_type: u32,
}

/// `NVB0B5_ALLOCATION_PARAMETERS_VERSION_0`: `engine_type` is a CE instance index.
pub const COPY_ALLOC_VERSION_INSTANCE: u32 = 0;

/// `NVB0B5_ALLOCATION_PARAMETERS_VERSION_1`: `engine_type` is an `NV2080_ENGINE_TYPE_COPY(n)`.
pub const COPY_ALLOC_VERSION_ENGINE_TYPE: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_types_follow_rms_two_ranges() {
        assert_eq!(copy_engine_type(0), Some(sys::NV2080_ENGINE_TYPE_COPY0));
        assert_eq!(copy_engine_type(9), Some(sys::NV2080_ENGINE_TYPE_COPY9));
        assert_eq!(copy_engine_type(10), Some(sys::NV2080_ENGINE_TYPE_COPY10));
        assert_eq!(copy_engine_type(19), Some(sys::NV2080_ENGINE_TYPE_COPY19));
        assert_eq!(copy_engine_type(20), None);
        for lce in 0..MAX_LCES {
            assert_eq!(
                copy_engine_type(lce).and_then(lce_of_engine_type),
                Some(lce)
            );
        }
        assert_eq!(lce_of_engine_type(sys::NV2080_ENGINE_TYPE_GRAPHICS), None);
        assert_eq!(lce_of_engine_type(sys::NV2080_ENGINE_TYPE_COPY9 + 1), None);
        assert_eq!(size_of::<CopyAllocParams>(), 8);
    }
}
