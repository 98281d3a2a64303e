//! What every `LD_PRELOAD` library of APEX needs (apex-trace, apex-preload): the next definition of a C symbol
//! after the preloaded library ([`next`], [`real!`]), a per-thread guard that lets a hook's own calls pass straight
//! through ([`enter`]), panics kept out of C ([`quietly`]), and the two ways CUDA programs find driver entry
//! points — `dlsym` on libcuda ([`forward_dlsym`]) and `cuGetProcAddress` ([`replace_proc_address`]) — turned into
//! one question for the library: "do you wrap this symbol?".
//!
//! Each preloaded library links its own copy of this crate, so its guard and caches are its own.

mod imports;

pub use imports::{Redirect, loads_so_far, provider_symbol, redirect_imports};

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `CUDA_ERROR_STUB_LIBRARY`: what a hook returns when the real driver function cannot be found.
pub const CUDA_ERROR_STUB_LIBRARY: c_int = 34;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`: the caller asks for the per-thread-stream variant.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a hook until dropped.
#[derive(Debug)]
pub struct Guard(());

impl Drop for Guard {
    fn drop(&mut self) {
        // `try_with`: during thread teardown the slot may be gone.
        let _ = IN_HOOK.try_with(|g| g.set(false));
    }
}

/// `Some` when this thread is not already inside a hook: the hook may do its own work (its nested calls then pass
/// straight through). `None` for a nested call, or during thread teardown.
pub fn enter() -> Option<Guard> {
    // `then`, not `then_some`: an eagerly built guard would be dropped on the nested path and clear the outer
    // hook's flag, letting the next nested call in (it deadlocked apex-preload on its own engine lock).
    IN_HOOK
        .try_with(|g| (!g.replace(true)).then(|| Guard(())))
        .ok()
        .flatten()
}

/// Marks this thread as inside a hook for good (a library's own background thread).
pub fn enter_forever() {
    IN_HOOK.with(|g| g.set(true));
}

/// Runs hook code, swallowing panics (a bug in a preloaded library must not unwind into C). `None` if it panicked.
pub fn quietly<T>(f: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

/// This thread's `errno`.
pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Sets this thread's `errno`.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// glibc's `dlsym`, the signature every interposer of it forwards to.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym` (a library that exports its own `dlsym` must never call `libc::dlsym`).
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Relaxed);
    if p == 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym with NUL-terminated names; it is not interposed.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) }
                as usize;
            if p != 0 {
                break;
            }
        }
        REAL_DLSYM.store(p, Ordering::Relaxed);
    }
    // SAFETY: a non-null result of dlvsym("dlsym") is glibc's dlsym, which has this signature.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// The next definition of `name` after this library, cached in `slot` (0 if there is none). A slot already
/// filled (by [`forward_dlsym`] or [`replace_proc_address`] storing the driver's pointer) is returned as is.
pub fn next(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let Some(dlsym) = real_dlsym() else { return 0 };
    // SAFETY: glibc's dlsym with RTLD_NEXT and a NUL-terminated name.
    let p = unsafe { dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    slot.store(p, Ordering::Relaxed);
    p
}

/// Declares `fn $getter() -> Option<$ty>`: the next definition of the C symbol `$name`, cached.
#[macro_export]
macro_rules! real {
    ($getter:ident, $name:literal, $ty:ty) => {
        fn $getter() -> Option<$ty> {
            static SLOT: ::std::sync::atomic::AtomicUsize =
                ::std::sync::atomic::AtomicUsize::new(0);
            let p = $crate::next(&SLOT, $name);
            // SAFETY: the symbol the C library exports under this name has this signature.
            (p != 0).then(|| unsafe { ::std::mem::transmute::<usize, $ty>(p) })
        }
    };
}

/// A symbol of the already loaded libcuda (`dlopen` with `RTLD_NOLOAD`: never loads it), looked up with the real
/// `dlsym`, so the driver's own function and never a wrapper.
pub fn libcuda_symbol(name: &CStr) -> Option<usize> {
    let dlsym = real_dlsym()?;
    // SAFETY: dlopen with RTLD_NOLOAD only finds an already loaded libcuda.
    let lib = unsafe {
        libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_NOLOAD | libc::RTLD_LAZY,
        )
    };
    if lib.is_null() {
        return None;
    }
    // SAFETY: glibc's dlsym on a live handle.
    let p = unsafe { dlsym(lib, name.as_ptr()) } as usize;
    // SAFETY: balances the dlopen above; libcuda stays loaded (the program holds it).
    unsafe { libc::dlclose(lib) };
    (p != 0).then_some(p)
}

/// The body of an interposed `dlsym`: glibc's answer, replaced by `wrap(name, real)` when the library wraps that
/// symbol (`wrap` stores `real` for its wrapper and returns the wrapper's address).
///
/// # Safety
/// As C `dlsym`: `handle` is a handle `dlsym` accepts, `name` null or a NUL-terminated string.
pub unsafe fn forward_dlsym(
    handle: *mut c_void,
    name: *const c_char,
    wrap: impl FnOnce(&[u8], usize) -> Option<usize>,
) -> *mut c_void {
    let Some(real) = real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { real(handle, name) };
    if r.is_null() || name.is_null() {
        return r;
    }
    // SAFETY: dlsym names are NUL-terminated.
    let n = unsafe { CStr::from_ptr(name) }.to_bytes();
    quietly(|| wrap(n, r as usize))
        .flatten()
        .map_or(r, |ours| ours as *mut c_void)
}

/// After a successful `cuGetProcAddress(symbol, pfn, version, flags)`: replaces `*pfn` by
/// `wrap(name, real, per_thread, version)` when the library wraps it. `name` is the symbol as asked
/// (`cuLaunchKernel`, never a `_v2`/`_ptsz` suffix), except that `cuGetProcAddress` itself from CUDA 12 on is
/// `cuGetProcAddress_v2` (its signature changed); `per_thread` says the caller asked for the per-thread default
/// stream variant.
///
/// # Safety
/// The driver returned success for these arguments: `pfn` is null or holds the function it found, `symbol` is null
/// or a NUL-terminated string.
pub unsafe fn replace_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    wrap: impl FnOnce(&[u8], usize, bool, c_int) -> Option<usize>,
) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: per the contract.
    let (n, real) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn as usize) };
    if real == 0 {
        return;
    }
    let n = if n == b"cuGetProcAddress" && version >= 12000 {
        &b"cuGetProcAddress_v2"[..]
    } else {
        n
    };
    if let Some(ours) =
        quietly(|| wrap(n, real, flags & PER_THREAD_DEFAULT_STREAM != 0, version)).flatten()
    {
        // SAFETY: `pfn` is the caller's out-parameter.
        unsafe { *pfn = ours as *mut c_void };
    }
}

/// `cuLaunchKernel` (and `cuLaunchKernel_ptsz`): function, grid x y z, block x y z, shared bytes, stream,
/// `kernelParams`, `extra`.
pub type LaunchKernelFn = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

/// `cuGetProcAddress_v2` (CUDA 12+).
pub type GpaV2Fn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
/// `cuGetProcAddress` (CUDA 11 signature).
pub type GpaFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int;

/// Stores `real` in `slot` for a wrapper at `ours` and returns `ours`, unless `real` already is the wrapper (a
/// library asking twice) — then `None`, so the wrapper never calls itself.
pub fn install(slot: &AtomicUsize, real: usize, ours: usize) -> Option<usize> {
    if real == ours {
        return None;
    }
    slot.store(real, Ordering::Relaxed);
    Some(ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_lets_only_the_outer_call_in() {
        let outer = enter().expect("first entry");
        assert!(enter().is_none(), "a nested call passes straight through");
        assert!(
            enter().is_none(),
            "a second nested call passes straight through too (the first must not clear the outer guard)"
        );
        let nested = enter();
        drop(nested);
        assert!(
            enter().is_none(),
            "a nested call's end keeps the outer guard"
        );
        drop(outer);
        assert!(enter().is_some(), "the guard is released on drop");
    }

    #[test]
    fn next_finds_libc_functions_and_caches_them() {
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        let p = next(&SLOT, c"getpid");
        assert_ne!(p, 0);
        assert_eq!(SLOT.load(Ordering::Relaxed), p);
        static NONE: AtomicUsize = AtomicUsize::new(0);
        assert_eq!(next(&NONE, c"apex_no_such_symbol_anywhere"), 0);
    }

    #[test]
    fn install_refuses_to_wrap_itself() {
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        assert_eq!(install(&SLOT, 0x1000, 0x2000), Some(0x2000));
        assert_eq!(SLOT.load(Ordering::Relaxed), 0x1000);
        assert_eq!(install(&SLOT, 0x2000, 0x2000), None);
        assert_eq!(SLOT.load(Ordering::Relaxed), 0x1000);
    }

    #[test]
    fn proc_address_names_and_flags_reach_the_wrapper() {
        let mut f: *mut c_void = 0x1234 as *mut c_void;
        let mut seen = None;
        // SAFETY: a NUL-terminated name and a live out-parameter.
        unsafe {
            replace_proc_address(
                c"cuGetProcAddress".as_ptr(),
                &mut f,
                12000,
                2,
                |n, r, pt, v| {
                    seen = Some((n.to_vec(), r, pt, v));
                    Some(0x5678)
                },
            )
        };
        assert_eq!(f as usize, 0x5678);
        assert_eq!(
            seen,
            Some((b"cuGetProcAddress_v2".to_vec(), 0x1234, true, 12000))
        );
        let mut g: *mut c_void = 0x1234 as *mut c_void;
        // SAFETY: as above.
        unsafe { replace_proc_address(c"cuMemFree".as_ptr(), &mut g, 12000, 0, |_, _, _, _| None) };
        assert_eq!(g as usize, 0x1234, "unwrapped symbols are left alone");
    }

    #[test]
    fn quietly_swallows_panics() {
        assert_eq!(quietly(|| 7), Some(7));
        assert_eq!(quietly(|| -> i32 { panic!("contained") }), None);
    }
}
