//! Set-up off the program's critical path (issue 27: the preload makes programs faster, never slower).
//!
//! Before APEX can take a launch over, three things must exist: the attachment to the launch's CUDA context (about
//! 11 ms on an H100), a queue for its stream (about 5 ms each, almost all of it RM's channel creation), and the
//! function's module loaded into APEX (up to a few ms for a large module). Done at the launch that first needs them,
//! on the program's thread, they made a short program slower under the preload than without it.
//!
//! With `APEX_PRELOAD_SETUP=background` (opt-in), one thread of the preload's, the set-up worker, prepares
//! each piece while the launches that need it go to libcuda exactly as refused launches do (ordered with the queues
//! by the same hops; counted as `warmup`, not as refusals). The worker never takes the engine's lock: the engine
//! hands it a [`Job`] and picks each result ([`Done`]) up at a later launch, after one atomic load
//! ([`Worker::has_results`]) tells it something is there; with nothing pending, that load is all a launch pays.
//! With `APEX_PRELOAD_SETUP=inline` (the default) the engine builds each piece on the program's thread as the launch that needs it
//! waits, and every launch is taken over from the first.
//!
//! `Gpu` is `Send + Sync` (its handles are shared behind `Arc`s, and what RM and the printf FIFO keep is behind
//! locks or atomics), so the engine shares each context's `Gpu` with the worker; a `Queue` and a `Module` are
//! `Send`, so they move back to the launching thread (asserted below at compile time).
//!
//! The end of the process or of a context ([`Worker::quiesce`]): queued jobs are dropped, and the one in flight,
//! which may be inside libcuda or RM in the program's context, is waited for, up to a bound, so that the context is
//! not destroyed under it; its result is then dropped with the engine's other objects. A job still running after
//! the bound is abandoned: whatever it produces is leaked rather than dropped, since its context may be gone by
//! then. A forked child never gets here (the engine forwards everything in a child, and never looks at the worker).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use apex::{Backend, Gpu, Module, Queue, QueueOptions};
use tracing::{debug, warn};

use crate::Refusal;
use crate::check;
use crate::cuda::CudaSide;
use crate::registry::{ImageBytes, Owner};

// The worker holds a context's `Gpu` while the engine uses it, and hands queues and modules back to the launching
// thread.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    fn moved<T: Send>() {}
    shared::<Gpu>();
    moved::<Queue>();
    moved::<Module>();
};

/// Where the set-up a launch needs runs (`APEX_PRELOAD_SETUP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// On the set-up worker, while the launches that need it go to libcuda (the default).
    Background,
    /// On the program's thread, at the launch that needs it (every launch through APEX from the first).
    Inline,
}

impl Mode {
    /// The mode a value of `APEX_PRELOAD_SETUP` asks for: `background`, else inline (the default: measured on an
    /// H100, a PyTorch decode loop was 0.69× libcuda's speed with the background set-up against 1.28-1.40× inline,
    /// its kernels' modules loading behind the first tokens; a 0.3 s CUDA C program 0.98× against 0.88×).
    pub(crate) fn by(value: Option<&str>) -> Mode {
        match value {
            Some("background") => Mode::Background,
            _ => Mode::Inline,
        }
    }

    /// The mode's name, as the summary shows it.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::Background => "background",
            Mode::Inline => "inline",
        }
    }
}

/// A piece of set-up for the worker. Each names the CUDA context it is for, which the worker makes current while
/// it runs.
pub(crate) enum Job {
    /// Attach APEX to the context, then take the GPU's first queue (the one that proved the channel: free).
    Attach { ctx: usize, options: QueueOptions },
    /// Build a queue of the context's GPU.
    Queue {
        ctx: usize,
        gpu: Arc<Gpu>,
        options: QueueOptions,
    },
    /// Load a module or library's image into APEX, its `__device__` variables placed where CUDA's instance has them.
    Module {
        ctx: usize,
        gpu: Arc<Gpu>,
        owner: Owner,
        library: bool,
        image: Arc<ImageBytes>,
        /// Whether failed asserts end their thread in this context (else kernels that assert are refused).
        asserts: bool,
    },
}

impl Job {
    fn ctx(&self) -> usize {
        match self {
            Job::Attach { ctx, .. } | Job::Queue { ctx, .. } | Job::Module { ctx, .. } => *ctx,
        }
    }

    /// The outcome of this job when it could not run (`why`).
    fn failed(&self, why: String) -> Outcome {
        match self {
            Job::Attach { .. } => Outcome::Attached {
                result: Err(why),
                first: None,
            },
            Job::Queue { .. } => Outcome::Queue(Err(why)),
            Job::Module { owner, .. } => Outcome::Module {
                owner: *owner,
                result: Err(Refusal::ModuleRefused(why)),
                placing: std::time::Duration::ZERO,
            },
        }
    }
}

/// What a job produced.
pub(crate) enum Outcome {
    /// The attach (the GPU, and whether failed asserts end their thread) and, when it is on the direct path, the
    /// GPU's first queue.
    Attached {
        result: Result<(Arc<Gpu>, bool), String>,
        first: Option<Result<Queue, String>>,
    },
    /// A queue.
    Queue(Result<Queue, String>),
    /// A module of `owner`.
    Module {
        owner: Owner,
        result: Result<Module, Refusal>,
        /// Of the load's time, what asking CUDA where the variables live took ([`load_module_timed`]).
        placing: std::time::Duration,
    },
}

/// A finished job.
pub(crate) struct Done {
    /// The context it was for.
    pub ctx: usize,
    /// The number [`Worker::submit`] gave the job.
    pub ticket: u64,
    /// How long it ran.
    pub took: Duration,
    pub outcome: Outcome,
}

/// Attaches APEX to the context current on this thread and, on the direct path, takes the GPU's first queue.
pub(crate) fn attach(cuda: &dyn CudaSide, options: QueueOptions) -> Outcome {
    let result = cuda.attach().map(|(gpu, asserts)| (Arc::new(gpu), asserts));
    let first = match &result {
        Ok((gpu, _)) if gpu.backend() == Backend::Direct => {
            Some(gpu.queue_with(options).map_err(|e| e.to_string()))
        }
        _ => None,
    };
    Outcome::Attached { result, first }
}

/// Loads `image` (of `owner`, a library when `library`) into `gpu`, every `__device__` variable placed at the
/// address CUDA's instance of the module has for it (asked of the context current on this thread), and checks it
/// for what APEX cannot run (`asserts`: failed asserts end their thread). With the module, the time spent asking
/// CUDA where the variables live: CUDA loads its instance of the module to answer, which a program that ran the
/// module's kernels on libcuda has paid for already and one run through APEX from its first launch pays for in
/// CUDA's place (its price is not APEX's).
pub(crate) fn load_module_timed(
    cuda: &dyn CudaSide,
    gpu: &Gpu,
    owner: Owner,
    library: bool,
    image: &[u8],
    asserts: bool,
) -> (Result<Module, Refusal>, std::time::Duration) {
    // The module's `__device__` variables are CUDA's instance's: kernels on both sides share them. Any one CUDA does
    // not give (or gives at another size: not the same variable) would diverge. The compiler's constants are not
    // asked for (`Gpu::load_module_sharing`): both instances hold the same bytes, which nothing writes.
    let placing = std::cell::Cell::new(std::time::Duration::ZERO);
    // For the debug log: how many variables were asked for, and how long the first answer took (CUDA loads its
    // instance of the module's data to give it, where the program has not run the module's kernels on libcuda).
    let asked_count = std::cell::Cell::new(0u32);
    let first_answer = std::cell::Cell::new(std::time::Duration::ZERO);
    let ask = |name: &str| {
        let asked = std::time::Instant::now();
        let home = cuda.global(owner, library, name);
        let took = asked.elapsed();
        if asked_count.get() == 0 {
            first_answer.set(took);
        }
        asked_count.set(asked_count.get() + 1);
        placing.set(placing.get() + took);
        home
    };
    let unplaced = std::cell::RefCell::new(None);
    let place = |name: &str, size: u64| {
        let home = ask(name).filter(|h| h.size == size);
        if home.is_none() {
            unplaced
                .borrow_mut()
                .get_or_insert_with(|| name.to_string());
        }
        home
    };
    // `__constant__` variables: APEX's launches bind CUDA's instance's bank when CUDA says where they live, so the
    // program's `cudaMemcpyToSymbol` reaches them; a variable CUDA does not give leaves the module a bank of its own
    // (no refusal: only a write through CUDA's address would diverge, and the escape of one is watched).
    let constants = |name: &str, size: u64| ask(name).filter(|h| h.size == size);
    let loaded = gpu
        .load_module_sharing_constants(image, &place, &constants)
        .map_err(|e| Refusal::ModuleRefused(e.to_string()))
        .and_then(|m| match unplaced.borrow_mut().take() {
            Some(name) => Err(Refusal::ModuleGlobals(name)),
            None => Ok(m),
        })
        .and_then(|m| {
            let checking = std::time::Instant::now();
            let refusal = m.cubin().and_then(|c| check::module_refusal(c, asserts));
            tracing::debug!(
                check_us = checking.elapsed().as_micros(),
                "module checked for what APEX refuses"
            );
            match refusal {
                Some(r) => Err(r),
                None => Ok(m),
            }
        });
    tracing::debug!(
        asked = asked_count.get(),
        first_us = first_answer.get().as_micros(),
        all_us = placing.get().as_micros(),
        "module variables asked of CUDA"
    );
    (loaded, placing.get())
}

/// Runs `job` with its context current on this thread (the worker's).
fn run(cuda: &dyn CudaSide, job: &Job) -> Outcome {
    if let Err(e) = cuda.set_current(Some(job.ctx())) {
        return job.failed(format!(
            "making the context current on the set-up thread: {e}"
        ));
    }
    let outcome = match job {
        Job::Attach { options, .. } => attach(cuda, *options),
        Job::Queue { gpu, options, .. } => {
            Outcome::Queue(gpu.queue_with(*options).map_err(|e| e.to_string()))
        }
        Job::Module {
            gpu,
            owner,
            library,
            image,
            asserts,
            ..
        } => {
            let (result, placing) =
                load_module_timed(cuda, gpu, *owner, *library, image.bytes(), *asserts);
            Outcome::Module {
                owner: *owner,
                result,
                placing,
            }
        }
    };
    // The thread keeps no context: one destroyed later is not left current here.
    let _ = cuda.set_current(None);
    outcome
}

/// What [`Worker::withdraw`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Withdrawn {
    /// The job had not started: it never will.
    Dropped,
    /// The job has finished (now, or before).
    Finished,
    /// The job still runs after the bound.
    StillRunning,
}

/// The worker's state, behind one lock.
#[derive(Default)]
struct State {
    jobs: VecDeque<(u64, Job)>,
    /// The ticket of the job running.
    running: Option<u64>,
    /// The worker ends at its next look at the queue (the end of the process or of the takeover).
    stop: bool,
    /// A job ran past [`Worker::quiesce`]'s bound: what it produces is leaked, never dropped.
    abandoned: bool,
    done: Vec<Done>,
    /// The last ticket given.
    tickets: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Jobs were added, or the worker must stop.
    wake: Condvar,
    /// A job finished.
    finished: Condvar,
    /// `state.done` is not empty: the launch path's one load.
    ready: AtomicBool,
    cuda: Arc<dyn CudaSide>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held leaves the state as consistent as any other point: nothing to undo.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for finished jobs while `busy` holds of the state, up to `bound`: the guard, and whether `busy` stopped
    /// holding in time.
    fn wait_while<'a>(
        &'a self,
        s: MutexGuard<'a, State>,
        bound: Duration,
        busy: impl FnMut(&mut State) -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        let (s, waited) = self
            .finished
            .wait_timeout_while(s, bound, busy)
            .unwrap_or_else(|e| e.into_inner());
        (s, !waited.timed_out())
    }
}

/// The set-up worker: one thread, started at the first job.
pub(crate) struct Worker {
    shared: Arc<Shared>,
    started: bool,
}

impl Worker {
    /// A worker that asks `cuda` (started at the first [`submit`](Worker::submit)).
    pub(crate) fn new(cuda: Arc<dyn CudaSide>) -> Worker {
        Worker {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                finished: Condvar::new(),
                ready: AtomicBool::new(false),
                cuda,
            }),
            started: false,
        }
    }

    /// Queues `job`; its ticket comes back with its result. `Err` when the worker's thread cannot be started (then
    /// the caller sets up on its own thread) or the worker was stopped.
    pub(crate) fn submit(&mut self, job: Job) -> Result<u64, String> {
        if !self.started {
            let shared = self.shared.clone();
            std::thread::Builder::new()
                .name("apex-setup".into())
                .spawn(move || work(&shared))
                .map_err(|e| format!("cannot start the set-up thread: {e}"))?;
            self.started = true;
        }
        let mut s = self.shared.lock();
        if s.stop {
            return Err("the set-up worker was stopped".into());
        }
        s.tickets += 1;
        let ticket = s.tickets;
        s.jobs.push_back((ticket, job));
        drop(s);
        self.shared.wake.notify_one();
        Ok(ticket)
    }

    /// Whether finished jobs wait to be taken: one relaxed load, all a launch pays once set-up is over.
    #[inline]
    pub(crate) fn has_results(&self) -> bool {
        self.shared.ready.load(Ordering::Relaxed)
    }

    /// The finished jobs, in the order they finished.
    pub(crate) fn take(&self) -> Vec<Done> {
        let mut s = self.shared.lock();
        self.shared.ready.store(false, Ordering::Relaxed);
        std::mem::take(&mut s.done)
    }

    /// Waits up to `bound` until the worker has nothing queued or running (`true`).
    #[cfg(test)]
    pub(crate) fn wait_idle(&self, bound: Duration) -> bool {
        let s = self.shared.lock();
        self.shared
            .wait_while(s, bound, |s| s.running.is_some() || !s.jobs.is_empty())
            .1
    }

    /// Makes sure job `ticket` neither waits nor runs (before the program unloads the module it loads): dropped if
    /// it is queued (`Withdrawn::Dropped`), waited for up to `bound` if it runs (its result then among
    /// [`take`](Worker::take)'s).
    pub(crate) fn withdraw(&self, ticket: u64, bound: Duration) -> Withdrawn {
        let mut s = self.shared.lock();
        if let Some(i) = s.jobs.iter().position(|(t, _)| *t == ticket) {
            let job = s.jobs.remove(i);
            drop(s);
            drop(job);
            return Withdrawn::Dropped;
        }
        match self
            .shared
            .wait_while(s, bound, |s| s.running == Some(ticket))
        {
            (_, true) => Withdrawn::Finished,
            (_, false) => Withdrawn::StillRunning,
        }
    }

    /// Stops the worker for good: queued jobs are dropped, and the one running is waited for up to `bound`
    /// (`true`: nothing runs any more; its result is among [`take`](Worker::take)'s). Past the bound the running
    /// job is abandoned (`false`): its result will be leaked, not dropped, as its context may be gone by then.
    pub(crate) fn quiesce(&self, bound: Duration) -> bool {
        let mut s = self.shared.lock();
        s.stop = true;
        let queued = std::mem::take(&mut s.jobs);
        self.shared.wake.notify_all();
        let (mut s, idle) = self.shared.wait_while(s, bound, |s| s.running.is_some());
        if !idle {
            s.abandoned = true;
            drop(s);
            drop(queued);
            return false;
        }
        drop(s);
        // Queued jobs hold only shares of GPUs the engine holds too: dropping them frees nothing.
        drop(queued);
        true
    }
}

/// The worker's thread: runs jobs in order until stopped.
fn work(shared: &Shared) {
    // The worker's calls into libcuda (APEX's, and the context switch) pass straight through the preload's hooks:
    // none of them may take the engine's lock, which a launching thread may hold while it waits for nothing here.
    apex_interpose::enter_forever();
    loop {
        let (ticket, job) = {
            let mut s = shared.lock();
            loop {
                if s.stop {
                    return;
                }
                if let Some(j) = s.jobs.pop_front() {
                    s.running = Some(j.0);
                    break j;
                }
                s = shared.wake.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        };
        let started = Instant::now();
        let ctx = job.ctx();
        let outcome = apex_interpose::quietly(|| run(shared.cuda.as_ref(), &job))
            .unwrap_or_else(|| job.failed("an internal error (a panic) in the set-up".into()));
        let took = started.elapsed();
        let mut s = shared.lock();
        if s.abandoned {
            // The engine gave up waiting at the end of the process or of the context: the context may be gone,
            // so nothing made in it may be dropped (a drop would call into RM and libcuda on a destroyed context).
            s.running = None;
            drop(s);
            std::mem::forget(outcome);
            std::mem::forget(job);
            shared.finished.notify_all();
            warn!("a set-up piece finished after the preload stopped waiting for it: leaked");
            return;
        }
        // The job's share of its GPU goes while the job still counts as running: the engine drops its own only
        // after `quiesce` saw the worker idle, so this never drops the last one (which would free the GPU here).
        drop(job);
        debug!(
            ctx = format_args!("{ctx:#x}"),
            ticket,
            took_us = took.as_micros(),
            "set-up piece ready"
        );
        s.done.push(Done {
            ctx,
            ticket,
            took,
            outcome,
        });
        s.running = None;
        shared.ready.store(true, Ordering::Relaxed);
        drop(s);
        shared.finished.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use apex::{AssertFailure, VariableHome};

    use crate::cuda::{Pointer, ReleaseMark};
    use crate::order::StreamKey;

    /// A libcuda whose attach waits until `open` is set, then fails (the worker's bookkeeping is what is tested), and
    /// which gives every module variable `home`.
    #[derive(Default)]
    struct SlowAttach {
        open: AtomicBool,
        home: Option<VariableHome>,
        /// The variables `global` was asked for.
        asked: std::sync::Mutex<Vec<String>>,
    }

    impl CudaSide for SlowAttach {
        fn current_context(&self) -> Option<usize> {
            None
        }
        fn set_current(&self, _: Option<usize>) -> Result<(), String> {
            Ok(())
        }
        fn attach(&self) -> Result<(Gpu, bool), String> {
            let t = Instant::now();
            while !self.open.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err("no GPU here".into())
        }
        fn stream_blocking(&self, _: usize) -> bool {
            true
        }
        fn stream_context(&self, _: usize) -> Option<usize> {
            None
        }
        fn function_name(&self, _: usize) -> Option<String> {
            None
        }
        fn max_dynamic_shared(&self, _: usize) -> Option<u32> {
            None
        }
        fn function_owner(&self, _: usize, _: &dyn Fn(usize) -> bool) -> Option<usize> {
            None
        }
        fn global(&self, _: Owner, _: bool, name: &str) -> Option<VariableHome> {
            self.asked.lock().unwrap().push(name.to_string());
            self.home
        }
        fn cuda_waits_for_apex(&self, _: &mut Queue, _: StreamKey) -> Result<(), String> {
            Ok(())
        }
        fn apex_waits_for_cuda(&self, _: &mut Queue, _: StreamKey) -> Result<(), String> {
            Ok(())
        }
        fn release_for_cuda(&self, _: &mut Queue) -> Result<ReleaseMark, String> {
            Err("not in this test".into())
        }
        fn cuda_waits_for_release(
            &self,
            _: &mut Queue,
            _: StreamKey,
            _: ReleaseMark,
        ) -> Result<(), String> {
            Ok(())
        }
        fn stream_idle(&self, _: usize) -> bool {
            false
        }
        fn record_event_after(
            &self,
            _: usize,
            _: &mut Queue,
            _: usize,
            _: &mut usize,
        ) -> Result<(), String> {
            Ok(())
        }
        fn record_event_now(&self, _: usize, _: usize, _: &mut usize) -> Result<(), String> {
            Ok(())
        }
        fn replay_asserts(&self, _: usize, _: &[AssertFailure]) -> Result<(), String> {
            Ok(())
        }
        fn pointer(&self, _: u64, _: usize) -> Pointer {
            Pointer::Other
        }
        fn stream_priority(&self, _: usize) -> i32 {
            0
        }
        fn sleeps_while_waiting(&self, _: usize) -> bool {
            false
        }
        fn sleeping_event(&self, _: usize) -> Result<usize, String> {
            Err("no events".into())
        }
        fn sleep_on_event(&self, _: usize) -> Result<(), String> {
            Ok(())
        }
    }

    /// A module loads when CUDA gives every `__device__` variable it has at the same size; the compiler's constants
    /// (printf formats, an assert's function name) are not asked for. A variable CUDA does not give, or gives at
    /// another size, refuses it.
    #[test]
    fn only_compiler_constants_load_unshared() {
        const PRINTF: &[u8] =
            include_bytes!("../../kernels/conformance/printf_kernels.sm_90.cubin");
        const DATA: &[u8] = include_bytes!("../../kernels/conformance/module_data.sm_90.cubin");
        let (gpu, _sim) = Gpu::open_simulated(apex::rm::sim::SimConfig::default()).unwrap();
        let none = SlowAttach::default();
        let loaded = load_module_timed(&none, &gpu, 1, false, PRINTF, true).0;
        assert!(loaded.is_ok(), "{:?}", loaded.err());
        match load_module_timed(&none, &gpu, 2, false, DATA, true).0 {
            Err(Refusal::ModuleGlobals(name)) => assert_eq!(name, "dev_value"),
            other => panic!("module_data: {:?}", other.err()),
        }
        // CUDA has the variable, at another size: not the same variable.
        let wrong_size = SlowAttach {
            home: Some(VariableHome {
                address: 0x7000_0000,
                size: 1,
            }),
            ..SlowAttach::default()
        };
        match load_module_timed(&wrong_size, &gpu, 3, false, DATA, true).0 {
            Err(Refusal::ModuleGlobals(name)) => assert_eq!(name, "dev_value"),
            other => panic!("module_data with mismatched sizes: {:?}", other.err()),
        }
        let loaded = load_module_timed(&wrong_size, &gpu, 4, false, PRINTF, true).0;
        assert!(
            loaded.is_ok(),
            "constants never asked for: {:?}",
            loaded.err()
        );
        // Every asked variable was a `__device__` variable, never a constant.
        let asked = wrong_size.asked.lock().unwrap().clone();
        assert!(asked.iter().any(|n| n == "dev_value"), "{asked:?}");
        assert!(
            !asked
                .iter()
                .any(|n| n.starts_with("__unnamed_") || n.starts_with("$str")),
            "{asked:?}"
        );
    }

    fn attach_job(ctx: usize) -> Job {
        Job::Attach {
            ctx,
            options: QueueOptions::default(),
        }
    }

    /// Waits until job `ticket` runs.
    fn running(w: &Worker, ticket: u64) {
        let t = Instant::now();
        while w.shared.lock().running != Some(ticket) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "job {ticket} never ran"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_queued_job_is_withdrawn_and_a_running_one_waited_for() {
        let cuda = Arc::new(SlowAttach::default());
        let mut w = Worker::new(cuda.clone());
        let first = w.submit(attach_job(1)).unwrap();
        let second = w.submit(attach_job(2)).unwrap();
        running(&w, first);
        assert_eq!(
            w.withdraw(second, Duration::ZERO),
            Withdrawn::Dropped,
            "queued: never runs"
        );
        assert_eq!(
            w.withdraw(first, Duration::from_millis(20)),
            Withdrawn::StillRunning
        );
        assert!(!w.has_results());
        cuda.open.store(true, Ordering::Relaxed);
        assert_eq!(
            w.withdraw(first, Duration::from_secs(30)),
            Withdrawn::Finished
        );
        assert!(w.wait_idle(Duration::from_secs(30)));
        assert!(w.has_results());
        let done = w.take();
        assert!(!w.has_results());
        assert_eq!(done.len(), 1, "the withdrawn job never ran");
        assert_eq!((done[0].ctx, done[0].ticket), (1, first));
        assert!(matches!(
            &done[0].outcome,
            Outcome::Attached { result: Err(e), first: None } if e == "no GPU here"
        ));
    }

    #[test]
    fn stopping_drops_queued_jobs_and_abandons_one_that_runs_past_the_bound() {
        let cuda = Arc::new(SlowAttach::default());
        let mut w = Worker::new(cuda.clone());
        let first = w.submit(attach_job(1)).unwrap();
        w.submit(attach_job(2)).unwrap();
        running(&w, first);
        let t = Instant::now();
        assert!(!w.quiesce(Duration::from_millis(50)), "abandoned");
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(w.submit(attach_job(3)).is_err(), "stopped for good");
        cuda.open.store(true, Ordering::Relaxed);
        // The abandoned job ends without handing anything back.
        let t = Instant::now();
        while w.shared.lock().running.is_some() {
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!w.has_results() && w.take().is_empty());

        // A job that finishes within the bound is handed back, and nothing queued runs after it.
        let cuda = Arc::new(SlowAttach::default());
        let mut w = Worker::new(cuda.clone());
        let first = w.submit(attach_job(1)).unwrap();
        w.submit(attach_job(2)).unwrap();
        running(&w, first);
        let opener = {
            let cuda = cuda.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cuda.open.store(true, Ordering::Relaxed);
            })
        };
        assert!(w.quiesce(Duration::from_secs(30)));
        opener.join().unwrap();
        let done = w.take();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].ticket, first);
    }

    #[test]
    fn the_mode_is_inline_unless_background_is_asked_for() {
        assert_eq!(Mode::by(None), Mode::Inline);
        assert_eq!(Mode::by(Some("background")), Mode::Background);
        assert_eq!(Mode::by(Some("inline")), Mode::Inline);
        assert_eq!(Mode::by(Some("something")), Mode::Inline);
        assert_eq!(Mode::Inline.label(), "inline");
        assert_eq!(Mode::Background.label(), "background");
    }
}
