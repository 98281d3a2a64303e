//! A diagnostic for hangs inside the preload (`APEX_PRELOAD_WATCHDOG=SECONDS`): when one call into the engine
//! lasts longer than that, every thread of the process prints its stack (glibc's `backtrace_symbols_fd`, the
//! nearest exported symbol of each frame) to stderr, and the process exits with status 99.
//!
//! For diagnosis only: it takes `SIGUSR2` over from the program, and a legitimately long call (draining the queues at
//! exit, compiling PTX for a module) trips it as well, so `SECONDS` must exceed the longest such call.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static START: OnceLock<Instant> = OnceLock::new();
/// Nanoseconds after START (plus one) at which the current engine call began; 0 outside one.
static BUSY_SINCE: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" {
    fn backtrace(buffer: *mut *mut libc::c_void, size: libc::c_int) -> libc::c_int;
    fn backtrace_symbols_fd(buffer: *const *mut libc::c_void, size: libc::c_int, fd: libc::c_int);
}

fn now() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// Whether the watchdog runs (`APEX_PRELOAD_WATCHDOG`): only then do engine calls read the clock.
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks an engine call's start; the returned token ends it. Free when the watchdog is off (the launch path takes
/// it once per launch).
pub(crate) fn busy() -> Option<Busy> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    let _ = BUSY_SINCE.compare_exchange(0, now(), Ordering::Relaxed, Ordering::Relaxed);
    Some(Busy)
}

/// An engine call in progress (see [`busy`]).
pub(crate) struct Busy;

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY_SINCE.store(0, Ordering::Relaxed);
    }
}

/// The signal handler: this thread's stack to stderr. No allocation (the thread may hold the allocator's lock);
/// glibc's unwinder was loaded before any signal was sent.
extern "C" fn dump(_: libc::c_int) {
    let mut frames = [std::ptr::null_mut::<libc::c_void>(); 64];
    let head = b"== apex-preload watchdog: the stack of the thread above\n";
    // SAFETY: a local buffer of 64 frames; glibc's backtrace and backtrace_symbols_fd write to it and to fd 2.
    unsafe {
        libc::write(2, head.as_ptr().cast(), head.len());
        let n = backtrace(frames.as_mut_ptr(), 64);
        backtrace_symbols_fd(frames.as_ptr(), n, 2);
    }
}

/// Starts the watchdog when `APEX_PRELOAD_WATCHDOG` names a number of seconds.
pub(crate) fn start() {
    let Some(secs) = std::env::var("APEX_PRELOAD_WATCHDOG")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    else {
        return;
    };
    now();
    ENABLED.store(true, Ordering::Relaxed);
    // SAFETY: installs a plain handler for SIGUSR2; loads libgcc's unwinder now, outside any signal handler.
    unsafe {
        libc::signal(libc::SIGUSR2, dump as extern "C" fn(libc::c_int) as usize);
        let mut f = [std::ptr::null_mut::<libc::c_void>(); 4];
        backtrace(f.as_mut_ptr(), 4);
    }
    let _ = std::thread::Builder::new()
        .name("apex-watchdog".into())
        .spawn(move || {
            apex_interpose::enter_forever();
            loop {
                std::thread::sleep(Duration::from_millis(500));
                let since = BUSY_SINCE.load(Ordering::Relaxed);
                if since == 0 || now() - since < secs * 1_000_000_000 {
                    continue;
                }
                // SAFETY: gettid has no arguments.
                let me = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
                let pid = std::process::id() as i32;
                if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
                    for t in tasks.flatten() {
                        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok())
                        else {
                            continue;
                        };
                        if tid == me {
                            continue;
                        }
                        let wchan = std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan"))
                            .unwrap_or_default();
                        let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                            .unwrap_or_default();
                        let sys = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
                            .unwrap_or_default();
                        eprintln!(
                            "== apex-preload watchdog: tid {tid} comm {} wchan {wchan} syscall {}",
                            comm.trim(),
                            sys.trim()
                        );
                        // SAFETY: signals a thread of this process; the handler only prints.
                        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGUSR2) };
                        std::thread::sleep(Duration::from_millis(300));
                    }
                }
                // SAFETY: ends the hung process.
                unsafe { libc::_exit(99) };
            }
        });
}
