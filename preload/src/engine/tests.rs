//! The engine's bookkeeping against the simulated GPU: APEX's side is a real [`apex::Gpu`] on the simulator (queues,
//! prepared launches, fences the simulated front end releases), the CUDA side a double that records what the engine
//! asked of libcuda. Each test checks what went through APEX, which hops were made, and which synchronizations were
//! answered without libcuda.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering as AtomicOrdering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use apex::module::cubin::Cubin;
use apex::rm::sim::SimConfig;
use apex::sim::Simulator;
use apex::{AssertFailure, Gpu, Queue, VariableHome};

use super::*;

const CUBIN: &[u8] = include_bytes!("../../../kernels/apex_test_kernels.sm_90.cubin");
const CTX: usize = 0xc0;
const MODULE: usize = 0x10;
const FUNC: usize = 0x100;
const EVENT: usize = 0xe0;
/// Stream handles from here on are non-blocking.
const NON_BLOCKING: usize = 0x100_0000;
/// A non-blocking stream of another context, never attached.
const FOREIGN: usize = NON_BLOCKING + 0xf000;
const FOREIGN_CTX: usize = 0xf0;
/// A non-blocking stream APEX never takes over in the tests that use it.
const QUIET_OTHER: Site = Site::Stream(NON_BLOCKING + 0x3000, false);
/// A non-blocking stream whose libcuda side is never idle.
const BUSY: usize = NON_BLOCKING + 0xb000;
/// A non-blocking stream on which libcuda refuses every wait for APEX's queue.
const NOHOP: usize = NON_BLOCKING + 0xd000;
/// A non-blocking stream made with a priority above the default.
const PRIORITY: usize = NON_BLOCKING + 0xe000;

/// What the engine asked of "libcuda".
#[derive(Default)]
struct Calls(Vec<String>);

/// Holds the double's attach while closed, as a slow attach would (open by default).
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn close(&self) {
        *self.closed.lock().unwrap() = true;
    }
    fn open(&self) {
        *self.closed.lock().unwrap() = false;
        self.opened.notify_all();
    }
    /// Waits while closed (at most 30 s, so that a test that forgets to open it fails rather than hangs).
    fn pass(&self) {
        let closed = self.closed.lock().unwrap();
        let (_closed, timeout) = self
            .opened
            .wait_timeout_while(closed, Duration::from_secs(30), |c| *c)
            .unwrap();
        assert!(!timeout.timed_out(), "the gate was never opened");
    }
}

/// What the double's `set_current` was asked, on which thread (by name), in order.
type MadeCurrent = Arc<Mutex<Vec<(String, Option<usize>)>>>;

thread_local! {
    /// The context the double's `set_current` made current on this thread (`None` inside: none).
    static CURRENT: Cell<Option<Option<usize>>> = const { Cell::new(None) };
}

struct FakeCuda {
    gpu: Mutex<Option<Gpu>>,
    calls: Arc<Mutex<Calls>>,
    /// Address ranges that play CUDA's device memory (start, bytes).
    device: Arc<Mutex<Vec<(u64, u64)>>>,
    /// The attach passes it first.
    gate: Arc<Gate>,
    /// Every job of the set-up worker passes it first (when it makes the job's context current).
    jobs: Arc<Gate>,
    /// The attach fails with this.
    fail_attach: Option<String>,
    /// What `set_current` was asked, on which thread, in order.
    made_current: MadeCurrent,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` of every function (48 KiB, CUDA's default, until a test
    /// raises it as the program's `cuFuncSetAttribute` would).
    dynamic_shared: Arc<AtomicU32>,
    /// The context was made with `CU_CTX_SCHED_BLOCKING_SYNC` (as `cudaDeviceScheduleBlockingSync` makes it).
    sleeps: Arc<AtomicBool>,
    /// Sleeping events made so far.
    sleeping_events: AtomicU32,
    /// Streams of the preload's own made so far (by `record_event_after`).
    side_streams: AtomicU32,
}

/// The double's streams of the preload's own are numbered from here.
const SIDE_STREAMS: usize = 0x51_0000;

/// The double's sleeping events are numbered from here.
const SLEEPING_EVENTS: usize = 0x5e_0000;

impl FakeCuda {
    fn new(gpu: Gpu) -> FakeCuda {
        FakeCuda {
            gpu: Mutex::new(Some(gpu)),
            calls: Arc::default(),
            device: Arc::default(),
            gate: Arc::default(),
            jobs: Arc::default(),
            fail_attach: None,
            made_current: Arc::default(),
            dynamic_shared: Arc::new(AtomicU32::new(48 << 10)),
            sleeps: Arc::default(),
            sleeping_events: AtomicU32::new(0),
            side_streams: AtomicU32::new(0),
        }
    }

    fn log(&self, s: impl Into<String>) {
        self.calls.lock().unwrap().0.push(s.into());
    }
}

impl CudaSide for FakeCuda {
    fn current_context(&self) -> Option<usize> {
        // The program's threads have CTX current; the set-up worker only what it made current itself.
        let worker = std::thread::current().name() == Some("apex-setup");
        CURRENT.get().unwrap_or_else(|| (!worker).then_some(CTX))
    }
    fn set_current(&self, ctx: Option<usize>) -> Result<(), String> {
        if ctx.is_some() {
            self.jobs.pass();
        }
        let thread = std::thread::current().name().unwrap_or("").to_string();
        self.made_current.lock().unwrap().push((thread, ctx));
        CURRENT.set(Some(ctx));
        Ok(())
    }
    fn attach(&self) -> Result<(Gpu, bool), String> {
        self.gate.pass();
        // Attaching looks at the calling thread's current context.
        if self.current_context() != Some(CTX) {
            return Err("no context current on the attaching thread".into());
        }
        if let Some(e) = &self.fail_attach {
            return Err(e.clone());
        }
        let gpu = self.gpu.lock().unwrap().take().ok_or("attached twice")?;
        let asserts = gpu.set_assert_action(apex::AssertAction::EndThread).is_ok();
        Ok((gpu, asserts))
    }
    fn stream_blocking(&self, stream: usize) -> bool {
        // Streams at NON_BLOCKING and above were made with CU_STREAM_NON_BLOCKING (as NCCL's and PyTorch's are).
        stream < NON_BLOCKING
    }
    fn stream_priority(&self, stream: usize) -> i32 {
        // PRIORITY was made with a high priority (as cudaStreamCreateWithPriority makes one).
        if stream == PRIORITY { -2 } else { 0 }
    }
    fn stream_context(&self, stream: usize) -> Option<usize> {
        // Every stream is CTX's, but FOREIGN, of a context APEX never attached to.
        Some(if stream == FOREIGN { FOREIGN_CTX } else { CTX })
    }
    fn function_name(&self, _: usize) -> Option<String> {
        None
    }
    fn max_dynamic_shared(&self, _: usize) -> Option<u32> {
        Some(self.dynamic_shared.load(AtomicOrdering::Relaxed))
    }
    fn function_owner(&self, _: usize, _: &dyn Fn(usize) -> bool) -> Option<usize> {
        None
    }
    fn global(&self, _: Owner, _: bool, _: &str) -> Option<VariableHome> {
        None
    }
    fn cuda_waits_for_apex(&self, _: &mut Queue, stream: StreamKey) -> Result<(), String> {
        if stream == StreamKey::Handle(NOHOP) {
            return Err("refused".into());
        }
        self.log(format!("cuda<-apex {stream:?}"));
        Ok(())
    }
    fn release_for_cuda(&self, _: &mut Queue) -> Result<ReleaseMark, String> {
        self.log("release".to_string());
        Ok(ReleaseMark(None))
    }
    fn cuda_waits_for_release(
        &self,
        _: &mut Queue,
        stream: StreamKey,
        _: ReleaseMark,
    ) -> Result<(), String> {
        if stream == StreamKey::Handle(NOHOP) {
            return Err("refused".into());
        }
        self.log(format!("cuda<-release {stream:?}"));
        Ok(())
    }
    fn stream_idle(&self, stream: usize) -> bool {
        stream != BUSY
    }
    fn apex_waits_for_cuda(&self, _: &mut Queue, stream: StreamKey) -> Result<(), String> {
        self.log(format!("apex<-cuda {stream:?}"));
        Ok(())
    }
    fn record_event_after(
        &self,
        _: usize,
        _: &mut Queue,
        event: usize,
        side: &mut usize,
    ) -> Result<(), String> {
        // The stream is made at its first use, as libcuda's would be.
        if *side == 0 {
            *side = SIDE_STREAMS + self.side_streams.fetch_add(1, AtomicOrdering::Relaxed) as usize;
        }
        self.log(format!("record after {event:#x}"));
        Ok(())
    }
    fn record_event_now(&self, _: usize, event: usize, _: &mut usize) -> Result<(), String> {
        self.log(format!("record now {event:#x}"));
        Ok(())
    }
    fn replay_asserts(&self, _: usize, failures: &[AssertFailure]) -> Result<(), String> {
        self.log(format!("replay {}", failures.len()));
        Ok(())
    }
    fn sleeps_while_waiting(&self, ctx: usize) -> bool {
        ctx == CTX && self.sleeps.load(AtomicOrdering::Relaxed)
    }
    fn sleeping_event(&self, ctx: usize) -> Result<usize, String> {
        assert_eq!(ctx, CTX);
        let event =
            SLEEPING_EVENTS + self.sleeping_events.fetch_add(1, AtomicOrdering::Relaxed) as usize;
        self.log(format!("sleeping event {event:#x}"));
        Ok(event)
    }
    fn sleep_on_event(&self, event: usize) -> Result<(), String> {
        self.log(format!("sleep on {event:#x}"));
        Ok(())
    }
    fn pointer(&self, ptr: u64, ctx: usize) -> crate::cuda::Pointer {
        assert_eq!(ctx, CTX);
        let device = self.device.lock().unwrap();
        match device.iter().find(|&&(a, n)| ptr >= a && ptr < a + n) {
            Some(&(a, n)) => crate::cuda::Pointer::Device { bytes: a + n - ptr },
            None => crate::cuda::Pointer::Pageable,
        }
    }
}

struct Setup {
    engine: Engine,
    sim: Simulator,
    calls: Arc<Mutex<Calls>>,
    device: Arc<Mutex<Vec<(u64, u64)>>>,
    /// The double's attach waits while it is closed.
    gate: Arc<Gate>,
    /// The set-up worker's jobs wait while it is closed.
    jobs: Arc<Gate>,
    made_current: MadeCurrent,
    /// The double's answer to `max_dynamic_shared`.
    dynamic_shared: Arc<AtomicU32>,
    /// The double's answer to `sleeps_while_waiting`.
    sleeps: Arc<AtomicBool>,
    /// Parameter values of vector_add: a, b, out, n.
    params: [u64; 4],
}

/// A launch of the test kernel on the legacy stream with no arguments given yet.
fn bare_launch() -> Launch {
    Launch {
        f: FUNC,
        grid: [1, 1, 1],
        block: [64, 1, 1],
        shared: 0,
        stream: 0,
        per_thread: false,
        params: std::ptr::null_mut(),
        extra: std::ptr::null_mut(),
        extras: Ok(Extras::default()),
    }
}

/// Records the test cubin as module `MODULE` and its `vector_add` kernel as function `FUNC`, as the program's
/// loads would.
fn register_test_kernel(engine: &mut Engine) {
    engine.loaded(MODULE, Ok(ImageBytes::Owned(CUBIN.into())), false);
    let cubin = Cubin::parse(CUBIN).unwrap();
    let name = cubin
        .kernels()
        .iter()
        .find(|k| k.name.contains("vector_add"))
        .unwrap()
        .name
        .clone();
    engine.function(FUNC, MODULE, &name);
}

impl Setup {
    /// A setup that makes what a launch needs on the spot (`APEX_PRELOAD_SETUP=inline`): every launch through APEX
    /// from the first.
    fn new() -> Setup {
        Setup::with(false, Mode::Inline, None)
    }

    /// A setup whose queues are chained queues (`APEX_PRELOAD_CHAINED`) when `chained`.
    fn with_chained(chained: bool) -> Setup {
        Setup::with(chained, Mode::Inline, None)
    }

    /// A setup whose attach, queues and modules are made by the set-up worker (the default mode); the attach
    /// fails with `fail_attach`.
    fn background(fail_attach: Option<&str>) -> Setup {
        Setup::with(false, Mode::Background, fail_attach)
    }

    fn with(chained: bool, setup: Mode, fail_attach: Option<&str>) -> Setup {
        Setup::build(chained, setup, fail_attach, Policy::First)
    }

    /// An inline setup whose streams are taken over by `policy` (`APEX_PRELOAD_TAKEOVER`).
    fn with_takeover(policy: Policy) -> Setup {
        Setup::build(false, Mode::Inline, None, policy)
    }

    fn build(chained: bool, setup: Mode, fail_attach: Option<&str>, takeover: Policy) -> Setup {
        let (gpu, sim) = Gpu::open_simulated(SimConfig::default()).unwrap();
        let mut cuda = FakeCuda::new(gpu);
        cuda.fail_attach = fail_attach.map(str::to_string);
        let (calls, device, gate, jobs, made_current, dynamic_shared) = (
            cuda.calls.clone(),
            cuda.device.clone(),
            cuda.gate.clone(),
            cuda.jobs.clone(),
            cuda.made_current.clone(),
            cuda.dynamic_shared.clone(),
        );
        let sleeps = cuda.sleeps.clone();
        let config = Config {
            off: None,
            max_queues: 8,
            stats: None,
            launch_memory: LaunchMemory::Video,
            chained,
            setup,
            // The tests of the background set-up check the queue kept ahead; the default (0) has its own test.
            queues_ahead: 1,
            // `First` for most tests (every launch through APEX from the first); the default policy has its own.
            takeover,
        };
        let mut engine = Engine::new(config, Box::new(cuda));
        register_test_kernel(&mut engine);
        Setup {
            engine,
            sim,
            calls,
            device,
            gate,
            jobs,
            made_current,
            dynamic_shared,
            sleeps,
            params: [0x1000, 0x2000, 0x3000, 64],
        }
    }

    fn launch_on(&mut self, stream: usize, grid: u32) -> bool {
        let mut ptrs: Vec<*mut c_void> = self
            .params
            .iter_mut()
            .map(|p| (p as *mut u64).cast())
            .collect();
        let l = Launch {
            grid: [grid, 1, 1],
            stream,
            params: ptrs.as_mut_ptr(),
            ..bare_launch()
        };
        self.engine.launch(&l, 0).is_some()
    }

    fn launch(&mut self) -> bool {
        self.launch_on(0, 1)
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.calls.lock().unwrap().0)
    }

    /// Waits until every queue's last launch is complete, behind the engine's back (its state is not updated).
    fn idle(&self) {
        for ctx in &self.engine.contexts {
            for slot in ctx.order.slots() {
                if let Some(f) = ctx.last_fence(slot) {
                    assert!(
                        f.unwrap().wait(Duration::from_secs(10)).is_ok(),
                        "the simulated GPU did not complete the launch"
                    );
                }
            }
        }
    }
}

const LEGACY: Site = Site::Stream(0, false);

/// A synchronize of the legacy stream that must reach libcuda: the epoch it returns.
fn forwarded_stream_sync(s: &mut Setup) -> u64 {
    let Step::Wait(w) = s.engine.stream_sync_begin(LEGACY, SyncKind::Wait) else {
        panic!("the queue's work is waited for first");
    };
    let waited = w.wait();
    let (answer, epoch) = s.engine.stream_sync_end(LEGACY, &w, &waited);
    assert_eq!(answer, Answer::Forward);
    assert_ne!(epoch, 0);
    epoch
}

/// A context synchronize that must reach libcuda: the epoch it returns.
fn forwarded_context_sync(s: &mut Setup) -> CtxMark {
    let Step::Wait(w) = s.engine.context_sync_begin() else {
        panic!("the queues' work is waited for first");
    };
    let waited = w.wait();
    let (answer, epoch) = s.engine.context_sync_end(&w, &waited);
    assert_eq!(answer, Answer::Forward);
    epoch
}

#[test]
fn a_launch_goes_to_the_gpu_and_a_synchronize_right_after_it_needs_no_libcuda() {
    let mut s = Setup::new();
    let before = s.sim.launches().len();
    assert!(s.launch());
    assert!(
        s.sim
            .wait_for(Duration::from_secs(10), |m| m.launches().len()
                == before + 1),
        "the simulated GPU ran the launch"
    );
    let l = s.sim.launches().last().cloned().unwrap();
    assert_eq!((l.grid, l.block), ([1, 1, 1], [64, 1, 1]));
    // The stream may have had CUDA work before it was taken over: one hop, before the first launch only.
    assert_eq!(s.calls(), vec!["apex<-cuda Legacy"]);
    assert!(s.launch());
    assert!(s.calls().is_empty(), "back-to-back launches make no hop");
    // Its doorbell was rung before the engine returned (the launch recorded deferred, then flushed once the launch
    // call had returned): the GPU runs it with no other call.
    assert!(
        s.sim
            .wait_for(Duration::from_secs(10), |m| m.launches().len()
                == before + 2),
        "the second launch was left unsent"
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Query),
        Answer::Done(0)
    );
    assert!(s.calls().is_empty(), "answered from APEX's fence");
    let sum = s.engine.summary();
    assert_eq!((sum.apex, sum.syncs_on_cpu, sum.syncs_forwarded), (2, 2, 0));
}

#[test]
fn cuda_work_after_a_launch_is_waited_for_by_libcuda_and_needs_no_hop_once_synchronized() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.idle();
    s.calls();
    // A copy on the stream (cudaMemcpyAsync): the queue's launch is complete, so CUDA waits for nothing.
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    assert!(
        s.calls().is_empty(),
        "no hop before CUDA work when APEX's is done"
    );
    assert_eq!(s.engine.summary().hops_avoided, 1);
    // The synchronize must reach libcuda (CUDA has work of its own); the queue's work is waited for on the CPU.
    let epoch = forwarded_stream_sync(&mut s);
    s.engine.stream_synced(LEGACY, 0, epoch);
    // Once libcuda said the stream is done, the next launch waits for nothing.
    assert!(s.launch());
    assert!(s.calls().is_empty(), "{:?}", s.calls());
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    // Without the synchronize, the next launch waits for the stream on the GPU.
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    assert!(s.launch());
    assert_eq!(s.calls(), vec!["apex<-cuda Legacy"]);
}

#[test]
fn a_failed_synchronize_leaves_the_stream_dirty() {
    let mut s = Setup::new();
    assert!(s.launch());
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    let epoch = forwarded_stream_sync(&mut s);
    s.engine.stream_synced(LEGACY, 700, epoch);
    s.calls();
    assert!(s.launch());
    assert_eq!(s.calls(), vec!["apex<-cuda Legacy"]);
}

#[test]
fn a_synchronous_copy_to_the_host_completes_the_stream() {
    let mut s = Setup::new();
    assert!(s.launch());
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, true);
    s.calls();
    assert!(s.launch());
    assert!(s.calls().is_empty());
}

#[test]
fn a_query_of_running_work_says_not_ready_without_libcuda() {
    let mut s = Setup::new();
    // The queue exists (making one waits for the GPU); then the GPU stops.
    assert!(s.launch());
    s.idle();
    s.sim.pause();
    assert!(s.launch());
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Query),
        Answer::Done(CUDA_ERROR_NOT_READY)
    );
    s.sim.resume();
    s.idle();
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Query),
        Answer::Done(0)
    );
}

#[test]
fn a_context_synchronize_reaches_libcuda_only_when_cuda_had_work() {
    let mut s = Setup::new();
    assert!(s.launch());
    // Attaching may follow CUDA work nobody synchronized: the first one goes to libcuda.
    let epoch = forwarded_context_sync(&mut s);
    s.engine.context_synced(0, epoch);
    assert!(s.launch());
    assert_eq!(s.engine.context_sync(), Answer::Done(0));
    // A launch left to libcuda (or any CUDA work) makes the next one go to libcuda again.
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    let epoch = forwarded_context_sync(&mut s);
    s.engine.context_synced(0, epoch);
    // After it, the stream needs no hop.
    s.calls();
    assert!(s.launch());
    assert!(s.calls().is_empty());
}

#[test]
fn an_untimed_event_after_apex_work_is_kept_and_recorded_in_libcuda_only_when_read() {
    let mut s = Setup::new();
    let stream = Site::Stream(0x5000, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    s.calls();
    assert_eq!(s.engine.event_record(EVENT, stream), Answer::Done(0));
    assert_eq!(s.engine.event_sync(EVENT, SyncKind::Wait), Answer::Done(0));
    assert_eq!(s.engine.event_sync(EVENT, SyncKind::Query), Answer::Done(0));
    assert!(s.calls().is_empty(), "no libcuda call for a kept event");
    // A stream waits for it: libcuda records it now (the work is complete, so with nothing before it).
    s.engine.materialize(EVENT, "cuEventElapsedTime");
    assert_eq!(s.calls(), vec!["record now 0xe0"]);
    // Recorded in libcuda now: libcuda answers from here on.
    assert_eq!(s.engine.event_sync(EVENT, SyncKind::Wait), Answer::Forward);
    let sum = s.engine.summary();
    assert_eq!((sum.events_on_apex, sum.events_materialized), (1, 1));
    assert_eq!(
        sum.events_materialized_for.get("cuEventElapsedTime"),
        Some(&1),
        "counted by what needed it"
    );
}

#[test]
fn a_kept_event_of_running_work_is_recorded_after_the_queue() {
    let mut s = Setup::new();
    let stream = Site::Stream(0x5000, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    s.calls();
    assert_eq!(s.engine.event_record(EVENT, stream), Answer::Done(0));
    assert_eq!(
        s.engine.event_sync(EVENT, SyncKind::Query),
        Answer::Done(CUDA_ERROR_NOT_READY)
    );
    s.engine.materialize(EVENT, "cuEventElapsedTime");
    assert_eq!(s.calls(), vec!["record after 0xe0"]);
    s.sim.resume();
}

#[test]
fn a_cuda_stream_waits_for_a_kept_event_without_libcuda_recording_it() {
    let mut s = Setup::new();
    let apex = Site::Stream(0x5000, false);
    let cuda = Site::Stream(0x6000, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    // Complete: nothing to wait for, no libcuda call.
    assert_eq!(s.engine.event_record(EVENT, apex), Answer::Done(0));
    s.calls();
    assert_eq!(
        s.engine.wait_cuda_on_kept(EVENT, cuda, "cuStreamWaitEvent"),
        Some(CUDA_SUCCESS)
    );
    assert!(s.calls().is_empty());
    assert_eq!(s.engine.summary().hops_avoided, 1);
    // Running, and all of its queue's work: the stream waits for a release of the queue, one call.
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, apex), Answer::Done(0));
    s.calls();
    assert_eq!(
        s.engine.wait_cuda_on_kept(EVENT, cuda, "cuStreamWaitEvent"),
        Some(CUDA_SUCCESS)
    );
    assert_eq!(s.calls(), vec!["cuda<-apex Handle(24576)"]);
    assert_eq!(s.engine.summary().events_materialized, 0, "still kept");
    // Work sent on the queue after the record: the stream must not wait for it; libcuda records the event.
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(
        s.engine.wait_cuda_on_kept(EVENT, cuda, "cuStreamWaitEvent"),
        None
    );
    // A stream taken over waits on APEX instead.
    assert_eq!(
        s.engine.wait_cuda_on_kept(EVENT, apex, "cuStreamWaitEvent"),
        None
    );
    s.sim.resume();
    s.idle();
}

/// A launch of the test kernel with `params` on `stream` (`per_thread`: through a `_ptsz` entry point).
fn launch_with(
    engine: &mut Engine,
    params: &mut [u64; 4],
    stream: usize,
    per_thread: bool,
) -> bool {
    let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(|p| (p as *mut u64).cast()).collect();
    let l = Launch {
        stream,
        per_thread,
        params: ptrs.as_mut_ptr(),
        ..bare_launch()
    };
    engine.launch(&l, 0).is_some()
}

/// A cooperative launch (`cuLaunchCooperativeKernel`, or `cuLaunchKernelEx` with the attribute) runs on APEX, never
/// as a prepared launch; one whose grid cannot be resident at once is refused before the GPU (libcuda then refuses it
/// as it does).
#[test]
fn cooperative_launches_run_on_apex_and_too_large_grids_are_refused() {
    let mut s = Setup::new();
    let mut params = s.params;
    let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(|p| (p as *mut u64).cast()).collect();
    let launch = |grid: u32, ptrs: &mut Vec<*mut c_void>| Launch {
        grid: [grid, 1, 1],
        params: ptrs.as_mut_ptr(),
        extras: Ok(Extras {
            cooperative: true,
            ..Extras::default()
        }),
        ..bare_launch()
    };
    assert!(s.engine.launch(&launch(4, &mut ptrs), 0).is_some());
    assert!(s.engine.launch(&launch(4, &mut ptrs), 0).is_some());
    let sum = s.engine.summary();
    assert_eq!((sum.apex, sum.prepared_shapes), (2, 0));
    assert!(s.engine.launch(&launch(1 << 24, &mut ptrs), 0).is_none());
    let sum = s.engine.summary();
    assert_eq!(
        sum.reasons["launch_refused"].launches, 1,
        "{:?}",
        sum.reasons
    );
    s.idle();
}

/// Each thread's per-thread default stream is taken over as a stream of its own (named by 0 on a `_ptsz` entry point
/// or by `CU_STREAM_PER_THREAD`, the same stream), ordered with the legacy stream as CUDA orders it: a libcuda
/// operation on the legacy stream hands both threads' queues over, and each queue waits for the legacy stream's work
/// before its next launch.
#[test]
fn each_threads_default_stream_is_taken_over_as_a_stream_of_its_own() {
    let mut s = Setup::new();
    let mut params = s.params;
    // Each thread's queue is built at its first launch (which waits for the simulated GPU); a second launch on each
    // is left running.
    let here = crate::order::StreamKey::PerThread(crate::order::thread_serial());
    assert!(launch_with(&mut s.engine, &mut params, 0, true));
    let there = std::thread::scope(|scope| {
        let other = scope.spawn(|| {
            let ok = launch_with(&mut s.engine, &mut params, 0, true);
            assert!(ok, "{:?}", s.engine.summary().reasons);
            s.sim.pause();
            assert!(launch_with(&mut s.engine, &mut params, 0, true));
            crate::order::StreamKey::PerThread(crate::order::thread_serial())
        });
        other.join().unwrap()
    });
    assert!(launch_with(
        &mut s.engine,
        &mut params,
        crate::order::CU_STREAM_PER_THREAD,
        false
    ));
    assert_ne!(here, there);
    let sum = s.engine.summary();
    assert_eq!(
        (sum.apex, sum.fallback, sum.queues),
        (4, 0, 2),
        "{:?}",
        sum.reasons
    );
    s.calls();
    // libcuda work on the legacy stream follows both threads' default streams: both queues are handed over.
    let o = s.engine.before_work(LEGACY, "cuMemsetD32Async");
    let mut handed = s.calls();
    handed.sort();
    let mut want = vec![
        format!("cuda<-apex {here:?}"),
        format!("cuda<-apex {there:?}"),
    ];
    want.sort();
    assert_eq!(handed, want);
    s.engine.after(LEGACY, o, false);
    // This thread's next launch on its default stream waits for the legacy stream's work first.
    assert!(launch_with(&mut s.engine, &mut params, 0, true));
    assert_eq!(s.calls(), vec![format!("apex<-cuda {here:?}")]);
    s.sim.resume();
    s.idle();
}

/// The end of a context APEX never attached to (a second context of the GPU, whose attach is refused) leaves the
/// takeover on for the others; the end of one APEX attached to is not handled alone.
#[test]
fn destroying_a_context_apex_never_attached_to_leaves_the_takeover_on() {
    let mut s = Setup::new();
    assert!(s.launch());
    assert!(s.engine.context_destroyed_alone(CTX + 0x1000));
    assert!(s.launch(), "still through APEX");
    assert_eq!(s.engine.summary().apex, 2);
    assert!(!s.engine.context_destroyed_alone(CTX));
    s.idle();
}

#[test]
fn a_wait_for_a_libcuda_event_on_a_taken_over_stream_hands_nothing_to_cuda() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.idle();
    s.sim.pause();
    assert!(s.launch());
    s.calls();
    // cuStreamWaitEvent(legacy, an event libcuda recorded): forwarded as it is, no hop before it.
    let Some(Err(o)) = s
        .engine
        .stream_wait(EVENT, LEGACY, "cuStreamWaitEvent", true)
    else {
        panic!("an event the preload did not keep: libcuda waits");
    };
    s.engine.after(LEGACY, o, false);
    assert!(s.calls().is_empty());
    // The stream's next APEX launch waits for its CUDA side, which holds the wait.
    assert!(s.launch());
    assert_eq!(s.calls(), vec!["apex<-cuda Legacy"]);
    // Work libcuda runs on the stream later still follows the queue's work: handed over then.
    let o = s.engine.before_work(LEGACY, "cuMemcpy2DAsync_v2");
    assert_eq!(s.calls(), vec!["cuda<-apex Legacy"]);
    s.engine.after(LEGACY, o, false);
    assert_eq!(
        s.engine.summary().cuda_work.get("cuStreamWaitEvent"),
        Some(&1)
    );
    s.sim.resume();
    s.idle();
}

#[test]
fn a_wait_for_a_kept_event_is_made_on_the_gpu_or_left_for_libcuda_to_record_first() {
    let mut s = Setup::new();
    let apex = Site::Stream(0x5000, false);
    let other = Site::Stream(NON_BLOCKING + 0x2000, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    assert!(s.launch_on(NON_BLOCKING + 0x2000, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, apex), Answer::Done(0));
    s.calls();
    // A taken-over stream joins the event's fence on the GPU: no libcuda call.
    assert_eq!(
        s.engine
            .stream_wait(EVENT, other, "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
    assert!(s.calls().is_empty());
    // Flags libcuda must judge: recorded in libcuda first.
    assert_eq!(
        s.engine
            .stream_wait(EVENT, other, "cuStreamWaitEvent", false),
        None
    );
    // Work sent after the record: a stream APEX did not take over cannot wait for a release of the queue.
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(
        s.engine
            .stream_wait(EVENT, QUIET_OTHER, "cuStreamWaitEvent", true),
        None
    );
    s.sim.resume();
    s.idle();
}

#[test]
fn timed_events_and_events_after_cuda_work_go_to_libcuda() {
    let mut s = Setup::new();
    let stream = Site::Stream(0x5000, false);
    s.engine.event_created(EVENT, 0);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    assert_eq!(s.engine.event_record(EVENT, stream), Answer::Forward);
    s.engine.event_created(EVENT + 1, 2);
    let o = s.engine.before(stream);
    s.engine.after(stream, o, false);
    assert_eq!(s.engine.event_record(EVENT + 1, stream), Answer::Forward);
    // Unknown events (created before the preload watched) time, as far as the preload knows.
    assert_eq!(s.engine.event_record(EVENT + 2, stream), Answer::Forward);
    assert_eq!(s.engine.summary().events_on_apex, 0);
}

/// A launch asking for more dynamic shared memory than the function allows (48 KiB until the program raises
/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`) is libcuda's to refuse, as CUDA refuses it; once raised, on the
/// launch's handle or another handle of the kernel (libcuda asked again), it runs on APEX, and lowered again it is
/// refused again.
#[test]
fn dynamic_shared_memory_beyond_the_functions_limit_is_left_to_libcuda() {
    let mut s = Setup::new();
    let mut params = s.params;
    let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(|p| (p as *mut u64).cast()).collect();
    let launch = |shared: u32, ptrs: &mut Vec<*mut c_void>| Launch {
        shared,
        params: ptrs.as_mut_ptr(),
        ..bare_launch()
    };
    assert!(s.engine.launch(&launch(48 << 10, &mut ptrs), 0).is_some());
    assert!(s.engine.launch(&launch(64 << 10, &mut ptrs), 0).is_none());
    let refused = |s: &Setup| {
        s.engine
            .summary()
            .reasons
            .get("launch_refused")
            .map_or(0, |r| r.launches)
    };
    assert_eq!(refused(&s), 1);
    // Raised through another handle: libcuda's answer is asked for again.
    s.dynamic_shared.store(100 << 10, AtomicOrdering::Relaxed);
    assert!(s.engine.launch(&launch(64 << 10, &mut ptrs), 0).is_some());
    // Lowered on the launch's own handle.
    s.dynamic_shared.store(32 << 10, AtomicOrdering::Relaxed);
    s.engine.dynamic_shared_limit(FUNC);
    assert!(s.engine.launch(&launch(48 << 10, &mut ptrs), 0).is_none());
    assert!(s.engine.launch(&launch(32 << 10, &mut ptrs), 0).is_some());
    // Lowered through a handle no launch used: every function asks libcuda again.
    s.dynamic_shared.store(16 << 10, AtomicOrdering::Relaxed);
    s.engine.dynamic_shared_limit(FUNC + 1);
    assert!(s.engine.launch(&launch(32 << 10, &mut ptrs), 0).is_none());
    assert_eq!(refused(&s), 3);
    assert_eq!(s.engine.summary().apex, 3);
    // Two handles of one kernel, both launched: lowered through one, the other's launches follow too.
    const OTHER: usize = FUNC + 0x20;
    let name = Cubin::parse(CUBIN)
        .unwrap()
        .kernels()
        .iter()
        .find(|k| k.name.contains("vector_add"))
        .unwrap()
        .name
        .clone();
    s.engine.function(OTHER, MODULE, &name);
    s.dynamic_shared.store(64 << 10, AtomicOrdering::Relaxed);
    s.engine.dynamic_shared_limit(FUNC);
    let other = |shared: u32, ptrs: &mut Vec<*mut c_void>| Launch {
        f: OTHER,
        ..launch(shared, ptrs)
    };
    assert!(s.engine.launch(&other(64 << 10, &mut ptrs), 0).is_some());
    assert!(s.engine.launch(&launch(64 << 10, &mut ptrs), 0).is_some());
    s.dynamic_shared.store(8 << 10, AtomicOrdering::Relaxed);
    s.engine.dynamic_shared_limit(FUNC);
    assert!(s.engine.launch(&other(16 << 10, &mut ptrs), 0).is_none());
    assert_eq!(refused(&s), 4);
    assert_eq!(s.engine.summary().apex, 5);
    s.idle();
}

#[test]
fn refusals_are_counted_by_reason_and_shapes_are_prepared_once() {
    let mut s = Setup::new();
    for round in 0..3 {
        for grid in 1..=20 {
            assert!(s.launch_on(0, grid), "round {round} grid {grid}");
        }
    }
    assert_eq!(s.engine.summary().apex, 60);
    let mut l = bare_launch();
    assert!(s.engine.launch(&l, 0).is_none(), "missing parameters");
    l.f = 0xdead;
    assert!(s.engine.launch(&l, 0).is_none());
    let sum = s.engine.summary();
    assert_eq!(sum.fallback, 2);
    assert_eq!(sum.reasons["extra_params"].launches, 1);
    assert_eq!(sum.reasons["unknown_function"].launches, 1);
    assert_eq!(sum.contexts, vec!["direct".to_string()]);
}

#[test]
fn a_stream_with_a_priority_above_the_default_stays_on_libcuda() {
    let mut s = Setup::new();
    // CUDA schedules a high-priority stream's work ahead of others'; APEX's queues are all of one priority.
    assert!(!s.launch_on(PRIORITY, 1));
    assert!(!s.launch_on(PRIORITY, 2));
    assert!(
        s.launch_on(NON_BLOCKING + 0x4000, 1),
        "a default stream is taken over"
    );
    let sum = s.engine.summary();
    assert_eq!(sum.reasons["stream_priority"].launches, 2);
    assert!(sum.reasons["stream_priority"].example.contains("-2"));
    assert_eq!(sum.apex, 1);
    // A stream made later with the same handle is asked again.
    s.engine.stream_destroyed(PRIORITY);
    assert!(!s.engine.stream_priorities.contains_key(&(CTX, PRIORITY)));
}

#[test]
fn a_device_wide_call_waits_for_every_queue_without_a_hop() {
    let mut s = Setup::new();
    let b = Site::Stream(0x5000, false);
    assert!(s.launch_on(0x5000, 1));
    assert!(s.launch_on(0x6000, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    s.calls();
    // The running launch is waited for (outside the engine's lock), not handed over.
    let Step::Wait(w) = s.engine.device_quiet_begin() else {
        panic!("the queues are waited for");
    };
    assert!(w.items.iter().any(|(_, f)| !f.is_done()), "one is running");
    s.sim.resume();
    let waited = w.wait();
    assert_eq!(s.engine.device_quiet_end(&w, &waited), Answer::Forward);
    assert!(s.calls().is_empty(), "waited on the CPU, not handed over");
    // Complete and known so: CUDA work after it needs no hop, and none was avoided (nothing was pending).
    s.engine.before(b);
    assert!(s.calls().is_empty());
    assert_eq!(s.engine.summary().hops_avoided, 0);
}

#[test]
fn a_context_that_reported_an_assert_answers_through_libcuda() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.engine.contexts[0].failed = Some(Refusal::AssertReported);
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Forward
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Query),
        Answer::Forward
    );
    assert_eq!(s.engine.context_sync(), Answer::Forward);
    assert!(
        !s.launch(),
        "launches go to libcuda, which fails them as CUDA does"
    );
    assert_eq!(s.engine.summary().reasons["assert_reported"].launches, 1);
}

/// Memory the simulated GPU reaches, registered with the double as CUDA device memory.
fn device_memory(s: &Setup, bytes: u64) -> apex::HostBuffer {
    let b = s.engine.contexts[0].gpu.alloc_host(bytes).unwrap();
    s.device.lock().unwrap().push((b.device_ptr(), bytes));
    b
}

/// Runs `op` through the engine (which must take it) and returns the parameters of the copy kernel launch it made:
/// source, destination, bytes.
fn copy_seen(s: &mut Setup, op: &CopyOp) -> (u64, u64, u64) {
    s.idle();
    assert_eq!(s.engine.copy(op), Some(0));
    // The copy is its queue's last launch: complete once the queue is idle.
    s.idle();
    let l = s.sim.launches().last().cloned().unwrap();
    let word = |i: usize| u64::from_le_bytes(l.params[i * 8..i * 8 + 8].try_into().unwrap());
    (word(0), word(1), word(2))
}

#[test]
fn small_copies_on_a_taken_over_stream_run_on_its_queue_in_order() {
    let mut s = Setup::new();
    assert!(s.launch());
    let dev = device_memory(&s, 4096);
    s.calls();
    // The .item() pattern: a copy to pageable host memory (through the staging ring, waited for), then a
    // synchronize. (The simulator runs no kernel: the copy kernel's launch is what is checked.)
    let mut out = vec![0u8; 200];
    let op = CopyOp {
        dst: out.as_mut_ptr() as u64,
        src: dev.device_ptr() + 64,
        bytes: 200,
        site: LEGACY,
        dir: CopyDir::DeviceToHost,
        blocking: false,
    };
    let (src, dst, n) = copy_seen(&mut s, &op);
    let staging = s.engine.contexts[0]
        .staging
        .as_ref()
        .unwrap()
        .buffer
        .device_ptr();
    assert_eq!((src, n), (dev.device_ptr() + 64, 200));
    assert!(
        dst >= staging && dst < staging + STAGING_BYTES,
        "into the staging ring"
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    // An upload from pageable memory: staged by the CPU, then copied in stream order.
    let data: Vec<u8> = (0..100u8).rev().collect();
    let up = CopyOp {
        dst: dev.device_ptr() + 1024,
        src: data.as_ptr() as u64,
        bytes: 100,
        site: LEGACY,
        dir: CopyDir::Any,
        blocking: true,
    };
    let (src, dst, n) = copy_seen(&mut s, &up);
    assert_eq!((dst, n), (dev.device_ptr() + 1024, 100));
    let mut staged = vec![0u8; 100];
    s.engine.contexts[0]
        .staging
        .as_ref()
        .unwrap()
        .buffer
        .read(src - staging, &mut staged)
        .unwrap();
    assert_eq!(staged, data, "the bytes were staged before the copy");
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    assert!(s.calls().is_empty(), "no hop, no libcuda call");
    assert_eq!(s.engine.summary().copies_on_apex, 2);
}

#[test]
fn copies_apex_cannot_run_go_to_libcuda() {
    let mut s = Setup::new();
    assert!(s.launch_on(0x5000, 1));
    let dev = device_memory(&s, 4096);
    let mut out = vec![0u8; 64];
    let mut op = CopyOp {
        dst: out.as_mut_ptr() as u64,
        src: dev.device_ptr(),
        bytes: 64,
        site: LEGACY,
        dir: CopyDir::DeviceToHost,
        blocking: false,
    };
    assert_eq!(s.engine.copy(&op), None, "the stream is not taken over yet");
    assert!(s.launch());
    op.bytes = 8192;
    assert_eq!(s.engine.copy(&op), None, "past the allocation");
    let big = device_memory(&s, (COPY_MAX * 2) as u64);
    op.src = big.device_ptr();
    op.bytes = COPY_MAX;
    let mut large = vec![0u8; COPY_MAX + 1];
    op.dst = large.as_mut_ptr() as u64;
    assert_eq!(s.engine.copy(&op), Some(0), "up to COPY_MAX on APEX");
    op.src = dev.device_ptr();
    op.bytes = 64;
    op.dst = out.as_mut_ptr() as u64;
    op.bytes = 64;
    op.dir = CopyDir::HostToDevice;
    assert_eq!(s.engine.copy(&op), None, "the pointers say the other way");
    op.dir = CopyDir::DeviceToHost;
    op.site = Site::Stream(0x7000, false);
    assert_eq!(s.engine.copy(&op), None, "another stream, not taken over");
    op.site = LEGACY;
    op.src = big.device_ptr();
    op.dst = large.as_mut_ptr() as u64;
    op.bytes = COPY_MAX + 1;
    assert_eq!(
        s.engine.copy(&op),
        None,
        "large host copies stay on libcuda"
    );
    assert_eq!(s.engine.summary().copies_on_apex, 1);
}

#[test]
fn copies_between_device_buffers_run_on_the_queue_at_any_size() {
    let mut s = Setup::new();
    assert!(s.launch());
    let bytes = (COPY_MAX + 4096) as u64;
    let a = device_memory(&s, bytes);
    let b = device_memory(&s, bytes);
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    a.write(0, &pattern).unwrap();
    let op = CopyOp {
        dst: b.device_ptr(),
        src: a.device_ptr(),
        bytes: bytes as usize,
        site: LEGACY,
        dir: CopyDir::DeviceToDevice,
        blocking: false,
    };
    assert_eq!(
        copy_seen(&mut s, &op),
        (a.device_ptr(), b.device_ptr(), bytes)
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    assert_eq!(s.engine.summary().copies_on_apex, 1);
}

#[test]
fn memsets_of_device_memory_run_on_the_queue() {
    let mut s = Setup::new();
    assert!(s.launch());
    let dev = device_memory(&s, 4096);
    s.idle();
    let op = SetOp {
        dst: dev.device_ptr() + 16,
        value: 0xabcd,
        width: 2,
        count: 100,
        site: LEGACY,
    };
    assert_eq!(s.engine.fill(&op), Some(0));
    s.idle();
    let l = s.sim.launches().last().cloned().unwrap();
    let word = |i: usize| u64::from_le_bytes(l.params[i..i + 8].try_into().unwrap());
    let word32 = |i: usize| u32::from_le_bytes(l.params[i..i + 4].try_into().unwrap());
    // apex_fill(dst, value, width, count)
    assert_eq!(word(0), dev.device_ptr() + 16);
    assert_eq!((word32(8), word32(12)), (0xabcd, 2));
    assert_eq!(word(16), 100);
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
    // Misaligned, past the allocation, or host memory: libcuda's.
    assert_eq!(
        s.engine.fill(&SetOp {
            dst: op.dst + 1,
            ..op
        }),
        None
    );
    assert_eq!(s.engine.fill(&SetOp { count: 4096, ..op }), None);
    let host = [0u8; 64];
    assert_eq!(
        s.engine.fill(&SetOp {
            dst: host.as_ptr() as u64,
            ..op
        }),
        None
    );
    assert_eq!(s.engine.summary().sets_on_apex, 1);
}

#[test]
fn an_event_on_a_blocking_stream_is_kept_only_after_the_legacy_queue_is_waited_for() {
    let mut s = Setup::new();
    let b = Site::Stream(0x5000, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0, 1));
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    s.sim.pause();
    // A legacy-stream kernel after B's: a record on B is ordered after it by CUDA.
    assert!(s.launch_on(0, 1));
    assert_eq!(s.engine.event_record(EVENT, b), Answer::Forward);
    s.sim.resume();
    s.idle();
    // Once B's queue has waited for it (a launch on B), the record is B's queue's alone again.
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, b), Answer::Done(0));
}

#[test]
fn interprocess_events_are_never_kept() {
    let mut s = Setup::new();
    s.engine.event_created(EVENT, 2 | 4);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    assert_eq!(
        s.engine.event_record(EVENT, Site::Stream(0x5000, false)),
        Answer::Forward
    );
}

#[test]
fn destroying_a_stream_records_its_kept_events_in_libcuda() {
    let mut s = Setup::new();
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    assert_eq!(
        s.engine.event_record(EVENT, Site::Stream(0x5000, false)),
        Answer::Done(0)
    );
    s.calls();
    s.engine.stream_destroyed(0x5000);
    assert_eq!(s.calls(), vec!["record now 0xe0"]);
    assert_eq!(s.engine.event_sync(EVENT, SyncKind::Wait), Answer::Forward);
}

#[test]
fn work_submitted_while_libcuda_synchronizes_keeps_its_hop() {
    let mut s = Setup::new();
    assert!(s.launch());
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    let epoch = forwarded_stream_sync(&mut s);
    // Another thread adds CUDA work on the stream before this thread's synchronize returns.
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    s.engine.stream_synced(LEGACY, 0, epoch);
    s.calls();
    assert!(s.launch());
    assert_eq!(
        s.calls(),
        vec!["apex<-cuda Legacy"],
        "that work is not complete"
    );
    // The same for a context synchronize.
    let epoch = forwarded_context_sync(&mut s);
    let o = s.engine.before(LEGACY);
    s.engine.after(LEGACY, o, false);
    s.engine.context_synced(0, epoch);
    assert_eq!(s.engine.context_sync(), Answer::Forward);
}

#[test]
fn a_synchronize_during_a_capture_goes_to_libcuda() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.idle();
    assert!(s.engine.capture(0x9000, false, true));
    assert!(
        !s.engine.capture(0x9000, false, true),
        "already capturing: nothing changes"
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Query),
        Answer::Forward
    );
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Forward
    );
    assert_eq!(s.engine.context_sync(), Answer::Forward);
    s.engine.capture(0x9000, false, false);
    assert_eq!(
        s.engine.stream_sync(LEGACY, SyncKind::Wait),
        Answer::Done(0)
    );
}

/// `%p` in `APEX_PRELOAD_STATS` gives every process of a job its own summary file; a path without it is kept.
#[test]
fn the_stats_path_names_the_process_where_asked() {
    use std::path::Path;
    assert_eq!(
        stats_path(Path::new("/tmp/run/stats-%p.json"), 4242),
        PathBuf::from("/tmp/run/stats-4242.json")
    );
    assert_eq!(
        stats_path(Path::new("/tmp/%p/%p.json"), 7),
        PathBuf::from("/tmp/7/7.json")
    );
    assert_eq!(
        stats_path(Path::new("/tmp/stats.json"), 7),
        PathBuf::from("/tmp/stats.json")
    );
}

/// An `extra` array holding one packed argument buffer (`buffer`, its size `size`), as NCCL passes its arguments;
/// freed on drop. The test changes the size and the keys through raw pointers, as the engine reads them through the
/// array.
struct PackedExtra {
    extra: *mut [*mut c_void; 5],
    size: *mut usize,
}

impl PackedExtra {
    fn new(buffer: &mut [u8], size: usize) -> PackedExtra {
        let size: *mut usize = Box::into_raw(Box::new(size));
        let extra = Box::into_raw(Box::new([
            PARAM_BUFFER_POINTER as *mut c_void,
            buffer.as_mut_ptr().cast(),
            PARAM_BUFFER_SIZE as *mut c_void,
            size.cast(),
            PARAM_END as *mut c_void,
        ]));
        PackedExtra { extra, size }
    }

    fn launch(&self) -> Launch {
        Launch {
            extra: self.extra.cast(),
            ..bare_launch()
        }
    }

    fn set_size(&self, n: usize) {
        // SAFETY: made by Box::into_raw in `new`, freed only on drop; no reference to it is held.
        unsafe { *self.size = n }
    }

    fn set_key(&self, k: usize) {
        // SAFETY: as above.
        unsafe { (*self.extra)[2] = k as *mut c_void }
    }
}

impl Drop for PackedExtra {
    fn drop(&mut self) {
        // SAFETY: made by Box::into_raw in `new`, no longer used.
        unsafe {
            drop(Box::from_raw(self.extra));
            drop(Box::from_raw(self.size));
        }
    }
}

/// NCCL passes its kernels' arguments as one packed buffer in `extra`, often shorter than the kernel's parameters:
/// such launches run on APEX with the parameters' rest zero; an `extra` the driver would refuse (a buffer longer than
/// the parameters), or one with keys the preload does not know, goes to libcuda.
#[test]
fn arguments_in_one_packed_buffer_run_on_apex() {
    let mut s = Setup::new();
    // vector_add(a, b, out, n): three pointers and a 32-bit count, at their parameter-table offsets; one byte more
    // than the parameters, cut below.
    let mut buffer = [0u8; 29];
    for (i, v) in s.params[..3].iter().enumerate() {
        buffer[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    buffer[24..28].copy_from_slice(&64u32.to_le_bytes());
    buffer[28] = 0x5a;
    let packed = PackedExtra::new(&mut buffer, 28);
    let set_size = |n: usize| packed.set_size(n);
    let set_key = |k: usize| packed.set_key(k);
    let mut l = packed.launch();
    let ran = |s: &Setup, n: usize| {
        s.sim
            .wait_for(Duration::from_secs(10), |m| m.launches().len() == n)
    };
    let before = s.sim.launches().len();
    assert!(
        s.engine.launch(&l, 0).is_some(),
        "a packed buffer runs on APEX"
    );
    assert!(ran(&s, before + 1));
    assert_eq!(
        s.sim.launches().last().unwrap().params[..28],
        buffer[..28],
        "each parameter from its offset in the buffer"
    );
    // Shorter than the parameters, as NCCL's: what is given, then zeros.
    set_size(20);
    assert!(
        s.engine.launch(&l, 0).is_some(),
        "a short buffer runs on APEX"
    );
    assert!(ran(&s, before + 2));
    let mut expected = buffer[..28].to_vec();
    expected[20..].fill(0);
    assert_eq!(s.sim.launches().last().unwrap().params[..28], expected[..]);
    // Longer than the parameters: left to libcuda, which answers for it.
    set_size(29);
    assert!(s.engine.launch(&l, 0).is_none());
    set_size(28);
    // An unknown key.
    set_key(7);
    assert!(s.engine.launch(&l, 0).is_none());
    set_key(PARAM_BUFFER_SIZE);
    // Both kernelParams and extra.
    let mut p = [std::ptr::null_mut::<c_void>(); 4];
    l.params = p.as_mut_ptr();
    assert!(s.engine.launch(&l, 0).is_none());
    l.params = std::ptr::null_mut();
    // No size.
    set_key(PARAM_END);
    assert!(s.engine.launch(&l, 0).is_none());
    let sum = s.engine.summary();
    assert_eq!((sum.apex, sum.fallback), (2, 4));
    assert_eq!(sum.reasons["extra_params"].launches, 4);
}

/// Counts this thread's heap allocations (the other tests' threads keep their own counts).
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the count is a thread-local `Cell` with a const
// initializer, which allocates nothing itself.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: CountingAlloc = CountingAlloc;

fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

/// NCCL's pattern: its kernels are refused for a reason that carries text (`module_globals`), and its streams are
/// ones APEX never took over. Once each has been seen, a refused launch and the ordering of CUDA work around it
/// allocate nothing (the refusal is counted by reference, the work by its name's address).
#[test]
fn a_refused_launch_and_forwarded_work_allocate_nothing() {
    let mut s = Setup::new();
    assert!(s.launch(), "attached, the legacy stream taken over");
    s.calls();
    const NCCL_KERNEL: usize = 0xbad;
    s.engine.contexts[0].funcs.insert(
        NCCL_KERNEL,
        FuncState::Refused(Refusal::ModuleGlobals("__unnamed_1".into())),
    );
    let nccl_stream = Site::Stream(NON_BLOCKING + 0x100, false);
    let refused = Launch {
        f: NCCL_KERNEL,
        stream: NON_BLOCKING + 0x100,
        ..bare_launch()
    };
    let round = |s: &mut Setup| {
        assert!(s.engine.launch(&refused, 0).is_none());
        let o = s.engine.before(nccl_stream);
        s.engine.after(nccl_stream, o, false);
        let o = s.engine.before_work(nccl_stream, "cuStreamWaitEvent");
        s.engine.after(nccl_stream, o, false);
        assert_eq!(s.engine.event_record(EVENT, nccl_stream), Answer::Forward);
    };
    round(&mut s);
    let before = allocations();
    for _ in 0..100 {
        round(&mut s);
    }
    assert_eq!(allocations() - before, 0, "allocations in 100 rounds");
    let sum = s.engine.summary();
    assert_eq!(sum.reasons["module_globals"].launches, 101);
    assert!(
        sum.reasons["module_globals"]
            .example
            .contains("__unnamed_1")
    );
    assert_eq!(sum.cuda_work["cuStreamWaitEvent"], 101);
    assert!(
        s.calls().is_empty(),
        "no hop for streams APEX never took over"
    );
}

/// CUDA work on a non-blocking stream APEX never took over is related to no queue: no hop before it, and the
/// queues' next launches wait for nothing. Work on the legacy stream still marks its queue.
#[test]
fn work_on_a_stream_apex_never_took_over_touches_no_queue() {
    let mut s = Setup::new();
    assert!(s.launch());
    s.calls();
    let other = Site::Stream(NON_BLOCKING + 0x200, false);
    let o = s.engine.before(other);
    s.engine.after(other, o, false);
    assert!(
        s.calls().is_empty(),
        "the queue's launch is not handed over"
    );
    assert!(s.launch());
    assert!(s.calls().is_empty(), "the queue waits for nothing");
    let o = s.engine.before(LEGACY);
    assert_eq!(
        s.calls(),
        vec!["cuda<-apex Legacy"],
        "its own stream's work waits"
    );
    s.engine.after(LEGACY, o, false);
    assert!(s.launch());
    assert_eq!(s.calls(), vec!["apex<-cuda Legacy"]);
}

/// A stream taken over by another thread while a CUDA call on it runs: what `before` found no longer holds, so
/// `after` looks again and the new queue's next launch waits for that call's work.
#[test]
fn a_stream_taken_over_during_a_forwarded_call_is_marked_after_it() {
    let mut s = Setup::new();
    assert!(s.launch());
    let raw = NON_BLOCKING + 0x300;
    let site = Site::Stream(raw, false);
    let o = s.engine.before(site);
    // Another thread's first launch on the stream: taken over, its first launch waits for the stream.
    assert!(s.launch_on(raw, 1));
    s.calls();
    s.engine.after(site, o, false);
    assert!(s.launch_on(raw, 1));
    assert_eq!(
        s.calls(),
        vec![format!("apex<-cuda {:?}", StreamKey::Handle(raw))],
        "the call's work, submitted after the first launch's hop, is waited for"
    );
}

/// With the takeover off the engine counts launches the hooks forwarded without its lock, into the summary.
#[test]
fn launches_forwarded_with_the_takeover_off_are_counted() {
    assert!(enabled_by(None) && enabled_by(Some(b"on")) && enabled_by(Some(b"1")));
    assert!(!enabled_by(Some(b"off")) && !enabled_by(Some(b"0")) && !enabled_by(Some(b"false")));
    // CUDA_LAUNCH_BLOCKING as libcuda reads it (atoi): non-zero turns the takeover off.
    for on in [&b"1"[..], b" 1", b"2", b"+1", b"-1", b"01", b"1x"] {
        assert!(
            launch_blocking_by(Some(on)),
            "{:?}",
            String::from_utf8_lossy(on)
        );
    }
    for off in [&b"0"[..], b"", b"true", b"yes", b"00", b"x1"] {
        assert!(
            !launch_blocking_by(Some(off)),
            "{:?}",
            String::from_utf8_lossy(off)
        );
    }
    assert!(!launch_blocking_by(None));
    let (gpu, _sim) = Gpu::open_simulated(SimConfig::default()).unwrap();
    let cuda = FakeCuda::new(gpu);
    let config = Config {
        off: Some(Refusal::Disabled),
        max_queues: 8,
        stats: None,
        launch_memory: LaunchMemory::Video,
        chained: false,
        setup: Mode::Background,
        queues_ahead: 0,
        takeover: Policy::First,
    };
    let mut engine = Engine::new(config, Box::new(cuda));
    let before = DISABLED_LAUNCHES.load(Ordering::Relaxed);
    count_disabled_launch();
    count_disabled_launch();
    assert!(engine.launch(&bare_launch(), 0).is_none());
    let sum = engine.summary();
    // Other tests do not count disabled launches: only this one's are there.
    assert_eq!(sum.reasons["disabled"].launches, before + 3);
    assert_eq!((sum.launches, sum.fallback), (before + 3, before + 3));
    assert_eq!(sum.apex, 0);
}

/// Launches held by the chained queues of the engine's contexts, not yet sent.
fn held_links(s: &mut Setup) -> usize {
    s.engine
        .contexts
        .iter_mut()
        .flat_map(|c| c.queues.iter_mut().flatten())
        .map(|q| q.direct().map_or(0, |d| d.chain_len()))
        .sum()
}

#[test]
fn chained_queues_are_asked_for_with_apex_preload_chained() {
    assert!(chained_by(Some("1")) && chained_by(Some("on")) && chained_by(Some("true")));
    assert!(!chained_by(None) && !chained_by(Some("0")) && !chained_by(Some("off")));
}

#[test]
fn a_chained_queue_holds_launches_while_busy_until_work_elsewhere_needs_them() {
    // Two non-blocking streams (the fake says so from 0x1000000 up): neither waits for the other or the legacy one.
    let (a, b) = (0x200_0000, 0x300_0000);
    let mut s = Setup::with_chained(true);
    assert!(s.launch_on(a, 1));
    // The other stream's queue is built now: building one waits for the GPU, which is paused below.
    assert!(s.launch_on(b, 1));
    // A launch right after a hop finds the queue busy and may be held: the engine's next entry sends it.
    s.engine.send_held();
    s.idle();
    s.calls();
    let before = s.sim.launches().len();
    s.sim.pause();
    // The queue is idle: sent at once. Busy (the model is paused): the next two are held.
    assert!(s.launch_on(a, 1));
    assert_eq!(held_links(&mut s), 0);
    assert!(s.launch_on(a, 1));
    assert!(s.launch_on(a, 1));
    assert_eq!(held_links(&mut s), 2);
    assert_eq!(s.engine.held, Some(StreamKey::of(a, false)));
    // A launch on another stream may be ordered after them: they are sent first.
    assert!(s.launch_on(b, 1));
    assert_eq!(
        held_links(&mut s),
        0,
        "held launches sent before another stream's"
    );
    assert_eq!(s.engine.held, Some(StreamKey::of(b, false)));
    assert!(s.launch_on(b, 1));
    assert_eq!(held_links(&mut s), 1);
    // Every entry but a launch sends what is held (`with` does, as here).
    s.engine.send_held();
    assert!(s.engine.held.is_none());
    assert_eq!(held_links(&mut s), 0);
    s.sim.resume();
    assert!(
        s.sim
            .wait_for(Duration::from_secs(10), |m| m.launches().len()
                == before + 5),
        "every launch reached the simulated GPU"
    );
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
}

// ---- stream-ordered frees the allocation cache keeps ----

/// A cache serving stream-ordered allocations of `CTX`, with a block of 256 bytes handed out at 0xa000 (its size a
/// loop's).
fn cache_with_live_block() -> crate::alloc_cache::AllocCache {
    use crate::alloc_cache::{AllocCache, Pools};
    let mut c = AllocCache::new(1 << 20);
    c.set_pools(
        CTX,
        Pools {
            default: 0xd0,
            current_is_default: true,
            generation: 1,
        },
    );
    for _ in 0..2 {
        assert_eq!(c.take_async(CTX, 256, None, &mut |_| false), None);
    }
    c.allocated_async(CTX, 256, 0xa000);
    c
}

/// Whether a marker's work is complete, as the preload asks (no event in these tests).
fn fence_done(m: &crate::alloc_cache::Marker) -> bool {
    match m {
        crate::alloc_cache::Marker::Done => true,
        crate::alloc_cache::Marker::Fence(f) => f.is_done(),
        crate::alloc_cache::Marker::Event(_) | crate::alloc_cache::Marker::Stream => false,
    }
}

#[test]
fn a_free_on_a_taken_over_stream_is_marked_by_its_queue_with_no_libcuda_call() {
    use crate::alloc_cache::{Marker, lane};
    let mut s = Setup::new();
    let a = StreamKey::Handle(0x5000);
    let b = StreamKey::Handle(0x6000);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    s.sim.pause();
    // The kernel that uses the block is still running when the program frees it.
    assert!(s.launch_on(0x5000, 1));
    s.calls();
    let Ok((ctx, fence)) = s
        .engine
        .free_point(Site::Stream(0x5000, false), "cuMemFreeAsync")
    else {
        panic!("the queue's last launch stands for the stream's work");
    };
    assert_eq!(ctx, CTX);
    assert!(!fence.is_done());
    assert!(s.calls().is_empty(), "no hop, no record");
    assert!(
        s.engine.summary().cuda_work.is_empty(),
        "nothing given to libcuda"
    );
    let mut c = cache_with_live_block();
    c.hold_async(CTX, 0xa000, lane(a), Marker::Fence(fence))
        .unwrap();
    // Another stream: not while the kernel runs.
    assert_eq!(c.take_async(CTX, 256, lane(b), &mut fence_done), None);
    // The same stream: at once (its next use is ordered after the kernel).
    assert_eq!(
        c.take_async(CTX, 256, lane(a), &mut fence_done),
        Some(0xa000)
    );
    let Ok((_, fence)) = s
        .engine
        .free_point(Site::Stream(0x5000, false), "cuMemFreeAsync")
    else {
        panic!("still the queue's");
    };
    c.hold_async(CTX, 0xa000, lane(a), Marker::Fence(fence))
        .unwrap();
    s.sim.resume();
    s.idle();
    // Complete: another stream may have it.
    assert_eq!(
        c.take_async(CTX, 256, lane(b), &mut fence_done),
        Some(0xa000)
    );
    assert_eq!(c.stats().async_unready, 1);
}

#[test]
fn a_free_after_cuda_work_or_on_a_stream_apex_never_took_is_left_to_cuda() {
    let mut s = Setup::new();
    let site = Site::Stream(0x5000, false);
    // A stream APEX never took over: CUDA marks the point, with nothing to hand over.
    assert!(s.launch_on(0x6000, 1));
    s.calls();
    let Err(o) = s.engine.free_point(site, "cuMemFreeAsync") else {
        panic!("no queue on the stream");
    };
    s.engine.after(site, o, false);
    assert!(s.calls().is_empty());
    assert_eq!(s.engine.summary().cuda_work["cuMemFreeAsync"], 1);
    // A taken-over stream with CUDA work its queue has not waited for: CUDA's side is part of the free's past.
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    let o = s.engine.before(site);
    s.engine.after(site, o, false);
    s.calls();
    assert!(s.engine.free_point(site, "cuMemFreeAsync").is_err());
    // The per-thread default stream is never taken over.
    assert!(
        s.engine
            .free_point(Site::Stream(0, true), "cuMemFreeAsync_ptsz")
            .is_err()
    );
    s.sim.resume();
    s.idle();
    // Once the queue waited for CUDA's side (its next launch), its fence stands for everything again.
    assert!(s.launch_on(0x5000, 1));
    assert!(s.engine.free_point(site, "cuMemFreeAsync").is_ok());
}

#[test]
fn a_free_on_the_legacy_stream_is_the_queues_only_when_it_waited_for_the_blocking_streams() {
    let mut s = Setup::new();
    // A blocking stream's kernel after the legacy stream's: CUDA orders a legacy-stream free after it too, and the
    // legacy queue never waited for it.
    assert!(s.launch_on(0, 1));
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    s.calls();
    let Err(o) = s.engine.free_point(LEGACY, "cuMemFreeAsync") else {
        panic!("the blocking stream's kernel is part of the free's past");
    };
    s.engine.after(LEGACY, o, false);
    // Both related queues were handed to CUDA's legacy stream first, so that an event recorded there covers them.
    let calls = s.calls();
    assert!(
        calls.contains(&"cuda<-apex Handle(20480)".to_string()),
        "{calls:?}"
    );
    s.sim.resume();
    s.idle();
    // A legacy launch after it waits for the blocking stream's queue: its fence covers both.
    assert!(s.launch_on(0, 1));
    assert!(s.engine.free_point(LEGACY, "cuMemFreeAsync").is_ok());
}

mod background;
mod plain;
mod sleep;
mod takeover;

/// An event recorded after a stream's APEX work (the legacy stream's too, once its queue has waited for every
/// blocking stream's) and waited for by another taken-over stream is waited for by that stream's queue on the GPU,
/// with no libcuda call and no hop; its next record then stands for what it waited for. A stream not taken over
/// waits in libcuda.
#[test]
fn a_stream_waits_for_a_kept_event_on_the_gpu_without_libcuda() {
    let mut s = Setup::new();
    let (nccl, other) = (NON_BLOCKING, NON_BLOCKING + 0x100);
    let nccl_site = Site::Stream(nccl, false);
    s.engine.event_created(EVENT, 2);
    s.engine.event_created(EVENT + 1, 2);
    assert!(s.launch_on(0, 1));
    assert!(s.launch_on(nccl, 1));
    s.idle();
    s.calls();
    s.sim.pause();
    assert!(s.launch_on(0, 1));
    // The legacy queue waited for every related queue (the non-blocking one is not related): kept.
    assert_eq!(s.engine.event_record(EVENT, LEGACY), Answer::Done(0));
    assert_eq!(s.engine.wait_on_apex(EVENT, nccl_site), Some(0));
    assert!(s.launch_on(nccl, 1));
    // After the wait, the stream's record stands for the legacy queue's launch too.
    assert_eq!(s.engine.event_record(EVENT + 1, nccl_site), Answer::Done(0));
    assert_eq!(
        s.engine.event_sync(EVENT + 1, SyncKind::Query),
        Answer::Done(CUDA_ERROR_NOT_READY)
    );
    assert_eq!(s.engine.wait_on_apex(EVENT, nccl_site), Some(0));
    assert!(s.calls().is_empty(), "no libcuda call");
    assert_eq!(
        s.engine.wait_on_apex(EVENT, Site::Stream(other, false)),
        None
    );
    s.sim.resume();
    s.idle();
    assert_eq!(
        s.engine.event_sync(EVENT + 1, SyncKind::Wait),
        Answer::Done(0)
    );
    assert_eq!(s.engine.summary().waits_on_apex, 2);
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
}

/// NCCL's pattern on APEX: a launch whose arguments are a packed buffer shorter than the kernel's parameters, an
/// event kept after it and waited for by another taken-over stream. Once each has been seen, a round allocates
/// nothing on the program's thread.
#[test]
fn packed_launches_kept_events_and_waits_on_apex_allocate_nothing() {
    let mut s = Setup::new();
    let other = NON_BLOCKING + 0x100;
    let other_site = Site::Stream(other, false);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(other, 1), "the second stream taken over");
    // vector_add's three pointers and its count, the count left out of the buffer (zero-filled).
    let mut buffer = [0u8; 24];
    for (i, v) in s.params[..3].iter().enumerate() {
        buffer[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    let extra = PackedExtra::new(&mut buffer, 24);
    let packed = extra.launch();
    let round = |s: &mut Setup| {
        assert!(s.engine.launch(&packed, 0).is_some());
        assert_eq!(s.engine.event_record(EVENT, LEGACY), Answer::Done(0));
        assert_eq!(s.engine.wait_on_apex(EVENT, other_site), Some(0));
    };
    round(&mut s);
    s.idle();
    // The GPU held, so every wait is one the queue makes on the GPU.
    s.sim.pause();
    round(&mut s);
    let before = allocations();
    for _ in 0..50 {
        round(&mut s);
    }
    assert_eq!(allocations() - before, 0, "allocations in 50 rounds");
    s.sim.resume();
    s.idle();
    assert!(s.sim.errors().is_empty(), "{:?}", s.sim.errors());
}

// ---- streams kept as waits only ----

/// The compute stream (0x5000, taken over) with its second launch running and `EVENT` kept after it; `EVENT + 1`
/// made untimed. The simulated GPU is left paused: the test resumes it.
fn kept_event_of_a_running_launch(s: &mut Setup) {
    s.engine.event_created(EVENT, 2);
    s.engine.event_created(EVENT + 1, 2);
    assert!(s.launch_on(0x5000, 1));
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(
        s.engine.event_record(EVENT, Site::Stream(0x5000, false)),
        Answer::Done(0)
    );
}

/// `site` waits for `event`, answered by the preload (kept as waits only, or through a hop it made).
fn waits_for(s: &mut Setup, event: usize, site: Site) {
    assert_eq!(
        s.engine.stream_wait(event, site, "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
}

/// NCCL's internal stream, as a collective uses it: waits for an event kept after the compute stream's kernel, then
/// has an event recorded that the compute stream waits for. Kept by the preload: neither call reaches libcuda, the
/// queue only releases a mark; libcuda gets the wait once the stream gets work of its own.
#[test]
fn a_stream_that_only_waits_is_kept_until_it_gets_work() {
    let mut s = Setup::new();
    let compute = Site::Stream(0x5000, false);
    let nccl = NON_BLOCKING + 0x4000;
    let internal = Site::Stream(nccl, false);
    kept_event_of_a_running_launch(&mut s);
    s.calls();
    waits_for(&mut s, EVENT, internal);
    assert_eq!(
        s.calls(),
        vec!["release"],
        "the queue releases a mark, libcuda sees nothing"
    );
    // A record on it is kept, standing for the compute stream's kernel; the compute stream's wait for it is its own.
    assert_eq!(s.engine.event_record(EVENT + 1, internal), Answer::Done(0));
    assert_eq!(
        s.engine
            .stream_wait(EVENT + 1, compute, "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
    assert!(s.calls().is_empty());
    assert_eq!(s.engine.summary().hops_to_cuda, 0);
    // Its query and the event's are answered from the kernel's fence.
    assert_eq!(
        s.engine.stream_sync(internal, SyncKind::Query),
        Answer::Done(CUDA_ERROR_NOT_READY)
    );
    assert_eq!(
        s.engine.event_sync(EVENT + 1, SyncKind::Query),
        Answer::Done(CUDA_ERROR_NOT_READY)
    );
    // Work for libcuda on it: libcuda waits for the mark first, and the stream is libcuda's again.
    let o = s.engine.before_work(internal, "cuMemcpyAsync");
    assert_eq!(s.calls(), vec![format!("cuda<-release Handle({nccl})")]);
    s.engine.after(internal, o, false);
    assert_eq!(s.engine.summary().hops_to_cuda, 1);
    assert_eq!(
        s.engine.event_record(EVENT + 1, internal),
        Answer::Forward,
        "a record after libcuda's work is libcuda's"
    );
    s.sim.resume();
    s.idle();
}

/// Where keeping the stream would not be exact, it waits in libcuda as before: a blocking stream (it waits for the
/// legacy stream too), one busy in libcuda, an event whose queue launched again since, a second queue to wait for.
#[test]
fn a_stream_is_kept_as_waits_only_only_where_that_is_exact() {
    let mut s = Setup::new();
    let compute = Site::Stream(0x5000, false);
    let second = Site::Stream(NON_BLOCKING + 0x2000, false);
    let nccl = NON_BLOCKING + 0x4000;
    s.engine.event_created(EVENT, 2);
    s.engine.event_created(EVENT + 1, 2);
    assert!(s.launch_on(0x5000, 1));
    assert!(s.launch_on(NON_BLOCKING + 0x2000, 1));
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, compute), Answer::Done(0));
    s.calls();
    for (stream, why) in [(0x6000, "blocking"), (BUSY, "busy in libcuda")] {
        assert_eq!(
            s.engine.stream_wait(
                EVENT,
                Site::Stream(stream, false),
                "cuStreamWaitEvent",
                true
            ),
            Some(Ok(CUDA_SUCCESS)),
            "{why}"
        );
        assert_eq!(
            s.calls(),
            vec![format!("cuda<-apex Handle({stream})")],
            "{why}: waits in libcuda"
        );
        let o = s
            .engine
            .before_work(Site::Stream(stream, false), "cuMemcpyAsync");
        s.engine.after(Site::Stream(stream, false), o, false);
    }
    s.calls();
    // Kept, then a wait for another queue's event: libcuda gets the first wait, then the second.
    let internal = Site::Stream(nccl, false);
    waits_for(&mut s, EVENT, internal);
    assert_eq!(s.calls(), vec!["release"]);
    assert!(s.launch_on(NON_BLOCKING + 0x2000, 1));
    assert_eq!(s.engine.event_record(EVENT + 1, second), Answer::Done(0));
    s.calls();
    assert_eq!(
        s.engine
            .stream_wait(EVENT + 1, internal, "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
    assert_eq!(
        s.calls(),
        vec![
            format!("cuda<-release Handle({nccl})"),
            format!("cuda<-apex Handle({nccl})")
        ]
    );
    // The compute queue launched since its event was recorded: no exact mark, libcuda records the event.
    let late = Site::Stream(NON_BLOCKING + 0x7000, false);
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(
        s.engine.stream_wait(EVENT, late, "cuStreamWaitEvent", true),
        None
    );
    assert!(s.calls().is_empty());
    s.sim.resume();
    s.idle();
}

/// A kept stream whose queue's work is complete needs nothing from libcuda: its synchronize is answered at once, its
/// destruction forgets it, and its work later waits for nothing. The queue's stream destroyed while a stream waits
/// for it: libcuda gets the wait first.
#[test]
fn a_kept_stream_is_synchronized_destroyed_and_handed_back_without_loss() {
    let mut s = Setup::new();
    let compute = Site::Stream(0x5000, false);
    let (a, b) = (NON_BLOCKING + 0x4000, NON_BLOCKING + 0x4100);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(0x5000, 1));
    s.idle();
    assert_eq!(s.engine.event_record(EVENT, compute), Answer::Done(0));
    s.calls();
    for h in [a, b] {
        assert_eq!(
            s.engine
                .stream_wait(EVENT, Site::Stream(h, false), "cuStreamWaitEvent", true),
            Some(Ok(CUDA_SUCCESS))
        );
    }
    assert!(s.calls().is_empty(), "complete: not even a release");
    assert_eq!(
        s.engine.stream_sync(Site::Stream(a, false), SyncKind::Wait),
        Answer::Done(CUDA_SUCCESS)
    );
    s.engine.stream_destroyed(a);
    let o = s
        .engine
        .before_work(Site::Stream(b, false), "cuMemcpyAsync");
    s.engine.after(Site::Stream(b, false), o, false);
    assert!(s.calls().is_empty(), "nothing to wait for");
    // Running work: destroying the queue's stream hands the kept stream's wait to libcuda while the queue serves it.
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, compute), Answer::Done(0));
    assert_eq!(
        s.engine
            .stream_wait(EVENT, Site::Stream(b, false), "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
    s.calls();
    s.engine.stream_destroyed(0x5000);
    assert!(
        s.calls().contains(&format!("cuda<-release Handle({b})")),
        "the kept stream waits in libcuda"
    );
    s.sim.resume();
    s.idle();
}

// From a review of the above (each failed on the first version).

/// Calls on a kept stream from a thread whose current context is another device's (valid in CUDA) still find it: the
/// copy waits in libcuda, the synchronize waits for the kernel, a later record goes to libcuda.
#[test]
fn a_kept_stream_is_found_whatever_context_is_current() {
    let mut s = Setup::new();
    let nccl = NON_BLOCKING + 0x4000;
    let internal = Site::Stream(nccl, false);
    kept_event_of_a_running_launch(&mut s);
    waits_for(&mut s, EVENT, internal);
    s.calls();
    s.engine.cuda.set_current(Some(FOREIGN_CTX)).unwrap();
    let o = s.engine.before_work(internal, "cuMemcpyAsync");
    s.engine.after(internal, o, false);
    s.engine.cuda.set_current(Some(CTX)).unwrap();
    assert_eq!(s.calls(), vec![format!("cuda<-release Handle({nccl})")]);
    assert_eq!(s.engine.event_record(EVENT + 1, internal), Answer::Forward);
    s.sim.resume();
    s.idle();
}

/// A stream of another context waiting for a kept event (its device is not the current one): waits in libcuda at
/// once, never kept.
#[test]
fn a_stream_of_another_context_is_never_kept_as_waits_only() {
    let mut s = Setup::new();
    kept_event_of_a_running_launch(&mut s);
    s.calls();
    assert_eq!(
        s.engine.stream_wait(
            EVENT,
            Site::Stream(FOREIGN, false),
            "cuStreamWaitEvent",
            true
        ),
        Some(Ok(CUDA_SUCCESS))
    );
    assert_eq!(s.calls(), vec![format!("cuda<-apex Handle({FOREIGN})")]);
    s.sim.resume();
    s.idle();
}

/// A call on the stream let through by the hooks without the engine is still on its way to libcuda when another
/// thread starts keeping the stream: once it arrives (a new generation), the stream is libcuda's again, so a later
/// record stands for that call's work too.
#[test]
fn a_call_in_flight_when_a_stream_starts_to_be_kept_hands_it_back() {
    let mut s = Setup::new();
    let compute = Site::Stream(0x5000, false);
    let nccl = NON_BLOCKING + 0x4000;
    let internal = Site::Stream(nccl, false);
    s.engine.event_created(EVENT, 2);
    s.engine.event_created(EVENT + 1, 2);
    assert!(s.launch_on(0x5000, 1));
    let o = s.engine.before_work(internal, "cuMemcpyAsync");
    s.engine.after(internal, o, false);
    s.sim.pause();
    assert!(s.launch_on(0x5000, 1));
    assert_eq!(s.engine.event_record(EVENT, compute), Answer::Done(0));
    let t = s.engine.plain.begin(nccl, None).expect("remembered");
    waits_for(&mut s, EVENT, internal);
    assert!(!s.engine.plain.end(t, Some("cuMemcpyAsync")));
    s.engine.after(internal, Ordered::UNKNOWN, false);
    assert_eq!(s.engine.event_record(EVENT + 1, internal), Answer::Forward);
    s.sim.resume();
    s.idle();
}

/// libcuda refusing both waits when a kept stream gets work: the launch it waits for is waited for on the CPU
/// before libcuda gets the work, never skipped.
#[test]
fn a_refused_hop_is_replaced_by_a_wait_on_the_cpu() {
    let mut s = Setup::new();
    let site = Site::Stream(NOHOP, false);
    kept_event_of_a_running_launch(&mut s);
    let fence = s.engine.contexts[0].last_fence(0).unwrap().unwrap();
    assert_eq!(
        s.engine.stream_wait(EVENT, site, "cuStreamWaitEvent", true),
        Some(Ok(CUDA_SUCCESS))
    );
    let (engine, sim) = (&mut s.engine, &s.sim);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            sim.resume();
        });
        let o = engine.before_work(site, "cuLaunchKernel");
        assert_eq!(
            fence_state(&fence),
            SlotState::Done,
            "libcuda got the work before the kernel it waits for completed"
        );
        engine.after(site, o, false);
    });
    assert_eq!(s.engine.summary().cpu_syncs, 1);
    s.idle();
}

/// A capture begins: streams kept as waits only are handed back to libcuda first, and while it runs no stream or
/// event is kept.
#[test]
fn a_capture_hands_kept_streams_back_and_keeps_nothing_while_it_runs() {
    let mut s = Setup::new();
    let nccl = NON_BLOCKING + 0x4000;
    let internal = Site::Stream(nccl, false);
    let other = Site::Stream(NON_BLOCKING + 0x4100, false);
    kept_event_of_a_running_launch(&mut s);
    waits_for(&mut s, EVENT, internal);
    s.calls();
    // What the capture hook does: mark, then hand everything kept to libcuda.
    assert!(s.engine.capture(0x9000, false, true));
    s.engine.materialize_all("capture");
    let calls = s.calls();
    assert!(
        calls.contains(&format!("cuda<-release Handle({nccl})")),
        "{calls:?}"
    );
    assert_eq!(s.engine.event_record(EVENT + 1, internal), Answer::Forward);
    // The event is libcuda's now: a wait for it is libcuda's, and keeps nothing.
    assert!(matches!(
        s.engine
            .stream_wait(EVENT, other, "cuStreamWaitEvent", true),
        Some(Err(_))
    ));
    assert_eq!(s.engine.event_record(EVENT + 1, other), Answer::Forward);
    s.engine.capture(0x9000, false, false);
    s.sim.resume();
    s.idle();
}

/// More streams than queues, one after another (PyTorch hands out streams from a pool): the queue of a stream that
/// stopped launching, its work complete, serves the next new stream; the kept event after its work is recorded in
/// libcuda first; its prepared launches stay valid (same queue); a stream that launched lately keeps its queue.
#[test]
fn an_idle_queue_serves_a_new_stream_once_every_queue_is_taken() {
    let mut s = Setup::new();
    s.engine.config.max_queues = 2;
    let (a, b, c) = (0x5000, 0x6000, 0x7000);
    s.engine.event_created(EVENT, 2);
    assert!(s.launch_on(a, 1));
    assert_eq!(
        s.engine.event_record(EVENT, Site::Stream(a, false)),
        Answer::Done(0)
    );
    assert!(s.launch_on(b, 1));
    assert!(!s.launch_on(c, 1), "a launched lately: it keeps its queue");
    for _ in 0..REASSIGN_AFTER_LAUNCHES {
        assert!(s.launch_on(b, 1));
    }
    s.idle();
    s.calls();
    let before = s.sim.launches().len();
    assert!(s.launch_on(c, 1), "a's idle queue serves c");
    let calls = s.calls();
    assert!(
        calls.contains(&format!("record now {EVENT:#x}")),
        "the event kept after a's work is recorded in libcuda: {calls:?}"
    );
    assert!(
        calls.iter().any(|c| c.starts_with("apex<-cuda")),
        "c's first launch waits for c's CUDA work: {calls:?}"
    );
    assert!(
        s.sim
            .wait_for(Duration::from_secs(10), |m| m.launches().len()
                == before + 1),
        "c's launch ran"
    );
    let sum = s.engine.summary();
    assert_eq!((sum.queues, sum.queues_reassigned), (2, 1));
    assert_eq!(sum.reasons["too_many_streams"].launches, 1);
    assert_eq!(
        sum.events_materialized_for
            .get("queue handed to another stream"),
        Some(&1)
    );
    let ctx = &s.engine.contexts[0];
    assert_eq!(
        ctx.order.find(StreamKey::of(a, false)),
        None,
        "a is no longer taken over"
    );
    let slot = ctx
        .order
        .find(StreamKey::of(c, false))
        .expect("c is taken over");
    assert_eq!(slot, 0, "in a's slot, with a's queue");
    assert!(!ctx.events.contains_key(&EVENT));
    // a's event is libcuda's now: a wait for it goes to libcuda.
    assert_eq!(s.engine.event_sync(EVENT, SyncKind::Query), Answer::Forward);
}

/// A queue whose last launch still runs, one that launched lately and one with many events kept after it are never
/// handed over: the new stream's launch stays on libcuda.
#[test]
fn a_busy_or_recent_queue_is_never_handed_to_another_stream() {
    let mut s = Setup::new();
    s.engine.config.max_queues = 2;
    let (a, b, c) = (0x5000, 0x6000, 0x7000);
    assert!(s.launch_on(a, 1));
    assert!(s.launch_on(b, 1));
    // a's work still runs (the GPU is paused), however many launches b makes after it.
    s.sim.pause();
    assert!(s.launch_on(a, 1));
    for _ in 0..REASSIGN_AFTER_LAUNCHES {
        assert!(s.launch_on(b, 1));
    }
    assert!(!s.launch_on(c, 1), "a's queue is busy, b's launched lately");
    s.sim.resume();
    s.idle();
    // a is idle now, but has more events kept after its work than are worth recording in libcuda at once.
    for i in 0..=REASSIGN_MAX_KEPT_EVENTS {
        let e = EVENT + 0x100 * (i + 1);
        s.engine.event_created(e, 2);
        assert_eq!(
            s.engine.event_record(e, Site::Stream(a, false)),
            Answer::Done(0)
        );
    }
    assert!(!s.launch_on(c, 1), "too many events kept after a's work");
    let sum = s.engine.summary();
    assert_eq!(sum.queues_reassigned, 0);
    assert_eq!(sum.reasons["too_many_streams"].launches, 2);
    assert!(
        s.engine.contexts[0]
            .order
            .find(StreamKey::of(a, false))
            .is_some()
    );
}

/// Once every queue is taken and none is idle, each launch on another stream is refused for it: the search for an
/// idle queue allocates nothing (from a review).
#[test]
fn a_launch_refused_for_want_of_a_queue_allocates_nothing() {
    let mut s = Setup::new();
    s.engine.config.max_queues = 2;
    let (a, b, c) = (0x5000, 0x6000, 0x7000);
    assert!(s.launch_on(a, 1));
    assert!(s.launch_on(b, 1));
    let mut ptrs: Vec<*mut c_void> = s
        .params
        .iter_mut()
        .map(|p| (p as *mut u64).cast())
        .collect();
    let l = Launch {
        stream: c,
        params: ptrs.as_mut_ptr(),
        ..bare_launch()
    };
    assert!(s.engine.launch(&l, 0).is_none(), "a and b launched lately");
    let before = allocations();
    for _ in 0..10 {
        assert!(s.engine.launch(&l, 0).is_none());
    }
    assert_eq!(
        allocations() - before,
        0,
        "allocations in 10 refused launches"
    );
}

/// A queue just handed to a stream counts as used from then on: streams whose launches never reach it (refused
/// after the takeover, here for a block of 2048 threads) do not pass it back and forth (from a review).
#[test]
fn a_queue_just_handed_over_is_not_taken_back_at_the_next_launch() {
    let mut s = Setup::new();
    s.engine.config.max_queues = 2;
    let (a, b, c, d) = (0x5000, 0x6000, 0x7000, 0x8000);
    assert!(s.launch_on(a, 1));
    assert!(s.launch_on(b, 1));
    for _ in 0..REASSIGN_AFTER_LAUNCHES {
        assert!(s.launch_on(b, 1));
    }
    s.idle();
    let mut ptrs: Vec<*mut c_void> = s
        .params
        .iter_mut()
        .map(|p| (p as *mut u64).cast())
        .collect();
    let params = ptrs.as_mut_ptr();
    let refused = |stream| Launch {
        stream,
        block: [2048, 1, 1],
        params,
        ..bare_launch()
    };
    for i in 0..6 {
        let stream = if i % 2 == 0 { c } else { d };
        assert!(s.engine.launch(&refused(stream), 0).is_none());
    }
    let sum = s.engine.summary();
    assert_eq!(sum.apex, 1 + 1 + REASSIGN_AFTER_LAUNCHES);
    assert_eq!(
        sum.queues_reassigned, 1,
        "one handover for 6 launches, none of which ran on APEX"
    );
}
