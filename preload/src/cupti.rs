//! Whether a profiler records the program's GPU activity through CUPTI (torch.profiler through Kineto, Nsight's
//! in-process collectors, a CUPTI client of the program's own): CUPTI sees the work libcuda runs, never APEX's, so
//! while one records, launches, copies and memsets go to libcuda (in order with APEX's earlier work, as a capture's
//! do) and the profile shows every kernel. The wrappers below watch `cuptiActivityEnable`,
//! `cuptiActivityEnableAndDump` and `cuptiActivityDisable` (and the per-context forms): they are exported (programs
//! linked against CUPTI without symbol versions call them), handed out by the `dlsym` hook, and written into the GOT
//! slots of loaded libraries that import CUPTI by versioned references (PyTorch's Kineto:
//! `cuptiActivityEnable@libcupti.so.13`, which an unversioned definition does not interpose) when the engine starts
//! and when a module load follows libraries loaded since ([`request_redirect`]). Callback subscriptions are not
//! watched (Kineto subscribes to CUPTI's callbacks whether or not it profiles).

use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use apex_interpose::{Redirect, next};

/// How CUPTI's file name starts (`libcupti.so.13`, ...).
const PROVIDER: &[u8] = b"libcupti.so";

/// Activity kinds counted apart; others share the last counter.
const KINDS_COUNTED: usize = 64;

/// The activity kinds enabled now: per kind, the enables that succeeded or are under way (a disable clears the
/// kind's count, as CUPTI's disable turns the kind off however often it was enabled), and their sum. A failed enable
/// takes back only its own count, so a concurrent enable of the same kind that succeeded keeps it recorded.
struct Kinds {
    per_kind: [AtomicU32; KINDS_COUNTED],
    /// The sum of `per_kind`, at least (an enable adds to it before its count); signed, so that no interleaving can
    /// wrap it around.
    total: AtomicI64,
}

impl Kinds {
    const fn new() -> Kinds {
        Kinds {
            per_kind: [const { AtomicU32::new(0) }; KINDS_COUNTED],
            total: AtomicI64::new(0),
        }
    }

    fn counter(&self, kind: u32) -> &AtomicU32 {
        let i = usize::try_from(kind).map_or(KINDS_COUNTED - 1, |k| k.min(KINDS_COUNTED - 1));
        &self.per_kind[i]
    }

    fn recording(&self) -> bool {
        self.total.load(Ordering::Acquire) > 0
    }

    fn enabling(&self, kind: u32) {
        // The sum first: it never falls below the counts, so a race only ever leans towards recording.
        self.total.fetch_add(1, Ordering::AcqRel);
        self.counter(kind).fetch_add(1, Ordering::AcqRel);
    }

    fn enable_failed(&self, kind: u32) {
        if self
            .counter(kind)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            self.total.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn disabled(&self, kind: u32) {
        let shared = usize::try_from(kind).map_or(true, |k| k >= KINDS_COUNTED - 1);
        if shared {
            // The kinds counted together: this disable ends one enable, not the others'.
            self.enable_failed(kind);
            return;
        }
        let n = self.counter(kind).swap(0, Ordering::AcqRel);
        self.total.fetch_sub(i64::from(n), Ordering::AcqRel);
    }
}

static KINDS: Kinds = Kinds::new();

/// Whether a profiler records GPU activity now: some activity kind is enabled.
pub(crate) fn recording() -> bool {
    KINDS.recording()
}

/// `CUPTI_ERROR_NOT_INITIALIZED`: what the wrappers return when CUPTI's own function cannot be found.
const CUPTI_ERROR_NOT_INITIALIZED: c_int = 15;
/// `CUPTI_SUCCESS`.
const CUPTI_SUCCESS: c_int = 0;

static REAL_ENABLE: AtomicUsize = AtomicUsize::new(0);
static REAL_ENABLE_AND_DUMP: AtomicUsize = AtomicUsize::new(0);
static REAL_DISABLE: AtomicUsize = AtomicUsize::new(0);
static REAL_ENABLE_CONTEXT: AtomicUsize = AtomicUsize::new(0);
static REAL_DISABLE_CONTEXT: AtomicUsize = AtomicUsize::new(0);

type KindFn = unsafe extern "C" fn(u32) -> c_int;
type ContextKindFn = unsafe extern "C" fn(*mut c_void, u32) -> c_int;

/// CUPTI's own function `name`: the next definition after the preload, else the one in the loaded CUPTI itself
/// (loaded `RTLD_LOCAL` for a Python extension, so outside the global scope `RTLD_NEXT` searches); 0 if neither.
fn real(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = next(slot, name);
    if p != 0 {
        return p;
    }
    let p = apex_interpose::provider_symbol(PROVIDER, name);
    slot.store(p, Ordering::Relaxed);
    p
}

/// Marks `kind` as recorded, calls `call` (CUPTI's enable), and takes the mark back if CUPTI refused.
fn enable(kind: u32, call: impl FnOnce() -> c_int) -> c_int {
    KINDS.enabling(kind);
    let r = call();
    if r != CUPTI_SUCCESS {
        KINDS.enable_failed(kind);
    }
    r
}

/// Calls CUPTI's `name` (in `slot`) of one kind, as an enable.
fn enable_kind(slot: &AtomicUsize, name: &CStr, kind: u32) -> c_int {
    let p = real(slot, name);
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let f = unsafe { std::mem::transmute::<usize, KindFn>(p) };
    // SAFETY: forwarded unchanged.
    enable(kind, || unsafe { f(kind) })
}

/// # Safety
/// `cuptiActivityEnable`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityEnable(kind: u32) -> c_int {
    enable_kind(&REAL_ENABLE, c"cuptiActivityEnable", kind)
}

/// # Safety
/// `cuptiActivityEnableAndDump`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityEnableAndDump(kind: u32) -> c_int {
    enable_kind(&REAL_ENABLE_AND_DUMP, c"cuptiActivityEnableAndDump", kind)
}

/// # Safety
/// `cuptiActivityEnableContext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityEnableContext(context: *mut c_void, kind: u32) -> c_int {
    let p = real(&REAL_ENABLE_CONTEXT, c"cuptiActivityEnableContext");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let f = unsafe { std::mem::transmute::<usize, ContextKindFn>(p) };
    // Recorded for one context: the preload leaves every context's work to libcuda meanwhile (conservative).
    // SAFETY: forwarded unchanged.
    enable(kind, || unsafe { f(context, kind) })
}

/// # Safety
/// `cuptiActivityDisable`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityDisable(kind: u32) -> c_int {
    let p = real(&REAL_DISABLE, c"cuptiActivityDisable");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let f = unsafe { std::mem::transmute::<usize, KindFn>(p) };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(kind) };
    if r == CUPTI_SUCCESS {
        KINDS.disabled(kind);
    }
    r
}

/// # Safety
/// `cuptiActivityDisableContext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityDisableContext(context: *mut c_void, kind: u32) -> c_int {
    let p = real(&REAL_DISABLE_CONTEXT, c"cuptiActivityDisableContext");
    if p == 0 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: CUPTI's function of this name, this signature.
    let f = unsafe { std::mem::transmute::<usize, ContextKindFn>(p) };
    // One context's recording ends; whether others still record is not known here, so the kind stays marked until
    // a `cuptiActivityDisable` of it (libcuda keeps running the work meanwhile: seen, never lost).
    // SAFETY: forwarded unchanged.
    unsafe { f(context, kind) }
}

/// Each watched function: its name, the slot CUPTI's own goes into, and the wrapper.
fn watched() -> [(&'static CStr, &'static AtomicUsize, usize); 5] {
    [
        (
            c"cuptiActivityEnable",
            &REAL_ENABLE,
            cuptiActivityEnable as *const () as usize,
        ),
        (
            c"cuptiActivityEnableAndDump",
            &REAL_ENABLE_AND_DUMP,
            cuptiActivityEnableAndDump as *const () as usize,
        ),
        (
            c"cuptiActivityDisable",
            &REAL_DISABLE,
            cuptiActivityDisable as *const () as usize,
        ),
        (
            c"cuptiActivityEnableContext",
            &REAL_ENABLE_CONTEXT,
            cuptiActivityEnableContext as *const () as usize,
        ),
        (
            c"cuptiActivityDisableContext",
            &REAL_DISABLE_CONTEXT,
            cuptiActivityDisableContext as *const () as usize,
        ),
    ]
}

/// The wrapper `dlsym` hands out for CUPTI's function `name`, with the slot CUPTI's own goes into.
pub(crate) fn by_symbol(name: &[u8]) -> Option<(&'static AtomicUsize, usize)> {
    watched()
        .into_iter()
        .find(|(n, _, _)| n.to_bytes() == name)
        .map(|(_, slot, ours)| (slot, ours))
}

/// The loader's count of objects loaded when a redirect was last asked for.
static LOADS_SEEN: AtomicU64 = AtomicU64::new(0);

/// A redirect is asked for and not yet run.
static WANTED: AtomicBool = AtomicBool::new(false);

/// The thread that runs the redirects ([`redirect_importers`]), started at the first request.
static WORKER: OnceLock<Option<std::thread::Thread>> = OnceLock::new();

/// Asks for the GOT slots of every loaded library that imports CUPTI's activity switches to be pointed at the
/// wrappers. The redirect runs on a thread of the preload's own, which holds no lock of the program's: it takes the
/// loader's lock, which a thread inside `dlopen` holds while its constructors make CUDA calls (and take cudart's and
/// the engine's locks). A thread started from inside a `dlopen` constructor runs once that `dlopen` returns.
pub(crate) fn request_redirect() {
    LOADS_SEEN.store(apex_interpose::loads_so_far(), Ordering::Relaxed);
    WANTED.store(true, Ordering::Release);
    let worker = WORKER.get_or_init(|| {
        std::thread::Builder::new()
            .name("apex-cupti".into())
            .spawn(|| {
                loop {
                    if WANTED.swap(false, Ordering::AcqRel) {
                        let slots = redirect_importers();
                        tracing::debug!(
                            slots,
                            "CUPTI's activity switches watched in the libraries that import them"
                        );
                    }
                    std::thread::park();
                }
            })
            .map(|h| h.thread().clone())
            .inspect_err(|e| tracing::debug!(error = %e, "no thread for CUPTI's redirect"))
            .ok()
    });
    if let Some(t) = worker {
        t.unpark();
    }
}

/// [`request_redirect`] if the process has loaded libraries since the last request (one call into the loader when
/// it has not): a program may load a CUPTI client after its first CUDA call.
pub(crate) fn request_redirect_if_loaded() {
    let now = apex_interpose::loads_so_far();
    if now != 0 && now != LOADS_SEEN.load(Ordering::Relaxed) {
        request_redirect();
    }
}

/// Points the GOT slots of every loaded library that imports CUPTI's activity switches at the wrappers
/// ([`apex_interpose::redirect_imports`]); how many slots do. Runs on the redirect's own thread.
fn redirect_importers() -> usize {
    let redirects = watched().map(|(name, real, ours)| Redirect { name, ours, real });
    // SAFETY: each wrapper has its function's signature and calls what its slot holds.
    unsafe { apex_interpose::redirect_imports(&redirects, PROVIDER) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_follows_the_kinds_enabled() {
        let k = Kinds::new();
        assert!(!k.recording());
        // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, twice, and _MEMCPY.
        k.enabling(10);
        k.enabling(10);
        k.enabling(1);
        assert!(k.recording());
        k.disabled(10);
        assert!(k.recording(), "memcpy still recorded");
        k.disabled(1);
        assert!(!k.recording());
        // Kinds beyond the counters share one: a disable of one ends that one only.
        k.enabling(70);
        k.enabling(71);
        assert!(k.recording());
        k.disabled(70);
        assert!(k.recording(), "kind 71 still recorded");
        k.disabled(71);
        k.disabled(71);
        assert!(!k.recording(), "never below nothing");
        assert_eq!(k.total.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_failed_enable_takes_back_only_its_own_mark() {
        let k = Kinds::new();
        // Two threads enable the same kind; one of them is refused.
        k.enabling(10);
        k.enabling(10);
        k.enable_failed(10);
        assert!(k.recording(), "the other enable stands");
        k.enable_failed(10);
        assert!(!k.recording());
        k.enable_failed(10);
        assert!(!k.recording(), "nothing to take back");
        assert_eq!(k.total.load(Ordering::Acquire), 0);
    }

    #[test]
    fn the_wrappers_are_handed_out_by_name() {
        for (name, slot, ours) in watched() {
            let (s, o) = by_symbol(name.to_bytes()).expect("handed out");
            assert!(std::ptr::eq(s, slot) && o == ours, "{name:?}");
        }
        assert!(by_symbol(b"cuptiSubscribe").is_none());
    }
}
