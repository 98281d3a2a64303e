//! How the CPU's stores reach the GPU: which placements are written write-combined, the ordering of stores before
//! the doorbell (a store fence where anything the GPU fetches is write-combined), and write prefetch.

use crate::rm::Placement;

/// Whether the CPU writes memory of `placement` through a write-combined mapping.
pub(super) fn is_write_combined(placement: Placement) -> bool {
    matches!(placement, Placement::Video | Placement::SystemWriteCombined)
}

/// Asks the CPU for the cache line at `p` with write ownership ahead of a store to it (`PREFETCHW`): a line the GPU
/// has read since the CPU last wrote it is shared, and the store would otherwise wait for the ownership request.
/// A hint: it never faults, it does nothing on CPUs that do not report the instruction, and off x86-64.
#[inline(always)]
pub fn prefetch_for_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    if write_prefetch_supported() {
        // SAFETY: the CPU reports PREFETCHW (CPUID.80000001H:ECX.PRFCHW), which only hints the cache: it does not
        // access memory architecturally, raises no page or protection fault for any address, and is ignored for
        // memory that is not write-back cacheable.
        unsafe {
            std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Whether the CPU reports `PREFETCHW` (CPUID.80000001H:ECX bit 8), read once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn write_prefetch_supported() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0: not read yet, 1: supported, 2: not supported.
    static SUPPORTED: AtomicU8 = AtomicU8::new(0);
    match SUPPORTED.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // Leaf 0x80000000 gives the highest extended leaf; 0x80000001 is asked only when the CPU has it.
            // SAFETY: CPUID exists on every x86-64 CPU. (`__cpuid` is a safe function on newer toolchains and an
            // unsafe one on the minimum supported Rust version, hence the allowance.)
            #[allow(unused_unsafe)]
            let max = unsafe { std::arch::x86_64::__cpuid(0x8000_0000) }.eax;
            // SAFETY: as above.
            #[allow(unused_unsafe)]
            let ecx = if max >= 0x8000_0001 {
                unsafe { std::arch::x86_64::__cpuid(0x8000_0001) }.ecx
            } else {
                0
            };
            let yes = ecx & (1 << 8) != 0;
            SUPPORTED.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
            yes
        }
    }
}

/// Orders cached stores before the doorbell store: on x86 the CPU keeps stores in program order (write-combined and
/// non-temporal stores excepted), so only the compiler must; elsewhere a full fence.
#[inline(always)]
pub(super) fn cached_store_order() {
    #[cfg(target_arch = "x86_64")]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Orders the write-combined ring and USERD stores before the doorbell store.
#[inline(always)]
pub(super) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}
