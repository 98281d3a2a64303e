//! Whether a profiler records the program's GPU activity through CUPTI (torch.profiler through Kineto, Nsight's
//! in-process collectors, a CUPTI client of the program's own): CUPTI sees the work libcuda runs, never APEX's, so
//! while one records, launches, copies and memsets go to libcuda (in order with APEX's earlier work, as a capture's
//! do) and the profile shows every kernel. The wrappers below watch `cuptiActivityEnable` and
//! `cuptiActivityDisable` (and their per-context forms): they are exported (programs linked against CUPTI without
//! symbol versions call them), handed out by the `dlsym` hook, and written into the GOT slots of loaded libraries
//! that import CUPTI by versioned references (PyTorch's Kineto: `cuptiActivityEnable@libcupti.so.13`, which an
//! unversioned definition does not interpose) when the engine starts ([`redirect_importers`]). Callback
//! subscriptions are not watched (Kineto subscribes to CUPTI's callbacks whether or not it profiles).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use apex_interpose::{Redirect, next};

/// The activity kinds enabled now.
struct Kinds {
    /// Kinds below 64, one bit each.
    low: AtomicU64,
    /// Kinds from 64 up (each counted once per enable).
    high: AtomicU32,
}

impl Kinds {
    const fn new() -> Kinds {
        Kinds {
            low: AtomicU64::new(0),
            high: AtomicU32::new(0),
        }
    }

    fn recording(&self) -> bool {
        self.low.load(Ordering::Acquire) != 0 || self.high.load(Ordering::Acquire) != 0
    }

    fn enabling(&self, kind: u32) -> bool {
        match 1u64.checked_shl(kind) {
            Some(bit) => self.low.fetch_or(bit, Ordering::AcqRel) & bit != 0,
            None => {
                self.high.fetch_add(1, Ordering::AcqRel);
                false
            }
        }
    }

    fn disabled(&self, kind: u32) {
        match 1u64.checked_shl(kind) {
            Some(bit) => {
                self.low.fetch_and(!bit, Ordering::AcqRel);
            }
            None => {
                let _ = self
                    .high
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
            }
        }
    }
}

static KINDS: Kinds = Kinds::new();

/// Whether a profiler records GPU activity now: some activity kind is enabled.
pub(crate) fn recording() -> bool {
    KINDS.recording()
}

/// Activity kind `kind` is about to be enabled (marked before CUPTI's call, so that no launch made meanwhile goes to
/// APEX unseen). Whether it was marked already.
pub(crate) fn enabling(kind: u32) -> bool {
    KINDS.enabling(kind)
}

/// Activity kind `kind` is no longer recorded (CUPTI disabled it, or refused to enable one not marked before).
pub(crate) fn disabled(kind: u32) {
    KINDS.disabled(kind)
}

/// `CUPTI_ERROR_NOT_INITIALIZED`: what the wrappers return when CUPTI's own function cannot be found.
const CUPTI_ERROR_NOT_INITIALIZED: c_int = 15;
/// `CUPTI_SUCCESS`.
const CUPTI_SUCCESS: c_int = 0;

static REAL_ENABLE: AtomicUsize = AtomicUsize::new(0);
static REAL_DISABLE: AtomicUsize = AtomicUsize::new(0);
static REAL_ENABLE_CONTEXT: AtomicUsize = AtomicUsize::new(0);
static REAL_DISABLE_CONTEXT: AtomicUsize = AtomicUsize::new(0);

type KindFn = unsafe extern "C" fn(u32) -> c_int;
type ContextKindFn = unsafe extern "C" fn(*mut c_void, u32) -> c_int;

/// Marks `kind` as recorded, calls `call` (CUPTI's enable), and unmarks it if CUPTI refused and it was not marked
/// before.
fn enable(kind: u32, call: impl FnOnce() -> c_int) -> c_int {
    let was = enabling(kind);
    let r = call();
    if r != CUPTI_SUCCESS && !was {
        disabled(kind);
    }
    r
}

/// # Safety
/// `cuptiActivityEnable`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityEnable(kind: u32) -> c_int {
    let p = next(&REAL_ENABLE, c"cuptiActivityEnable");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let real = unsafe { std::mem::transmute::<usize, KindFn>(p) };
    // SAFETY: forwarded unchanged.
    enable(kind, || unsafe { real(kind) })
}

/// # Safety
/// `cuptiActivityEnableContext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityEnableContext(context: *mut c_void, kind: u32) -> c_int {
    let p = next(&REAL_ENABLE_CONTEXT, c"cuptiActivityEnableContext");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let real = unsafe { std::mem::transmute::<usize, ContextKindFn>(p) };
    // Recorded for one context: the preload leaves every context's work to libcuda meanwhile (conservative).
    // SAFETY: forwarded unchanged.
    enable(kind, || unsafe { real(context, kind) })
}

/// # Safety
/// `cuptiActivityDisable`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityDisable(kind: u32) -> c_int {
    let p = next(&REAL_DISABLE, c"cuptiActivityDisable");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let real = unsafe { std::mem::transmute::<usize, KindFn>(p) };
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(kind) };
    if r == CUPTI_SUCCESS {
        disabled(kind);
    }
    r
}

/// # Safety
/// `cuptiActivityDisableContext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityDisableContext(context: *mut c_void, kind: u32) -> c_int {
    let p = next(&REAL_DISABLE_CONTEXT, c"cuptiActivityDisableContext");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let real = unsafe { std::mem::transmute::<usize, ContextKindFn>(p) };
    // One context's recording ends; whether others still record is not known here, so the kind stays marked until
    // a `cuptiActivityDisable` of it (libcuda keeps running the work meanwhile: seen, never lost).
    // SAFETY: forwarded unchanged.
    unsafe { real(context, kind) }
}

/// The wrapper `dlsym` hands out for CUPTI's function `name`, with the slot CUPTI's own goes into.
pub(crate) fn by_symbol(name: &[u8]) -> Option<(&'static AtomicUsize, usize)> {
    Some(match name {
        b"cuptiActivityEnable" => (&REAL_ENABLE, cuptiActivityEnable as *const () as usize),
        b"cuptiActivityDisable" => (&REAL_DISABLE, cuptiActivityDisable as *const () as usize),
        b"cuptiActivityEnableContext" => (
            &REAL_ENABLE_CONTEXT,
            cuptiActivityEnableContext as *const () as usize,
        ),
        b"cuptiActivityDisableContext" => (
            &REAL_DISABLE_CONTEXT,
            cuptiActivityDisableContext as *const () as usize,
        ),
        _ => return None,
    })
}

/// The loader's count of objects loaded when [`redirect_importers`] last looked.
static LOADS_SEEN: AtomicU64 = AtomicU64::new(0);

/// [`redirect_importers`] again if the process has loaded libraries since it last ran (one call into the loader
/// when it has not): a program may load a CUPTI client after its first CUDA call.
pub(crate) fn redirect_new_importers() {
    let now = apex_interpose::loads_so_far();
    if now != 0 && now != LOADS_SEEN.load(Ordering::Relaxed) {
        redirect_importers();
    }
}

/// Points the GOT slots of every loaded library that imports CUPTI's activity switches at the wrappers
/// ([`apex_interpose::redirect_imports`]); how many slots do. Called when the engine starts, after the program
/// loaded its libraries (PyTorch's at `import torch`, before its first CUDA call).
pub(crate) fn redirect_importers() -> usize {
    LOADS_SEEN.store(apex_interpose::loads_so_far(), Ordering::Relaxed);
    let redirects = [
        Redirect {
            name: c"cuptiActivityEnable",
            ours: cuptiActivityEnable as *const () as usize,
            real: &REAL_ENABLE,
        },
        Redirect {
            name: c"cuptiActivityDisable",
            ours: cuptiActivityDisable as *const () as usize,
            real: &REAL_DISABLE,
        },
        Redirect {
            name: c"cuptiActivityEnableContext",
            ours: cuptiActivityEnableContext as *const () as usize,
            real: &REAL_ENABLE_CONTEXT,
        },
        Redirect {
            name: c"cuptiActivityDisableContext",
            ours: cuptiActivityDisableContext as *const () as usize,
            real: &REAL_DISABLE_CONTEXT,
        },
    ];
    // SAFETY: each wrapper has its function's signature and calls what its slot holds.
    unsafe { apex_interpose::redirect_imports(&redirects, b"libcupti") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_follows_the_kinds_enabled() {
        let k = Kinds::new();
        assert!(!k.recording());
        // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL and _MEMCPY.
        assert!(!k.enabling(10));
        assert!(k.enabling(10), "enabled twice");
        assert!(!k.enabling(1));
        assert!(k.recording());
        k.disabled(10);
        assert!(k.recording(), "memcpy still recorded");
        k.disabled(1);
        assert!(!k.recording());
        // A kind beyond the bit set.
        assert!(!k.enabling(70));
        assert!(k.recording());
        k.disabled(70);
        k.disabled(70);
        assert!(!k.recording(), "never below nothing");
    }
}
