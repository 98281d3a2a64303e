//! The engine's side of the background set-up ([`crate::setup`]): asking the worker for a piece, picking finished
//! pieces up at a launch, keeping `APEX_PRELOAD_QUEUES_AHEAD` queues (none by default) ready ahead of the next new
//! streams, and stopping the worker at the end.
//!
//! What is in flight is known by ticket: `Engine::attaching` (contexts), `Ctx::loading` (modules) and
//! `Ctx::building` (queues, which serve no stream until one takes them). A result whose ticket is no longer
//! expected — its module unloaded, the takeover ended — is dropped; a queue whose stream was destroyed while it was
//! built serves the next new stream instead.

use tracing::{info, warn};

use super::{Engine, Mode};
use crate::Refusal;
use crate::setup::{Done, Job, Outcome, Withdrawn};

impl Engine {
    /// Gives `job` to the set-up worker: its ticket, or `None` when the worker cannot start (then the set-up is made
    /// on the program's threads from now on, as with `APEX_PRELOAD_SETUP=inline`).
    pub(super) fn request(&mut self, job: Job) -> Option<u64> {
        match self.setup.submit(job) {
            Ok(ticket) => Some(ticket),
            Err(e) => {
                warn!(error = %e, "apex-preload sets up on the program's threads");
                self.config.setup = Mode::Inline;
                None
            }
        }
    }

    /// Asks for as many queues of context `ci` as the streams waiting for one need, plus
    /// [`queues_ahead`](super::Config::queues_ahead) ready for the next new streams, within `APEX_PRELOAD_QUEUES`.
    pub(super) fn top_up(&mut self, ci: usize) {
        if self.config.setup != Mode::Background {
            return;
        }
        let options = self.queue_options();
        let max = self.config.max_queues;
        loop {
            let ctx = &self.contexts[ci];
            if ctx.queue_failed.is_some() {
                return;
            }
            let room = max.saturating_sub(ctx.order.live());
            let want = (ctx.wanted.len() + self.config.queues_ahead).min(room);
            if ctx.spare.len() + ctx.building >= want {
                return;
            }
            let job = Job::Queue {
                ctx: ctx.handle,
                gpu: ctx.gpu.clone(),
                options,
            };
            if self.request(job).is_none() {
                return;
            }
            self.contexts[ci].building += 1;
        }
    }

    /// Takes what the set-up worker finished.
    pub(super) fn collect(&mut self) {
        for done in self.setup.take() {
            self.adopt_piece(done);
        }
    }

    fn adopt_piece(&mut self, done: Done) {
        let Done {
            ctx: handle,
            ticket,
            took,
            outcome,
        } = done;
        let ci = self.contexts.iter().position(|c| c.handle == handle);
        match outcome {
            Outcome::Attached { result, first } => {
                self.summary.setup.attach.add(took);
                if result.is_ok() {
                    self.takeover.attach_took(took);
                }
                if self.attaching.get(&handle) != Some(&ticket) {
                    self.summary.setup.dropped += 1;
                    return;
                }
                self.attaching.remove(&handle);
                if result.is_err() {
                    self.summary.setup.failed += 1;
                }
                if let Ok(ci) = self.adopt(handle, result, first) {
                    info!(
                        ctx = format_args!("{handle:#x}"),
                        took_ms = took.as_secs_f64() * 1e3,
                        "attached in the background: launches in this context go through APEX from now on"
                    );
                    self.top_up(ci);
                }
            }
            Outcome::Queue(result) => {
                self.summary.setup.queue.add(took);
                if result.is_ok() {
                    self.takeover.queue_took(took);
                }
                let Some(ci) = ci else {
                    self.summary.setup.dropped += 1;
                    return;
                };
                let ctx = &mut self.contexts[ci];
                ctx.building = ctx.building.saturating_sub(1);
                match result {
                    Ok(q) => {
                        ctx.spare.push(q);
                        self.summary.queues += 1;
                    }
                    Err(e) => {
                        warn!(error = %e, "an APEX queue could not be built: new streams stay on libcuda");
                        self.summary.setup.failed += 1;
                        ctx.queue_failed = Some(Refusal::QueueFailed(e));
                        ctx.wanted.clear();
                    }
                }
            }
            Outcome::Module {
                owner,
                result,
                placing,
            } => {
                self.summary.setup.module.add(took);
                let Some(ci) =
                    ci.filter(|&ci| self.contexts[ci].loading.get(&owner) == Some(&ticket))
                else {
                    // Unloaded (or its handle loaded again) while it loaded: a later launch asks again.
                    self.summary.setup.dropped += 1;
                    return;
                };
                // Only a load still wanted (its image is the registry's) and done prices later ones.
                if result.is_ok()
                    && let Some(image) = self.registry.image(owner)
                {
                    // CUDA's loading of its own instance is not APEX's price (as inline).
                    self.takeover
                        .module_took(image.bytes().len(), took.saturating_sub(placing));
                }
                self.contexts[ci].loading.remove(&owner);
                if result.is_err() {
                    self.summary.setup.failed += 1;
                }
                let _ = self.module_loaded(ci, owner, result);
            }
        }
    }

    /// Before the program unloads module or library `handle`: a load of it the set-up worker has queued is dropped,
    /// and one it is running is waited for (up to `setup_bound`), so that the worker never asks libcuda about a
    /// module libcuda is freeing. The load is forgotten: its result, if any, is dropped when it comes back, and a
    /// launch asks again if the unload fails.
    pub(crate) fn unloading(&mut self, handle: usize) {
        let Some(owner) = self.registry.owner(handle) else {
            return;
        };
        for ci in 0..self.contexts.len() {
            let Some(ticket) = self.contexts[ci].loading.remove(&owner) else {
                continue;
            };
            if self.setup.withdraw(ticket, self.setup_bound) == Withdrawn::StillRunning {
                warn!(
                    owner = format_args!("{owner:#x}"),
                    "a module is unloaded while APEX still loads it"
                );
            }
        }
    }

    /// Stops the set-up worker (the end of the process or of a context): the piece in flight is waited for, up to
    /// `setup_bound`, and every finished piece not taken yet is dropped here, before the contexts go.
    pub(super) fn stop_setup(&mut self) {
        if !self.setup.quiesce(self.setup_bound) {
            warn!(
                bound_s = self.setup_bound.as_secs_f64(),
                "a set-up piece is still running at the end: abandoned"
            );
        }
        for done in self.setup.take() {
            self.summary.setup.dropped += 1;
            if let Outcome::Attached { result, .. } = &done.outcome {
                // Ready only after the program's last launch: no launch of the context went through APEX.
                self.summary.attach = match result {
                    Ok(_) => "direct (ready only after the last launch)".into(),
                    Err(e) => Refusal::AttachFailed(e.clone()).to_string(),
                };
            }
            drop(done);
        }
        self.attaching.clear();
        for c in &mut self.contexts {
            c.loading.clear();
            c.building = 0;
            c.wanted.clear();
        }
    }
}
