//! Driver-API calls that order or wait for work: event records, stream waits, queries, synchronizations, stream
//! and event creation and destruction, host functions. Each is forwarded exactly once and recorded after it
//! returned, so a trace shows how a program or library (NCCL, PyTorch's process groups) chains its streams.
//!
//! Only entry points whose signature is the same in every version the driver hands out are wrapped, so a wrapper
//! never forwards to a function of another shape.

use std::cell::Cell;
use std::ffi::{CStr, c_int, c_uint, c_void};
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

use apex_interpose::{CUDA_ERROR_STUB_LIBRARY, install, next, quietly};

use crate::record::{DriverCallRecord, Record};
use crate::tracer;

type Handle = *mut c_void;

/// What a call names, read after it returned (a creation's handle is its out-parameter).
#[derive(Default)]
struct Named {
    stream: Option<u64>,
    event: Option<u64>,
    flags: Option<u64>,
}

thread_local! {
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

/// The calling thread's kernel id, asked once per thread.
fn thread_id() -> u64 {
    THREAD.with(|t| {
        if t.get() == 0 {
            // SAFETY: gettid takes no arguments and cannot fail.
            t.set(unsafe { libc::syscall(libc::SYS_gettid) } as u64);
        }
        t.get()
    })
}

/// Forwards `call` to the real function in `slot` (looked up as `symbol` if empty), then records it.
fn traced(
    slot: &AtomicUsize,
    symbol: &CStr,
    api: &'static str,
    call: impl FnOnce(usize) -> c_int,
    named: impl FnOnce(c_int) -> Named,
) -> c_int {
    let p = next(slot, symbol);
    if p == 0 {
        return CUDA_ERROR_STUB_LIBRARY;
    }
    let t0 = Instant::now();
    let r = call(p);
    if let Some(_g) = crate::hooks::enter() {
        let dur = t0.elapsed().as_nanos() as u64;
        quietly(|| {
            let n = named(r);
            let t = tracer::get();
            t.emit(Record::DriverCall(DriverCallRecord {
                t_ns: t.now_ns().saturating_sub(dur),
                dur_ns: dur,
                api: api.to_string(),
                thread: thread_id(),
                stream: n.stream,
                event: n.event,
                flags: n.flags,
                result: r,
            }));
        });
    }
    r
}

/// A created handle: the out-parameter's value after a successful call.
///
/// # Safety
/// `out` is null or the caller's live out-parameter.
unsafe fn created(r: c_int, out: *mut Handle) -> Option<u64> {
    // SAFETY: per the contract; the driver wrote it when it returned success.
    (r == 0 && !out.is_null()).then(|| unsafe { *out } as u64)
}

/// Declares a wrapper exported under the driver's symbol, with its slot for the real function.
macro_rules! call_hook {
    ($sym:ident, $slot:ident, $cname:literal, ($($a:ident: $t:ty),*), |$r:ident| $named:expr) => {
        static $slot: AtomicUsize = AtomicUsize::new(0);

        /// # Safety
        /// The CUDA driver function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $sym($($a: $t),*) -> c_int {
            traced(
                &$slot,
                $cname,
                stringify!($sym),
                |p| {
                    // SAFETY: the driver's function of this name has this signature.
                    let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> c_int>(p) };
                    // SAFETY: forwarded unchanged.
                    unsafe { f($($a),*) }
                },
                #[allow(unused_variables)]
                |$r| $named,
            )
        }
    };
}

fn on(stream: Handle, event: Handle, flags: Option<c_uint>) -> Named {
    Named {
        stream: Some(stream as u64),
        event: (!event.is_null()).then_some(event as u64),
        flags: flags.map(u64::from),
    }
}

fn event_only(event: Handle) -> Named {
    Named {
        event: Some(event as u64),
        ..Named::default()
    }
}

call_hook!(cuEventRecord, EVENT_RECORD, c"cuEventRecord", (e: Handle, s: Handle), |r| on(s, e, None));
call_hook!(cuEventRecord_ptsz, EVENT_RECORD_PT, c"cuEventRecord_ptsz", (e: Handle, s: Handle), |r| on(s, e, None));
call_hook!(cuEventRecordWithFlags, EVENT_RECORD_FLAGS, c"cuEventRecordWithFlags",
    (e: Handle, s: Handle, f: c_uint), |r| on(s, e, Some(f)));
call_hook!(cuEventRecordWithFlags_ptsz, EVENT_RECORD_FLAGS_PT, c"cuEventRecordWithFlags_ptsz",
    (e: Handle, s: Handle, f: c_uint), |r| on(s, e, Some(f)));
call_hook!(cuStreamWaitEvent, STREAM_WAIT, c"cuStreamWaitEvent", (s: Handle, e: Handle, f: c_uint),
    |r| on(s, e, Some(f)));
call_hook!(cuStreamWaitEvent_ptsz, STREAM_WAIT_PT, c"cuStreamWaitEvent_ptsz", (s: Handle, e: Handle, f: c_uint),
    |r| on(s, e, Some(f)));
call_hook!(cuEventQuery, EVENT_QUERY, c"cuEventQuery", (e: Handle), |r| event_only(e));
call_hook!(cuEventSynchronize, EVENT_SYNC, c"cuEventSynchronize", (e: Handle), |r| event_only(e));
call_hook!(cuEventDestroy_v2, EVENT_DESTROY, c"cuEventDestroy_v2", (e: Handle), |r| event_only(e));
call_hook!(cuStreamQuery, STREAM_QUERY, c"cuStreamQuery", (s: Handle), |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuStreamQuery_ptsz, STREAM_QUERY_PT, c"cuStreamQuery_ptsz", (s: Handle),
    |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuStreamSynchronize, STREAM_SYNC, c"cuStreamSynchronize", (s: Handle),
    |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuStreamSynchronize_ptsz, STREAM_SYNC_PT, c"cuStreamSynchronize_ptsz", (s: Handle),
    |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuStreamDestroy_v2, STREAM_DESTROY, c"cuStreamDestroy_v2", (s: Handle),
    |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuCtxSynchronize, CTX_SYNC, c"cuCtxSynchronize", (), |r| {
    Named::default()
});
call_hook!(cuEventCreate, EVENT_CREATE, c"cuEventCreate", (out: *mut Handle, f: c_uint), |r| Named {
    // SAFETY: the caller's out-parameter.
    event: unsafe { created(r, out) },
    flags: Some(f.into()),
    ..Named::default()
});
call_hook!(cuStreamCreate, STREAM_CREATE, c"cuStreamCreate", (out: *mut Handle, f: c_uint), |r| Named {
    // SAFETY: the caller's out-parameter.
    stream: unsafe { created(r, out) },
    flags: Some(f.into()),
    ..Named::default()
});
call_hook!(cuStreamCreateWithPriority, STREAM_CREATE_PRIORITY, c"cuStreamCreateWithPriority",
    (out: *mut Handle, f: c_uint, priority: c_int), |r| Named {
    // SAFETY: the caller's out-parameter.
    stream: unsafe { created(r, out) },
    flags: Some(f.into()),
    ..Named::default()
});
call_hook!(cuLaunchHostFunc, HOST_FUNC, c"cuLaunchHostFunc", (s: Handle, f: Handle, data: Handle),
    |r| on(s, std::ptr::null_mut(), None));
call_hook!(cuLaunchHostFunc_ptsz, HOST_FUNC_PT, c"cuLaunchHostFunc_ptsz", (s: Handle, f: Handle, data: Handle),
    |r| on(s, std::ptr::null_mut(), None));

/// Our wrapper for the driver entry point `name` (a symbol, or a `cuGetProcAddress` base name with the per-thread
/// flag), after storing the real function `real`; `None` for functions not traced here.
pub(crate) fn wrap(name: &[u8], real: usize, per_thread: bool) -> Option<usize> {
    let (slot, ours): (&AtomicUsize, usize) = match (name, per_thread) {
        (b"cuEventRecord", false) => (&EVENT_RECORD, cuEventRecord as *const () as usize),
        (b"cuEventRecord", true) | (b"cuEventRecord_ptsz", _) => {
            (&EVENT_RECORD_PT, cuEventRecord_ptsz as *const () as usize)
        }
        (b"cuEventRecordWithFlags", false) => (
            &EVENT_RECORD_FLAGS,
            cuEventRecordWithFlags as *const () as usize,
        ),
        (b"cuEventRecordWithFlags", true) | (b"cuEventRecordWithFlags_ptsz", _) => (
            &EVENT_RECORD_FLAGS_PT,
            cuEventRecordWithFlags_ptsz as *const () as usize,
        ),
        (b"cuStreamWaitEvent", false) => (&STREAM_WAIT, cuStreamWaitEvent as *const () as usize),
        (b"cuStreamWaitEvent", true) | (b"cuStreamWaitEvent_ptsz", _) => (
            &STREAM_WAIT_PT,
            cuStreamWaitEvent_ptsz as *const () as usize,
        ),
        (b"cuEventQuery", _) => (&EVENT_QUERY, cuEventQuery as *const () as usize),
        (b"cuEventSynchronize", _) => (&EVENT_SYNC, cuEventSynchronize as *const () as usize),
        (b"cuEventDestroy" | b"cuEventDestroy_v2", _) => {
            (&EVENT_DESTROY, cuEventDestroy_v2 as *const () as usize)
        }
        (b"cuStreamQuery", false) => (&STREAM_QUERY, cuStreamQuery as *const () as usize),
        (b"cuStreamQuery", true) | (b"cuStreamQuery_ptsz", _) => {
            (&STREAM_QUERY_PT, cuStreamQuery_ptsz as *const () as usize)
        }
        (b"cuStreamSynchronize", false) => {
            (&STREAM_SYNC, cuStreamSynchronize as *const () as usize)
        }
        (b"cuStreamSynchronize", true) | (b"cuStreamSynchronize_ptsz", _) => (
            &STREAM_SYNC_PT,
            cuStreamSynchronize_ptsz as *const () as usize,
        ),
        (b"cuStreamDestroy" | b"cuStreamDestroy_v2", _) => {
            (&STREAM_DESTROY, cuStreamDestroy_v2 as *const () as usize)
        }
        (b"cuCtxSynchronize", _) => (&CTX_SYNC, cuCtxSynchronize as *const () as usize),
        (b"cuEventCreate", _) => (&EVENT_CREATE, cuEventCreate as *const () as usize),
        (b"cuStreamCreate", _) => (&STREAM_CREATE, cuStreamCreate as *const () as usize),
        (b"cuStreamCreateWithPriority", _) => (
            &STREAM_CREATE_PRIORITY,
            cuStreamCreateWithPriority as *const () as usize,
        ),
        (b"cuLaunchHostFunc", false) => (&HOST_FUNC, cuLaunchHostFunc as *const () as usize),
        (b"cuLaunchHostFunc", true) | (b"cuLaunchHostFunc_ptsz", _) => {
            (&HOST_FUNC_PT, cuLaunchHostFunc_ptsz as *const () as usize)
        }
        _ => return None,
    };
    install(slot, real, ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_lookups_get_the_per_thread_wrapper() {
        let a = wrap(b"cuEventRecord", 1, true).unwrap();
        assert_eq!(a, cuEventRecord_ptsz as *const () as usize);
        let b = wrap(b"cuEventRecord", 2, false).unwrap();
        assert_eq!(b, cuEventRecord as *const () as usize);
        // Functions without a per-thread variant answer the same either way.
        assert_eq!(
            wrap(b"cuEventQuery", 3, true),
            Some(cuEventQuery as *const () as usize)
        );
        assert_eq!(
            wrap(b"cuStreamDestroy", 4, false),
            wrap(b"cuStreamDestroy_v2", 4, false)
        );
        assert!(wrap(b"cuMemAlloc_v2", 5, false).is_none());
    }

    #[test]
    fn a_wrapper_is_never_its_own_real_function() {
        let ours = cuStreamWaitEvent as *const () as usize;
        assert_eq!(wrap(b"cuStreamWaitEvent", ours, false), None);
    }
}
