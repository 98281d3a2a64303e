//! Synchronization without hops: the ordering of CUDA work with APEX's queues, stream and context synchronizes,
//! queries and events answered from APEX's fences, and device asserts reported as libcuda reports its own.
//!
//! A synchronization runs in two steps around a wait that holds no lock: `*_begin` decides under the engine's lock
//! and returns the fences to wait for, the caller waits for them without the lock (other threads keep launching, and
//! a kernel that waits for another thread's CUDA call still gets it), and `*_end` applies what the wait showed under
//! the lock again. The single-threaded forms (`stream_sync`, ...) run the three in a row, for the tests.

use super::*;

/// What a synchronizing hook asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SyncKind {
    /// `cuStreamSynchronize`: wait.
    Wait,
    /// `cuStreamQuery`: look.
    Query,
}

/// What the engine made of a call: answered (the hook returns this code without calling libcuda), or libcuda must
/// run it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Return this `CUresult`; libcuda is not called.
    Done(c_int),
    /// Call libcuda.
    Forward,
}

/// What the first step of a synchronization decided: the answer, or the fences to wait for first.
pub(crate) enum Step {
    /// Answered (or to be answered by libcuda) without waiting.
    Answer(Answer),
    /// Wait for these, outside the engine's lock, then take the last step.
    Wait(Waits),
}

/// Fences of one context's queues to wait for outside the engine's lock.
pub(crate) struct Waits {
    /// The context's index, and its handle (checked again after the wait).
    pub(super) ctx: usize,
    pub(super) handle: usize,
    /// (slot, the fence of its last launch when the wait began).
    pub(super) items: Vec<(usize, Fence)>,
}

impl Waits {
    /// Waits for every fence (as long as the work runs), without draining the printf FIFO.
    pub(crate) fn wait(&self) -> Result<(), String> {
        for (_, f) in &self.items {
            wait_fence(f)?;
        }
        Ok(())
    }

    /// Waits for every fence for at most `bound`: `None` while work still runs then.
    pub(crate) fn wait_briefly(&self, bound: Duration) -> Option<Result<(), String>> {
        let started = std::time::Instant::now();
        for (_, f) in &self.items {
            let Some(d) = f.direct() else {
                // A driver-backed queue's fence is libcuda's own wait (which sleeps as the context says).
                if let Err(e) = wait_fence(f) {
                    return Some(Err(e));
                }
                continue;
            };
            match d.wait(bound.saturating_sub(started.elapsed())) {
                Ok(()) => {}
                Err(apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })) => {
                    return None;
                }
                Err(e) => return Some(Err(e.to_string())),
            }
        }
        Some(Ok(()))
    }
}

/// An event of the preload's own whose synchronize sleeps, and the stream of its own it is recorded on (0 until
/// first used): recorded on a stream shared with other work, its synchronize would wait for that work too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sleeper {
    pub(crate) event: usize,
    pub(crate) stream: usize,
}

impl Sleeper {
    /// A sleeper from context `handle`'s pool, or a new one.
    pub(super) fn take(
        pool: &mut Vec<Sleeper>,
        cuda: &dyn CudaSide,
        handle: usize,
    ) -> Option<Sleeper> {
        pool.pop().or_else(|| {
            cuda.sleeping_event(handle)
                .inspect_err(|e| debug!(error = %e, "no sleeping event; the wait spins"))
                .ok()
                .map(|event| Sleeper { event, stream: 0 })
        })
    }
}

/// A wait that sleeps in libcuda ([`Engine::sleep_ticket`]): on `sleeper`'s event, in context `ctx`.
pub(crate) struct Sleep {
    /// What sleeps ([`CudaSide::sleep_on_event`]).
    pub(crate) cuda: Arc<dyn CudaSide>,
    /// The context's handle, whose pool gets the sleeper back.
    ctx: usize,
    /// The event slept on, and its stream.
    pub(crate) sleeper: Sleeper,
}

/// Where a queue's last launch stands, looked at without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    Done,
    Running,
    /// The queue's channel faulted: libcuda must answer (with the context's error).
    Failed,
}

/// Where the work before `fence` stands: complete, running, or never to complete (a fault).
pub(super) fn fence_state(fence: &Fence) -> SlotState {
    if fence.is_done() {
        return SlotState::Done;
    }
    let Some(f) = fence.direct() else {
        return SlotState::Running;
    };
    // A zero-length wait looks at the channel's error notifier as well.
    match f.wait(Duration::ZERO) {
        Ok(()) => SlotState::Done,
        Err(apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })) => {
            SlotState::Running
        }
        Err(_) => SlotState::Failed,
    }
}

/// Set when a failed assert could not be replayed through libcuda: every call through the preload then answers
/// this (`CUDA_ERROR_ASSERT`), as libcuda's failed context would.
pub(crate) static STICKY: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The sticky error the preload answers every call with, if any.
pub(crate) fn sticky() -> Option<c_int> {
    match STICKY.load(Ordering::Relaxed) {
        0 => None,
        e => Some(e),
    }
}

/// What [`Engine::before`] found out about a CUDA operation's site, so that [`Engine::after`] needs no second look
/// (no `cuCtxGetCurrent`, no search of the taken-over streams): valid while the engine's generation is unchanged (no
/// context attached or dropped, no stream taken over or released meanwhile, by any thread); otherwise `after` looks
/// again, as it always did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ordered {
    generation: u64,
    /// The attached context concerned (its index) and its epoch after `before`; `None`: no attached context is.
    ctx: Option<(usize, u64)>,
    /// A live queue of that context is related to the site: `after` marks it as having CUDA work to wait for.
    related: bool,
}

/// What a forwarded context synchronize must find unchanged when it returns for the context's CUDA work to count as
/// complete: the context's epoch and the count of calls forwarded without the engine ([`super::plain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CtxMark {
    epoch: u64,
    plain: u64,
}

impl CtxMark {
    /// Nothing to complete (the synchronize was answered, or failed). Epochs start at 1.
    pub(crate) const NONE: CtxMark = CtxMark { epoch: 0, plain: 0 };
}

impl Ordered {
    /// No answer from the engine (it was unreachable): `after` looks again.
    pub(crate) const UNKNOWN: Ordered = Ordered {
        generation: u64::MAX,
        ctx: None,
        related: true,
    };
}

impl Engine {
    // ---- ordering with CUDA ----

    /// Before a CUDA operation that adds work at `site`: related queues' work is handed to CUDA (a hop, unless it
    /// is complete already). The answer is for [`after`](Self::after).
    pub(crate) fn before(&mut self, site: Site) -> Ordered {
        let ci = self.site_context(site);
        self.before_at(ci, site)
    }

    /// Before a capture begins on this thread: every queue's work handed to CUDA ([`Target::CaptureBegins`]: a
    /// captured stream, or one an event joins into the capture, can take no hop while it captures), but other threads'
    /// per-thread default streams, which their own thread hands over at its next CUDA call on them.
    pub(crate) fn before_capture(&mut self) {
        let Some(ci) = self.site_context(Site::Device) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        ctx.epoch += 1;
        if ctx.order.live() > 0 {
            let (mut hops, order) = ctx.hops(cuda);
            if let Err(e) = order.before_cuda(Target::CaptureBegins, &mut hops) {
                warn!(error = %e, "cannot hand APEX's queues to CUDA before a capture");
            }
        }
    }

    /// [`before`](Self::before) for CUDA work the program gave libcuda through driver function `name`, counted for
    /// the summary by the name's address (one word hashed).
    pub(crate) fn before_work(&mut self, site: Site, name: &'static str) -> Ordered {
        self.count_work(name);
        self.before(site)
    }

    /// Counts CUDA work given to libcuda through driver function `name`, for the summary.
    fn count_work(&mut self, name: &'static str) {
        self.cuda_work
            .entry(name.as_ptr() as usize)
            .or_insert((name, 0))
            .1 += 1;
    }

    /// A stream-ordered free at `site` (through driver function `name`) that the allocation cache keeps: where the
    /// stream's work up to it stands. `Ok((context, fence))` when the stream is taken over and its queue's last launch
    /// stands for all of its work: nothing on its CUDA side or a related stream that the queue has not waited for, and
    /// the last launch of every related queue waited for (CUDA orders the free after the legacy stream's earlier work
    /// for a blocking stream, and after every blocking stream's for the legacy one), as for an event kept on APEX.
    /// Otherwise only CUDA can mark the point: the stream is ordered after related queues as the free itself would
    /// have been (counted as `name`), and the answer is for [`after`](Self::after) once the mark is recorded.
    pub(crate) fn free_point(
        &mut self,
        site: Site,
        name: &'static str,
    ) -> Result<(usize, Fence), Ordered> {
        let found = self.site_context(site);
        if let (Some(ci), Site::Stream(raw, pt)) = (found, site)
            && self.contexts[ci].failed.is_none()
        {
            let cuda = self.cuda.as_ref();
            let ctx = &mut self.contexts[ci];
            let stream = ctx.stream(cuda, raw, pt);
            if let Some(slot) = ctx.order.find(stream.key)
                && ctx.order.cuda_clean(slot)
                && ctx.order.covers_related(slot)
                && let Some(Ok(fence)) = ctx.last_fence(slot)
            {
                return Ok((ctx.handle, fence));
            }
        }
        self.count_work(name);
        Err(self.before_at(found, site))
    }

    /// Before a stream waits for an event in libcuda (`cuStreamWaitEvent` for an event the preload did not keep),
    /// counted as `name`: as [`before_work`](Self::before_work), but the stream's own queue is not handed to CUDA
    /// first ([`Order::before_cuda_wait`]; related streams' queues are, as CUDA orders the wait after them). A wait
    /// adds no work of its own, only a condition on what follows it: the stream's later APEX launches wait for its
    /// CUDA side (which holds the wait), and later CUDA work hands the queue over when it comes. Handing it over here
    /// cost a `cuStreamWaitValue64` per wait (NCCL waits on its stream before every collective).
    pub(crate) fn before_stream_wait(&mut self, site: Site, name: &'static str) -> Ordered {
        self.count_work(name);
        let ci = self.site_context(site);
        self.ordered_at(ci, site, false)
    }

    /// `cuStreamWaitEvent(site, event)`, what can be decided under one lock: for an event the preload did not keep,
    /// the wait ordered ([`before_stream_wait`](Self::before_stream_wait), `Err` for [`after`](Self::after)); for one
    /// it kept, the wait made on the GPU (`Ok`: [`wait_on_apex`](Self::wait_on_apex), else
    /// [`wait_cuda_on_kept`](Self::wait_cuda_on_kept), only where `on_apex`). `None`: the kept event must be recorded
    /// in libcuda first ([`super::materialize`], which waits without the lock), then the wait ordered.
    pub(crate) fn stream_wait(
        &mut self,
        event: usize,
        site: Site,
        name: &'static str,
        on_apex: bool,
    ) -> Option<Result<c_int, Ordered>> {
        if self.event_home(event).is_none() {
            return Some(Err(self.before_stream_wait(site, name)));
        }
        if !on_apex {
            return None;
        }
        self.wait_on_apex(event, site)
            .or_else(|| self.wait_as_dependency(event, site))
            .or_else(|| self.wait_cuda_on_kept(event, site, name))
            .map(Ok)
    }

    /// [`before`](Self::before) with the site's context found already (`ci`, under the same lock).
    pub(super) fn before_at(&mut self, ci: Option<usize>, site: Site) -> Ordered {
        self.ordered_at(ci, site, true)
    }

    /// [`before_at`](Self::before_at); `hand_over`: related queues' work is handed to CUDA (not for a wait).
    fn ordered_at(&mut self, ci: Option<usize>, site: Site, hand_over: bool) -> Ordered {
        if let Some(ci) = ci {
            // Work for libcuda on a stream kept as waits only: libcuda holds the waits first.
            self.make_real(ci, site);
        }
        let generation = self.generation;
        let Some(ci) = ci else {
            self.remember_plain(site, None);
            return Ordered {
                generation,
                ctx: None,
                related: false,
            };
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        ctx.epoch += 1;
        let mut related = false;
        if ctx.order.live() > 0 {
            let target = match site {
                Site::Stream(raw, pt) => Target::Stream(ctx.stream(cuda, raw, pt)),
                Site::Device => Target::Device,
            };
            related = match target {
                Target::Stream(s) => ctx.order.related(s).next().is_some(),
                Target::Device | Target::CaptureBegins => true,
            };
            if related {
                let (mut hops, order) = ctx.hops(cuda);
                let handed = match (hand_over, target) {
                    (false, Target::Stream(s)) => order.before_cuda_wait(s, &mut hops),
                    _ => order.before_cuda(target, &mut hops),
                };
                if let Err(e) = handed {
                    warn!(error = %e, "cannot order a CUDA operation after APEX's queue");
                }
            }
        }
        let epoch = ctx.epoch;
        if !related {
            self.remember_plain(site, Some(ci));
        }
        Ordered {
            generation,
            ctx: Some((ci, epoch)),
            related,
        }
    }

    /// A stream no queue relates to, found in context `ci`: the hooks forward its next calls that need nothing else
    /// of the engine without it ([`super::plain`]) until relations change. Only where `ci` is the stream's own
    /// context (libcuda asked once per stream): the context was found through the calling thread's current one,
    /// which another thread's later calls on the stream need not share. Not with chained queues, whose held launches
    /// every entry into the engine sends.
    fn remember_plain(&mut self, site: Site, ci: Option<usize>) {
        let (Site::Stream(raw, pt), Some(ci)) = (site, ci) else {
            return;
        };
        let StreamKey::Handle(h) = StreamKey::of(raw, pt) else {
            return;
        };
        if self.config.chained {
            return;
        }
        let cuda = self.cuda.as_ref();
        let own = *self
            .stream_ctx
            .entry(h)
            .or_insert_with(|| cuda.stream_context(h).unwrap_or(0));
        if own != 0 && self.contexts.get(ci).is_some_and(|c| c.handle == own) {
            self.plain.remember(h, ci);
        }
    }

    /// After a CUDA operation that added work at `site`; `o`: what [`before`](Self::before) answered. `completed`:
    /// the call returned only once the stream's work was done (a synchronous copy to the host): the stream then needs
    /// no hop, unless other work came in between.
    pub(crate) fn after(&mut self, site: Site, o: Ordered, completed: bool) {
        let Site::Stream(raw, pt) = site else { return };
        if o.generation != self.generation {
            return self.after_looked_up(site, o.ctx.filter(|_| completed).map(|(_, e)| e));
        }
        // Nothing attached or taken over since `before`: its findings hold.
        let Some((ci, epoch)) = o.ctx else { return };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        let unchanged = completed && ctx.epoch == epoch;
        ctx.epoch += 1;
        if !o.related {
            // No queue waits for this stream's work, and none may be marked.
            return;
        }
        let s = ctx.stream(cuda, raw, pt);
        ctx.order.after_cuda(s);
        if unchanged {
            ctx.order.cuda_synchronized(s);
        }
    }

    /// [`after`](Self::after) with the site's context looked up again (`completed`: the epoch `before` returned,
    /// when the stream's work is done as the call returns).
    fn after_looked_up(&mut self, site: Site, completed: Option<u64>) {
        let Site::Stream(raw, pt) = site else { return };
        let Some(ci) = self.site_context(site) else {
            return;
        };
        // The call reached libcuda after the stream began to be kept as waits only (by another thread, after this
        // call was let through): libcuda holds work of it now, so records on it must go to libcuda from here on.
        self.make_real(ci, site);
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        ctx.cuda_work = true;
        let unchanged = completed == Some(ctx.epoch);
        ctx.epoch += 1;
        if ctx.order.live() == 0 {
            return;
        }
        let s = ctx.stream(cuda, raw, pt);
        ctx.order.after_cuda(s);
        if unchanged {
            ctx.order.cuda_synchronized(s);
        }
    }

    // ---- synchronization ----
    //
    // A synchronization runs in two steps around a wait that holds no lock: `*_begin` decides under the engine's lock
    // and returns the fences to wait for, the caller waits for them without the lock (other threads keep launching,
    // and a kernel that waits for another thread's CUDA call still gets it), and `*_end` applies what the wait
    // showed under the lock again. The single-threaded forms (`stream_sync`, ...) run the three in a row.

    /// The fences of `slots` in context `ci`, to wait for.
    pub(super) fn waits(&self, ci: usize, slots: impl IntoIterator<Item = usize>) -> Step {
        let ctx = &self.contexts[ci];
        let items = slots
            .into_iter()
            .filter_map(|s| Some((s, ctx.last_fence(s)?.ok()?)))
            .collect();
        Step::Wait(Waits {
            ctx: ci,
            handle: ctx.handle,
            items,
        })
    }

    /// A wait for `w`'s fences that has spun for a while, where the program asked CUDA to sleep while it waits
    /// (the context made with `CU_CTX_SCHED_BLOCKING_SYNC`, or the program's `event` with `CU_EVENT_BLOCKING_SYNC`):
    /// an event of the preload's own, recorded in libcuda after every waited queue's work on a stream of its own, for
    /// the caller to sleep on without the lock. `None` to go on spinning: the program did not ask to sleep, the context is gone or failed,
    /// or a queue has launched since the fence waited for (waiting for that later work too could wait for work that
    /// itself waits for what follows this wait).
    pub(crate) fn sleep_ticket(&mut self, w: &Waits, event: Option<usize>) -> Option<Sleep> {
        let cuda = self.cuda.clone();
        let event_sleeps = event.is_some_and(|e| self.event_sleeps.contains_key(&e));
        let ctx = self
            .contexts
            .get_mut(w.ctx)
            .filter(|c| c.handle == w.handle && c.failed.is_none())?;
        if !event_sleeps && !cuda.sleeps_while_waiting(ctx.handle) {
            return None;
        }
        let running: Vec<usize> = w
            .items
            .iter()
            .filter(|(_, f)| !f.is_done())
            .map(|&(slot, ref f)| {
                let latest = ctx
                    .last_fence(slot)
                    .and_then(Result::ok)
                    .and_then(|l| Some(l.direct()?.value()));
                (latest.is_some() && latest == f.direct().map(|d| d.value())).then_some(slot)
            })
            .collect::<Option<_>>()?;
        if running.is_empty() {
            return None;
        }
        let mut sleeper = Sleeper::take(&mut ctx.sleepers, cuda.as_ref(), ctx.handle)?;
        for slot in running {
            let recorded = match ctx.queues.get_mut(slot).and_then(Option::as_mut) {
                Some(q) => {
                    cuda.record_event_after(ctx.handle, q, sleeper.event, &mut sleeper.stream)
                }
                None => Err("the queue is gone".into()),
            };
            if let Err(e) = recorded {
                debug!(error = %e, "cannot record a sleeping event after an APEX queue; the wait spins");
                // Its stream may already wait for some queues' work: the next wait that takes the event records it
                // on a new stream (this one is left to libcuda, which frees it with the context).
                sleeper.stream = 0;
                ctx.sleepers.push(sleeper);
                return None;
            }
        }
        self.summary.syncs_asleep += 1;
        Some(Sleep {
            cuda,
            ctx: w.handle,
            sleeper,
        })
    }

    /// A sleep [`sleep_ticket`](Self::sleep_ticket) arranged has ended: its event is free for the next.
    pub(crate) fn slept(&mut self, sleep: Sleep) {
        if let Some(ci) = self.find_context(sleep.ctx) {
            self.contexts[ci].sleepers.push(sleep.sleeper);
        }
    }

    /// After the waits of `w` (`waited`): the queues whose last launch is still the one waited for are complete;
    /// `None` when the context is gone or a queue failed (libcuda then answers).
    pub(super) fn waited(&mut self, w: &Waits, waited: &Result<(), String>) -> Option<usize> {
        let ci = w.ctx;
        if self.contexts.get(ci).is_none_or(|c| c.handle != w.handle) {
            return None;
        }
        if let Err(e) = waited {
            // A fault: libcuda reports the context's error (the queues are in its channel group).
            debug!(error = %e, "an APEX queue faulted; libcuda answers");
            return None;
        }
        let ctx = &mut self.contexts[ci];
        for (slot, fence) in &w.items {
            // A launch another thread made meanwhile is not complete.
            let same = ctx
                .last_fence(*slot)
                .and_then(Result::ok)
                .and_then(|f| Some(f.direct()?.value()))
                == fence.direct().map(|f| f.value());
            if same {
                ctx.order.apex_complete(*slot);
            }
        }
        Some(ci)
    }

    /// `cuStreamSynchronize` / `cuStreamQuery` at `site`, first step: the queue's work is waited for (or looked at)
    /// on the CPU; libcuda is called only where the stream holds CUDA work of its own, with no hop before it.
    pub(crate) fn stream_sync_begin(&mut self, site: Site, kind: SyncKind) -> Step {
        let Site::Stream(raw, pt) = site else {
            return Step::Answer(Answer::Forward);
        };
        let Some(ci) = self.site_context(site) else {
            return Step::Answer(Answer::Forward);
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        if let Some(step) = self.dependency_sync(ci, site, kind) {
            return step;
        }
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        // A failed context answers through libcuda, which keeps its error; a capture makes libcuda's answer an error.
        if ctx.order.live() == 0 || ctx.failed.is_some() || !self.capturing.is_empty() {
            return Step::Answer(Answer::Forward);
        }
        let stream = ctx.stream(cuda, raw, pt);
        let own = ctx.order.find(stream.key);
        // The slots whose work the stream's synchronize covers: its own queue, and for the legacy stream every
        // blocking stream's queue (conservative: CUDA's legacy stream orders itself after their work).
        let slots: Vec<usize> = if stream.key == StreamKey::Legacy {
            ctx.order.related(stream).collect()
        } else {
            own.into_iter().collect()
        };
        if kind == SyncKind::Query {
            for &s in &slots {
                match ctx.slot_state(s) {
                    SlotState::Done => {}
                    SlotState::Running => {
                        self.summary.syncs_on_cpu += 1;
                        return Step::Answer(Answer::Done(CUDA_ERROR_NOT_READY));
                    }
                    SlotState::Failed => return Step::Answer(Answer::Forward),
                }
            }
        }
        self.waits(ci, slots)
    }

    /// `cuStreamSynchronize` / `cuStreamQuery`, last step: the answer, and the generation to give
    /// [`stream_synced`](Self::stream_synced) after a forwarded call.
    pub(crate) fn stream_sync_end(
        &mut self,
        site: Site,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> (Answer, u64) {
        let Some(ci) = self.waited(w, waited) else {
            return (self.forward_after_asserts(w.ctx, w.handle), 0);
        };
        if let Some(a) = self.report_asserts(ci) {
            return (a, 0);
        }
        let Site::Stream(raw, pt) = site else {
            return (Answer::Forward, 0);
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let stream = ctx.stream(cuda, raw, pt);
        if let StreamKey::Handle(h) = stream.key
            && ctx.dependency.contains_key(&h)
        {
            // Still kept as waits only: the queue position it waits for is complete, and libcuda holds nothing of it.
            self.summary.syncs_on_cpu += 1;
            return (Answer::Done(CUDA_SUCCESS), 0);
        }
        match ctx.order.find(stream.key) {
            Some(slot) if ctx.order.cuda_clean(slot) => {
                self.summary.syncs_on_cpu += 1;
                (Answer::Done(CUDA_SUCCESS), 0)
            }
            _ => {
                self.summary.syncs_forwarded += 1;
                (Answer::Forward, ctx.epoch)
            }
        }
    }

    /// `cuStreamSynchronize` / `cuStreamQuery` in one thread (the steps in a row).
    #[cfg(test)]
    pub(crate) fn stream_sync(&mut self, site: Site, kind: SyncKind) -> Answer {
        match self.stream_sync_begin(site, kind) {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.stream_sync_end(site, &w, &waited).0
            }
        }
    }

    /// After a forwarded stream synchronize returned `result`; `epoch`: what [`stream_sync_end`](Self::stream_sync_end)
    /// returned (0: nothing to do).
    pub(crate) fn stream_synced(&mut self, site: Site, result: c_int, epoch: u64) {
        let Site::Stream(raw, pt) = site else { return };
        if result != CUDA_SUCCESS || epoch == 0 {
            return;
        }
        let Some(ci) = self.site_context(site) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        // Only if no work came in while libcuda synchronized (another thread's): that work is not complete.
        if ctx.epoch == epoch {
            let s = ctx.stream(cuda, raw, pt);
            ctx.order.cuda_synchronized(s);
        }
    }

    /// `cuCtxSynchronize`, first step: every queue of the current context waited for on the CPU.
    pub(crate) fn context_sync_begin(&mut self) -> Step {
        let Some(ci) = self.site_context(Site::Device) else {
            return Step::Answer(Answer::Forward);
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        let slots: Vec<usize> = self.contexts[ci].order.slots().collect();
        self.waits(ci, slots)
    }

    /// `cuCtxSynchronize`, last step: libcuda only if CUDA has had work since the context's last synchronize. The
    /// generation is for [`context_synced`](Self::context_synced).
    pub(crate) fn context_sync_end(
        &mut self,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> (Answer, CtxMark) {
        let Some(ci) = self.waited(w, waited) else {
            return (self.forward_after_asserts(w.ctx, w.handle), CtxMark::NONE);
        };
        if let Some(a) = self.report_asserts(ci) {
            return (a, CtxMark::NONE);
        }
        let ctx = &self.contexts[ci];
        // Calls the hooks forwarded without the engine since the last synchronize are CUDA work too.
        let plain = self.plain.work(ci);
        if ctx.cuda_work
            || plain != ctx.plain_synced
            || ctx.failed.is_some()
            || !self.capturing.is_empty()
        {
            self.summary.syncs_forwarded += 1;
            (
                Answer::Forward,
                CtxMark {
                    epoch: ctx.epoch,
                    plain,
                },
            )
        } else {
            self.summary.syncs_on_cpu += 1;
            (Answer::Done(CUDA_SUCCESS), CtxMark::NONE)
        }
    }

    /// `cuCtxSynchronize` in one thread.
    #[cfg(test)]
    pub(crate) fn context_sync(&mut self) -> Answer {
        match self.context_sync_begin() {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.context_sync_end(&w, &waited).0
            }
        }
    }

    /// After a forwarded `cuCtxSynchronize` returned `result` (`mark`: what `context_sync_end` returned).
    pub(crate) fn context_synced(&mut self, result: c_int, mark: CtxMark) {
        if result != CUDA_SUCCESS || mark == CtxMark::NONE {
            return;
        }
        if let Some(ci) = self.site_context(Site::Device) {
            let plain = self.plain.work(ci);
            let ctx = &mut self.contexts[ci];
            // Work another thread submitted while libcuda synchronized is not complete, whether through the engine
            // or forwarded without it.
            if ctx.epoch == mark.epoch && plain == mark.plain {
                ctx.order.context_synchronized();
                ctx.cuda_work = false;
                ctx.plain_synced = plain;
            }
        }
    }

    /// Before a CUDA call that frees or unloads what work may use, or needs the whole device idle, first step:
    /// every queue's work is waited for on the CPU (libcuda's own call waits for CUDA's), so no hop is needed.
    pub(crate) fn device_quiet_begin(&mut self) -> Step {
        let Some(ci) = self.site_context(Site::Device) else {
            return Step::Answer(Answer::Forward);
        };
        let slots: Vec<usize> = self.contexts[ci].order.slots().collect();
        self.waits(ci, slots)
    }

    /// Last step of [`device_quiet_begin`](Self::device_quiet_begin): a queue that could not be waited for is
    /// handed to CUDA instead; a failed assert is reported (libcuda's call then returns it).
    pub(crate) fn device_quiet_end(&mut self, w: &Waits, waited: &Result<(), String>) -> Answer {
        match self.waited(w, waited) {
            Some(ci) => self.report_asserts(ci).unwrap_or(Answer::Forward),
            None => {
                if let Some(ctx) = self
                    .contexts
                    .get_mut(w.ctx)
                    .filter(|c| c.handle == w.handle)
                {
                    let cuda = self.cuda.as_ref();
                    let (mut hops, order) = ctx.hops(cuda);
                    let _ = order.before_cuda(Target::Device, &mut hops);
                }
                self.report_asserts(w.ctx).unwrap_or(Answer::Forward)
            }
        }
    }

    /// Every queue of context `ci` waited for on the CPU, under the lock (at shutdown and when the takeover stops:
    /// nothing runs beside it then).
    pub(super) fn wait_all(&mut self, ci: usize) {
        if let Step::Wait(w) = self.waits(ci, self.contexts[ci].order.slots().collect::<Vec<_>>()) {
            let waited = w.wait();
            if self.waited(&w, &waited).is_none()
                && let Some(ctx) = self.contexts.get_mut(ci)
            {
                warn!("an APEX queue failed while the preload waited for it");
                let cuda = self.cuda.as_ref();
                let (mut hops, order) = ctx.hops(cuda);
                let _ = order.before_cuda(Target::Device, &mut hops);
            }
        }
    }

    /// Failed asserts of APEX's kernels in context `ci`, reported as libcuda reports its own. `Some` when one was:
    /// what the call that found it returns.
    pub(super) fn report_asserts(&mut self, ci: usize) -> Option<Answer> {
        let ctx = self.contexts.get_mut(ci)?;
        if !ctx.asserts_on_apex || !ctx.gpu.device_assert_pending() {
            return None;
        }
        let failures = match ctx.gpu.take_device_asserts() {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot read the failed device asserts");
                Vec::new()
            }
        };
        self.summary.asserts += failures.len() as u64;
        ctx.failed = Some(Refusal::AssertReported);
        // The context is unusable from here on, as libcuda makes it: the program's call reaches libcuda, which
        // answers CUDA_ERROR_ASSERT once the replay has run.
        match self.cuda.replay_asserts(ctx.handle, &failures) {
            Ok(()) => Some(Answer::Forward),
            Err(e) => {
                // libcuda could not replay (its context already failed, or no record survived): CUDA's lines printed
                // here, and every call through the preload answers CUDA_ERROR_ASSERT from now on.
                warn!(error = %e, "device asserts could not be replayed through libcuda");
                for f in &failures {
                    eprintln!("{f}");
                }
                STICKY.store(CUDA_ERROR_ASSERT, Ordering::Relaxed);
                Some(Answer::Done(CUDA_ERROR_ASSERT))
            }
        }
    }

    /// A failed assert of APEX's kernels in context `ci`, reported: what a call that found it returns
    /// (`CUDA_ERROR_ASSERT`, libcuda's context failed by the replay).
    pub(super) fn assert_answer(&mut self, ci: usize) -> Option<c_int> {
        match self.report_asserts(ci)? {
            Answer::Done(code) => Some(code),
            Answer::Forward => Some(CUDA_ERROR_ASSERT),
        }
    }

    /// libcuda answers, after a failed assert of the context (`ci`, if it is still `handle`) is reported.
    pub(super) fn forward_after_asserts(&mut self, ci: usize, handle: usize) -> Answer {
        self.summary.syncs_forwarded += 1;
        if self.contexts.get(ci).is_some_and(|c| c.handle == handle) {
            self.report_asserts(ci).unwrap_or(Answer::Forward)
        } else {
            Answer::Forward
        }
    }

    // ---- events ----

    /// `cuEventCreate` made `event` with `flags`.
    pub(crate) fn event_created(&mut self, event: usize, flags: u32) {
        // Kept by the preload only with CU_EVENT_DISABLE_TIMING (2), never with CU_EVENT_INTERPROCESS (4): another
        // process reads an interprocess event's state from libcuda.
        self.event_untimed
            .insert(event, flags & 2 != 0 && flags & 4 == 0);
        // CU_EVENT_BLOCKING_SYNC (1): a synchronize on it sleeps.
        if flags & 1 != 0 {
            self.event_sleeps.insert(event, ());
        } else {
            self.event_sleeps.remove(&event);
        }
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroyed(&mut self, event: usize) {
        self.event_untimed.remove(&event);
        self.event_sleeps.remove(&event);
        for c in &mut self.contexts {
            c.events.remove(&event);
        }
    }

    /// `cuEventRecord(event, site)`: recorded by the preload itself when everything it stands for is an APEX
    /// queue's work and the event does not time; otherwise the stream's queues are handed over and libcuda records
    /// it.
    pub(crate) fn event_record(&mut self, event: usize, site: Site) -> Answer {
        // A new record replaces the last one, wherever it was kept.
        for c in &mut self.contexts {
            c.events.remove(&event);
        }
        let Site::Stream(raw, pt) = site else {
            return Answer::Forward;
        };
        let untimed = self.event_untimed.get(&event).copied().unwrap_or(false);
        // Looked up once, for the record and for the ordering below.
        let found = self.site_context(site);
        let why = if !untimed {
            "the event times or is interprocess"
        } else if !self.capturing.is_empty() {
            "a stream is capturing"
        } else if crate::cupti::recording() {
            "a profiler records GPU activity"
        } else if let Some(ci) = found
            && self.contexts[ci].failed.is_none()
        {
            let cuda = self.cuda.as_ref();
            let ctx = &mut self.contexts[ci];
            let stream = ctx.stream(cuda, raw, pt);
            // Only a taken-over stream whose CUDA side holds nothing the queue did not wait for, and whose queue
            // waited for every related queue's last launch (CUDA orders a record on a blocking stream after the
            // legacy stream's earlier work): then the queue's last launch stands for all of it.
            // The legacy stream's record stands for every blocking stream's earlier work too: `covers_related`
            // (its queue waited for every related queue's last launch) and `cuda_clean` (no CUDA work on a related
            // stream it did not wait for) say the last launch covers it, as for a stream-ordered free.
            if let Some(slot) = ctx.order.find(stream.key) {
                if !ctx.order.cuda_clean(slot) {
                    "the stream has CUDA work its queue did not wait for"
                } else if !ctx.order.covers_related(slot) {
                    "a related queue launched since"
                } else if let Some(Ok(fence)) = ctx.last_fence(slot) {
                    ctx.events.insert(event, VirtualEvent { slot, fence });
                    self.summary.events_on_apex += 1;
                    return Answer::Done(CUDA_SUCCESS);
                } else {
                    "the queue launched nothing"
                }
            } else if let StreamKey::Handle(h) = stream.key
                && let Some(d) = ctx.dependency.get(&h)
            {
                // A stream kept as waits only: the event stands for the queue position it waits for.
                let kept = VirtualEvent {
                    slot: d.slot,
                    fence: d.fence.clone(),
                };
                ctx.events.insert(event, kept);
                self.summary.events_on_apex += 1;
                return Answer::Done(CUDA_SUCCESS);
            } else {
                "the stream was not taken over"
            }
        } else {
            "the context is not attached, or failed"
        };
        if let Some(ci) = found
            && self.logged.insert((self.contexts[ci].handle, why))
        {
            debug!(event, stream = raw, why, "event record left to libcuda");
        }
        self.before_at(found, site);
        Answer::Forward
    }

    /// A wait of stream `site` for `event` the preload may answer itself: the event is kept, the stream is of the
    /// event's context, which has not failed, and no capture runs. The context's index and the stream.
    fn kept_wait(&mut self, event: usize, site: Site) -> Option<(usize, StreamKey)> {
        let Site::Stream(raw, pt) = site else {
            return None;
        };
        if !self.capturing.is_empty() || crate::cupti::recording() {
            return None;
        }
        let ci = self.event_home(event)?;
        if self.site_context(site) != Some(ci) || self.contexts[ci].failed.is_some() {
            return None;
        }
        Some((ci, StreamKey::of(raw, pt)))
    }

    /// `cuStreamWaitEvent(site, event)` for an event the preload kept, by a taken-over stream of the event's context:
    /// the stream's queue waits for the event's fence on the GPU (a semaphore acquire; none when the event is of the
    /// same queue or complete), and libcuda sees nothing. `None`: libcuda waits, the event recorded there first.
    pub(crate) fn wait_on_apex(&mut self, event: usize, site: Site) -> Option<c_int> {
        let (ci, key) = self.kept_wait(event, site)?;
        // Only a stream taken over already: taking one over here (NCCL's internal stream, which waits and records
        // around every collective) made NCCL's kernels fault (an illegal address in all-reduce, 2× H200); left to
        // libcuda until that is understood.
        let slot = self.contexts[ci].order.find(key)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let v = ctx.events.get(&event)?;
        // Complete already, or of the same queue: nothing to wait for.
        if v.slot != slot && !v.fence.is_done() {
            let fence = v.fence.clone();
            if let Err(e) = ctx.run_on_queue(cuda, slot, |q, _| {
                q.join(&fence).map(Last::Fence).map_err(|e| e.to_string())
            }) {
                debug!(error = %e, "a queue could not wait for another's fence; libcuda waits");
                return None;
            }
        }
        self.summary.waits_on_apex += 1;
        Some(CUDA_SUCCESS)
    }

    /// `cuStreamWaitEvent(site, event)` on a stream APEX did not take over, for an event the preload kept: the wait
    /// made without libcuda recording the event. Complete already: nothing to wait for (no call at all). Standing for
    /// all of its queue's work so far (nothing sent on the queue since the record): the stream waits on the GPU for a
    /// release of the queue (`cuStreamWaitValue64`, the hop a forwarded call after the queue's work makes), where
    /// libcuda would otherwise record the event after the queue on the preload's own stream and the program's wait
    /// follow it (three driver calls). The event stays kept. `None`: the usual way (libcuda records it, then waits).
    pub(crate) fn wait_cuda_on_kept(
        &mut self,
        event: usize,
        site: Site,
        name: &'static str,
    ) -> Option<c_int> {
        let (ci, key) = self.kept_wait(event, site)?;
        let ctx = &self.contexts[ci];
        if ctx.order.find(key).is_some() {
            // A stream taken over waits on APEX ([`Engine::wait_on_apex`]).
            return None;
        }
        let v = ctx.events.get(&event)?;
        let slot = v.slot;
        if v.fence.is_done() {
            self.summary.hops_avoided += 1;
            return Some(CUDA_SUCCESS);
        }
        let latest = ctx
            .last_fence(slot)
            .and_then(Result::ok)
            .and_then(|f| Some(f.direct()?.value()));
        if latest.is_none() || latest != v.fence.direct().map(|f| f.value()) {
            return None;
        }
        ctx.queues.get(slot)?.as_ref()?;
        // Ordered as the program's own call would be, with the hop in its place.
        let o = self.before_work(site, name);
        let cuda = self.cuda.as_ref();
        let hop = match self.contexts[ci]
            .queues
            .get_mut(slot)
            .and_then(Option::as_mut)
        {
            Some(q) => cuda.cuda_waits_for_apex(q, key),
            None => Err("the event's queue is gone".into()),
        };
        self.after(site, o, false);
        match hop {
            Ok(()) => {
                self.summary.hops_to_cuda += 1;
                Some(CUDA_SUCCESS)
            }
            Err(e) => {
                debug!(error = %e, "a stream could not wait for a queue's release; libcuda records the event");
                None
            }
        }
    }

    pub(super) fn event_home(&self, event: usize) -> Option<usize> {
        self.contexts
            .iter()
            .position(|c| c.events.contains_key(&event))
    }

    /// `cuEventSynchronize` / `cuEventQuery`, first step: an event the preload kept is answered from its fence;
    /// any other goes to libcuda, after a failed assert of APEX's is reported (libcuda then answers with it).
    pub(crate) fn event_sync_begin(&mut self, event: usize, kind: SyncKind) -> Step {
        let Some(ci) = self.event_home(event) else {
            let current = self.site_context(Site::Device);
            return Step::Answer(
                current
                    .and_then(|ci| self.report_asserts(ci))
                    .unwrap_or(Answer::Forward),
            );
        };
        if let Some(a) = self.report_asserts(ci) {
            return Step::Answer(a);
        }
        let ctx = &mut self.contexts[ci];
        let Some(v) = ctx.events.get(&event) else {
            return Step::Answer(Answer::Forward);
        };
        if ctx.failed.is_some() {
            return Step::Answer(Answer::Forward);
        }
        if kind == SyncKind::Query {
            match fence_state(&v.fence) {
                SlotState::Done => {}
                SlotState::Running => {
                    self.summary.syncs_on_cpu += 1;
                    return Step::Answer(Answer::Done(CUDA_ERROR_NOT_READY));
                }
                SlotState::Failed => {
                    ctx.events.remove(&event);
                    return Step::Answer(Answer::Forward);
                }
            }
        }
        Step::Wait(Waits {
            ctx: ci,
            handle: ctx.handle,
            items: vec![(v.slot, v.fence.clone())],
        })
    }

    /// `cuEventSynchronize` / `cuEventQuery`, last step.
    pub(crate) fn event_sync_end(
        &mut self,
        event: usize,
        w: &Waits,
        waited: &Result<(), String>,
    ) -> Answer {
        if waited.is_err() {
            // The queue faulted: libcuda's event (never recorded) would say nothing; libcuda's context error is
            // what the program must see, from a call that reaches libcuda with the event recorded.
            if let Some(ctx) = self
                .contexts
                .get_mut(w.ctx)
                .filter(|c| c.handle == w.handle)
            {
                ctx.events.remove(&event);
            }
            return self.forward_after_asserts(w.ctx, w.handle);
        }
        if let Some(a) = self.report_asserts(w.ctx) {
            return a;
        }
        self.summary.syncs_on_cpu += 1;
        Answer::Done(CUDA_SUCCESS)
    }

    /// `cuEventSynchronize` / `cuEventQuery` in one thread.
    #[cfg(test)]
    pub(crate) fn event_sync(&mut self, event: usize, kind: SyncKind) -> Answer {
        match self.event_sync_begin(event, kind) {
            Step::Answer(a) => a,
            Step::Wait(w) => {
                let waited = w.wait();
                self.event_sync_end(event, &w, &waited)
            }
        }
    }

    /// Before libcuda looks at `event` (a stream waits for it, elapsed time, IPC), first step: an event the preload
    /// kept is recorded in libcuda now, on the preload's own stream. Its work complete: with nothing before it. Its
    /// queue has launched nothing since: after the queue's work. Otherwise its fence is returned to wait for first
    /// (waiting for the queue's later work too could wait for work that itself waits for what follows).
    pub(crate) fn materialize_begin(
        &mut self,
        event: usize,
        why: &'static str,
    ) -> Option<(Fence, usize)> {
        let ci = self.event_home(event)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let v = ctx.events.remove(&event)?;
        self.summary.events_materialized += 1;
        match self.summary.events_materialized_for.get_mut(why) {
            Some(n) => *n += 1,
            None => {
                self.summary
                    .events_materialized_for
                    .insert(why.to_string(), 1);
            }
        }
        debug!(event, why, "a kept event is recorded in libcuda");
        ctx.cuda_work = true;
        ctx.epoch += 1;
        let latest = ctx
            .last_fence(v.slot)
            .and_then(Result::ok)
            .and_then(|f| Some(f.direct()?.value()));
        let result = if v.fence.is_done() {
            cuda.record_event_now(ctx.handle, event, &mut ctx.side)
        } else if latest == v.fence.direct().map(|f| f.value()) {
            match ctx.queues.get_mut(v.slot).and_then(Option::as_mut) {
                Some(q) => cuda.record_event_after(ctx.handle, q, event, &mut ctx.side),
                None => Err("the event's queue is gone".into()),
            }
        } else {
            return Some((v.fence, ctx.handle));
        };
        if let Err(e) = result {
            warn!(error = %e, "cannot record an event after APEX's queue; waiting for the queue instead");
            return Some((v.fence, ctx.handle));
        }
        None
    }

    /// After the fence [`materialize_begin`](Self::materialize_begin) returned was waited for: libcuda records the
    /// event with nothing pending.
    pub(crate) fn materialize_end(&mut self, event: usize, handle: usize) {
        let Some(ci) = self.find_context(handle) else {
            return;
        };
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        if let Err(e) = cuda.record_event_now(ctx.handle, event, &mut ctx.side) {
            warn!(error = %e, "cannot record an event in libcuda");
        }
    }

    /// [`materialize_begin`](Self::materialize_begin), the wait and the end in one thread.
    pub(crate) fn materialize(&mut self, event: usize, why: &'static str) {
        if let Some((f, handle)) = self.materialize_begin(event, why) {
            let _ = wait_fence(&f);
            self.materialize_end(event, handle);
        }
    }

    /// Every event the preload kept recorded in libcuda, and every stream kept as waits only handed back to it
    /// (before a capture begins, and at the end).
    pub(crate) fn materialize_all(&mut self, why: &'static str) {
        self.materialize_events(why);
        for ci in 0..self.contexts.len() {
            let streams: Vec<usize> = self.contexts[ci].dependency.keys().copied().collect();
            for h in streams {
                self.make_real(ci, Site::Stream(h, false));
            }
        }
    }

    /// Every event the preload kept, recorded in libcuda (before a graph launches: its nodes may wait for them);
    /// `why` names the cause in the summary.
    pub(crate) fn materialize_events(&mut self, why: &'static str) {
        let events: Vec<usize> = self
            .contexts
            .iter()
            .flat_map(|c| c.events.keys().copied())
            .collect();
        for e in events {
            self.materialize(e, why);
        }
    }

    // ---- streams kept as waits only ----

    /// `cuStreamWaitEvent(site, event)` for an event the preload kept, by a stream APEX did not take over: the
    /// stream kept as waits only ([`DependencyStream`]), so that libcuda sees nothing of the wait and an event
    /// recorded on the stream later is kept too (standing for the same queue position). Taken only where that is
    /// exact: a non-blocking stream (no implicit wait for the legacy stream), idle in libcuda when it begins to be
    /// kept, waiting for one queue, and the event's launch either complete or the queue's last, so that the queue
    /// releases a mark right after it for libcuda to wait for if the stream later gets work ([`make_real`](
    /// Self::make_real)). `None`: the usual way (the stream waits in libcuda).
    pub(crate) fn wait_as_dependency(&mut self, event: usize, site: Site) -> Option<c_int> {
        let (ci, key) = self.kept_wait(event, site)?;
        let (Site::Stream(raw, pt), StreamKey::Handle(h)) = (site, key) else {
            return None;
        };
        let cuda = self.cuda.as_ref();
        // Only a stream of the event's own context (asked of libcuda once per stream): the calling thread's current
        // context need not be the stream's.
        let own = *self
            .stream_ctx
            .entry(h)
            .or_insert_with(|| cuda.stream_context(h).unwrap_or(0));
        let ctx = &mut self.contexts[ci];
        if ctx.order.find(key).is_some() || own != ctx.handle {
            return None;
        }
        let v = ctx.events.get(&event)?;
        let (slot, fence) = (v.slot, v.fence.clone());
        let value = fence.direct()?.value();
        let fresh = match ctx.dependency.get(&h) {
            // Two queues to wait for: libcuda waits (the usual way makes the stream real first).
            Some(d) if d.slot != slot => return None,
            Some(d) if d.fence.direct().is_some_and(|f| f.value() >= value) => {
                // An earlier launch of the queue the stream already waits after.
                self.summary.waits_on_apex += 1;
                return Some(CUDA_SUCCESS);
            }
            Some(_) => false,
            None => {
                if ctx.stream(cuda, raw, pt).blocking || !cuda.stream_idle(h) {
                    return None;
                }
                true
            }
        };
        let release = match fence_state(&fence) {
            SlotState::Done => None,
            SlotState::Failed => return None,
            SlotState::Running => {
                let latest = ctx
                    .last_fence(slot)
                    .and_then(Result::ok)
                    .and_then(|f| Some(f.direct()?.value()));
                if latest != Some(value) {
                    return None;
                }
                let q = ctx.queues.get_mut(slot)?.as_mut()?;
                match cuda.release_for_cuda(q) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        debug!(error = %e, "a queue cannot release a mark for CUDA; the stream waits in libcuda");
                        return None;
                    }
                }
            }
        };
        ctx.dependency.insert(
            h,
            DependencyStream {
                slot,
                fence,
                release,
            },
        );
        if fresh {
            // The hooks forward calls on streams they remember without the engine: this one's records must reach it.
            self.new_generation();
        }
        self.summary.waits_on_apex += 1;
        Some(CUDA_SUCCESS)
    }

    /// `cuStreamSynchronize` / `cuStreamQuery` of a stream kept as waits only, first step: answered from the queue
    /// position it waits for. `None`: not such a stream. Where the context failed or a capture runs, libcuda answers,
    /// holding the stream's waits first.
    fn dependency_sync(&mut self, ci: usize, site: Site, kind: SyncKind) -> Option<Step> {
        let Site::Stream(raw, pt) = site else {
            return None;
        };
        let StreamKey::Handle(h) = StreamKey::of(raw, pt) else {
            return None;
        };
        let ctx = &self.contexts[ci];
        let d = ctx.dependency.get(&h)?;
        let state =
            (ctx.failed.is_none() && self.capturing.is_empty()).then(|| fence_state(&d.fence));
        match state {
            Some(SlotState::Done) => {
                self.summary.syncs_on_cpu += 1;
                Some(Step::Answer(Answer::Done(CUDA_SUCCESS)))
            }
            Some(SlotState::Running) if kind == SyncKind::Query => {
                self.summary.syncs_on_cpu += 1;
                Some(Step::Answer(Answer::Done(CUDA_ERROR_NOT_READY)))
            }
            Some(SlotState::Running) => Some(Step::Wait(Waits {
                ctx: ci,
                handle: ctx.handle,
                items: vec![(d.slot, d.fence.clone())],
            })),
            Some(SlotState::Failed) | None => {
                self.make_real(ci, site);
                Some(Step::Answer(Answer::Forward))
            }
        }
    }

    /// A stream kept as waits only ([`DependencyStream`]) handed back to libcuda before libcuda gets work of it: the
    /// stream waits on the GPU for the queue's mark released right after the launch it waited for (nothing when
    /// that launch is complete or the context failed). Nothing for any other stream.
    pub(super) fn make_real(&mut self, ci: usize, site: Site) {
        let Site::Stream(raw, pt) = site else { return };
        let StreamKey::Handle(h) = StreamKey::of(raw, pt) else {
            return;
        };
        let Some(ctx) = self.contexts.get_mut(ci) else {
            return;
        };
        let Some(d) = ctx.dependency.remove(&h) else {
            return;
        };
        ctx.epoch += 1;
        let Some(release) = d.release else { return };
        if ctx.failed.is_some() || fence_state(&d.fence) != SlotState::Running {
            return;
        }
        let cuda = self.cuda.as_ref();
        let key = StreamKey::Handle(h);
        let Some(q) = ctx.queues.get_mut(d.slot).and_then(Option::as_mut) else {
            warn!("a stream that only waited lost its queue; its later work does not wait for it");
            return;
        };
        let waited = cuda.cuda_waits_for_release(q, key, release).or_else(|e| {
            // Waiting for the queue's later work too is late, never early.
            debug!(error = %e, "a stream cannot wait for a queue's mark; it waits for all of the queue's work");
            cuda.cuda_waits_for_apex(q, key)
        });
        match waited {
            Ok(()) => {
                ctx.cuda_work = true;
                self.summary.hops_to_cuda += 1;
            }
            Err(e) => {
                // Never early: the launch is waited for here, on the CPU, before libcuda gets the stream's work.
                warn!(error = %e, "a stream that only waited cannot wait for APEX's queue in libcuda; waiting on the CPU");
                self.summary.cpu_syncs += 1;
                if let Err(e) = wait_fence(&d.fence) {
                    warn!(error = %e, "the queue a stream waited for failed");
                }
            }
        }
    }
}
