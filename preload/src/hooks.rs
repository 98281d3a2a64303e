//! The interposed C symbols. Each forwards to libcuda's function exactly once; around it, under the per-thread
//! guard of `apex_interpose` (so APEX's own calls into libcuda pass straight through), the engine orders the call
//! with APEX's queues, records what was loaded, or takes the launch over.
//!
//! Programs reach the driver three ways, all covered: by linking libcuda (these exported symbols win over libcuda's),
//! through `dlsym` on libcuda, and through `cuGetProcAddress` (how the CUDA runtime finds every driver function),
//! whose answers are replaced by these wrappers where one exists ([`HOOKS`]). With `APEX_PRELOAD=off` only launches
//! (counted), module loads and unloads and `cuGetProcAddress` are replaced: every other call reaches libcuda's own
//! function directly, and a wrapper called anyway (a program linked to the exported symbol) forwards at once.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;

use apex_interpose::{CUDA_ERROR_STUB_LIBRARY, GpaFn, GpaV2Fn, enter, install, next, quietly};

use crate::attrs::{self, LaunchConfig};
use crate::engine::{self, Answer, CopyDir, CopyOp, Launch, SetOp, Site, SyncKind};

/// How a wrapped call is ordered with APEX's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Adds work at its site: related queues are handed to CUDA before, and wait for it before their next launch.
    Work,
    /// As `Work`, and the call returns only once the stream's work is complete (a synchronous copy to the host): the
    /// stream's queue needs no hop for it afterwards.
    WorkDone,
    /// `cuStreamWaitEvent`: as `Work`, after an event the preload kept is recorded in libcuda.
    WaitEvent,
    /// A graph launch or upload: as `Work`, after every event the preload kept is recorded in libcuda.
    Graph,
    /// `cuStreamSynchronize`: answered from APEX's fences where the stream holds only APEX's work.
    StreamSync,
    /// `cuStreamQuery`: likewise, without waiting.
    StreamQuery,
    /// `cuEventRecord`: kept by the preload after an APEX queue's work, or handed to libcuda after a hand-over.
    EventRecord,
    /// `cuCtxSynchronize`: APEX's queues waited for on the CPU; libcuda only if CUDA had work.
    CtxSync,
    /// `cuCtxSynchronize_v2(ctx)`: as `Device` (the context named may not be the current one); when it names the
    /// current context (or none), its success completes that context's work as `CtxSync`'s does.
    CtxSyncOf,
    /// A copy between the host and the device, run on the stream's APEX queue where it can be (else `Work`):
    /// `cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`, `cuMemcpyAsync`, and their synchronous forms.
    CopyDtoHAsync,
    CopyHtoDAsync,
    CopyAnyAsync,
    CopyDtoH,
    CopyHtoD,
    CopyAny,
    /// `cuMemcpyDtoDAsync` / `cuMemcpyDtoD` (no host-side synchronization in either form, as in CUDA).
    CopyDtoD,
    /// `cuMemsetD8/16/32(Async)`: run on the stream's APEX queue where it can be (else `Work`).
    Set8,
    Set16,
    Set32,
    /// Frees or unloads what work may use: every queue's work is waited for on the CPU first.
    Device,
    /// Destroys the context APEX attached to: APEX's objects go first.
    Teardown,
}

impl Kind {
    /// Whether the preload has anything to do for this kind of call only once APEX holds something (an attached
    /// context): ordering with queues, events kept on APEX, answers from fences, copies and sets run on queues.
    /// `Device` and `Teardown` also keep the preload's books (frees, the end of a context): always handled.
    fn needs_apex_only(self) -> bool {
        !matches!(self, Kind::Device | Kind::CtxSyncOf | Kind::Teardown)
    }

    /// Whether the call, answered with success, says its site's work so far is complete (the allocation cache's
    /// unmarked frees there are then complete).
    fn completes(self) -> bool {
        matches!(
            self,
            Kind::StreamSync | Kind::StreamQuery | Kind::CtxSync | Kind::CtxSyncOf
        )
    }

    /// Whether the call, on a stream no queue relates to, goes to libcuda without the engine (as the engine would
    /// only forward it: [`engine::plain_begin`]). Not synchronizations and queries (a failed assert of APEX's is
    /// reported there), not copies to the host (they report one too), not graphs (kept events are recorded first).
    fn forwards_alone(self) -> bool {
        matches!(
            self,
            Kind::Work
                | Kind::WaitEvent
                | Kind::EventRecord
                | Kind::CopyHtoDAsync
                | Kind::CopyAnyAsync
                | Kind::CopyDtoD
                | Kind::Set8
                | Kind::Set16
                | Kind::Set32
        )
    }

    /// Whether the call puts work on its stream (a queue that takes the stream over must wait for it).
    fn adds_work(self) -> bool {
        !matches!(
            self,
            Kind::StreamSync
                | Kind::StreamQuery
                | Kind::EventRecord
                | Kind::CtxSync
                | Kind::Device
                | Kind::CtxSyncOf
                | Kind::Teardown
        )
    }
}

/// A wrapped call's name and pointers, for the rows that need them.
#[derive(Clone, Copy, Debug, Default)]
struct Args {
    /// The driver function's name (the stats count CUDA work by it).
    name: &'static str,
    event: usize,
    /// `cuStreamWaitEvent`'s flags.
    flags: u32,
    /// The context `cuCtxSynchronize_v2` names (0: the current one).
    context: usize,
    /// A copy's destination, source and size.
    copy: (u64, u64, usize),
    /// A memset's destination, value and element count.
    set: (u64, u32, usize),
}

fn around(kind: Kind, site: Site, a: Args, call: impl FnOnce() -> c_int) -> c_int {
    // With the takeover off no queue exists: nothing to order (one load; most callers got libcuda's own function).
    if engine::disabled() {
        return call();
    }
    // Nothing of APEX's exists yet to order this with, keep an event on or answer from (one load).
    if kind.needs_apex_only() && !engine::engaged() {
        let r = call();
        // Another thread may have attached and taken the stream over while this call ran: its queue must then
        // wait for this work before its next launch, as if the call had been ordered.
        if kind.adds_work() {
            engine::after_unordered(site);
        }
        return r;
    }
    let Some(_g) = enter() else { return call() };
    // A failed assert that could not be replayed through libcuda: every call answers it, as a failed context does.
    if let Some(e) = engine::sticky() {
        return e;
    }
    // Work, a wait, an event record, a copy or memset that does not return to the host, on a stream no queue relates
    // to and naming no event the preload kept: libcuda's alone, forwarded without the engine's lock (counted as the
    // context's CUDA work).
    if kind.forwards_alone() {
        let event = matches!(kind, Kind::WaitEvent | Kind::EventRecord).then_some(a.event);
        if let Some(t) = engine::plain_begin(site, event) {
            let r = call();
            // Counted by name as the engine counts the work it orders (event records are not).
            engine::plain_end(t, site, (kind != Kind::EventRecord).then_some(a.name));
            return r;
        }
    }
    let event = a.event;
    let copy = |dir: CopyDir, blocking: bool| {
        let (dst, src, bytes) = a.copy;
        CopyOp {
            dst,
            src,
            bytes,
            site,
            dir,
            blocking,
        }
    };
    let copy_op = match kind {
        Kind::CopyDtoHAsync => Some(copy(CopyDir::DeviceToHost, false)),
        Kind::CopyHtoDAsync => Some(copy(CopyDir::HostToDevice, false)),
        Kind::CopyAnyAsync => Some(copy(CopyDir::Any, false)),
        Kind::CopyDtoH => Some(copy(CopyDir::DeviceToHost, true)),
        Kind::CopyHtoD => Some(copy(CopyDir::HostToDevice, true)),
        Kind::CopyAny => Some(copy(CopyDir::Any, true)),
        Kind::CopyDtoD => Some(copy(CopyDir::DeviceToDevice, false)),
        _ => None,
    };
    let width = match kind {
        Kind::Set8 => 1,
        Kind::Set16 => 2,
        Kind::Set32 => 4,
        _ => 0,
    };
    if width != 0 {
        let (dst, value, count) = a.set;
        let op = SetOp {
            dst,
            value,
            width,
            count,
            site,
        };
        if let Some(code) = engine::fill(&op) {
            return code;
        }
        let o = engine::before_work(site, a.name);
        let r = call();
        engine::after(site, o, false);
        return r;
    }
    if let Some(op) = copy_op {
        if let Some(code) = engine::copy(&op) {
            return code;
        }
        // A copy that returns once done (to the host, or a synchronous form) reports a failed assert of APEX's
        // first, as libcuda's would (the replay fails libcuda's context, and the call returns its error).
        if (op.blocking || op.dir == CopyDir::DeviceToHost)
            && let Some(code) = engine::pending_assert()
        {
            return code;
        }
        let o = engine::before_work(site, a.name);
        let r = call();
        // A synchronous copy to the host returns once the stream's work is done.
        let done = op.blocking && op.dir == CopyDir::DeviceToHost && r == 0;
        engine::after(site, o, done);
        if op.blocking || op.dir == CopyDir::DeviceToHost {
            return after_waiting(r);
        }
        return r;
    }
    match kind {
        Kind::Work | Kind::WorkDone | Kind::WaitEvent | Kind::Graph => {
            if kind == Kind::Graph {
                engine::materialize_events();
            }
            if kind == Kind::WorkDone
                && let Some(code) = engine::pending_assert()
            {
                return code;
            }
            let o = if kind == Kind::WaitEvent {
                // One lock for the event and the ordering (or the wait itself, on APEX).
                // Flags other than CU_EVENT_WAIT_DEFAULT and _EXTERNAL are libcuda's to refuse.
                match engine::before_wait(event, site, a.name, a.flags & !1 == 0) {
                    Ok(code) => return code,
                    Err(o) => o,
                }
            } else {
                engine::before_work(site, a.name)
            };
            let r = call();
            engine::after(site, o, kind == Kind::WorkDone && r == 0);
            if kind == Kind::WorkDone {
                return after_waiting(r);
            }
            r
        }
        Kind::StreamSync | Kind::StreamQuery => {
            let how = if kind == Kind::StreamSync {
                SyncKind::Wait
            } else {
                SyncKind::Query
            };
            match engine::stream_sync(site, how) {
                (Answer::Done(code), _) => code,
                (Answer::Forward, epoch) => {
                    let r = call();
                    if kind == Kind::StreamSync {
                        engine::stream_synced(site, r, epoch);
                    }
                    after_waiting(r)
                }
            }
        }
        Kind::EventRecord => match engine::event_record(event, site) {
            Answer::Done(code) => code,
            Answer::Forward => call(),
        },
        Kind::CtxSync => match engine::context_sync() {
            (Answer::Done(code), _) => code,
            (Answer::Forward, epoch) => {
                let r = call();
                engine::context_synced(r, epoch);
                after_waiting(r)
            }
        },
        Kind::Device | Kind::CtxSyncOf => match engine::device_quiet() {
            Answer::Done(code) => code,
            Answer::Forward => after_waiting(call()),
        },
        Kind::Teardown => {
            // A context APEX never attached to (another context of the GPU, one whose attach was refused) goes alone:
            // nothing of APEX's runs in it. Any other end of a context (one APEX attached to, a primary context
            // reset, which names a device) ends the takeover.
            let alone = a.context != 0 && engine::context_destroyed_alone(a.context);
            if !alone {
                engine::shutdown("the program destroyed or reset the CUDA context APEX had joined");
            }
            // libcuda frees the context's memory with it, the cached blocks too.
            if let Some(mut c) = crate::alloc_cache::lock() {
                c.forget(alone.then_some(a.context));
            }
            call()
        }
        Kind::CopyDtoHAsync
        | Kind::CopyHtoDAsync
        | Kind::CopyAnyAsync
        | Kind::CopyDtoH
        | Kind::CopyHtoD
        | Kind::CopyAny
        | Kind::CopyDtoD
        | Kind::Set8
        | Kind::Set16
        | Kind::Set32 => unreachable!("copies and memsets are handled above"),
    }
}

/// After a call that waited for work libcuda ran after APEX's (through a hop): a failed assert of APEX's kernels it
/// waited for is reported, and the call answers it, as libcuda's would after its own kernel's.
fn after_waiting(r: c_int) -> c_int {
    engine::pending_assert().unwrap_or(r)
}

/// One wrapped driver function.
#[derive(Debug)]
struct Hook {
    /// libcuda's exported name.
    symbol: &'static CStr,
    /// The name `cuGetProcAddress` is asked with.
    base: &'static [u8],
    /// The per-thread default stream variant (`_ptsz`/`_ptds`).
    per_thread: bool,
    /// Whether the function's signature changed between versions under one base name: then `cuGetProcAddress`'s
    /// answer is taken only if it is this symbol.
    versioned: bool,
    slot: &'static AtomicUsize,
    ours: usize,
    /// Handed out with the takeover off too (`APEX_PRELOAD=off`): launches (still counted), module loads and
    /// unloads (the summary's `modules_seen`), `cuGetProcAddress` itself. Every other function is then libcuda's own.
    when_off: bool,
}

impl Hook {
    /// Whether `dlsym` and `cuGetProcAddress` hand out this wrapper (`off`: `APEX_PRELOAD=off`). With the takeover
    /// off a wrapper of stream work, events, synchronization or memory only forwards: libcuda's own function costs
    /// the program nothing more.
    fn handed_out(&self, off: bool) -> bool {
        !off || self.when_off
    }
}

type P = *mut c_void;
type Dptr = u64;

macro_rules! hooks {
    ($( $sym:ident, $base:literal, $pt:literal, $versioned:literal, $kind:ident, ($($a:ident: $t:ty),*) => $site:expr $(, event $ev:ident)? $(, flags $fl:ident)? $(, context $cx:ident)? $(, copy $cd:ident $cs:ident $cn:ident)? $(, set $sd:ident $sv:ident $sn:ident)?; )*) => {
        $(
            #[allow(non_snake_case)]
            mod $sym {
                pub(crate) static REAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                pub(crate) const NAME: &std::ffi::CStr =
                    match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($sym), "\0").as_bytes()) {
                        Ok(c) => c,
                        Err(_) => panic!("a symbol name with a NUL"),
                    };
            }

            #[doc = concat!("`", stringify!($sym), "`, forwarded to libcuda and ordered with APEX's queues.")]
            ///
            /// # Safety
            /// As the CUDA driver function of this name.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $sym($($a: $t),*) -> c_int {
                type F = unsafe extern "C" fn($($t),*) -> c_int;
                let p = next(&$sym::REAL, $sym::NAME);
                if p == 0 {
                    return CUDA_ERROR_STUB_LIBRARY;
                }
                // SAFETY: libcuda's function of this name (or what cuGetProcAddress returned for it), this signature.
                let real = unsafe { std::mem::transmute::<usize, F>(p) };
                let site: Site = $site;
                #[allow(unused_mut)]
                let mut args = Args {
                    name: stringify!($sym),
                    ..Args::default()
                };
                $( args.event = $ev as usize; )?
                $( args.flags = $fl as u32; )?
                $( args.context = $cx as usize; )?
                $( args.copy = ($cd as u64, $cs as u64, $cn); )?
                $( args.set = ($sd, u32::from($sv), $sn); )?
                // Frees kept before the call are the ones a synchronization that succeeds completes.
                let frees = if Kind::$kind.completes() { crate::alloc_cache::frees_so_far() } else { 0 };
                // SAFETY: forwarded unchanged.
                let r = around(Kind::$kind, site, args, || unsafe { real($($a),*) });
                if r == 0 && Kind::$kind.completes() {
                    memory::synchronized(site, args.context, frees);
                }
                r
            }
        )*

        /// The wrapped functions of the table above, in order.
        fn generated() -> Vec<Hook> {
            vec![$(Hook {
                symbol: $sym::NAME,
                base: $base.as_bytes(),
                per_thread: $pt,
                versioned: $versioned,
                slot: &$sym::REAL,
                ours: $sym as *const () as usize,
                when_off: false,
            }),*]
        }
    };
}

fn s(stream: P, per_thread: bool) -> Site {
    Site::Stream(stream as usize, per_thread)
}

/// The legacy (or, for `_ptds` entry points, per-thread) default stream: where synchronous copies and sets run.
fn default(per_thread: bool) -> Site {
    Site::Stream(0, per_thread)
}

hooks! {
    // Asynchronous copies and sets.
    cuMemcpyAsync, "cuMemcpyAsync", false, false, CopyAnyAsync, (d: Dptr, src: Dptr, n: usize, st: P) => s(st, false), copy d src n;
    cuMemcpyAsync_ptsz, "cuMemcpyAsync", true, false, CopyAnyAsync, (d: Dptr, src: Dptr, n: usize, st: P) => s(st, true), copy d src n;
    cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", false, false, CopyHtoDAsync, (d: Dptr, src: P, n: usize, st: P) => s(st, false), copy d src n;
    cuMemcpyHtoDAsync_v2_ptsz, "cuMemcpyHtoDAsync", true, false, CopyHtoDAsync, (d: Dptr, src: P, n: usize, st: P) => s(st, true), copy d src n;
    cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", false, false, CopyDtoHAsync, (d: P, src: Dptr, n: usize, st: P) => s(st, false), copy d src n;
    cuMemcpyDtoHAsync_v2_ptsz, "cuMemcpyDtoHAsync", true, false, CopyDtoHAsync, (d: P, src: Dptr, n: usize, st: P) => s(st, true), copy d src n;
    cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", false, false, CopyDtoD, (d: Dptr, src: Dptr, n: usize, st: P) => s(st, false), copy d src n;
    cuMemcpyDtoDAsync_v2_ptsz, "cuMemcpyDtoDAsync", true, false, CopyDtoD, (d: Dptr, src: Dptr, n: usize, st: P) => s(st, true), copy d src n;
    cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", false, false, Work, (c: P, st: P) => s(st, false);
    cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", true, false, Work, (c: P, st: P) => s(st, true);
    cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", false, false, Work, (c: P, st: P) => s(st, false);
    cuMemcpy3DAsync_v2_ptsz, "cuMemcpy3DAsync", true, false, Work, (c: P, st: P) => s(st, true);
    cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", false, false, Work, (c: P, st: P) => s(st, false);
    cuMemcpy3DPeerAsync_ptsz, "cuMemcpy3DPeerAsync", true, false, Work, (c: P, st: P) => s(st, true);
    cuMemcpyPeerAsync, "cuMemcpyPeerAsync", false, false, Work, (d: Dptr, dc: P, src: Dptr, sc: P, n: usize, st: P) => s(st, false);
    cuMemcpyPeerAsync_ptsz, "cuMemcpyPeerAsync", true, false, Work, (d: Dptr, dc: P, src: Dptr, sc: P, n: usize, st: P) => s(st, true);
    cuMemsetD8Async, "cuMemsetD8Async", false, false, Set8, (d: Dptr, v: u8, n: usize, st: P) => s(st, false), set d v n;
    cuMemsetD8Async_ptsz, "cuMemsetD8Async", true, false, Set8, (d: Dptr, v: u8, n: usize, st: P) => s(st, true), set d v n;
    cuMemsetD16Async, "cuMemsetD16Async", false, false, Set16, (d: Dptr, v: u16, n: usize, st: P) => s(st, false), set d v n;
    cuMemsetD16Async_ptsz, "cuMemsetD16Async", true, false, Set16, (d: Dptr, v: u16, n: usize, st: P) => s(st, true), set d v n;
    cuMemsetD32Async, "cuMemsetD32Async", false, false, Set32, (d: Dptr, v: u32, n: usize, st: P) => s(st, false), set d v n;
    cuMemsetD32Async_ptsz, "cuMemsetD32Async", true, false, Set32, (d: Dptr, v: u32, n: usize, st: P) => s(st, true), set d v n;
    cuMemsetD2D8Async, "cuMemsetD2D8Async", false, false, Work, (d: Dptr, p: usize, v: u8, w: usize, h: usize, st: P) => s(st, false);
    cuMemsetD2D8Async_ptsz, "cuMemsetD2D8Async", true, false, Work, (d: Dptr, p: usize, v: u8, w: usize, h: usize, st: P) => s(st, true);
    cuMemsetD2D16Async, "cuMemsetD2D16Async", false, false, Work, (d: Dptr, p: usize, v: u16, w: usize, h: usize, st: P) => s(st, false);
    cuMemsetD2D16Async_ptsz, "cuMemsetD2D16Async", true, false, Work, (d: Dptr, p: usize, v: u16, w: usize, h: usize, st: P) => s(st, true);
    cuMemsetD2D32Async, "cuMemsetD2D32Async", false, false, Work, (d: Dptr, p: usize, v: u32, w: usize, h: usize, st: P) => s(st, false);
    cuMemsetD2D32Async_ptsz, "cuMemsetD2D32Async", true, false, Work, (d: Dptr, p: usize, v: u32, w: usize, h: usize, st: P) => s(st, true);
    // Array copies, batched copies, external semaphores and sparse array mapping: stream work too. The batched
    // copies changed signature between v1 (with a failure index) and v2 under one name: versioned.
    cuMemcpyHtoAAsync_v2, "cuMemcpyHtoAAsync", false, false, Work, (a: P, o: usize, h: P, n: usize, st: P) => s(st, false);
    cuMemcpyHtoAAsync_v2_ptsz, "cuMemcpyHtoAAsync", true, false, Work, (a: P, o: usize, h: P, n: usize, st: P) => s(st, true);
    cuMemcpyAtoHAsync_v2, "cuMemcpyAtoHAsync", false, false, Work, (h: P, a: P, o: usize, n: usize, st: P) => s(st, false);
    cuMemcpyAtoHAsync_v2_ptsz, "cuMemcpyAtoHAsync", true, false, Work, (h: P, a: P, o: usize, n: usize, st: P) => s(st, true);
    cuMemcpyBatchAsync, "cuMemcpyBatchAsync", false, true, Work, (d: P, src: P, z: P, c: usize, at: P, ai: P, na: usize, fi: P, st: P) => s(st, false);
    cuMemcpyBatchAsync_ptsz, "cuMemcpyBatchAsync", true, true, Work, (d: P, src: P, z: P, c: usize, at: P, ai: P, na: usize, fi: P, st: P) => s(st, true);
    cuMemcpyBatchAsync_v2, "cuMemcpyBatchAsync", false, true, Work, (d: P, src: P, z: P, c: usize, at: P, ai: P, na: usize, st: P) => s(st, false);
    cuMemcpyBatchAsync_v2_ptsz, "cuMemcpyBatchAsync", true, true, Work, (d: P, src: P, z: P, c: usize, at: P, ai: P, na: usize, st: P) => s(st, true);
    cuMemcpy3DBatchAsync, "cuMemcpy3DBatchAsync", false, true, Work, (n: usize, ops: P, fi: P, fl: u64, st: P) => s(st, false);
    cuMemcpy3DBatchAsync_ptsz, "cuMemcpy3DBatchAsync", true, true, Work, (n: usize, ops: P, fi: P, fl: u64, st: P) => s(st, true);
    cuMemcpy3DBatchAsync_v2, "cuMemcpy3DBatchAsync", false, true, Work, (n: usize, ops: P, fl: u64, st: P) => s(st, false);
    cuMemcpy3DBatchAsync_v2_ptsz, "cuMemcpy3DBatchAsync", true, true, Work, (n: usize, ops: P, fl: u64, st: P) => s(st, true);
    cuSignalExternalSemaphoresAsync, "cuSignalExternalSemaphoresAsync", false, false, Work, (e: P, p: P, n: c_uint, st: P) => s(st, false);
    cuSignalExternalSemaphoresAsync_ptsz, "cuSignalExternalSemaphoresAsync", true, false, Work, (e: P, p: P, n: c_uint, st: P) => s(st, true);
    cuWaitExternalSemaphoresAsync, "cuWaitExternalSemaphoresAsync", false, false, Work, (e: P, p: P, n: c_uint, st: P) => s(st, false);
    cuWaitExternalSemaphoresAsync_ptsz, "cuWaitExternalSemaphoresAsync", true, false, Work, (e: P, p: P, n: c_uint, st: P) => s(st, true);
    cuMemMapArrayAsync, "cuMemMapArrayAsync", false, false, Work, (m: P, c: c_uint, st: P) => s(st, false);
    cuMemMapArrayAsync_ptsz, "cuMemMapArrayAsync", true, false, Work, (m: P, c: c_uint, st: P) => s(st, true);
    // Synchronous copies and sets: on the default stream.
    cuMemcpy, "cuMemcpy", false, false, CopyAny, (d: Dptr, src: Dptr, n: usize) => default(false), copy d src n;
    cuMemcpy_ptds, "cuMemcpy", true, false, CopyAny, (d: Dptr, src: Dptr, n: usize) => default(true), copy d src n;
    cuMemcpyHtoD_v2, "cuMemcpyHtoD", false, false, CopyHtoD, (d: Dptr, src: P, n: usize) => default(false), copy d src n;
    cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", true, false, CopyHtoD, (d: Dptr, src: P, n: usize) => default(true), copy d src n;
    cuMemcpyDtoH_v2, "cuMemcpyDtoH", false, false, CopyDtoH, (d: P, src: Dptr, n: usize) => default(false), copy d src n;
    cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", true, false, CopyDtoH, (d: P, src: Dptr, n: usize) => default(true), copy d src n;
    cuMemcpyDtoD_v2, "cuMemcpyDtoD", false, false, CopyDtoD, (d: Dptr, src: Dptr, n: usize) => default(false), copy d src n;
    cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", true, false, CopyDtoD, (d: Dptr, src: Dptr, n: usize) => default(true), copy d src n;
    cuMemcpy2D_v2, "cuMemcpy2D", false, false, Work, (c: P) => default(false);
    cuMemcpy2D_v2_ptds, "cuMemcpy2D", true, false, Work, (c: P) => default(true);
    cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", false, false, Work, (c: P) => default(false);
    cuMemcpy2DUnaligned_v2_ptds, "cuMemcpy2DUnaligned", true, false, Work, (c: P) => default(true);
    cuMemcpy3D_v2, "cuMemcpy3D", false, false, Work, (c: P) => default(false);
    cuMemcpy3D_v2_ptds, "cuMemcpy3D", true, false, Work, (c: P) => default(true);
    cuMemcpyAtoH_v2, "cuMemcpyAtoH", false, false, WorkDone, (h: P, a: P, o: usize, n: usize) => default(false);
    cuMemcpyAtoH_v2_ptds, "cuMemcpyAtoH", true, false, WorkDone, (h: P, a: P, o: usize, n: usize) => default(true);
    cuMemcpyHtoA_v2, "cuMemcpyHtoA", false, false, Work, (a: P, o: usize, h: P, n: usize) => default(false);
    cuMemcpyHtoA_v2_ptds, "cuMemcpyHtoA", true, false, Work, (a: P, o: usize, h: P, n: usize) => default(true);
    cuMemcpyDtoA_v2, "cuMemcpyDtoA", false, false, Work, (a: P, o: usize, d: Dptr, n: usize) => default(false);
    cuMemcpyDtoA_v2_ptds, "cuMemcpyDtoA", true, false, Work, (a: P, o: usize, d: Dptr, n: usize) => default(true);
    cuMemcpyAtoD_v2, "cuMemcpyAtoD", false, false, Work, (d: Dptr, a: P, o: usize, n: usize) => default(false);
    cuMemcpyAtoD_v2_ptds, "cuMemcpyAtoD", true, false, Work, (d: Dptr, a: P, o: usize, n: usize) => default(true);
    cuMemcpyAtoA_v2, "cuMemcpyAtoA", false, false, Work, (a: P, o: usize, b: P, q: usize, n: usize) => default(false);
    cuMemcpyAtoA_v2_ptds, "cuMemcpyAtoA", true, false, Work, (a: P, o: usize, b: P, q: usize, n: usize) => default(true);
    cuMemcpy3DPeer, "cuMemcpy3DPeer", false, false, Work, (c: P) => default(false);
    cuMemcpy3DPeer_ptds, "cuMemcpy3DPeer", true, false, Work, (c: P) => default(true);
    cuMemcpyPeer, "cuMemcpyPeer", false, false, Work, (d: Dptr, dc: P, src: Dptr, sc: P, n: usize) => default(false);
    cuMemcpyPeer_ptds, "cuMemcpyPeer", true, false, Work, (d: Dptr, dc: P, src: Dptr, sc: P, n: usize) => default(true);
    cuMemsetD8_v2, "cuMemsetD8", false, false, Set8, (d: Dptr, v: u8, n: usize) => default(false), set d v n;
    cuMemsetD8_v2_ptds, "cuMemsetD8", true, false, Set8, (d: Dptr, v: u8, n: usize) => default(true), set d v n;
    cuMemsetD16_v2, "cuMemsetD16", false, false, Set16, (d: Dptr, v: u16, n: usize) => default(false), set d v n;
    cuMemsetD16_v2_ptds, "cuMemsetD16", true, false, Set16, (d: Dptr, v: u16, n: usize) => default(true), set d v n;
    cuMemsetD32_v2, "cuMemsetD32", false, false, Set32, (d: Dptr, v: u32, n: usize) => default(false), set d v n;
    cuMemsetD32_v2_ptds, "cuMemsetD32", true, false, Set32, (d: Dptr, v: u32, n: usize) => default(true), set d v n;
    cuMemsetD2D8_v2, "cuMemsetD2D8", false, false, Work, (d: Dptr, p: usize, v: u8, w: usize, h: usize) => default(false);
    cuMemsetD2D8_v2_ptds, "cuMemsetD2D8", true, false, Work, (d: Dptr, p: usize, v: u8, w: usize, h: usize) => default(true);
    cuMemsetD2D16_v2, "cuMemsetD2D16", false, false, Work, (d: Dptr, p: usize, v: u16, w: usize, h: usize) => default(false);
    cuMemsetD2D16_v2_ptds, "cuMemsetD2D16", true, false, Work, (d: Dptr, p: usize, v: u16, w: usize, h: usize) => default(true);
    cuMemsetD2D32_v2, "cuMemsetD2D32", false, false, Work, (d: Dptr, p: usize, v: u32, w: usize, h: usize) => default(false);
    cuMemsetD2D32_v2_ptds, "cuMemsetD2D32", true, false, Work, (d: Dptr, p: usize, v: u32, w: usize, h: usize) => default(true);
    // Stream work other than copies.
    cuStreamWaitEvent, "cuStreamWaitEvent", false, false, WaitEvent, (st: P, ev: P, f: c_uint) => s(st, false), event ev, flags f;
    cuStreamWaitEvent_ptsz, "cuStreamWaitEvent", true, false, WaitEvent, (st: P, ev: P, f: c_uint) => s(st, true), event ev, flags f;
    cuStreamAddCallback, "cuStreamAddCallback", false, false, Work, (st: P, cb: P, ud: P, f: c_uint) => s(st, false);
    cuStreamAddCallback_ptsz, "cuStreamAddCallback", true, false, Work, (st: P, cb: P, ud: P, f: c_uint) => s(st, true);
    cuLaunchHostFunc, "cuLaunchHostFunc", false, true, Work, (st: P, cb: P, ud: P) => s(st, false);
    cuLaunchHostFunc_ptsz, "cuLaunchHostFunc", true, true, Work, (st: P, cb: P, ud: P) => s(st, true);
    cuLaunchHostFunc_v2, "cuLaunchHostFunc", false, true, Work, (st: P, cb: P, ud: P, m: c_uint) => s(st, false);
    cuLaunchHostFunc_v2_ptsz, "cuLaunchHostFunc", true, true, Work, (st: P, cb: P, ud: P, m: c_uint) => s(st, true);
    // Stream memory operations: the v1 entry points (CUDA 11 semantics, refused by CUDA 12+ drivers unless enabled)
    // and v2 share a name in cuGetProcAddress, so each wrapper is taken only for its exact symbol (versioned).
    cuStreamWaitValue32_v2, "cuStreamWaitValue32", false, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, false);
    cuStreamWaitValue32_v2_ptsz, "cuStreamWaitValue32", true, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, true);
    cuStreamWaitValue64_v2, "cuStreamWaitValue64", false, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, false);
    cuStreamWaitValue64_v2_ptsz, "cuStreamWaitValue64", true, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, true);
    cuStreamWriteValue32_v2, "cuStreamWriteValue32", false, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, false);
    cuStreamWriteValue32_v2_ptsz, "cuStreamWriteValue32", true, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, true);
    cuStreamWriteValue64_v2, "cuStreamWriteValue64", false, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, false);
    cuStreamWriteValue64_v2_ptsz, "cuStreamWriteValue64", true, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, true);
    cuStreamBatchMemOp_v2, "cuStreamBatchMemOp", false, true, Work, (st: P, n: c_uint, ops: P, f: c_uint) => s(st, false);
    cuStreamBatchMemOp_v2_ptsz, "cuStreamBatchMemOp", true, true, Work, (st: P, n: c_uint, ops: P, f: c_uint) => s(st, true);
    cuStreamWaitValue32, "cuStreamWaitValue32", false, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, false);
    cuStreamWaitValue32_ptsz, "cuStreamWaitValue32", true, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, true);
    cuStreamWaitValue64, "cuStreamWaitValue64", false, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, false);
    cuStreamWaitValue64_ptsz, "cuStreamWaitValue64", true, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, true);
    cuStreamWriteValue32, "cuStreamWriteValue32", false, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, false);
    cuStreamWriteValue32_ptsz, "cuStreamWriteValue32", true, true, Work, (st: P, a: Dptr, v: u32, f: c_uint) => s(st, true);
    cuStreamWriteValue64, "cuStreamWriteValue64", false, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, false);
    cuStreamWriteValue64_ptsz, "cuStreamWriteValue64", true, true, Work, (st: P, a: Dptr, v: u64, f: c_uint) => s(st, true);
    cuStreamBatchMemOp, "cuStreamBatchMemOp", false, true, Work, (st: P, n: c_uint, ops: P, f: c_uint) => s(st, false);
    cuStreamBatchMemOp_ptsz, "cuStreamBatchMemOp", true, true, Work, (st: P, n: c_uint, ops: P, f: c_uint) => s(st, true);
    cuGraphLaunch, "cuGraphLaunch", false, false, Graph, (g: P, st: P) => s(st, false);
    cuGraphLaunch_ptsz, "cuGraphLaunch", true, false, Graph, (g: P, st: P) => s(st, true);
    cuGraphUpload, "cuGraphUpload", false, false, Graph, (g: P, st: P) => s(st, false);
    cuGraphUpload_ptsz, "cuGraphUpload", true, false, Graph, (g: P, st: P) => s(st, true);
    cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", false, false, Work, (d: P, n: usize, pool: P, st: P) => s(st, false);
    cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", true, false, Work, (d: P, n: usize, pool: P, st: P) => s(st, true);
    cuStreamAttachMemAsync, "cuStreamAttachMemAsync", false, false, Work, (st: P, d: Dptr, n: usize, f: c_uint) => s(st, false);
    cuStreamAttachMemAsync_ptsz, "cuStreamAttachMemAsync", true, false, Work, (st: P, d: Dptr, n: usize, f: c_uint) => s(st, true);
    cuMemPrefetchAsync, "cuMemPrefetchAsync", false, true, Work, (d: Dptr, n: usize, dev: c_int, st: P) => s(st, false);
    cuMemPrefetchAsync_ptsz, "cuMemPrefetchAsync", true, true, Work, (d: Dptr, n: usize, dev: c_int, st: P) => s(st, true);
    cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", false, true, Work, (d: Dptr, n: usize, loc: u64, f: c_uint, st: P) => s(st, false);
    cuMemPrefetchAsync_v2_ptsz, "cuMemPrefetchAsync", true, true, Work, (d: Dptr, n: usize, loc: u64, f: c_uint, st: P) => s(st, true);
    // Stream work of newer or rarer entry points (CUDA 12.8-13): ordered like any CUDA work, so that no stream work
    // escapes the preload's count of what libcuda holds.
    cuGraphicsMapResources, "cuGraphicsMapResources", false, false, Work, (n: c_uint, r: P, st: P) => s(st, false);
    cuGraphicsUnmapResources, "cuGraphicsUnmapResources", false, false, Work, (n: c_uint, r: P, st: P) => s(st, false);
    cuLaunchGridAsync, "cuLaunchGridAsync", false, false, Work, (f: P, w: c_int, h: c_int, st: P) => s(st, false);
    cuMemBatchDecompressAsync, "cuMemBatchDecompressAsync", false, false, Work, (p: P, n: usize, fl: c_uint, ei: P, st: P) => s(st, false);
    cuMemDiscardAndPrefetchBatchAsync, "cuMemDiscardAndPrefetchBatchAsync", false, false, Work, (d: P, z: P, n: usize, l: P, li: P, nl: usize, fl: u64, st: P) => s(st, false);
    cuMemDiscardBatchAsync, "cuMemDiscardBatchAsync", false, false, Work, (d: P, z: P, n: usize, fl: u64, st: P) => s(st, false);
    cuMemPrefetchBatchAsync, "cuMemPrefetchBatchAsync", false, false, Work, (d: P, z: P, n: usize, l: P, li: P, nl: usize, fl: u64, st: P) => s(st, false);
    cuMemcpy3DWithAttributesAsync, "cuMemcpy3DWithAttributesAsync", false, false, Work, (op: P, fl: u64, st: P) => s(st, false);
    cuMemcpyWithAttributesAsync, "cuMemcpyWithAttributesAsync", false, false, Work, (d: Dptr, src: Dptr, n: usize, at: P, st: P) => s(st, false);
    // Event records and synchronization: answered from APEX's fences where they can be.
    cuEventRecord, "cuEventRecord", false, false, EventRecord, (ev: P, st: P) => s(st, false), event ev;
    cuEventRecord_ptsz, "cuEventRecord", true, false, EventRecord, (ev: P, st: P) => s(st, true), event ev;
    cuEventRecordWithFlags, "cuEventRecordWithFlags", false, false, EventRecord, (ev: P, st: P, f: c_uint) => s(st, false), event ev;
    cuEventRecordWithFlags_ptsz, "cuEventRecordWithFlags", true, false, EventRecord, (ev: P, st: P, f: c_uint) => s(st, true), event ev;
    cuStreamSynchronize, "cuStreamSynchronize", false, false, StreamSync, (st: P) => s(st, false);
    cuStreamSynchronize_ptsz, "cuStreamSynchronize", true, false, StreamSync, (st: P) => s(st, true);
    cuStreamQuery, "cuStreamQuery", false, false, StreamQuery, (st: P) => s(st, false);
    cuStreamQuery_ptsz, "cuStreamQuery", true, false, StreamQuery, (st: P) => s(st, true);
    // The whole context.
    cuCtxSynchronize, "cuCtxSynchronize", false, true, CtxSync, () => Site::Device;
    // A context that may not be the current one: its queues are waited for, and libcuda always synchronizes it.
    cuCtxSynchronize_v2, "cuCtxSynchronize", false, true, CtxSyncOf, (c: P) => Site::Device, context c;
    cuMemFreeHost, "cuMemFreeHost", false, false, Device, (p: P) => Site::Device;
    cuMemHostUnregister, "cuMemHostUnregister", false, false, Device, (p: P) => Site::Device;
    cuMemUnmap, "cuMemUnmap", false, false, Device, (d: Dptr, n: usize) => Site::Device;
    cuCtxDestroy_v2, "cuCtxDestroy", false, false, Teardown, (c: P) => Site::Device, context c;
    cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", false, false, Teardown, (d: c_int) => Site::Device;
}

// ---- calls whose results the engine records ----

/// Declares the cache slot of a hand-written wrapper's real function (named for the reader).
macro_rules! real_fn {
    ($slot:ident, $name:literal) => {
        static $slot: AtomicUsize = AtomicUsize::new(0);
    };
}

/// Forwards to `slot`'s function (looked up as `name`), as type `F`, or returns the stub-library error.
macro_rules! forward {
    ($slot:ident, $name:literal, $ty:ty, ($($a:expr),*)) => {{
        let mut p = next(&$slot, $name);
        if p == 0 {
            // A function the program never looked up itself (the preload calls it on its own account, as the
            // allocation cache does cuCtxSynchronize): libcuda's own, where the program loaded libcuda privately.
            p = apex_interpose::libcuda_symbol($name).unwrap_or(0);
            $slot.store(p, std::sync::atomic::Ordering::Relaxed);
        }
        if p == 0 {
            return CUDA_ERROR_STUB_LIBRARY;
        }
        // SAFETY: libcuda's function of this name (or what cuGetProcAddress returned for it), this signature.
        let real = unsafe { std::mem::transmute::<usize, $ty>(p) };
        // SAFETY: forwarded unchanged.
        unsafe { real($($a),*) }
    }};
}

/// Reads a handle the driver wrote to an out-parameter after success.
///
/// # Safety
/// `p` is null or the out-parameter the driver just filled.
unsafe fn out(p: *mut P) -> usize {
    if p.is_null() {
        0
    } else {
        // SAFETY: per the contract.
        unsafe { *p as usize }
    }
}

real_fn!(REAL_MODULE_LOAD, c"cuModuleLoad");
real_fn!(REAL_MODULE_LOAD_DATA, c"cuModuleLoadData");
real_fn!(REAL_MODULE_LOAD_DATA_EX, c"cuModuleLoadDataEx");
real_fn!(REAL_MODULE_LOAD_FATBIN, c"cuModuleLoadFatBinary");
real_fn!(REAL_LIBRARY_LOAD_DATA, c"cuLibraryLoadData");
real_fn!(REAL_LIBRARY_LOAD_FILE, c"cuLibraryLoadFromFile");
real_fn!(REAL_MODULE_UNLOAD, c"cuModuleUnload");
real_fn!(REAL_LIBRARY_UNLOAD, c"cuLibraryUnload");
real_fn!(REAL_MODULE_GET_FUNCTION, c"cuModuleGetFunction");
real_fn!(REAL_LIBRARY_GET_KERNEL, c"cuLibraryGetKernel");
real_fn!(REAL_KERNEL_GET_FUNCTION, c"cuKernelGetFunction");
real_fn!(REAL_LIBRARY_GET_MODULE, c"cuLibraryGetModule");
real_fn!(REAL_MODULE_GET_GLOBAL, c"cuModuleGetGlobal_v2");
real_fn!(REAL_LIBRARY_GET_GLOBAL, c"cuLibraryGetGlobal");
real_fn!(REAL_LIBRARY_GET_MANAGED, c"cuLibraryGetManaged");
real_fn!(REAL_FUNC_SET_ATTRIBUTE, c"cuFuncSetAttribute");
real_fn!(REAL_KERNEL_SET_ATTRIBUTE, c"cuKernelSetAttribute");
real_fn!(REAL_CTX_SET_LIMIT, c"cuCtxSetLimit");
real_fn!(REAL_STREAM_DESTROY, c"cuStreamDestroy_v2");
real_fn!(REAL_BEGIN_CAPTURE, c"cuStreamBeginCapture_v2");
real_fn!(REAL_BEGIN_CAPTURE_PT, c"cuStreamBeginCapture_v2_ptsz");
real_fn!(REAL_BEGIN_CAPTURE_GRAPH, c"cuStreamBeginCaptureToGraph");
real_fn!(
    REAL_BEGIN_CAPTURE_GRAPH_PT,
    c"cuStreamBeginCaptureToGraph_ptsz"
);
real_fn!(REAL_END_CAPTURE, c"cuStreamEndCapture");
real_fn!(REAL_END_CAPTURE_PT, c"cuStreamEndCapture_ptsz");
real_fn!(REAL_COOP, c"cuLaunchCooperativeKernel");
real_fn!(REAL_COOP_PT, c"cuLaunchCooperativeKernel_ptsz");
real_fn!(REAL_LAUNCH, c"cuLaunchKernel");
real_fn!(REAL_LAUNCH_PT, c"cuLaunchKernel_ptsz");
real_fn!(REAL_LAUNCH_EX, c"cuLaunchKernelEx");
real_fn!(REAL_LAUNCH_EX_PT, c"cuLaunchKernelEx_ptsz");
real_fn!(REAL_GPA, c"cuGetProcAddress");
real_fn!(REAL_GPA_V2, c"cuGetProcAddress_v2");

/// Runs `call`; on success, and outside nested hooks, `record` (panics contained).
fn recorded(call: impl FnOnce() -> c_int, record: impl FnOnce()) -> c_int {
    let g = enter();
    let r = call();
    if r == 0 && g.is_some() {
        quietly(record);
    }
    r
}

/// # Safety
/// `cuModuleLoad`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut P, fname: *const c_char) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_char) -> c_int;
    recorded(
        || forward!(REAL_MODULE_LOAD, c"cuModuleLoad", F, (module, fname)),
        // SAFETY: the driver filled `module`.
        || engine::loaded_file(unsafe { out(module) }, fname, false),
    )
}

/// # Safety
/// `cuModuleLoadData`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut P, image: *const c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_void) -> c_int;
    recorded(
        || {
            forward!(
                REAL_MODULE_LOAD_DATA,
                c"cuModuleLoadData",
                F,
                (module, image)
            )
        },
        // SAFETY: the driver filled `module`.
        || engine::loaded(unsafe { out(module) }, image.cast(), false),
    )
}

/// # Safety
/// `cuModuleLoadDataEx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut P,
    image: *const c_void,
    n: c_uint,
    options: P,
    values: P,
) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_void, c_uint, P, P) -> c_int;
    recorded(
        || {
            forward!(
                REAL_MODULE_LOAD_DATA_EX,
                c"cuModuleLoadDataEx",
                F,
                (module, image, n, options, values)
            )
        },
        // SAFETY: the driver filled `module`.
        || engine::loaded(unsafe { out(module) }, image.cast(), false),
    )
}

/// # Safety
/// `cuModuleLoadFatBinary`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadFatBinary(module: *mut P, fatbin: *const c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_void) -> c_int;
    recorded(
        || {
            forward!(
                REAL_MODULE_LOAD_FATBIN,
                c"cuModuleLoadFatBinary",
                F,
                (module, fatbin)
            )
        },
        // SAFETY: the driver filled `module`.
        || engine::loaded(unsafe { out(module) }, fatbin.cast(), false),
    )
}

/// # Safety
/// `cuLibraryLoadData`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut P,
    code: *const c_void,
    jit_options: P,
    jit_values: P,
    jit_n: c_uint,
    lib_options: P,
    lib_values: P,
    lib_n: c_uint,
) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_void, P, P, c_uint, P, P, c_uint) -> c_int;
    recorded(
        || {
            forward!(
                REAL_LIBRARY_LOAD_DATA,
                c"cuLibraryLoadData",
                F,
                (
                    library,
                    code,
                    jit_options,
                    jit_values,
                    jit_n,
                    lib_options,
                    lib_values,
                    lib_n
                )
            )
        },
        // SAFETY: the driver filled `library`.
        || engine::loaded(unsafe { out(library) }, code.cast(), true),
    )
}

/// # Safety
/// `cuLibraryLoadFromFile`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadFromFile(
    library: *mut P,
    fname: *const c_char,
    jit_options: P,
    jit_values: P,
    jit_n: c_uint,
    lib_options: P,
    lib_values: P,
    lib_n: c_uint,
) -> c_int {
    type F = unsafe extern "C" fn(*mut P, *const c_char, P, P, c_uint, P, P, c_uint) -> c_int;
    recorded(
        || {
            forward!(
                REAL_LIBRARY_LOAD_FILE,
                c"cuLibraryLoadFromFile",
                F,
                (
                    library,
                    fname,
                    jit_options,
                    jit_values,
                    jit_n,
                    lib_options,
                    lib_values,
                    lib_n
                )
            )
        },
        // SAFETY: the driver filled `library`.
        || engine::loaded_file(unsafe { out(library) }, fname, true),
    )
}

fn unload(handle: P, call: impl FnOnce() -> c_int) -> c_int {
    let g = enter();
    if g.is_some() {
        // The set-up worker is not loading the module while libcuda frees it.
        engine::unloading(handle as usize);
        // APEX launches of the module's kernels complete before whatever reuses its memory.
        engine::device_quiet();
    }
    let r = call();
    if r == 0 && g.is_some() {
        engine::unloaded(handle as usize);
    }
    r
}

/// # Safety
/// `cuModuleUnload`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(module: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    unload(module, || {
        forward!(REAL_MODULE_UNLOAD, c"cuModuleUnload", F, (module))
    })
}

/// # Safety
/// `cuLibraryUnload`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryUnload(library: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    unload(library, || {
        forward!(REAL_LIBRARY_UNLOAD, c"cuLibraryUnload", F, (library))
    })
}

/// # Safety
/// `cuModuleGetFunction`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut P, module: P, name: *const c_char) -> c_int {
    type F = unsafe extern "C" fn(*mut P, P, *const c_char) -> c_int;
    recorded(
        || {
            forward!(
                REAL_MODULE_GET_FUNCTION,
                c"cuModuleGetFunction",
                F,
                (f, module, name)
            )
        },
        // SAFETY: the driver filled `f`.
        || engine::function(unsafe { out(f) }, module as usize, name),
    )
}

/// # Safety
/// `cuLibraryGetKernel`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetKernel(k: *mut P, library: P, name: *const c_char) -> c_int {
    type F = unsafe extern "C" fn(*mut P, P, *const c_char) -> c_int;
    recorded(
        || {
            forward!(
                REAL_LIBRARY_GET_KERNEL,
                c"cuLibraryGetKernel",
                F,
                (k, library, name)
            )
        },
        // SAFETY: the driver filled `k`.
        || engine::function(unsafe { out(k) }, library as usize, name),
    )
}

/// # Safety
/// `cuKernelGetFunction`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetFunction(f: *mut P, kernel: P) -> c_int {
    type F = unsafe extern "C" fn(*mut P, P) -> c_int;
    recorded(
        || {
            forward!(
                REAL_KERNEL_GET_FUNCTION,
                c"cuKernelGetFunction",
                F,
                (f, kernel)
            )
        },
        // SAFETY: the driver filled `f`.
        || engine::same_function(unsafe { out(f) }, kernel as usize),
    )
}

/// # Safety
/// `cuLibraryGetModule`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetModule(module: *mut P, library: P) -> c_int {
    type F = unsafe extern "C" fn(*mut P, P) -> c_int;
    recorded(
        || {
            forward!(
                REAL_LIBRARY_GET_MODULE,
                c"cuLibraryGetModule",
                F,
                (module, library)
            )
        },
        // SAFETY: the driver filled `module`.
        || engine::library_module(unsafe { out(module) }, library as usize),
    )
}

/// A lookup of a variable by name in a module or library (`cuModuleGetGlobal_v2`, `cuLibraryGetGlobal`,
/// `cuLibraryGetManaged`): forwarded to libcuda; once it succeeds, the module is marked as having a variable whose
/// address escaped (`$escape` names the variable, or null for one never shared with APEX's instance).
macro_rules! variable_lookup {
    ($fn_name:ident, $slot:ident, $symbol:literal, |$owner:ident, $name:ident| $escape:expr) => {
        /// # Safety
        #[doc = concat!("`", stringify!($fn_name), "`.")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $fn_name(
            dptr: *mut Dptr,
            bytes: *mut usize,
            $owner: P,
            $name: *const c_char,
        ) -> c_int {
            type F = unsafe extern "C" fn(*mut Dptr, *mut usize, P, *const c_char) -> c_int;
            recorded(
                || forward!($slot, $symbol, F, (dptr, bytes, $owner, $name)),
                || engine::escape($owner as usize, $escape),
            )
        }
    };
}

variable_lookup!(
    cuModuleGetGlobal_v2,
    REAL_MODULE_GET_GLOBAL,
    c"cuModuleGetGlobal_v2",
    |module, name| name
);
variable_lookup!(
    cuLibraryGetGlobal,
    REAL_LIBRARY_GET_GLOBAL,
    c"cuLibraryGetGlobal",
    |library, name| name
);
// A managed variable is never shared with APEX's instance: the module is refused.
variable_lookup!(
    cuLibraryGetManaged,
    REAL_LIBRARY_GET_MANAGED,
    c"cuLibraryGetManaged",
    |library, _name| std::ptr::null()
);

mod memory;

/// # Safety
/// `cuFuncSetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetAttribute(f: P, attr: c_int, value: c_int) -> c_int {
    type F = unsafe extern "C" fn(P, c_int, c_int) -> c_int;
    recorded(
        || {
            forward!(
                REAL_FUNC_SET_ATTRIBUTE,
                c"cuFuncSetAttribute",
                F,
                (f, attr, value)
            )
        },
        || engine::func_attribute(f as usize, attr),
    )
}

/// # Safety
/// `cuKernelSetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelSetAttribute(
    attr: c_int,
    value: c_int,
    kernel: P,
    dev: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(c_int, c_int, P, c_int) -> c_int;
    recorded(
        || {
            forward!(
                REAL_KERNEL_SET_ATTRIBUTE,
                c"cuKernelSetAttribute",
                F,
                (attr, value, kernel, dev)
            )
        },
        || engine::func_attribute(kernel as usize, attr),
    )
}

/// # Safety
/// `cuCtxSetLimit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> c_int {
    type F = unsafe extern "C" fn(c_int, usize) -> c_int;
    recorded(
        || forward!(REAL_CTX_SET_LIMIT, c"cuCtxSetLimit", F, (limit, value)),
        || engine::limit(limit, value),
    )
}

/// # Safety
/// `cuStreamDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    let g = enter().filter(|_| !engine::disabled());
    if g.is_some() {
        engine::forget_dependency(stream as usize);
        engine::before(Site::Stream(stream as usize, false));
        memory::stream_destroyed(stream as usize);
        engine::stream_destroying();
    }
    let r = forward!(REAL_STREAM_DESTROY, c"cuStreamDestroy_v2", F, (stream));
    if r == 0 && g.is_some() {
        engine::stream_destroyed(stream as usize);
    }
    r
}

real_fn!(REAL_EVENT_CREATE, c"cuEventCreate");
real_fn!(REAL_EVENT_DESTROY, c"cuEventDestroy_v2");
real_fn!(REAL_EVENT_SYNCHRONIZE, c"cuEventSynchronize");
real_fn!(REAL_EVENT_QUERY, c"cuEventQuery");
real_fn!(REAL_EVENT_ELAPSED, c"cuEventElapsedTime");
real_fn!(REAL_EVENT_ELAPSED_V2, c"cuEventElapsedTime_v2");
real_fn!(REAL_IPC_EVENT_HANDLE, c"cuIpcGetEventHandle");

/// # Safety
/// `cuEventCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut P, flags: c_uint) -> c_int {
    type F = unsafe extern "C" fn(*mut P, c_uint) -> c_int;
    if engine::disabled() {
        return forward!(REAL_EVENT_CREATE, c"cuEventCreate", F, (event, flags));
    }
    recorded(
        || forward!(REAL_EVENT_CREATE, c"cuEventCreate", F, (event, flags)),
        // SAFETY: the driver filled `event`.
        || engine::event_created(unsafe { out(event) }, flags),
    )
}

/// # Safety
/// `cuEventDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    if !engine::disabled()
        && let Some(_g) = enter()
    {
        engine::event_destroyed(event as usize);
    }
    forward!(REAL_EVENT_DESTROY, c"cuEventDestroy_v2", F, (event))
}

/// An event wait or query: answered from APEX's fence for an event the preload kept, else libcuda's.
fn event_sync(event: P, kind: SyncKind, call: impl FnOnce() -> c_int) -> c_int {
    // No event is kept on APEX before anything is attached.
    if engine::disabled() || !engine::engaged() {
        return call();
    }
    let Some(_g) = enter() else { return call() };
    if let Some(e) = engine::sticky() {
        return e;
    }
    match engine::event_sync(event as usize, kind) {
        Answer::Done(code) => code,
        Answer::Forward => after_waiting(call()),
    }
}

/// # Safety
/// `cuEventSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    event_sync(event, SyncKind::Wait, || {
        forward!(REAL_EVENT_SYNCHRONIZE, c"cuEventSynchronize", F, (event))
    })
}

/// # Safety
/// `cuEventQuery`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    event_sync(event, SyncKind::Query, || {
        forward!(REAL_EVENT_QUERY, c"cuEventQuery", F, (event))
    })
}

/// Before libcuda reads `events`: the ones the preload kept are recorded in libcuda first.
fn reads_events(events: &[P], why: &'static str, call: impl FnOnce() -> c_int) -> c_int {
    if !engine::disabled()
        && let Some(_g) = enter()
    {
        for &e in events {
            engine::materialize(e as usize, why);
        }
    }
    call()
}

/// # Safety
/// `cuEventElapsedTime`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: P, end: P) -> c_int {
    type F = unsafe extern "C" fn(*mut f32, P, P) -> c_int;
    reads_events(&[start, end], "cuEventElapsedTime", || {
        forward!(
            REAL_EVENT_ELAPSED,
            c"cuEventElapsedTime",
            F,
            (ms, start, end)
        )
    })
}

/// # Safety
/// `cuEventElapsedTime_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: P, end: P) -> c_int {
    type F = unsafe extern "C" fn(*mut f32, P, P) -> c_int;
    reads_events(&[start, end], "cuEventElapsedTime", || {
        forward!(
            REAL_EVENT_ELAPSED_V2,
            c"cuEventElapsedTime_v2",
            F,
            (ms, start, end)
        )
    })
}

/// # Safety
/// `cuIpcGetEventHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetEventHandle(handle: P, event: P) -> c_int {
    type F = unsafe extern "C" fn(P, P) -> c_int;
    reads_events(&[event], "cuIpcGetEventHandle", || {
        forward!(
            REAL_IPC_EVENT_HANDLE,
            c"cuIpcGetEventHandle",
            F,
            (handle, event)
        )
    })
}

/// Begins a capture: every queue is handed to CUDA first (nothing of APEX's may be pending in a captured stream),
/// and launches stay on libcuda until it ends.
fn capture_begins(stream: P, per_thread: bool, call: impl FnOnce() -> c_int) -> c_int {
    let g = enter().filter(|_| !engine::disabled());
    let mut marked = false;
    if g.is_some() {
        // Marked first: from here no thread keeps an event or a stream that only waits, so nothing kept is left
        // for libcuda to miss once the capture runs.
        marked = engine::capture(stream as usize, per_thread, true);
        // A captured stream may wait for an event the preload kept: libcuda must hold it first.
        engine::materialize_all();
        engine::before_capture();
    }
    let r = call();
    if r != 0 && marked {
        // libcuda refused the capture: the stream is not capturing after all.
        engine::capture(stream as usize, per_thread, false);
    }
    r
}

fn capture_ends(stream: P, per_thread: bool, call: impl FnOnce() -> c_int) -> c_int {
    let g = enter().filter(|_| !engine::disabled());
    let r = call();
    if g.is_some() {
        // Ended either way (an invalidated capture ends with an error).
        engine::capture(stream as usize, per_thread, false);
    }
    r
}

/// # Safety
/// `cuStreamBeginCapture_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: P, mode: c_int) -> c_int {
    type F = unsafe extern "C" fn(P, c_int) -> c_int;
    capture_begins(stream, false, || {
        forward!(
            REAL_BEGIN_CAPTURE,
            c"cuStreamBeginCapture_v2",
            F,
            (stream, mode)
        )
    })
}

/// # Safety
/// `cuStreamBeginCapture_v2_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: P, mode: c_int) -> c_int {
    type F = unsafe extern "C" fn(P, c_int) -> c_int;
    capture_begins(stream, true, || {
        forward!(
            REAL_BEGIN_CAPTURE_PT,
            c"cuStreamBeginCapture_v2_ptsz",
            F,
            (stream, mode)
        )
    })
}

/// # Safety
/// `cuStreamBeginCaptureToGraph`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph(
    stream: P,
    graph: P,
    deps: P,
    data: P,
    n: usize,
    mode: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(P, P, P, P, usize, c_int) -> c_int;
    capture_begins(stream, false, || {
        forward!(
            REAL_BEGIN_CAPTURE_GRAPH,
            c"cuStreamBeginCaptureToGraph",
            F,
            (stream, graph, deps, data, n, mode)
        )
    })
}

/// # Safety
/// `cuStreamBeginCaptureToGraph_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph_ptsz(
    stream: P,
    graph: P,
    deps: P,
    data: P,
    n: usize,
    mode: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(P, P, P, P, usize, c_int) -> c_int;
    capture_begins(stream, true, || {
        forward!(
            REAL_BEGIN_CAPTURE_GRAPH_PT,
            c"cuStreamBeginCaptureToGraph_ptsz",
            F,
            (stream, graph, deps, data, n, mode)
        )
    })
}

real_fn!(REAL_BEGIN_CAPTURE_CIG, c"cuStreamBeginCaptureToCig");
real_fn!(REAL_BEGIN_RECAPTURE, c"cuStreamBeginRecaptureToGraph");
real_fn!(REAL_END_CAPTURE_CIG, c"cuStreamEndCaptureToCig");

/// # Safety
/// `cuStreamBeginCaptureToCig`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToCig(stream: P, params: P) -> c_int {
    type F = unsafe extern "C" fn(P, P) -> c_int;
    capture_begins(stream, false, || {
        forward!(
            REAL_BEGIN_CAPTURE_CIG,
            c"cuStreamBeginCaptureToCig",
            F,
            (stream, params)
        )
    })
}

/// # Safety
/// `cuStreamBeginRecaptureToGraph`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginRecaptureToGraph(
    stream: P,
    mode: c_int,
    graph: P,
    callback: P,
    data: P,
) -> c_int {
    type F = unsafe extern "C" fn(P, c_int, P, P, P) -> c_int;
    capture_begins(stream, false, || {
        forward!(
            REAL_BEGIN_RECAPTURE,
            c"cuStreamBeginRecaptureToGraph",
            F,
            (stream, mode, graph, callback, data)
        )
    })
}

/// # Safety
/// `cuStreamEndCaptureToCig`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCaptureToCig(stream: P) -> c_int {
    type F = unsafe extern "C" fn(P) -> c_int;
    capture_ends(stream, false, || {
        forward!(
            REAL_END_CAPTURE_CIG,
            c"cuStreamEndCaptureToCig",
            F,
            (stream)
        )
    })
}

/// # Safety
/// `cuStreamEndCapture`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(stream: P, graph: *mut P) -> c_int {
    type F = unsafe extern "C" fn(P, *mut P) -> c_int;
    capture_ends(stream, false, || {
        forward!(REAL_END_CAPTURE, c"cuStreamEndCapture", F, (stream, graph))
    })
}

/// # Safety
/// `cuStreamEndCapture_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: P, graph: *mut P) -> c_int {
    type F = unsafe extern "C" fn(P, *mut P) -> c_int;
    capture_ends(stream, true, || {
        forward!(
            REAL_END_CAPTURE_PT,
            c"cuStreamEndCapture_ptsz",
            F,
            (stream, graph)
        )
    })
}

// ---- launches ----

type LaunchFn = apex_interpose::LaunchKernelFn;
type LaunchExFn = unsafe extern "C" fn(*const LaunchConfig, P, *mut P, *mut P) -> c_int;
type CoopFn = unsafe extern "C" fn(
    P,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    P,
    *mut P,
) -> c_int;

/// Takes the launch over, or forwards it ordered with APEX's queues (the refusal and the ordering under one lock).
fn launch(l: Launch, forward: impl FnOnce() -> c_int) -> c_int {
    if engine::disabled() {
        engine::count_disabled_launch();
        return forward();
    }
    // Before anything is attached, a launch the engine has granted goes straight to libcuda ([`engine::fast_forward`]).
    if engine::fast_forward(&l) {
        let r = engine::forward_on_credit(forward);
        engine::after_unordered(Site::Stream(l.stream, l.per_thread));
        return r;
    }
    let t0 = crate::profile::stamp();
    let Some(_g) = enter() else { return forward() };
    if let Some(e) = engine::sticky() {
        return e;
    }
    match engine::launch(&l, t0) {
        Ok(taken) => {
            crate::profile::tail(taken.finish());
            0
        }
        Err(Some(o)) => {
            let r = forward();
            engine::after(Site::Stream(l.stream, l.per_thread), o, false);
            r
        }
        Err(None) => {
            let r = forward();
            engine::after_unordered(Site::Stream(l.stream, l.per_thread));
            r
        }
    }
}

/// # Safety
/// `cuLaunchKernel`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: P,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: P,
    params: *mut P,
    extra: *mut P,
) -> c_int {
    let l = Launch {
        f: f as usize,
        grid: [gx, gy, gz],
        block: [bx, by, bz],
        shared,
        stream: stream as usize,
        per_thread: false,
        params,
        extra,
        extras: Ok(attrs::Extras::default()),
    };
    launch(l, || {
        forward!(
            REAL_LAUNCH,
            c"cuLaunchKernel",
            LaunchFn,
            (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        )
    })
}

/// # Safety
/// `cuLaunchKernel_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: P,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: P,
    params: *mut P,
    extra: *mut P,
) -> c_int {
    let l = Launch {
        f: f as usize,
        grid: [gx, gy, gz],
        block: [bx, by, bz],
        shared,
        stream: stream as usize,
        per_thread: true,
        params,
        extra,
        extras: Ok(attrs::Extras::default()),
    };
    launch(l, || {
        forward!(
            REAL_LAUNCH_PT,
            c"cuLaunchKernel_ptsz",
            LaunchFn,
            (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        )
    })
}

fn launch_ex(
    config: *const LaunchConfig,
    f: P,
    params: *mut P,
    extra: *mut P,
    per_thread: bool,
    forward: impl FnOnce() -> c_int,
) -> c_int {
    if config.is_null() {
        return forward();
    }
    if engine::disabled() {
        engine::count_disabled_launch();
        return forward();
    }
    // SAFETY: the driver reads the same configuration.
    let c = unsafe { &*config };
    // SAFETY: the configuration's attribute array, as the driver reads it.
    let extras = attrs::extras(unsafe { attrs::attributes(c) });
    let l = Launch {
        f: f as usize,
        grid: c.grid,
        block: c.block,
        shared: c.shared,
        stream: c.stream as usize,
        per_thread,
        params,
        extra,
        extras,
    };
    launch(l, forward)
}

/// # Safety
/// `cuLaunchKernelEx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: P,
    params: *mut P,
    extra: *mut P,
) -> c_int {
    launch_ex(config, f, params, extra, false, || {
        forward!(
            REAL_LAUNCH_EX,
            c"cuLaunchKernelEx",
            LaunchExFn,
            (config, f, params, extra)
        )
    })
}

/// # Safety
/// `cuLaunchKernelEx_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const LaunchConfig,
    f: P,
    params: *mut P,
    extra: *mut P,
) -> c_int {
    launch_ex(config, f, params, extra, true, || {
        forward!(
            REAL_LAUNCH_EX_PT,
            c"cuLaunchKernelEx_ptsz",
            LaunchExFn,
            (config, f, params, extra)
        )
    })
}

/// A `cuLaunchCooperativeKernel` is a `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_COOPERATIVE` set: taken over
/// as one (every block resident at once, the grid barrier APEX's), or forwarded ordered.
#[allow(clippy::too_many_arguments)]
fn cooperative(
    f: P,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: P,
    params: *mut P,
    per_thread: bool,
    forward: impl FnOnce() -> c_int,
) -> c_int {
    let l = Launch {
        f: f as usize,
        grid,
        block,
        shared,
        stream: stream as usize,
        per_thread,
        params,
        extra: std::ptr::null_mut(),
        extras: Ok(attrs::Extras {
            cooperative: true,
            ..attrs::Extras::default()
        }),
    };
    launch(l, forward)
}

/// # Safety
/// `cuLaunchCooperativeKernel`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: P,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: P,
    params: *mut P,
) -> c_int {
    cooperative(
        f,
        [gx, gy, gz],
        [bx, by, bz],
        shared,
        stream,
        params,
        false,
        || {
            forward!(
                REAL_COOP,
                c"cuLaunchCooperativeKernel",
                CoopFn,
                (f, gx, gy, gz, bx, by, bz, shared, stream, params)
            )
        },
    )
}

/// # Safety
/// `cuLaunchCooperativeKernel_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: P,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: P,
    params: *mut P,
) -> c_int {
    cooperative(
        f,
        [gx, gy, gz],
        [bx, by, bz],
        shared,
        stream,
        params,
        true,
        || {
            forward!(
                REAL_COOP_PT,
                c"cuLaunchCooperativeKernel_ptsz",
                CoopFn,
                (f, gx, gy, gz, bx, by, bz, shared, stream, params)
            )
        },
    )
}

// ---- how programs find the driver's functions ----

/// Every wrapper: the generated stream operations and the hand-written ones.
static HOOKS: OnceLock<Vec<Hook>> = OnceLock::new();

fn hooks() -> &'static [Hook] {
    HOOKS.get_or_init(|| {
        let mut v = generated();
        // Every hand-written wrapper up to cuLibraryUnload is handed out with the takeover off too (launches,
        // module loads and unloads, cuGetProcAddress); the ones after it are not.
        let mut when_off = true;
        let mut add = |symbol: &'static CStr,
                       base: &'static str,
                       per_thread: bool,
                       slot: &'static AtomicUsize,
                       ours: usize| {
            v.push(Hook {
                symbol,
                base: base.as_bytes(),
                per_thread,
                versioned: false,
                slot,
                ours,
                when_off,
            });
            // Module lookups (cuModuleGetFunction, cuLibraryGetKernel, cuKernelGetFunction, cuLibraryGetModule)
            // only feed the takeover: with it off they are libcuda's own. The CUDA runtime calls
            // cuKernelGetFunction on every cudaGetFuncBySymbol (NCCL: every collective).
            if symbol == c"cuLibraryUnload" {
                when_off = false;
            }
        };
        add(
            c"cuGetProcAddress_v2",
            "cuGetProcAddress_v2",
            false,
            &REAL_GPA_V2,
            cuGetProcAddress_v2 as *const () as usize,
        );
        add(
            c"cuGetProcAddress",
            "cuGetProcAddress",
            false,
            &REAL_GPA,
            cuGetProcAddress as *const () as usize,
        );
        add(
            c"cuLaunchKernel",
            "cuLaunchKernel",
            false,
            &REAL_LAUNCH,
            cuLaunchKernel as *const () as usize,
        );
        add(
            c"cuLaunchKernel_ptsz",
            "cuLaunchKernel",
            true,
            &REAL_LAUNCH_PT,
            cuLaunchKernel_ptsz as *const () as usize,
        );
        add(
            c"cuLaunchKernelEx",
            "cuLaunchKernelEx",
            false,
            &REAL_LAUNCH_EX,
            cuLaunchKernelEx as *const () as usize,
        );
        add(
            c"cuLaunchKernelEx_ptsz",
            "cuLaunchKernelEx",
            true,
            &REAL_LAUNCH_EX_PT,
            cuLaunchKernelEx_ptsz as *const () as usize,
        );
        add(
            c"cuLaunchCooperativeKernel",
            "cuLaunchCooperativeKernel",
            false,
            &REAL_COOP,
            cuLaunchCooperativeKernel as *const () as usize,
        );
        add(
            c"cuLaunchCooperativeKernel_ptsz",
            "cuLaunchCooperativeKernel",
            true,
            &REAL_COOP_PT,
            cuLaunchCooperativeKernel_ptsz as *const () as usize,
        );
        add(
            c"cuModuleLoad",
            "cuModuleLoad",
            false,
            &REAL_MODULE_LOAD,
            cuModuleLoad as *const () as usize,
        );
        add(
            c"cuModuleLoadData",
            "cuModuleLoadData",
            false,
            &REAL_MODULE_LOAD_DATA,
            cuModuleLoadData as *const () as usize,
        );
        add(
            c"cuModuleLoadDataEx",
            "cuModuleLoadDataEx",
            false,
            &REAL_MODULE_LOAD_DATA_EX,
            cuModuleLoadDataEx as *const () as usize,
        );
        add(
            c"cuModuleLoadFatBinary",
            "cuModuleLoadFatBinary",
            false,
            &REAL_MODULE_LOAD_FATBIN,
            cuModuleLoadFatBinary as *const () as usize,
        );
        add(
            c"cuLibraryLoadData",
            "cuLibraryLoadData",
            false,
            &REAL_LIBRARY_LOAD_DATA,
            cuLibraryLoadData as *const () as usize,
        );
        add(
            c"cuLibraryLoadFromFile",
            "cuLibraryLoadFromFile",
            false,
            &REAL_LIBRARY_LOAD_FILE,
            cuLibraryLoadFromFile as *const () as usize,
        );
        add(
            c"cuModuleUnload",
            "cuModuleUnload",
            false,
            &REAL_MODULE_UNLOAD,
            cuModuleUnload as *const () as usize,
        );
        add(
            c"cuLibraryUnload",
            "cuLibraryUnload",
            false,
            &REAL_LIBRARY_UNLOAD,
            cuLibraryUnload as *const () as usize,
        );
        add(
            c"cuModuleGetFunction",
            "cuModuleGetFunction",
            false,
            &REAL_MODULE_GET_FUNCTION,
            cuModuleGetFunction as *const () as usize,
        );
        add(
            c"cuLibraryGetKernel",
            "cuLibraryGetKernel",
            false,
            &REAL_LIBRARY_GET_KERNEL,
            cuLibraryGetKernel as *const () as usize,
        );
        add(
            c"cuKernelGetFunction",
            "cuKernelGetFunction",
            false,
            &REAL_KERNEL_GET_FUNCTION,
            cuKernelGetFunction as *const () as usize,
        );
        add(
            c"cuLibraryGetModule",
            "cuLibraryGetModule",
            false,
            &REAL_LIBRARY_GET_MODULE,
            cuLibraryGetModule as *const () as usize,
        );
        add(
            c"cuModuleGetGlobal_v2",
            "cuModuleGetGlobal",
            false,
            &REAL_MODULE_GET_GLOBAL,
            cuModuleGetGlobal_v2 as *const () as usize,
        );
        add(
            c"cuLibraryGetGlobal",
            "cuLibraryGetGlobal",
            false,
            &REAL_LIBRARY_GET_GLOBAL,
            cuLibraryGetGlobal as *const () as usize,
        );
        add(
            c"cuLibraryGetManaged",
            "cuLibraryGetManaged",
            false,
            &REAL_LIBRARY_GET_MANAGED,
            cuLibraryGetManaged as *const () as usize,
        );
        add(
            c"cuFuncSetAttribute",
            "cuFuncSetAttribute",
            false,
            &REAL_FUNC_SET_ATTRIBUTE,
            cuFuncSetAttribute as *const () as usize,
        );
        add(
            c"cuKernelSetAttribute",
            "cuKernelSetAttribute",
            false,
            &REAL_KERNEL_SET_ATTRIBUTE,
            cuKernelSetAttribute as *const () as usize,
        );
        add(
            c"cuCtxSetLimit",
            "cuCtxSetLimit",
            false,
            &REAL_CTX_SET_LIMIT,
            cuCtxSetLimit as *const () as usize,
        );
        add(
            c"cuStreamDestroy_v2",
            "cuStreamDestroy",
            false,
            &REAL_STREAM_DESTROY,
            cuStreamDestroy_v2 as *const () as usize,
        );
        add(
            c"cuStreamBeginCapture_v2",
            "cuStreamBeginCapture",
            false,
            &REAL_BEGIN_CAPTURE,
            cuStreamBeginCapture_v2 as *const () as usize,
        );
        add(
            c"cuStreamBeginCapture_v2_ptsz",
            "cuStreamBeginCapture",
            true,
            &REAL_BEGIN_CAPTURE_PT,
            cuStreamBeginCapture_v2_ptsz as *const () as usize,
        );
        add(
            c"cuStreamBeginCaptureToGraph",
            "cuStreamBeginCaptureToGraph",
            false,
            &REAL_BEGIN_CAPTURE_GRAPH,
            cuStreamBeginCaptureToGraph as *const () as usize,
        );
        add(
            c"cuStreamBeginCaptureToGraph_ptsz",
            "cuStreamBeginCaptureToGraph",
            true,
            &REAL_BEGIN_CAPTURE_GRAPH_PT,
            cuStreamBeginCaptureToGraph_ptsz as *const () as usize,
        );
        add(
            c"cuStreamEndCapture",
            "cuStreamEndCapture",
            false,
            &REAL_END_CAPTURE,
            cuStreamEndCapture as *const () as usize,
        );
        add(
            c"cuStreamEndCapture_ptsz",
            "cuStreamEndCapture",
            true,
            &REAL_END_CAPTURE_PT,
            cuStreamEndCapture_ptsz as *const () as usize,
        );
        add(
            c"cuStreamBeginCaptureToCig",
            "cuStreamBeginCaptureToCig",
            false,
            &REAL_BEGIN_CAPTURE_CIG,
            cuStreamBeginCaptureToCig as *const () as usize,
        );
        add(
            c"cuStreamBeginRecaptureToGraph",
            "cuStreamBeginRecaptureToGraph",
            false,
            &REAL_BEGIN_RECAPTURE,
            cuStreamBeginRecaptureToGraph as *const () as usize,
        );
        add(
            c"cuStreamEndCaptureToCig",
            "cuStreamEndCaptureToCig",
            false,
            &REAL_END_CAPTURE_CIG,
            cuStreamEndCaptureToCig as *const () as usize,
        );
        add(
            c"cuEventCreate",
            "cuEventCreate",
            false,
            &REAL_EVENT_CREATE,
            cuEventCreate as *const () as usize,
        );
        add(
            c"cuEventDestroy_v2",
            "cuEventDestroy",
            false,
            &REAL_EVENT_DESTROY,
            cuEventDestroy_v2 as *const () as usize,
        );
        add(
            c"cuEventSynchronize",
            "cuEventSynchronize",
            false,
            &REAL_EVENT_SYNCHRONIZE,
            cuEventSynchronize as *const () as usize,
        );
        add(
            c"cuEventQuery",
            "cuEventQuery",
            false,
            &REAL_EVENT_QUERY,
            cuEventQuery as *const () as usize,
        );
        add(
            c"cuEventElapsedTime",
            "cuEventElapsedTime",
            false,
            &REAL_EVENT_ELAPSED,
            cuEventElapsedTime as *const () as usize,
        );
        add(
            c"cuEventElapsedTime_v2",
            "cuEventElapsedTime",
            false,
            &REAL_EVENT_ELAPSED_V2,
            cuEventElapsedTime_v2 as *const () as usize,
        );
        add(
            c"cuIpcGetEventHandle",
            "cuIpcGetEventHandle",
            false,
            &REAL_IPC_EVENT_HANDLE,
            cuIpcGetEventHandle as *const () as usize,
        );
        memory::register(&mut v);
        v
    })
}

/// The wrapper for the exact symbol `name` (a `dlsym` lookup).
fn by_symbol(name: &[u8]) -> Option<&'static Hook> {
    hooks().iter().find(|h| h.symbol.to_bytes() == name)
}

/// The wrapper `cuGetProcAddress` should return instead of `real` for `base` (`per_thread`: the per-thread stream
/// variant was asked for). `Err` when the preload wraps `base` but `real` is a variant it does not know.
fn by_base(base: &[u8], real: usize, per_thread: bool) -> Result<Option<&'static Hook>, ()> {
    let all: Vec<&Hook> = hooks().iter().filter(|h| h.base == base).collect();
    if all.is_empty() {
        return Ok(None);
    }
    // Functions without a per-thread variant answer the same whatever the flag says.
    let wanted = if all.iter().any(|h| h.per_thread == per_thread) {
        per_thread
    } else {
        false
    };
    let candidates: Vec<&Hook> = all.into_iter().filter(|h| h.per_thread == wanted).collect();
    if candidates.iter().all(|h| !h.versioned) {
        return Ok(candidates.first().copied());
    }
    // Signatures differ between versions: take the variant only if it is the symbol the wrapper was written for.
    Ok(Some(
        candidates
            .into_iter()
            .find(|h| apex_interpose::libcuda_symbol(h.symbol) == Some(real))
            .ok_or(())?,
    ))
}

/// Interposed so that lookups of wrapped driver functions (`cuGetProcAddress_v2` first: how the CUDA runtime finds
/// the driver) return the wrappers.
///
/// # Safety
/// C `dlsym`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: forwarded unchanged.
    unsafe {
        apex_interpose::forward_dlsym(handle, name, |n, real| {
            // APEX's own lookups (made inside a hook) get libcuda's function: a wrapper's slot is shared with the
            // program's lookups, which may have stored another version of the function there.
            let _outer = enter()?;
            // CUPTI's activity switches: watched whatever the takeover does (a profiler turned on under
            // `APEX_PRELOAD=off` changes nothing, but costs nothing either).
            if let Some((slot, ours)) = crate::cupti::by_symbol(n) {
                return install(slot, real, ours);
            }
            let h = by_symbol(n).filter(|h| h.handed_out(engine::disabled()))?;
            install(h.slot, real, h.ours)
        })
    }
}

/// # Safety
/// As [`apex_interpose::replace_proc_address`].
unsafe fn replace(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    // SAFETY: forwarded.
    unsafe {
        apex_interpose::replace_proc_address(symbol, pfn, version, flags, |n, real, pt, _| {
            let off = engine::disabled();
            // With the takeover off most functions are libcuda's own: no variant check (a dlopen) for them.
            if off && !hooks().iter().any(|h| h.when_off && h.base == n) {
                return None;
            }
            match by_base(n, real, pt) {
                // Not handed out: the program calls libcuda's own function, at libcuda's cost.
                Ok(Some(h)) if !h.handed_out(off) => None,
                Ok(Some(h)) => install(h.slot, real, h.ours),
                Ok(None) => None,
                // Nothing is taken over with the takeover off: no variant can break an order.
                Err(()) if off => None,
                Err(()) => {
                    if let Some(_g) = enter() {
                        engine::unknown_entry(&String::from_utf8_lossy(n));
                    }
                    None
                }
            }
        })
    }
}

/// # Safety
/// `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    let r = forward!(
        REAL_GPA_V2,
        c"cuGetProcAddress_v2",
        GpaV2Fn,
        (symbol, pfn, version, flags, status)
    );
    if r == 0 {
        // SAFETY: the driver returned success for these arguments.
        unsafe { replace(symbol, pfn, version, flags) };
    }
    r
}

/// # Safety
/// `cuGetProcAddress` (CUDA 11 signature).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> c_int {
    let r = forward!(
        REAL_GPA,
        c"cuGetProcAddress",
        GpaFn,
        (symbol, pfn, version, flags)
    );
    if r == 0 {
        // SAFETY: the driver returned success for these arguments.
        unsafe { replace(symbol, pfn, version, flags) };
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a stream no queue relates to, only calls the engine would merely forward skip it: never one that answers
    /// or reports a failed assert of APEX's (synchronizations, queries, copies to the host), a graph's launch (kept
    /// events are recorded first), or the calls that keep the preload's books.
    #[test]
    fn only_calls_the_engine_would_merely_forward_skip_it() {
        use Kind::*;
        let alone = [
            Work,
            WaitEvent,
            EventRecord,
            CopyHtoDAsync,
            CopyAnyAsync,
            CopyDtoD,
            Set8,
            Set16,
            Set32,
        ];
        let engine = [
            WorkDone,
            Graph,
            StreamSync,
            StreamQuery,
            CtxSync,
            CtxSyncOf,
            CopyDtoHAsync,
            CopyDtoH,
            CopyHtoD,
            CopyAny,
            Device,
            Teardown,
        ];
        assert!(alone.iter().all(|k| k.forwards_alone()));
        assert!(engine.iter().all(|k| !k.forwards_alone()));
    }

    /// Before anything is attached, only the calls that keep the preload's own books (frees and unloads, a
    /// context's end) reach the engine; ordering, kept events, answers from fences and copies on queues need
    /// something of APEX's to exist.
    #[test]
    fn only_bookkeeping_calls_reach_the_engine_before_an_attach() {
        use Kind::*;
        let apex_only = [
            Work,
            WorkDone,
            WaitEvent,
            Graph,
            StreamSync,
            StreamQuery,
            EventRecord,
            CtxSync,
            CopyDtoHAsync,
            CopyHtoDAsync,
            CopyAnyAsync,
            CopyDtoH,
            CopyHtoD,
            CopyAny,
            CopyDtoD,
            Set8,
            Set16,
            Set32,
        ];
        assert!(apex_only.iter().all(|k| k.needs_apex_only()));
        assert!(!Device.needs_apex_only());
        assert!(!Teardown.needs_apex_only());
    }

    #[test]
    fn symbols_and_bases_are_consistent() {
        let all = hooks();
        let mut names = std::collections::BTreeSet::new();
        for h in all {
            assert!(names.insert(h.symbol.to_bytes()), "{:?} twice", h.symbol);
            let s = h.symbol.to_str().unwrap();
            assert!(s.starts_with(std::str::from_utf8(h.base).unwrap()), "{s}");
            assert_eq!(
                h.per_thread,
                s.ends_with("_ptsz") || s.ends_with("_ptds"),
                "{s}"
            );
            assert_ne!(h.ours, 0);
        }
        assert!(by_symbol(b"cuLaunchKernel").is_some());
        assert!(by_symbol(b"cuMemcpyHtoDAsync_v2").is_some());
        // Allocations need no ordering, but the preload's allocation cache serves them.
        assert!(by_symbol(b"cuMemAlloc_v2").is_some_and(|h| h.versioned));
        assert!(by_symbol(b"cuMemAllocPitch_v2").is_some_and(|h| h.versioned));
        assert!(by_symbol(b"cuMemAllocManaged").is_none());
    }

    /// Every driver function of CUDA 13 that puts work on a stream (or begins or ends a capture) is wrapped, so the
    /// engine knows what libcuda holds: a context synchronize skips libcuda only when nothing went there.
    #[test]
    fn every_stream_work_entry_point_is_wrapped() {
        const STREAM_WORK: &[&str] = &[
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuLaunchCooperativeKernel",
            "cuLaunchHostFunc",
            "cuLaunchGridAsync",
            "cuStreamAddCallback",
            "cuStreamWaitEvent",
            "cuEventRecord",
            "cuEventRecordWithFlags",
            "cuStreamWaitValue32",
            "cuStreamWaitValue64",
            "cuStreamWriteValue32",
            "cuStreamWriteValue64",
            "cuStreamBatchMemOp",
            "cuGraphLaunch",
            "cuGraphUpload",
            "cuMemcpyAsync",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpyDtoDAsync_v2",
            "cuMemcpy2DAsync_v2",
            "cuMemcpy3DAsync_v2",
            "cuMemcpy3DPeerAsync",
            "cuMemcpyPeerAsync",
            "cuMemcpyHtoAAsync_v2",
            "cuMemcpyAtoHAsync_v2",
            "cuMemcpyBatchAsync_v2",
            "cuMemcpy3DBatchAsync_v2",
            "cuMemcpyWithAttributesAsync",
            "cuMemcpy3DWithAttributesAsync",
            "cuMemsetD8Async",
            "cuMemsetD16Async",
            "cuMemsetD32Async",
            "cuMemsetD2D8Async",
            "cuMemsetD2D16Async",
            "cuMemsetD2D32Async",
            "cuMemAllocAsync",
            "cuMemAllocFromPoolAsync",
            "cuMemFreeAsync",
            "cuMemPrefetchAsync_v2",
            "cuMemPrefetchBatchAsync",
            "cuMemDiscardBatchAsync",
            "cuMemDiscardAndPrefetchBatchAsync",
            "cuMemBatchDecompressAsync",
            "cuMemMapArrayAsync",
            "cuStreamAttachMemAsync",
            "cuSignalExternalSemaphoresAsync",
            "cuWaitExternalSemaphoresAsync",
            "cuGraphicsMapResources",
            "cuGraphicsUnmapResources",
            "cuStreamBeginCapture_v2",
            "cuStreamBeginCaptureToGraph",
            "cuStreamBeginCaptureToCig",
            "cuStreamBeginRecaptureToGraph",
            "cuStreamEndCapture",
            "cuStreamEndCaptureToCig",
            "cuStreamSynchronize",
            "cuStreamQuery",
        ];
        for name in STREAM_WORK {
            assert!(
                by_symbol(name.as_bytes()).is_some(),
                "{name} is not wrapped"
            );
        }
    }

    /// With `APEX_PRELOAD=off` the program gets libcuda's own functions for everything but launches (still
    /// counted), module loads and unloads, and `cuGetProcAddress`: a forwarded call then costs what libcuda's does.
    #[test]
    fn with_the_takeover_off_only_launches_and_module_loads_are_handed_out() {
        let off: Vec<&str> = hooks()
            .iter()
            .filter(|h| h.handed_out(true))
            .map(|h| h.symbol.to_str().unwrap())
            .collect();
        for name in [
            "cuGetProcAddress_v2",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuLaunchKernelEx_ptsz",
            "cuLaunchCooperativeKernel",
            "cuModuleLoadData",
            "cuLibraryLoadData",
            "cuLibraryUnload",
        ] {
            assert!(off.contains(&name), "{name} is not handed out");
        }
        for name in [
            "cuModuleGetFunction",
            "cuLibraryGetKernel",
            "cuKernelGetFunction",
            "cuLibraryGetModule",
            "cuEventRecord",
            "cuEventRecordWithFlags",
            "cuStreamWaitEvent",
            "cuEventQuery",
            "cuEventCreate",
            "cuStreamSynchronize",
            "cuMemcpyAsync",
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemAllocAsync",
            "cuMemFreeAsync_ptsz",
            "cuMemPoolTrimTo",
            "cuModuleGetGlobal_v2",
            "cuStreamBeginCapture_v2",
            "cuCtxSynchronize",
        ] {
            assert!(
                !off.contains(&name),
                "{name} is handed out with the takeover off"
            );
        }
        assert!(
            hooks().iter().all(|h| h.handed_out(false)),
            "with it on, every wrapper is"
        );
    }

    #[test]
    fn proc_address_picks_the_per_thread_variant_when_it_exists() {
        let h = by_base(b"cuMemcpyAsync", 1, true).unwrap().unwrap();
        assert_eq!(h.symbol, c"cuMemcpyAsync_ptsz");
        let h = by_base(b"cuMemcpyAsync", 1, false).unwrap().unwrap();
        assert_eq!(h.symbol, c"cuMemcpyAsync");
        // No per-thread variant: the flag does not matter.
        let h = by_base(b"cuMemFree", 1, true).unwrap().unwrap();
        assert_eq!(h.symbol, c"cuMemFree_v2");
        assert!(by_base(b"cuModuleGetTexRef", 1, false).unwrap().is_none());
    }

    /// The stream-ordered allocator's entry points are the cache's, in both stream forms; the pool calls that let the
    /// cache give back are wrapped too, and cuMemAllocFromPoolAsync (an explicit pool) only ordered.
    #[test]
    fn stream_ordered_allocations_are_wrapped_in_both_stream_forms() {
        for (base, pt, symbol) in [
            ("cuMemAllocAsync", false, c"cuMemAllocAsync"),
            ("cuMemAllocAsync", true, c"cuMemAllocAsync_ptsz"),
            ("cuMemFreeAsync", false, c"cuMemFreeAsync"),
            ("cuMemFreeAsync", true, c"cuMemFreeAsync_ptsz"),
            (
                "cuMemAllocFromPoolAsync",
                true,
                c"cuMemAllocFromPoolAsync_ptsz",
            ),
            ("cuDeviceSetMemPool", true, c"cuDeviceSetMemPool"),
            ("cuMemPoolTrimTo", false, c"cuMemPoolTrimTo"),
            ("cuMemPoolGetAttribute", false, c"cuMemPoolGetAttribute"),
        ] {
            let h = by_base(base.as_bytes(), 1, pt).unwrap().unwrap();
            assert_eq!(h.symbol, symbol);
            assert_eq!(by_symbol(symbol.to_bytes()).unwrap().ours, h.ours);
        }
    }

    #[test]
    fn versioned_signatures_are_refused_unless_the_variant_is_known() {
        // Without libcuda loaded nothing can be matched: the preload must not guess a signature.
        assert!(by_base(b"cuCtxSynchronize", 0x1234, false).is_err());
        assert!(by_base(b"cuLaunchHostFunc", 0x1234, true).is_err());
    }
}
